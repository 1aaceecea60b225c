// Shared pieces of the FP8 expert-kernel tests (test_sm90_mx_swap.cu, test_sm90_fp8b_tile.cu): a
// device buffer, the sm_90a check, the routed segments of a case (the layout the kernels read), one
// pair's fp64 SwiGLU row with its slack, and the output check against an fp64 reference.
#pragma once
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "epmoe/bf16.h"
#include "kernels/cuda_check.cuh"
#include "kernels/expert_problem.cuh"
#include "kernels/sm90/experts.cuh"

namespace epmoe::test::fp8k {

template <class T>
struct Dev {
  T* p = nullptr;
  explicit Dev(size_t n, int poison = -1) {
    EPMOE_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
    if (poison >= 0) EPMOE_CUDA_CHECK(cudaMemset(p, poison, std::max<size_t>(n, 1) * sizeof(T)));
    EPMOE_CUDA_CHECK(cudaDeviceSynchronize());
  }
  Dev(const std::vector<T>& h) : Dev(h.size()) {
    EPMOE_CUDA_CHECK(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    EPMOE_CUDA_CHECK(cudaDeviceSynchronize());  // (pageable uploads may still be in flight otherwise)
  }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  std::vector<T> get(size_t n) const {
    std::vector<T> h(n);
    EPMOE_CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

inline bool sm90_here() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || !kernels::sm90_experts_supported(dev)) {
    (void)cudaGetLastError();
    return false;
  }
  return true;
}

// A case's routing as the kernels' layout: per expert its (token, weight) pairs, segments padded to
// kExpertTile rows, pair_row / pair_weight with each segment's real rows first (-1 / 0 after).
struct Segments {
  std::vector<std::vector<std::pair<int, float>>> seg;
  std::vector<int64_t> offsets;
  int64_t cap = 0;
  std::vector<int32_t> pair_row;
  std::vector<float> pair_weight;
};
// Per token k distinct experts (uniform) or all to expert E - 2 (one_expert; the last expert and
// the others stay empty), weights in (0.1, 1).
inline Segments make_segments(int E, int T, int k, bool one_expert, std::mt19937& rng) {
  using kernels::kExpertTile;
  Segments s;
  s.seg.resize(size_t(E));
  std::uniform_real_distribution<float> wd(0.1f, 1.0f);
  for (int t = 0; t < T; ++t) {
    if (one_expert) {
      s.seg[size_t(E - 2)].push_back({t, wd(rng)});
      continue;
    }
    std::vector<int> ids(static_cast<size_t>(E));
    for (int e = 0; e < E; ++e) ids[size_t(e)] = e;
    std::shuffle(ids.begin(), ids.end(), rng);
    for (int j = 0; j < k; ++j) s.seg[size_t(ids[size_t(j)])].push_back({t, wd(rng)});
  }
  s.offsets.assign(size_t(E) + 1, 0);
  for (int e = 0; e < E; ++e)
    s.offsets[size_t(e) + 1] =
        s.offsets[size_t(e)] + (int64_t(s.seg[size_t(e)].size()) + kExpertTile - 1) / kExpertTile * kExpertTile;
  s.cap = std::max<int64_t>(s.offsets[size_t(E)], kExpertTile);
  s.pair_row.assign(size_t(s.cap), -1);
  s.pair_weight.assign(size_t(s.cap), 0.0f);
  for (int e = 0; e < E; ++e)
    for (size_t i = 0; i < s.seg[size_t(e)].size(); ++i) {
      s.pair_row[size_t(s.offsets[size_t(e)]) + i] = s.seg[size_t(e)][i].first;
      s.pair_weight[size_t(s.offsets[size_t(e)]) + i] = s.seg[size_t(e)][i].second;
    }
  return s;
}

// One pair's UP in fp64 on the dequantized inputs: vd[f] = silu(g) * u of token row xr [H] and
// expert e's W1 (w1 [E, 2F, H]: gate rows, then up rows), v = vd in fp32 (what the kernel quantizes),
// and slack[f]: how far the GPU's fp32 v may be from vd before it is quantized: the dot products'
// fp32 sums of ~14-bit tensor-core blocks (2^-9 sum|terms|: 4x the core test's worst), through
// silu' (<= 1.1) and u, plus the tanh form of silu (|g| 2^-18 measured, 2^-16 here).
inline void swiglu_reference_row(const double* xr, const double* w1, int e, int F, int H, double* vd, float* v,
                                 double* slack) {
  for (int f = 0; f < F; ++f) {
    const double* g = &w1[(size_t(e) * 2 * F + size_t(f)) * H];
    const double* u = &w1[(size_t(e) * 2 * F + size_t(F + f)) * H];
    double sg = 0, su = 0, ag = 0, au = 0;
    for (int h = 0; h < H; ++h) {
      sg += xr[h] * g[h], su += xr[h] * u[h];
      ag += std::fabs(xr[h] * g[h]), au += std::fabs(xr[h] * u[h]);
    }
    const double silu = sg / (1.0 + std::exp(-sg));
    vd[f] = silu * su;
    v[f] = float(vd[f]);
    const double dg = std::ldexp(ag, -9), du = std::ldexp(au, -9);
    slack[f] = 1.1 * dg * (std::fabs(su) + du) + std::fabs(silu) * du + std::ldexp(std::fabs(sg * su), -16);
  }
}

struct OutputError {
  double rel = 0, worst_token = 0;
};
// out (bf16 bits [T, H]) against y (fp64): every element finite, rows without pairs exactly 0, relative
// L2 <= 1e-2 over the output and <= 3e-2 for every token with output (issue 50's accuracy target).
inline OutputError check_output(const std::vector<uint16_t>& out, const std::vector<double>& y, const Segments& s,
                                int T, int H) {
  OutputError r;
  double num = 0, den = 0;
  int64_t nonzero_unrouted = 0, nonfinite = 0;
  std::vector<int> routed(size_t(T), 0);
  for (const auto& pairs : s.seg)
    for (const auto& pr : pairs) routed[size_t(pr.first)] = 1;
  for (int t = 0; t < T; ++t) {
    double tn = 0, td = 0;
    for (int h = 0; h < H; ++h) {
      const float got = bf16::to_float(out[size_t(t) * H + size_t(h)]);
      const double want = y[size_t(t) * H + size_t(h)];
      if (!std::isfinite(got)) ++nonfinite;
      if (!routed[size_t(t)] && got != 0.0f) ++nonzero_unrouted;
      tn += (got - want) * (got - want);
      td += want * want;
    }
    num += tn, den += td;
    if (td > 0) r.worst_token = std::max(r.worst_token, std::sqrt(tn / td));
  }
  r.rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  EXPECT_EQ(nonfinite, 0);
  EXPECT_EQ(nonzero_unrouted, 0);
  EXPECT_LE(r.rel, 1e-2);
  EXPECT_LE(r.worst_token, 3e-2);
  return r;
}

}  // namespace epmoe::test::fp8k
