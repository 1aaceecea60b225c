// The NCCL communicator: collectives on a dedicated stream, host waits under a watchdog, and the
// three ways to get one (bootstrap over MPI, single GPU, borrow). See nccl_comm.h for the design.
#include "comm/nccl_comm.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "epmoe/error.h"
#include "kernels/cuda_check.cuh"

namespace epmoe {
namespace {

double now_seconds() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

// Poll pacing for host waits: a short spin (with yields) keeps small collectives at microsecond
// latency; after that, sleeps growing to 1 ms keep a long wait from burning a core.
class Backoff {
 public:
  void pause() {
    if (++polls_ < kSpinPolls) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(sleep_us_));
    sleep_us_ = std::min(sleep_us_ * 2, 1000);
  }

 private:
  static constexpr int kSpinPolls = 2000;
  int polls_ = 0;
  int sleep_us_ = 50;
};

// Makes `device` current for the scope: callers may use us from a thread whose current device is
// another one (a framework thread, a fresh thread that defaults to device 0).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device_) EPMOE_CUDA_CHECK(cudaSetDevice(device_));
  }
  ~DeviceGuard() {
    if (previous_ >= 0 && previous_ != device_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_;
  int previous_ = -1;
};

const char* nccl_last_error() {
  const char* s = ncclGetLastError(nullptr);
  return (s && *s) ? s : "(no details)";
}

[[noreturn]] void fail_nccl(ncclResult_t r, const char* what) {
  EPMOE_FAIL(ErrorCode::comm_error, what, " failed: ", ncclGetErrorString(r), ": ", nccl_last_error());
}

// NVLink multicast (NVLS) must never be used on our machines. NCCL reads the variable when it
// first initializes, so this runs before any NCCL call of ours; an explicit setting is kept.
void disable_nvls() { setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0); }

void check_options(const NcclCommOptions& opt) {
  EPMOE_CHECK(std::isfinite(opt.deadline_seconds) && opt.deadline_seconds > 0, ErrorCode::invalid_config,
              "NcclCommOptions::deadline_seconds must be a positive number of seconds, got ", opt.deadline_seconds);
}

int checked_device(int device) {
  int count = 0;
  EPMOE_CUDA_CHECK(cudaGetDeviceCount(&count));
  EPMOE_CHECK(device < count, ErrorCode::invalid_config, "NcclCommOptions::device=", device, " but only ", count,
              " CUDA devices are visible");
  return device;
}

// The widest NCCL element (8, 4 or 1 bytes) that divides every size, offset and base pointer of
// the planes: fewer, wider elements for the same bytes. (NCCL has no 2- or 16-byte integer type.)
size_t alltoallv_word_size(std::span<const AlltoallvPlane> planes) {
  uint64_t bits = 0;
  for (const AlltoallvPlane& pl : planes) {
    bits |= reinterpret_cast<uintptr_t>(pl.send) | reinterpret_cast<uintptr_t>(pl.recv);
    for (size_t v : pl.send_bytes) bits |= v;
    for (size_t v : pl.send_offsets) bits |= v;
    for (size_t v : pl.recv_bytes) bits |= v;
    for (size_t v : pl.recv_offsets) bits |= v;
  }
  if (bits % 8 == 0) return 8;
  if (bits % 4 == 0) return 4;
  return 1;
}

ncclDataType_t word_type(size_t word) {
  return word == 8 ? ncclUint64 : word == 4 ? ncclUint32 : ncclUint8;
}

void check_plane(const AlltoallvPlane& pl, size_t index, int world, int me) {
  const size_t w = static_cast<size_t>(world);
  auto check_len = [&](const std::vector<size_t>& v, const char* field) {
    EPMOE_CHECK(v.size() == w, ErrorCode::invalid_argument, "alltoallv plane ", index, ": ", field, " has ", v.size(),
                " entries, expected one per rank (", world, ")");
  };
  check_len(pl.send_bytes, "send_bytes");
  check_len(pl.send_offsets, "send_offsets");
  check_len(pl.recv_bytes, "recv_bytes");
  check_len(pl.recv_offsets, "recv_offsets");
  for (size_t p = 0; p < w; ++p) {
    EPMOE_CHECK(pl.send_bytes[p] == 0 || pl.send != nullptr, ErrorCode::invalid_argument, "alltoallv plane ", index,
                ": send is null but ", pl.send_bytes[p], " bytes go to rank ", p);
    EPMOE_CHECK(pl.recv_bytes[p] == 0 || pl.recv != nullptr, ErrorCode::invalid_argument, "alltoallv plane ", index,
                ": recv is null but ", pl.recv_bytes[p], " bytes come from rank ", p);
  }
  EPMOE_CHECK(pl.send_bytes[me] == pl.recv_bytes[me], ErrorCode::invalid_argument, "alltoallv plane ", index,
              ": rank ", me, " sends itself ", pl.send_bytes[me], " bytes but expects ", pl.recv_bytes[me]);
}

// Creates a nonblocking communicator (so that a stuck init can be timed out and aborted) and
// wraps it; returns once initialization completed.
std::shared_ptr<NcclCommunicator> init_nonblocking(const ncclUniqueId& id, int rank, int world, int device,
                                                   double deadline_seconds) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&comm, world, id, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    if (comm) ncclCommAbort(comm);
    fail_nccl(r, "ncclCommInitRankConfig");
  }
  std::shared_ptr<NcclCommunicator> c;
  try {
    c = std::make_shared<NcclCommunicator>(comm, /*owned=*/true, rank, world, device, deadline_seconds);
  } catch (...) {
    ncclCommAbort(comm);  // the constructor failed: nobody else will release the communicator
    throw;
  }
  c->wait_ready("ncclCommInitRankConfig");
  return c;
}

}  // namespace

// ---- lifetime --------------------------------------------------------------------------------

NcclCommunicator::NcclCommunicator(ncclComm_t comm, bool owned, int rank, int world, int device,
                                   double deadline_seconds)
    : comm_(comm), owned_(owned), rank_(rank), world_(world), device_(device), deadline_s_(deadline_seconds) {
  try {
    EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking));
    EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&caller_ready_, cudaEventDisableTiming));
    EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&comm_done_, cudaEventDisableTiming));
  } catch (...) {
    release_cuda_resources();  // the destructor does not run for a throwing constructor
    throw;
  }
}

NcclCommunicator::~NcclCommunicator() {
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
  if (previous != device_) cudaSetDevice(device_);
  if (comm_ != nullptr && owned_) finalize_and_destroy();
  release_cuda_resources();
  if (previous >= 0 && previous != device_) cudaSetDevice(previous);
}

// Finalize flushes our outstanding work; with a nonblocking communicator it returns ncclInProgress
// and we poll, under the deadline, so that a dead peer cannot hang a destructor. Any failure on the
// way: abort instead (never throws).
void NcclCommunicator::finalize_and_destroy() noexcept {
  ncclResult_t r = ncclCommFinalize(comm_);
  if (r == ncclInProgress) {
    const double start = now_seconds();
    Backoff backoff;
    ncclResult_t state = ncclInProgress;
    while (state == ncclInProgress && now_seconds() - start < deadline_s_) {
      if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) state = ncclInternalError;
      if (state == ncclInProgress) backoff.pause();
    }
    r = state;
  }
  if (r == ncclSuccess)
    ncclCommDestroy(comm_);
  else
    ncclCommAbort(comm_);
  comm_ = nullptr;
}

void NcclCommunicator::release_cuda_resources() noexcept {
  if (scratch_dev_) cudaFree(scratch_dev_);
  if (scratch_host_) cudaFreeHost(scratch_host_);
  if (comm_done_) cudaEventDestroy(comm_done_);
  if (caller_ready_) cudaEventDestroy(caller_ready_);
  if (comm_stream_) cudaStreamDestroy(comm_stream_);
  scratch_dev_ = nullptr;
  scratch_host_ = nullptr;
  scratch_capacity_ = 0;
  comm_done_ = caller_ready_ = nullptr;
  comm_stream_ = nullptr;
}

void NcclCommunicator::abort() {
  if (comm_ == nullptr) return;
  DeviceGuard guard(device_);
  ncclCommAbort(comm_);  // also frees it; nothing useful to do with a failure here
  comm_ = nullptr;
}

// ---- waits and the watchdog ------------------------------------------------------------------

void NcclCommunicator::ensure_usable(const char* what) const {
  EPMOE_CHECK(comm_ != nullptr, ErrorCode::comm_error, "rank ", rank_, ": ", what,
              ": the NCCL communicator was aborted after an earlier failure; create a new one");
}

ncclResult_t NcclCommunicator::poll_async_error(const char* what) {
  ncclResult_t state = ncclSuccess;
  const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
  if (r != ncclSuccess) {
    const std::string details = nccl_last_error();  // read before abort tears things down
    abort();
    EPMOE_FAIL(ErrorCode::comm_error, "rank ", rank_, ": ", what, ": ncclCommGetAsyncError failed: ",
               ncclGetErrorString(r), ": ", details, "; NCCL communicator aborted");
  }
  if (state != ncclSuccess && state != ncclInProgress) {
    const std::string details = nccl_last_error();
    abort();
    EPMOE_FAIL(ErrorCode::comm_error, "rank ", rank_, ": ", what, ": NCCL async error: ", ncclGetErrorString(state),
               ": ", details, "; NCCL communicator aborted");
  }
  return state;
}

void NcclCommunicator::check_deadline(double started_s, const char* what) {
  if (now_seconds() - started_s <= deadline_s_) return;
  abort();
  EPMOE_FAIL(ErrorCode::timeout, "rank ", rank_, ": ", what, " did not complete within ", deadline_s_,
             "s: a peer may have died or stalled; NCCL communicator aborted");
}

void NcclCommunicator::wait_ready(const char* what) {
  ensure_usable(what);
  const double start = now_seconds();
  Backoff backoff;
  while (poll_async_error(what) == ncclInProgress) {
    check_deadline(start, what);
    backoff.pause();
  }
}

void NcclCommunicator::wait_on(cudaEvent_t event, cudaStream_t stream, const char* what) {
  ensure_usable(what);
  DeviceGuard guard(device_);
  const double start = now_seconds();
  Backoff backoff;
  for (;;) {
    const cudaError_t q = event ? cudaEventQuery(event) : cudaStreamQuery(stream);
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady)
      EPMOE_FAIL(ErrorCode::cuda_error, "rank ", rank_, ": ", what, ": waiting for the GPU failed: ",
                 cudaGetErrorName(q), ": ", cudaGetErrorString(q));
    poll_async_error(what);
    check_deadline(start, what);
    backoff.pause();
  }
  // Work that finished may still have been cut short by an asynchronous NCCL failure.
  poll_async_error(what);
}

void NcclCommunicator::host_wait_stream(cudaStream_t stream, const char* what) { wait_on(nullptr, stream, what); }

void NcclCommunicator::check_call(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return;
  if (r == ncclInProgress) {
    wait_ready(what);  // nonblocking: the operation is enqueued on the stream once this returns
    return;
  }
  fail_nccl(r, what);
}

// ---- stream ordering -------------------------------------------------------------------------

void NcclCommunicator::order_after_caller(const char* what) {
  ensure_usable(what);
  EPMOE_CUDA_CHECK(cudaEventRecord(caller_ready_, caller_));
  EPMOE_CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, caller_ready_, 0));
}

// Only after every NCCL call of the operation returned ready: before that, a nonblocking
// communicator may not have put its kernel on the comm stream yet.
void NcclCommunicator::order_caller_after(const char* /*what*/) {
  EPMOE_CUDA_CHECK(cudaEventRecord(comm_done_, comm_stream_));
  EPMOE_CUDA_CHECK(cudaStreamWaitEvent(caller_, comm_done_, 0));
}

// ---- collectives -----------------------------------------------------------------------------

void NcclCommunicator::alltoall_i64(const int64_t* send, int64_t* recv, size_t count) {
  const char* what = "alltoall_i64";
  ensure_usable(what);
  if (count == 0) return;
  EPMOE_CHECK(send != nullptr && recv != nullptr, ErrorCode::invalid_argument, what, ": null buffer");
  DeviceGuard guard(device_);
  order_after_caller(what);
  check_call(ncclAlltoAll(send, recv, count, ncclInt64, comm_, comm_stream_), "ncclAlltoAll (alltoall_i64)");
  order_caller_after(what);
}

// One group for all planes and peers, so every message is in flight at once; the block a rank
// sends itself is a device-to-device copy on the comm stream, cheaper than a self send.
void NcclCommunicator::alltoallv(std::span<const AlltoallvPlane> planes) {
  const char* what = "alltoallv";
  ensure_usable(what);
  for (size_t i = 0; i < planes.size(); ++i) check_plane(planes[i], i, world_, rank_);
  DeviceGuard guard(device_);
  order_after_caller(what);

  for (const AlltoallvPlane& pl : planes) {
    const size_t n = pl.send_bytes[rank_];
    if (n == 0) continue;
    EPMOE_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(pl.recv) + pl.recv_offsets[rank_],
                                     static_cast<const char*>(pl.send) + pl.send_offsets[rank_], n,
                                     cudaMemcpyDeviceToDevice, comm_stream_));
  }

  const size_t word = alltoallv_word_size(planes);
  const ncclDataType_t type = word_type(word);
  // Inside a group NCCL only records the calls; an error there still needs ncclGroupEnd to close
  // the group, so the first one is kept and raised after it.
  ncclResult_t first_error = ncclSuccess;
  const char* first_call = nullptr;
  auto note = [&](ncclResult_t r, const char* call) {
    if (r != ncclSuccess && r != ncclInProgress && first_error == ncclSuccess) {
      first_error = r;
      first_call = call;
    }
  };
  check_call(ncclGroupStart(), "ncclGroupStart (alltoallv)");
  for (int p = 0; p < world_; ++p) {
    if (p == rank_) continue;
    for (const AlltoallvPlane& pl : planes) {
      if (pl.send_bytes[p] > 0)
        note(ncclSend(static_cast<const char*>(pl.send) + pl.send_offsets[p], pl.send_bytes[p] / word, type, p, comm_,
                      comm_stream_),
             "ncclSend (alltoallv)");
      if (pl.recv_bytes[p] > 0)
        note(ncclRecv(static_cast<char*>(pl.recv) + pl.recv_offsets[p], pl.recv_bytes[p] / word, type, p, comm_,
                      comm_stream_),
             "ncclRecv (alltoallv)");
    }
  }
  const ncclResult_t end = ncclGroupEnd();
  if (end == ncclInProgress) wait_ready("ncclGroupEnd (alltoallv)");
  if (first_error != ncclSuccess) fail_nccl(first_error, first_call);
  if (end != ncclSuccess && end != ncclInProgress) fail_nccl(end, "ncclGroupEnd (alltoallv)");
  order_caller_after(what);
}

void NcclCommunicator::ensure_scratch(size_t count) {
  if (count <= scratch_capacity_) return;
  // Only between operations, each of which the host waited for: nothing still uses the old buffers.
  // (1024 words at first: more than the usual agreement checks need, so growing, whose cudaFree
  // synchronizes the device, is rare.)
  const size_t capacity = std::max<size_t>({count, 2 * scratch_capacity_, 1024});
  if (scratch_dev_) EPMOE_CUDA_CHECK(cudaFree(scratch_dev_));
  if (scratch_host_) EPMOE_CUDA_CHECK(cudaFreeHost(scratch_host_));
  scratch_dev_ = nullptr;
  scratch_host_ = nullptr;
  scratch_capacity_ = 0;
  // Plain cudaMalloc, not a stream-ordered pool: the simplest memory to hand to NCCL.
  EPMOE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&scratch_dev_), capacity * sizeof(int64_t)));
  EPMOE_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&scratch_host_), capacity * sizeof(int64_t)));
  scratch_capacity_ = capacity;
}

// Host values -> pinned -> device -> all-reduce -> pinned -> host; the host waits (watchdog) on
// the comm stream only, which itself waited for the caller stream.
void NcclCommunicator::allreduce_max_host(int64_t* values, size_t count, const char* what) {
  ensure_usable(what);
  if (count == 0) return;
  EPMOE_CHECK(values != nullptr, ErrorCode::invalid_argument, what, ": null buffer");
  DeviceGuard guard(device_);
  order_after_caller(what);
  ensure_scratch(count);
  const size_t bytes = count * sizeof(int64_t);
  std::memcpy(scratch_host_, values, bytes);
  EPMOE_CUDA_CHECK(cudaMemcpyAsync(scratch_dev_, scratch_host_, bytes, cudaMemcpyHostToDevice, comm_stream_));
  check_call(ncclAllReduce(scratch_dev_, scratch_dev_, count, ncclInt64, ncclMax, comm_, comm_stream_), what);
  EPMOE_CUDA_CHECK(cudaMemcpyAsync(scratch_host_, scratch_dev_, bytes, cudaMemcpyDeviceToHost, comm_stream_));
  EPMOE_CUDA_CHECK(cudaEventRecord(comm_done_, comm_stream_));
  wait_on(comm_done_, nullptr, what);
  std::memcpy(values, scratch_host_, bytes);
}

void NcclCommunicator::allreduce_max_i64(int64_t* values, size_t count) {
  allreduce_max_host(values, count, "allreduce_max_i64");
}

void NcclCommunicator::barrier() {
  int64_t token = 0;
  allreduce_max_host(&token, 1, "barrier");
}

// ---- free functions --------------------------------------------------------------------------

void nccl_abort(Communicator& comm) {
  auto* nccl = dynamic_cast<NcclCommunicator*>(&comm);
  EPMOE_CHECK(nccl != nullptr, ErrorCode::invalid_argument, "nccl_abort: the communicator is '", comm.name(),
              "', not an NCCL communicator");
  nccl->abort();
}

// ---- factories -------------------------------------------------------------------------------

#if EPMOE_WITH_MPI
// Every rank picks and sets its device first and all agree that this worked: a rank that failed
// alone would otherwise leave the others waiting in NCCL initialization until the deadline.
std::shared_ptr<Communicator> make_nccl_communicator_from_mpi(MPI_Comm mpi_comm, const NcclCommOptions& opt) {
  disable_nvls();
  check_options(opt);
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  EPMOE_CHECK(initialized && !finalized, ErrorCode::comm_error,
              "make_nccl_communicator_from_mpi: MPI must be initialized (and not finalized)");
  int rank = 0, world = 1;
  MPI_Comm_rank(mpi_comm, &rank);
  MPI_Comm_size(mpi_comm, &world);

  int device = -1;
  int local_ok = 1;
  std::string local_error;
  ErrorCode local_code = ErrorCode::ok;
  try {
    device = opt.device >= 0 ? checked_device(opt.device) : select_local_device_for(mpi_comm);
    EPMOE_CUDA_CHECK(cudaSetDevice(device));
  } catch (const Error& e) {
    local_ok = 0;
    local_error = e.what();
    local_code = e.code();
  }
  int all_ok = 0;
  MPI_Allreduce(&local_ok, &all_ok, 1, MPI_INT, MPI_MIN, mpi_comm);
  if (!local_ok) throw Error(local_code, local_error);
  EPMOE_CHECK(all_ok, ErrorCode::comm_error, "rank ", rank,
              ": another rank could not select its CUDA device (see its error); no NCCL communicator was created");

  // Rank 0 makes the id and says whether it could, so the others never wait on a missing one.
  struct {
    int ok;
    ncclUniqueId id;
  } msg{};
  ncclResult_t id_result = ncclSuccess;
  if (rank == 0) {
    id_result = ncclGetUniqueId(&msg.id);
    msg.ok = id_result == ncclSuccess ? 1 : 0;
  }
  MPI_Bcast(&msg, sizeof(msg), MPI_BYTE, 0, mpi_comm);
  if (rank == 0 && id_result != ncclSuccess) fail_nccl(id_result, "ncclGetUniqueId");
  EPMOE_CHECK(msg.ok, ErrorCode::comm_error, "rank ", rank, ": rank 0 could not create the NCCL unique id");

  return init_nonblocking(msg.id, rank, world, device, opt.deadline_seconds);
}
#endif

std::shared_ptr<Communicator> make_nccl_communicator_single(const NcclCommOptions& opt) {
  disable_nvls();
  check_options(opt);
  const int device = opt.device >= 0 ? checked_device(opt.device) : select_local_device();
  EPMOE_CUDA_CHECK(cudaSetDevice(device));
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) fail_nccl(r, "ncclGetUniqueId");
  return init_nonblocking(id, 0, 1, device, opt.deadline_seconds);
}

std::vector<uint8_t> make_nccl_unique_id() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) fail_nccl(r, "ncclGetUniqueId");
  return std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(&id), reinterpret_cast<const uint8_t*>(&id) + sizeof(id));
}

std::shared_ptr<Communicator> make_nccl_communicator_from_unique_id(const std::vector<uint8_t>& bytes, int rank,
                                                                    int world, const NcclCommOptions& opt) {
  disable_nvls();
  check_options(opt);
  EPMOE_CHECK(bytes.size() == sizeof(ncclUniqueId), ErrorCode::invalid_argument, "NCCL unique id of ", bytes.size(),
              " bytes, expected ", sizeof(ncclUniqueId));
  EPMOE_CHECK(world > 0 && rank >= 0 && rank < world, ErrorCode::invalid_argument, "rank ", rank, " of world ", world);
  const int device = opt.device >= 0 ? checked_device(opt.device) : select_local_device();
  EPMOE_CUDA_CHECK(cudaSetDevice(device));
  ncclUniqueId id;
  std::memcpy(&id, bytes.data(), sizeof(id));
  return init_nonblocking(id, rank, world, device, opt.deadline_seconds);
}

// The caller's communicator must be fully initialized; we only read its rank, size and device.
std::shared_ptr<Communicator> make_nccl_communicator_borrowed(ncclComm_t comm, const NcclCommOptions& opt) {
  disable_nvls();  // too late for `comm` itself, but not for communicators the process makes later
  check_options(opt);
  EPMOE_CHECK(comm != nullptr, ErrorCode::invalid_argument, "make_nccl_communicator_borrowed: comm is null");
  int world = 0, rank = 0, device = -1;
  ncclResult_t r = ncclCommCount(comm, &world);
  if (r != ncclSuccess) fail_nccl(r, "ncclCommCount (borrowed communicator; is its initialization complete?)");
  r = ncclCommUserRank(comm, &rank);
  if (r != ncclSuccess) fail_nccl(r, "ncclCommUserRank (borrowed communicator)");
  r = ncclCommCuDevice(comm, &device);
  if (r != ncclSuccess) fail_nccl(r, "ncclCommCuDevice (borrowed communicator)");
  int current = -1;
  EPMOE_CUDA_CHECK(cudaGetDevice(&current));
  EPMOE_CHECK(current == device, ErrorCode::invalid_argument, "make_nccl_communicator_borrowed: the NCCL communicator "
              "is on CUDA device ", device, " but the current device is ", current, "; call cudaSetDevice(", device,
              ") first");
  EPMOE_CHECK(opt.device < 0 || opt.device == device, ErrorCode::invalid_argument,
              "make_nccl_communicator_borrowed: NcclCommOptions::device=", opt.device,
              " but the NCCL communicator is on device ", device);
  return std::make_shared<NcclCommunicator>(comm, /*owned=*/false, rank, world, device, opt.deadline_seconds);
}

}  // namespace epmoe
