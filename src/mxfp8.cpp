// MXFP8 conversions (epmoe/mxfp8.h), on the host: the CPU engine's MXFP8 path, the reference, the
// tests, and callers quantizing their weights.
#include "epmoe/mxfp8.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "epmoe/error.h"

namespace epmoe::mx {

float e4m3_to_float(uint8_t v) {
  const int e = (v >> 3) & 15, m = v & 7;
  if (e == 15 && m == 7) return std::nanf("");
  const float mag = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(1.0f + float(m) / 8.0f, e - 7);
  return (v & 0x80) ? -mag : mag;
}

uint8_t e4m3_from_float(float v) {
  if (std::isnan(v)) return kE4m3Nan;
  const uint8_t sign = std::signbit(v) ? 0x80 : 0x00;
  const float a = std::fabs(v);
  if (a >= kE4m3Max) return sign | 0x7E;  // saturate (448 = 1.75 * 2^8: exponent field 15, mantissa 6)
  if (a < std::ldexp(1.0f, -6)) {         // subnormal: m * 2^-9, m in 0..7 (8 rounds up to the smallest normal)
    const int m = int(std::nearbyint(std::ldexp(a, 9)));
    return sign | uint8_t(m);  // (m == 8 is exactly the smallest normal's code, 0x08)
  }
  int e = 0;
  const float f = std::frexp(a, &e);  // a = f 2^e, f in [0.5, 1): a = (1 + m/8) 2^(e - 1)
  int m = int(std::nearbyint((f * 2.0f - 1.0f) * 8.0f));
  int ex = e - 1;
  if (m == 8) m = 0, ++ex;
  const int field = ex + 7;
  if (field > 15 || (field == 15 && m == 7)) return sign | 0x7E;  // (unreachable below 448; kept as a guard)
  return sign | uint8_t(field << 3) | uint8_t(m);
}

float e8m0_to_float(uint8_t s) { return s == kE8m0Nan ? std::nanf("") : std::ldexp(1.0f, int(s) - 127); }

uint8_t e8m0_for_amax(float amax) {
  if (!std::isfinite(amax)) return kE8m0Nan;
  if (amax == 0.0f) return 0;
  int e = 0;
  (void)std::frexp(amax, &e);  // amax in [2^(e-1), 2^e): floor(log2) = e - 1
  const int shared = std::clamp(e - 1 - kE4m3Emax, -127, 127);
  return uint8_t(shared + 127);
}

namespace {
template <class T>
void quantize_impl(const T* x, int64_t rows, int K, uint8_t* q, uint8_t* s) {
  EPMOE_CHECK(K > 0 && K % kBlock == 0, ErrorCode::invalid_argument, "MXFP8: K (", K, ") must be a multiple of ",
              kBlock);
  const int blocks = K / kBlock;
  for (int64_t r = 0; r < rows; ++r)
    for (int b = 0; b < blocks; ++b) {
      const int64_t base = r * K + int64_t(b) * kBlock;
      float amax = 0.0f;
      for (int i = 0; i < kBlock; ++i) {
        const float v = float(x[base + i]);
        amax = std::isnan(v) || std::isnan(amax) ? std::nanf("") : std::max(amax, std::fabs(v));
      }
      const uint8_t sc = e8m0_for_amax(amax);
      s[r * blocks + b] = sc;
      const float inv = sc == kE8m0Nan ? 0.0f : std::ldexp(1.0f, 127 - int(sc));  // exact: a power of two
      for (int i = 0; i < kBlock; ++i)
        q[base + i] = sc == kE8m0Nan ? kE4m3Nan : e4m3_from_float(float(x[base + i]) * inv);
    }
}
}  // namespace

void quantize_rows(const float* x, int64_t rows, int K, uint8_t* q, uint8_t* s) { quantize_impl(x, rows, K, q, s); }
void quantize_rows(const bf16* x, int64_t rows, int K, uint8_t* q, uint8_t* s) { quantize_impl(x, rows, K, q, s); }

void dequantize_rows(const uint8_t* q, const uint8_t* s, int64_t rows, int K, float* out) {
  EPMOE_CHECK(K > 0 && K % kBlock == 0, ErrorCode::invalid_argument, "MXFP8: K (", K, ") must be a multiple of ",
              kBlock);
  const int blocks = K / kBlock;
  for (int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < K; ++c) out[r * K + c] = e4m3_to_float(q[r * K + c]) * e8m0_to_float(s[r * blocks + c / kBlock]);
}

void quantize_packed_row(const bf16* x, int K, uint8_t* packed) {
  quantize_rows(x, 1, K, packed, packed + K);
  std::memset(packed + K + K / kBlock, 0, size_t(packed_scale_bytes(K) - K / kBlock));  // (the padding)
}

void pack_row(const uint8_t* q, const uint8_t* s, int K, uint8_t* packed) {
  std::memcpy(packed, q, size_t(K));
  std::memcpy(packed + K, s, size_t(K / kBlock));
  std::memset(packed + K + K / kBlock, 0, size_t(packed_scale_bytes(K) - K / kBlock));
}
void dequantize_packed_row(const uint8_t* packed, int K, float* out) { dequantize_rows(packed, packed + K, 1, K, out); }

void round_trip_row(float* v, int K) {
  std::vector<uint8_t> q(static_cast<size_t>(K)), s(static_cast<size_t>(K / kBlock + 1));
  quantize_rows(v, 1, K, q.data(), s.data());
  dequantize_rows(q.data(), s.data(), 1, K, v);
}

}  // namespace epmoe::mx
