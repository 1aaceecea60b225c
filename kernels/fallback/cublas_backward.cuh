// The local experts' backward with cuBLAS GEMMs (any CUDA GPU; the first correctness baseline of the
// Hopper backward). Per expert e, over its real rows (count_e of its segment), in row-major terms:
//   da   = dys_e @ w2_e                  [n, ffn]     bf16   (dy . W2, unscaled)
//   (ds, dh, act_s) = swiglu_backward(h, da, s)              (kernels/backward/swiglu_backward.cuh)
//   dxp  = dh_e @ w1_e                   [n, hidden]  bf16   (one dx row per pair)
//   dw2_e (+)= dys_e^T @ act_s_e         [hidden, ffn]       (sum_i s_i dy_i a_i^T)
//   dw1_e (+)= dh_e^T @ xs_e             [2 ffn, hidden]     (sum_i dh_i x_i^T)
// dW in each gradient's dtype (bf16 or f32; bf16 rounds once, after the sum); with accumulate the
// sums add to what dw holds. An expert without rows gets dw = 0 (or keeps it, accumulating).
// The counts come from the host (cuBLAS takes its sizes there); the rows stay expert-sorted and
// tile-padded as the forward's layout put them.
#pragma once
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/fallback/cublas_grouped.cuh"

namespace epmoe::kernels {

struct ExpertBackwardProblem {
  // the forward's layout (device), `rows` = its padded total
  const int64_t* padded_offsets = nullptr;
  const int32_t* pair_row = nullptr;
  const float* pair_weight = nullptr;
  int64_t rows = 0;
  // weights and shape
  const __nv_bfloat16* w1 = nullptr;  // [E, 2 ffn, hidden]
  const __nv_bfloat16* w2 = nullptr;  // [E, hidden, ffn]
  int experts = 0, hidden = 0, ffn = 0;
  // inputs, expert-sorted [rows, .]
  const __nv_bfloat16* xs = nullptr;   // [rows, hidden] the forward's rows
  const __nv_bfloat16* dys = nullptr;  // [rows, hidden] dy of each pair's row
  const __nv_bfloat16* h = nullptr;    // [rows, 2 ffn]  saved or recomputed pre-activation
  // scratch
  __nv_bfloat16* da = nullptr;     // [rows, ffn]
  __nv_bfloat16* dh = nullptr;     // [rows, 2 ffn]
  __nv_bfloat16* act_s = nullptr;  // [rows, ffn]
  // outputs
  float* ds = nullptr;             // [rows]  per pair; 0 for padding
  __nv_bfloat16* dxp = nullptr;    // [rows, hidden] per pair (padding rows unwritten)
  void* dw1 = nullptr;             // [E, 2 ffn, hidden]
  void* dw2 = nullptr;             // [E, hidden, ffn]
  bool dw1_f32 = false, dw2_f32 = false;  // each gradient's dtype: f32, else bf16
  bool accumulate = false;
  // false: da, dh, ds and dx only; the caller runs the dW GEMMs (the sm_90 wgrad kernel, wgrad.cuh)
  bool weight_grads = true;
  bool data_grads_grouped = false;  // da and dx as one grouped launch each, else one GEMM per expert
};

// host_padded_offsets[E + 1], host_counts[E]: the host's copies of the layout. `ptrs` has room for
// 3 pointers per expert for each of the four grouped GEMMs.
void cublas_expert_backward_launch(const ExpertBackwardProblem& p, const int64_t* host_padded_offsets,
                                   const int64_t* host_counts, cublasHandle_t handle, CublasPointerArrays& ptrs,
                                   cudaStream_t stream);

}  // namespace epmoe::kernels
