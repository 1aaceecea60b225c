// SwiGLU backward on the expert-sorted rows, with the routing-weight gradient as a row reduction.
//   h[rows, 2 ffn] bf16 (g | u: the saved or recomputed pre-activation), da[rows, ffn] bf16 (dy . W2_e,
//   not yet scaled by the weight), pair_row[rows] i32, pair_weight[rows] f32 ->
//     ds[i]        = sum_j da[i, j] a[i, j],  a = bf16(silu(g) u)      f32  (dL/d weight of the pair)
//     dh[i, j]     = s da[i, j] u silu'(g)                              bf16 (dL/dg)
//     dh[i, F + j] = s da[i, j] silu(g)                                 bf16 (dL/du)
//     act_s[i, j]  = bf16(s a[i, j])                                   bf16 (dW2_e = sum_i dy_i (s a_i)^T)
//   s = pair_weight[i]; padding rows (pair_row[i] < 0) get zeros everywhere. rows_total (device,
//   optional): rows at or past *rows_total are not touched (the capturable backward's bound).
// silu'(g) = sigmoid(g) (1 + g (1 - sigmoid(g))). ffn % 8 == 0, 16-byte aligned rows.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace epmoe::kernels {

void swiglu_backward_launch(const __nv_bfloat16* h, const __nv_bfloat16* da, const int32_t* pair_row,
                            const float* pair_weight, int64_t rows, int ffn, __nv_bfloat16* dh, __nv_bfloat16* act_s,
                            float* ds, cudaStream_t stream, const int64_t* rows_total = nullptr);

}  // namespace epmoe::kernels
