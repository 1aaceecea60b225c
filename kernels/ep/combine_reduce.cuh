// Source reduce: each token's returned rows summed in destination rank order.
//   returned[rows, hidden] bf16, token_row[T, world] i32 -> y[T, hidden] bf16
//   y[t] = bf16( sum over r ascending with token_row[t, r] >= 0 of float(returned[token_row[t, r]]) ),
//   fp32 sums from 0.0f, rounded once (round to nearest even): bit-exact with protocol::combine_reduce.
//   A token with no rows gets 0. hidden % 8 == 0, 16-byte aligned buffers, world <= 64.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace epmoe::kernels {

void combine_reduce_launch(const __nv_bfloat16* returned, const int32_t* token_row, int64_t num_tokens, int world,
                           int hidden, __nv_bfloat16* y, cudaStream_t stream);

// The capturable forward's form over the capacity's num_tokens rows: the same sum, but when
// status[0] (the source's dispatch-layout status, device i64[4]) is not 0 the rows below the device
// token count (*device_count, read at run time) are NaN and the rows past it zero - every row NaN
// when the count itself is outside [0, num_tokens] - and the status is copied into the sticky record
// `error` (i64[4]) unless one is there already.
void combine_reduce_checked_launch(const __nv_bfloat16* returned, const int32_t* token_row, int64_t num_tokens,
                                   int world, int hidden, const int64_t* status, int64_t* error,
                                   const int64_t* device_count, __nv_bfloat16* y, cudaStream_t stream);

}  // namespace epmoe::kernels
