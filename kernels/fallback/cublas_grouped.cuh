// Grouped GEMMs through cuBLAS, the fallback paths' one GEMM entry point (forward and backward).
//
// Each group is one GEMM in cuBLAS's column-major terms, C_g = op(A_g) op(B_g) + beta C_g, with its
// own m, n, k and pointers; the operations, types and beta are shared. cublasGemmGroupedBatchedEx
// runs them as one launch; where this cuBLAS has no grouped kernel for the types (it answers
// CUBLAS_STATUS_NOT_SUPPORTED, e.g. for fp32 C) the groups run as one cublasGemmEx each. Groups with
// m, n or k equal to 0 are skipped, C untouched: a caller that needs C = 0 there zeroes it itself.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

namespace epmoe::kernels {

// Device pointer arrays for the grouped launches, staged through pinned host memory. One call of
// the engine takes slots for each of its grouped GEMMs (3 per group) and resets `used` at its start:
// a staging slot is rewritten only by a later call, after that call's host wait drained the stream
// that read it.
struct CublasPointerArrays {
  void** device = nullptr;  // [capacity]
  void** host = nullptr;    // [capacity], pinned
  int64_t capacity = 0;
  int64_t used = 0;
};
void cublas_pointer_arrays_create(CublasPointerArrays& p, int64_t capacity);
void cublas_pointer_arrays_destroy(CublasPointerArrays& p) noexcept;

struct CublasGemmSpec {
  cublasOperation_t op_a = CUBLAS_OP_N, op_b = CUBLAS_OP_N;
  cudaDataType a_type = CUDA_R_16BF, b_type = CUDA_R_16BF, c_type = CUDA_R_16BF;
  float beta = 0.f;
  bool grouped = true;  // false: one cublasGemmEx per group
};
struct CublasGemmGroup {
  int m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldc = 0;
  const void* a = nullptr;
  const void* b = nullptr;
  void* c = nullptr;
};

// Queues the groups on `stream` (fp32 accumulation, alpha = 1). Sets the handle's stream.
void cublas_grouped_gemm(cublasHandle_t handle, const CublasGemmSpec& spec, const std::vector<CublasGemmGroup>& groups,
                         CublasPointerArrays& ptrs, cudaStream_t stream);

}  // namespace epmoe::kernels
