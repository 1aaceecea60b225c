// The fused pipelines' DOWN epilogue (fused_swap_kernel.cu: bf16; fused_mx_kernel.cu: MXFP8): an m64
// tile of split-K partials (the item's K slice of ffn) reduced in fp32 into out_acc, and the
// write-out grid that turns out_acc into bf16 out and leaves it zero for the next call.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/sm90/core/ptx.cuh"
#include "kernels/sm90/swap_items.cuh"
#include "kernels/sm90/tile_config.h"

namespace epmoe::kernels::sm90 {

// out[0, out_rows) = bf16(out_acc), out_acc = 0 there: the programmatic dependent of the fused grid
// just launched on s (fused_swap_kernel.cu). Nothing when out_rows is 0.
void launch_fused_write_out(float* out_acc, __nv_bfloat16* out, int64_t out_rows, int hidden, cudaStream_t s);

#if EPMOE_SM90A_DEVICE
__device__ __forceinline__ void ld_shared_f32x4(uint32_t addr, float (&v)[4]) {
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3]) : "r"(addr)
               : "memory");
}
// dst[0..3] += v in the memory system; 16-byte aligned address.
__device__ __forceinline__ void red_add_f32x4(float* dst, const float (&v)[4]) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3])
               : "memory");
}
__device__ __forceinline__ void red_add_f32(float* dst, float v) {
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(dst), "f"(v) : "memory");
}

// Before DOWN, per token column t of this thread's fragment (8 g + 2 (l % 4) + b): colf[2 g + b] =
// factor(t) (the tile's column scale: the routing weight, times act's scale in MX), 0 past the real
// rows; N = 8: prs[b] = that column's pair_row, -1 past the real rows or out of [0, out_rows).
template <int N, class Args, class Factor>
__device__ __forceinline__ void fused_columns(const Args& a, const SwapItem& it, int lane, float (&colf)[N / 4],
                                              int32_t (&prs)[2], Factor&& factor) {
#pragma unroll
  for (int g = 0; g < N / 8; ++g)
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const int t = 8 * g + 2 * (lane & 3) + b;
      colf[2 * g + b] = t < it.rows ? factor(t) : 0.0f;
      if (N == 8 && t < it.rows) {
        const int32_t pr = a.pair_row[it.m0 + t];
        prs[b] = pr >= 0 && int64_t(pr) < a.out_rows ? pr : -1;
      }
    }
}

// One m64 tile's epilogue (W2 rows [n0, +64) of the stage): this thread's fragment D[16 wl + l/4
// + 8h][t] weighted by its token's routing weight. N >= 16: into the fp32 staging [token][64], then
// the warpgroup reduces the real rows' 16-byte chunks into out_acc (two named barriers). N = 8 (at
// most 8 rows: decode): each thread reduces its own <= 4 values, 8 lanes covering 32 contiguous bytes
// of a row, no barrier. prs: the pair_row of this thread's token columns (N = 8 only; -1: none).
// Args: SwapArgs or MxArgs (out_acc, hidden, pair_row, out_rows).
template <int N, class Args>
__device__ __forceinline__ void reduce_tile(const Args& a, const SwapItem& it, const float (&acc)[N / 2],
                                            const float (&wt)[N / 4], const int32_t (&prs)[2], uint32_t stg,
                                            int64_t n0, int wl, int lane, int tid) {
  if constexpr (N == 8) {
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      if (prs[b] < 0) continue;
      const int64_t col = n0 + 16 * wl + (lane >> 2);
      float* row = a.out_acc + int64_t(prs[b]) * a.hidden + col;
      if (col < a.hidden) red_add_f32(row, wt[b] * acc[b]);
      if (col + 8 < a.hidden) red_add_f32(row + 8, wt[b] * acc[2 + b]);
    }
    return;
  }
  named_barrier_sync(1, 128);  // the previous tile's copy-out has read the staging
#pragma unroll
  for (int g = 0; g < N / 8; ++g)
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const int t = 8 * g + 2 * (lane & 3) + b;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int f = 16 * wl + (lane >> 2) + 8 * h;
        st_shared_f32(stg + uint32_t(t * kFusedStagingStride + f) * 4u, wt[2 * g + b] * acc[4 * g + 2 * h + b]);
      }
    }
  named_barrier_sync(1, 128);
  for (int q = tid; q < it.rows * 16; q += 128) {
    const int r = q >> 4, part = q & 15;
    const int32_t pr = a.pair_row[it.m0 + r];
    if (pr < 0 || int64_t(pr) >= a.out_rows || n0 + 4 * part >= a.hidden) continue;
    float v[4];
    ld_shared_f32x4(stg + uint32_t(r * kFusedStagingStride + 4 * part) * 4u, v);
    red_add_f32x4(a.out_acc + int64_t(pr) * a.hidden + n0 + 4 * part, v);
  }
}

#endif  // EPMOE_SM90A_DEVICE
}  // namespace epmoe::kernels::sm90
