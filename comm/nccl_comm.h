// The NCCL communicator, internal side (the public entry points are in epmoe/nccl_communicator.h).
//
// Streams: the caller's stream (set_stream) orders our work with the caller's (every collective,
// also allreduce_max_i64 / barrier, records an event on it, so it must stay alive while set; the GPU
// engine sets it for one forward and puts the previous one back); the NCCL operations
// themselves run on a dedicated non-blocking communication stream, so they overlap work on other
// streams. Each collective: event on the caller stream -> comm stream waits -> NCCL (and copies) on
// the comm stream -> event on the comm stream -> caller stream waits.
//
// Watchdog: NCCL has no timeout of its own, and a dead or stalled peer leaves a kernel spinning
// forever. So every host wait here polls (CUDA query + ncclCommGetAsyncError) under a deadline,
// and on an error or an expired deadline aborts the NCCL communicator and throws
// Error(comm_error / timeout). An aborted communicator refuses all later work (comm_error).
//
// Borrowed communicators are aborted too when the watchdog fires: a communicator stuck in a
// collective is unusable anyway, and aborting is the only way to release the spinning kernel.
// After such an error the caller must NOT use or destroy its ncclComm_t again (ncclCommAbort freed
// it); aborted() says so.
#pragma once
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "epmoe/build_config.h"
#include "epmoe/communicator.h"
#include "epmoe/nccl_communicator.h"

namespace epmoe {

class NcclCommunicator final : public Communicator {
 public:
  // Takes `comm` as ncclCommInitRankConfig returned it: it may still be initializing (nonblocking),
  // so the caller calls wait_ready() next. `owned`: finalized and destroyed here. The current CUDA
  // device must be `device`.
  NcclCommunicator(ncclComm_t comm, bool owned, int rank, int world, int device, double deadline_seconds);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string name() const override { return "nccl"; }
  MemorySpace memory_space() const override { return MemorySpace::device; }

  void alltoall_i64(const int64_t* send, int64_t* recv, size_t count) override;
  void alltoallv(std::span<const AlltoallvPlane> planes) override;
  void allreduce_max_i64(int64_t* values, size_t count) override;
  void barrier() override;

  void set_stream(void* cuda_stream) override { caller_ = static_cast<cudaStream_t>(cuda_stream); }
  void* stream() const override { return caller_; }

  // Polls ncclCommGetAsyncError until the last NCCL call is no longer in progress (nonblocking
  // communicators return ncclInProgress from any call). Aborts and throws on an error or when the
  // deadline passes.
  void wait_ready(const char* what);
  // Host wait, with the watchdog, for everything queued so far on the caller stream / on `stream`.
  void synchronize(const char* what) { host_wait_stream(caller_, what); }
  void host_wait_stream(cudaStream_t stream, const char* what);
  void host_wait(void* cuda_stream, const char* what) override {
    host_wait_stream(static_cast<cudaStream_t>(cuda_stream), what);
  }
  // ncclCommAbort now (also when borrowed); later collectives throw Error(comm_error).
  void abort();

  bool aborted() const { return comm_ == nullptr; }
  bool owned() const { return owned_; }
  int device() const { return device_; }
  double deadline_seconds() const { return deadline_s_; }
  ncclComm_t nccl_comm() const { return comm_; }
  cudaStream_t comm_stream() const { return comm_stream_; }

 private:
  // Collective prologue / epilogue: the comm stream waits for the caller stream, and the caller
  // stream for the comm stream.
  void order_after_caller(const char* what);
  void order_caller_after(const char* what);
  void ensure_usable(const char* what) const;
  // After an NCCL call outside a group: ncclInProgress -> wait_ready, an error -> throw.
  void check_call(ncclResult_t r, const char* what);
  // Returns the communicator's async state (ncclSuccess or ncclInProgress); aborts and throws on
  // an error.
  ncclResult_t poll_async_error(const char* what);
  void check_deadline(double started_s, const char* what);
  // Host wait on `event` if not null, else on `stream`.
  void wait_on(cudaEvent_t event, cudaStream_t stream, const char* what);
  void allreduce_max_host(int64_t* values, size_t count, const char* what);
  void ensure_scratch(size_t count);
  void finalize_and_destroy() noexcept;
  void release_cuda_resources() noexcept;

  ncclComm_t comm_ = nullptr;  // null once aborted or destroyed
  bool owned_ = false;
  int rank_ = 0, world_ = 1, device_ = 0;
  double deadline_s_ = 300.0;
  cudaStream_t caller_ = nullptr;       // the caller's stream (null: legacy default stream)
  cudaStream_t comm_stream_ = nullptr;  // ours, non-blocking
  cudaEvent_t caller_ready_ = nullptr;  // recorded on caller_, waited on by comm_stream_
  cudaEvent_t comm_done_ = nullptr;     // recorded on comm_stream_, waited on by caller_ / the host
  // allreduce_max_i64 works on host memory: pinned staging (so the device-to-host copy never blocks
  // the host outside the watchdog) and a device buffer for NCCL.
  int64_t* scratch_dev_ = nullptr;
  int64_t* scratch_host_ = nullptr;
  size_t scratch_capacity_ = 0;  // in int64 words
};


// Aborts the NCCL communicator behind `comm` (Error(invalid_argument) if it is not one): for
// tearing down after a fatal error, and for tests that simulate a dead peer.
void nccl_abort(Communicator& comm);

#if EPMOE_WITH_MPI
// select_local_device() with the MPI fallback (the rank within a shared-memory split) taken over
// `node_scope` instead of MPI_COMM_WORLD: collective over `node_scope` when it is reached.
int select_local_device_for(MPI_Comm node_scope);
#endif

}  // namespace epmoe
