// Pack-and-quantize kernel (see pack_rows_mx.cuh). One warp per row; lane l quantizes the row's
// MX blocks l, l + 32, ...: 32 bf16 (four 16-byte loads) -> the block's E8M0 scale and 32 E4M3 bytes
// (two 16-byte stores) by mxdev::quantize_block32 (kernels/mx_device.cuh: bit-exact with
// mx::quantize_rows); and its copy for rows already in the format (forward_mxfp8). 64-bit row offsets.
#include "epmoe/mxfp8.h"
#include "kernels/cuda_check.cuh"
#include "kernels/ep/pack_rows_mx.cuh"
#include "kernels/mx_device.cuh"

namespace epmoe::kernels {

namespace {

constexpr int kWarpsPerBlock = 8;

__global__ void pack_rows_mx_kernel(const uint4* __restrict__ x, int hidden, const int32_t* __restrict__ send_token,
                                    int64_t rows, const int64_t* __restrict__ device_rows,
                                    uint8_t* __restrict__ send, int64_t row_bytes) {
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= rows || (device_rows != nullptr && row >= *device_rows)) return;
  const int lane = int(threadIdx.x % 32), blocks = hidden / mx::kBlock;
  const uint4* src = x + (send_token != nullptr ? int64_t(send_token[row]) : row) * (hidden / 8);
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
    uint32_t words[8];
    const uint32_t s = mxdev::quantize_block32(v, words);
    uint4* out = reinterpret_cast<uint4*>(dst + 32 * int64_t(b));
    out[0] = make_uint4(words[0], words[1], words[2], words[3]);
    out[1] = make_uint4(words[4], words[5], words[6], words[7]);
    dst[hidden + b] = uint8_t(s);
  }
  for (int64_t i = hidden + blocks + lane; i < row_bytes; i += 32) dst[i] = 0;  // (the scales' padding)
}

// One warp per row: the row's hidden / 16 16-byte chunks of E4M3, its hidden / 128 4-byte words of
// scales, the padding zeroed.
__global__ void pack_rows_mx_given_kernel(const uint4* __restrict__ xq, const uint32_t* __restrict__ xs, int hidden,
                                          const int32_t* __restrict__ send_token, int64_t rows,
                                          const int64_t* __restrict__ device_rows, uint8_t* __restrict__ send,
                                          int64_t row_bytes) {
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= rows || (device_rows != nullptr && row >= *device_rows)) return;
  const int lane = int(threadIdx.x % 32);
  const int64_t t = send_token != nullptr ? int64_t(send_token[row]) : row;
  uint8_t* dst = send + row * row_bytes;
  const uint4* q = xq + t * (hidden / 16);
  for (int i = lane; i < hidden / 16; i += 32) reinterpret_cast<uint4*>(dst)[i] = __ldg(q + i);
  const uint32_t* sc = xs + t * (hidden / 128);
  for (int i = lane; i < hidden / 128; i += 32) reinterpret_cast<uint32_t*>(dst + hidden)[i] = __ldg(sc + i);
  for (int64_t i = hidden + hidden / mx::kBlock + lane; i < row_bytes; i += 32) dst[i] = 0;
}

}  // namespace

void pack_rows_mx_given_launch(const uint8_t* xq, const uint8_t* xs, int hidden, const int32_t* send_token,
                               int64_t rows, uint8_t* send, cudaStream_t stream, const int64_t* device_rows) {
  if (rows <= 0) return;
  EPMOE_CHECK(hidden > 0 && hidden % 128 == 0, ErrorCode::internal, "pack_rows_mx_given: hidden ", hidden,
              " is not a multiple of 128");
  EPMOE_CHECK(reinterpret_cast<uintptr_t>(xq) % 16 == 0 && reinterpret_cast<uintptr_t>(xs) % 4 == 0,
              ErrorCode::internal, "pack_rows_mx_given: xq must be 16-byte and xs 4-byte aligned");
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  pack_rows_mx_given_kernel<<<unsigned(blocks), kWarpsPerBlock * 32, 0, stream>>>(
      reinterpret_cast<const uint4*>(xq), reinterpret_cast<const uint32_t*>(xs), hidden, send_token, rows, device_rows,
      send, mx::packed_row_bytes(hidden));
  EPMOE_CUDA_CHECK_LAUNCH("pack_rows_mx_given_kernel");
}

void pack_rows_mx_launch(const __nv_bfloat16* x, int hidden, const int32_t* send_token, int64_t rows, uint8_t* send,
                         cudaStream_t stream, const int64_t* device_rows) {
  if (rows <= 0) return;
  EPMOE_CHECK(hidden > 0 && hidden % mx::kBlock == 0, ErrorCode::internal, "pack_rows_mx: hidden ", hidden,
              " is not a multiple of ", mx::kBlock);
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  pack_rows_mx_kernel<<<unsigned(blocks), kWarpsPerBlock * 32, 0, stream>>>(
      reinterpret_cast<const uint4*>(x), hidden, send_token, rows, device_rows, send, mx::packed_row_bytes(hidden));
  EPMOE_CUDA_CHECK_LAUNCH("pack_rows_mx_kernel");
}

}  // namespace epmoe::kernels
