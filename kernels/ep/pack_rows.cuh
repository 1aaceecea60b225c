// Pack: the source's rows in send order.
//   x[T, hidden] bf16, send_token[rows] i32 -> send_x[rows, hidden] bf16, send_x[r] = x[send_token[r]]
// hidden % 8 == 0 and x / send_x 16-byte aligned (16-byte vector copies).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace epmoe::kernels {

void pack_rows_launch(const __nv_bfloat16* x, int hidden, const int32_t* send_token, int64_t rows,
                      __nv_bfloat16* send_x, cudaStream_t stream);

}  // namespace epmoe::kernels
