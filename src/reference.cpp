// The dense reference: token by token, slot by slot, straight from the definition. fp64 dot
// products (an oracle one precision above every backend); the activation is rounded to bf16, as
// the backends hand it to the down projection.
#include "epmoe/reference.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "epmoe/error.h"
#include "epmoe/fp8_block.h"
#include "epmoe/mxfp8.h"

namespace epmoe {

namespace {
double dot(const bf16* w, const float* x, int n) {
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int c = 0;
  for (; c + 4 <= n; c += 4) {
    s0 += double(w[c].f()) * x[c];
    s1 += double(w[c + 1].f()) * x[c + 1];
    s2 += double(w[c + 2].f()) * x[c + 2];
    s3 += double(w[c + 3].f()) * x[c + 3];
  }
  for (; c < n; ++c) s0 += double(w[c].f()) * x[c];
  return (s0 + s1) + (s2 + s3);
}
}  // namespace

void reference_moe(const bf16* x, const int32_t* ids, const float* wts, int64_t T, int k, const bf16* w1,
                   const bf16* w2, int E, int H, int F, float* y) {
  std::vector<float> xf(H), act(F);
  std::vector<double> acc(H);
  for (int64_t t = 0; t < T; ++t) {
    for (int c = 0; c < H; ++c) xf[c] = x[t * H + c].f();
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int j = 0; j < k; ++j) {
      const int e = ids[t * k + j];
      if (e == -1) continue;
      EPMOE_CHECK(e >= 0 && e < E, ErrorCode::expert_id_out_of_range, "reference_moe: id ", e, " at token ", t);
      const bf16* w1e = w1 + int64_t(e) * 2 * F * H;
      const bf16* w2e = w2 + int64_t(e) * H * F;
      for (int i = 0; i < F; ++i) {
        const double g = dot(w1e + int64_t(i) * H, xf.data(), H);
        const double u = dot(w1e + int64_t(F + i) * H, xf.data(), H);
        act[i] = round_bf16(float(g / (1.0 + std::exp(-g)) * u));
      }
      for (int c = 0; c < H; ++c) acc[c] += double(wts[t * k + j]) * dot(w2e + int64_t(c) * F, act.data(), F);
    }
    for (int c = 0; c < H; ++c) y[t * H + c] = float(acc[c]);
  }
}

namespace {

// The FP8 layers' reference (MXFP8, block-128): x through the format once per token, then expert by
// expert - dequantize(e, w1, w2) gives its weights in fp32 (exact: E4M3 times the scale) - every
// (token, slot) of it adding into the token's fp64 sum; act through the format per row (round_trip).
// The slots' order per token does not matter beyond fp64 rounding.
template <class Dequantize, class RoundTrip>
void reference_moe_fp8(const bf16* x, const int32_t* ids, const float* wts, int64_t T, int k, int E, int H, int F,
                       const char* who, Dequantize&& dequantize, RoundTrip&& round_trip, float* y) {
  for (int64_t i = 0; i < T * k; ++i)
    EPMOE_CHECK(ids[i] >= -1 && ids[i] < E, ErrorCode::expert_id_out_of_range, who, ": id ", ids[i], " at token ",
                i / k);
  std::vector<float> xf(size_t(T) * H), act(F), w1(size_t(2) * F * H), w2(size_t(H) * F);
  for (int64_t i = 0; i < T * H; ++i) xf[size_t(i)] = x[i].f();
  for (int64_t t = 0; t < T; ++t) round_trip(&xf[size_t(t) * H], H);
  std::vector<double> acc(size_t(T) * H, 0.0);
  auto row_dot = [](const float* w, int n, const float* v) {  // dequantized row . v
    double d = 0;
    for (int c = 0; c < n; ++c) d += double(w[c]) * v[c];
    return d;
  };
  for (int e = 0; e < E; ++e) {
    bool used = false;
    for (int64_t i = 0; i < T * k && !used; ++i) used = ids[i] == e;
    if (!used) continue;
    dequantize(e, w1.data(), w2.data());
    for (int64_t t = 0; t < T; ++t)
      for (int j = 0; j < k; ++j) {
        if (ids[t * k + j] != e) continue;
        const float* xr = &xf[size_t(t) * H];
        for (int i = 0; i < F; ++i) {
          const double g = row_dot(&w1[size_t(i) * H], H, xr), u = row_dot(&w1[size_t(F + i) * H], H, xr);
          act[i] = float(g / (1.0 + std::exp(-g)) * u);
        }
        round_trip(act.data(), F);
        for (int c = 0; c < H; ++c) acc[size_t(t) * H + c] += double(wts[t * k + j]) * row_dot(&w2[size_t(c) * F], F, act.data());
      }
  }
  for (int64_t i = 0; i < T * H; ++i) y[i] = float(acc[size_t(i)]);
}

}  // namespace

void reference_moe_mxfp8(const bf16* x, const int32_t* ids, const float* wts, int64_t T, int k, const uint8_t* w1q,
                         const uint8_t* w1s, const uint8_t* w2q, const uint8_t* w2s, int E, int H, int F, float* y) {
  const int b1 = H / mx::kBlock, b2 = F / mx::kBlock;
  reference_moe_fp8(
      x, ids, wts, T, k, E, H, F, "reference_moe_mxfp8",
      [&](int e, float* w1, float* w2) {
        mx::dequantize_rows(w1q + int64_t(e) * 2 * F * H, w1s + int64_t(e) * 2 * F * b1, 2 * F, H, w1);
        mx::dequantize_rows(w2q + int64_t(e) * H * F, w2s + int64_t(e) * H * b2, H, F, w2);
      },
      [](float* v, int K) { mx::round_trip_row(v, K); }, y);
}

void reference_moe_fp8_block(const bf16* x, const int32_t* ids, const float* wts, int64_t T, int k, const uint8_t* w1q,
                             const float* w1s, const uint8_t* w2q, const float* w2s, int E, int H, int F, float* y) {
  const int64_t b1 = int64_t(2 * F / fp8b::kBlock) * (H / fp8b::kBlock), b2 = int64_t(H / fp8b::kBlock) * (F / fp8b::kBlock);
  reference_moe_fp8(
      x, ids, wts, T, k, E, H, F, "reference_moe_fp8_block",
      [&](int e, float* w1, float* w2) {
        fp8b::dequantize_weight(w1q + int64_t(e) * 2 * F * H, w1s + e * b1, 2 * F, H, w1);
        fp8b::dequantize_weight(w2q + int64_t(e) * H * F, w2s + e * b2, H, F, w2);
      },
      [](float* v, int K) { fp8b::round_trip_row(v, K); }, y);
}

}  // namespace epmoe
