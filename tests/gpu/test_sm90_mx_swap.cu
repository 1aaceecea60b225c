// The MX expert pipeline (kernels/sm90/swap_mx.cuh; issue 50), swap-AB, tile and fused forms, against a
// host reference on the dequantized operands:
//   v = silu(x . w1_gate) * (x . w1_up) in fp64 over the dequantized x and w1, act = MX(v) by the
//   host quantizer (mx::quantize_rows), y[token] = sum over its pairs of weight * (act . w2) in fp64.
// Checks, per case:
//   - act: every real row's packed bytes written (poisoned before); its E8M0 scales within one of the
//     host quantizer's (a block's amax may sit at a power of two within the GPU's error), and every
//     element within its format's rounding (half an E4M3 step at its block scale, or the saturation
//     past 448 X of the OCP scale rule) of a value within the GPU's stated error of the exact v (the
//     fp32 sums of the tensor cores' ~14-bit k32 blocks, and the tanh form of silu: see slack);
//     how many codes differ from the host quantizer's is printed;
//   - the fused form: act never written (its buffer keeps its poison: act stays in shared memory),
//     y against the reference on the host quantizer's act, and its fp32 accumulator left all zero;
//   - y: relative L2 error <= 1e-2 over the whole output and <= 3e-2 for every token with output
//     (the issue's accuracy target; what is expected is the bf16 rounding of each pair's row and of
//     the k reductions, ~2^-9 k, plus act elements one code apart), rows without pairs exactly 0 (out
//     is poisoned, UP zeroes it in-kernel).
// Routings: decode (T = 1, 8, 33), one expert holding 64 / 65 rows (the swap-AB N = 64 boundary and
// an upper half with one row), uniform k = 2 over several tiles, experts without rows; shapes
// 2048 / 1024 and 256 / 128 (one and two k stages); a case with block scales spread over 2^+-12.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "epmoe/bf16.h"
#include "epmoe/error.h"
#include "epmoe/mxfp8.h"
#include "kernels/cuda_check.cuh"
#include "kernels/expert_problem.cuh"
#include "kernels/sm90/experts.cuh"
#include "kernels/sm90/swap_mx.cuh"
#include "fp8_kernel_case.h"

namespace {

namespace mx = epmoe::mx;
using epmoe::kernels::kExpertTile;

using epmoe::test::fp8k::check_output;
using epmoe::test::fp8k::Dev;
using epmoe::test::fp8k::make_segments;
using epmoe::test::fp8k::swiglu_reference_row;
using epmoe::test::fp8k::sm90_here;

// Rows of K values ~ N(0, 1) times a per-block power of two in [2^-spread, 2^spread], in MX form.
struct MxRows {
  std::vector<uint8_t> q, s;
  std::vector<double> deq;
};
MxRows random_mx_rows(int64_t rows, int K, double sigma, int spread, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, float(sigma));
  std::uniform_int_distribution<int> ex(-spread, spread);
  std::vector<float> v(size_t(rows) * K);
  for (size_t b = 0; b < v.size() / 32; ++b) {
    const float sc = std::ldexp(1.0f, ex(rng));
    for (int i = 0; i < 32; ++i) v[b * 32 + i] = nd(rng) * sc;
  }
  MxRows m;
  m.q.resize(v.size());
  m.s.resize(v.size() / 32);
  mx::quantize_rows(v.data(), rows, K, m.q.data(), m.s.data());
  std::vector<float> f(v.size());
  mx::dequantize_rows(m.q.data(), m.s.data(), rows, K, f.data());
  m.deq.assign(f.begin(), f.end());
  return m;
}

struct Case {
  std::string name;
  int experts, hidden, ffn, T, k;
  enum { uniform, one_expert } route;
  int spread = 2;
};

void run_case_form(const Case& c, epmoe::kernels::MxForm form) {
  const int E = c.experts, H = c.hidden, F = c.ffn, T = c.T;
  std::mt19937 rng(0x5eed + uint32_t(T) * 131 + uint32_t(H));
  const epmoe::test::fp8k::Segments S = make_segments(E, T, c.k, c.route == Case::one_expert, rng);
  const auto& seg = S.seg;
  const auto& offsets = S.offsets;
  const int64_t cap = S.cap;
  const std::vector<int32_t>& pair_row = S.pair_row;
  const std::vector<float>& pair_weight = S.pair_weight;

  // Operands: x rows packed as the dispatch sends them; weights row-major E4M3 + E8M0.
  const MxRows x = random_mx_rows(T, H, 1.0, c.spread, rng);
  const MxRows w1 = random_mx_rows(int64_t(E) * 2 * F, H, 1.0 / std::sqrt(double(H)), c.spread, rng);
  const MxRows w2 = random_mx_rows(int64_t(E) * H, F, 1.0 / std::sqrt(double(F)), c.spread, rng);
  const int64_t xrb = mx::packed_row_bytes(H), arb = mx::packed_row_bytes(F);
  std::vector<uint8_t> xp(size_t(std::max(T, 1) * xrb), 0);
  for (int t = 0; t < T; ++t) mx::pack_row(&x.q[size_t(t) * H], &x.s[size_t(t) * H / 32], H, &xp[size_t(t * xrb)]);

  Dev<uint8_t> d_x(xp), d_w1(w1.q), d_w1s(w1.s), d_w2(w2.q), d_w2s(w2.s);
  Dev<int64_t> d_off(offsets);
  Dev<int32_t> d_row(pair_row);
  Dev<float> d_wt(pair_weight);
  Dev<uint8_t> d_act(size_t(cap * arb), 0xA5);
  Dev<uint16_t> d_out(size_t(std::max(T, 1)) * H, 0x7F);  // bf16 poison 0x7F7F (~3.4e38)
  const bool fused = form == epmoe::kernels::MxForm::fused;
  Dev<float> d_acc(size_t(std::max(T, 1)) * H, 0);  // the fused form's accumulator: zero on entry
  epmoe::kernels::MxExpertProblem p;
  p.x = d_x.p, p.x_rows = std::max(T, 1);
  p.padded_offsets = d_off.p, p.pair_row = d_row.p, p.pair_weight = d_wt.p;
  p.w1 = d_w1.p, p.w1_scale = d_w1s.p, p.w2 = d_w2.p, p.w2_scale = d_w2s.p;
  p.act = d_act.p;
  p.out = reinterpret_cast<__nv_bfloat16*>(d_out.p), p.out_rows = T;
  p.rows_capacity = cap, p.experts = E, p.hidden = H, p.ffn = F;
  p.zero_out = true;
  p.form = form;
  if (fused) p.out_acc = d_acc.p;
  const char* form_name = form == epmoe::kernels::MxForm::tile ? "tile" : fused ? "fused" : "swap";
  SCOPED_TRACE(std::string(form_name) + " form");
  epmoe::kernels::sm90_mx_experts_launch(p, nullptr);
  EPMOE_CUDA_CHECK(cudaGetLastError());
  EPMOE_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint8_t> act = d_act.get(size_t(cap * arb));
  const std::vector<uint16_t> out = d_out.get(size_t(std::max(T, 1)) * H);
  if (fused) {
    const std::vector<float> acc = d_acc.get(size_t(std::max(T, 1)) * H);
    EXPECT_EQ(std::count_if(act.begin(), act.end(), [](uint8_t b) { return b != 0xA5; }), 0)
        << "the fused form wrote act to global memory";
    EXPECT_EQ(std::count_if(acc.begin(), acc.end(), [](float f) { return f != 0.0f; }), 0)
        << "the fused form left its accumulator non-zero";
  }

  // Reference, and the act checks row by row.
  std::vector<double> y(size_t(T) * H, 0.0);
  int64_t codes = 0, code_diff = 0, code_far = 0, scale_far = 0;
  std::vector<float> v(static_cast<size_t>(F));
  std::vector<double> vd(static_cast<size_t>(F)), slack(static_cast<size_t>(F));
  std::vector<uint8_t> hq(static_cast<size_t>(F)), hs(static_cast<size_t>(F / 32));
  std::vector<float> adeq(static_cast<size_t>(F));
  // y[t] += wt * (adeq . w2[e, h, :]) for every h: one pair's DOWN in fp64.
  auto add_down = [&](int t, int e, double wt) {
    for (int h = 0; h < H; ++h) {
      const double* w = &w2.deq[(size_t(e) * H + size_t(h)) * F];
      double s = 0;
      for (int f = 0; f < F; ++f) s += double(adeq[size_t(f)]) * w[f];
      y[size_t(t) * H + size_t(h)] += wt * s;
    }
  };
  for (int e = 0; e < E; ++e)
    for (size_t i = 0; i < seg[size_t(e)].size(); ++i) {
      const int t = seg[size_t(e)][i].first;
      const int64_t r = offsets[size_t(e)] + int64_t(i);
      const double* xr = &x.deq[size_t(t) * H];
      swiglu_reference_row(xr, w1.deq.data(), e, F, H, vd.data(), v.data(), slack.data());
      mx::quantize_rows(v.data(), 1, F, hq.data(), hs.data());
      if (fused) {  // no act to check: DOWN from the host quantizer's act
        mx::dequantize_rows(hq.data(), hs.data(), 1, F, adeq.data());
        add_down(t, e, seg[size_t(e)][i].second);
        continue;
      }
      const uint8_t* ar = &act[size_t(r * arb)];
      for (int b = 0; b < F / 32; ++b)
        if (std::abs(int(ar[F + b]) - int(hs[size_t(b)])) > 1) ++scale_far;
      for (int f = 0; f < F; ++f) {
        ++codes;
        code_diff += ar[f] != hq[size_t(f)] ? 1 : 0;
        // The GPU's element against the exact v: within the rounding of its block's format (half an
        // E4M3 step at its scale X, or the saturation past 448 X that the OCP scale rule allows) of
        // some value within the slack of v.
        const double X = mx::e8m0_to_float(ar[F + f / 32]);
        const double gv = double(mx::e4m3_to_float(ar[f])) * X;
        const double a = std::fabs(vd[size_t(f)]) + slack[size_t(f)];
        const double step = X * std::ldexp(1.0, std::max(-9, int(std::floor(std::log2(std::max(a / X, 1e-300)))) - 3));
        const double bound = 0.5 * step + std::max(0.0, a - 448.0 * X) + slack[size_t(f)];
        if (!(std::fabs(gv - vd[size_t(f)]) <= 1.0001 * bound)) {
          if (code_far < 3)
            ADD_FAILURE() << "act[" << r << "][" << f << "] = " << gv << ", want " << vd[size_t(f)] << " within "
                          << bound << " (scale 2^" << int(ar[F + f / 32]) - 127 << ")";
          ++code_far;
        }
      }
      // DOWN from the GPU's act (the act checks above bound how far it is from the host's).
      mx::dequantize_rows(ar, ar + F, 1, F, adeq.data());
      add_down(t, e, seg[size_t(e)][i].second);
    }
  EXPECT_EQ(scale_far, 0) << "act scales more than one code from the host quantizer's";
  EXPECT_EQ(code_far, 0) << "act elements outside their format's rounding of the exact v";

  const epmoe::test::fp8k::OutputError err = check_output(out, y, S, T, H);
  const double rel = err.rel, worst_token = err.worst_token;
  std::printf("[mx %s] %s: E=%d %d/%d T=%d k=%d: y rel L2 %.3g (worst token %.3g); act codes differing %lld of %lld\n",
              form_name, c.name.c_str(), E, H, F, T, c.k, rel, worst_token,
              (long long)code_diff, (long long)codes);
}

// Every case in every form: swap-AB (half tiles, N <= 64), the tile form (128 x 128 items) and the
// fused pipeline (the swap-AB items, DOWN in the same grid).
void run_case(const Case& c) {
  if (!sm90_here()) GTEST_SKIP() << "needs a compute capability 9.0 device and an sm_90a build";
  run_case_form(c, epmoe::kernels::MxForm::swap);
  run_case_form(c, epmoe::kernels::MxForm::tile);
  run_case_form(c, epmoe::kernels::MxForm::fused);
}

TEST(Sm90MxSwap, DecodeOneToken) { run_case({"decode T=1", 8, 2048, 1024, 1, 4, Case::uniform}); }
TEST(Sm90MxSwap, DecodeEightTokens) { run_case({"decode T=8", 8, 2048, 1024, 8, 4, Case::uniform}); }
TEST(Sm90MxSwap, ThirtyThreeTokens) { run_case({"T=33", 8, 2048, 1024, 33, 2, Case::uniform}); }
TEST(Sm90MxSwap, OneExpertHoldsSixtyFourRows) { run_case({"64 rows in one expert", 4, 2048, 1024, 64, 1, Case::one_expert}); }
TEST(Sm90MxSwap, OneExpertHoldsSixtyFiveRows) { run_case({"65 rows in one expert", 4, 2048, 1024, 65, 1, Case::one_expert}); }
TEST(Sm90MxSwap, SeveralTilesPerExpert) { run_case({"T=300 k=2", 4, 1024, 512, 300, 2, Case::uniform}); }
TEST(Sm90MxSwap, SmallestShape) { run_case({"256/128", 4, 256, 128, 40, 2, Case::uniform}); }
// hidden 640: the fused DOWN's last stage holds one 256-row box, half of it past hidden.
TEST(Sm90MxSwap, HiddenNotAMultipleOfFiveTwelve) { run_case({"640/256", 4, 640, 256, 20, 2, Case::uniform}); }
TEST(Sm90MxSwap, WideBlockScales) { run_case({"scales 2^+-12", 8, 512, 256, 24, 2, Case::uniform, 12}); }

TEST(Sm90MxSwap, RejectsShapesAndPointersItCannotTake) {
  epmoe::kernels::MxExpertProblem p;
  p.experts = 2, p.hidden = 192, p.ffn = 128, p.rows_capacity = 128;  // hidden not a multiple of 128
  EXPECT_THROW(epmoe::kernels::check_mx_expert_problem(p, "test"), epmoe::Error);
  p.hidden = 256;
  EXPECT_THROW(epmoe::kernels::check_mx_expert_problem(p, "test"), epmoe::Error);  // null pointers
}

}  // namespace
