// The EP backward on mock ranks (threads), world in {1, 2, 4, 8}: every gradient against the fp64
// reference (tests/backward_case.h), on the routing cases of the forward suites, both save policies,
// f32 and bf16 weight gradients; and the errors that must reach every rank.
#include <gtest/gtest.h>

#include "backward_case.h"
#include "comm/mock_comm.h"
#include "epmoe/error.h"

namespace epmoe::test {
namespace {

using RK = RoutingKind;

BackwardCase bcase(int world, int E, int k, int hidden, int ffn, int64_t T, RK routing, int focus = 0,
                   SavePolicy policy = SavePolicy::rows_and_preactivation, DType grads = DType::f32) {
  BackwardCase c;
  c.ep = make_ep_case(world, E, k, hidden, ffn, T, routing, focus, uint64_t(7000 + world * 100 + E * 3 + k));
  c.policy = policy;
  c.grad_dtype = grads;
  return c;
}

void run_on_mock_ranks(const BackwardCase& c) {
  auto run = [&](int, std::shared_ptr<Communicator> comm) { run_backward_case_cpu(c, comm); };
  report_rank_errors(run_mock_ranks(c.ep.world, run), c.name());
}

class BackwardMock : public ::testing::TestWithParam<BackwardCase> {};
TEST_P(BackwardMock, GradientsMatchReference) { run_on_mock_ranks(GetParam()); }

INSTANTIATE_TEST_SUITE_P(
    Shapes, BackwardMock,
    ::testing::Values(bcase(1, 8, 2, 128, 128, 48, RK::uniform), bcase(2, 8, 2, 128, 128, 48, RK::uniform),
                      bcase(4, 16, 4, 128, 256, 32, RK::uniform), bcase(8, 32, 8, 128, 128, 24, RK::uniform),
                      bcase(8, 32, 4, 128, 128, 32, RK::zipf), bcase(2, 8, 1, 256, 128, 16, RK::uniform),
                      bcase(4, 16, 4, 128, 128, 32, RK::uniform, 0, SavePolicy::rows_recompute),
                      bcase(2, 8, 2, 128, 128, 32, RK::uniform, 0, SavePolicy::rows_and_preactivation, DType::bf16),
                      bcase(4, 16, 2, 128, 128, 32, RK::zipf, 0, SavePolicy::rows_recompute, DType::bf16)),
    [](const auto& info) { return info.param.name(); });

INSTANTIATE_TEST_SUITE_P(
    Routing, BackwardMock,
    ::testing::Values(bcase(4, 8, 2, 128, 128, 32, RK::one_expert, 5),   // every token to one expert
                      bcase(4, 16, 4, 128, 128, 32, RK::local_only, 0),  // ranks 1-3's experts idle
                      bcase(4, 16, 4, 128, 128, 32, RK::with_drops),     // -1 slots and tokens routed nowhere
                      bcase(2, 8, 2, 128, 128, 16, RK::all_dropped),     // nothing sent at all
                      bcase(8, 16, 4, 128, 128, 1, RK::uniform)),        // T = 1
    [](const auto& info) { return info.param.name() + "_T" + std::to_string(info.param.ep.tokens_of(0)); });

// hidden and ffn multiples of 16 but not of 128 (the CPU engine; kDimAlignment).
TEST(BackwardMockEdge, DimsMultipleOf16) {
  for (const auto& [H, F] : {std::pair{144, 80}, std::pair{16, 48}}) {
    BackwardCase c = bcase(2, 8, 2, H, F, 24, RK::uniform);
    run_on_mock_ranks(c);
  }
}

TEST(BackwardMockEdge, RankWithZeroTokens) {
  BackwardCase c = bcase(4, 16, 4, 128, 128, 0, RK::uniform);
  c.ep.tokens = {40, 0, 17, 1};
  run_on_mock_ranks(c);
}

TEST(BackwardMockEdge, UnevenTokensZipf) {
  BackwardCase c = bcase(8, 32, 4, 128, 128, 0, RK::zipf);
  c.ep.tokens = {1, 60, 0, 17, 33, 3, 40, 5};
  run_on_mock_ranks(c);
}

// ---- errors: each reaches every rank, none hangs ---------------------------------------------------
struct ErrLayer {
  std::vector<bf16> w1, w2;
  std::unique_ptr<MoeLayer> layer;
  ErrLayer(int W, int me, std::shared_ptr<Communicator> comm, int E = 8, int k = 2, int H = 128, int F = 128) {
    const int El = E / W;
    w1 = random_bf16(size_t(El) * 2 * F * H, 1 + me, 0.1f);
    w2 = random_bf16(size_t(El) * H * F, 2 + me, 0.1f);
    const MoeConfig cfg{.num_experts = E, .top_k = k, .hidden = H, .ffn = F, .world_size = W, .rank = me};
    layer = std::make_unique<MoeLayer>(cfg,
                                       ExpertWeights{TensorView::contiguous(w1.data(), DType::bf16, {El, 2 * F, H}),
                                                     TensorView::contiguous(w2.data(), DType::bf16, {El, H, F})},
                                       comm);
  }
};

// Runs a forward (saving into ctx unless `no_save`) and a backward whose arguments `spoil` may break
// on one rank; every rank must throw `code` naming `text`.
template <class Spoil>
void expect_error_on_every_rank(int W, ErrorCode code, const std::string& text, Spoil spoil) {
  auto errors = run_mock_ranks(W, [&](int me, std::shared_ptr<Communicator> comm) {
    ErrLayer L(W, me, comm);
    const int64_t T = 8;
    const int H = 128, k = 2;
    auto x = make_x(3, me, T, H);
    auto R = make_routing(T, 8, k, RoutingKind::uniform, mix(4, me));
    std::vector<bf16> y(size_t(T) * H), dy = random_bf16(size_t(T) * H, 5, 1.0f), dx(size_t(T) * H);
    std::vector<float> dwts(size_t(T) * k), dw1(size_t(8 / W) * 256 * 128), dw2(size_t(8 / W) * 128 * 128);
    MoeForwardContext ctx;
    int64_t dy_rows = T;
    bool save = true;
    spoil(me, dy_rows, save);
    L.layer->forward(TensorView::contiguous(x.data(), DType::bf16, {T, H}),
                     TensorView::contiguous(R.ids.data(), DType::i32, {T, k}),
                     TensorView::contiguous(R.weights.data(), DType::f32, {T, k}),
                     TensorView::contiguous(y.data(), DType::bf16, {T, H}), nullptr, save ? &ctx : nullptr);
    try {
      ExpertGradients g{TensorView::contiguous(dw1.data(), DType::f32, {8 / W, 256, 128}),
                        TensorView::contiguous(dw2.data(), DType::f32, {8 / W, 128, 128})};
      L.layer->backward(ctx, TensorView::contiguous(dy.data(), DType::bf16, {dy_rows, H}),
                        TensorView::contiguous(dx.data(), DType::bf16, {T, H}),
                        TensorView::contiguous(dwts.data(), DType::f32, {T, k}), g);
      ADD_FAILURE() << "rank " << me << ": no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << "rank " << me << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << "rank " << me << ": " << e.what();
    }
  });
  for (int r = 0; r < W; ++r)
    if (errors[r]) ADD_FAILURE() << "rank " << r << " threw outside the check";
}

TEST(BackwardMockErrors, WrongDyShapeOnOneRankFailsEveryRank) {
  expect_error_on_every_rank(4, ErrorCode::invalid_argument, "rank 2: backward: dy: expected bf16[8, 128]",
                             [](int me, int64_t& dy_rows, bool&) {
                               if (me == 2) dy_rows = 7;
                             });
}

TEST(BackwardMockErrors, UnsavedContextOnOneRankFailsEveryRank) {
  expect_error_on_every_rank(2, ErrorCode::invalid_argument, "rank 1: backward: the context holds no saved forward",
                             [](int me, int64_t&, bool& save) {
                               if (me == 1) save = false;
                             });
}

TEST(BackwardMockErrors, ContextOfAnotherLayer) {
  auto errors = run_mock_ranks(2, [&](int me, std::shared_ptr<Communicator> comm) {
    ErrLayer a(2, me, comm), b(2, me, comm);
    const int64_t T = 4;
    auto x = make_x(3, me, T, 128);
    auto R = make_routing(T, 8, 2, RoutingKind::uniform, mix(4, me));
    std::vector<bf16> y(size_t(T) * 128), dx(y.size());
    std::vector<float> dwts(size_t(T) * 2), dw1(size_t(4) * 256 * 128), dw2(size_t(4) * 128 * 128);
    MoeForwardContext ctx;
    a.layer->forward(TensorView::contiguous(x.data(), DType::bf16, {T, 128}),
                     TensorView::contiguous(R.ids.data(), DType::i32, {T, 2}),
                     TensorView::contiguous(R.weights.data(), DType::f32, {T, 2}),
                     TensorView::contiguous(y.data(), DType::bf16, {T, 128}), nullptr, &ctx);
    EXPECT_THROW(b.layer->backward(ctx, TensorView::contiguous(y.data(), DType::bf16, {T, 128}),
                                   TensorView::contiguous(dx.data(), DType::bf16, {T, 128}),
                                   TensorView::contiguous(dwts.data(), DType::f32, {T, 2}),
                                   {TensorView::contiguous(dw1.data(), DType::f32, {4, 256, 128}),
                                    TensorView::contiguous(dw2.data(), DType::f32, {4, 128, 128})}),
                 Error);
  });
  for (int r = 0; r < 2; ++r)
    if (errors[r]) ADD_FAILURE() << "rank " << r << " threw outside the check";
}

}  // namespace
}  // namespace epmoe::test
