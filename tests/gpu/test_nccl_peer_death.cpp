// A peer that loses its NCCL state mid-job, under mpirun -np 2: rank 1 aborts its communicator
// (as a crashed or torn-down process would leave it) and rank 0's next collective must fail with
// Error(timeout or comm_error) within its deadline instead of hanging.
//
// Why not let rank 1 exit: Open MPI kills the whole job when a rank leaves without MPI_Finalize, so
// the survivor's error could never be observed. Rank 1 stays in MPI and only its NCCL side dies.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "comm/nccl_comm.h"
#include "epmoe/error.h"
#include "epmoe/nccl_communicator.h"
#include "gpu/nccl_test_util.h"

namespace epmoe {
namespace {

using nccl_test::DeviceBuffer;
using nccl_test::NcclTest;
using nccl_test::seconds_since;

constexpr double kDeadline = 4.0;

// `op` runs one collective and waits for it on the host (through the communicator's watchdog).
void expect_failure_after_peer_death(int rank, const std::function<void(Communicator&)>& op) {
  NcclCommOptions opt;
  opt.deadline_seconds = kDeadline;
  auto comm = make_nccl_communicator_from_mpi(MPI_COMM_WORLD, opt);
  op(*comm);  // warm-up on both ranks: the connections of this collective exist before the death
  if (rank == 1) nccl_abort(*comm);
  MPI_Barrier(MPI_COMM_WORLD);  // rank 0 starts only once its peer's NCCL state is gone

  if (rank == 0) {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      op(*comm);
      ADD_FAILURE() << "the collective completed although rank 1 had aborted its communicator";
    } catch (const Error& e) {
      std::printf("rank 0 got, as expected after %.1f s: %s\n", seconds_since(t0), e.what());
      EXPECT_TRUE(e.code() == ErrorCode::timeout || e.code() == ErrorCode::comm_error)
          << error_code_name(e.code()) << ": " << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "unexpected exception: " << e.what();
    }
    const double elapsed = seconds_since(t0);
    EXPECT_LT(elapsed, kDeadline + 3.0);
    EXPECT_TRUE(static_cast<NcclCommunicator&>(*comm).aborted());
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

using NcclPeerDeath = NcclTest;

TEST_F(NcclPeerDeath, BarrierFailsWithinTheDeadline) {
  expect_failure_after_peer_death(rank_, [](Communicator& c) { c.barrier(); });
}

TEST_F(NcclPeerDeath, AlltoallFailsWithinTheDeadline) {
  DeviceBuffer send(world_ * 4 * sizeof(int64_t)), recv(world_ * 4 * sizeof(int64_t));
  EXPECT_EQ(cudaMemset(send.get(), 0, send.bytes()), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // (cudaMemset returns before it is done)
  expect_failure_after_peer_death(rank_, [&](Communicator& c) {
    c.alltoall_i64(send.get<int64_t>(), recv.get<int64_t>(), 4);
    c.host_wait(c.stream(), "alltoall_i64 after peer death");  // where the engine waits
  });
}

TEST_F(NcclPeerDeath, AlltoallvFailsWithinTheDeadline) {
  const int world = world_;
  constexpr size_t kBytes = 4096;
  DeviceBuffer send(world * kBytes), recv(world * kBytes);
  AlltoallvPlane plane;
  plane.send = send.get();
  plane.recv = recv.get();
  for (int p = 0; p < world; ++p) {
    plane.send_bytes.push_back(kBytes);
    plane.send_offsets.push_back(p * kBytes);
    plane.recv_bytes.push_back(kBytes);
    plane.recv_offsets.push_back(p * kBytes);
  }
  expect_failure_after_peer_death(rank_, [&](Communicator& c) {
    c.alltoallv(std::span<const AlltoallvPlane>(&plane, 1));
    c.host_wait(c.stream(), "alltoallv after peer death");
  });
}

}  // namespace
}  // namespace epmoe
