// Pack-and-quantize kernel (see pack_rows_mx.cuh). One warp per row; lane l quantizes the row's
// MX blocks l, l + 32, ...: 32 bf16 (four 16-byte loads) -> the block's E8M0 scale and 32 E4M3 bytes
// (two 16-byte stores), all in fp32 as mx::quantize_rows does: X = 2^(floor(log2 amax) - 8) clamped
// to 2^[-127, 127], each element x * 2^(127 - s) (an exact power of two) converted by cvt.rn.satfinite
// (round to nearest even, +-448 at most); a block holding a NaN or an infinity gets the
// NaN scale and NaN codes. 64-bit row offsets.
#include <cuda_fp8.h>

#include "epmoe/mxfp8.h"
#include "kernels/cuda_check.cuh"
#include "kernels/ep/pack_rows_mx.cuh"

namespace epmoe::kernels {

namespace {

constexpr int kWarpsPerBlock = 8;

__device__ __forceinline__ uint32_t e8m0_for_amax(float amax) {
  if (!isfinite(amax)) return 0xFFu;  // (NaN or an infinity in the block)
  if (amax == 0.0f) return 0u;
  const int e = ilogbf(amax);  // floor(log2 amax), subnormals included
  return uint32_t(max(-127, min(127, e - mx::kE4m3Emax)) + 127);
}

// Two fp32 -> two E4M3 (RNE, saturating), low byte from lo (cvt.rn.satfinite.e4m3x2 from sm_89 on;
// cuda_fp8.h emulates it for the older architectures of a multi-arch build).
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
  return uint32_t(__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
}

__global__ void pack_rows_mx_kernel(const uint4* __restrict__ x, int hidden, const int32_t* __restrict__ send_token,
                                    int64_t rows, uint8_t* __restrict__ send, int64_t row_bytes) {
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = int(threadIdx.x % 32), blocks = hidden / mx::kBlock;
  const uint4* src = x + int64_t(send_token[row]) * (hidden / 8);
  uint8_t* dst = send + row * row_bytes;
  for (int b = lane; b < blocks; b += 32) {
    float v[32];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const uint4 w = __ldg(src + 4 * b + q);
      const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        v[8 * q + 2 * i] = __uint_as_float(u[i] << 16);
        v[8 * q + 2 * i + 1] = __uint_as_float(u[i] & 0xFFFF0000u);
      }
    }
    float amax = 0.0f;
    bool nan = false;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      nan |= isnan(v[i]);
      amax = fmaxf(amax, fabsf(v[i]));
    }
    const uint32_t s = nan ? 0xFFu : e8m0_for_amax(amax);
    uint32_t words[8];
    if (s == 0xFFu) {
#pragma unroll
      for (int i = 0; i < 8; ++i) words[i] = 0x7F7F7F7Fu;
    } else {
      const float inv = ldexpf(1.0f, 127 - int(s));  // exact: a power of two, as on the host
#pragma unroll
      for (int i = 0; i < 8; ++i)
        words[i] = e4m3x2(v[4 * i] * inv, v[4 * i + 1] * inv) | (e4m3x2(v[4 * i + 2] * inv, v[4 * i + 3] * inv) << 16);
    }
    uint4* out = reinterpret_cast<uint4*>(dst + 32 * int64_t(b));
    out[0] = make_uint4(words[0], words[1], words[2], words[3]);
    out[1] = make_uint4(words[4], words[5], words[6], words[7]);
    dst[hidden + b] = uint8_t(s);
  }
  for (int64_t i = hidden + blocks + lane; i < row_bytes; i += 32) dst[i] = 0;  // (the scales' padding)
}

}  // namespace

void pack_rows_mx_launch(const __nv_bfloat16* x, int hidden, const int32_t* send_token, int64_t rows, uint8_t* send,
                         cudaStream_t stream) {
  if (rows <= 0) return;
  EPMOE_CHECK(hidden > 0 && hidden % mx::kBlock == 0, ErrorCode::internal, "pack_rows_mx: hidden ", hidden,
              " is not a multiple of ", mx::kBlock);
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  pack_rows_mx_kernel<<<unsigned(blocks), kWarpsPerBlock * 32, 0, stream>>>(
      reinterpret_cast<const uint4*>(x), hidden, send_token, rows, send, mx::packed_row_bytes(hidden));
  EPMOE_CUDA_CHECK_LAUNCH("pack_rows_mx_kernel");
}

}  // namespace epmoe::kernels
