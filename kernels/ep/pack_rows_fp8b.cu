// Pack-and-quantize kernel for FP8 block-128 rows (see pack_rows_fp8b.cuh). One warp per row, one
// 128-element block at a time: lane l holds elements 4l .. 4l + 3 (one 8-byte load), the block's
// amax and NaN flag by warp shuffles, then 4 E4M3 codes per lane (one 4-byte store) and the scale from
// lane 0 (kernels/fp8b_device.cuh: bit-exact with fp8b::quantize_rows). 64-bit row offsets.
#include "epmoe/fp8_block.h"
#include "kernels/cuda_check.cuh"
#include "kernels/ep/pack_rows_fp8b.cuh"
#include "kernels/fp8b_device.cuh"

namespace epmoe::kernels {

namespace {

constexpr int kWarpsPerBlock = 8;

__global__ void pack_rows_fp8b_kernel(const uint2* __restrict__ x, int hidden, const int32_t* __restrict__ send_token,
                                      int64_t rows, const int64_t* __restrict__ device_rows,
                                      uint8_t* __restrict__ send, int64_t row_bytes) {
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= rows || (device_rows != nullptr && row >= *device_rows)) return;
  const int lane = int(threadIdx.x % 32), blocks = hidden / fp8b::kBlock;
  const uint2* src = x + (send_token != nullptr ? int64_t(send_token[row]) : row) * (hidden / 4);
  uint8_t* dst = send + row * row_bytes;
  float* scales = reinterpret_cast<float*>(dst + hidden);
  for (int b = 0; b < blocks; ++b) {
    const uint2 w = __ldg(src + 32 * b + lane);
    const float v[4] = {__uint_as_float(w.x << 16), __uint_as_float(w.x & 0xFFFF0000u), __uint_as_float(w.y << 16),
                        __uint_as_float(w.y & 0xFFFF0000u)};
    float amax = 0.0f;
    int nan = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) nan |= isnan(v[i]) ? 1 : 0, amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      nan |= __shfl_xor_sync(0xffffffffu, nan, o);
    }
    const float s = fp8bdev::scale_for(amax, nan != 0);
    reinterpret_cast<uint32_t*>(dst + int64_t(b) * fp8b::kBlock)[lane] = fp8bdev::quantize4(v[0], v[1], v[2], v[3], s);
    if (lane == 0) scales[b] = s;
  }
  for (int64_t i = hidden + 4 * blocks + lane; i < row_bytes; i += 32) dst[i] = 0;  // (the scales' padding)
}

}  // namespace

void pack_rows_fp8b_launch(const __nv_bfloat16* x, int hidden, const int32_t* send_token, int64_t rows, uint8_t* send,
                           cudaStream_t stream, const int64_t* device_rows) {
  if (rows <= 0) return;
  EPMOE_CHECK(hidden > 0 && hidden % fp8b::kBlock == 0, ErrorCode::internal, "pack_rows_fp8b: hidden ", hidden,
              " is not a multiple of ", fp8b::kBlock);
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  pack_rows_fp8b_kernel<<<unsigned(blocks), kWarpsPerBlock * 32, 0, stream>>>(
      reinterpret_cast<const uint2*>(x), hidden, send_token, rows, device_rows, send, fp8b::packed_row_bytes(hidden));
  EPMOE_CUDA_CHECK_LAUNCH("pack_rows_fp8b_kernel");
}

}  // namespace epmoe::kernels
