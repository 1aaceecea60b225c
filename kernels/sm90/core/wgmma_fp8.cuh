// FP8 wgmma of the sm_90a kernel core (issue 50, the MXFP8 path): wgmma.mma_async m64n128k32
// e4m3 x e4m3 -> fp32, and the promotion of a k32 block's partial product by its MX scales.
//
// Operands: both K-major in shared memory (FP8 wgmma has no transpose), in the same 128B-swizzled
// layout and descriptors as the bf16 tiles (wgmma.cuh): a row of 128 e4m3 elements is 128 bytes, like
// a row of 64 bf16, so one TMA box of 128 K elements per row fills a stage's rows and a k32 step
// advances the start address by 32 bytes (descriptor + 2, kKMajorK16Step).
//
// Hopper has no block-scaled MMA: an MX block (32 along K) is one k32 wgmma, whose partial D_j is
// accumulated separately and promoted into the fp32 accumulator as acc += D_j * Xa[row, j] * Xb[col, j]
// (the two E8M0 scales: a power of two, 2^(sa + sb - 254)). The promotion also bounds the tensor
// cores' FP8 accumulation to 32 products (their internal sum is narrower than fp32).
// Fragment of an m64n128 result: warp w of the warpgroup, lane l:
//   d[4g + 2h + b] = D[16w + l/4 + 8h][8g + 2(l%4) + b], g < 16.
#pragma once
#include <cstdint>

#include "kernels/sm90/core/wgmma.cuh"

namespace epmoe::kernels::sm90 {
#if EPMOE_SM90A_DEVICE

// D[64 x 128] (+)= A[64 x 32] * B[128 x 32]^T, e4m3 inputs; scale_d 0 overwrites D.
struct WgmmaE4m3N128 {
  static constexpr int kAcc = 64;
  static __device__ __forceinline__ void mma(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d = 1) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
        "{" EPMOE_WGMMA_ACC64_NAMES
        "}, %64, %65, p, 1, 1;\n"
        "}\n"
        : EPMOE_WGMMA_ACC64(d, 0)
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  }
};

// Xa * Xb for E8M0 scales sa, sb: 2^(sa + sb - 254), NaN where either is the NaN scale (0xFF). The
// fp32 exponent field is sa + sb - 127 where that is a normal number's; outside, ldexpf (subnormal
// results and overflow to infinity, as the product of the two values would give).
__device__ __forceinline__ float e8m0_product(uint32_t sa, uint32_t sb) {
  if (sa == 0xFFu || sb == 0xFFu) return __int_as_float(0x7FC00000);
  const int e = int(sa + sb) - 127;
  return e >= 1 && e <= 254 ? __int_as_float(e << 23) : ldexpf(1.0f, e - 127);
}

// acc += part * Xa[row] * Xb[col] over an m64n128 fragment: xa[h] the scale product's row factor for
// rows 16w + l/4 + 8h, xb[2g + b] the column factor for columns 8g + 2(l%4) + b (E8M0 codes).
__device__ __forceinline__ void promote_mx_n128(float (&acc)[64], const float (&part)[64], const uint32_t (&sa)[2],
                                                const uint32_t (&sb)[32]) {
#pragma unroll
  for (int g = 0; g < 16; ++g)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int i = 4 * g + 2 * h + b;
        acc[i] = fmaf(part[i], e8m0_product(sa[h], sb[2 * g + b]), acc[i]);
      }
}

#endif  // EPMOE_SM90A_DEVICE
}  // namespace epmoe::kernels::sm90
