// main() for GoogleTest binaries run under mpirun: one process per rank, all running the same
// tests in the same order (tests may use collectives). Rank 0 prints the usual gtest output;
// the other ranks print only their failures, tagged "[rank R]", so output stays readable. Every
// rank exits with the same code: failed if any rank failed.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

// Failures of a rank whose default printer was removed.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}

  // The name comes from OnTestStart: UnitTest::current_test_info() would take the lock that gtest
  // already holds while it reports a part result (a self-deadlock).
  void OnTestStart(const ::testing::TestInfo& info) override {
    test_ = std::string(info.test_suite_name()) + "." + info.name();
  }
  void OnTestEnd(const ::testing::TestInfo&) override { test_ = "(outside a test)"; }

  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::printf("[rank %d] FAILED %s at %s:%d: %s\n", rank_, test_.c_str(), r.file_name() ? r.file_name() : "?",
                r.line_number(), r.message());
    std::fflush(stdout);
  }

 private:
  int rank_;
  std::string test_ = "(outside a test)";
};

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  // Serialized: tests call MPI from one thread at a time, possibly not the main one.
  if (MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS) {
    std::fprintf(stderr, "MPI_Init_thread failed\n");
    return 1;
  }
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (provided < MPI_THREAD_SERIALIZED && rank == 0)
    std::printf("note: MPI provides thread level %d, below MPI_THREAD_SERIALIZED\n", provided);

  // mpirun forwards output through a pseudo-terminal, which would turn on colour codes in logs.
  if (std::getenv("GTEST_COLOR") == nullptr) GTEST_FLAG_SET(color, "no");
  ::testing::InitGoogleTest(&argc, argv);
  ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (rank != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  }

  const int local = RUN_ALL_TESTS();
  int global = local;
  MPI_Allreduce(&local, &global, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  int failed_ranks = 0, mine = local != 0;
  MPI_Reduce(&mine, &failed_ranks, 1, MPI_INT, MPI_SUM, 0, MPI_COMM_WORLD);
  if (rank == 0 && failed_ranks > 0)
    std::printf("[mpi] %d of %d ranks had failures (their failures print as [rank R] FAILED lines)\n",
                failed_ranks, size);
  std::fflush(stdout);
  MPI_Finalize();
  return global;
}
