// The MPI communicator under mpirun (any number of ranks): exact data for every collective,
// uneven and empty alltoallv blocks over several planes, the chunked path that carries blocks
// beyond MPI's int counts (forced with a tiny chunk), and size errors that fail every rank alike
// and leave the communicator usable; a stalled peer makes the others time out.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm/mpi_comm.h"
#include "alltoallv_pattern.h"
#include "epmoe/error.h"

namespace epmoe {
namespace {

using namespace ::epmoe::test;  // alltoallv_pattern.h



// Restores the default chunk when a test ends, however it ends.
struct ChunkOverride {
  explicit ChunkOverride(size_t bytes) { mpi_comm_set_max_chunk_bytes_for_testing(bytes); }
  ~ChunkOverride() { mpi_comm_set_max_chunk_bytes_for_testing(0); }
};

// Runs `call` and returns the epmoe::Error it threw (or fails the test if none).
template <class F>
std::pair<ErrorCode, std::string> expect_error(F call) {
  try {
    call();
  } catch (const Error& e) {
    return {e.code(), e.what()};
  }
  ADD_FAILURE() << "no epmoe::Error thrown";
  return {ErrorCode::ok, ""};
}

// The same string on every rank (error messages must agree).
bool same_on_all_ranks(const std::string& s) {
  const uint64_t h = std::hash<std::string>{}(s);
  uint64_t lo = h, hi = h;
  MPI_Allreduce(MPI_IN_PLACE, &lo, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(MPI_IN_PLACE, &hi, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
  return lo == hi;
}

class MpiComm : public ::testing::Test {
 protected:
  void SetUp() override {
    comm = make_mpi_communicator(MPI_COMM_WORLD);
    world = comm->world_size();
    me = comm->rank();
  }
  std::shared_ptr<Communicator> comm;
  int world = 0, me = 0;
};

TEST_F(MpiComm, Properties) {
  int r = -1, n = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  EXPECT_EQ(me, r);
  EXPECT_EQ(world, n);
  EXPECT_EQ(comm->name(), "mpi");
  EXPECT_EQ(comm->memory_space(), MemorySpace::host);
  EXPECT_EQ(mpi_comm_max_chunk_bytes(), kMpiDefaultMaxChunkBytes);
}

TEST_F(MpiComm, AlltoallI64) {
  for (size_t count : {size_t(3), size_t(1), size_t(0)}) {
    std::vector<int64_t> send(size_t(world) * count), recv(size_t(world) * count, -1);
    for (int p = 0; p < world; ++p)
      for (size_t i = 0; i < count; ++i) send[p * count + i] = int64_t(me) * 1000000 + p * 1000 + int64_t(i);
    comm->alltoall_i64(send.data(), recv.data(), count);
    for (int p = 0; p < world; ++p)
      for (size_t i = 0; i < count; ++i) EXPECT_EQ(recv[p * count + i], int64_t(p) * 1000000 + me * 1000 + int64_t(i));
  }
}

TEST_F(MpiComm, AlltoallvUnevenTwoPlanes) {
  for (uint32_t seed = 1; seed <= 6; ++seed) check_alltoallv(*comm, 2, seed, 300);
  check_alltoallv(*comm, 1, 77, 20000);
  check_alltoallv(*comm, 0, 0, 1);  // no planes: still agrees and returns
}

TEST_F(MpiComm, AlltoallvAllEmpty) {
  const AlltoallvPlane empty = empty_plane(world);
  std::vector<AlltoallvPlane> planes{empty, empty};
  comm->alltoallv(planes);
}

// The path that carries blocks and offsets beyond INT_MAX: every block split into many chunks.
TEST_F(MpiComm, ChunkedPathWithTinyChunks) {
  for (size_t chunk : {size_t(1), size_t(7), size_t(256)}) {
    ChunkOverride force(chunk);
    EXPECT_EQ(mpi_comm_max_chunk_bytes(), chunk);
    for (uint32_t seed = 10; seed < 13; ++seed) check_alltoallv(*comm, 2, seed, chunk == 1 ? 40 : 2000);
  }
  EXPECT_EQ(mpi_comm_max_chunk_bytes(), kMpiDefaultMaxChunkBytes);
}

TEST_F(MpiComm, ChunkedPathWithMegabyteBlocks) {
  ChunkOverride force(size_t(1) << 20);
  check_alltoallv(*comm, 2, 21, size_t(3) << 20);  // blocks up to 3 MiB: up to 3 chunks each, odd tails
}

TEST_F(MpiComm, ChunkKnobRejectsOverIntMax) {
  EXPECT_THROW(mpi_comm_set_max_chunk_bytes_for_testing(size_t(INT_MAX) + 1), Error);
  EXPECT_EQ(mpi_comm_max_chunk_bytes(), kMpiDefaultMaxChunkBytes);
}

TEST_F(MpiComm, AllreduceMax) {
  for (int salt = 0; salt < 4; ++salt) {
    auto value = [&](int r, size_t i) -> int64_t {
      return int64_t((r * 7 + int(i) * 13 + salt) % (world + 5)) - 3 - int64_t(i % 2) * (1LL << 40);
    };
    std::vector<int64_t> values(5);
    for (size_t i = 0; i < values.size(); ++i) values[i] = value(me, i);
    comm->allreduce_max_i64(values.data(), values.size());
    for (size_t i = 0; i < values.size(); ++i) {
      int64_t want = value(0, i);
      for (int r = 1; r < world; ++r) want = std::max(want, value(r, i));
      EXPECT_EQ(values[i], want) << "index " << i;
    }
  }
}

// Nobody leaves a barrier before the last rank entered it. Ranks enter staggered (rank r sleeps
// r * 20 ms); times come from steady_clock, which is one clock for all processes of one host, so
// the check runs only when every rank shares this host.
TEST_F(MpiComm, BarrierWaitsForTheLastRank) {
  MPI_Comm local;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &local);
  int local_size = 0;
  MPI_Comm_size(local, &local_size);
  MPI_Comm_free(&local);
  auto now_us = [] {
    return int64_t(std::chrono::duration_cast<std::chrono::microseconds>(
                       std::chrono::steady_clock::now().time_since_epoch()).count());
  };
  for (int round = 0; round < 3; ++round) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20 * ((me + round) % world)));
    const int64_t entered = now_us();
    comm->barrier();
    const int64_t left = now_us();
    int64_t last_entry = entered, first_exit = -left;  // max of entries, min of exits (as max of negatives)
    comm->allreduce_max_i64(&last_entry, 1);
    comm->allreduce_max_i64(&first_exit, 1);
    if (local_size == world) EXPECT_LE(last_entry, -first_exit) << "round " << round;
  }
}

// ---- a stalled peer: the others raise Error(timeout) within the deadline, then refuse work ----
// The last rank enters the barrier 2.5 s late; the others, with a 1 s deadline, raise in [1, 2.4) s
// and then refuse every call (naming the first failure). The late rank's own barrier completes
// against the others' still-posted requests, or times out too; a world barrier (another
// communicator) ends the test with every request completed.
TEST_F(MpiComm, StalledPeerMakesTheOthersTimeOut) {
  if (world < 2) GTEST_SKIP() << "needs 2 ranks";
  auto c = make_mpi_communicator(MPI_COMM_WORLD, 1.0);
  const int stalled = world - 1;
  if (me == stalled) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    try {
      c->barrier();
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::timeout) << e.what();
    }
  } else {
    const auto t0 = std::chrono::steady_clock::now();
    const auto [code, what] = expect_error([&] { c->barrier(); });
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(code, ErrorCode::timeout) << what;
    EXPECT_NE(what.find("barrier did not complete within 1 s"), std::string::npos) << what;
    EXPECT_GE(waited, 1.0);
    EXPECT_LT(waited, 2.4) << "raised only after the stalled rank arrived";
    int64_t v = 1;
    const auto [code2, what2] = expect_error([&] { c->allreduce_max_i64(&v, 1); });
    EXPECT_EQ(code2, ErrorCode::timeout);
    EXPECT_NE(what2.find("failed earlier"), std::string::npos) << what2;
  }
  MPI_Barrier(MPI_COMM_WORLD);
  const auto [code, what] = expect_error([] { (void)make_mpi_communicator(MPI_COMM_WORLD, 0.0); });
  EXPECT_EQ(code, ErrorCode::invalid_argument) << what;
}

// ---- inconsistent arguments: the same error on every rank, and the communicator still works ----

TEST_F(MpiComm, SizeMismatchFailsEveryRank) {
  const std::vector<size_t> bytes = random_block_sizes(world, 0, 5, 50);
  RankPlane rp = make_rank_plane(bytes, world, 0, me);
  const int src = (world - 1) % world;  // rank 0 expects one byte too many from the last rank
  if (me == 0) rp.plane.recv_bytes[src] += 1;
  std::vector<AlltoallvPlane> planes{rp.plane};
  auto [code, what] = expect_error([&] { comm->alltoallv(planes); });
  EXPECT_EQ(code, ErrorCode::comm_error) << what;
  const std::string want = "size mismatch, plane 0: rank 0 expects " + std::to_string(bytes[size_t(src) * world] + 1) +
                           " bytes from rank " + std::to_string(src) + ", which sends " +
                           std::to_string(bytes[size_t(src) * world]);
  EXPECT_NE(what.find(want), std::string::npos) << what;
  EXPECT_TRUE(same_on_all_ranks(what)) << what;
  check_alltoallv(*comm, 2, 3, 100);  // nothing was sent: the next exchange is clean
}

TEST_F(MpiComm, PlaneCountMismatchFailsEveryRank) {
  if (world < 2) GTEST_SKIP() << "needs 2 ranks";
  RankPlane rp = make_rank_plane(std::vector<size_t>(size_t(world) * world, 0), world, 0, me);
  std::vector<AlltoallvPlane> planes(me == 1 ? 2 : 1, rp.plane);
  auto [code, what] = expect_error([&] { comm->alltoallv(planes); });
  EXPECT_EQ(code, ErrorCode::comm_error) << what;
  EXPECT_NE(what.find("plane count mismatch: rank 1 passed 2, rank 0 passed 1"), std::string::npos) << what;
  EXPECT_TRUE(same_on_all_ranks(what)) << what;
  comm->barrier();
}

TEST_F(MpiComm, BadPlaneShapeFailsEveryRank) {
  RankPlane rp = make_rank_plane(std::vector<size_t>(size_t(world) * world, 1), world, 0, me);
  const int bad = world - 1;
  if (me == bad) rp.plane.send_offsets.push_back(0);
  std::vector<AlltoallvPlane> planes{rp.plane};
  auto [code, what] = expect_error([&] { comm->alltoallv(planes); });
  EXPECT_EQ(code, ErrorCode::invalid_argument) << what;
  EXPECT_NE(what.find("rank " + std::to_string(bad) + " plane 0: send_offsets has " + std::to_string(world + 1) +
                      " entries"),
            std::string::npos)
      << what;
  EXPECT_TRUE(same_on_all_ranks(what)) << what;
}

TEST_F(MpiComm, TooManyPlanesFailsEveryRank) {
  RankPlane rp = make_rank_plane(std::vector<size_t>(size_t(world) * world, 0), world, 0, me);
  std::vector<AlltoallvPlane> planes(9, rp.plane);
  auto [code, what] = expect_error([&] { comm->alltoallv(planes); });
  EXPECT_EQ(code, ErrorCode::unsupported) << what;
  EXPECT_TRUE(same_on_all_ranks(what)) << what;
}

TEST(MpiCommLifetime, ManyCommunicatorsComeAndGo) {
  for (int i = 0; i < 20; ++i) {
    auto c = make_mpi_communicator(MPI_COMM_WORLD);
    c->barrier();
  }
  auto a = make_mpi_communicator(MPI_COMM_WORLD), b = make_mpi_communicator(MPI_COMM_WORLD);
  int64_t va = a->rank(), vb = -b->rank();
  a->allreduce_max_i64(&va, 1);  // independent duplicates: traffic on one never matches the other
  b->allreduce_max_i64(&vb, 1);
  EXPECT_EQ(va, a->world_size() - 1);
  EXPECT_EQ(vb, 0);
}

}  // namespace
}  // namespace epmoe
