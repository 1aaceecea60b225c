// Pack for an FP8 block-128 layer: the source's rows in send order, quantized to packed block-128 rows
// (epmoe/fp8_block.h: hidden E4M3 bytes, then hidden / 128 fp32 scales zero-padded to 16 bytes).
//   x[T, hidden] bf16, send_token[rows] i32 -> send[rows, fp8b::packed_row_bytes(hidden)] u8,
//   send[r] = the packed row of x[send_token[r]], bit-exact with fp8b::quantize_packed_row.
// hidden % 128 == 0; x and send 16-byte aligned.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace epmoe::kernels {

// send_token null: the identity (send[r] from x[r]). device_rows (device memory, read when the
// kernel runs): only rows below min(rows, *device_rows) are written (the capturable forward's count).
void pack_rows_fp8b_launch(const __nv_bfloat16* x, int hidden, const int32_t* send_token, int64_t rows, uint8_t* send,
                           cudaStream_t stream, const int64_t* device_rows = nullptr);

}  // namespace epmoe::kernels
