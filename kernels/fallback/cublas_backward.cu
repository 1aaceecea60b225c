// The experts' backward with cuBLAS (see cublas_backward.cuh). Row-major buffers seen by cuBLAS as
// column-major transposes (cublas_experts.cu's header): a row-major [r, c] buffer is the col-major
// [c, r] matrix with leading dimension c.
//   da^T [F, n]   = W2_e(col-major [F, H]) * dys^T [H, n]        m = F, n = n, k = H  (N, N)
//   dxp^T[H, n]   = W1_e(col-major [H, 2F]) * dh^T [2F, n]       m = H, n = n, k = 2F (N, N)
//   dW2_e^T[F, H] = act_s^T [F, n] * (dys^T [H, n])^T            m = F, n = H, k = n  (N, T)
//   dW1_e^T[H, 2F]= xs^T [H, n] * (dh^T [2F, n])^T               m = H, n = 2F, k = n (N, T)
#include "kernels/fallback/cublas_backward.cuh"

#include <vector>

#include "kernels/backward/swiglu_backward.cuh"
#include "kernels/cuda_check.cuh"

namespace epmoe::kernels {

void cublas_expert_backward_launch(const ExpertBackwardProblem& p, const int64_t* off, const int64_t* counts,
                                   cublasHandle_t handle, CublasPointerArrays& ptrs, cudaStream_t stream) {
  const int E = p.experts, H = p.hidden, F = p.ffn;
  EPMOE_CHECK(H % 8 == 0 && F % 8 == 0, ErrorCode::internal, "cublas_expert_backward: hidden/ffn not multiples of 8");
  EPMOE_CHECK(off[E] <= p.rows, ErrorCode::internal, "cublas_expert_backward: layout of ", off[E],
              " rows beyond the buffers' ", p.rows);
  const size_t g1 = p.dw1_f32 ? sizeof(float) : sizeof(__nv_bfloat16), g2 = p.dw2_f32 ? sizeof(float) : sizeof(__nv_bfloat16);
  const int64_t w1_elems = int64_t(2) * F * H, w2_elems = int64_t(H) * F;
  auto at = [](void* base, int64_t elems, size_t esize) { return static_cast<char*>(base) + size_t(elems) * esize; };

  std::vector<CublasGemmGroup> da, dx, dw2, dw1;
  for (int e = 0; e < E; ++e) {
    const int64_t n64 = counts[e], r0 = off[e];
    EPMOE_CHECK(n64 >= 0 && n64 <= off[e + 1] - r0, ErrorCode::internal, "cublas_expert_backward: expert ", e,
                " count ", n64, " exceeds its segment");
    if (n64 == 0) {
      if (!p.accumulate && p.weight_grads) {
        EPMOE_CUDA_CHECK(cudaMemsetAsync(at(p.dw1, e * w1_elems, g1), 0, size_t(w1_elems) * g1, stream));
        EPMOE_CUDA_CHECK(cudaMemsetAsync(at(p.dw2, e * w2_elems, g2), 0, size_t(w2_elems) * g2, stream));
      }
      continue;
    }
    const int n = int(n64);
    const __nv_bfloat16* w1e = p.w1 + e * w1_elems;
    const __nv_bfloat16* w2e = p.w2 + e * w2_elems;
    da.push_back({F, n, H, F, H, F, w2e, p.dys + r0 * H, p.da + r0 * F});
    dx.push_back({H, n, 2 * F, H, 2 * F, H, w1e, p.dh + r0 * 2 * F, p.dxp + r0 * H});
    dw2.push_back({F, H, n, F, H, F, p.act_s + r0 * F, p.dys + r0 * H, at(p.dw2, e * w2_elems, g2)});
    dw1.push_back({H, 2 * F, n, H, 2 * F, H, p.xs + r0 * H, p.dh + r0 * 2 * F, at(p.dw1, e * w1_elems, g1)});
  }
  CublasGemmSpec data{CUBLAS_OP_N, CUBLAS_OP_N};
  data.grouped = p.data_grads_grouped;
  cublas_grouped_gemm(handle, data, da, ptrs, stream);
  swiglu_backward_launch(p.h, p.da, p.pair_row, p.pair_weight, off[E], F, p.dh, p.act_s, p.ds, stream);
  cublas_grouped_gemm(handle, data, dx, ptrs, stream);
  if (!p.weight_grads) return;
  const float beta = p.accumulate ? 1.f : 0.f;
  auto wgrad = [&](bool f32) {
    return CublasGemmSpec{CUBLAS_OP_N, CUBLAS_OP_T, CUDA_R_16BF, CUDA_R_16BF, f32 ? CUDA_R_32F : CUDA_R_16BF, beta};
  };
  cublas_grouped_gemm(handle, wgrad(p.dw2_f32), dw2, ptrs, stream);
  cublas_grouped_gemm(handle, wgrad(p.dw1_f32), dw1, ptrs, stream);
}

}  // namespace epmoe::kernels
