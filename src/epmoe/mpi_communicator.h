// The MPI communicator: host buffers, MPI_Alltoall / MPI_Alltoallv (comm/mpi_comm.cpp).
#pragma once
#include <mpi.h>

#include <memory>

#include "epmoe/communicator.h"

namespace epmoe {

// Wraps (duplicates) `comm`; MPI must be initialized and stay so while the communicator lives.
std::shared_ptr<Communicator> make_mpi_communicator(MPI_Comm comm = MPI_COMM_WORLD);

}  // namespace epmoe
