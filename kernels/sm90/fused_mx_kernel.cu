// The fused MXFP8 pipeline (MxForm::fused; seed 000's fused form with its MXFP8 data path, in the
// swap-AB form of seed 004): UP, SwiGLU, the requantization of act and DOWN of an item in one grid,
// act never through HBM.
//   item = a 64-row half tile of expert e x act block j (32 columns = one MX block), as the split MX
//   swap UP's (mx_swap_loop.cuh: the same gather, ring and promoted k loop, so act is bit for bit
//   the split form's):
//     v[r, c]     = silu(g) * u for c in [32j, +32); act[r] = MX(v[r]): 32 E4M3 codes + 1 E8M0 scale
//                   (mxdev::quantize_block32), kept in shared memory
//     out_acc[pr, n] += pair_weight[r] * Xa[r] * Xw2[e, n, j] * sum_c act_q[r, c] * w2_q[e, n, c]
//                   for every n < hidden, pr = pair_row[r]
//   DOWN is a split-K GEMM over ffn whose K slice is the item's one MX block, so each m64 tile is one
//   m64nNk32 FP8 wgmma and its promotion is a multiply: no partial sums to keep across blocks.
//   The ffn / 32 partial sums per pair and column are reduced in fp32 into out_acc (red.global.add,
//   fused_reduce.cuh), and the write-out grid, this grid's programmatic dependent, writes out =
//   bf16(out_acc) over all out_rows and leaves out_acc zero for the next call.
//
// Ring and roles: the split MX swap UP's (12 stages of an 8 KB E4M3 W1 box + up to 8 KB of gathered
// token rows, 512 bytes of scales beside each; 4 gathering warps, 1 consumer warpgroup, 1 TMA warp).
// An item takes hidden / 128 UP stages, then hidden / 512 DOWN stages, each two W2 boxes of 256 rows
// x the item's 32 bytes (32B-swizzled, the whole 16 KB stage): the TMA warp streams the item's W2
// slice right behind its W1 rows, under UP's last MMAs (the seed's W2 prefetch). On DOWN stages the
// gathering warps copy the 512 rows' E8M0 scales of block j (one byte each, ffn / 32 bytes apart in
// w2_scale: below TMA's 16-byte box minimum) into the stage's scale slot and arrive on its full
// barrier. After UP the consumers stage v in fp32, threads t < N quantize token t's block into a
// 32B-swizzled tile [N tokens][32 B] (DOWN's B operand) and its scale Xa[t] beside it.
//
// What it is not: it keeps no act for a backward (the MXFP8 layer is forward-only), and its fp32
// reductions land in any order (not bitwise reproducible; the split forms' bf16 reductions are not
// either).
#include "epmoe/mxfp8.h"
#include "kernels/sm90/fused_reduce.cuh"
#include "kernels/sm90/launch.cuh"
#include "kernels/sm90/mx_common.cuh"
#include "kernels/sm90/mx_swap_loop.cuh"
#include "kernels/sm90/swap_mx.cuh"
#include "kernels/sm90/tensor_maps.cuh"
#include "kernels/sm90/zero_out.cuh"

namespace epmoe::kernels::sm90 {

#if EPMOE_SM90A_DEVICE
namespace {

// Byte offset of token t's 16-byte chunk c (0, 1) in the 32B-swizzled act tile: 32-byte rows, chunk c
// at c ^ ((t / 4) % 2) (smem_desc_sw32; the tile is 1024-aligned).
__device__ __forceinline__ uint32_t act_chunk_offset(int t, int c) {
  return uint32_t(t * 32 + (((c ^ (t >> 2)) & 1) << 4));
}

// The consumer warpgroup's item at N: UP's promoted k loop on the ring (as the split MX UP), SwiGLU
// and its MX requantization into the act tile, then DOWN over hidden / 512 stages.
template <int N>
__device__ __forceinline__ void fused_mx_consume(const MxArgs& a, const SwapItem& it, RingCursor<kMxSwapStages>& cur,
                                                 const Ring<kMxSwapStages>& ring, uint32_t ring_base,
                                                 uint32_t sc_base, uint32_t act_tile, uint32_t act_scale,
                                                 uint32_t stg, int num_k, int num_d, int wl, int lane) {
  float acc[N / 2];
  mx_swap_k_loop<N>(acc, cur, ring, ring_base, sc_base, num_k, wl, lane);

  const int tid = int(threadIdx.x) - 128;
  named_barrier_sync(1, 128);  // the previous item's DOWN is done with the staging and the act tile
  mx_stage_swiglu<N>(acc, stg, wl, lane);
  named_barrier_sync(1, 128);
  if (tid < N) {  // token columns past the real rows: their B rows were zeros, so v = 0 there
    uint32_t q[8];
    const uint32_t scale = mx_quantize_staged_row(stg, tid, q);
    const uint32_t lo[4] = {q[0], q[1], q[2], q[3]}, hi[4] = {q[4], q[5], q[6], q[7]};
    st_shared_16(act_tile + act_chunk_offset(tid, 0), lo);
    st_shared_16(act_tile + act_chunk_offset(tid, 1), hi);
    st_shared_f32(act_scale + uint32_t(tid) * 4u, e8m0_to_f32(scale));
  }
  fence_proxy_async_shared();  // the act writes, before DOWN's wgmma (async proxy) reads them
  named_barrier_sync(1, 128);

  // Per token column: its routing weight times its act scale (0 past the real rows).
  float colf[N / 4];
  int32_t prs[2] = {-1, -1};  // (N = 8)
  fused_columns<N>(a, it, lane, colf, prs, [&](int t) {
    return a.pair_weight[it.m0 + t] * __uint_as_float(ld_shared_u32(act_scale + uint32_t(t) * 4u));
  });

  // DOWN: each stage's 512 W2 rows are eight m64 tiles, run as pairs (two partials); the stage's
  // rows past hidden (hidden % 512) are not computed.
  const uint64_t db = smem_desc_sw32(act_tile);
  for (int d = 0; d < num_d; ++d) {
    const uint32_t s = cur.stage();
    mbar_wait(ring.full(s), cur.parity());
    const uint32_t wa = ring_base + s * kMxSwapStageBytes;    // W2 rows [512 d, +512) x the item's 32 bytes
    const uint32_t sc = sc_base + s * kMxScaleStageBytes;     // their E8M0 scales of block j
    const int64_t r0 = int64_t(kFusedMxDownRows) * d;
    const int pairs = int(min(int64_t(kFusedMxDownRows), int64_t(a.hidden) - r0) / 128);
    for (int m2 = 0; m2 < pairs; ++m2) {
      const uint32_t w0 = wa + uint32_t(m2) * 128u * 32u;
      float acc0[N / 2], acc1[N / 2];
      wgmma_fence();
      WgmmaE4m3<N>::mma(acc0, smem_desc_sw32(w0), db, /*scale_d=*/0);
      WgmmaE4m3<N>::mma(acc1, smem_desc_sw32(w0 + 64u * 32u), db, /*scale_d=*/0);
      wgmma_commit();
      float xw0[2], xw1[2];  // the scales of this thread's fragment rows 16 wl + l/4 + 8 h in both tiles
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t row = uint32_t(128 * m2 + 16 * wl + (lane >> 2) + 8 * h);
        xw0[h] = e8m0_to_f32(ld_shared_u8(sc + row));
        xw1[h] = e8m0_to_f32(ld_shared_u8(sc + row + 64u));
      }
      wgmma_wait<0>();
      fence_regs(acc0);
      fence_regs(acc1);
      if (m2 == pairs - 1) {  // every wgmma read and scale read of the stage is done
        mbar_arrive(ring.empty(s));
        cur.advance();
      }
#pragma unroll
      for (int g = 0; g < N / 8; ++g)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            acc0[4 * g + 2 * h + b] *= xw0[h];
            acc1[4 * g + 2 * h + b] *= xw1[h];
          }
      const int64_t n0 = r0 + 128 * m2;
      reduce_tile<N>(a, it, acc0, colf, prs, stg, n0, wl, lane, tid);
      reduce_tile<N>(a, it, acc1, colf, prs, stg, n0 + 64, wl, lane, tid);
    }
  }
}

}  // namespace
#endif  // EPMOE_SM90A_DEVICE

__global__ void __launch_bounds__(kSwapThreads, 1)
    sm90_fused_mx_kernel(const __grid_constant__ CUtensorMap tm_w1, const __grid_constant__ CUtensorMap tm_w2,
                         const MxArgs a) {
#if EPMOE_SM90A_DEVICE
  __shared__ __align__(8) uint64_t bars[2 * kMxSwapStages];  // full[0..S), empty[0..S)
  extern __shared__ uint8_t dyn_smem[];
  uint8_t* ring_mem = align_1024(dyn_smem);
  const uint32_t ring_base = smem_u32(ring_mem);  // S x (A: 64 weight rows x 128 B, B: 64 token rows x 128 B)
  const uint32_t sc_base = ring_base + kMxSwapStages * kMxSwapStageBytes;  // S x 512 B of scales
  const uint32_t act_tile = sc_base + kMxSwapStages * kMxScaleStageBytes;  // 1024-aligned
  const uint32_t act_scale = act_tile + kFusedMxActBytes;
  const uint32_t stg = act_scale + kFusedMxActScaleBytes;
  const Ring<kMxSwapStages> ring{smem_u32(&bars[0]), smem_u32(&bars[kMxSwapStages])};

  const int64_t tiles = a.padded_offsets[a.experts] / kBM;
  const int64_t half_items = tiles * (a.ffn / mx::kBlock), items = 2 * half_items;
  const int num_k = a.hidden / kMxBK, num_d = ceil_div(a.hidden, kFusedMxDownRows);
  ZeroPlan no_zeroing{};  // (the write-out writes every row of out)
  // (the bf16 write-out's launch may start; it waits for this grid)
  if (!start_persistent_kernel</*kUp=*/true>(ring, no_zeroing, items, kSwapThreads, 1 + kSwapGatherThreads, 128)) return;

  const int warp = int(threadIdx.x / 32), lane = int(threadIdx.x & 31);
  const int64_t first = blockIdx.x, stride = gridDim.x;
  if (warp < 4) {
    // ---- UP stages: token rows and scales (as the split MX UP); DOWN stages: the W2 rows' scales ----
    const int t = int(threadIdx.x);
    const RowGather<kSwapGatherThreads, 1, 4> gather(ring_base + kMxSwapATileBytes, t, a.hidden / 2);
    grid_dependency_wait();  // x comes from the previous kernel (no-op unless PDL-launched)
    const int scale_stride = a.ffn / mx::kBlock;
    RingCursor<kMxSwapStages> cur;
    for (int64_t w = first; w < items; w += stride) {
      const SwapItem it = swap_item(a, w, tiles, half_items);
      if (it.rows == 0) continue;
      mx_gather_item<true>(a, it, gather, cur, ring, sc_base, num_k, a.hidden, t);
      const uint8_t* w2s = a.w2_scale + int64_t(it.e) * a.hidden * scale_stride + it.j;
      for (int d = 0; d < num_d; ++d, cur.advance()) {
        const uint32_t s = cur.stage();
        ring.wait_empty(cur);
#pragma unroll
        for (int q = 0; q < kFusedMxDownRows / kSwapGatherThreads; ++q) {
          const int i = t + kSwapGatherThreads * q;
          const int64_t n = int64_t(kFusedMxDownRows) * d + i;
          st_shared_u8(sc_base + s * kMxScaleStageBytes + uint32_t(i), n < a.hidden ? __ldg(w2s + n * scale_stride) : 0u);
        }
        mbar_arrive(ring.full(s));  // (release: the consumers' wait on full sees the scale bytes)
      }
    }
    cp_async_wait_all();
  } else if (warp < 8) {
    // ---- consumer warpgroup ----
    RingCursor<kMxSwapStages> cur;
    for (int64_t w = first; w < items; w += stride) {
      const SwapItem it = swap_item(a, w, tiles, half_items);
      if (it.rows == 0) continue;  // an upper half of padding: nothing to add
      with_swap_n(it.rows, [&](auto n) {
        fused_mx_consume<decltype(n)::value>(a, it, cur, ring, ring_base, sc_base, act_tile, act_scale, stg, num_k, num_d,
                                             warp - 4, lane);
      });
    }
  } else {
    // ---- weights: the item's W1 box per UP stage, then its W2 slice, 512 rows per DOWN stage ----
    if (lane == 0) {
      tma_prefetch_desc(&tm_w1);
      tma_prefetch_desc(&tm_w2);
    }
    swap_weight_warp(a, tiles, half_items, items, ring, ring_base, kMxSwapStageBytes, num_k + num_d, lane,
                     [&](uint32_t dst, uint32_t full, int kt, const SwapItem& it) {
                       if (kt < num_k) {
                         mbar_arrive_expect_tx(full, kMxSwapATileBytes);
                         tma_load_4d(dst, &tm_w1, full, kt * kMxBK, 0, 2 * it.e, 4 * it.j);
                       } else {
                         const int r0 = kFusedMxDownRows * (kt - num_k);
                         const bool two = r0 + kFusedMxBoxRows < a.hidden;  // (a box past hidden: all zeros)
                         mbar_arrive_expect_tx(full, two ? 2 * kFusedMxBoxBytes : kFusedMxBoxBytes);
                         tma_load_3d(dst, &tm_w2, full, mx::kBlock * it.j, r0, it.e);
                         if (two)
                           tma_load_3d(dst + kFusedMxBoxBytes, &tm_w2, full, mx::kBlock * it.j, r0 + kFusedMxBoxRows, it.e);
                       }
                     });
  }
#else
  (void)a;
#endif
}

void launch_mx_fused(const MxExpertProblem& p, cudaStream_t s) {
  check_mx_expert_problem(p, "sm90 fused MX kernel");
  const MxArgs a = make_mx_args(p, /*up=*/true);
  const CUtensorMap tm_w1 = make_w1_swap_map_e4m3(p.w1, p.experts, p.hidden, p.ffn);
  const CUtensorMap tm_w2 = make_w2_slice_map_e4m3(p.w2, p.experts, p.hidden, p.ffn);
  const int64_t tiles = (p.rows_capacity + kBM - 1) / kBM;
  sm90_launch_threads(sm90_fused_mx_kernel, unsigned(kSwapThreads), /*cluster=*/false, /*pdl=*/false,
                      2 * tiles * (p.ffn / mx::kBlock), kFusedMxSmemBytes, s, "sm90_fused_mx", tm_w1, tm_w2, a);
  launch_fused_write_out(p.out_acc, p.out, p.out_rows, p.hidden, s);
}

}  // namespace epmoe::kernels::sm90
