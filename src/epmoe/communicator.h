// What expert parallelism needs from a transport, and no more: a fixed-size all-to-all for the
// count exchange, a variable all-to-all of byte buffers for the payload, a max-all-reduce and a
// barrier. Implementations: mock ranks (threads, comm/mock_comm), MPI (comm/mpi_comm), NCCL
// (comm/nccl_comm, device buffers on a stream).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace epmoe {

enum class MemorySpace { host, device };

// One buffer pair of a variable all-to-all. All vectors have world_size entries, in bytes.
// Block p of send goes to peer p; block p of recv comes from peer p.
struct AlltoallvPlane {
  const void* send = nullptr;
  void* recv = nullptr;
  std::vector<size_t> send_bytes, send_offsets;
  std::vector<size_t> recv_bytes, recv_offsets;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual std::string name() const = 0;  // "mock", "mpi", "nccl"
  // Where the buffers of alltoall_i64 / alltoallv must live.
  virtual MemorySpace memory_space() const = 0;

  // send and recv hold world_size * count int64 each; block p of send goes to peer p.
  virtual void alltoall_i64(const int64_t* send, int64_t* recv, size_t count) = 0;
  // All planes are exchanged together (one group for NCCL). Every rank must pass the same number
  // of planes with consistent sizes: recv_bytes[p] here == send_bytes[me] on peer p.
  virtual void alltoallv(std::span<const AlltoallvPlane> planes) = 0;
  // In place on host memory, whatever memory_space() says.
  virtual void allreduce_max_i64(int64_t* values, size_t count) = 0;
  virtual void barrier() = 0;

  // Device backends: the stream the caller's work is ordered on (a cudaStream_t). The collectives
  // above are ordered after work already queued on it, and work queued on it afterwards runs after
  // them. Host backends ignore it.
  virtual void set_stream(void* /*cuda_stream*/) {}
  virtual void* stream() const { return nullptr; }
  // Device backends: waits on the host for the work queued so far on `cuda_stream` (a cudaStream_t),
  // with the backend's failure detection (NCCL: a dead or stalled peer raises Error(timeout /
  // comm_error) instead of hanging). Device backends must override it; host backends queue no device
  // work, so theirs does nothing.
  virtual void host_wait(void* /*cuda_stream*/, const char* /*what*/) {}
};

// Mock ranks: world_size communicators for threads of one process (comm/mock_comm.cpp).
// Collectives block until every rank arrived or the deadline passed (then Error(timeout)).
std::vector<std::shared_ptr<Communicator>> make_mock_world(int world_size, double deadline_seconds = 60.0);

}  // namespace epmoe
