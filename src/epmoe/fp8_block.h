// FP8 with 128-element block scales, the DeepSeek-V3 layout (issue 50's second format): E4M3FN
// elements (epmoe/mxfp8.h's element type) with one fp32 scale per block, where
//   activations (x, and the act requantized before DOWN) have 1 x 128 blocks: one scale per row per
//     128 consecutive elements along K;
//   weights have 128 x 128 blocks: one scale per 128 rows x 128 K elements,
//     w1 [E, 2 ffn, hidden] with scales [E, 2 ffn / 128, hidden / 128],
//     w2 [E, hidden, ffn]   with scales [E, hidden / 128, ffn / 128].
// A value is scale * e4m3(q). Quantization: scale = amax / 448 of the block (fp32), q = e4m3(v / scale)
// rounded to nearest even (|v / scale| <= 448 up to the division's rounding, saturating); a block of
// zeros gets scale 1 and zeros; a block holding a NaN or an infinity gets a NaN scale (every element
// dequantizes to NaN).
//
// Why a second format: Hopper has no block-scaled MMA, so a kernel promotes each scale block's partial
// product into fp32 itself; per-32 MX blocks cost one FP32 pass over the accumulators per k32 wgmma
// (about the tensor cores' own time: the MX tile form measured 0.27x bf16 at T=16k), 128-element
// blocks a quarter of that (DeepGEMM's choice on Hopper).
#pragma once
#include <cstdint>

#include "epmoe/bf16.h"

namespace epmoe::fp8b {

inline constexpr int kBlock = 128;  // elements per scale along K (and weight rows per scale)

// The scale of a block whose largest magnitude is amax: amax / 448; 1 for amax 0; NaN for a NaN or an
// infinite amax.
float scale_for_amax(float amax);

// Activation rows [rows, K] (K % 128 == 0) -> q [rows, K] E4M3 and s [rows, K / 128] fp32.
void quantize_rows(const float* x, int64_t rows, int K, uint8_t* q, float* s);
void quantize_rows(const bf16* x, int64_t rows, int K, uint8_t* q, float* s);
void dequantize_rows(const uint8_t* q, const float* s, int64_t rows, int K, float* out);
// A row through the format and back, in place (x on the fly, act before DOWN). K % 128 == 0.
void round_trip_row(float* v, int K);

// A weight matrix [rows, K] (rows % 128 == 0, K % 128 == 0) -> q [rows, K] and s [rows / 128, K / 128].
void quantize_weight(const float* w, int64_t rows, int K, uint8_t* q, float* s);
void quantize_weight(const bf16* w, int64_t rows, int K, uint8_t* q, float* s);
void dequantize_weight(const uint8_t* q, const float* s, int64_t rows, int K, float* out);

// A dispatched row: K E4M3 bytes, then K / 128 fp32 scales, padded to a multiple of 16 bytes
// (K + K / 32 bytes: 0.52 of a bf16 row, as MXFP8's packed row).
inline int64_t packed_scale_bytes(int K) { return (int64_t(K / kBlock) * 4 + 15) / 16 * 16; }
inline int64_t packed_row_bytes(int K) { return int64_t(K) + packed_scale_bytes(K); }
void quantize_packed_row(const bf16* x, int K, uint8_t* packed);
void dequantize_packed_row(const uint8_t* packed, int K, float* out);

}  // namespace epmoe::fp8b
