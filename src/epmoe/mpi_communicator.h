// The MPI communicator: host buffers, MPI_Alltoall / MPI_Alltoallv (comm/mpi_comm.cpp).
#pragma once
#include <mpi.h>

#include <memory>

#include "epmoe/communicator.h"

namespace epmoe {

// Wraps (duplicates) `comm`; MPI must be initialized and stay so while the communicator lives.
// Every collective is nonblocking underneath and polled under `deadline_seconds`: a rank that stalls
// makes the others raise Error(timeout) instead of waiting forever, after which the communicator
// refuses every further call (its abandoned requests may still complete into their buffers, so the
// caller should stop using them and shut down). A rank that dies is mpirun's to handle: it ends the
// job.
std::shared_ptr<Communicator> make_mpi_communicator(MPI_Comm comm = MPI_COMM_WORLD, double deadline_seconds = 300.0);

}  // namespace epmoe
