// Grouped GEMMs through cuBLAS (see cublas_grouped.cuh).
#include "kernels/fallback/cublas_grouped.cuh"

#include "kernels/cuda_check.cuh"

namespace epmoe::kernels {

void cublas_pointer_arrays_create(CublasPointerArrays& p, int64_t capacity) {
  cublas_pointer_arrays_destroy(p);
  const size_t bytes = size_t(capacity > 0 ? capacity : 1) * sizeof(void*);
  EPMOE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p.device), bytes));
  EPMOE_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&p.host), bytes));
  p.capacity = capacity;
  p.used = 0;
}

void cublas_pointer_arrays_destroy(CublasPointerArrays& p) noexcept {
  if (p.device) cudaFree(p.device);
  if (p.host) cudaFreeHost(p.host);
  p = {};
}

void cublas_grouped_gemm(cublasHandle_t handle, const CublasGemmSpec& spec, const std::vector<CublasGemmGroup>& groups,
                         CublasPointerArrays& ptrs, cudaStream_t stream) {
  std::vector<const CublasGemmGroup*> live;
  for (const CublasGemmGroup& g : groups)
    if (g.m > 0 && g.n > 0 && g.k > 0) live.push_back(&g);
  const int G = int(live.size());
  if (G == 0) return;
  EPMOE_CUBLAS_CHECK(cublasSetStream(handle, stream));
  EPMOE_CUBLAS_CHECK(cublasSetPointerMode(handle, CUBLAS_POINTER_MODE_HOST));
  const float one = 1.f;
  const cublasStatus_t grouped = [&] {
    if (!spec.grouped || ptrs.used + 3 * int64_t(G) > ptrs.capacity) return CUBLAS_STATUS_NOT_SUPPORTED;  // one by one
    void** h = ptrs.host + ptrs.used;
    void** d = ptrs.device + ptrs.used;
    ptrs.used += 3 * int64_t(G);
    std::vector<cublasOperation_t> ta(G, spec.op_a), tb(G, spec.op_b);
    std::vector<int> m(G), n(G), k(G), lda(G), ldb(G), ldc(G), size(G, 1);
    std::vector<float> alpha(G, one), beta(G, spec.beta);
    for (int i = 0; i < G; ++i) {
      const CublasGemmGroup& g = *live[i];
      m[i] = g.m, n[i] = g.n, k[i] = g.k, lda[i] = g.lda, ldb[i] = g.ldb, ldc[i] = g.ldc;
      h[i] = const_cast<void*>(g.a);
      h[G + i] = const_cast<void*>(g.b);
      h[2 * G + i] = g.c;
    }
    EPMOE_CUDA_CHECK(cudaMemcpyAsync(d, h, size_t(3) * G * sizeof(void*), cudaMemcpyHostToDevice, stream));
    return cublasGemmGroupedBatchedEx(handle, ta.data(), tb.data(), m.data(), n.data(), k.data(), alpha.data(), d,
                                      spec.a_type, lda.data(), d + G, spec.b_type, ldb.data(), beta.data(), d + 2 * G,
                                      spec.c_type, ldc.data(), G, size.data(), CUBLAS_COMPUTE_32F);
  }();
  if (grouped != CUBLAS_STATUS_NOT_SUPPORTED) {
    EPMOE_CUBLAS_CHECK(grouped);
    return;
  }
  for (const CublasGemmGroup* g : live)
    EPMOE_CUBLAS_CHECK(cublasGemmEx(handle, spec.op_a, spec.op_b, g->m, g->n, g->k, &one, g->a, spec.a_type, g->lda,
                                    g->b, spec.b_type, g->ldb, &spec.beta, g->c, spec.c_type, g->ldc,
                                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace epmoe::kernels
