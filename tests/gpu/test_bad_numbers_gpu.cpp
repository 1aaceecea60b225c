// Bad numbers on one GPU (issue 49 item 5), the GPU counterpart of tests/test_reliability_cpu.cpp's
// bad-number cases: NaN in one token's x, or Inf in one of its routing weights, leaves every other
// token's y, dx and d_topk_weights finite (the poisoned token's y is not); routing weights of 0 give
// that token an exact-zero row; W2 = 0 gives exact zeros everywhere. On each expert path: cuBLAS, and
// on sm_90 the 128-row kernels, swap-AB and the fused pipeline (forward only: a saving forward never
// swaps). Each run is a row of the reliability matrix. dW is not
// checked: it sums over tokens, so one NaN token poisons it by definition.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "device_array.h"
#include "epmoe/moe_layer.h"
#include "epmoe/sm90_plan.h"
#include "kernels/sm90/experts.cuh"
#include "single_comm.h"
#include "test_support.h"

namespace epmoe::test {
namespace {

enum class Poison { nan_x, inf_weight, zero_weights, zero_w2 };
const char* name(Poison p) {
  return p == Poison::nan_x ? "nan_x" : p == Poison::inf_weight ? "inf_weight" : p == Poison::zero_weights ? "zero_weights" : "zero_w2";
}

bool finite_row(const bf16* row, int n) {
  for (int i = 0; i < n; ++i)
    if (!std::isfinite(row[i].f())) return false;
  return true;
}

class BadNumbersGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!cuda_available(why)) GTEST_SKIP() << why;
  }
  static void TearDownTestSuite() { release_single_comm(); }
};

// E 8, k 2, 256/256, 64 tokens (uniform routing: every expert a few rows, so the poisoned token
// shares its tiles with others); token 5 carries the poison.
void run(Poison what, ExpertPath path, const char* plan, bool backward) {
  constexpr int E = 8, k = 2, H = 256, F = 256;
  constexpr int64_t T = 64, bad_t = 5;
  SCOPED_TRACE(std::string(name(what)) + (path == ExpertPath::sm90 ? " sm90 '" : " cublas '") + plan + "'" +
               (backward ? " fwd+bwd" : " fwd"));
  ModelWeights M = make_weights(E, H, F, 911);
  if (what == Poison::zero_w2) std::fill(M.w2.begin(), M.w2.end(), bf16(0.f));
  std::vector<bf16> x = make_x(912, 0, T, H);
  Routing R = make_routing(T, E, k, RoutingKind::uniform, 913, 0, 1);
  if (what == Poison::nan_x) x[size_t(bad_t) * H + 17] = bf16(std::nanf(""));
  if (what == Poison::inf_weight) R.weights[size_t(bad_t) * k + 1] = INFINITY;
  if (what == Poison::zero_weights) R.weights[size_t(bad_t) * k] = R.weights[size_t(bad_t) * k + 1] = 0.f;
  std::vector<bf16> dy_h(size_t(T) * H, bf16(0.25f));

  Dev<bf16> w1(M.w1), w2(M.w2), dx_in(x), dy(dy_h);
  Dev<int32_t> ids(R.ids);
  Dev<float> wts(R.weights);
  Dev<bf16> y(size_t(T) * H, 0xff), dx(size_t(T) * H, 0xff);
  Dev<float> dwts(size_t(T) * k, 0xff), dw1(M.w1.size(), 0), dw2(M.w2.size(), 0);
  const MoeConfig cfg{.num_experts = E, .top_k = k, .hidden = H, .ffn = F, .world_size = 1, .rank = 0};
  LayerOptions opt;
  opt.expert_path = path;
  opt.sm90_plan = parse_sm90_plan_override(plan);
  MoeLayer layer(cfg, {dview(w1.get(), DType::bf16, {E, 2 * F, H}), dview(w2.get(), DType::bf16, {E, H, F})},
                 single_comm(), opt);
  MoeForwardContext ctx;
  layer.forward(dview(dx_in.get(), DType::bf16, {T, H}), dview(ids.get(), DType::i32, {T, k}),
                dview(wts.get(), DType::f32, {T, k}), dview(y.get(), DType::bf16, {T, H}), nullptr,
                backward ? &ctx : nullptr);
  if (backward)
    layer.backward(ctx, dview(dy.get(), DType::bf16, {T, H}), dview(dx.get(), DType::bf16, {T, H}),
                   dview(dwts.get(), DType::f32, {T, k}),
                   {dview(dw1.get(), DType::f32, {E, 2 * F, H}), dview(dw2.get(), DType::f32, {E, H, F}), false},
                   nullptr);
  ck(cudaDeviceSynchronize(), "sync");
  const std::vector<bf16> yh = y.host(), dxh = dx.host();
  const std::vector<float> dwh = dwts.host();
  std::string nonfinite_y;
  int nonfinite_grad = 0, nonzero = 0;
  for (int64_t t = 0; t < T; ++t) {
    const bool poisoned = t == bad_t;
    const bf16* yr = yh.data() + t * H;
    if (!finite_row(yr, H)) nonfinite_y += " " + std::to_string(t);
    if (what == Poison::zero_w2 || (poisoned && what == Poison::zero_weights)) {
      for (int c = 0; c < H; ++c) nonzero += (yr[c].bits & 0x7fff) != 0;
      continue;
    }
    EXPECT_EQ(finite_row(yr, H), !poisoned) << "token " << t << " y";
    if (backward && !poisoned) {
      const bool ok = finite_row(dxh.data() + t * H, H) && std::isfinite(dwh[size_t(t) * k]) &&
                      std::isfinite(dwh[size_t(t) * k + 1]);
      nonfinite_grad += !ok;
      EXPECT_TRUE(ok) << "token " << t << " dx or d_topk_weights";
    }
  }
  EXPECT_EQ(nonzero, 0) << "elements that must be exactly zero";
  const std::string where = std::string(path == ExpertPath::sm90 ? "sm90" : "cublas") + (plan[0] ? " " : "") + plan +
                            (backward ? ", fwd+bwd" : ", fwd");
  const char* expected = what == Poison::zero_w2        ? "every y row exactly 0"
                         : what == Poison::zero_weights ? "token 5's y row exactly 0, the rest finite"
                         : backward ? "only token 5's y non-finite; every other dx, dw finite"
                                    : "only token 5's y non-finite";
  matrix_row(std::string(name(what)) + " in token 5 (1 GPU, " + where + ")", expected,
             "non-finite y rows:" + (nonfinite_y.empty() ? std::string(" none") : nonfinite_y) +
                 (backward ? "; other tokens' non-finite dx/dw: " + std::to_string(nonfinite_grad) : std::string()) +
                 "; non-zero elements where 0 is due: " + std::to_string(nonzero));
}

void run_paths(Poison what) {
  run(what, ExpertPath::cublas, "", true);
  int dev = 0;
  ck(cudaGetDevice(&dev), "cudaGetDevice");
  if (!kernels::sm90_experts_supported(dev)) return;
  run(what, ExpertPath::sm90, "", true);
  run(what, ExpertPath::sm90, "swap=off", false);
  run(what, ExpertPath::sm90, "swap=on", false);
  run(what, ExpertPath::sm90, "fused=on", false);
}

TEST_F(BadNumbersGpu, NanInOneTokensXStaysInItsRow) { run_paths(Poison::nan_x); }
TEST_F(BadNumbersGpu, InfInOneRoutingWeightStaysInItsRow) { run_paths(Poison::inf_weight); }
TEST_F(BadNumbersGpu, ZeroRoutingWeightsGiveAnExactZeroRow) { run_paths(Poison::zero_weights); }
TEST_F(BadNumbersGpu, ZeroW2GivesExactZeros) { run_paths(Poison::zero_w2); }

}  // namespace
}  // namespace epmoe::test
