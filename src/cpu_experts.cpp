#include "cpu_experts.h"

#include <algorithm>
#include <cmath>
#include <mutex>
#include <thread>
#include <vector>

namespace epmoe {

namespace {

// Row blocks share each weight row they stream, so the weights are read rows/kRowBlock times.
constexpr int kRowBlock = 8;

// out[i, :n] += sum_c a[i, c] * bt[c, :n] for i < m (rows of a have stride lda). bt is K-major
// ([K, n]), so the inner loop is a contiguous axpy the compiler vectorizes without reassociation.
void gemm_axpy(const float* a, int64_t lda, int m, const float* bt, int K, int n, float* out) {
  for (int c = 0; c < K; ++c) {
    const float* b = bt + int64_t(c) * n;
    for (int i = 0; i < m; ++i) {
      const float s = a[i * lda + c];
      if (s == 0.f) continue;
      float* o = out + int64_t(i) * n;
      for (int j = 0; j < n; ++j) o[j] += s * b[j];
    }
  }
}

float silu(float g) { return g / (1.f + std::exp(-g)); }

}  // namespace

CpuExperts::CpuExperts(const MoeConfig& cfg, const bf16* w1, const bf16* w2, int threads)
    : cfg_(cfg), w1_(w1), w2_(w2), threads_(std::max(1, threads)) {}

void CpuExperts::run_expert(int e, const bf16* x, const protocol::ExpertLayout& L, float* acc) const {
  const int H = cfg_.hidden, F = cfg_.ffn;
  const int64_t begin = L.padded_offsets[e], n = L.expert_counts[e];
  if (n == 0) return;
  // Transposed fp32 copies of this expert's weights: w1t[H, 2F], w2t[F, H].
  std::vector<float> w1t(size_t(H) * 2 * F), w2t(size_t(F) * H);
  const bf16* w1 = w1_ + int64_t(e) * 2 * F * H;
  const bf16* w2 = w2_ + int64_t(e) * H * F;
  for (int o = 0; o < 2 * F; ++o)
    for (int c = 0; c < H; ++c) w1t[size_t(c) * 2 * F + o] = w1[int64_t(o) * H + c].f();
  for (int o = 0; o < H; ++o)
    for (int c = 0; c < F; ++c) w2t[size_t(c) * H + o] = w2[int64_t(o) * F + c].f();

  std::vector<float> xb(size_t(kRowBlock) * H), gu(size_t(kRowBlock) * 2 * F), act(size_t(kRowBlock) * F),
      y(size_t(kRowBlock) * H);
  for (int64_t i0 = 0; i0 < n; i0 += kRowBlock) {
    const int m = int(std::min<int64_t>(kRowBlock, n - i0));
    for (int i = 0; i < m; ++i) {
      const bf16* src = x + int64_t(L.pair_row[begin + i0 + i]) * H;
      for (int c = 0; c < H; ++c) xb[size_t(i) * H + c] = src[c].f();
    }
    std::fill(gu.begin(), gu.end(), 0.f);
    gemm_axpy(xb.data(), H, m, w1t.data(), H, 2 * F, gu.data());
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < F; ++j) {
        const float g = gu[size_t(i) * 2 * F + j], u = gu[size_t(i) * 2 * F + F + j];
        act[size_t(i) * F + j] = round_bf16(silu(g) * u);  // the kernels hand bf16 to the down GEMM
      }
    std::fill(y.begin(), y.end(), 0.f);
    gemm_axpy(act.data(), F, m, w2t.data(), F, H, y.data());
    for (int i = 0; i < m; ++i) {
      const int64_t row = L.pair_row[begin + i0 + i];
      const float w = L.pair_weight[begin + i0 + i];
      float* a = acc + row * H;
      for (int c = 0; c < H; ++c) a[c] += w * y[size_t(i) * H + c];
    }
  }
}

void CpuExperts::run(const bf16* x, const int32_t* meta, int64_t rows, bf16* out) const {
  const int H = cfg_.hidden, El = cfg_.experts_per_rank();
  const protocol::ExpertLayout L = protocol::expert_layout(meta, rows, cfg_.top_k, El, /*tile=*/1);
  std::vector<float> acc(size_t(rows) * H, 0.f);
  if (threads_ == 1 || El == 1) {
    for (int e = 0; e < El; ++e) run_expert(e, x, L, acc.data());
  } else {
    // Experts in parallel, each into a private accumulator, summed in expert order afterwards so
    // the result does not depend on thread timing.
    const int nt = std::min(threads_, El);
    std::vector<std::vector<float>> part(El);
    std::vector<std::thread> pool;
    for (int t = 0; t < nt; ++t)
      pool.emplace_back([&, t] {
        for (int e = t; e < El; e += nt) {
          if (L.expert_counts[e] == 0) continue;
          part[e].assign(size_t(rows) * H, 0.f);
          run_expert(e, x, L, part[e].data());
        }
      });
    for (auto& th : pool) th.join();
    for (int e = 0; e < El; ++e)
      if (!part[e].empty())
        for (size_t i = 0; i < acc.size(); ++i) acc[i] += part[e][i];
  }
  for (size_t i = 0; i < acc.size(); ++i) out[i] = bf16(acc[i]);
}

}  // namespace epmoe
