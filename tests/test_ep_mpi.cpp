// The EP forward under mpirun (one process per rank, MPI communicator): the same cases and checks
// as the mock-rank suite (tests/ep_case.h), plus the bad-input errors on every rank and a stalled
// rank under the communicator's deadline.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ep_case.h"
#include "epmoe/error.h"
#include "epmoe/mpi_communicator.h"

namespace epmoe::test {
namespace {

int world() {
  int w;
  MPI_Comm_size(MPI_COMM_WORLD, &w);
  return w;
}

EpCase mpi_case(int E, int k, int hidden, int ffn, int64_t T, RoutingKind routing, int focus = 0) {
  return make_ep_case(world(), E, k, hidden, ffn, T, routing, focus, uint64_t(31 * E + k));
}

TEST(EpMpi, Uniform) { run_ep_case_cpu(mpi_case(8, 2, 128, 128, 96, RoutingKind::uniform), make_mpi_communicator()); }
TEST(EpMpi, ZipfLargeK) { run_ep_case_cpu(mpi_case(32, 8, 128, 768, 64, RoutingKind::zipf), make_mpi_communicator()); }
TEST(EpMpi, Hidden2048) { run_ep_case_cpu(mpi_case(8, 4, 2048, 1024, 8, RoutingKind::uniform), make_mpi_communicator()); }
TEST(EpMpi, AllToOneExpert) {
  run_ep_case_cpu(mpi_case(8, 2, 128, 128, 64, RoutingKind::one_expert, 7), make_mpi_communicator());
}
TEST(EpMpi, DropsAndEmptyRows) {
  run_ep_case_cpu(mpi_case(32, 4, 128, 128, 64, RoutingKind::with_drops), make_mpi_communicator());
}
TEST(EpMpi, OnlyRankZeroExpertsUsed) {
  run_ep_case_cpu(mpi_case(8, 2, 128, 128, 64, RoutingKind::local_only, 0), make_mpi_communicator());
}
TEST(EpMpi, RankWithZeroTokens) {
  EpCase c = mpi_case(8, 2, 128, 128, 0, RoutingKind::uniform);
  for (int r = 0; r < c.world; ++r) c.tokens[r] = r == 1 ? 0 : 40 + r;
  run_ep_case_cpu(c, make_mpi_communicator());
}

// The error-path tests' step: this rank's layer of 4 experts (E = 4 W, k 2, 128/128) over `comm`
// and 16 tokens of uniform routing.
struct SmallStep {
  static constexpr int k = 2, H = 128, F = 128;
  static constexpr int64_t T = 16;
  const int W, me, E;
  std::vector<bf16> w1, w2;
  MoeLayer layer;
  std::vector<bf16> x, y;
  Routing R;
  explicit SmallStep(std::shared_ptr<Communicator> comm)
      : W(world()),
        me(comm->rank()),
        E(4 * W),
        w1(random_bf16(size_t(4) * 2 * F * H, 1, 0.1f)),
        w2(random_bf16(size_t(4) * H * F, 2, 0.1f)),
        layer(MoeConfig{.num_experts = E, .top_k = k, .hidden = H, .ffn = F, .world_size = W, .rank = me},
              {TensorView::contiguous(w1.data(), DType::bf16, {4, 2 * F, H}),
               TensorView::contiguous(w2.data(), DType::bf16, {4, H, F})},
              comm),
        x(make_x(1, me, T, H)),
        y(size_t(T) * H),
        R(make_routing(T, E, k, RoutingKind::uniform, mix(2, me))) {}
  void forward() {
    layer.forward(TensorView::contiguous(x.data(), DType::bf16, {T, H}),
                  TensorView::contiguous(R.ids.data(), DType::i32, {T, k}),
                  TensorView::contiguous(R.weights.data(), DType::f32, {T, k}),
                  TensorView::contiguous(y.data(), DType::bf16, {T, H}));
  }
};

TEST(EpMpi, BadIdOnLastRankFailsEveryRank) {
  SmallStep st(make_mpi_communicator());
  const int W = st.W, me = st.me, E = st.E, k = SmallStep::k;
  if (me == W - 1) st.R.ids[3 * k + 1] = E + 5;
  try {
    st.forward();
    ADD_FAILURE() << "rank " << me << ": no error raised";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::expert_id_out_of_range);
    const std::string want = "rank " + std::to_string(W - 1) + ": topk_ids[3, 1] = " + std::to_string(E + 5);
    EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
  }
}

// A rank that stalls (enters forward 2.5 s late) under a 1 s deadline: every other rank's forward
// raises Error(timeout) within [1, 2.4) s, and their layers refuse the next forward with an error
// naming the first failure; the late rank's own forward fails too (its count exchange meets the
// others' posted requests, its dispatch finds nobody). (A rank that dies is mpirun's: it ends the
// job.)
TEST(EpMpi, StalledRankMakesTheOthersRaise) {
  const int W = world();
  if (W < 2) GTEST_SKIP() << "needs 2 ranks";
  SmallStep st(make_mpi_communicator(MPI_COMM_WORLD, 1.0));
  const int me = st.me;
  auto forward = [&] { st.forward(); };
  auto error_of = [&](auto&& f) -> std::pair<ErrorCode, std::string> {
    try {
      f();
    } catch (const Error& e) {
      return {e.code(), e.what()};
    }
    return {ErrorCode::ok, ""};
  };
  if (me == W - 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    EXPECT_EQ(error_of(forward).first, ErrorCode::timeout) << "the late rank";
  } else {
    const auto t0 = std::chrono::steady_clock::now();
    const auto [code, what] = error_of(forward);
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(code, ErrorCode::timeout) << what;
    EXPECT_GE(waited, 1.0);
    EXPECT_LT(waited, 2.4) << "raised only after the stalled rank arrived";
    const auto [code2, what2] = error_of(forward);
    EXPECT_NE(code2, ErrorCode::ok) << "the layer took more work after a timeout";
    EXPECT_NE(what2.find("failed earlier"), std::string::npos) << what2;
    if (me == 0) {
      const std::string seen =
          strprintf("rank 0: %s after %.2f s, then %s", code == ErrorCode::timeout ? "Error(timeout)" : "no timeout",
                    waited, what2.find("failed earlier") != std::string::npos ? "'failed earlier'" : "no refusal");
      matrix_row("the last of " + std::to_string(W) + " MPI ranks stalls 2.5 s (deadline 1 s)",
                 "the others raise Error(timeout) in [1, 2.4) s, then refuse work", seen);
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(EpMpi, ConfigMismatchFailsEveryRank) {
  auto comm = make_mpi_communicator();
  const int W = world(), me = comm->rank();
  MoeConfig cfg{.num_experts = 2 * W, .top_k = 2, .hidden = me == 0 ? 256 : 128, .ffn = 128, .world_size = W,
                .rank = me};
  std::vector<bf16> w1(size_t(2) * 2 * 128 * cfg.hidden), w2(size_t(2) * cfg.hidden * 128);
  try {
    MoeLayer layer(cfg,
                   {TensorView::contiguous(w1.data(), DType::bf16, {2, 256, cfg.hidden}),
                    TensorView::contiguous(w2.data(), DType::bf16, {2, cfg.hidden, 128})},
                   comm);
    ADD_FAILURE() << "rank " << me << ": no error raised";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::config_mismatch) << e.what();
    EXPECT_NE(std::string(e.what()).find("hidden ranges over [128, 256]"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace epmoe::test
