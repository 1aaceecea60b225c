// MoeLayer::bind_weights on the CPU engine (mock ranks): a layer bound to other weights computes
// what a layer built with them computes (same bits, forward and backward), and weights of another
// shape or dtype are refused without changing what the layer uses.
#include <gtest/gtest.h>

#include <vector>

#include "comm/mock_comm.h"
#include "epmoe/error.h"
#include "epmoe/moe_layer.h"
#include "test_support.h"

namespace epmoe::test {
namespace {

struct Weights {
  std::vector<bf16> w1, w2;
  ExpertWeights view(int El, int H, int F) {
    return {TensorView::contiguous(w1.data(), DType::bf16, {El, 2 * F, H}),
            TensorView::contiguous(w2.data(), DType::bf16, {El, H, F})};
  }
};

TEST(BindWeights, BoundLayerMatchesALayerBuiltWithTheWeights) {
  constexpr int W = 2, E = 8, k = 2, H = 128, F = 128, El = E / W;
  constexpr int64_t T = 24;
  auto run = [&](int me, std::shared_ptr<Communicator> comm) {
    Weights a{random_bf16(size_t(El) * 2 * F * H, 11 + me, 0.1f), random_bf16(size_t(El) * H * F, 21 + me, 0.1f)};
    Weights b{random_bf16(size_t(El) * 2 * F * H, 31 + me, 0.1f), random_bf16(size_t(El) * H * F, 41 + me, 0.1f)};
    const MoeConfig cfg{.num_experts = E, .top_k = k, .hidden = H, .ffn = F, .world_size = W, .rank = me};
    MoeLayer bound(cfg, a.view(El, H, F), comm);
    MoeLayer built(cfg, b.view(El, H, F), comm);
    bound.bind_weights(b.view(El, H, F));
    const std::vector<bf16> x = make_x(5, me, T, H), dy = random_bf16(size_t(T) * H, 50 + me, 1.0f);
    const Routing R = make_routing(T, E, k, RoutingKind::uniform, 77 + me);
    auto tv = [](const auto& v, DType t, std::initializer_list<int64_t> s) {
      return TensorView::contiguous(const_cast<void*>(static_cast<const void*>(v.data())), t, s);
    };
    auto pass = [&](MoeLayer& l, std::vector<bf16>& y, std::vector<bf16>& dx, std::vector<float>& dw1) {
      y.assign(size_t(T) * H, bf16(0.f));
      dx.assign(size_t(T) * H, bf16(0.f));
      dw1.assign(size_t(El) * 2 * F * H, 0.f);
      std::vector<float> dtw(size_t(T) * k), dw2(size_t(El) * H * F);
      MoeForwardContext ctx;
      l.forward(tv(x, DType::bf16, {T, H}), tv(R.ids, DType::i32, {T, k}), tv(R.weights, DType::f32, {T, k}),
                tv(y, DType::bf16, {T, H}), nullptr, &ctx);
      l.backward(ctx, tv(dy, DType::bf16, {T, H}), tv(dx, DType::bf16, {T, H}), tv(dtw, DType::f32, {T, k}),
                 {tv(dw1, DType::f32, {El, 2 * F, H}), tv(dw2, DType::f32, {El, H, F}), false});
    };
    std::vector<bf16> y1, y2, dx1, dx2;
    std::vector<float> g1, g2;
    pass(bound, y1, dx1, g1);
    pass(built, y2, dx2, g2);
    size_t diff = 0;
    for (size_t i = 0; i < y1.size(); ++i) diff += y1[i].bits != y2[i].bits || dx1[i].bits != dx2[i].bits;
    EXPECT_EQ(diff, 0u) << "rank " << me << ": y / dx of the bound layer differ";
    EXPECT_EQ(g1, g2) << "rank " << me << ": dw1 of the bound layer differs";

    // Refused: another shape, another dtype; the layer keeps the weights it had.
    Weights small{random_bf16(size_t(El) * 2 * F * H / 2, 1, 0.1f), random_bf16(size_t(El) * H * F, 2, 0.1f)};
    const ExpertWeights bad_shape{TensorView::contiguous(small.w1.data(), DType::bf16, {El, F, H}),
                                  TensorView::contiguous(small.w2.data(), DType::bf16, {El, H, F})};
    EXPECT_THROW(bound.bind_weights(bad_shape), Error);
    std::vector<float> f32(size_t(El) * 2 * F * H);
    const ExpertWeights bad_dtype{TensorView::contiguous(f32.data(), DType::f32, {El, 2 * F, H}),
                                  TensorView::contiguous(b.w2.data(), DType::bf16, {El, H, F})};
    EXPECT_THROW(bound.bind_weights(bad_dtype), Error);
    std::vector<bf16> y3, dx3;
    std::vector<float> g3;
    pass(bound, y3, dx3, g3);
    diff = 0;
    for (size_t i = 0; i < y1.size(); ++i) diff += y1[i].bits != y3[i].bits;
    EXPECT_EQ(diff, 0u) << "rank " << me << ": a refused bind changed the layer";
  };
  report_rank_errors(run_mock_ranks(W, run), "bind_weights");
}

}  // namespace
}  // namespace epmoe::test
