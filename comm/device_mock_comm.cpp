// Mock ranks on one GPU (make_device_mock_world, comm/mock_comm.h): the host mock's rendezvous
// (comm/mock_world.h) with device buffers. One alltoallv is two rounds:
//
//   1. each rank records `ready` on its stream and arrives; each then queues, on its own stream,
//      a wait for every sender's `ready` and the copies of its blocks out of the senders' buffers,
//      records `done`, and departs;
//   2. a barrier round, then each rank's stream waits for every peer's `done` (its send buffers are
//      free again only when the peers' copies out of them have run), and departs.
//
// The second round keeps the `done` events still: no rank records them again before every rank
// has queued its waits. CUDA failures inside a round are held until it completes (a throw there
// would leave the peers in `depart`, which has no deadline).
#include <cuda_runtime.h>

#include <memory>
#include <vector>

#include "comm/mock_comm.h"
#include "comm/mock_world.h"
#include "ep_protocol.h"

namespace epmoe {
namespace {

using mock::Arrival;
using mock::Collective;
using mock::MockWorld;

void check_cuda(cudaError_t e, int rank, const char* what) {
  if (e != cudaSuccess)
    EPMOE_FAIL(ErrorCode::comm_error, "device mock rank ", rank, ": ", what, ": ", cudaGetErrorString(e));
}

class DeviceMockCommunicator final : public Communicator, public mock::MockRank {
 public:
  DeviceMockCommunicator(std::shared_ptr<MockWorld> world, int rank, int device)
      : world_(std::move(world)), rank_(rank), device_(device) {
    int prev = 0;
    check_cuda(cudaGetDevice(&prev), rank_, "cudaGetDevice");
    check_cuda(cudaSetDevice(device_), rank_, "cudaSetDevice");
    check_cuda(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), rank_, "cudaEventCreate");
    check_cuda(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), rank_, "cudaEventCreate");
    cudaSetDevice(prev);
  }
  ~DeviceMockCommunicator() override {
    cudaEventDestroy(ready_);
    cudaEventDestroy(done_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_->size(); }
  std::string name() const override { return "device-mock"; }
  MemorySpace memory_space() const override { return MemorySpace::device; }
  void set_stream(void* s) override { stream_ = static_cast<cudaStream_t>(s); }
  void* stream() const override { return stream_; }

  void alltoall_i64(const int64_t* send, int64_t* recv, size_t count) override {
    const std::vector<int64_t> one(size_t(world_size()), 1);
    const AlltoallvPlane p = protocol::make_plane(send, recv, one, one, count * sizeof(int64_t));
    alltoallv(std::span<const AlltoallvPlane>(&p, 1));
  }

  void alltoallv(std::span<const AlltoallvPlane> planes) override {
    const int W = world_size();
    check_cuda(cudaSetDevice(device_), rank_, "cudaSetDevice");
    check_cuda(cudaEventRecord(ready_, stream_), rank_, "cudaEventRecord");
    Arrival mine{Collective::alltoallv, nullptr, nullptr, 0, planes, ready_};
    std::vector<cudaEvent_t> peer_done(static_cast<size_t>(W));
    cudaError_t err = cudaSuccess;
    auto keep = [&](cudaError_t e) {
      if (err == cudaSuccess) err = e;
    };
    {
      const std::vector<Arrival>& all = world_->arrive(rank_, mine);
      for (int p = 0; p < W; ++p) {
        bool any = false;
        for (const AlltoallvPlane& pl : planes) any = any || pl.recv_bytes[p] > 0;
        if (!any) continue;
        if (p != rank_) keep(cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(all[p].ready_event), 0));
        for (size_t i = 0; i < planes.size(); ++i) {
          const size_t n = planes[i].recv_bytes[p];
          if (n == 0) continue;
          const AlltoallvPlane& theirs = all[p].planes[i];
          keep(cudaMemcpyAsync(static_cast<char*>(planes[i].recv) + planes[i].recv_offsets[p],
                               static_cast<const char*>(theirs.send) + theirs.send_offsets[rank_], n,
                               cudaMemcpyDeviceToDevice, stream_));
        }
      }
      keep(cudaEventRecord(done_, stream_));
      world_->depart();
    }
    // Round 2: everyone's `done` is recorded; queue the waits before anyone records it again.
    Arrival bar{Collective::barrier, nullptr, nullptr, 0, {}, done_};
    const std::vector<Arrival>& all = world_->arrive(rank_, bar);
    for (int p = 0; p < W; ++p) peer_done[size_t(p)] = static_cast<cudaEvent_t>(all[p].ready_event);
    for (int p = 0; p < W; ++p)
      if (p != rank_) keep(cudaStreamWaitEvent(stream_, peer_done[size_t(p)], 0));
    world_->depart();
    check_cuda(err, rank_, "alltoallv");
  }

  // Host memory, as the host mock.
  void allreduce_max_i64(int64_t* values, size_t count) override {
    mock::allreduce_max_i64(*world_, rank_, values, count);
  }
  void barrier() override { mock::barrier(*world_, rank_); }

  void host_wait(void* s, const char* what) override {
    check_cuda(cudaStreamSynchronize(static_cast<cudaStream_t>(s)), rank_, what);
  }

  MockWorld& world() override { return *world_; }

 private:
  std::shared_ptr<MockWorld> world_;
  int rank_, device_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr, done_ = nullptr;
};

}  // namespace

std::vector<std::shared_ptr<Communicator>> make_device_mock_world(int world_size, int device, double deadline_seconds) {
  EPMOE_CHECK(world_size >= 1 && world_size <= 64, ErrorCode::invalid_argument,
              "make_device_mock_world: world_size must be in [1, 64], got ", world_size);
  EPMOE_CHECK(deadline_seconds > 0, ErrorCode::invalid_argument, "make_device_mock_world: deadline_seconds ",
              deadline_seconds);
  auto world = std::make_shared<MockWorld>(world_size, deadline_seconds);
  std::vector<std::shared_ptr<Communicator>> comms;
  for (int r = 0; r < world_size; ++r) comms.push_back(std::make_shared<DeviceMockCommunicator>(world, r, device));
  return comms;
}

}  // namespace epmoe
