// FP8 with 128-element block scales (epmoe/fp8_block.h): the host quantizer and its inverse.
#include "epmoe/fp8_block.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "epmoe/error.h"
#include "epmoe/mxfp8.h"

namespace epmoe::fp8b {

float scale_for_amax(float amax) {
  if (!std::isfinite(amax)) return std::numeric_limits<float>::quiet_NaN();
  return amax == 0.0f ? 1.0f : amax / mx::kE4m3Max;
}

namespace {

void check_k(int K, const char* who) {
  EPMOE_CHECK(K > 0 && K % kBlock == 0, ErrorCode::invalid_argument, who, ": K (", K, ") must be a multiple of ", kBlock);
}

// The block's `rows` x `n` elements (rows row_len apart) with scale s (NaN: the NaN code everywhere).
template <class T>
void quantize_block(const T* v, int64_t n, int64_t rows, int64_t row_len, float s, uint8_t* q) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < n; ++c) {
      const int64_t i = r * row_len + c;
      q[i] = std::isnan(s) ? mx::kE4m3Nan : mx::e4m3_from_float(float(v[i]) / s);
    }
}

template <class T>
float block_amax(const T* v, int64_t rows, int64_t n, int64_t row_len) {
  float amax = 0.0f;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < n; ++c) {
      const float a = std::fabs(float(v[r * row_len + c]));
      if (std::isnan(a) || std::isinf(a)) return std::numeric_limits<float>::infinity();
      amax = std::fmax(amax, a);
    }
  return amax;
}

template <class T>
void quantize_rows_impl(const T* x, int64_t rows, int K, uint8_t* q, float* s) {
  check_k(K, "FP8 block rows");
  const int blocks = K / kBlock;
  for (int64_t r = 0; r < rows; ++r)
    for (int b = 0; b < blocks; ++b) {
      const int64_t base = r * K + int64_t(b) * kBlock;
      const float sc = scale_for_amax(block_amax(x + base, 1, kBlock, K));
      s[r * blocks + b] = sc;
      quantize_block(x + base, kBlock, 1, K, sc, q + base);
    }
}

template <class T>
void quantize_weight_impl(const T* w, int64_t rows, int K, uint8_t* q, float* s) {
  check_k(K, "FP8 block weight");
  EPMOE_CHECK(rows > 0 && rows % kBlock == 0, ErrorCode::invalid_argument, "FP8 block weight: rows (", rows,
              ") must be a multiple of ", kBlock);
  const int64_t rb = rows / kBlock, kb = K / kBlock;
  for (int64_t i = 0; i < rb; ++i)
    for (int64_t j = 0; j < kb; ++j) {
      const int64_t base = i * kBlock * K + j * kBlock;
      const float sc = scale_for_amax(block_amax(w + base, kBlock, kBlock, K));
      s[i * kb + j] = sc;
      quantize_block(w + base, kBlock, kBlock, K, sc, q + base);
    }
}

}  // namespace

void quantize_rows(const float* x, int64_t rows, int K, uint8_t* q, float* s) { quantize_rows_impl(x, rows, K, q, s); }
void quantize_rows(const bf16* x, int64_t rows, int K, uint8_t* q, float* s) { quantize_rows_impl(x, rows, K, q, s); }

void dequantize_rows(const uint8_t* q, const float* s, int64_t rows, int K, float* out) {
  check_k(K, "FP8 block rows");
  const int blocks = K / kBlock;
  for (int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < K; ++c) out[r * K + c] = mx::e4m3_to_float(q[r * K + c]) * s[r * blocks + c / kBlock];
}

void round_trip_row(float* v, int K) {
  check_k(K, "FP8 block round trip");
  uint8_t q[kBlock];
  for (int b = 0; b < K / kBlock; ++b) {
    float* blk = v + int64_t(b) * kBlock;
    const float sc = scale_for_amax(block_amax(blk, 1, kBlock, kBlock));
    quantize_block(blk, kBlock, 1, kBlock, sc, q);
    for (int i = 0; i < kBlock; ++i) blk[i] = mx::e4m3_to_float(q[i]) * sc;
  }
}

void quantize_weight(const float* w, int64_t rows, int K, uint8_t* q, float* s) { quantize_weight_impl(w, rows, K, q, s); }
void quantize_weight(const bf16* w, int64_t rows, int K, uint8_t* q, float* s) { quantize_weight_impl(w, rows, K, q, s); }

void dequantize_weight(const uint8_t* q, const float* s, int64_t rows, int K, float* out) {
  check_k(K, "FP8 block weight");
  EPMOE_CHECK(rows % kBlock == 0, ErrorCode::invalid_argument, "FP8 block weight: rows (", rows,
              ") must be a multiple of ", kBlock);
  const int64_t kb = K / kBlock;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < K; ++c)
      out[r * K + c] = mx::e4m3_to_float(q[r * K + c]) * s[(r / kBlock) * kb + c / kBlock];
}

void quantize_packed_row(const bf16* x, int K, uint8_t* packed) {
  float s[1024];
  EPMOE_CHECK(K / kBlock <= 1024, ErrorCode::invalid_argument, "FP8 block row: K ", K, " too long");
  quantize_rows(x, 1, K, packed, s);
  std::memset(packed + K, 0, size_t(packed_scale_bytes(K)));
  std::memcpy(packed + K, s, size_t(K / kBlock) * sizeof(float));
}

void dequantize_packed_row(const uint8_t* packed, int K, float* out) {
  float s[1024];
  EPMOE_CHECK(K / kBlock <= 1024, ErrorCode::invalid_argument, "FP8 block row: K ", K, " too long");
  std::memcpy(s, packed + K, size_t(K / kBlock) * sizeof(float));
  dequantize_rows(packed, s, 1, K, out);
}

}  // namespace epmoe::fp8b
