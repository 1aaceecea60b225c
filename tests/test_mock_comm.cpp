// Mock ranks: every collective moves exactly the right bytes for worlds of 1..8 ranks, and every
// way a round can fail (a rank missing, ranks disagreeing, a rank dying) ends promptly with the
// same error on every rank instead of a hang.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "comm/mock_comm.h"
#include "alltoallv_pattern.h"
#include "epmoe/error.h"

namespace epmoe {
namespace {

using namespace ::epmoe::test;  // alltoallv_pattern.h

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::optional<ErrorCode> code_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const Error& err) {
    return err.code();
  } catch (...) {
    return std::nullopt;
  }
}

void expect_all_ok(const std::vector<std::exception_ptr>& errors) {
  for (size_t r = 0; r < errors.size(); ++r)
    EXPECT_FALSE(errors[r]) << "rank " << r << ": " << describe_exception(errors[r]);
}

// Every rank failed with `code` and a message containing `text`.
void expect_all_failed(const std::vector<std::exception_ptr>& errors, ErrorCode code, const std::string& text) {
  for (size_t r = 0; r < errors.size(); ++r) {
    ASSERT_TRUE(errors[r]) << "rank " << r << " did not fail";
    EXPECT_EQ(code_of(errors[r]), code) << "rank " << r << ": " << describe_exception(errors[r]);
    EXPECT_NE(describe_exception(errors[r]).find(text), std::string::npos)
        << "rank " << r << ": '" << describe_exception(errors[r]) << "' lacks '" << text << "'";
  }
}


// ---- correctness over world sizes --------------------------------------------------------------

class MockWorldSizes : public ::testing::TestWithParam<int> {};

INSTANTIATE_TEST_SUITE_P(Worlds, MockWorldSizes, ::testing::Values(1, 2, 3, 4, 8));

int64_t a2a_value(int src, int dst, size_t i) { return int64_t(src) * 1000000 + int64_t(dst) * 1000 + int64_t(i); }

void check_alltoall_i64(Communicator& comm, size_t count) {
  const int world = comm.world_size(), me = comm.rank();
  std::vector<int64_t> send(size_t(world) * count), recv(size_t(world) * count, -1);
  for (int p = 0; p < world; ++p)
    for (size_t i = 0; i < count; ++i) send[p * count + i] = a2a_value(me, p, i);
  comm.alltoall_i64(send.data(), recv.data(), count);
  for (int p = 0; p < world; ++p)
    for (size_t i = 0; i < count; ++i) EXPECT_EQ(recv[p * count + i], a2a_value(p, me, i)) << "rank " << me;
}


void check_allreduce_max(Communicator& comm, int salt) {
  const int world = comm.world_size(), me = comm.rank();
  auto value = [&](int r, size_t i) -> int64_t { return int64_t((r * 7 + int(i) * 13 + salt) % (world + 5)) - 3 - int64_t(i % 2) * (1LL << 40); };
  std::vector<int64_t> values(5);
  for (size_t i = 0; i < values.size(); ++i) values[i] = value(me, i);
  comm.allreduce_max_i64(values.data(), values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    int64_t want = value(0, i);
    for (int r = 1; r < world; ++r) want = std::max(want, value(r, i));
    EXPECT_EQ(values[i], want) << "rank " << me << " index " << i;
  }
}

TEST_P(MockWorldSizes, AlltoallI64) {
  auto errors = run_mock_ranks(GetParam(), [](int, std::shared_ptr<Communicator> comm) {
    check_alltoall_i64(*comm, 3);
    check_alltoall_i64(*comm, 1);
    check_alltoall_i64(*comm, 0);
  });
  expect_all_ok(errors);
}

TEST_P(MockWorldSizes, AlltoallvUnevenSeveralPlanes) {
  auto errors = run_mock_ranks(GetParam(), [](int, std::shared_ptr<Communicator> comm) {
    for (uint32_t seed = 1; seed <= 5; ++seed) check_alltoallv(*comm, 3, seed, 300);
    check_alltoallv(*comm, 1, 99, 5000);
    check_alltoallv(*comm, 0, 0, 1);  // no planes: still a collective
  });
  expect_all_ok(errors);
}

TEST_P(MockWorldSizes, AlltoallvAllEmpty) {
  auto errors = run_mock_ranks(GetParam(), [](int, std::shared_ptr<Communicator> comm) {
    const AlltoallvPlane empty = empty_plane(comm->world_size());
    std::vector<AlltoallvPlane> planes{empty, empty};
    comm->alltoallv(planes);
  });
  expect_all_ok(errors);
}

TEST_P(MockWorldSizes, AllreduceMax) {
  auto errors = run_mock_ranks(GetParam(), [](int, std::shared_ptr<Communicator> comm) {
    for (int salt = 0; salt < 4; ++salt) check_allreduce_max(*comm, salt);
    comm->allreduce_max_i64(nullptr, 0);
  });
  expect_all_ok(errors);
}

TEST_P(MockWorldSizes, BarrierHoldsEveryoneBack) {
  const int world = GetParam();
  std::atomic<int> arrived{0};
  auto errors = run_mock_ranks(world, [&](int, std::shared_ptr<Communicator> comm) {
    for (int round = 1; round <= 20; ++round) {
      arrived.fetch_add(1);
      comm->barrier();
      EXPECT_GE(arrived.load(), round * world);  // nobody left before all of this round arrived
      comm->barrier();  // nobody starts the next round before all checked this one
    }
  });
  expect_all_ok(errors);
}

// Back-to-back rounds of different collectives reuse the world's state correctly.
TEST_P(MockWorldSizes, MixedSequence) {
  auto errors = run_mock_ranks(GetParam(), [](int rank, std::shared_ptr<Communicator> comm) {
    for (uint32_t it = 0; it < 30; ++it) {
      check_alltoall_i64(*comm, 2 + it % 3);
      check_alltoallv(*comm, 2, 1000 + it, 64);
      check_allreduce_max(*comm, int(it));
      if ((it + uint32_t(rank)) % 5 == 0) std::this_thread::yield();
    }
  });
  expect_all_ok(errors);
}

TEST(MockComm, Properties) {
  auto comms = make_mock_world(3);
  ASSERT_EQ(comms.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(comms[r]->rank(), r);
    EXPECT_EQ(comms[r]->world_size(), 3);
    EXPECT_EQ(comms[r]->name(), "mock");
    EXPECT_EQ(comms[r]->memory_space(), MemorySpace::host);
    EXPECT_EQ(comms[r]->stream(), nullptr);
  }
}

TEST(MockComm, RejectsBadWorld) {
  EXPECT_THROW(make_mock_world(0), Error);
  EXPECT_THROW(make_mock_world(2, 0.0), Error);
  try {
    make_mock_world(-1);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("-1"), std::string::npos) << e.what();
  }
}

TEST(MockComm, RunMockRanksReportsNothingWhenAllSucceed) {
  std::atomic<int> ran{0};
  auto errors = run_mock_ranks(4, [&](int, std::shared_ptr<Communicator> comm) {
    comm->barrier();
    ran.fetch_add(1);
  });
  ASSERT_EQ(errors.size(), 4u);
  expect_all_ok(errors);
  EXPECT_EQ(ran.load(), 4);
}

// ---- failures end promptly, the same on every rank -----------------------------------------------

TEST(MockCommFailure, SkippedCollectiveTimesOut) {
  const auto t0 = Clock::now();
  auto errors = run_mock_ranks(
      4,
      [](int rank, std::shared_ptr<Communicator> comm) {
        if (rank != 2) comm->barrier();  // rank 2 skips it and returns normally
      },
      0.3);
  const double took = seconds_since(t0);
  EXPECT_LT(took, 5.0);
  EXPECT_GE(took, 0.25);
  EXPECT_FALSE(errors[2]) << describe_exception(errors[2]);
  for (int r : {0, 1, 3}) {
    ASSERT_TRUE(errors[r]) << "rank " << r;
    EXPECT_EQ(code_of(errors[r]), ErrorCode::timeout) << describe_exception(errors[r]);
    const std::string what = describe_exception(errors[r]);
    EXPECT_NE(what.find("mock rank " + std::to_string(r) + ": barrier waited > 0.3s for ranks {2}"), std::string::npos)
        << what;
  }
}

TEST(MockCommFailure, WorldStaysFailedAfterTimeout) {
  auto comms = make_mock_world(2, 0.2);
  EXPECT_THROW(comms[0]->barrier(), Error);  // rank 1 never comes
  const auto t0 = Clock::now();
  try {
    comms[1]->barrier();  // arrives late: fails at once instead of pairing with a dead round
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::timeout);
    EXPECT_NE(std::string(e.what()).find("after the world failed"), std::string::npos) << e.what();
  }
  EXPECT_LT(seconds_since(t0), 0.1);
}

TEST(MockCommFailure, CollectiveKindMismatch) {
  const auto t0 = Clock::now();
  auto errors = run_mock_ranks(3, [](int rank, std::shared_ptr<Communicator> comm) {
    comm->barrier();  // one good round first
    int64_t v = rank;
    if (rank == 1) comm->allreduce_max_i64(&v, 1);
    else comm->barrier();
  });
  EXPECT_LT(seconds_since(t0), 5.0);
  expect_all_failed(errors, ErrorCode::comm_error,
                    "collective mismatch in round 1: rank 0 called barrier, rank 1 called allreduce_max_i64, rank 2 "
                    "called barrier");
}

TEST(MockCommFailure, CountMismatch) {
  auto errors = run_mock_ranks(2, [](int rank, std::shared_ptr<Communicator> comm) {
    std::vector<int64_t> send(8, 0), recv(8, 0);
    comm->alltoall_i64(send.data(), recv.data(), rank == 0 ? 2 : 4);
  });
  expect_all_failed(errors, ErrorCode::comm_error, "rank 0 passed 2, rank 1 passed 4");
}

TEST(MockCommFailure, AlltoallvSizeMismatch) {
  const int world = 3;
  const std::vector<size_t> bytes = random_block_sizes(world, 0, 5, 50);
  auto errors = run_mock_ranks(world, [&](int rank, std::shared_ptr<Communicator> comm) {
    RankPlane rp = make_rank_plane(bytes, world, 0, rank);
    if (rank == 0) rp.plane.recv_bytes[1] += 1;  // the buffer has room: block 1 is followed by a gap
    std::vector<AlltoallvPlane> planes{rp.plane};
    comm->alltoallv(planes);
  });
  const std::string want = "plane 0: rank 0 expects " + std::to_string(bytes[1 * world + 0] + 1) +
                           " bytes from rank 1, which sends " + std::to_string(bytes[1 * world + 0]);
  expect_all_failed(errors, ErrorCode::comm_error, want);
}

TEST(MockCommFailure, AlltoallvPlaneCountMismatch) {
  auto errors = run_mock_ranks(2, [](int rank, std::shared_ptr<Communicator> comm) {
    RankPlane rp = make_rank_plane(std::vector<size_t>(4, 0), 2, 0, rank);
    std::vector<AlltoallvPlane> planes(rank == 1 ? 2 : 1, rp.plane);
    comm->alltoallv(planes);
  });
  expect_all_failed(errors, ErrorCode::comm_error, "plane count mismatch in round 0: rank 0 passed 1, rank 1 passed 2");
}

TEST(MockCommFailure, AlltoallvBadPlaneShape) {
  auto errors = run_mock_ranks(2, [](int rank, std::shared_ptr<Communicator> comm) {
    RankPlane rp = make_rank_plane(std::vector<size_t>(4, 1), 2, 0, rank);
    if (rank == 1) rp.plane.recv_offsets.pop_back();
    std::vector<AlltoallvPlane> planes{rp.plane};
    comm->alltoallv(planes);
  });
  expect_all_failed(errors, ErrorCode::invalid_argument, "rank 1 plane 0: recv_offsets has 1 entries, world size is 2");
}

// A rank that dies outside any collective: run_mock_ranks aborts the world, so its peers stop
// waiting at once (the deadline is a minute) and every rank reports an error.
TEST(MockCommFailure, RankThrowsBeforeCollective) {
  const auto t0 = Clock::now();
  auto errors = run_mock_ranks(
      4,
      [](int rank, std::shared_ptr<Communicator> comm) {
        comm->barrier();
        if (rank == 1) throw std::runtime_error("boom");
        comm->barrier();
      },
      60.0);
  EXPECT_LT(seconds_since(t0), 5.0);
  ASSERT_TRUE(errors[1]);
  EXPECT_EQ(describe_exception(errors[1]), "boom");
  for (int r : {0, 2, 3}) {
    ASSERT_TRUE(errors[r]) << "rank " << r;
    EXPECT_EQ(code_of(errors[r]), ErrorCode::comm_error);
    EXPECT_NE(describe_exception(errors[r]).find("mock world aborted: rank 1 failed: boom"), std::string::npos)
        << describe_exception(errors[r]);
  }
}

TEST(MockCommFailure, AbortWakesWaitingRanks) {
  auto comms = make_mock_world(3, 60.0);
  std::vector<std::exception_ptr> errors(2);
  std::vector<std::thread> waiters;
  for (int r = 0; r < 2; ++r) {
    waiters.emplace_back([&, r] {
      try {
        comms[r]->barrier();
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const auto t0 = Clock::now();
  mock_world_abort(*comms[2], "test says stop");
  for (auto& t : waiters) t.join();
  EXPECT_LT(seconds_since(t0), 5.0);
  expect_all_failed(errors, ErrorCode::comm_error, "mock world aborted: test says stop");
}

TEST(MockCommFailure, AbortNeedsAMockCommunicator) {
  struct NotMock : Communicator {
    int rank() const override { return 0; }
    int world_size() const override { return 1; }
    std::string name() const override { return "other"; }
    MemorySpace memory_space() const override { return MemorySpace::host; }
    void alltoall_i64(const int64_t*, int64_t*, size_t) override {}
    void alltoallv(std::span<const AlltoallvPlane>) override {}
    void allreduce_max_i64(int64_t*, size_t) override {}
    void barrier() override {}
  } other;
  try {
    mock_world_abort(other, "x");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("'other'"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace epmoe
