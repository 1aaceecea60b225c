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

// Narrow FP8 shapes for the MX swap-AB kernels (weights in M, a tile's tokens in N = 8 ... 64):
// m64nNk32 e4m3 x e4m3 -> fp32, fragment d[4g + 2h + b] = D[16w + l/4 + 8h][8g + 2(l%4) + b], g < N/8.
template <int N>
struct WgmmaE4m3;
template <>
struct WgmmaE4m3<8> {
  static constexpr int kAcc = 4;
  static __device__ __forceinline__ void mma(float (&d)[4], uint64_t desc_a, uint64_t desc_b, int scale_d = 1) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %6, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3}, %4, %5, p, 1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  }
};
template <>
struct WgmmaE4m3<16> {
  static constexpr int kAcc = 8;
  static __device__ __forceinline__ void mma(float (&d)[8], uint64_t desc_a, uint64_t desc_b, int scale_d = 1) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  }
};
template <>
struct WgmmaE4m3<32> {
  static constexpr int kAcc = 16;
  static __device__ __forceinline__ void mma(float (&d)[16], uint64_t desc_a, uint64_t desc_b, int scale_d = 1) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  }
};
template <>
struct WgmmaE4m3<64> {
  static constexpr int kAcc = 32;
  static __device__ __forceinline__ void mma(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int scale_d = 1) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  }
};

// 2^(s - 127) as fp32, exactly (s = 0 is the subnormal 2^-127), NaN for 0xFF.
__device__ __forceinline__ float e8m0_to_f32(uint32_t s) {
  return __int_as_float(s == 0u ? 0x00400000 : s == 0xFFu ? 0x7FC00000 : int(s << 23));
}

// acc += part * Xa[row] * Xb[col] over an m64nN fragment: xa[h] the scale (as e8m0_to_f32) of rows
// 16w + l/4 + 8h, xb[2g + b] that of columns 8g + 2(l%4) + b. xa * xb is exact wherever
// e8m0_product's result is a normal number (a product of powers of two), and like it rounds to the
// subnormal or zero power of two below that; two FP32 ops per element.
template <int N>
__device__ __forceinline__ void promote_mx(float (&acc)[N / 2], const float (&part)[N / 2], const float (&xa)[2],
                                           const float (&xb)[N / 4]) {
#pragma unroll
  for (int g = 0; g < N / 8; ++g)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int i = 4 * g + 2 * h + b;
        acc[i] = fmaf(part[i], xa[h] * xb[2 * g + b], acc[i]);
      }
}

#endif  // EPMOE_SM90A_DEVICE
}  // namespace epmoe::kernels::sm90
