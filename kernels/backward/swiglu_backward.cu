// SwiGLU backward (see swiglu_backward.cuh). One warp per row: 16-byte loads of g, u and da, the
// ds partial sums reduced across the warp once per row. Memory-bound: 5 ffn bf16 read, 3 ffn written
// per row.
#include "kernels/backward/swiglu_backward.cuh"

#include <algorithm>

#include "kernels/cuda_check.cuh"

namespace epmoe::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerBlock = kThreads / 32;

__device__ __forceinline__ uint32_t pack2(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__global__ void __launch_bounds__(kThreads)
    swiglu_backward_kernel(const uint4* __restrict__ h, const uint4* __restrict__ da, const int32_t* __restrict__ pair_row,
                           const float* __restrict__ pair_weight, int64_t rows, int vecs, uint4* __restrict__ dh,
                           uint4* __restrict__ act_s, float* __restrict__ ds, const int64_t* __restrict__ rows_total) {
  const int64_t i = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = int(threadIdx.x & 31);
  if (i >= rows || (rows_total != nullptr && i >= *rows_total)) return;
  const uint4* hg = h + i * 2 * vecs;  // vecs = ffn / 8 chunks of 8 columns
  const uint4* hu = hg + vecs;
  const uint4* t = da + i * vecs;
  uint4* dg = dh + i * 2 * vecs;
  uint4* du = dg + vecs;
  uint4* as = act_s + i * vecs;
  if (pair_row[i] < 0) {
    const uint4 z = make_uint4(0, 0, 0, 0);
    for (int v = lane; v < vecs; v += 32) dg[v] = du[v] = as[v] = z;
    if (lane == 0) ds[i] = 0.f;
    return;
  }
  const float s = pair_weight[i];
  float sum = 0.f;
  for (int v = lane; v < vecs; v += 32) {
    const uint4 g8 = hg[v], u8 = hu[v], t8 = t[v];
    const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&g8);
    const __nv_bfloat162* u2 = reinterpret_cast<const __nv_bfloat162*>(&u8);
    const __nv_bfloat162* t2 = reinterpret_cast<const __nv_bfloat162*>(&t8);
    uint32_t og[4], ou[4], oa[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float2 g = __bfloat1622float2(g2[q]), u = __bfloat1622float2(u2[q]), d = __bfloat1622float2(t2[q]);
      const float sg0 = 1.f / (1.f + __expf(-g.x)), sg1 = 1.f / (1.f + __expf(-g.y));
      const float silu0 = g.x * sg0, silu1 = g.y * sg1;
      const float a0 = __bfloat162float(__float2bfloat16_rn(silu0 * u.x));
      const float a1 = __bfloat162float(__float2bfloat16_rn(silu1 * u.y));
      sum = fmaf(d.x, a0, fmaf(d.y, a1, sum));
      const float e0 = s * d.x, e1 = s * d.y;
      og[q] = pack2(e0 * u.x * sg0 * (1.f + g.x * (1.f - sg0)), e1 * u.y * sg1 * (1.f + g.y * (1.f - sg1)));
      ou[q] = pack2(e0 * silu0, e1 * silu1);
      oa[q] = pack2(s * a0, s * a1);
    }
    dg[v] = make_uint4(og[0], og[1], og[2], og[3]);
    du[v] = make_uint4(ou[0], ou[1], ou[2], ou[3]);
    as[v] = make_uint4(oa[0], oa[1], oa[2], oa[3]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (lane == 0) ds[i] = sum;
}

}  // namespace

void swiglu_backward_launch(const __nv_bfloat16* h, const __nv_bfloat16* da, const int32_t* pair_row,
                            const float* pair_weight, int64_t rows, int ffn, __nv_bfloat16* dh, __nv_bfloat16* act_s,
                            float* ds, cudaStream_t stream, const int64_t* rows_total) {
  EPMOE_CHECK(ffn > 0 && ffn % 8 == 0, ErrorCode::internal, "swiglu_backward: ffn must be a multiple of 8, got ", ffn);
  if (rows == 0) return;
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  EPMOE_CHECK(blocks <= 0x7fffffff, ErrorCode::internal, "swiglu_backward: too many rows: ", rows);
  swiglu_backward_kernel<<<unsigned(blocks), kThreads, 0, stream>>>(
      reinterpret_cast<const uint4*>(h), reinterpret_cast<const uint4*>(da), pair_row, pair_weight, rows, ffn / 8,
      reinterpret_cast<uint4*>(dh), reinterpret_cast<uint4*>(act_s), ds, rows_total);
  EPMOE_CUDA_CHECK_LAUNCH("swiglu_backward_kernel");
}

}  // namespace epmoe::kernels
