// The NCCL communicator under mpirun -np 2, one rank per GPU: exchanges checked byte for byte,
// stream ordering, the borrowed path, device selection, and the watchdog (a stalled peer must
// raise Error(timeout) within the deadline instead of hanging). Skips without the GPUs.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <thread>
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

// ---- alltoallv checking: every byte says which plane, source, destination and position it is --

using BytesFn = size_t (*)(int plane, int src, int dst);

uint8_t pattern(int plane, int src, int dst, size_t i) {
  return static_cast<uint8_t>((plane * 67 + src * 29 + dst * 13 + i) % 251);
}
constexpr uint8_t kSendPad = 0xAB;  // between send blocks: must never arrive anywhere
constexpr uint8_t kUntouched = 0xEE;  // recv bytes outside every block: must stay as they are

// Block offsets with `pad` bytes after each block; returns the total size.
size_t layout(const std::vector<size_t>& bytes, size_t pad, std::vector<size_t>& offsets) {
  offsets.assign(bytes.size(), 0);
  size_t at = 0;
  for (size_t p = 0; p < bytes.size(); ++p) {
    offsets[p] = at;
    at += bytes[p] + pad;
  }
  return at;
}

// Runs one alltoallv of `planes` planes on `stream` and checks every received byte, the gaps too.
void check_alltoallv(Communicator& comm, int planes, BytesFn bytes, size_t pad, cudaStream_t stream) {
  const int me = comm.rank(), world = comm.world_size();
  std::vector<AlltoallvPlane> pl(planes);
  std::vector<std::unique_ptr<DeviceBuffer>> send_buf, recv_buf;
  std::vector<std::vector<uint8_t>> expected(planes);
  for (int k = 0; k < planes; ++k) {
    AlltoallvPlane& p = pl[k];
    for (int q = 0; q < world; ++q) {
      p.send_bytes.push_back(bytes(k, me, q));
      p.recv_bytes.push_back(bytes(k, q, me));
    }
    const size_t send_total = layout(p.send_bytes, pad, p.send_offsets);
    const size_t recv_total = layout(p.recv_bytes, pad, p.recv_offsets);
    std::vector<uint8_t> host_send(send_total, kSendPad);
    expected[k].assign(recv_total, kUntouched);
    for (int q = 0; q < world; ++q) {
      for (size_t i = 0; i < p.send_bytes[q]; ++i) host_send[p.send_offsets[q] + i] = pattern(k, me, q, i);
      for (size_t i = 0; i < p.recv_bytes[q]; ++i) expected[k][p.recv_offsets[q] + i] = pattern(k, q, me, i);
    }
    send_buf.push_back(std::make_unique<DeviceBuffer>(std::max<size_t>(send_total, 1)));
    recv_buf.push_back(std::make_unique<DeviceBuffer>(std::max<size_t>(recv_total, 1)));
    EXPECT_EQ(cudaMemcpy(send_buf[k]->get(), host_send.data(), send_total, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemset(recv_buf[k]->get(), kUntouched, recv_buf[k]->bytes()), cudaSuccess);
    p.send = send_buf[k]->get();
    p.recv = recv_buf[k]->get();
  }
  // cudaMemcpy from pageable memory and cudaMemset return before the device has the bytes, on the
  // legacy stream, which `stream` (non-blocking) does not wait for.
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  comm.set_stream(stream);
  comm.alltoallv(pl);
  std::vector<std::vector<uint8_t>> got(planes);
  for (int k = 0; k < planes; ++k) {
    got[k].assign(expected[k].size(), 0);
    // On the caller stream: ordered after the exchange by the communicator, not by a host sync.
    EXPECT_EQ(cudaMemcpyAsync(got[k].data(), recv_buf[k]->get(), got[k].size(), cudaMemcpyDeviceToHost, stream),
              cudaSuccess);
  }
  comm.host_wait(stream, "check_alltoallv");
  for (int k = 0; k < planes; ++k) {
    size_t wrong = 0, first = 0;
    for (size_t i = 0; i < got[k].size(); ++i)
      if (got[k][i] != expected[k][i] && wrong++ == 0) first = i;
    EXPECT_EQ(wrong, 0u) << "rank " << me << " plane " << k << ": first wrong byte at " << first << " of "
                         << got[k].size();
  }
}

// Odd sizes (the byte path), zero-byte blocks (the self block of plane 0, among others), padding.
size_t uneven_bytes(int plane, int src, int dst) {
  if (plane == 0) return static_cast<size_t>((src + 2 * dst) % 3) * 11;
  return static_cast<size_t>(1 + src + 3 * dst) * 5 + 1;
}
// Multiples of 8 everywhere (the 64-bit path), about a megabyte per peer, a zero self block.
size_t aligned_bytes(int plane, int src, int dst) {
  if (plane == 0) return src == dst ? 0 : (size_t{1} << 20) + 8 * static_cast<size_t>((src + 1) * (dst + 2));
  return 64 * static_cast<size_t>(1 + src + dst);
}

class Stream {
 public:
  Stream() { EXPECT_EQ(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), cudaSuccess); }
  ~Stream() {
    if (s_) cudaStreamDestroy(s_);
  }
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

std::shared_ptr<Communicator> world_comm(double deadline_seconds = 120.0) {
  NcclCommOptions opt;
  opt.deadline_seconds = deadline_seconds;
  return make_nccl_communicator_from_mpi(MPI_COMM_WORLD, opt);
}

// ---- tests -----------------------------------------------------------------------------------

using NcclComm = NcclTest;

TEST_F(NcclComm, SingleRankCommunicator) {
  auto comm = make_nccl_communicator_single();
  EXPECT_EQ(comm->name(), "nccl");
  EXPECT_EQ(comm->world_size(), 1);
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->memory_space(), MemorySpace::device);
  const std::vector<int64_t> host = {7, -3, 1ll << 40};
  DeviceBuffer send(host.size() * 8), recv(host.size() * 8);
  EXPECT_EQ(cudaMemcpy(send.get(), host.data(), host.size() * 8, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // (as above)
  comm->alltoall_i64(send.get<int64_t>(), recv.get<int64_t>(), host.size());
  std::vector<int64_t> got(host.size());
  comm->host_wait(nullptr, "single alltoall");
  EXPECT_EQ(cudaMemcpy(got.data(), recv.get(), host.size() * 8, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(got, host);
  int64_t v[2] = {5, -9};
  comm->allreduce_max_i64(v, 2);
  EXPECT_EQ(v[0], 5);
  EXPECT_EQ(v[1], -9);
  check_alltoallv(*comm, 2, uneven_bytes, 5, nullptr);
}

TEST_F(NcclComm, AlltoallI64OrderedOnCallerStream) {
  auto comm = world_comm();
  EXPECT_EQ(comm->rank(), rank_);
  EXPECT_EQ(comm->world_size(), world_);
  constexpr size_t kCount = 5;
  std::vector<int64_t> send(world_ * kCount), got(world_ * kCount, -1);
  for (int p = 0; p < world_; ++p)
    for (size_t j = 0; j < kCount; ++j) send[p * kCount + j] = (int64_t{rank_} << 40) + p * 1000 + j;
  Stream stream;
  DeviceBuffer d_send(send.size() * 8), d_recv(send.size() * 8);
  comm->set_stream(stream.get());
  EXPECT_EQ(comm->stream(), stream.get());
  // Upload, exchange and download all queued on the caller stream: no host sync in between.
  EXPECT_EQ(cudaMemcpyAsync(d_send.get(), send.data(), send.size() * 8, cudaMemcpyHostToDevice, stream.get()),
            cudaSuccess);
  comm->alltoall_i64(d_send.get<int64_t>(), d_recv.get<int64_t>(), kCount);
  EXPECT_EQ(cudaMemcpyAsync(got.data(), d_recv.get(), got.size() * 8, cudaMemcpyDeviceToHost, stream.get()),
            cudaSuccess);
  static_cast<NcclCommunicator&>(*comm).synchronize("alltoall test");
  for (int p = 0; p < world_; ++p)
    for (size_t j = 0; j < kCount; ++j)
      EXPECT_EQ(got[p * kCount + j], (int64_t{p} << 40) + rank_ * 1000 + j) << "from rank " << p << " word " << j;
}

TEST_F(NcclComm, AlltoallvUnevenSizesWithZerosTwoPlanes) {
  auto comm = world_comm();
  Stream stream;
  check_alltoallv(*comm, 2, uneven_bytes, 5, stream.get());
  check_alltoallv(*comm, 2, uneven_bytes, 5, stream.get());  // reuses the events and stream
}

TEST_F(NcclComm, AlltoallvAlignedSizesTwoPlanes) {
  auto comm = world_comm();
  Stream stream;
  check_alltoallv(*comm, 2, aligned_bytes, 8, stream.get());
}

TEST_F(NcclComm, AlltoallvRejectsInconsistentPlanesBeforeCommunicating) {
  auto comm = world_comm();
  AlltoallvPlane bad;
  bad.send_bytes.assign(world_ + 1, 0);  // one entry too many
  bad.send_offsets.assign(world_, 0);
  bad.recv_bytes.assign(world_, 0);
  bad.recv_offsets.assign(world_, 0);
  try {
    comm->alltoallv(std::span<const AlltoallvPlane>(&bad, 1));
    ADD_FAILURE() << "a plane with world+1 send sizes was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
  }
  DeviceBuffer buf(64);
  AlltoallvPlane self_mismatch;
  self_mismatch.send = buf.get();
  self_mismatch.recv = buf.get();
  self_mismatch.send_bytes.assign(world_, 0);
  self_mismatch.send_offsets.assign(world_, 0);
  self_mismatch.recv_bytes.assign(world_, 0);
  self_mismatch.recv_offsets.assign(world_, 0);
  self_mismatch.send_bytes[rank_] = 8;
  self_mismatch.recv_bytes[rank_] = 16;
  try {
    comm->alltoallv(std::span<const AlltoallvPlane>(&self_mismatch, 1));
    ADD_FAILURE() << "a self block of 8 bytes sent and 16 expected was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
  }
  comm->barrier();  // still usable: nothing reached NCCL
}

TEST_F(NcclComm, AllreduceMaxOnHostMemory) {
  auto comm = world_comm();
  for (size_t count : {size_t{1}, size_t{5}, size_t{3000}}) {  // 3000: the scratch grows
    std::vector<int64_t> v(count);
    for (size_t i = 0; i < count; ++i)
      v[i] = (static_cast<int>(i % world_) == rank_) ? int64_t(100 + i) * (i % 2 ? -1 : 1) : -(int64_t{1} << 50);
    comm->allreduce_max_i64(v.data(), count);
    for (size_t i = 0; i < count; ++i) EXPECT_EQ(v[i], int64_t(100 + i) * (i % 2 ? -1 : 1)) << "word " << i;
  }
  int64_t ranks = rank_;
  comm->allreduce_max_i64(&ranks, 1);
  EXPECT_EQ(ranks, world_ - 1);
}

TEST_F(NcclComm, BarrierRepeatedOnACallerStream) {
  auto comm = world_comm();
  Stream stream;
  comm->set_stream(stream.get());
  for (int i = 0; i < 5; ++i) comm->barrier();
  comm->host_wait(stream.get(), "after barriers");
}

TEST_F(NcclComm, BorrowedCommunicatorStaysTheCallers) {
  const int device = select_local_device();
  EXPECT_EQ(cudaSetDevice(device), cudaSuccess);
  ncclUniqueId id{};
  if (rank_ == 0) EXPECT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
  ncclComm_t raw = nullptr;
  ASSERT_EQ(ncclCommInitRank(&raw, world_, id, rank_), ncclSuccess) << ncclGetLastError(nullptr);
  {
    auto comm = make_nccl_communicator_borrowed(raw);
    EXPECT_EQ(comm->name(), "nccl");
    EXPECT_EQ(comm->rank(), rank_);
    EXPECT_EQ(comm->world_size(), world_);
    Stream stream;
    check_alltoallv(*comm, 2, uneven_bytes, 5, stream.get());
    comm->barrier();
    int count = 0;
    cudaGetDeviceCount(&count);
    if (count >= 2) {  // the current device must be the communicator's
      EXPECT_EQ(cudaSetDevice((device + 1) % count), cudaSuccess);
      try {
        make_nccl_communicator_borrowed(raw);
        ADD_FAILURE() << "borrowing from the wrong current device was accepted";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
      }
      EXPECT_EQ(cudaSetDevice(device), cudaSuccess);
    }
  }  // the wrapper is gone; `raw` must still be alive and ours
  int n = 0;
  EXPECT_EQ(ncclCommCount(raw, &n), ncclSuccess);
  EXPECT_EQ(n, world_);
  EXPECT_EQ(ncclCommDestroy(raw), ncclSuccess);
}

// Restores one environment variable when the test ends.
class EnvRestore {
 public:
  explicit EnvRestore(const char* name) : name_(name) {
    if (const char* v = std::getenv(name)) old_ = v;
  }
  ~EnvRestore() {
    if (old_)
      setenv(name_, old_->c_str(), 1);
    else
      unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST_F(NcclComm, SelectLocalDeviceFromTheEnvironment) {
  EnvRestore restore("LOCAL_RANK");
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);

  setenv("LOCAL_RANK", "0", 1);
  EXPECT_EQ(select_local_device(), 0);
  setenv("LOCAL_RANK", std::to_string(count - 1).c_str(), 1);
  EXPECT_EQ(select_local_device(), count - 1);

  const std::string too_big = std::to_string(count + 3);
  setenv("LOCAL_RANK", too_big.c_str(), 1);
  try {
    select_local_device();
    ADD_FAILURE() << "LOCAL_RANK=" << too_big << " was accepted with " << count << " devices";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_config);
    const std::string want = "LOCAL_RANK=" + too_big + " but only " + std::to_string(count) + " CUDA devices are visible";
    EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
  }

  setenv("LOCAL_RANK", "1x", 1);
  try {
    select_local_device();
    ADD_FAILURE() << "LOCAL_RANK=1x was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_config);
    EXPECT_NE(std::string(e.what()).find("LOCAL_RANK='1x'"), std::string::npos) << e.what();
  }

  // Without LOCAL_RANK, Open MPI's variable decides (mpirun sets it).
  unsetenv("LOCAL_RANK");
  if (const char* ompi = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK")) EXPECT_EQ(select_local_device(), std::atoi(ompi));
}

TEST_F(NcclComm, AbortedCommunicatorRefusesWork) {
  auto comm = world_comm();
  comm->barrier();
  nccl_abort(*comm);  // every rank aborts its own: nothing is left waiting
  EXPECT_TRUE(static_cast<NcclCommunicator&>(*comm).aborted());
  try {
    comm->barrier();
    ADD_FAILURE() << "an aborted communicator ran a barrier";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::comm_error) << e.what();
  }
}

// Keep this test LAST: it aborts a communicator on rank 0 while rank 1 is away.
TEST_F(NcclComm, DeadlineTurnsAStalledPeerIntoTimeout) {
  constexpr double kDeadline = 3.0;
  auto comm = world_comm(kDeadline);
  comm->barrier();  // warm-up on both ranks: connections exist, so only the stall is timed
  if (rank_ == 0) {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      comm->barrier();  // rank 1 never joins this one
      ADD_FAILURE() << "barrier returned although rank 1 never entered it";
    } catch (const Error& e) {
      std::printf("rank 0 got, as expected: %s\n", e.what());
      EXPECT_EQ(e.code(), ErrorCode::timeout) << e.what();
      EXPECT_NE(std::string(e.what()).find("did not complete within"), std::string::npos) << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "unexpected exception: " << e.what();
    }
    const double elapsed = seconds_since(t0);
    EXPECT_GE(elapsed, kDeadline - 0.5);
    EXPECT_LT(elapsed, 7.0);
    EXPECT_TRUE(static_cast<NcclCommunicator&>(*comm).aborted());
  } else {
    std::this_thread::sleep_for(std::chrono::seconds(8));  // a stalled peer, not a dead process
  }
  MPI_Barrier(MPI_COMM_WORLD);
  comm.reset();  // rank 1: finalize (bounded by the deadline); rank 0: already aborted

  // A fresh communicator works after the abort.
  auto fresh = world_comm();
  int64_t top = rank_;
  fresh->allreduce_max_i64(&top, 1);
  EXPECT_EQ(top, world_ - 1);
  fresh->barrier();
}

}  // namespace
}  // namespace epmoe
