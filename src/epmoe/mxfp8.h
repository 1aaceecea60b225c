// MXFP8, the OCP Microscaling format (OCP MX v1.0) with FP8 E4M3 elements: every block of 32
// consecutive elements along K shares one E8M0 scale X = 2^(s - 127) (s = 0xFF: NaN), and each
// element is E4M3 in its "FN" form (bias 7, no infinities, S.1111.111 the only NaN, largest 448).
// A value is X * e4m3(P). What the layer's MXFP8 path means by it (seed 000's second data path):
//   - weights are given in it: w1 [E, 2 ffn, hidden] e4m3 with scales [E, 2 ffn, hidden / 32],
//     w2 [E, hidden, ffn] e4m3 with scales [E, hidden, ffn / 32] (K = the contracted dimension);
//   - x is quantized to it on the fly, per token row along hidden;
//   - the activation silu(g) * u is requantized to it per row along ffn before DOWN.
// Quantization follows the spec: X = 2^(floor(log2(amax)) - 8) (8 = E4M3's largest exponent), so
// amax / X lies in [256, 512); elements round to nearest even and saturate at +-448. A block with a
// NaN or an infinity gets the NaN scale (its every element dequantizes to NaN); an all-zero block the
// smallest scale.
#pragma once
#include <cstdint>

#include "epmoe/bf16.h"

namespace epmoe::mx {

inline constexpr int kBlock = 32;          // elements per scale, along K
// The GPU's MX kernels stage 128 K elements (four scale blocks) per step and take no partial step.
inline constexpr int kGpuDimAlignment = 128;
inline constexpr float kE4m3Max = 448.0f;  // largest finite E4M3FN value
inline constexpr int kE4m3Emax = 8;        // its exponent: floor(log2(448))
inline constexpr uint8_t kE4m3Nan = 0x7F;
inline constexpr uint8_t kE8m0Nan = 0xFF;

float e4m3_to_float(uint8_t v);
// Round to nearest even, saturating at +-448; NaN -> 0x7F (infinities saturate too, but a block
// holding one gets the NaN scale first).
uint8_t e4m3_from_float(float v);
// 2^(s - 127); 0xFF -> NaN.
float e8m0_to_float(uint8_t s);
// The block scale for a block whose largest magnitude is amax: 2^(floor(log2(amax)) - 8), its
// exponent clamped to [-127, 127]; amax 0 -> 2^-127; amax NaN or infinite -> the NaN scale.
uint8_t e8m0_for_amax(float amax);

// Rows [rows, K] (K % 32 == 0, row-major) -> q [rows, K] E4M3 and s [rows, K / 32] E8M0.
void quantize_rows(const float* x, int64_t rows, int K, uint8_t* q, uint8_t* s);
void quantize_rows(const bf16* x, int64_t rows, int K, uint8_t* q, uint8_t* s);
// The values q, s stand for, as fp32 (exact: E4M3 times a power of two).
void dequantize_rows(const uint8_t* q, const uint8_t* s, int64_t rows, int K, float* out);
// A row through the format and back, in place: what the MXFP8 path makes of an fp32 row (x on the
// fly, act before DOWN). K % 32 == 0.
void round_trip_row(float* v, int K);

// A packed row, as an MXFP8 layer dispatches its tokens: the K E4M3 elements, then the K / 32 E8M0
// scales, zero-padded to a multiple of 16 bytes so that rows stay 16-byte aligned for the GPU's
// vector copies (K + K / 32 bytes for K % 512 == 0: 0.52 of a bf16 row). Quantizing an already-MXFP8
// block gives it back unchanged (its largest element over the scale lies in [256, 448]), so a row
// quantized at its source and dequantized at its destination is what the destination would have
// made of it.
inline int64_t packed_scale_bytes(int K) { return (int64_t(K / kBlock) + 15) / 16 * 16; }
inline int64_t packed_row_bytes(int K) { return int64_t(K) + packed_scale_bytes(K); }
void quantize_packed_row(const bf16* x, int K, uint8_t* packed);
// A row already in the format (q: K E4M3 bytes, s: its K / 32 E8M0 scales) as a packed row.
void pack_row(const uint8_t* q, const uint8_t* s, int K, uint8_t* packed);
void dequantize_packed_row(const uint8_t* packed, int K, float* out);

}  // namespace epmoe::mx
