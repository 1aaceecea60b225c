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

// out[pair_row[i]] += pair_weight[i] * down[i] for every xs row i with pair_row[i] >= 0 (with pair_out:
// pair_out[i] = bf16(pair_weight[i] * down[i]) instead).
// down[rows, hidden] bf16 -> out[out_rows, hidden] bf16 (bf16x2 atomics: rows of one token that
// went to several local experts add into the same out row). One warp per row, 8 columns per lane.
constexpr int kWarpsPerBlock = 8;
__global__ void weighted_scatter_add_kernel(const uint4* __restrict__ down, const int32_t* __restrict__ pair_row,
                                            const float* __restrict__ pair_weight, int64_t rows, int hidden_vecs,
                                            __nv_bfloat16* __restrict__ out, __nv_bfloat16* __restrict__ pair_out) {
  const int64_t i = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (i >= rows) return;
  const int32_t dst = pair_row[i];
  if (dst < 0) return;
  const float w = pair_weight[i];
  if (pair_out != nullptr) {  // deterministic mode: the pair's own row, no reduction
    uint4* po = reinterpret_cast<uint4*>(pair_out + i * hidden_vecs * 8);
    for (int v = threadIdx.x % 32; v < hidden_vecs; v += 32) {
      const uint4 d8 = down[i * hidden_vecs + v];
      const __nv_bfloat162* d = reinterpret_cast<const __nv_bfloat162*>(&d8);
      uint4 o;
      __nv_bfloat162* ob = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 f = __bfloat1622float2(d[q]);
        ob[q] = __floats2bfloat162_rn(w * f.x, w * f.y);
      }
      po[v] = o;
    }
    return;
  }
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

// The experts with rows, checked against their segments.
std::vector<int> active_experts(const ExpertProblem& p, const int64_t* off, const int64_t* counts) {
  std::vector<int> active;
  for (int e = 0; e < p.experts; ++e)
    if (counts[e] > 0) {
      EPMOE_CHECK(counts[e] <= off[e + 1] - off[e], ErrorCode::internal, "cublas_experts: expert ", e, " count ",
                  counts[e], " exceeds its segment");
      active.push_back(e);
    }
  return active;
}

void check_shape(const ExpertProblem& p) {
  EPMOE_CHECK(p.hidden % 8 == 0 && p.ffn % 8 == 0, ErrorCode::internal, "cublas_experts: hidden/ffn not multiples of 8");
}

}  // namespace

size_t cublas_experts_workspace_bytes(int64_t rows, int hidden, int ffn) {
  return align_up(size_t(rows) * 2 * ffn * 2) + align_up(size_t(rows) * hidden * 2);
}

// Column-major Y^T[2F, n] = W1_e * X^T (see the file header).
void cublas_up_launch(const ExpertProblem& p, const int64_t* off, const int64_t* counts, __nv_bfloat16* h,
                      cublasHandle_t handle, CublasPointerArrays& ptrs, cudaStream_t stream) {
  check_shape(p);
  const int H = p.hidden, F = p.ffn;
  std::vector<CublasGemmGroup> g;
  for (int e : active_experts(p, off, counts))
    g.push_back({2 * F, int(counts[e]), H, H, H, 2 * F, p.w1 + int64_t(e) * 2 * F * H, p.xs + off[e] * H,
                 h + off[e] * 2 * F});
  cublas_grouped_gemm(handle, CublasGemmSpec{CUBLAS_OP_T, CUBLAS_OP_N}, g, ptrs, stream);
}

void swiglu_launch(const __nv_bfloat16* h, const int32_t* pair_row, int64_t rows, int ffn, __nv_bfloat16* act,
                   cudaStream_t stream) {
  EPMOE_CHECK(ffn % 8 == 0, ErrorCode::internal, "swiglu: ffn not a multiple of 8");
  if (rows == 0) return;
  const int64_t total = rows * (ffn / 8);
  const int64_t blocks = std::min<int64_t>((total + 255) / 256, 132 * 32);
  swiglu_kernel<<<unsigned(blocks), 256, 0, stream>>>(reinterpret_cast<const uint4*>(h), pair_row, rows, ffn / 8,
                                                      reinterpret_cast<uint4*>(act));
  EPMOE_CUDA_CHECK_LAUNCH("swiglu_kernel");
}

// Column-major D^T[H, n] = W2_e * act^T, then the weighted scatter into out.
void cublas_down_launch(const ExpertProblem& p, const int64_t* off, const int64_t* counts, __nv_bfloat16* down,
                        cublasHandle_t handle, CublasPointerArrays& ptrs, cudaStream_t stream) {
  check_shape(p);
  const int H = p.hidden, F = p.ffn, El = p.experts;
  std::vector<CublasGemmGroup> g;
  for (int e : active_experts(p, off, counts))
    g.push_back({H, int(counts[e]), F, F, F, H, p.w2 + int64_t(e) * H * F, p.act + off[e] * F, down + off[e] * H});
  if (g.empty()) return;
  cublas_grouped_gemm(handle, CublasGemmSpec{CUBLAS_OP_T, CUBLAS_OP_N}, g, ptrs, stream);
  const int64_t P = off[El];
  const int64_t blocks = (P + kWarpsPerBlock - 1) / kWarpsPerBlock;
  weighted_scatter_add_kernel<<<unsigned(blocks), kWarpsPerBlock * 32, 0, stream>>>(
      reinterpret_cast<const uint4*>(down), p.pair_row, p.pair_weight, P, H / 8, p.out, p.pair_out);
  EPMOE_CUDA_CHECK_LAUNCH("weighted_scatter_add_kernel");
}

void cublas_experts_launch(const ExpertProblem& p, const int64_t* off, const int64_t* counts, cublasHandle_t handle,
                           CublasPointerArrays& ptrs, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  const int El = p.experts, H = p.hidden, F = p.ffn;
  EPMOE_CHECK(!p.zero_out, ErrorCode::invalid_argument,
              "cublas_experts: ExpertProblem::zero_out is an sm_90 pipeline option; zero out before the call");
  const int64_t P = off[El];
  if (P == 0) return;
  EPMOE_CHECK(workspace_bytes >= cublas_experts_workspace_bytes(P, H, F) && P <= p.rows_capacity,
              ErrorCode::internal, "cublas_experts: workspace or rows too small for ", P, " rows");
  __nv_bfloat16* up = static_cast<__nv_bfloat16*>(workspace);
  __nv_bfloat16* down = reinterpret_cast<__nv_bfloat16*>(static_cast<char*>(workspace) +
                                                         align_up(size_t(P) * 2 * F * 2));
  cublas_up_launch(p, off, counts, up, handle, ptrs, stream);
  swiglu_launch(up, p.pair_row, P, F, p.act, stream);
  cublas_down_launch(p, off, counts, down, handle, ptrs, stream);
}

}  // namespace epmoe::kernels
