// The cuBLAS fallback expert path (any CUDA GPU): ExpertProblem semantics (expert_problem.cuh)
// with grouped GEMMs and three small kernels.
//
//   xs[rows, hidden] (expert segments at padded_offsets, counts[e] real rows each)
//     up   = xs_e @ w1_e^T          -> up[rows, 2*ffn] bf16    (cuBLAS, fp32 accumulate)
//     act  = bf16(silu(g) * u)      -> act[rows, ffn] bf16     (g = up[:, j], u = up[:, ffn + j])
//     down = act_e @ w2_e^T         -> down[rows, hidden] bf16 (cuBLAS, fp32 accumulate)
//     out[pair_row[i]] += pair_weight[i] * down[i]   (bf16x2 atomics; pair_row == -1 skipped)
//
// Only the real rows of each segment go through the GEMMs (padding rows cost nothing here); act is
// written for every row < padded_total (0 for padding rows) so the workspace never holds garbage.
// The grouped GEMM (cublasGemmGroupedBatchedEx) runs bf16 -> bf16, hence the bf16 up and down
// scratch. Row-major activations with column-major cuBLAS: C^T = W * X^T, see the .cu.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/expert_problem.cuh"
#include "kernels/fallback/cublas_grouped.cuh"

namespace epmoe::kernels {

// Device scratch: up [rows, 2*ffn] + down [rows, hidden], bf16.
size_t cublas_experts_workspace_bytes(int64_t rows, int hidden, int ffn);

// host_padded_offsets[E_local + 1] and host_counts[E_local] are the host's copies of the layout
// (the same values the device layout used); `ptrs` has room for 3 pointers per expert and GEMM.

// The three steps, for callers that keep h (the backward's saved pre-activation):
//   h[rows, 2 ffn] = xs_e @ w1_e^T (the real rows of each segment; padding rows untouched)
void cublas_up_launch(const ExpertProblem& p, const int64_t* host_padded_offsets, const int64_t* host_counts,
                      __nv_bfloat16* h, cublasHandle_t handle, CublasPointerArrays& ptrs, cudaStream_t stream);
//   act[i] = bf16(silu(h[i, :ffn]) * h[i, ffn:]) for i < rows; 0 where pair_row[i] < 0 (padding)
void swiglu_launch(const __nv_bfloat16* h, const int32_t* pair_row, int64_t rows, int ffn, __nv_bfloat16* act,
                   cudaStream_t stream);
//   down[i] = act_e[i] @ w2_e^T, out[pair_row[i]] += pair_weight[i] * down[i]  (down: [rows, hidden] scratch)
void cublas_down_launch(const ExpertProblem& p, const int64_t* host_padded_offsets, const int64_t* host_counts,
                        __nv_bfloat16* down, cublasHandle_t handle, CublasPointerArrays& ptrs, cudaStream_t stream);

// All three, the scratch in `workspace` (>= cublas_experts_workspace_bytes(host_padded_offsets[E_local],
// hidden, ffn)).
void cublas_experts_launch(const ExpertProblem& p, const int64_t* host_padded_offsets, const int64_t* host_counts,
                           cublasHandle_t handle, CublasPointerArrays& ptrs, void* workspace, size_t workspace_bytes,
                           cudaStream_t stream);

}  // namespace epmoe::kernels
