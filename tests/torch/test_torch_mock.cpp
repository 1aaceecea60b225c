// The libtorch bindings on mock ranks (threads), CPU tensors: the torch::nn::Module forward and
// autograd backward (y.backward(dy)) give x.grad, topk_weights.grad, w1.grad and w2.grad that match
// the fp64 reference gradients of the whole layer (tests/backward_case.h's reference_grads, with its
// tolerances: the bindings add one bf16 rounding of dW, which kGradElem's margin covers), and the
// forward matches MoeLayer's own. Also: replaced Parameters are picked up (weights bound per call),
// the ops' Meta kernels give the shapes, and a bad handle raises.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "backward_case.h"
#include "comm/mock_comm.h"
#include "ep_case.h"
#include "epmoe/error.h"
#include "epmoe/torch.h"

namespace epmoe::test {
namespace {

at::Tensor from_bf16(const std::vector<bf16>& v, std::vector<int64_t> shape) {
  at::Tensor t = at::empty(shape, at::kBFloat16);
  std::memcpy(t.data_ptr(), v.data(), v.size() * sizeof(bf16));
  return t;
}
std::vector<float> to_float(const at::Tensor& t) {
  const at::Tensor f = t.to(at::kFloat).contiguous();
  return std::vector<float>(f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
}

void run_rank(const EpCase& c, int me, std::shared_ptr<Communicator> comm) {
  const int W = c.world, E = c.E, k = c.k, H = c.hidden, F = c.ffn, El = E / W;
  const int64_t T = c.tokens_of(me);
  const MoeConfig cfg{.num_experts = E, .top_k = k, .hidden = H, .ffn = F, .world_size = W, .rank = me};
  torch_ext::Moe moe(cfg, comm);
  // This rank's experts of the case's model (the reference's weights).
  const ModelWeights mw = make_weights(E, H, F, c.seed);
  {
    torch::NoGradGuard no_grad;
    moe->w1.copy_(from_bf16(std::vector<bf16>(mw.w1_of(me * El), mw.w1_of(me * El) + size_t(El) * 2 * F * H),
                            {El, 2 * F, H}));
    moe->w2.copy_(from_bf16(std::vector<bf16>(mw.w2_of(me * El), mw.w2_of(me * El) + size_t(El) * H * F),
                            {El, H, F}));
  }
  const Routing R = routing_of(c, me);
  at::Tensor x = from_bf16(make_x(c.seed, me, T, H), {T, H}).requires_grad_();
  at::Tensor ids = at::empty({T, k}, at::kInt);
  std::memcpy(ids.data_ptr(), R.ids.data(), R.ids.size() * 4);
  ids = ids.to(at::kLong);  // as torch.topk gives them
  at::Tensor wts = at::empty({T, k}, at::kFloat);
  std::memcpy(wts.data_ptr(), R.weights.data(), R.weights.size() * 4);
  wts.requires_grad_();
  const at::Tensor dy = from_bf16(dy_of(c, me), {T, H});

  at::Tensor y = moe->forward(x, ids, wts);
  ASSERT_EQ(y.scalar_type(), at::kBFloat16);
  ASSERT_EQ(y.sizes(), x.sizes());
  y.backward(dy);

  const ReferenceGrads ref = reference_grads(c, me);
  const std::string tag = c.name() + " rank " + std::to_string(me);
  ASSERT_TRUE(x.grad().defined() && wts.grad().defined() && moe->w1.grad().defined() && moe->w2.grad().defined())
      << tag;
  EXPECT_TRUE(grad_close("x.grad", to_float(x.grad()), ref.dx)) << tag;
  EXPECT_TRUE(grad_close("topk_weights.grad", to_float(wts.grad()), ref.dwts)) << tag;
  EXPECT_TRUE(grad_close("w1.grad", to_float(moe->w1.grad()), ref.dw1)) << tag;
  EXPECT_TRUE(grad_close("w2.grad", to_float(moe->w2.grad()), ref.dw2)) << tag;

  // The module's forward is MoeLayer's (same bits).
  std::vector<bf16> w1v(size_t(El) * 2 * F * H), w2v(size_t(El) * H * F);
  std::memcpy(w1v.data(), moe->w1.data_ptr(), w1v.size() * 2);
  std::memcpy(w2v.data(), moe->w2.data_ptr(), w2v.size() * 2);
  MoeLayer plain(cfg, {TensorView::contiguous(w1v.data(), DType::bf16, {El, 2 * F, H}),
                       TensorView::contiguous(w2v.data(), DType::bf16, {El, H, F})}, comm);
  const std::vector<bf16> xv = make_x(c.seed, me, T, H);
  std::vector<bf16> yv(size_t(T) * H);
  std::vector<int32_t> idv = R.ids;
  std::vector<float> wv = R.weights;
  plain.forward(TensorView::contiguous(const_cast<bf16*>(xv.data()), DType::bf16, {T, H}),
                TensorView::contiguous(idv.data(), DType::i32, {T, k}),
                TensorView::contiguous(wv.data(), DType::f32, {T, k}), TensorView::contiguous(yv.data(), DType::bf16, {T, H}));
  EXPECT_EQ(std::memcmp(yv.data(), y.data_ptr(), yv.size() * 2), 0) << tag << ": the module's y differs";

  // Replaced Parameters (new storage): the next forward uses them.
  {
    torch::NoGradGuard no_grad;
    moe->w2.set_data(moe->w2.clone() * 2);
  }
  const at::Tensor y2 = moe->forward(x, ids, wts);
  const at::Tensor want = (y.to(at::kFloat) * 2);
  const double err = (y2.to(at::kFloat) - want).abs().max().item<double>(),
               scale = want.abs().max().item<double>();
  EXPECT_LE(err, scale / 64 + 1e-6) << tag << ": y with w2 doubled should double (max err " << err << ")";
}

class TorchMock : public ::testing::TestWithParam<EpCase> {};
TEST_P(TorchMock, ModuleGradientsMatchReference) {
  const EpCase c = GetParam();
  report_rank_errors(run_mock_ranks(c.world, [&](int r, std::shared_ptr<Communicator> comm) { run_rank(c, r, comm); }),
                     c.name());
}
INSTANTIATE_TEST_SUITE_P(
    Worlds, TorchMock,
    ::testing::Values(make_ep_case(1, 8, 2, 128, 128, 40, RoutingKind::uniform, 0, 301),
                      make_ep_case(2, 8, 2, 128, 128, 32, RoutingKind::zipf, 0, 302),
                      make_ep_case(4, 16, 4, 128, 128, 24, RoutingKind::with_drops, 0, 303)),
    [](const auto& info) { return info.param.name(); });

// moe_backward_accumulate (Tensor(a!) dw1, Tensor(b!) dw2): two backwards of one saved forward add
// twice the gradient into fp32 main grads.
TEST(TorchOps, BackwardAccumulateAddsIntoMainGrads) {
  const EpCase c = make_ep_case(2, 8, 2, 128, 128, 24, RoutingKind::uniform, 0, 404);
  auto run = [&](int me, std::shared_ptr<Communicator> comm) {
    const int E = c.E, k = c.k, H = c.hidden, F = c.ffn, El = E / c.world;
    const int64_t T = c.tokens_of(me);
    const ModelWeights mw = make_weights(E, H, F, c.seed);
    const at::Tensor w1 = from_bf16(std::vector<bf16>(mw.w1_of(me * El), mw.w1_of(me * El) + size_t(El) * 2 * F * H),
                                    {El, 2 * F, H});
    const at::Tensor w2 = from_bf16(std::vector<bf16>(mw.w2_of(me * El), mw.w2_of(me * El) + size_t(El) * H * F),
                                    {El, H, F});
    const MoeConfig cfg{.num_experts = E, .top_k = k, .hidden = H, .ffn = F, .world_size = c.world, .rank = me};
    const int64_t layer =
        torch_ext::register_layer(std::make_shared<MoeLayer>(cfg, ExpertWeights{torch_ext::view_of(w1),
                                                                                torch_ext::view_of(w2)}, comm));
    const Routing R = routing_of(c, me);
    const at::Tensor x = from_bf16(make_x(c.seed, me, T, H), {T, H}), dy = from_bf16(dy_of(c, me), {T, H});
    at::Tensor ids = at::empty({T, k}, at::kInt), wts = at::empty({T, k}, at::kFloat);
    std::memcpy(ids.data_ptr(), R.ids.data(), R.ids.size() * 4);
    std::memcpy(wts.data_ptr(), R.weights.data(), R.weights.size() * 4);
    auto& d = c10::Dispatcher::singleton();
    const auto fwd = d.findSchemaOrThrow("epmoe::moe_forward", "")
                         .typed<std::tuple<at::Tensor, int64_t>(int64_t, const at::Tensor&, const at::Tensor&,
                                                                const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                                bool)>();
    const auto acc = d.findSchemaOrThrow("epmoe::moe_backward_accumulate", "")
                         .typed<std::tuple<at::Tensor, at::Tensor>(int64_t, int64_t, const at::Tensor&,
                                                                   const at::Tensor&, const at::Tensor&, at::Tensor&,
                                                                   at::Tensor&)>();
    auto [y, ctx] = fwd.call(layer, x, ids, wts, w1, w2, true);
    at::Tensor g1 = at::zeros({El, 2 * F, H}, at::kFloat), g2 = at::zeros({El, H, F}, at::kFloat);
    auto [dx, dtw] = acc.call(layer, ctx, dy, w1, w2, g1, g2);
    (void)acc.call(layer, ctx, dy, w1, w2, g1, g2);
    const ReferenceGrads ref = reference_grads(c, me);
    std::vector<double> two1(ref.dw1.size()), two2(ref.dw2.size());
    for (size_t i = 0; i < two1.size(); ++i) two1[i] = 2 * ref.dw1[i];
    for (size_t i = 0; i < two2.size(); ++i) two2[i] = 2 * ref.dw2[i];
    EXPECT_TRUE(grad_close("dx", to_float(dx), ref.dx)) << "rank " << me;
    EXPECT_TRUE(grad_close("d_topk_weights", to_float(dtw), ref.dwts)) << "rank " << me;
    EXPECT_TRUE(grad_close("dw1 accumulated twice", to_float(g1), two1)) << "rank " << me;
    EXPECT_TRUE(grad_close("dw2 accumulated twice", to_float(g2), two2)) << "rank " << me;
    c10::Dispatcher::singleton().findSchemaOrThrow("epmoe::release_context", "").typed<void(int64_t)>().call(ctx);
    torch_ext::release_layer(layer);
  };
  report_rank_errors(run_mock_ranks(c.world, run), "backward_accumulate");
}

TEST(TorchOps, MetaKernelsGiveShapes) {
  const at::Tensor x = at::empty({5, 128}, at::TensorOptions().dtype(at::kBFloat16).device(at::kMeta));
  const at::Tensor ids = at::empty({5, 2}, at::TensorOptions().dtype(at::kInt).device(at::kMeta));
  const at::Tensor w = at::empty({5, 2}, at::TensorOptions().dtype(at::kFloat).device(at::kMeta));
  const at::Tensor w1 = at::empty({4, 256, 128}, at::TensorOptions().dtype(at::kBFloat16).device(at::kMeta));
  const at::Tensor w2 = at::empty({4, 128, 128}, at::TensorOptions().dtype(at::kBFloat16).device(at::kMeta));
  at::AutoDispatchBelowADInplaceOrView below;  // the Meta kernel itself
  const at::Tensor y = torch_ext::moe(/*layer=*/12345, x, ids, w, w1, w2);
  EXPECT_TRUE(y.is_meta());
  EXPECT_EQ(y.sizes(), x.sizes());
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
}

TEST(TorchOps, UnknownHandleRaises) {
  const at::Tensor x = at::zeros({2, 128}, at::kBFloat16), ids = at::zeros({2, 2}, at::kInt),
                   w = at::zeros({2, 2}, at::kFloat), w1 = at::zeros({4, 256, 128}, at::kBFloat16),
                   w2 = at::zeros({4, 128, 128}, at::kBFloat16);
  try {
    (void)torch_ext::moe(987654321, x, ids, w, w1, w2);
    ADD_FAILURE() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("no layer with handle"), std::string::npos) << e.what();
  }
}

// The C++ modules' capturable forward on what it cannot run: a CPU layer asked for a capacity (at the
// first call, which makes the layer), and, on a CPU layer without one, the op itself (needs the GPU
// engine) and a cast it will not make. (Graph replays: test_torch_cuda.)
TEST(TorchOps, CapturableForwardRefusesClearly) {
  const MoeConfig cfg{.num_experts = 8, .top_k = 2, .hidden = 128, .ffn = 128, .world_size = 1, .rank = 0};
  const at::Tensor x = at::zeros({4, 128}, at::kBFloat16), ids = at::zeros({4, 2}, at::kInt),
                   wts = at::zeros({4, 2}, at::kFloat), T = at::full({1}, 4, at::kLong);
  torch::NoGradGuard no_grad;
  LayerOptions opt;
  opt.max_tokens_per_rank = 16;
  torch_ext::Moe capped(cfg, make_mock_world(1)[0], opt);
  auto what = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_NE(what([&] { capped->forward_capturable(x, ids, wts, T); }).find("needs cuda weights"), std::string::npos);
  torch_ext::Moe plain(cfg, make_mock_world(1)[0]);
  EXPECT_NE(what([&] { plain->forward_capturable(x, ids, wts, T); }).find("needs the GPU engine"), std::string::npos);
  EXPECT_NE(what([&] { plain->forward_capturable(x, ids.to(at::kLong), wts, T); }).find("int32"), std::string::npos);
  plain->check_capturable();  // (nothing to report on a CPU layer)
}

}  // namespace
}  // namespace epmoe::test
