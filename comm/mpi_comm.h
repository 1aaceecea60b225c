// The MPI communicator (make_mpi_communicator, declared in epmoe/mpi_communicator.h): host
// buffers over a duplicate of the caller's MPI communicator, with MPI_ERRORS_RETURN so every MPI
// failure becomes an epmoe::Error(comm_error) carrying MPI_Error_string, and a collective that a
// stalled peer keeps from completing raises Error(timeout) after the deadline (every wait polls).
//
// alltoallv moves each block with MPI_Isend/MPI_Irecv in chunks of at most the chunk size below,
// so blocks and offsets beyond INT_MAX bytes (MPI's int counts) need no special datatype. Before
// the payload, ranks exchange and check their byte counts (two small collectives), so
// inconsistent sizes raise the same Error(comm_error) on every rank instead of a hang.
#pragma once
#include <cstddef>

#include "epmoe/mpi_communicator.h"

namespace epmoe {

// Largest message alltoallv posts: 1 GiB, below INT_MAX.
inline constexpr size_t kMpiDefaultMaxChunkBytes = size_t(1) << 30;

// Tests only: forces a smaller chunk so the multi-chunk path runs on small buffers. 0 restores the
// default. Values above INT_MAX are rejected with Error(invalid_argument). Process-wide; every rank
// must use the same value (they compute the same chunking independently).
void mpi_comm_set_max_chunk_bytes_for_testing(size_t bytes);
size_t mpi_comm_max_chunk_bytes();

}  // namespace epmoe
