// The libtorch FP8 inference bindings on mock ranks (threads), CPU tensors: the quantizer ops give the
// bytes of the host quantizers (epmoe/mxfp8.h, epmoe/fp8_block.h); MoeFp8 made from a bf16 Moe gives
// MoeLayer's own y on the same quantized weights (same bits) and matches the exact-format fp64
// references (kCpuTolerance, as tests/test_mxfp8.cpp and test_fp8_block.cpp state it for the layer);
// x given in MXFP8 gives forward()'s y on the bf16 x it came from (same bits, MoeLayer's contract).
// And the errors: a call autograd would record, a bf16 tensor where bytes belong, an FP8 op on a bf16
// layer, dims the format cannot block; the Meta kernels' shapes.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstring>
#include <string>
#include <vector>

#include "comm/mock_comm.h"
#include "ep_case.h"
#include "fp8_model.h"
#include "epmoe/error.h"
#include "epmoe/torch.h"

namespace epmoe::test {
namespace {

using torch_ext::Fp8Format;

at::Tensor from_bf16(const bf16* v, std::vector<int64_t> shape) {
  at::Tensor t = at::empty(shape, at::kBFloat16);
  std::memcpy(t.data_ptr(), v, size_t(t.numel()) * sizeof(bf16));
  return t;
}
template <class T>
std::vector<T> bytes_of(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  return std::vector<T>(static_cast<const T*>(c.data_ptr()), static_cast<const T*>(c.data_ptr()) + c.numel());
}
std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

// The test support's host-quantized model in the module's format.
Fp8Model quantize_model(const ModelWeights& M, Fp8Format f) {
  return test::quantize_model(M, f == Fp8Format::mxfp8 ? Fp8Layout::mxfp8 : Fp8Layout::block128);
}

TEST(TorchFp8, QuantizersGiveTheHostQuantizersBytes) {
  const ModelWeights M = make_weights(2, 128, 128, 77);  // w1 [2, 256, 128]: both formats block it
  const at::Tensor w1 = from_bf16(M.w1.data(), {2, 256, 128});
  for (Fp8Format f : {Fp8Format::mxfp8, Fp8Format::block128}) {
    const Fp8Model q = quantize_model(M, f);
    const auto [q1, s1] = f == Fp8Format::mxfp8 ? torch_ext::quantize_mxfp8(w1) : torch_ext::quantize_fp8_block128(w1);
    ASSERT_EQ(q1.scalar_type(), at::kByte);
    EXPECT_EQ(q1.sizes(), w1.sizes());
    EXPECT_EQ(bytes_of<uint8_t>(q1), std::vector<uint8_t>(q.w1.begin(), q.w1.begin() + q1.numel()));
    if (f == Fp8Format::mxfp8) {
      ASSERT_EQ(s1.scalar_type(), at::kByte);
      EXPECT_EQ(s1.sizes(), (std::vector<int64_t>{2, 256, 4}));
      EXPECT_EQ(bytes_of<uint8_t>(s1), std::vector<uint8_t>(q.w1s_e8m0.begin(), q.w1s_e8m0.begin() + s1.numel()));
    } else {
      ASSERT_EQ(s1.scalar_type(), at::kFloat);
      EXPECT_EQ(s1.sizes(), (std::vector<int64_t>{2, 2, 1}));
      EXPECT_EQ(bytes_of<float>(s1), std::vector<float>(q.w1s_f32.begin(), q.w1s_f32.begin() + s1.numel()));
    }
  }
  // fp32 input of the same values: the same bytes (bf16 -> fp32 is exact).
  EXPECT_TRUE(std::get<0>(torch_ext::quantize_mxfp8(w1.to(at::kFloat))).equal(std::get<0>(torch_ext::quantize_mxfp8(w1))));
  EXPECT_NE(message_of([&] { (void)torch_ext::quantize_mxfp8(at::zeros({4, 48})); }).find("multiple of 32"),
            std::string::npos);
  EXPECT_NE(message_of([&] { (void)torch_ext::quantize_fp8_block128(at::zeros({2, 64, 128})); }).find("multiples of 128"),
            std::string::npos);
  EXPECT_NE(message_of([&] { (void)torch_ext::quantize_mxfp8(at::zeros({4, 64}, at::kInt)); }).find("floating-point"),
            std::string::npos);
}

struct Fp8Case {
  Fp8Format format;
  EpCase ep;
};
std::string case_name(const Fp8Case& c) {
  return std::string(c.format == Fp8Format::mxfp8 ? "mxfp8_" : "block128_") + c.ep.name();
}

void PrintTo(const Fp8Case& c, std::ostream* os) { *os << case_name(c); }

void run_rank(const Fp8Case& fc, int me, std::shared_ptr<Communicator> comm) {
  const EpCase& c = fc.ep;
  const int W = c.world, E = c.E, k = c.k, H = c.hidden, F = c.ffn, El = E / W;
  const int64_t T = c.tokens_of(me);
  const MoeConfig cfg{.num_experts = E, .top_k = k, .hidden = H, .ffn = F, .world_size = W, .rank = me};
  const ModelWeights M = make_weights(E, H, F, c.seed);
  torch_ext::Moe moe(cfg, comm);
  {
    torch::NoGradGuard no_grad;
    moe->w1.copy_(from_bf16(M.w1_of(me * El), {El, 2 * F, H}));
    moe->w2.copy_(from_bf16(M.w2_of(me * El), {El, H, F}));
  }
  torch_ext::MoeFp8 fp8(*moe, fc.format);
  EXPECT_EQ(fp8->format(), fc.format);
  const Routing R = routing_of(c, me);
  const std::vector<bf16> xv = make_x(c.seed, me, T, H);
  const at::Tensor x = from_bf16(xv.data(), {T, H});
  at::Tensor ids = at::empty({T, k}, at::kInt), wts = at::empty({T, k}, at::kFloat);
  std::memcpy(ids.data_ptr(), R.ids.data(), R.ids.size() * 4);
  std::memcpy(wts.data_ptr(), R.weights.data(), R.weights.size() * 4);
  ids = ids.to(at::kLong);  // as torch.topk gives them

  torch::NoGradGuard no_grad;
  const at::Tensor y = fp8->forward(x, ids, wts);
  ASSERT_EQ(y.scalar_type(), at::kBFloat16);
  ASSERT_EQ(y.sizes(), x.sizes());
  const std::string tag = case_name(fc) + " rank " + std::to_string(me);

  // MoeLayer on the host quantizers' weights (this rank's shard): the same bits.
  const Fp8Model q = quantize_model(M, fc.format);
  const bool mxf = fc.format == Fp8Format::mxfp8;
  MoeLayer plain(cfg, q.shard(W, me), comm);
  std::vector<bf16> yv(size_t(T) * H);
  std::vector<int32_t> idv = R.ids;
  std::vector<float> wv = R.weights;
  plain.forward(TensorView::contiguous(const_cast<bf16*>(xv.data()), DType::bf16, {T, H}),
                TensorView::contiguous(idv.data(), DType::i32, {T, k}), TensorView::contiguous(wv.data(), DType::f32, {T, k}),
                TensorView::contiguous(yv.data(), DType::bf16, {T, H}));
  EXPECT_EQ(std::memcmp(yv.data(), y.data_ptr(), yv.size() * 2), 0) << tag << ": the module's y differs from MoeLayer's";

  // The exact-format reference over all experts.
  std::vector<float> ref(size_t(T) * H);
  q.reference(xv.data(), R.ids.data(), R.weights.data(), T, k, ref.data());
  EXPECT_TRUE(close_to_reference(static_cast<const bf16*>(y.data_ptr()), ref.data(), T, H, kCpuTolerance)) << tag;

  if (mxf) {  // x given in MXFP8: forward()'s y on the bf16 x it stands for
    const auto [xq, xs] = torch_ext::quantize_mxfp8(x);
    const at::Tensor y8 = fp8->forward_mxfp8(xq, xs, ids, wts);
    EXPECT_TRUE(y8.equal(y)) << tag << ": y of x given in MXFP8 differs";
  }
}

class TorchFp8Mock : public ::testing::TestWithParam<Fp8Case> {};
TEST_P(TorchFp8Mock, ModuleIsTheLayerAndMatchesTheFormatReference) {
  const Fp8Case c = GetParam();
  report_rank_errors(run_mock_ranks(c.ep.world, [&](int r, std::shared_ptr<Communicator> comm) { run_rank(c, r, comm); }),
                     case_name(c));
}
INSTANTIATE_TEST_SUITE_P(
    Worlds, TorchFp8Mock,
    ::testing::Values(Fp8Case{Fp8Format::mxfp8, make_ep_case(1, 8, 2, 128, 128, 40, RoutingKind::uniform, 0, 311)},
                      Fp8Case{Fp8Format::mxfp8, make_ep_case(2, 8, 2, 256, 96, 33, RoutingKind::zipf, 0, 312)},
                      Fp8Case{Fp8Format::mxfp8, make_ep_case(4, 16, 4, 128, 64, 24, RoutingKind::with_drops, 0, 313)},
                      Fp8Case{Fp8Format::block128, make_ep_case(1, 8, 2, 128, 128, 40, RoutingKind::uniform, 0, 314)},
                      Fp8Case{Fp8Format::block128, make_ep_case(2, 8, 2, 256, 128, 0, RoutingKind::uniform, 0, 315)},
                      Fp8Case{Fp8Format::block128, make_ep_case(4, 16, 4, 128, 256, 24, RoutingKind::with_drops, 0, 316)}),
    [](const auto& info) { return case_name(info.param); });

// One mock rank: every refusal names its cause, and the layer still works after each.
TEST(TorchFp8, RefusalsAreClear) {
  auto comms = make_mock_world(1);
  const MoeConfig cfg{.num_experts = 4, .top_k = 2, .hidden = 128, .ffn = 128, .world_size = 1, .rank = 0};
  torch_ext::Moe moe(cfg, comms[0]);
  torch_ext::MoeFp8 fp8(*moe, Fp8Format::mxfp8);
  const at::Tensor x = at::randn({6, 128}).to(at::kBFloat16), ids = at::randint(0, 4, {6, 1}, at::kLong);
  const at::Tensor id2 = at::cat({ids, (ids + 1) % 4}, 1), wts = at::full({6, 2}, 0.5f);
  // Grad mode with an input that requires grad: no y that silently cuts the graph.
  const at::Tensor xg = x.clone().requires_grad_();
  EXPECT_NE(message_of([&] { (void)fp8->forward(xg, id2, wts); }).find("forward-only"), std::string::npos);
  {
    torch::NoGradGuard no_grad;
    const at::Tensor y = fp8->forward(xg, id2, wts);  // the same input, under no_grad: fine
    EXPECT_EQ(y.sizes(), x.sizes());
    EXPECT_TRUE(y.to(at::kFloat).isfinite().all().item<bool>());
  }
  torch::NoGradGuard no_grad;
  // Weight bytes as bf16: the op names the uint8 it wants.
  EXPECT_NE(message_of([&] { (void)torch_ext::moe_fp8(fp8->handle(), x, id2, wts, moe->w1, fp8->w1_scale, fp8->w2,
                                                       fp8->w2_scale); })
                .find("uint8"),
            std::string::npos);
  // The FP8 op on a bf16 layer: the layer names its format.
  (void)moe->forward(x, id2, wts);
  const std::string on_bf16 = message_of([&] {
    (void)torch_ext::moe_fp8(moe->handle(), x, id2, wts, fp8->w1, fp8->w1_scale, fp8->w2, fp8->w2_scale);
  });
  EXPECT_NE(on_bf16.find("bf16"), std::string::npos) << on_bf16;
  // x in MXFP8 on a block-128 layer: refused.
  torch_ext::MoeFp8 b128(*moe, Fp8Format::block128);
  (void)b128->forward(x, id2, wts);
  const auto [xq, xs] = torch_ext::quantize_mxfp8(x);
  EXPECT_NE(message_of([&] { (void)b128->forward_mxfp8(xq, xs, id2, wts); }).find("needs an MXFP8 layer"),
            std::string::npos);
  // The capturable forward on x given in MXFP8: the int32 routing it wants (no casts), then the
  // engine it needs (a CPU layer has none).
  const at::Tensor T = at::full({1}, 6, at::kLong);
  EXPECT_NE(message_of([&] { (void)fp8->forward_capturable_mxfp8(xq, xs, id2, wts, T); }).find("int32"),
            std::string::npos);
  EXPECT_NE(message_of([&] { (void)fp8->forward_capturable_mxfp8(xq, xs, id2.to(at::kInt), wts, T); })
                .find("needs the GPU engine"),
            std::string::npos);
  // And the MXFP8 module still answers after all that.
  EXPECT_TRUE(fp8->forward(x, id2, wts).to(at::kFloat).isfinite().all().item<bool>());
}

TEST(TorchFp8, MetaKernelsGiveShapes) {
  const auto meta = [](std::vector<int64_t> s, at::ScalarType t) {
    return at::empty(s, at::TensorOptions().dtype(t).device(at::kMeta));
  };
  at::AutoDispatchBelowADInplaceOrView below;  // the Meta kernels themselves
  const at::Tensor ids = meta({5, 2}, at::kInt), w = meta({5, 2}, at::kFloat);
  const at::Tensor w1 = meta({4, 256, 128}, at::kByte), w2 = meta({4, 128, 128}, at::kByte);
  const at::Tensor s1 = meta({4, 256, 4}, at::kByte), s2 = meta({4, 128, 4}, at::kByte);
  const at::Tensor y = torch_ext::moe_fp8(12345, meta({5, 128}, at::kBFloat16), ids, w, w1, s1, w2, s2);
  EXPECT_TRUE(y.is_meta());
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{5, 128}));
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  const at::Tensor y8 =
      torch_ext::moe_mxfp8_x(12345, meta({5, 128}, at::kByte), meta({5, 4}, at::kByte), ids, w, w1, s1, w2, s2);
  EXPECT_EQ(y8.sizes(), (std::vector<int64_t>{5, 128}));
  EXPECT_EQ(y8.scalar_type(), at::kBFloat16);
  const at::Tensor yc = torch_ext::moe_capturable_mxfp8_x(12345, meta({5, 128}, at::kByte), meta({5, 4}, at::kByte),
                                                          ids, w, meta({1}, at::kLong), {w1, s1, w2, s2});
  EXPECT_TRUE(yc.is_meta());
  EXPECT_EQ(yc.sizes(), (std::vector<int64_t>{5, 128}));
  EXPECT_EQ(yc.scalar_type(), at::kBFloat16);
}

}  // namespace
}  // namespace epmoe::test
