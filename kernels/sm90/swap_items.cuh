// The swap-AB kernels' shared pieces (swap_ab_kernel.cu: split UP and DOWN; fused_swap_kernel.cu:
// the fused pipeline): their arguments, the work item (one 64-row half of a 128-row layout tile x
// one weight block) and its decode, and a bf16 shared-memory store.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/sm90/core/ptx.cuh"
#include "kernels/sm90/tile_config.h"
#include "kernels/sm90/work_items.cuh"

namespace epmoe::kernels::sm90 {

struct SwapArgs {
  const int64_t* padded_offsets;
  int experts, hidden, ffn;
  const __nv_bfloat16* src;  // UP: x (rows pair_row[r]); DOWN: act (rows r)
  int64_t src_rows;
  const int32_t* pair_row;
  const float* pair_weight;
  __nv_bfloat16* act;     // UP
  __nv_bfloat16* preact;  // UP, optional
  __nv_bfloat16* out;     // DOWN
  int64_t out_rows;
  __nv_bfloat16* pair_out;  // DOWN, optional (deterministic mode): each pair's row instead of out
  __nv_bfloat16* zero_out;  // UP, optional (ExpertProblem::zero_out)
  int64_t zero_chunks;
  float* out_acc;  // the fused pipeline: its fp32 split-K accumulator [out_rows, hidden]
};

#if EPMOE_SM90A_DEVICE
struct SwapItem {
  int64_t m0;  // first row of the half tile
  int j;       // weight block
  int e;       // expert
  int rows;    // its real rows (0..64; 0: nothing to compute)
};
// Whole warp (ballots). half_items = tiles * blocks: the items of one half.
__device__ __forceinline__ SwapItem swap_item(const SwapArgs& a, int64_t w, int64_t tiles, int64_t half_items) {
  SwapItem it;
  const int half = w >= half_items ? 1 : 0;
  const int64_t v = w - half * half_items;
  it.j = int(v / tiles);
  const int64_t t0 = (v - int64_t(it.j) * tiles) * kBM;
  it.m0 = t0 + half * kSwapRows;
  it.e = expert_of_tile(a.padded_offsets, a.experts, t0);
  // Real rows: the segment's prefix.
  const int lane = int(threadIdx.x & 31);
  int n = 0;
#pragma unroll
  for (int i = 0; i < kSwapRows / 32; ++i) n += __popc(__ballot_sync(0xffffffffu, a.pair_row[it.m0 + 32 * i + lane] >= 0));
  it.rows = n;
  return it;
}

__device__ __forceinline__ void st_shared_bf16(uint32_t addr, float v) {
  const __nv_bfloat16 b = __float2bfloat16_rn(v);
  asm volatile("st.shared.b16 [%0], %1;" ::"r"(addr), "h"(*reinterpret_cast<const unsigned short*>(&b)) : "memory");
}

#endif  // EPMOE_SM90A_DEVICE
}  // namespace epmoe::kernels::sm90
