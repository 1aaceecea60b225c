// Internal: the rendezvous world behind the mock communicators (comm/mock_comm.cpp: host
// buffers; comm/device_mock_comm.cpp: device buffers on one GPU). Every collective is one round of
// two rendezvous:
//
//   arrive: each rank deposits what it brings (pointers, sizes); the last to arrive checks the
//           round as a whole (same collective everywhere, consistent sizes) and releases everyone.
//   copy:   each rank reads what it must receive straight from its peers' send buffers (valid:
//           no peer has returned yet) and writes only its own receive buffers.
//   depart: nobody returns (and reuses its send buffer) before every rank finished copying.
//
// Checking the round once, under the lock, gives every rank the same verdict: either all copy or
// all throw the same error. Only `arrive` can time out; `depart` cannot hang, because between the
// two every rank only copies (or queues copies).
#pragma once
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "epmoe/communicator.h"
#include "epmoe/error.h"

namespace epmoe::mock {


enum class Collective { alltoall_i64, alltoallv, allreduce_max_i64, barrier };

inline const char* collective_name(Collective c) {
  switch (c) {
    case Collective::alltoall_i64: return "alltoall_i64";
    case Collective::alltoallv: return "alltoallv";
    case Collective::allreduce_max_i64: return "allreduce_max_i64";
    case Collective::barrier: return "barrier";
  }
  return "?";
}

// What one rank brings to a round. The pointers stay valid until the round completes.
struct Arrival {
  Collective kind = Collective::barrier;
  const int64_t* send = nullptr;  // alltoall_i64
  int64_t* values = nullptr;      // alltoall_i64: recv; allreduce_max_i64: in/out
  size_t count = 0;
  std::span<const AlltoallvPlane> planes;
  void* ready_event = nullptr;  // (device mock) a cudaEvent_t the rank recorded on its stream: `ready`, or `done`
                                // in the alltoallv's second (barrier) round
};

// Why the world stopped. `text` has no rank prefix: each rank adds its own when it throws.
struct Failure {
  ErrorCode code = ErrorCode::comm_error;
  std::string text;
};

inline std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream os;
  os << "{";
  for (size_t i = 0; i < ranks.size(); ++i) os << (i ? ", " : "") << ranks[i];
  os << "}";
  return os.str();
}

// ---- checks of a complete round (all ranks arrived) ------------------------------------------

inline std::optional<Failure> check_same_collective(const std::vector<Arrival>& all, uint64_t round) {
  const bool same = std::all_of(all.begin(), all.end(), [&](const Arrival& a) { return a.kind == all[0].kind; });
  if (same) return std::nullopt;
  std::ostringstream os;
  os << "collective mismatch in round " << round << ":";
  for (size_t r = 0; r < all.size(); ++r) os << (r ? "," : "") << " rank " << r << " called " << collective_name(all[r].kind);
  return Failure{ErrorCode::comm_error, os.str()};
}

inline std::optional<Failure> check_same_count(const std::vector<Arrival>& all, uint64_t round) {
  for (size_t r = 1; r < all.size(); ++r) {
    if (all[r].count != all[0].count) {
      return Failure{ErrorCode::comm_error,
                     detail::concat(collective_name(all[0].kind), " count mismatch in round ", round, ": rank 0 passed ",
                                    all[0].count, ", rank ", r, " passed ", all[r].count)};
    }
  }
  return std::nullopt;
}

// One rank's planes, alone: vector lengths and pointers.
inline std::optional<Failure> check_planes_shape(std::span<const AlltoallvPlane> planes, size_t rank, size_t world,
                                          uint64_t round) {
  for (size_t i = 0; i < planes.size(); ++i) {
    const AlltoallvPlane& pl = planes[i];
    const size_t lengths[4] = {pl.send_bytes.size(), pl.send_offsets.size(), pl.recv_bytes.size(),
                               pl.recv_offsets.size()};
    const char* names[4] = {"send_bytes", "send_offsets", "recv_bytes", "recv_offsets"};
    for (int v = 0; v < 4; ++v) {
      if (lengths[v] != world) {
        return Failure{ErrorCode::invalid_argument,
                       detail::concat("alltoallv in round ", round, ": rank ", rank, " plane ", i, ": ", names[v],
                                      " has ", lengths[v], " entries, world size is ", world)};
      }
    }
    const bool sends = std::any_of(pl.send_bytes.begin(), pl.send_bytes.end(), [](size_t b) { return b > 0; });
    const bool recvs = std::any_of(pl.recv_bytes.begin(), pl.recv_bytes.end(), [](size_t b) { return b > 0; });
    if ((sends && pl.send == nullptr) || (recvs && pl.recv == nullptr)) {
      return Failure{ErrorCode::invalid_argument, detail::concat("alltoallv in round ", round, ": rank ", rank,
                                                                 " plane ", i, ": null ", sends && !pl.send ? "send" : "recv",
                                                                 " buffer with a non-zero byte count")};
    }
  }
  return std::nullopt;
}

inline std::optional<Failure> check_alltoallv(const std::vector<Arrival>& all, uint64_t round) {
  const size_t world = all.size();
  for (size_t r = 0; r < world; ++r) {
    if (all[r].planes.size() != all[0].planes.size()) {
      return Failure{ErrorCode::comm_error, detail::concat("alltoallv plane count mismatch in round ", round,
                                                           ": rank 0 passed ", all[0].planes.size(), ", rank ", r,
                                                           " passed ", all[r].planes.size())};
    }
    if (auto f = check_planes_shape(all[r].planes, r, world, round)) return f;
  }
  for (size_t i = 0; i < all[0].planes.size(); ++i) {
    for (size_t dst = 0; dst < world; ++dst) {
      for (size_t src = 0; src < world; ++src) {
        const size_t expects = all[dst].planes[i].recv_bytes[src];
        const size_t sends = all[src].planes[i].send_bytes[dst];
        if (expects != sends) {
          return Failure{ErrorCode::comm_error,
                         detail::concat("alltoallv size mismatch in round ", round, ", plane ", i, ": rank ", dst,
                                        " expects ", expects, " bytes from rank ", src, ", which sends ", sends)};
        }
      }
    }
  }
  return std::nullopt;
}

inline std::optional<Failure> check_round(const std::vector<Arrival>& all, uint64_t round) {
  if (auto f = check_same_collective(all, round)) return f;
  switch (all[0].kind) {
    case Collective::alltoall_i64:
    case Collective::allreduce_max_i64: return check_same_count(all, round);
    case Collective::alltoallv: return check_alltoallv(all, round);
    case Collective::barrier: return std::nullopt;
  }
  return std::nullopt;
}

// ---- the shared world ------------------------------------------------------------------------

class MockWorld {
 public:
  MockWorld(int size, double deadline_seconds)
      : size_(size), deadline_seconds_(deadline_seconds), slots_(size), present_(size, false) {}

  int size() const { return size_; }

  // Deposits `mine` and waits for every rank. Returns all ranks' arrivals, unchanged until this
  // rank calls depart(). Throws (and fails the world) on timeout or a bad round.
  const std::vector<Arrival>& arrive(int rank, const Arrival& mine) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (failure_) {
      EPMOE_FAIL(failure_->code, "mock rank ", rank, ": ", collective_name(mine.kind),
                 " after the world failed: ", failure_->text);
    }
    slots_[rank] = mine;
    present_[rank] = true;
    if (++arrived_ == size_) {
      if (auto f = check_round(slots_, round_)) {
        fail_locked(std::move(*f));
      } else {
        all_arrived_ = true;
        cv_.notify_all();
      }
    } else {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(deadline_seconds_);
      const bool done = cv_.wait_until(lock, deadline, [&] { return all_arrived_ || failure_.has_value(); });
      if (!done) fail_locked(timeout_failure(mine.kind));
    }
    // A round everyone reached completes even if the world failed meanwhile (abort): peers may
    // already be reading this rank's buffers.
    if (!all_arrived_) EPMOE_FAIL(failure_->code, "mock rank ", rank, ": ", failure_->text);
    return slots_;
  }

  // Waits until every rank finished copying, then the last one opens the next round.
  void depart() {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t round = round_;
    if (++departed_ == size_) {
      arrived_ = departed_ = 0;
      all_arrived_ = false;
      std::fill(present_.begin(), present_.end(), false);
      ++round_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return round_ != round; });  // no deadline: peers only memcpy now
    }
  }

  void abort(const std::string& why) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failure_) fail_locked(Failure{ErrorCode::comm_error, "mock world aborted: " + why});
  }

 private:
  Failure timeout_failure(Collective kind) const {
    std::vector<int> missing;
    for (int r = 0; r < size_; ++r)
      if (!present_[r]) missing.push_back(r);
    return Failure{ErrorCode::timeout, detail::concat(collective_name(kind), " waited > ", deadline_seconds_,
                                                      "s for ranks ", rank_list(missing), " (round ", round_, ")")};
  }

  void fail_locked(Failure f) {
    failure_ = std::move(f);
    cv_.notify_all();
  }

  const int size_;
  const double deadline_seconds_;
  std::mutex mutex_;
  std::condition_variable cv_;
  uint64_t round_ = 0;  // rounds completed so far
  int arrived_ = 0, departed_ = 0;
  bool all_arrived_ = false;
  std::vector<Arrival> slots_;
  std::vector<bool> present_;
  std::optional<Failure> failure_;  // set once; the world stays failed
};

// The host-memory collectives both mock communicators share. allreduce_max in place: everyone's
// values are read before the depart rendezvous, ours written only after it, when no peer reads them.
inline void allreduce_max_i64(MockWorld& world, int rank, int64_t* values, size_t count) {
  std::vector<int64_t> result(values, values + count);  // allocated before the round: cannot throw inside
  Arrival mine{Collective::allreduce_max_i64, nullptr, values, count, {}};
  const std::vector<Arrival>& all = world.arrive(rank, mine);
  for (int p = 0; p < world.size(); ++p)
    for (size_t i = 0; i < count; ++i) result[i] = std::max(result[i], all[p].values[i]);
  world.depart();
  std::copy(result.begin(), result.end(), values);
}
inline void barrier(MockWorld& world, int rank) {
  world.arrive(rank, Arrival{Collective::barrier, nullptr, nullptr, 0, {}});
  world.depart();
}

// What mock_world_abort finds behind a Communicator of either mock kind.
class MockRank {
 public:
  virtual ~MockRank() = default;
  virtual MockWorld& world() = 0;
};

}  // namespace epmoe::mock
