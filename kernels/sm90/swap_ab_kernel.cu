// Swap-AB UP and DOWN (seed 004): for experts with few rows, the weights take wgmma's M and a tile's
// tokens take N, so a 1-row expert costs an m64n8 MMA per k16 step instead of an m64n256 on 127
// padding rows, and - what matters at decode, where the layer streams weights - each CTA owns only
// 64 weight rows of one expert: T = 1 on E = 32 k = 4 2048/1024 gives 128 UP and 128 DOWN items
// (the 128-row kernels give 32 each, leaving 100 SMs without a weight stream).
//   UP:   act[r, 32j + c] = bf16(silu(g) * u), g = x[pair_row[r]] . w1[e, 32j + c],
//         u = x[pair_row[r]] . w1[e, ffn + 32j + c]      (and h = [g | u] when p.preact)
//   DOWN: out[pair_row[r], 64j + c] += bf16(pair_weight[r] * (act[r] . w2[e, 64j + c]))
// Work item: one 64-row half of a 128-row layout tile (rows [128t + 64h, +64) of one expert's
// segment) x one 64-row weight block j (UP: ffn / 32 blocks of 32 gate rows and their up partners,
// interleaved 8 by 8 by the swap W1 map so a gate row and its partner sit in one thread's fragment;
// DOWN: hidden / 64 blocks of W2). Items: every tile's lower half first (w = j * tiles + t), then the
// upper halves, so the upper halves without rows (the common case at decode: real rows are each
// segment's prefix) are quick skips spread over all CTAs instead of idling every other one.
// Persistent grid of min(SMs, capacity items), CTA b taking b, b + grid, ... N = swap_ab_n(rows of
// the half): 8, 16, 32 or 64, chosen per item on the device from pair_row, one instantiation of the
// consumer loop per N. Half tiles keep the B stage at 8 KB, so the ring holds 12 stages: 96 KB of
// weights in flight per SM. (6 stages in 112 KB, two CTAs per SM so that DOWN's CTAs prefetch W2
// beside UP's, lost: T=8 1.13x and T=64 1.15x of the 128-row kernels against 1.02x / 1.03x here.)
//
// Roles (288 threads): warps 0-3 gather the half tile's first N rows (B, K-major, 128B-swizzled, by
// cp.async; rows past the real ones zero-filled), warps 4-7 are the consumer warpgroup (wgmma m64nN,
// staged epilogue), warp 8 loads the weight boxes by TMA. The weight loads never wait for the
// previous grid: in DOWN (PDL-launched after UP) they start while UP finishes; the gather and the
// epilogue wait for it (act, and out zeroed by UP). Every stage's full barrier takes the TMA bytes
// and one cp.async arrival per gathering thread; its empty barrier one arrival per consumer thread.
//
// Staging: UP stores act (and h) through shared memory as [64 rows][32] tiles with 16-byte rows
// out, writing zeros for the padding rows (backward reads act and h over whole segments);
// DOWN weights the rows and reduces 16-byte chunks of its real rows into out (red.global.add).
#include "kernels/sm90/core/gather.cuh"
#include "kernels/sm90/core/ring.cuh"
#include "kernels/sm90/core/wgmma_narrow.cuh"
#include "kernels/sm90/launch.cuh"
#include "kernels/sm90/swap_items.cuh"
#include "kernels/sm90/tensor_maps.cuh"
#include "kernels/sm90/up_common.cuh"
#include "kernels/sm90/work_items.cuh"
#include "kernels/sm90/zero_out.cuh"

namespace epmoe::kernels::sm90 {

#if EPMOE_SM90A_DEVICE
namespace {

// UP's copy-out of a half tile's 64 rows x the item's 32 act columns (and h's gate and up columns):
// the real rows from the staging, zeros for the rest (padding rows; backward reads them). The
// consumer warpgroup, tid 0..127; rows 0 (an empty upper half) reads no staging.
__device__ __forceinline__ void store_act_rows(const SwapArgs& a, const SwapItem& it, int rows, uint32_t stg,
                                               uint32_t stg_g, uint32_t stg_u, int tid) {
  const int64_t ffn = a.ffn;
  for (int q = tid; q < kSwapRows * 4; q += 128) {
    const int r = q >> 2, part = q & 3;
    const uint32_t off = uint32_t(r * kSwapUpStride + 8 * part) * 2u;
    const int64_t row = it.m0 + r, col = 32 * int64_t(it.j) + 8 * part;
    if (col >= ffn) continue;  // (ffn % 32 != 0: the last block's columns past ffn)
    uint32_t v[4] = {0u, 0u, 0u, 0u};
    if (r < rows) ld_shared_16(stg + off, v);
    st_global_16(a.act + row * ffn + col, v);
    if (a.preact != nullptr) {
      if (r < rows) ld_shared_16(stg_g + off, v);
      st_global_16(a.preact + row * 2 * ffn + col, v);
      if (r < rows) ld_shared_16(stg_u + off, v);
      st_global_16(a.preact + row * 2 * ffn + ffn + col, v);
    }
  }
}

// The consumer warpgroup's item at N: the k loop on the ring, then the epilogue. wl: warp in the
// warpgroup (0..3); fragment rows 16 wl + lane / 4 + 8 h, token columns 8 g + 2 (lane % 4) + b.
template <bool kUp, int N>
__device__ __forceinline__ void swap_consume(const SwapArgs& a, const SwapItem& it, RingCursor<kSwapStages>& cur,
                                             const Ring<kSwapStages>& ring, uint32_t ring_base, uint32_t stg,
                                             int num_k, int wl, int lane) {
  float acc[N / 2];
  swap_k_loop<N>(acc, cur, ring, ring_base, num_k);

  const int rows = it.rows;
  const int tid = int(threadIdx.x) - 128;  // 0..127
  named_barrier_sync(1, 128);              // the previous item's copy-out has read the staging rows
  if constexpr (kUp) {
    const uint32_t stg_g = stg + kSwapRows * kSwapUpStride * 2, stg_u = stg_g + kSwapRows * kSwapUpStride * 2;
    for_each_gate_up<N>(acc, wl, lane, [&](int t, int c, float gate, float up) {
      const uint32_t off = uint32_t(t * kSwapUpStride + c) * 2u;
      st_shared_bf16(stg + off, silu_tanh(gate) * up);
      if (a.preact != nullptr) {
        st_shared_bf16(stg_g + off, gate);
        st_shared_bf16(stg_u + off, up);
      }
    });
    named_barrier_sync(1, 128);
    store_act_rows(a, it, rows, stg, stg_g, stg_u, tid);
  } else {
    swap_down_epilogue<N, true>(acc, it, rows, a.pair_weight, a.pair_row, a.out, a.out_rows, a.pair_out, a.hidden, stg,
                                wl, lane, tid);
  }
}

}  // namespace
#endif  // EPMOE_SM90A_DEVICE

template <bool kUp>
__global__ void __launch_bounds__(kSwapThreads, 1)
    sm90_swap_ab_kernel(const __grid_constant__ CUtensorMap tm_w, const SwapArgs a) {
#if EPMOE_SM90A_DEVICE
  __shared__ __align__(8) uint64_t bars[2 * kSwapStages];  // full[0..S), empty[0..S)
  extern __shared__ uint8_t dyn_smem[];
  uint8_t* ring_mem = align_1024(dyn_smem);
  const uint32_t ring_base = smem_u32(ring_mem);  // S x (A: 64 weight rows x 64, B: 128 rows x 64)
  const uint32_t stg = ring_base + kSwapStages * kSwapStageBytes;
  const Ring<kSwapStages> ring{smem_u32(&bars[0]), smem_u32(&bars[kSwapStages])};

  const int64_t tiles = a.padded_offsets[a.experts] / kBM;
  const int blocks = kUp ? ceil_div(a.ffn, 32) : ceil_div(a.hidden, kSwapWeightRows);
  const int64_t half_items = tiles * blocks, items = 2 * half_items;
  const int k_dim = kUp ? a.hidden : a.ffn;
  const int num_k = ceil_div(k_dim, kBK);
  ZeroPlan zero = kUp ? make_zero_plan<false>(a.zero_out, a.zero_chunks, items) : ZeroPlan{};
  // (UP: DOWN's prologue and weight loads may start)
  if (!start_persistent_kernel<kUp>(ring, zero, items, kSwapThreads, 1 + kSwapGatherThreads, 128)) return;

  const int warp = int(threadIdx.x / 32), lane = int(threadIdx.x & 31);
  const int64_t first = blockIdx.x, stride = gridDim.x;
  if (warp < 4) {
    // ---- B: the tile's first N rows, every K step ----
    const int t = int(threadIdx.x);
    const RowGather<kSwapGatherThreads, 1, 4> gather(ring_base + kSwapATileBytes, t, k_dim);
    grid_dependency_wait();  // x / act come from the previous kernel (no-op unless PDL-launched)
    RingCursor<kSwapStages> cur;
    for (int64_t w = first; w < items; w += stride) {
      const SwapItem it = swap_item(a, w, tiles, half_items);
      if (it.rows == 0) continue;
      const int rows = it.rows, n = swap_ab_n(rows);
      const GatherRows<4> src = gather.rows(a.src, a.src_rows, k_dim, [&](int i) {
        const int r = gather.row(i);
        if (r >= rows) return int32_t(-1);
        return kUp ? a.pair_row[it.m0 + r] : int32_t(it.m0 + r);
      });
      zero_step(zero, zero.per_item, t, kSwapGatherThreads);
      for (int kt = 0; kt < num_k; ++kt, cur.advance()) {
        const uint32_t s = cur.stage();
        ring.wait_empty(cur);
        gather.copy_below(src, s * kSwapStageBytes, kt, n);
        cp_async_mbar_arrive_noinc(ring.full(s));
      }
    }
    zero_step(zero, zero.end - zero.next, t, kSwapGatherThreads);
    cp_async_wait_all();
  } else if (warp < 8) {
    // ---- consumer warpgroup ----
    grid_dependency_wait();  // DOWN reduces into out, which UP zeroed
    RingCursor<kSwapStages> cur;
    for (int64_t w = first; w < items; w += stride) {
      const SwapItem it = swap_item(a, w, tiles, half_items);
      if (it.rows == 0) {  // an upper half of padding: UP writes its act (and h) rows as zeros
        if constexpr (kUp) store_act_rows(a, it, 0, 0u, 0u, 0u, int(threadIdx.x) - 128);
        continue;
      }
      with_swap_n(it.rows, [&](auto n) {
        swap_consume<kUp, decltype(n)::value>(a, it, cur, ring, ring_base, stg, num_k, warp - 4, lane);
      });
    }
  } else {
    // ---- weights: one 64-row box per stage ----
    if (lane == 0) tma_prefetch_desc(&tm_w);
    swap_weight_warp(a, tiles, half_items, items, ring, ring_base, kSwapStageBytes, num_k, lane,
                     [&](uint32_t dst, uint32_t full, int kt, const SwapItem& it) {
                       mbar_arrive_expect_tx(full, kSwapATileBytes);
                       if constexpr (kUp) tma_load_5d(dst, &tm_w, full, kt * kBK, 0, 0, 4 * it.j, it.e);
                       else tma_load_3d(dst, &tm_w, full, kt * kBK, kSwapWeightRows * it.j, it.e);
                     });
  }
#else
  (void)a;
#endif
}

void launch_swap_ab_kernel(const ExpertProblem& p, bool up, bool pdl, cudaStream_t s) {
  SwapArgs a{};
  a.padded_offsets = p.padded_offsets;
  a.experts = p.experts, a.hidden = p.hidden, a.ffn = p.ffn;
  a.src = up ? p.x : p.act;
  a.src_rows = up ? p.x_rows : p.rows_capacity;
  a.pair_row = p.pair_row, a.pair_weight = p.pair_weight;
  a.act = p.act, a.preact = p.preact;
  a.out = p.out, a.out_rows = p.out_rows;
  a.pair_out = up ? nullptr : p.pair_out;
  a.zero_out = up ? zero_out_ptr(p) : nullptr;
  a.zero_chunks = up ? zero_out_chunks(p) : 0;
  const CUtensorMap tm = up ? make_w1_swap_map(p.w1, p.experts, p.hidden, p.ffn)
                            : make_w2_map(p.w2, p.experts, p.hidden, p.ffn, kSwapWeightRows);
  const int64_t tiles = (p.rows_capacity + kBM - 1) / kBM;
  const int64_t items = 2 * tiles * (up ? ceil_div(p.ffn, 32) : ceil_div(p.hidden, kSwapWeightRows));
  sm90_launch_threads(up ? sm90_swap_ab_kernel<true> : sm90_swap_ab_kernel<false>, unsigned(kSwapThreads),
                      /*cluster=*/false, pdl, items, kSwapSmemBytes, s, up ? "sm90_swap_ab_up" : "sm90_swap_ab_down",
                      tm, a);
}

}  // namespace epmoe::kernels::sm90
