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
// The grouped GEMM (cublasGemmGroupedBatchedEx) supports bf16 -> bf16 only, hence the bf16 up and
// down scratch. Row-major activations with column-major cuBLAS: C^T = W * X^T, see the .cu.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/expert_problem.cuh"

namespace epmoe::kernels {

// Device scratch: up [rows, 2*ffn] + down [rows, hidden], bf16.
size_t cublas_experts_workspace_bytes(int64_t rows, int hidden, int ffn);

// Grouped GEMM pointer arrays: 6 per expert (A, B, C of the two GEMMs), on the device and in
// pinned host staging. Created once by the engine for E_local experts and reused.
struct CublasPointerArrays {
  void** device = nullptr;  // [6 * experts]
  void** host = nullptr;    // [6 * experts], pinned
  int experts = 0;
  // The host staging is overwritten by the next launch: the caller must order that after this
  // launch's upload (the engine's per-forward host sync does).
};
void cublas_pointer_arrays_create(CublasPointerArrays& p, int experts);
void cublas_pointer_arrays_destroy(CublasPointerArrays& p) noexcept;

// host_padded_offsets[E_local + 1] and host_counts[E_local] are the host's copies of the layout
// (the same values the device layout used). `workspace` >= cublas_experts_workspace_bytes(
// host_padded_offsets[E_local], hidden, ffn). Sets the handle's stream to `stream`.
void cublas_experts_launch(const ExpertProblem& p, const int64_t* host_padded_offsets, const int64_t* host_counts,
                           cublasHandle_t handle, CublasPointerArrays& ptrs, void* workspace, size_t workspace_bytes,
                           cudaStream_t stream);

}  // namespace epmoe::kernels
