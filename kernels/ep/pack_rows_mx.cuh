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

void pack_rows_mx_launch(const __nv_bfloat16* x, int hidden, const int32_t* send_token, int64_t rows, uint8_t* send,
                         cudaStream_t stream);

}  // namespace epmoe::kernels
