// The FP8 block-128 tile form (kernels/sm90/tile_fp8b_kernel.cu; issue 50) against a host reference on
// the dequantized operands:
//   v = silu(x . w1_gate) * (x . w1_up) in fp64 over the dequantized x and w1, act = the 1 x 128 block
//   format of v, y[token] = sum over its pairs of weight * (act . w2) in fp64 (from the GPU's act).
// Checks, per case:
//   - act: every real row's packed bytes written (poisoned before); each block's fp32 scale within the
//     slack of the host's (amax / 448 of values the GPU computes within `slack` of the exact v), every
//     element within half an E4M3 step at its block's scale of a value within the slack of v (the fp32
//     sums of the tensor cores' ~14-bit k32 blocks, and the tanh form of silu); how many codes differ
//     from the host quantizer's on the exact v is printed;
//   - y: relative L2 error <= 1e-2 over the whole output and <= 3e-2 for every token with output (the
//     issue's accuracy target: bf16 rounding of each pair's row and of the k reductions, ~2^-9 k, plus
//     act elements one code apart), rows without pairs exactly 0 (out is poisoned, UP zeroes it).
// Routings: decode (T = 1, 8), one expert holding 128 / 129 rows (a full tile and a tile with one row),
// uniform k = 2 over several tiles, experts without rows; shapes 2048 / 1024, 1024 / 512 and 256 / 128
// (one UP item and one DOWN stage); a case with block scales spread over 2^+-12.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "epmoe/bf16.h"
#include "epmoe/error.h"
#include "epmoe/fp8_block.h"
#include "epmoe/mxfp8.h"
#include "kernels/cuda_check.cuh"
#include "kernels/expert_problem.cuh"
#include "kernels/sm90/experts.cuh"
#include "kernels/sm90/swap_mx.cuh"
#include "fp8_kernel_case.h"

namespace {

namespace fp8b = epmoe::fp8b;
namespace mx = epmoe::mx;
using epmoe::kernels::kExpertTile;

using epmoe::test::fp8k::check_output;
using epmoe::test::fp8k::Dev;
using epmoe::test::fp8k::make_segments;
using epmoe::test::fp8k::swiglu_reference_row;
using epmoe::test::fp8k::sm90_here;

// A [rows, K] matrix of N(0, sigma) values times a power of two in [2^-spread, 2^spread] per block
// (blocks of block_rows x 128), in the block-128 format: activation rows (block_rows 1) or a weight.
struct BlockMatrix {
  std::vector<uint8_t> q;
  std::vector<float> s;
  std::vector<double> deq;
};
BlockMatrix random_block_matrix(int64_t rows, int K, int block_rows, double sigma, int spread, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, float(sigma));
  std::uniform_int_distribution<int> ex(-spread, spread);
  const int kb = K / fp8b::kBlock;
  std::vector<float> bscale(size_t(rows / block_rows) * kb);
  for (float& b : bscale) b = std::ldexp(1.0f, ex(rng));
  std::vector<float> v(size_t(rows) * K);
  for (int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < K; ++c) v[size_t(r) * K + c] = nd(rng) * bscale[size_t(r / block_rows) * kb + c / fp8b::kBlock];
  BlockMatrix m;
  m.q.resize(v.size());
  m.s.resize(bscale.size());
  std::vector<float> f(v.size());
  if (block_rows == 1) {
    fp8b::quantize_rows(v.data(), rows, K, m.q.data(), m.s.data());
    fp8b::dequantize_rows(m.q.data(), m.s.data(), rows, K, f.data());
  } else {
    fp8b::quantize_weight(v.data(), rows, K, m.q.data(), m.s.data());
    fp8b::dequantize_weight(m.q.data(), m.s.data(), rows, K, f.data());
  }
  m.deq.assign(f.begin(), f.end());
  return m;
}

struct Case {
  std::string name;
  int experts, hidden, ffn, T, k;
  enum { uniform, one_expert } route;
  int spread = 2;
};

void run_case(const Case& c) {
  if (!sm90_here()) GTEST_SKIP() << "needs a compute capability 9.0 device and an sm_90a build";
  const int E = c.experts, H = c.hidden, F = c.ffn, T = c.T;
  std::mt19937 rng(0xb10c + uint32_t(T) * 131 + uint32_t(H));
  const epmoe::test::fp8k::Segments S = make_segments(E, T, c.k, c.route == Case::one_expert, rng);
  const auto& seg = S.seg;
  const auto& offsets = S.offsets;
  const int64_t cap = S.cap;
  const std::vector<int32_t>& pair_row = S.pair_row;
  const std::vector<float>& pair_weight = S.pair_weight;

  // Operands: x rows packed as the dispatch sends them; weights row-major E4M3 + fp32 block scales.
  const BlockMatrix x = random_block_matrix(T, H, 1, 1.0, c.spread, rng);
  const BlockMatrix w1 = random_block_matrix(int64_t(E) * 2 * F, H, fp8b::kBlock, 1.0 / std::sqrt(double(H)), c.spread, rng);
  const BlockMatrix w2 = random_block_matrix(int64_t(E) * H, F, fp8b::kBlock, 1.0 / std::sqrt(double(F)), c.spread, rng);
  const int64_t xrb = fp8b::packed_row_bytes(H), arb = fp8b::packed_row_bytes(F);
  std::vector<uint8_t> xp(size_t(std::max(T, 1) * xrb), 0);
  for (int t = 0; t < T; ++t) {
    std::memcpy(&xp[size_t(t * xrb)], &x.q[size_t(t) * H], size_t(H));
    std::memcpy(&xp[size_t(t * xrb + H)], &x.s[size_t(t) * (H / fp8b::kBlock)], size_t(H / fp8b::kBlock) * 4);
  }
  auto bytes_of = [](const std::vector<float>& f) {
    std::vector<uint8_t> b(f.size() * 4);
    std::memcpy(b.data(), f.data(), b.size());
    return b;
  };

  Dev<uint8_t> d_x(xp), d_w1(w1.q), d_w1s(bytes_of(w1.s)), d_w2(w2.q), d_w2s(bytes_of(w2.s));
  Dev<int64_t> d_off(offsets);
  Dev<int32_t> d_row(pair_row);
  Dev<float> d_wt(pair_weight);
  Dev<uint8_t> d_act(size_t(cap * arb), 0xA5);
  Dev<uint16_t> d_out(size_t(std::max(T, 1)) * H, 0x7F);  // bf16 poison 0x7F7F (~3.4e38)
  epmoe::kernels::MxExpertProblem p;
  p.x = d_x.p, p.x_rows = std::max(T, 1);
  p.padded_offsets = d_off.p, p.pair_row = d_row.p, p.pair_weight = d_wt.p;
  p.w1 = d_w1.p, p.w1_scale = d_w1s.p, p.w2 = d_w2.p, p.w2_scale = d_w2s.p;
  p.act = d_act.p;
  p.out = reinterpret_cast<__nv_bfloat16*>(d_out.p), p.out_rows = T;
  p.rows_capacity = cap, p.experts = E, p.hidden = H, p.ffn = F;
  p.zero_out = true;
  p.form = epmoe::kernels::MxForm::tile;
  p.scales = epmoe::kernels::Fp8Scales::block128;
  epmoe::kernels::sm90_mx_experts_launch(p, nullptr);
  EPMOE_CUDA_CHECK(cudaGetLastError());
  EPMOE_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint8_t> act = d_act.get(size_t(cap * arb));
  const std::vector<uint16_t> out = d_out.get(size_t(std::max(T, 1)) * H);

  // Reference, and the act checks row by row.
  const int fb = F / fp8b::kBlock, hb = H / fp8b::kBlock;
  std::vector<double> y(size_t(T) * H, 0.0);
  int64_t codes = 0, code_diff = 0, code_far = 0, scale_far = 0;
  std::vector<float> v(static_cast<size_t>(F)), hs(static_cast<size_t>(fb)), gs(static_cast<size_t>(fb));
  std::vector<double> vd(static_cast<size_t>(F)), slack(static_cast<size_t>(F));
  std::vector<uint8_t> hq(static_cast<size_t>(F));
  std::vector<float> adeq(static_cast<size_t>(F));
  for (int e = 0; e < E; ++e)
    for (size_t i = 0; i < seg[size_t(e)].size(); ++i) {
      const int t = seg[size_t(e)][i].first;
      const int64_t r = offsets[size_t(e)] + int64_t(i);
      const double* xr = &x.deq[size_t(t) * H];
      swiglu_reference_row(xr, w1.deq.data(), e, F, H, vd.data(), v.data(), slack.data());
      fp8b::quantize_rows(v.data(), 1, F, hq.data(), hs.data());
      const uint8_t* ar = &act[size_t(r * arb)];
      std::memcpy(gs.data(), ar + F, size_t(fb) * 4);
      for (int b = 0; b < fb; ++b) {
        double worst = 0;
        for (int f = b * fp8b::kBlock; f < (b + 1) * fp8b::kBlock; ++f) worst = std::max(worst, slack[size_t(f)]);
        if (!(std::fabs(double(gs[size_t(b)]) - double(hs[size_t(b)])) <= 1.0001 * worst / 448.0 + 1e-6 * hs[size_t(b)])) {
          if (scale_far < 3)
            ADD_FAILURE() << "act row " << r << " block " << b << ": scale " << gs[size_t(b)] << ", host " << hs[size_t(b)];
          ++scale_far;
        }
      }
      for (int f = 0; f < F; ++f) {
        ++codes;
        code_diff += ar[f] != hq[size_t(f)] ? 1 : 0;
        const double X = gs[size_t(f / fp8b::kBlock)];
        const double gv = double(mx::e4m3_to_float(ar[f])) * X;
        const double a = std::fabs(vd[size_t(f)]) + slack[size_t(f)];
        const double step = X * std::ldexp(1.0, std::max(-9, int(std::floor(std::log2(std::max(a / X, 1e-300)))) - 3));
        const double bound = 0.5 * step + std::max(0.0, a - 448.0 * X) + slack[size_t(f)];
        if (!(std::fabs(gv - vd[size_t(f)]) <= 1.0001 * bound)) {
          if (code_far < 3)
            ADD_FAILURE() << "act[" << r << "][" << f << "] = " << gv << ", want " << vd[size_t(f)] << " within " << bound
                          << " (scale " << X << ")";
          ++code_far;
        }
      }
      // DOWN from the GPU's act (the act checks above bound how far it is from the host's).
      fp8b::dequantize_rows(ar, gs.data(), 1, F, adeq.data());
      const double wt = seg[size_t(e)][i].second;
      for (int h = 0; h < H; ++h) {
        const double* w = &w2.deq[(size_t(e) * H + size_t(h)) * F];
        double s = 0;
        for (int f = 0; f < F; ++f) s += double(adeq[size_t(f)]) * w[f];
        y[size_t(t) * H + size_t(h)] += wt * s;
      }
    }
  (void)hb;
  EXPECT_EQ(scale_far, 0) << "act scales outside the slack of the host quantizer's";
  EXPECT_EQ(code_far, 0) << "act elements outside their format's rounding of the exact v";

  const epmoe::test::fp8k::OutputError err = check_output(out, y, S, T, H);
  const double rel = err.rel, worst_token = err.worst_token;
  std::printf("[fp8 block-128 tile] %s: E=%d %d/%d T=%d k=%d: y rel L2 %.3g (worst token %.3g); act codes differing "
              "%lld of %lld\n",
              c.name.c_str(), E, H, F, T, c.k, rel, worst_token, (long long)code_diff, (long long)codes);
}

TEST(Sm90Fp8BlockTile, DecodeOneToken) { run_case({"decode T=1", 8, 2048, 1024, 1, 4, Case::uniform}); }
TEST(Sm90Fp8BlockTile, DecodeEightTokens) { run_case({"decode T=8", 8, 2048, 1024, 8, 4, Case::uniform}); }
TEST(Sm90Fp8BlockTile, OneExpertHoldsAFullTile) { run_case({"128 rows in one expert", 4, 1024, 512, 128, 1, Case::one_expert}); }
TEST(Sm90Fp8BlockTile, OneExpertHoldsATileAndOneRow) { run_case({"129 rows in one expert", 4, 1024, 512, 129, 1, Case::one_expert}); }
TEST(Sm90Fp8BlockTile, SeveralTilesPerExpert) { run_case({"T=300 k=2", 4, 1024, 512, 300, 2, Case::uniform}); }
TEST(Sm90Fp8BlockTile, SmallestShape) { run_case({"256/128", 4, 256, 128, 40, 2, Case::uniform}); }
TEST(Sm90Fp8BlockTile, WideBlockScales) { run_case({"scales 2^+-12", 8, 512, 256, 24, 2, Case::uniform, 12}); }

// (The swap-AB form's refusal of block-128 problems: test_sm90_problem_checks, on the CPU.)

}  // namespace
