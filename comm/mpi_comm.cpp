// The MPI communicator. alltoall_i64, allreduce_max_i64 and barrier map onto one nonblocking MPI
// collective each. alltoallv is built from point-to-point messages instead of MPI_Alltoallv because
// MPI's counts and displacements are int: chunked Isend/Irecv handle any size, and all planes travel
// in one round of requests. Every wait polls under the communicator's deadline (wait_requests).
#include "comm/mpi_comm.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "epmoe/error.h"

namespace epmoe {
namespace {

std::atomic<size_t> g_max_chunk_bytes{kMpiDefaultMaxChunkBytes};

std::string mpi_error_string(int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) return "MPI error code " + std::to_string(rc);
  return std::string(text, size_t(len));
}

void check_mpi(int rc, const char* call, int rank, const char* file, int line) {
  if (rc == MPI_SUCCESS) return;
  const std::string who = rank >= 0 ? detail::concat("mpi rank ", rank, ": ") : std::string("mpi: ");
  detail::throw_error(ErrorCode::comm_error, file, line,
                      detail::concat(who, call, " failed: ", mpi_error_string(rc), " (code ", rc, ")"));
}

// Wraps an MPI call: on failure, Error(comm_error) naming the call, the rank and the MPI message.
#define EPMOE_MPI(call) check_mpi((call), #call, rank_, __FILE__, __LINE__)

// ---- alltoallv size check ---------------------------------------------------------------------
// Every rank tells every peer how many bytes it will send it, per plane, and checks that against
// what it expects to receive. The local verdicts are then all-gathered, so every rank raises the
// same error (the lowest failing rank's) or none does. Without this, inconsistent sizes would
// truncate a message on one rank and leave its peers waiting forever.

constexpr int kMaxCheckedPlanes = 8;                 // planes one alltoallv call may carry
constexpr int kHeaderWords = 1 + kMaxCheckedPlanes;  // per peer: plane count, bytes per plane
constexpr int64_t kBadPlanes = -1;                   // plane count sent by a rank whose own args are bad

enum class Verdict : int64_t { ok = 0, bad_shape, too_many_planes, plane_count_mismatch, size_mismatch };

// One rank's verdict, all-gathered as kVerdictWords int64.
struct VerdictRecord {
  Verdict kind = Verdict::ok;
  int64_t a = 0, b = 0, c = 0, d = 0;  // meaning depends on kind, see verdict_message
};
constexpr int kVerdictWords = 5;

VerdictRecord check_own_planes(std::span<const AlltoallvPlane> planes, int world) {
  if (planes.size() > size_t(kMaxCheckedPlanes)) return {Verdict::too_many_planes, int64_t(planes.size())};
  for (size_t i = 0; i < planes.size(); ++i) {
    const AlltoallvPlane& pl = planes[i];
    const size_t lengths[4] = {pl.send_bytes.size(), pl.send_offsets.size(), pl.recv_bytes.size(),
                               pl.recv_offsets.size()};
    for (int v = 0; v < 4; ++v)
      if (lengths[v] != size_t(world)) return {Verdict::bad_shape, int64_t(i), v, int64_t(lengths[v])};
    const bool sends = std::any_of(pl.send_bytes.begin(), pl.send_bytes.end(), [](size_t n) { return n > 0; });
    const bool recvs = std::any_of(pl.recv_bytes.begin(), pl.recv_bytes.end(), [](size_t n) { return n > 0; });
    if (sends && pl.send == nullptr) return {Verdict::bad_shape, int64_t(i), 4, 0};
    if (recvs && pl.recv == nullptr) return {Verdict::bad_shape, int64_t(i), 5, 0};
  }
  return {};
}

// headers[p * kHeaderWords ...] = what this rank tells peer p.
void encode_size_headers(std::span<const AlltoallvPlane> planes, bool own_ok, int world, std::vector<int64_t>& headers) {
  headers.assign(size_t(world) * kHeaderWords, 0);
  for (int p = 0; p < world; ++p) {
    int64_t* h = &headers[size_t(p) * kHeaderWords];
    h[0] = own_ok ? int64_t(planes.size()) : kBadPlanes;
    if (!own_ok) continue;
    for (size_t i = 0; i < planes.size(); ++i) h[1 + i] = int64_t(planes[i].send_bytes[p]);
  }
}

VerdictRecord check_peer_headers(std::span<const AlltoallvPlane> planes, int world, const std::vector<int64_t>& got) {
  for (int p = 0; p < world; ++p) {
    const int64_t* h = &got[size_t(p) * kHeaderWords];
    if (h[0] == kBadPlanes) continue;  // that peer reports its own error
    if (h[0] != int64_t(planes.size())) return {Verdict::plane_count_mismatch, p, h[0], int64_t(planes.size())};
    for (size_t i = 0; i < planes.size(); ++i) {
      if (h[1 + i] != int64_t(planes[i].recv_bytes[p]))
        return {Verdict::size_mismatch, int64_t(i), p, int64_t(planes[i].recv_bytes[p]), h[1 + i]};
    }
  }
  return {};
}

void throw_verdict(int rank, const VerdictRecord& v) {
  static const char* kVectorNames[6] = {"send_bytes", "send_offsets", "recv_bytes", "recv_offsets", "send", "recv"};
  switch (v.kind) {
    case Verdict::ok: return;
    case Verdict::bad_shape:
      if (v.b >= 4)
        EPMOE_FAIL(ErrorCode::invalid_argument, "mpi alltoallv: rank ", rank, " plane ", v.a, ": null ",
                   kVectorNames[v.b], " buffer with a non-zero byte count");
      EPMOE_FAIL(ErrorCode::invalid_argument, "mpi alltoallv: rank ", rank, " plane ", v.a, ": ", kVectorNames[v.b],
                 " has ", v.c, " entries, not one per rank");
    case Verdict::too_many_planes:
      EPMOE_FAIL(ErrorCode::unsupported, "mpi alltoallv: rank ", rank, " passed ", v.a, " planes, at most ",
                 kMaxCheckedPlanes, " are supported");
    case Verdict::plane_count_mismatch:
      EPMOE_FAIL(ErrorCode::comm_error, "mpi alltoallv plane count mismatch: rank ", v.a, " passed ", v.b, ", rank ",
                 rank, " passed ", v.c);
    case Verdict::size_mismatch:
      EPMOE_FAIL(ErrorCode::comm_error, "mpi alltoallv size mismatch, plane ", v.a, ": rank ", rank, " expects ", v.c,
                 " bytes from rank ", v.b, ", which sends ", v.d);
  }
}

// ---- the communicator -------------------------------------------------------------------------

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm parent, double deadline_s) : deadline_s_(deadline_s) {
    EPMOE_CHECK(deadline_s > 0, ErrorCode::invalid_argument, "make_mpi_communicator: deadline_seconds must be > 0, got ",
                deadline_s);
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    EPMOE_CHECK(initialized && !finalized, ErrorCode::comm_error,
                "make_mpi_communicator: MPI must be initialized and not finalized (initialized=", initialized,
                ", finalized=", finalized, ")");
    EPMOE_CHECK(parent != MPI_COMM_NULL, ErrorCode::invalid_argument, "make_mpi_communicator: MPI_COMM_NULL");
    EPMOE_MPI(MPI_Comm_dup(parent, &comm_));
    EPMOE_MPI(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    EPMOE_MPI(MPI_Comm_rank(comm_, &rank_));
    EPMOE_MPI(MPI_Comm_size(comm_, &size_));
  }

  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);  // a destructor cannot report failure
  }

  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int world_size() const override { return size_; }
  std::string name() const override { return "mpi"; }
  MemorySpace memory_space() const override { return MemorySpace::host; }

  void alltoall_i64(const int64_t* send, int64_t* recv, size_t count) override {
    check_usable();
    EPMOE_CHECK(count <= size_t(INT_MAX), ErrorCode::unsupported, "mpi alltoall_i64: ", count,
                " values per peer exceed MPI's int count");
    MPI_Request r = MPI_REQUEST_NULL;
    EPMOE_MPI(MPI_Ialltoall(send, int(count), MPI_INT64_T, recv, int(count), MPI_INT64_T, comm_, &r));
    wait_one(r, "alltoall_i64");
  }

  void alltoallv(std::span<const AlltoallvPlane> planes) override {
    check_usable();
    check_sizes_agree(planes);
    exchange_payload(planes);
  }

  void allreduce_max_i64(int64_t* values, size_t count) override {
    check_usable();
    EPMOE_CHECK(count <= size_t(INT_MAX), ErrorCode::unsupported, "mpi allreduce_max_i64: ", count,
                " values exceed MPI's int count");
    MPI_Request r = MPI_REQUEST_NULL;
    EPMOE_MPI(MPI_Iallreduce(MPI_IN_PLACE, values, int(count), MPI_INT64_T, MPI_MAX, comm_, &r));
    wait_one(r, "allreduce_max_i64");
  }

  void barrier() override {
    check_usable();
    MPI_Request r = MPI_REQUEST_NULL;
    EPMOE_MPI(MPI_Ibarrier(comm_, &r));
    wait_one(r, "barrier");
  }

 private:
  // Two small collectives; throws the same error on every rank if any rank's sizes disagree.
  void check_sizes_agree(std::span<const AlltoallvPlane> planes) {
    const VerdictRecord own = check_own_planes(planes, size_);
    std::vector<int64_t> headers, got(size_t(size_) * kHeaderWords);
    encode_size_headers(planes, own.kind == Verdict::ok, size_, headers);
    MPI_Request r = MPI_REQUEST_NULL;
    EPMOE_MPI(MPI_Ialltoall(headers.data(), kHeaderWords, MPI_INT64_T, got.data(), kHeaderWords, MPI_INT64_T, comm_, &r));
    wait_one(r, "alltoallv size exchange");

    const VerdictRecord mine = own.kind != Verdict::ok ? own : check_peer_headers(planes, size_, got);
    const int64_t words[kVerdictWords] = {int64_t(mine.kind), mine.a, mine.b, mine.c, mine.d};
    std::vector<int64_t> all(size_t(size_) * kVerdictWords);
    EPMOE_MPI(MPI_Iallgather(words, kVerdictWords, MPI_INT64_T, all.data(), kVerdictWords, MPI_INT64_T, comm_, &r));
    wait_one(r, "alltoallv size verdicts");
    for (int r = 0; r < size_; ++r) {
      const int64_t* w = &all[size_t(r) * kVerdictWords];
      throw_verdict(r, VerdictRecord{Verdict(w[0]), w[1], w[2], w[3], w[4]});
    }
  }

  // All receives first, then all sends, then one wait. Chunks of a block travel in order (MPI
  // keeps messages between two ranks with one tag in order), one tag per plane.
  void exchange_payload(std::span<const AlltoallvPlane> planes) {
    const size_t chunk = g_max_chunk_bytes.load();
    std::vector<MPI_Request> requests;
    requests.reserve(count_requests(planes, chunk));
    for (size_t i = 0; i < planes.size(); ++i) {
      for (int p = 0; p < size_; ++p) {
        if (p == rank_) continue;
        char* base = static_cast<char*>(planes[i].recv) + planes[i].recv_offsets[p];
        post_chunks(planes[i].recv_bytes[p], chunk, [&](size_t off, int n) {
          requests.emplace_back();
          EPMOE_MPI(MPI_Irecv(base + off, n, MPI_BYTE, p, int(i), comm_, &requests.back()));
        });
      }
    }
    for (size_t i = 0; i < planes.size(); ++i) {
      for (int p = 0; p < size_; ++p) {
        if (p == rank_) continue;
        const char* base = static_cast<const char*>(planes[i].send) + planes[i].send_offsets[p];
        post_chunks(planes[i].send_bytes[p], chunk, [&](size_t off, int n) {
          requests.emplace_back();
          EPMOE_MPI(MPI_Isend(base + off, n, MPI_BYTE, p, int(i), comm_, &requests.back()));
        });
      }
    }
    for (const AlltoallvPlane& pl : planes) {  // own block: no MPI
      const size_t n = pl.send_bytes[rank_];
      if (n > 0)
        std::memcpy(static_cast<char*>(pl.recv) + pl.recv_offsets[rank_],
                    static_cast<const char*>(pl.send) + pl.send_offsets[rank_], n);
    }
    wait_requests(requests.data(), requests.size(), "alltoallv");
  }

  template <class Post>
  static void post_chunks(size_t bytes, size_t chunk, Post post) {
    for (size_t off = 0; off < bytes; off += chunk) post(off, int(std::min(chunk, bytes - off)));
  }

  size_t count_requests(std::span<const AlltoallvPlane> planes, size_t chunk) const {
    size_t n = 0;
    for (const AlltoallvPlane& pl : planes)
      for (int p = 0; p < size_; ++p)
        if (p != rank_) n += (pl.send_bytes[p] + chunk - 1) / chunk + (pl.recv_bytes[p] + chunk - 1) / chunk;
    return n;
  }

  // After a timeout: every call refuses, naming the first failure.
  void check_usable() const {
    EPMOE_CHECK(failed_.empty(), ErrorCode::timeout, "mpi rank ", rank_, ": the communicator failed earlier (", failed_,
                "); it takes no more work");
  }

  // Polls the requests until all completed (MPI_Testall: spinning for the first millisecond, then
  // 100 us sleeps between tests) or the deadline passed: then Error(timeout), and the communicator
  // refuses further calls (the requests stay posted: an MPI collective cannot be cancelled).
  // MPI_Testall reports a per-request failure as MPI_ERR_IN_STATUS; name the request's own error.
  void wait_one(MPI_Request& r, const char* what) { wait_requests(&r, 1, what); }
  void wait_requests(MPI_Request* requests, size_t count, const char* what) {
    if (count == 0) return;
    std::vector<MPI_Status> statuses(count);
    const auto start = std::chrono::steady_clock::now();
    int rc = MPI_SUCCESS, done = 0;
    for (;;) {
      rc = MPI_Testall(int(count), requests, &done, statuses.data());
      if (rc != MPI_SUCCESS || done) break;
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (waited > deadline_s_) {
        failed_ = detail::concat(what, " did not complete within ", deadline_s_, " s");
        EPMOE_FAIL(ErrorCode::timeout, "mpi rank ", rank_, ": ", failed_,
                   ": a peer rank is stalled or gone; this communicator takes no more work");
      }
      if (waited > 1e-3) std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    if (rc == MPI_ERR_IN_STATUS) {
      for (const MPI_Status& s : statuses)
        if (s.MPI_ERROR != MPI_SUCCESS && s.MPI_ERROR != MPI_ERR_PENDING)
          EPMOE_FAIL(ErrorCode::comm_error, "mpi rank ", rank_, ": alltoallv message from/to rank ", s.MPI_SOURCE,
                     " (plane ", s.MPI_TAG, ") failed: ", mpi_error_string(s.MPI_ERROR));
    }
    EPMOE_MPI(rc);
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = -1, size_ = 0;
  double deadline_s_ = 300.0;
  std::string failed_;  // the first timeout (empty: none)
};

}  // namespace

std::shared_ptr<Communicator> make_mpi_communicator(MPI_Comm comm, double deadline_seconds) {
  return std::make_shared<MpiCommunicator>(comm, deadline_seconds);
}

void mpi_comm_set_max_chunk_bytes_for_testing(size_t bytes) {
  EPMOE_CHECK(bytes <= size_t(INT_MAX), ErrorCode::invalid_argument, "mpi chunk size ", bytes,
              " exceeds MPI's int count (", INT_MAX, ")");
  g_max_chunk_bytes.store(bytes == 0 ? kMpiDefaultMaxChunkBytes : bytes);
}

size_t mpi_comm_max_chunk_bytes() { return g_max_chunk_bytes.load(); }

}  // namespace epmoe
