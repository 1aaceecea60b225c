// The swap-AB kernels' shared pieces (swap_ab_kernel.cu: split UP and DOWN; fused_swap_kernel.cu:
// the fused pipeline): their arguments, the work item (one 64-row half of a 128-row layout tile x
// one weight block) and its decode, a bf16 shared-memory store, the consumers' k loop, the UP
// fragment's gate/up walk and the DOWN epilogue (shared with the MX swap DOWN, swap_mx_kernel.cu).
#pragma once
#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

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

// f(std::integral_constant<int, N>{}) at the item's N (swap_ab_n of its real rows: 8, 16, 32, 64), so
// the consumer runs the wgmma shape that covers its rows.
template <class F>
__device__ __forceinline__ void with_swap_n(int rows, F&& f) {
  switch (swap_ab_n(rows)) {
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 16: f(std::integral_constant<int, 16>{}); break;
    case 32: f(std::integral_constant<int, 32>{}); break;
    default: f(std::integral_constant<int, 64>{}); break;
  }
}

// The weight warp of the persistent swap-AB grids (split and fused, bf16 and MX): for each of this
// CTA's items with real rows, `stages` ring stages, each loaded by lane 0 with load(dst, full, kt, it)
// (its expect_tx and TMA boxes) once the consumers have released it.
template <int S, class Args, class Load>
__device__ __forceinline__ void swap_weight_warp(const Args& a, int64_t tiles, int64_t half_items, int64_t items,
                                                 const Ring<S>& ring, uint32_t ring_base, uint32_t stage_bytes,
                                                 int stages, int lane, Load&& load) {
  RingCursor<S> cur;
  for (int64_t w = blockIdx.x; w < items; w += gridDim.x) {
    const SwapItem it = swap_item(a, w, tiles, half_items);
    if (it.rows == 0) continue;
    for (int kt = 0; kt < stages; ++kt, cur.advance()) {
      const uint32_t s = cur.stage(), full = ring.full(s), dst = ring_base + s * stage_bytes;
      ring.wait_empty(cur);
      if (lane == 0) load(dst, full, kt, it);
      __syncwarp();
    }
  }
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

// The swap UP fragment's (gate, up) pairs: the fragment's row 16 wl + l/4 is gate column
// c = 8 wl + l/4 of the item's 32 act columns, row + 8 its up partner (the swap W1 map);
// store(t, c, gate, up) for each of the thread's token columns t.
template <int N, class Store>
__device__ __forceinline__ void for_each_gate_up(const float (&acc)[N / 2], int wl, int lane, Store&& store) {
  const int c = 8 * wl + (lane >> 2);
#pragma unroll
  for (int g = 0; g < N / 8; ++g)
#pragma unroll
    for (int b = 0; b < 2; ++b) store(8 * g + 2 * (lane & 3) + b, c, acc[4 * g + b], acc[4 * g + 2 + b]);
}

// The consumer warpgroup's DOWN epilogue of one item at N (wl: warp in the warpgroup, tid: 0..127):
// each token column times its pair weight into the bf16 staging rows [N][64 hidden], then each real
// row's 64 columns reduced into out (red.global.add) or, where pair_out is given (deterministic
// mode), stored as the pair's own row. kHiddenTail: hidden % 64 may be nonzero (bf16), so the last
// block's columns past hidden are skipped; the MX kernels need hidden % 64 == 0.
template <int N, bool kHiddenTail>
__device__ __forceinline__ void swap_down_epilogue(const float (&acc)[N / 2], const SwapItem& it, int rows,
                                                   const float* pair_weight, const int32_t* pair_row,
                                                   __nv_bfloat16* out, int64_t out_rows, __nv_bfloat16* pair_out,
                                                   int hidden, uint32_t stg, int wl, int lane, int tid) {
#pragma unroll
  for (int g = 0; g < N / 8; ++g)
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const int t = 8 * g + 2 * (lane & 3) + b;
      const float wt = t < rows ? pair_weight[it.m0 + t] : 0.0f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int f = 16 * wl + (lane >> 2) + 8 * h;
        st_shared_bf16(stg + uint32_t(t * kSwapDownStride + f) * 2u, wt * acc[4 * g + 2 * h + b]);
      }
    }
  named_barrier_sync(1, 128);
  for (int q = tid; q < rows * 8; q += 128) {
    const int r = q >> 3, part = q & 7;
    const int32_t pr = pair_row[it.m0 + r];
    if (pr < 0 || int64_t(pr) >= out_rows) continue;
    uint32_t v[4];
    ld_shared_16(stg + uint32_t(r * kSwapDownStride + 8 * part) * 2u, v);
    const int64_t col = int64_t(kSwapWeightRows) * it.j + 8 * part;
    if (kHiddenTail && col >= hidden) continue;  // (hidden % 64 != 0: the last block's rows past hidden)
    if (pair_out != nullptr) st_global_16(pair_out + (it.m0 + r) * hidden + col, v);
    else red_add_bf16x8(out + int64_t(pr) * hidden + col, v);
  }
}

#endif  // EPMOE_SM90A_DEVICE
}  // namespace epmoe::kernels::sm90
