// The swap-AB kernels' shared pieces (swap_ab_kernel.cu: split UP and DOWN; fused_swap_kernel.cu:
// the fused pipeline): their arguments, the work item (one 64-row half of a 128-row layout tile x
// one weight block) and its decode, a bf16 shared-memory store, and the consumers' k loop.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/sm90/core/ptx.cuh"
#include "kernels/sm90/core/ring.cuh"
#include "kernels/sm90/core/wgmma_narrow.cuh"
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
// Whole warp (ballots): the real rows among pair_row[m0, m0 + kRows) (a segment's real rows come first).
template <int kRows>
__device__ __forceinline__ int count_real_rows(const int32_t* pair_row, int64_t m0) {
  const int lane = int(threadIdx.x & 31);
  int n = 0;
#pragma unroll
  for (int i = 0; i < kRows / 32; ++i) n += __popc(__ballot_sync(0xffffffffu, pair_row[m0 + 32 * i + lane] >= 0));
  return n;
}

// Whole warp (ballots). half_items = tiles * blocks: the items of one half. Args: SwapArgs, or the
// MX kernels' MxArgs (padded_offsets, experts, pair_row).
template <class Args>
__device__ __forceinline__ SwapItem swap_item(const Args& a, int64_t w, int64_t tiles, int64_t half_items) {
  SwapItem it;
  const int half = w >= half_items ? 1 : 0;
  const int64_t v = w - half * half_items;
  it.j = int(v / tiles);
  const int64_t t0 = (v - int64_t(it.j) * tiles) * kBM;
  it.m0 = t0 + half * kSwapRows;
  it.e = expert_of_tile(a.padded_offsets, a.experts, t0);
  it.rows = count_real_rows<kSwapRows>(a.pair_row, it.m0);
  return it;
}

__device__ __forceinline__ void st_shared_bf16(uint32_t addr, float v) {
  const __nv_bfloat16 b = __float2bfloat16_rn(v);
  asm volatile("st.shared.b16 [%0], %1;" ::"r"(addr), "h"(*reinterpret_cast<const unsigned short*>(&b)) : "memory");
}


// The consumer warpgroup's k loop of one item at N: acc (zeroed here) = the stage's 64 weight rows
// (A, TMA) times its first N gathered token rows (B, cp.async), over num_k stages from the cursor on
// (advanced past them), each stage released once the next one's MMAs are queued.
template <int N>
__device__ __forceinline__ void swap_k_loop(float (&acc)[N / 2], RingCursor<kSwapStages>& cur,
                                            const Ring<kSwapStages>& ring, uint32_t ring_base, int num_k) {
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.0f;
  const uint32_t d0 = pin_u32(smem_desc_sw128_lo(ring_base));
  for (int kt = 0; kt < num_k; ++kt) {
    const uint32_t s = cur.stage();
    mbar_wait(ring.full(s), cur.parity());
    fence_proxy_async_shared();  // B came by cp.async (generic proxy); wgmma reads through the async one
    const uint32_t da = d0 + s * (kSwapStageBytes >> 4), db = da + (kSwapATileBytes >> 4);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk)
      Wgmma<N>::mma(acc, smem_desc_sw128_join(da + kKMajorK16Step * kk), smem_desc_sw128_join(db + kKMajorK16Step * kk));
    wgmma_commit();
    if (kt > 0) {
      wgmma_wait<1>();
      mbar_arrive(ring.empty(cur.prev_stage()));
    }
    cur.advance();
  }
  wgmma_wait<0>();
  fence_regs(acc);
  mbar_arrive(ring.empty(cur.prev_stage()));
}

#endif  // EPMOE_SM90A_DEVICE
}  // namespace epmoe::kernels::sm90
