// Pack for an MXFP8 layer: the source's rows in send order, quantized to packed MXFP8 rows
// (epmoe/mxfp8.h: hidden E4M3 bytes, then hidden / 32 E8M0 scales zero-padded to 16 bytes).
//   x[T, hidden] bf16, send_token[rows] i32 -> send[rows, mx::packed_row_bytes(hidden)] u8,
//   send[r] = the packed MXFP8 row of x[send_token[r]], bit-exact with mx::quantize_packed_row
//   (the same scale rule, E4M3 round-to-nearest-even with saturation, NaN blocks).
// hidden % 32 == 0; x 16-byte aligned; send 16-byte aligned (packed rows keep that alignment).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace epmoe::kernels {

// send_token null: the identity (send[r] from x[r]). device_rows (device memory, read when the
// kernel runs): only rows below min(rows, *device_rows) are written (the capturable forward's count).
void pack_rows_mx_launch(const __nv_bfloat16* x, int hidden, const int32_t* send_token, int64_t rows, uint8_t* send,
                         cudaStream_t stream, const int64_t* device_rows = nullptr);

// The same packed rows from x already in the format (MoeLayer::forward_mxfp8): xq[T, hidden] E4M3 and
// xs[T, hidden / 32] E8M0 copied as they are, send[r] = mx::pack_row of token send_token[r].
// hidden % 128 == 0; xq 16-byte aligned, xs 4-byte aligned. send_token and device_rows as above
// (the capturable forward_capturable_mxfp8: the identity, bounded by the device count).
void pack_rows_mx_given_launch(const uint8_t* xq, const uint8_t* xs, int hidden, const int32_t* send_token,
                               int64_t rows, uint8_t* send, cudaStream_t stream, const int64_t* device_rows = nullptr);

}  // namespace epmoe::kernels
