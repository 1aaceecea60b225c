// cuBLAS fallback expert path (see cublas_experts.cuh).
//
// Row-major activations, column-major cuBLAS. A row-major M[r, c] buffer is the column-major
// matrix M^T[c, r] with leading dimension c, so for Y[n, N] = X[n, K] @ W[N, K]^T (all row-major)
// we ask cuBLAS for the column-major Y^T[N, n] = W * X^T:
//   A = W   (col-major [K, N], lda = K), op(A) = T  -> [N, K]
//   B = X   (col-major [K, n], ldb = K), op(B) = N  -> [K, n]
//   C = Y   (col-major [N, n], ldc = N)
//   m = N, n = rows, k = K.
// up:   N = 2*ffn, K = hidden (W = w1_e [2ffn, hidden]);  down: N = hidden, K = ffn (W = w2_e).
#include <algorithm>
#include <vector>

#include "kernels/fallback/cublas_experts.cuh"
#include "kernels/cuda_check.cuh"

namespace epmoe::kernels {

namespace {

size_t align_up(size_t n) { return (n + 255) / 256 * 256; }

__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

// act[i, j] = bf16(silu(up[i, j]) * up[i, ffn + j]); rows with pair_row == -1 (padding) get 0.
// up[rows, 2*ffn] bf16, pair_row[rows] -> act[rows, ffn] bf16. One thread per 8 columns.
__global__ void swiglu_kernel(const uint4* __restrict__ up, const int32_t* __restrict__ pair_row, int64_t rows,
                              int ffn_vecs, uint4* __restrict__ act) {
  const int64_t total = rows * ffn_vecs;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = idx / ffn_vecs;
    const int j = int(idx - i * ffn_vecs);
    uint4 out = make_uint4(0, 0, 0, 0);
    if (pair_row[i] >= 0) {
      const uint4 g8 = up[i * 2 * ffn_vecs + j];
      const uint4 u8 = up[i * 2 * ffn_vecs + ffn_vecs + j];
      const __nv_bfloat162* g = reinterpret_cast<const __nv_bfloat162*>(&g8);
      const __nv_bfloat162* u = reinterpret_cast<const __nv_bfloat162*>(&u8);
      __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 gf = __bfloat1622float2(g[q]), uf = __bfloat1622float2(u[q]);
        o[q] = __floats2bfloat162_rn(silu(gf.x) * uf.x, silu(gf.y) * uf.y);
      }
    }
    act[idx] = out;
  }
}

// out[pair_row[i]] += pair_weight[i] * down[i] for every xs row i with pair_row[i] >= 0.
// down[rows, hidden] bf16 -> out[out_rows, hidden] bf16 (bf16x2 atomics: rows of one token that
// went to several local experts add into the same out row). One warp per row, 8 columns per lane.
constexpr int kWarpsPerBlock = 8;
__global__ void weighted_scatter_add_kernel(const uint4* __restrict__ down, const int32_t* __restrict__ pair_row,
                                            const float* __restrict__ pair_weight, int64_t rows, int hidden_vecs,
                                            __nv_bfloat16* __restrict__ out) {
  const int64_t i = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (i >= rows) return;
  const int32_t dst = pair_row[i];
  if (dst < 0) return;
  const float w = pair_weight[i];
  __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(out + int64_t(dst) * hidden_vecs * 8);
  for (int v = threadIdx.x % 32; v < hidden_vecs; v += 32) {
    const uint4 d8 = down[i * hidden_vecs + v];
    const __nv_bfloat162* d = reinterpret_cast<const __nv_bfloat162*>(&d8);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float2 f = __bfloat1622float2(d[q]);
      atomicAdd(o + v * 4 + q, __floats2bfloat162_rn(w * f.x, w * f.y));
    }
  }
}

struct Gemm {
  int m, k, lda, ldb, ldc;
};

// C_e = A_e (op T) * B_e for the active experts, grouped; per-expert cublasGemmEx if this cuBLAS has
// no grouped kernel for the shapes (CUBLAS_STATUS_NOT_SUPPORTED).
void grouped_gemm(cublasHandle_t handle, const Gemm& g, const std::vector<int>& n, void* const* dev_a,
                  void* const* dev_b, void* const* dev_c, void* const* host_a, void* const* host_b,
                  void* const* host_c) {
  const int G = int(n.size());
  const float one = 1.f, zero = 0.f;
  std::vector<cublasOperation_t> ta(G, CUBLAS_OP_T), tb(G, CUBLAS_OP_N);
  std::vector<int> m(G, g.m), k(G, g.k), lda(G, g.lda), ldb(G, g.ldb), ldc(G, g.ldc), size(G, 1);
  std::vector<float> alpha(G, one), beta(G, zero);
  const cublasStatus_t st = cublasGemmGroupedBatchedEx(
      handle, ta.data(), tb.data(), m.data(), n.data(), k.data(), alpha.data(), dev_a,
      CUDA_R_16BF, lda.data(), dev_b, CUDA_R_16BF, ldb.data(), beta.data(), dev_c,
      CUDA_R_16BF, ldc.data(), G, size.data(), CUBLAS_COMPUTE_32F);
  if (st != CUBLAS_STATUS_NOT_SUPPORTED) {
    EPMOE_CUBLAS_CHECK(st);
    return;
  }
  for (int e = 0; e < G; ++e)
    EPMOE_CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, g.m, n[e], g.k, &one, host_a[e], CUDA_R_16BF,
                                    g.lda, host_b[e], CUDA_R_16BF, g.ldb, &zero, host_c[e], CUDA_R_16BF, g.ldc,
                                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace

size_t cublas_experts_workspace_bytes(int64_t rows, int hidden, int ffn) {
  return align_up(size_t(rows) * 2 * ffn * 2) + align_up(size_t(rows) * hidden * 2);
}

void cublas_pointer_arrays_create(CublasPointerArrays& p, int experts) {
  cublas_pointer_arrays_destroy(p);
  const size_t bytes = size_t(6) * (experts > 0 ? experts : 1) * sizeof(void*);
  EPMOE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p.device), bytes));
  EPMOE_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&p.host), bytes));
  p.experts = experts;
}

void cublas_pointer_arrays_destroy(CublasPointerArrays& p) noexcept {
  if (p.device) cudaFree(p.device);
  if (p.host) cudaFreeHost(p.host);
  p = {};
}

void cublas_experts_launch(const ExpertProblem& p, const int64_t* off, const int64_t* counts, cublasHandle_t handle,
                           CublasPointerArrays& ptrs, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  const int El = p.experts, H = p.hidden, F = p.ffn;
  EPMOE_CHECK(!p.zero_out, ErrorCode::invalid_argument,
              "cublas_experts: ExpertProblem::zero_out is an sm_90 pipeline option; zero out before the call");
  const int64_t P = off[El];
  if (P == 0) return;
  EPMOE_CHECK(ptrs.experts >= El, ErrorCode::internal, "cublas_experts: pointer arrays for ", ptrs.experts,
              " experts, need ", El);
  EPMOE_CHECK(workspace_bytes >= cublas_experts_workspace_bytes(P, H, F) && P <= p.rows_capacity,
              ErrorCode::internal, "cublas_experts: workspace or rows too small for ", P, " rows");
  EPMOE_CHECK(H % 8 == 0 && F % 8 == 0, ErrorCode::internal, "cublas_experts: hidden/ffn not multiples of 8");
  __nv_bfloat16* up = static_cast<__nv_bfloat16*>(workspace);
  __nv_bfloat16* down = reinterpret_cast<__nv_bfloat16*>(static_cast<char*>(workspace) +
                                                         align_up(size_t(P) * 2 * F * 2));

  // Active experts (n > 0) and their matrices; 64-bit element offsets throughout.
  std::vector<int> n;
  std::vector<int> active;
  for (int e = 0; e < El; ++e)
    if (counts[e] > 0) {
      EPMOE_CHECK(counts[e] <= off[e + 1] - off[e], ErrorCode::internal, "cublas_experts: expert ", e, " count ",
                  counts[e], " exceeds its segment");
      n.push_back(int(counts[e]));
      active.push_back(e);
    }
  const int G = int(active.size());
  void** h = ptrs.host;  // [6][G]: up A, B, C, down A, B, C
  for (int i = 0; i < G; ++i) {
    const int e = active[i];
    const int64_t r0 = off[e];
    h[0 * G + i] = const_cast<__nv_bfloat16*>(p.w1 + int64_t(e) * 2 * F * H);
    h[1 * G + i] = const_cast<__nv_bfloat16*>(p.xs + r0 * H);
    h[2 * G + i] = up + r0 * 2 * F;
    h[3 * G + i] = const_cast<__nv_bfloat16*>(p.w2 + int64_t(e) * H * F);
    h[4 * G + i] = p.act + r0 * F;
    h[5 * G + i] = down + r0 * H;
  }
  EPMOE_CUBLAS_CHECK(cublasSetStream(handle, stream));
  EPMOE_CUBLAS_CHECK(cublasSetPointerMode(handle, CUBLAS_POINTER_MODE_HOST));
  if (G > 0) {
    void** d = ptrs.device;
    EPMOE_CUDA_CHECK(cudaMemcpyAsync(d, h, size_t(6) * G * sizeof(void*), cudaMemcpyHostToDevice, stream));
    grouped_gemm(handle, Gemm{2 * F, H, H, H, 2 * F}, n, d, d + G, d + 2 * G, h, h + G, h + 2 * G);
  }
  {
    const int64_t total = P * (F / 8);
    const int64_t blocks = std::min<int64_t>((total + 255) / 256, 132 * 32);
    swiglu_kernel<<<unsigned(blocks), 256, 0, stream>>>(reinterpret_cast<const uint4*>(up), p.pair_row, P, F / 8,
                                                        reinterpret_cast<uint4*>(p.act));
    EPMOE_CUDA_CHECK_LAUNCH("swiglu_kernel");
  }
  if (G > 0) {
    void** d = ptrs.device;
    grouped_gemm(handle, Gemm{H, F, F, F, H}, n, d + 3 * G, d + 4 * G, d + 5 * G, h + 3 * G, h + 4 * G, h + 5 * G);
    const int64_t blocks = (P + kWarpsPerBlock - 1) / kWarpsPerBlock;
    weighted_scatter_add_kernel<<<unsigned(blocks), kWarpsPerBlock * 32, 0, stream>>>(
        reinterpret_cast<const uint4*>(down), p.pair_row, p.pair_weight, P, H / 8, p.out);
    EPMOE_CUDA_CHECK_LAUNCH("weighted_scatter_add_kernel");
  }
}

}  // namespace epmoe::kernels
