// The NCCL communicator: device buffers, ordered on a CUDA stream (comm/nccl_comm.cpp).
//
// Two ways in, as trainers expect: bootstrap a new NCCL communicator over MPI (unique id
// broadcast), or borrow the caller's ncclComm_t (the caller keeps ownership). Bootstrapped
// communicators are nonblocking: waits poll ncclCommGetAsyncError under `deadline_seconds` and,
// when a peer dies or stalls, abort the communicator and raise Error(timeout / comm_error) instead
// of hanging.
#pragma once
#include <nccl.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "epmoe/build_config.h"
#include "epmoe/communicator.h"
#if EPMOE_WITH_MPI
#include <mpi.h>
#endif

namespace epmoe {

struct NcclCommOptions {
  int device = -1;                 // CUDA device; -1: select_local_device()
  double deadline_seconds = 300.0; // how long a host wait on a collective may take
};

#if EPMOE_WITH_MPI
// Collective over `mpi_comm`: one rank per GPU. Sets the current device.
std::shared_ptr<Communicator> make_nccl_communicator_from_mpi(MPI_Comm mpi_comm, const NcclCommOptions& opt = {});
#endif
// Bootstrap through any channel the caller has (a torch.distributed broadcast, a file): rank 0 makes
// the NCCL unique id (its bytes), every rank of the world passes the same bytes with its rank.
// Collective over that world. Sets the current device.
std::vector<uint8_t> make_nccl_unique_id();
std::shared_ptr<Communicator> make_nccl_communicator_from_unique_id(const std::vector<uint8_t>& id, int rank,
                                                                    int world, const NcclCommOptions& opt = {});
// Borrow: `comm` stays the caller's (never destroyed here) and must outlive the communicator.
std::shared_ptr<Communicator> make_nccl_communicator_borrowed(ncclComm_t comm, const NcclCommOptions& opt = {});
// One rank, one GPU, no MPI: single-GPU runs and tests.
std::shared_ptr<Communicator> make_nccl_communicator_single(const NcclCommOptions& opt = {});

// The device for this process: LOCAL_RANK, else OMPI_COMM_WORLD_LOCAL_RANK, else (with MPI
// initialized) the rank in an MPI_COMM_TYPE_SHARED split, else 0. Checked against the device count
// (Error(invalid_config) naming the variable when out of range).
int select_local_device();

}  // namespace epmoe
