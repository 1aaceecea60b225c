// Device side of the MXFP8 format (epmoe/mxfp8.h), shared by the kernels that quantize to it (the
// dispatch's pack, kernels/ep/pack_rows_mx.cu; the MX swap-AB UP's requantized act,
// kernels/sm90/swap_mx_kernel.cu), so that every quantizer on the GPU is bit-exact with the host's
// mx::quantize_rows: X = 2^(floor(log2 amax) - 8) clamped to 2^[-127, 127], each element x * 2^(127 - s)
// (an exact power of two) rounded to nearest even by cvt.rn.satfinite (+-448 at most), a block holding
// a NaN or an infinity the NaN scale and NaN codes.
#pragma once
#include <cuda_fp8.h>

#include <cstdint>

#include "epmoe/mxfp8.h"

namespace epmoe::kernels::mxdev {

// E8M0 code of a finite, NaN-free block's largest magnitude (the caller maps NaN blocks to 0xFF).
__device__ __forceinline__ uint32_t e8m0_for_amax(float amax) {
  if (!isfinite(amax)) return 0xFFu;  // (an infinity in the block)
  if (amax == 0.0f) return 0u;
  const int e = ilogbf(amax);  // floor(log2 amax), subnormals included
  return uint32_t(max(-127, min(127, e - mx::kE4m3Emax)) + 127);
}

// Two fp32 -> two E4M3 (RNE, saturating), low byte from lo (cvt.rn.satfinite.e4m3x2 from sm_89 on;
// cuda_fp8.h emulates it for the older architectures of a multi-arch build).
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
  return uint32_t(__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
}

// One MX block of 32 fp32 values -> its E8M0 scale (returned) and 32 E4M3 codes in 8 words (element
// 4i + b in byte b of words[i]).
__device__ __forceinline__ uint32_t quantize_block32(const float (&v)[32], uint32_t (&words)[8]) {
  float amax = 0.0f;
  bool nan = false;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    nan |= isnan(v[i]);
    amax = fmaxf(amax, fabsf(v[i]));
  }
  const uint32_t s = nan ? 0xFFu : e8m0_for_amax(amax);
  if (s == 0xFFu) {
#pragma unroll
    for (int i = 0; i < 8; ++i) words[i] = 0x7F7F7F7Fu;
  } else {
    const float inv = ldexpf(1.0f, 127 - int(s));  // exact: a power of two, as on the host
#pragma unroll
    for (int i = 0; i < 8; ++i)
      words[i] = e4m3x2(v[4 * i] * inv, v[4 * i + 1] * inv) | (e4m3x2(v[4 * i + 2] * inv, v[4 * i + 3] * inv) << 16);
  }
  return s;
}

}  // namespace epmoe::kernels::mxdev
