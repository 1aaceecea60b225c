#include "cpu_experts.h"

#include "epmoe/error.h"
#include "epmoe/fp8_block.h"
#include "epmoe/mxfp8.h"

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

float sigmoid(float g) { return 1.f / (1.f + std::exp(-g)); }
float silu(float g) { return g / (1.f + std::exp(-g)); }

// acc[0, n) += the per-expert contributions fn(e, into) adds into its argument, summed in expert
// order whatever the threads (so the result does not depend on thread timing): on one thread
// straight into acc; on several, experts striped over the threads into private buffers, summed
// afterwards in expert order (the same fp32 sums as the one-thread order).
template <class Fn>
void sum_over_experts(int experts, int threads, int64_t n, float* acc, Fn&& fn) {
  if (threads <= 1 || experts <= 1) {
    for (int e = 0; e < experts; ++e) fn(e, acc);
    return;
  }
  const int nt = std::min(threads, experts);
  std::vector<std::vector<float>> part(experts);
  std::vector<std::thread> pool;
  for (int t = 0; t < nt; ++t)
    pool.emplace_back([&, t] {
      for (int e = t; e < experts; e += nt) {
        part[e].assign(size_t(n), 0.f);
        fn(e, part[e].data());
      }
    });
  for (auto& th : pool) th.join();
  for (int e = 0; e < experts; ++e)
    for (int64_t i = 0; i < n; ++i) acc[i] += part[e][size_t(i)];
}
}  // namespace

CpuExperts::CpuExperts(const MoeConfig& cfg, const bf16* w1, const bf16* w2, int threads)
    : cfg_(cfg), w1_(w1), w2_(w2), threads_(std::max(1, threads)) {}

void CpuExperts::round_trip(float* v, int K) const {
  if (mx_.block()) fp8b::round_trip_row(v, K);
  else mx::round_trip_row(v, K);
}
int64_t CpuExperts::packed_row_bytes(int K) const {
  return mx_.block() ? fp8b::packed_row_bytes(K) : mx::packed_row_bytes(K);
}
void CpuExperts::dequantize_packed(const uint8_t* packed, int K, float* out) const {
  if (mx_.block()) fp8b::dequantize_packed_row(packed, K, out);
  else mx::dequantize_packed_row(packed, K, out);
}

void CpuExperts::expert_weights_t(int e, float* w1t, float* w2t) const {
  const int H = cfg_.hidden, F = cfg_.ffn;
  if (mx_.w1 != nullptr) {
    std::vector<float> w1(size_t(2) * F * H), w2(size_t(H) * F);
    if (mx_.block()) {
      const int64_t b1 = int64_t(2 * F / fp8b::kBlock) * (H / fp8b::kBlock), b2 = int64_t(H / fp8b::kBlock) * (F / fp8b::kBlock);
      fp8b::dequantize_weight(mx_.w1 + int64_t(e) * 2 * F * H, mx_.w1_block_scale + e * b1, 2 * F, H, w1.data());
      fp8b::dequantize_weight(mx_.w2 + int64_t(e) * H * F, mx_.w2_block_scale + e * b2, H, F, w2.data());
    } else {
      mx::dequantize_rows(mx_.w1 + int64_t(e) * 2 * F * H, mx_.w1_scale + int64_t(e) * 2 * F * (H / mx::kBlock), 2 * F,
                          H, w1.data());
      mx::dequantize_rows(mx_.w2 + int64_t(e) * H * F, mx_.w2_scale + int64_t(e) * H * (F / mx::kBlock), H, F, w2.data());
    }
    for (int o = 0; o < 2 * F; ++o)
      for (int c = 0; c < H; ++c) w1t[size_t(c) * 2 * F + o] = w1[size_t(o) * H + c];
    for (int o = 0; o < H; ++o)
      for (int c = 0; c < F; ++c) w2t[size_t(c) * H + o] = w2[size_t(o) * F + c];
    return;
  }
  const bf16* w1 = w1_ + int64_t(e) * 2 * F * H;
  const bf16* w2 = w2_ + int64_t(e) * H * F;
  for (int o = 0; o < 2 * F; ++o)
    for (int c = 0; c < H; ++c) w1t[size_t(c) * 2 * F + o] = w1[int64_t(o) * H + c].f();
  for (int o = 0; o < H; ++o)
    for (int c = 0; c < F; ++c) w2t[size_t(c) * H + o] = w2[int64_t(o) * F + c].f();
}

void CpuExperts::run_expert(int e, const Rows& x, const protocol::ExpertLayout& L, float* acc, bf16* h) const {
  const int H = cfg_.hidden, F = cfg_.ffn;
  const int64_t begin = L.padded_offsets[e], n = L.expert_counts[e];
  if (n == 0) return;
  // Transposed fp32 copies of this expert's weights: w1t[H, 2F], w2t[F, H].
  std::vector<float> w1t(size_t(H) * 2 * F), w2t(size_t(F) * H);
  expert_weights_t(e, w1t.data(), w2t.data());
  const bool mx = mx_.w1 != nullptr;

  std::vector<float> xb(size_t(kRowBlock) * H), gu(size_t(kRowBlock) * 2 * F), act(size_t(kRowBlock) * F),
      y(size_t(kRowBlock) * H);
  for (int64_t i0 = 0; i0 < n; i0 += kRowBlock) {
    const int m = int(std::min<int64_t>(kRowBlock, n - i0));
    for (int i = 0; i < m; ++i) {
      const int64_t row = L.pair_row[begin + i0 + i];
      if (x.mx_rows != nullptr) {  // quantized at the source
        dequantize_packed(x.mx_rows + row * packed_row_bytes(H), H, &xb[size_t(i) * H]);
        continue;
      }
      const bf16* src = x.bf16_rows + row * H;
      for (int c = 0; c < H; ++c) xb[size_t(i) * H + c] = src[c].f();
      if (mx) round_trip(&xb[size_t(i) * H], H);  // x quantized on the fly
    }
    std::fill(gu.begin(), gu.end(), 0.f);
    gemm_axpy(xb.data(), H, m, w1t.data(), H, 2 * F, gu.data());
    if (h != nullptr)
      for (int i = 0; i < m; ++i)
        for (int j = 0; j < 2 * F; ++j) h[(begin + i0 + i) * 2 * F + j] = bf16(gu[size_t(i) * 2 * F + j]);
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < F; ++j) {
        const float g = gu[size_t(i) * 2 * F + j], u = gu[size_t(i) * 2 * F + F + j];
        const float a = silu(g) * u;
        act[size_t(i) * F + j] = mx ? a : round_bf16(a);  // the kernels hand bf16 (or MXFP8) to DOWN
      }
    if (mx)
      for (int i = 0; i < m; ++i) round_trip(&act[size_t(i) * F], F);  // act requantized
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

void CpuExperts::run(const bf16* x, const int32_t* meta, int64_t rows, bf16* out, bf16* h) const {
  run_rows({x, nullptr}, meta, rows, out, h);
}

void CpuExperts::run_packed_mx(const uint8_t* x, const int32_t* meta, int64_t rows, bf16* out) const {
  EPMOE_CHECK(mx_.w1 != nullptr, ErrorCode::internal, "CpuExperts::run_packed_mx: the weights are not FP8");
  run_rows({nullptr, x}, meta, rows, out, nullptr);
}

void CpuExperts::run_rows(const Rows& x, const int32_t* meta, int64_t rows, bf16* out, bf16* h) const {
  EPMOE_CHECK(mx_.w1 == nullptr || h == nullptr, ErrorCode::internal, "CpuExperts::run: MXFP8 keeps no h");
  const int H = cfg_.hidden, El = cfg_.experts_per_rank();
  const protocol::ExpertLayout L = protocol::expert_layout(meta, rows, cfg_.top_k, El, /*tile=*/1);
  std::vector<float> acc(size_t(rows) * H, 0.f);
  sum_over_experts(El, threads_, rows * H, acc.data(), [&](int e, float* into) {
    if (L.expert_counts[e] > 0) run_expert(e, x, L, into, h);
  });
  for (size_t i = 0; i < acc.size(); ++i) out[i] = bf16(acc[i]);
}

void CpuExperts::backward_expert(int e, const bf16* x, const int32_t* meta, const protocol::ExpertLayout& L,
                                 const bf16* dy, const bf16* h, float* dx_acc, float* ds, float* dw1,
                                 float* dw2) const {
  const int H = cfg_.hidden, F = cfg_.ffn, k = cfg_.top_k;
  const int64_t begin = L.padded_offsets[e], n = L.expert_counts[e];
  if (n == 0) return;
  const bf16* w1 = w1_ + int64_t(e) * 2 * F * H;  // [2F, H]: as bt of dx = dh . W1
  const bf16* w2 = w2_ + int64_t(e) * H * F;      // [H, F]: as bt of da' = dy . W2
  std::vector<float> w1f(size_t(2) * F * H), w2f(size_t(H) * F), w1t;
  for (size_t i = 0; i < w1f.size(); ++i) w1f[i] = w1[i].f();
  for (size_t i = 0; i < w2f.size(); ++i) w2f[i] = w2[i].f();
  if (h == nullptr) {  // recompute: the forward's transposed W1, the forward's GEMM order
    w1t.assign(size_t(H) * 2 * F, 0.f);
    for (int o = 0; o < 2 * F; ++o)
      for (int c = 0; c < H; ++c) w1t[size_t(c) * 2 * F + o] = w1f[size_t(o) * H + c];
  }
  float* dw1e = dw1 + int64_t(e) * 2 * F * H;
  float* dw2e = dw2 + int64_t(e) * H * F;
  std::vector<float> xb(size_t(kRowBlock) * H), dyb(size_t(kRowBlock) * H), gu(size_t(kRowBlock) * 2 * F),
      act(size_t(kRowBlock) * F), dap(size_t(kRowBlock) * F), dh(size_t(kRowBlock) * 2 * F),
      dxb(size_t(kRowBlock) * H);
  for (int64_t i0 = 0; i0 < n; i0 += kRowBlock) {
    const int m = int(std::min<int64_t>(kRowBlock, n - i0));
    for (int i = 0; i < m; ++i) {
      const int64_t row = L.pair_row[begin + i0 + i];
      for (int c = 0; c < H; ++c) {
        xb[size_t(i) * H + c] = x[row * H + c].f();
        dyb[size_t(i) * H + c] = dy[row * H + c].f();
      }
    }
    if (h != nullptr) {
      for (int i = 0; i < m; ++i)
        for (int j = 0; j < 2 * F; ++j) gu[size_t(i) * 2 * F + j] = h[(begin + i0 + i) * 2 * F + j].f();
    } else {
      std::fill(gu.begin(), gu.end(), 0.f);
      gemm_axpy(xb.data(), H, m, w1t.data(), H, 2 * F, gu.data());
      for (float& v : gu) v = round_bf16(v);  // as saved
    }
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < F; ++j)
        act[size_t(i) * F + j] = round_bf16(silu(gu[size_t(i) * 2 * F + j]) * gu[size_t(i) * 2 * F + F + j]);
    std::fill(dap.begin(), dap.end(), 0.f);
    gemm_axpy(dyb.data(), H, m, w2f.data(), H, F, dap.data());  // da' = dy . W2
    for (int i = 0; i < m; ++i) {
      const int64_t pair = begin + i0 + i;
      const int64_t row = L.pair_row[pair];
      const float s = L.pair_weight[pair];
      double dsum = 0;
      for (int j = 0; j < F; ++j) dsum += double(dap[size_t(i) * F + j]) * act[size_t(i) * F + j];
      // The row's local slot of expert e, in meta order (the order the source reads ds back in).
      const int32_t* m_row = meta + row * protocol::meta_words(k);
      int slot = 0;
      while (slot < k && m_row[1 + slot] != e) ++slot;
      ds[row * k + slot] = float(dsum);
      for (int j = 0; j < F; ++j) {
        const float g = gu[size_t(i) * 2 * F + j], u = gu[size_t(i) * 2 * F + F + j];
        const float sg = sigmoid(g), da = s * dap[size_t(i) * F + j];
        dh[size_t(i) * 2 * F + j] = da * u * sg * (1.f + g * (1.f - sg));  // silu'(g) = sg (1 + g (1 - sg))
        dh[size_t(i) * 2 * F + F + j] = da * g * sg;                        // silu(g)
      }
    }
    std::fill(dxb.begin(), dxb.end(), 0.f);
    gemm_axpy(dh.data(), 2 * F, m, w1f.data(), 2 * F, H, dxb.data());  // dx = dh . W1
    for (int i = 0; i < m; ++i) {
      const int64_t pair = begin + i0 + i;
      const int64_t row = L.pair_row[pair];
      const float s = L.pair_weight[pair];
      float* d = dx_acc + row * H;
      for (int c = 0; c < H; ++c) d[c] += dxb[size_t(i) * H + c];
      // dW2 += s dy act^T, dW1 += dh x^T (row by row: the weights' rows stream once per row block)
      for (int c = 0; c < H; ++c) {
        const float v = s * dyb[size_t(i) * H + c];
        if (v == 0.f) continue;
        float* o = dw2e + int64_t(c) * F;
        for (int j = 0; j < F; ++j) o[j] += v * act[size_t(i) * F + j];
      }
      for (int o2 = 0; o2 < 2 * F; ++o2) {
        const float v = dh[size_t(i) * 2 * F + o2];
        if (v == 0.f) continue;
        float* o = dw1e + int64_t(o2) * H;
        for (int c = 0; c < H; ++c) o[c] += v * xb[size_t(i) * H + c];
      }
    }
  }
}

void CpuExperts::backward(const bf16* x, const int32_t* meta, int64_t rows, const bf16* dy, const bf16* h, bf16* dx,
                          float* ds, float* dw1, float* dw2) const {
  EPMOE_CHECK(mx_.w1 == nullptr, ErrorCode::internal, "CpuExperts::backward: the MXFP8 path is forward-only");
  const int H = cfg_.hidden, El = cfg_.experts_per_rank();
  const protocol::ExpertLayout L = protocol::expert_layout(meta, rows, cfg_.top_k, El, /*tile=*/1);
  std::fill(ds, ds + rows * cfg_.top_k, 0.f);
  // dW per expert is its own; ds is written once per (row, slot).
  std::vector<float> acc(size_t(rows) * H, 0.f);
  sum_over_experts(El, threads_, rows * H, acc.data(), [&](int e, float* into) {
    if (L.expert_counts[e] > 0) backward_expert(e, x, meta, L, dy, h, into, ds, dw1, dw2);
  });
  for (size_t i = 0; i < acc.size(); ++i) dx[i] = bf16(acc[i]);
}

}  // namespace epmoe
