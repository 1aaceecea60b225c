// Device side of the FP8 block-128 format (epmoe/fp8_block.h), shared by its quantizers on the GPU
// (the dispatch's pack, kernels/ep/pack_rows_fp8b.cu; the block-128 tile UP's requantized act,
// kernels/sm90/tile_fp8b_kernel.cu), bit-exact with the host's fp8b::quantize_rows: scale = amax / 448
// in fp32 (1 for a zero block, NaN for a block holding a NaN or an infinity), each element
// e4m3(v / scale) by an IEEE division and cvt.rn.satfinite, the NaN code for a NaN scale.
#pragma once
#include <cuda_fp8.h>

#include <cstdint>

#include "epmoe/mxfp8.h"

namespace epmoe::kernels::fp8bdev {

// The block's scale from its largest magnitude and whether it holds a NaN (fmaxf drops NaNs).
__device__ __forceinline__ float scale_for(float amax, bool nan) {
  if (nan || !isfinite(amax)) return __int_as_float(0x7FC00000);
  return amax == 0.0f ? 1.0f : __fdiv_rn(amax, mx::kE4m3Max);
}

// Four values -> four E4M3 codes (element i in byte i) at scale s.
__device__ __forceinline__ uint32_t quantize4(float v0, float v1, float v2, float v3, float s) {
  if (isnan(s)) return 0x7F7F7F7Fu;
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(__fdiv_rn(v0, s), __fdiv_rn(v1, s)), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(__fdiv_rn(v2, s), __fdiv_rn(v3, s)), __NV_SATFINITE, __NV_E4M3);
  return (lo & 0xFFFFu) | (hi << 16);
}

}  // namespace epmoe::kernels::fp8bdev
