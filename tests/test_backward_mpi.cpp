// The EP backward under mpirun (one process per rank, MPI communicator): the mock-rank suite's
// checks (tests/backward_case.h) on a few cases.
#include <gtest/gtest.h>
#include <mpi.h>

#include "backward_case.h"
#include "epmoe/mpi_communicator.h"

namespace epmoe::test {
namespace {

int world() {
  int w;
  MPI_Comm_size(MPI_COMM_WORLD, &w);
  return w;
}

BackwardCase mpi_case(int E, int k, int hidden, int ffn, int64_t T, RoutingKind routing, int focus = 0,
                      SavePolicy policy = SavePolicy::rows_and_preactivation) {
  BackwardCase c;
  c.ep = make_ep_case(world(), E, k, hidden, ffn, T, routing, focus, uint64_t(53 * E + k));
  c.policy = policy;
  return c;
}

TEST(BackwardMpi, Uniform) { run_backward_case_cpu(mpi_case(8, 2, 128, 128, 48, RoutingKind::uniform), make_mpi_communicator()); }
TEST(BackwardMpi, ZipfRecompute) {
  run_backward_case_cpu(mpi_case(16, 4, 128, 256, 32, RoutingKind::zipf, 0, SavePolicy::rows_recompute),
                        make_mpi_communicator());
}
TEST(BackwardMpi, DropsAndEmptyRows) {
  run_backward_case_cpu(mpi_case(16, 4, 128, 128, 32, RoutingKind::with_drops), make_mpi_communicator());
}
TEST(BackwardMpi, RankWithZeroTokens) {
  BackwardCase c = mpi_case(8, 2, 128, 128, 0, RoutingKind::uniform);
  for (int r = 0; r < c.ep.world; ++r) c.ep.tokens[r] = r == 1 ? 0 : 20 + r;
  run_backward_case_cpu(c, make_mpi_communicator());
}

}  // namespace
}  // namespace epmoe::test
