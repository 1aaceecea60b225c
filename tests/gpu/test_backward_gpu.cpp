// The backward on one GPU (NCCL single-rank communicator): MoeLayer::forward(..., save) +
// backward against the fp64 reference gradients (tests/backward_case.h) on the forward suites'
// routing cases (uniform, skewed, all to one expert with the others idle, -1 slots, nothing routed,
// T = 1, T = 0), both save policies, f32 and bf16 weight gradients, both paths (cuBLAS, and sm90
// where supported: its forward, and dW through the sm_90 wgrad kernel where hidden and ffn are
// multiples of 256, else cuBLAS). Also: a second backward gives the same bits, the two policies give the same
// bits, accumulate adds into what dw holds, the saved bytes are what the policy states, and bad
// arguments raise without breaking the layer. Skips without a CUDA device.
//
// Tolerances: tests/backward_case.h's kGradElem / kGradL2 (the CPU engine's), which cover the device
// path's extra roundings too: da = dy.W2 and dx per pair are stored as bf16 before the SwiGLU backward
// and the per-row sum (2^-9 relative each, independent across elements), and dh is a bf16 GEMM
// operand (the CPU keeps it in fp32): a few more 2^-9 terms against a bound of 2^-5 of max |ref|.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backward_case.h"
#include "device_array.h"
#include "single_comm.h"
#include "ep_case.h"
#include "epmoe/error.h"
#include "epmoe/moe_layer.h"
#include "epmoe/nccl_communicator.h"
#include "kernels/expert_problem.cuh"
#include "kernels/sm90/experts.cuh"
#include "test_support.h"

namespace epmoe::test {
namespace {

bool sm90_here() { return kernels::sm90_experts_supported(current_device()); }

// One layer (world 1: every expert here) with its weights on the device.
struct GpuLayer {
  MoeConfig cfg;
  std::unique_ptr<Dev<bf16>> w1, w2;
  std::unique_ptr<MoeLayer> layer;
  GpuLayer(const EpCase& c, ExpertPath path, SavePolicy policy, ExpertPath wgrad = ExpertPath::automatic,
           GemmGrouping dgrad = GemmGrouping::automatic) {
    cfg = MoeConfig{.num_experts = c.E, .top_k = c.k, .hidden = c.hidden, .ffn = c.ffn, .world_size = 1, .rank = 0};
    const ModelWeights mw = make_weights(c.E, c.hidden, c.ffn, c.seed);
    w1 = std::make_unique<Dev<bf16>>(mw.w1);
    w2 = std::make_unique<Dev<bf16>>(mw.w2);
    LayerOptions opt;
    opt.expert_path = path;
    opt.save_policy = policy;
    opt.weight_grad_path = wgrad;
    opt.data_grad_grouping = dgrad;
    layer = std::make_unique<MoeLayer>(
        cfg,
        ExpertWeights{dview(w1->get(), DType::bf16, {c.E, 2 * int64_t(c.ffn), c.hidden}),
                      dview(w2->get(), DType::bf16, {c.E, int64_t(c.hidden), c.ffn})},
        single_comm(), opt);
  }
};

// What one forward(save) + backward produced, on the host (dW widened to float).
struct HostGrads {
  std::vector<bf16> dx;
  std::vector<float> dwts, dw1, dw2;
  std::vector<uint16_t> dw1_bits, dw2_bits;  // bf16 gradients' bits (bit comparisons)
  int64_t pairs = 0;
  double bytes_per_pair = 0;
};

// The case's inputs on the device, reusable across runs.
struct DeviceInputs {
  int64_t T;
  Dev<bf16> x, dy;
  Dev<int32_t> ids;
  Dev<float> wts;
  DeviceInputs(const EpCase& c)
      : T(c.tokens_of(0)), x(make_x(c.seed, 0, c.tokens_of(0), c.hidden)), dy(dy_of(c, 0)), ids(routing_of(c, 0).ids),
        wts(routing_of(c, 0).weights) {}
};

// forward(save) then backward (twice with `backward_twice`, keeping the second's dW). With
// `prefill1/2` the dW tensors start from those values and accumulate into them.
HostGrads run_pass(GpuLayer& L, const DeviceInputs& in, DType gd, const std::vector<float>* prefill1 = nullptr,
                   const std::vector<float>* prefill2 = nullptr) {
  const MoeConfig& cfg = L.cfg;
  const int64_t T = in.T, H = cfg.hidden, F = cfg.ffn, E = cfg.num_experts, k = cfg.top_k;
  const size_t n1 = size_t(E) * 2 * F * H, n2 = size_t(E) * H * F;
  Dev<bf16> y(size_t(T) * H, 0xff), dx(size_t(T) * H, 0xff);
  Dev<float> dwts(size_t(T) * k, 0xff);
  const size_t es = gd == DType::f32 ? 4 : 2;
  Dev<uint8_t> dw1(n1 * es, 0xff), dw2(n2 * es, 0xff);  // NaN bits in both dtypes: unwritten shows
  const bool accumulate = prefill1 != nullptr;
  if (accumulate) {
    for (auto [dst, src] : {std::pair{&dw1, prefill1}, std::pair{&dw2, prefill2}}) {
      std::vector<uint8_t> raw(src->size() * es);
      for (size_t i = 0; i < src->size(); ++i) {
        if (gd == DType::f32) std::memcpy(&raw[i * 4], &(*src)[i], 4);
        else {
          const uint16_t b = bf16::from_float((*src)[i]);
          std::memcpy(&raw[i * 2], &b, 2);
        }
      }
      ck(cudaMemcpy(dst->get(), raw.data(), raw.size(), cudaMemcpyHostToDevice), "prefill");
      ck(cudaDeviceSynchronize(), "prefill sync");  // (a pageable upload may still be in flight: device_array.h)
    }
  }
  MoeForwardContext ctx;
  L.layer->forward(dview(in.x.get(), DType::bf16, {T, H}), dview(in.ids.get(), DType::i32, {T, k}),
                   dview(in.wts.get(), DType::f32, {T, k}), dview(y.get(), DType::bf16, {T, H}), nullptr, &ctx);
  ExpertGradients g;
  g.dw1 = dview(dw1.get(), gd, {E, 2 * F, H});
  g.dw2 = dview(dw2.get(), gd, {E, H, F});
  g.accumulate = accumulate;
  L.layer->backward(ctx, dview(in.dy.get(), DType::bf16, {T, H}), dview(dx.get(), DType::bf16, {T, H}),
                    dview(dwts.get(), DType::f32, {T, k}), g, nullptr);
  ck(cudaDeviceSynchronize(), "sync");
  HostGrads h;
  h.dx = dx.host();
  h.dwts = dwts.host();
  auto widen = [&](const Dev<uint8_t>& d, size_t n, std::vector<float>& f, std::vector<uint16_t>& bits) {
    const std::vector<uint8_t> raw = d.host();
    f.resize(n);
    if (gd == DType::f32) {
      std::memcpy(f.data(), raw.data(), n * 4);
    } else {
      bits.resize(n);
      std::memcpy(bits.data(), raw.data(), n * 2);
      for (size_t i = 0; i < n; ++i) f[i] = bf16::to_float(bits[i]);
    }
  };
  widen(dw1, n1, h.dw1, h.dw1_bits);
  widen(dw2, n2, h.dw2, h.dw2_bits);
  h.pairs = ctx.routed_pairs();
  h.bytes_per_pair = ctx.activation_bytes_per_pair();
  return h;
}

bool same_bits(const HostGrads& a, const HostGrads& b) {
  if (a.dx.size() != b.dx.size()) return false;
  for (size_t i = 0; i < a.dx.size(); ++i)
    if (a.dx[i].bits != b.dx[i].bits) return false;
  auto eq = [](const std::vector<float>& u, const std::vector<float>& v) {
    return u.size() == v.size() && std::memcmp(u.data(), v.data(), u.size() * 4) == 0;
  };
  return eq(a.dwts, b.dwts) && eq(a.dw1, b.dw1) && eq(a.dw2, b.dw2);
}

struct GpuBackwardCase {
  EpCase ep;
  ExpertPath path = ExpertPath::cublas;
  SavePolicy policy = SavePolicy::rows_and_preactivation;
  DType grads = DType::f32;
  ExpertPath wgrad = ExpertPath::automatic;        // LayerOptions::weight_grad_path
  GemmGrouping dgrad = GemmGrouping::automatic;    // LayerOptions::data_grad_grouping
  std::string name() const {
    return ep.name() + (path == ExpertPath::sm90 ? "_sm90" : "_cublas") +
           (policy == SavePolicy::rows_recompute ? "_recompute" : "_saveh") + (grads == DType::bf16 ? "_bf16" : "_f32") +
           (wgrad == ExpertPath::sm90 ? "_wgrad90" : wgrad == ExpertPath::cublas ? "_wgradcublas" : "") +
           (dgrad == GemmGrouping::grouped ? "_grouped" : dgrad == GemmGrouping::per_gemm ? "_pergemm" : "");
  }
};
void PrintTo(const GpuBackwardCase& c, std::ostream* os) { *os << c.name(); }

class BackwardGpu : public ::testing::TestWithParam<GpuBackwardCase> {
 protected:
  void SetUp() override {
    std::string why;
    if (!cuda_available(why)) GTEST_SKIP() << why;
    if (GetParam().path == ExpertPath::sm90 && !sm90_here()) GTEST_SKIP() << "sm90 path needs an sm_90a device";
  }
  static void TearDownTestSuite() { release_single_comm(); }
};

// Padded expert rows of the case's routing (world 1): each expert's pairs rounded up to the tile.
int64_t padded_pairs(const EpCase& c) {
  const Routing R = routing_of(c, 0);
  std::vector<int64_t> n(c.E, 0);
  for (int32_t e : R.ids)
    if (e >= 0) ++n[e];
  int64_t p = 0;
  for (int64_t v : n) p += (v + kernels::kExpertTile - 1) / kernels::kExpertTile * kernels::kExpertTile;
  return p;
}

TEST_P(BackwardGpu, GradientsMatchReference) {
  const GpuBackwardCase& c = GetParam();
  GpuLayer L(c.ep, c.path, c.policy, c.wgrad, c.dgrad);
  const DeviceInputs in(c.ep);
  const HostGrads g = run_pass(L, in, c.grads);
  const ReferenceGrads ref = reference_grads(c.ep, 0);
  const std::string tag = c.name();
  EXPECT_TRUE(grad_close("dx", as_float(g.dx), ref.dx)) << tag;
  EXPECT_TRUE(grad_close("d_topk_weights", g.dwts, ref.dwts)) << tag;
  EXPECT_TRUE(grad_close("dw1", g.dw1, ref.dw1)) << tag;
  EXPECT_TRUE(grad_close("dw2", g.dw2, ref.dw2)) << tag;
  const Routing R = routing_of(c.ep, 0);
  for (size_t i = 0; i < R.ids.size(); ++i)
    if (R.ids[i] < 0) EXPECT_EQ(g.dwts[i], 0.0f) << tag << ": dropped slot " << i << " needs d = 0";

  // Saved bytes: rows_recompute keeps the received rows; rows_and_preactivation the expert-sorted
  // rows and h, one of each per padded pair (the tiles' padding is what it costs over 2 ffn + a row).
  if (g.pairs > 0) {
    const double H = c.ep.hidden, F = c.ep.ffn;
    const double want = c.policy == SavePolicy::rows_recompute
                            ? double(ref.recv_rows) * H * 2 / double(g.pairs)
                            : double(padded_pairs(c.ep)) * (2 * H + 4 * F) / double(g.pairs);
    EXPECT_DOUBLE_EQ(g.bytes_per_pair, want) << tag;
  } else {
    EXPECT_EQ(g.bytes_per_pair, 0.0) << tag;
  }

  // The same bits again, and under the other policy (h recomputed by the same GEMM on the same rows).
  EXPECT_TRUE(same_bits(run_pass(L, in, c.grads), g)) << tag << ": a second forward + backward differs";
  GpuLayer other(c.ep, c.path,
                 c.policy == SavePolicy::rows_recompute ? SavePolicy::rows_and_preactivation : SavePolicy::rows_recompute,
                 c.wgrad, c.dgrad);
  EXPECT_TRUE(same_bits(run_pass(other, in, c.grads), g)) << tag << ": the other save policy differs";

  // Accumulate: dW = prefill + this gradient (fp32 epilogue of the GEMM: one rounding of the sum; bf16
  // rounds that sum once more).
  std::vector<float> p1(g.dw1.size()), p2(g.dw2.size());
  for (size_t i = 0; i < p1.size(); ++i) p1[i] = float(int(i % 7) - 3) * 0.25f;
  for (size_t i = 0; i < p2.size(); ++i) p2[i] = float(int(i % 5) - 2) * 0.5f;
  const HostGrads acc = run_pass(L, in, c.grads, &p1, &p2);
  size_t off = 0;
  double worst = 0;
  auto check_acc = [&](const std::vector<float>& got, const std::vector<float>& pre, const std::vector<float>& fresh) {
    double scale = 0;
    for (float v : fresh) scale = std::max(scale, double(std::fabs(v)));
    for (size_t i = 0; i < got.size(); ++i) {
      const double want = double(pre[i]) + fresh[i];
      const double err = std::fabs(got[i] - want);
      const double tol = (c.grads == DType::f32 ? 0x1p-20 : 0x1p-8) * (std::fabs(want) + scale);
      worst = std::max(worst, err);
      off += !(err <= tol);
    }
  };
  check_acc(acc.dw1, p1, g.dw1);
  check_acc(acc.dw2, p2, g.dw2);
  EXPECT_EQ(off, 0u) << tag << ": accumulate must add the gradient to dw (worst |err| " << worst << ")";
}

GpuBackwardCase gcase(int E, int k, int H, int F, int64_t T, RoutingKind r, ExpertPath path, SavePolicy pol,
                      DType gd, int focus = 0) {
  GpuBackwardCase c;
  c.ep = make_ep_case(1, E, k, H, F, T, r, focus, uint64_t(9100 + E * 7 + k * 3 + H + F + T));
  c.path = path;
  c.policy = pol;
  c.grads = gd;
  return c;
}

std::vector<GpuBackwardCase> cases() {
  using RK = RoutingKind;
  const auto A = SavePolicy::rows_and_preactivation, B = SavePolicy::rows_recompute;
  std::vector<GpuBackwardCase> v;
  for (ExpertPath p : {ExpertPath::cublas, ExpertPath::sm90}) {
    v.push_back(gcase(8, 2, 256, 256, 200, RK::uniform, p, A, DType::f32));
    v.push_back(gcase(8, 2, 256, 256, 200, RK::uniform, p, B, DType::bf16));
    v.push_back(gcase(16, 4, 256, 256, 300, RK::zipf, p, A, DType::bf16));
    v.push_back(gcase(16, 4, 256, 128, 300, RK::zipf, p, B, DType::f32));  // (sm90: dW through cuBLAS, ffn 128)
    v.push_back(gcase(8, 4, 256, 256, 160, RK::one_expert, p, B, DType::f32, 3));  // the other experts idle
    v.push_back(gcase(8, 2, 256, 256, 150, RK::with_drops, p, A, DType::f32));
    v.push_back(gcase(8, 2, 128, 128, 40, RK::all_dropped, p, B, DType::f32));
    v.push_back(gcase(8, 2, 128, 128, 1, RK::uniform, p, A, DType::f32));  // T = 1
    v.push_back(gcase(8, 2, 128, 128, 0, RK::uniform, p, B, DType::bf16));  // T = 0
    v.push_back(gcase(8, 2, 1024, 512, 256, RK::uniform, p, A, DType::f32));
  }
  // Dims that are multiples of 16 but not of 128: the sm_90 forward's bounded boxes (the saving
  // forward's h through the rank-3 preact map), dW through cuBLAS (the sm_90 dW tiles do not fit).
  for (ExpertPath p : {ExpertPath::cublas, ExpertPath::sm90}) {
    v.push_back(gcase(8, 2, 144, 80, 200, RK::zipf, p, A, DType::f32));
    v.push_back(gcase(8, 4, 272, 48, 150, RK::with_drops, p, B, DType::bf16));
    v.push_back(gcase(8, 2, 16, 16, 100, RK::uniform, p, A, DType::f32));
  }
  v.push_back(gcase(8, 2, 2064, 1040, 64, RK::zipf, ExpertPath::sm90, A, DType::f32));
  // Each dW kernel and each grouping of the data-gradient GEMMs, whatever the automatic rules pick.
  for (ExpertPath w : {ExpertPath::sm90, ExpertPath::cublas}) {
    for (SavePolicy pol : {A, B}) {
      GpuBackwardCase c = gcase(16, 4, 512, 256, 333, RK::zipf, ExpertPath::sm90, pol, DType::bf16);
      c.wgrad = w;
      v.push_back(c);
    }
  }
  for (GemmGrouping d : {GemmGrouping::grouped, GemmGrouping::per_gemm}) {
    GpuBackwardCase c = gcase(16, 4, 512, 256, 333, RK::with_drops, ExpertPath::sm90, A, DType::f32);
    c.dgrad = d;
    v.push_back(c);
    c = gcase(8, 2, 256, 256, 150, RK::zipf, ExpertPath::cublas, B, DType::f32);
    c.dgrad = d;
    v.push_back(c);
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Routing, BackwardGpu, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name() + "_T" + std::to_string(info.param.ep.tokens_of(0)); });

// ---- errors: raised before any device work, the layer usable after --------------------------------
class BackwardGpuErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!cuda_available(why)) GTEST_SKIP() << why;
  }
  static void TearDownTestSuite() { release_single_comm(); }
};

TEST_F(BackwardGpuErrors, BadArgumentsRaiseAndTheLayerGoesOn) {
  const EpCase c = make_ep_case(1, 8, 2, 128, 128, 64, RoutingKind::uniform, 0, 4242);
  GpuLayer L(c, ExpertPath::cublas, SavePolicy::rows_and_preactivation);
  GpuLayer other(c, ExpertPath::cublas, SavePolicy::rows_and_preactivation);
  const DeviceInputs in(c);
  const int64_t T = in.T, H = c.hidden, F = c.ffn, E = c.E, k = c.k;
  Dev<bf16> y(size_t(T) * H), dx(size_t(T) * H);
  Dev<float> dwts(size_t(T) * k), dw1(size_t(E) * 2 * F * H), dw2(size_t(E) * H * F);
  ExpertGradients g{dview(dw1.get(), DType::f32, {E, 2 * F, H}), dview(dw2.get(), DType::f32, {E, H, F}), false};
  auto fwd = [&](GpuLayer& l, MoeForwardContext* ctx) {
    l.layer->forward(dview(in.x.get(), DType::bf16, {T, H}), dview(in.ids.get(), DType::i32, {T, k}),
                     dview(in.wts.get(), DType::f32, {T, k}), dview(y.get(), DType::bf16, {T, H}), nullptr, ctx);
  };
  auto bwd = [&](const MoeForwardContext& ctx, const TensorView& dyv, const ExpertGradients& gg) {
    L.layer->backward(ctx, dyv, dview(dx.get(), DType::bf16, {T, H}), dview(dwts.get(), DType::f32, {T, k}), gg,
                      nullptr);
  };
  const TensorView dy = dview(in.dy.get(), DType::bf16, {T, H});
  auto expect_error = [&](auto&& f, const char* text) {
    try {
      f();
      ADD_FAILURE() << "no error (expected one naming '" << text << "')";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  MoeForwardContext none;
  expect_error([&] { bwd(none, dy, g); }, "no saved forward");
  MoeForwardContext theirs;
  fwd(other, &theirs);
  expect_error([&] { bwd(theirs, dy, g); }, "another layer");
  MoeForwardContext ctx;
  fwd(L, &ctx);
  expect_error([&] { bwd(ctx, dview(in.dy.get(), DType::bf16, {T - 1, H}), g); }, "dy");
  ExpertGradients bad = g;
  bad.dw2 = dview(dw2.get(), DType::f32, {E - 1, H, F});
  expect_error([&] { bwd(ctx, dy, bad); }, "dw2");
  bwd(ctx, dy, g);  // the layer and the context still work
  ck(cudaDeviceSynchronize(), "sync");
  const std::vector<bf16> got = dx.host();
  const ReferenceGrads ref = reference_grads(c, 0);
  EXPECT_TRUE(grad_close("dx after errors", as_float(got), ref.dx));
}

// A context outlives its layer, and several forwards may be saved before their backwards.
TEST_F(BackwardGpuErrors, ContextsInFlightAndOutlivingTheLayer) {
  const EpCase c = make_ep_case(1, 8, 2, 128, 128, 96, RoutingKind::zipf, 0, 5151);
  const DeviceInputs in(c);
  const int64_t T = in.T, H = c.hidden, F = c.ffn, E = c.E, k = c.k;
  Dev<bf16> y(size_t(T) * H), dx(size_t(T) * H);
  Dev<float> dwts(size_t(T) * k), dw1(size_t(E) * 2 * F * H), dw2(size_t(E) * H * F);
  MoeForwardContext outliving;
  {
    GpuLayer L(c, sm90_here() ? ExpertPath::sm90 : ExpertPath::cublas, SavePolicy::rows_recompute);
    std::vector<MoeForwardContext> ctx(3);
    for (auto& cx : ctx)
      L.layer->forward(dview(in.x.get(), DType::bf16, {T, H}), dview(in.ids.get(), DType::i32, {T, k}),
                       dview(in.wts.get(), DType::f32, {T, k}), dview(y.get(), DType::bf16, {T, H}), nullptr, &cx);
    std::vector<std::vector<bf16>> dxs;
    for (int i = 2; i >= 0; --i) {
      ExpertGradients g{dview(dw1.get(), DType::f32, {E, 2 * F, H}), dview(dw2.get(), DType::f32, {E, H, F}), i < 2};
      L.layer->backward(ctx[i], dview(in.dy.get(), DType::bf16, {T, H}), dview(dx.get(), DType::bf16, {T, H}),
                        dview(dwts.get(), DType::f32, {T, k}), g, nullptr);
      ck(cudaDeviceSynchronize(), "sync");
      dxs.push_back(dx.host());
    }
    EXPECT_EQ(dxs[0].size(), dxs[2].size());
    for (size_t i = 0; i < dxs[0].size(); ++i) ASSERT_EQ(dxs[0][i].bits, dxs[2][i].bits) << "dx of saved forward " << i;
    // dW accumulated three equal micro-batches: 3x one gradient (against the reference).
    const ReferenceGrads ref = reference_grads(c, 0);
    std::vector<double> three(ref.dw1.size());
    for (size_t i = 0; i < three.size(); ++i) three[i] = 3 * ref.dw1[i];
    EXPECT_TRUE(grad_close("dw1 over 3 micro-batches", dw1.host(), three));
    outliving = std::move(ctx[0]);
  }
  EXPECT_TRUE(outliving.saved());
  outliving = MoeForwardContext();  // frees after the layer is gone
  ck(cudaDeviceSynchronize(), "sync");
}

}  // namespace
}  // namespace epmoe::test
