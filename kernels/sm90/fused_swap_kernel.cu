// The fused pipeline: UP, SwiGLU and DOWN of an expert in one launch (seed 000's fused form),
// built in the swap-AB form of seed 004 for the decode sizes where one launch can pay.
//   item = a 64-row half tile of expert e x act block j (32 columns), as the split swap UP's:
//     act[r, c]       = bf16(silu(g) * u) for c in [32j, +32)           (kept in shared memory)
//     out_acc[pr, n] += pair_weight[r] * sum_c act[r, c] * w2[e, n, c]    for every n < hidden
//   with pr = pair_row[r]: DOWN is a split-K GEMM over ffn whose K slice is the item's 32 act
//   columns, reduced in the memory system (red.global.add.v4.f32). ffn / 32 partial sums per pair
//   and column is too many for bf16 reductions (each rounds to 2^-9), so the accumulator is fp32
//   (ExpertProblem::out_acc); a second grid, the programmatic dependent of this one, writes
//   out = bf16(out_acc) over all out_rows and leaves out_acc zero for the next call.
//
// Ring and roles: the split swap UP's (12 stages of an 8 KB weight box + up to 8 KB of gathered
// tokens; 4 gathering warps, 1 consumer warpgroup, 1 TMA warp). An item takes hidden / 64 UP stages
// then hidden / 256 DOWN stages, each one W2 box of 256 rows x the item's 32 columns (64 B per row,
// 64B-swizzled, the whole 16 KB stage) and no tokens: the TMA warp streams the item's W2 slice
// right behind its W1 rows, under UP's last MMAs (the seed's W2 prefetch), and the gathering warps
// arrive on those stages' full barriers without copies. After UP the consumers write act [N tokens]
// [32] into a 64B-swizzled tile, DOWN's B operand (K = 32: two k16 steps per m64 tile), so the
// activation never leaves the SM. The 128-row fused form (act 128 x 128 per CTA) is not built: at
// the sizes where fusing pays, few tiles leave most SMs without a weight stream (swap_ab_kernel.cu).
//
// What it is not: it keeps no h (a saving forward runs the split kernels) and its fp32 reductions
// land in any order (a deterministic forward runs the split kernels with pair_out).
#include "kernels/sm90/core/gather.cuh"
#include "kernels/sm90/core/ring.cuh"
#include "kernels/sm90/core/wgmma_narrow.cuh"
#include "kernels/sm90/fused_reduce.cuh"
#include "kernels/sm90/launch.cuh"
#include "kernels/sm90/swap_items.cuh"
#include "kernels/sm90/tensor_maps.cuh"
#include "kernels/sm90/up_common.cuh"
#include "kernels/sm90/zero_out.cuh"

namespace epmoe::kernels::sm90 {

#if EPMOE_SM90A_DEVICE
namespace {

// Byte offset of act (token t, column c) in the 64B-swizzled tile: 64-byte rows, chunk c / 8 at
// chunk (c / 8) ^ ((t / 2) % 4) (smem_desc_sw64).
__device__ __forceinline__ uint32_t act_tile_offset(int t, int c) {
  return uint32_t(t * 64 + ((((c >> 3) ^ (t >> 1)) & 3) << 4) + (c & 7) * 2);
}

// The consumer warpgroup's item at N: UP's k loop on the ring (as the split swap UP), SwiGLU into
// the act tile, then DOWN over hidden / 128 stages. wl: warp in the warpgroup (0..3).
template <int N>
__device__ __forceinline__ void fused_consume(const SwapArgs& a, const SwapItem& it, RingCursor<kSwapStages>& cur,
                                              const Ring<kSwapStages>& ring, uint32_t ring_base, uint32_t act_tile,
                                              uint32_t stg, int num_k, int num_d, int wl, int lane) {
  float acc[N / 2];
  swap_k_loop<N>(acc, cur, ring, ring_base, num_k);

  // act[t][c] = silu(gate) * up. Token columns past the real rows hold zeros (their B rows were
  // zero-filled), so DOWN's products there are zero.
  const int tid = int(threadIdx.x) - 128;
  named_barrier_sync(1, 128);  // the previous item's DOWN MMAs are done with the act tile
  for_each_gate_up<N>(acc, wl, lane, [&](int t, int c, float gate, float up) {
    st_shared_bf16(act_tile + act_tile_offset(t, c), silu_tanh(gate) * up);
  });
  fence_proxy_async_shared();  // the act writes, before DOWN's wgmma (async proxy) reads them
  named_barrier_sync(1, 128);
  float wt[N / 4];
  int32_t prs[2] = {-1, -1};  // (N = 8)
  fused_columns<N>(a, it, lane, wt, prs, [&](int t) { return a.pair_weight[it.m0 + t]; });

  // DOWN: each stage's W2 box is 256 rows = four m64 tiles, run as two pairs (two accumulators);
  // the last stage's rows past hidden are the box's zero fill and are not reduced.
  const uint64_t db = smem_desc_sw64(act_tile);
  for (int d = 0; d < num_d; ++d) {
    const uint32_t s = cur.stage();
    mbar_wait(ring.full(s), cur.parity());
    const uint32_t wa = ring_base + s * kSwapStageBytes;  // W2 rows [256 d, +256) x the item's 32 columns
#pragma unroll
    for (int m2 = 0; m2 < 2; ++m2) {
      const int64_t n0 = int64_t(kFusedDownRows) * d + 128 * m2;
      float acc0[N / 2], acc1[N / 2];
#pragma unroll
      for (int i = 0; i < N / 2; ++i) acc0[i] = acc1[i] = 0.0f;
      fence_regs(acc0);  // the zeros are written before the fence (else ptxas injects one per MMA pair)
      fence_regs(acc1);
      const uint32_t w0 = wa + uint32_t(m2) * (kFusedDownBoxBytes / 2);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        Wgmma<N>::mma(acc0, smem_desc_sw64(w0 + 32u * kk), db + kKMajorK16Step * kk);
        Wgmma<N>::mma(acc1, smem_desc_sw64(w0 + kFusedDownBoxBytes / 4 + 32u * kk), db + kKMajorK16Step * kk);
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(acc0);
      fence_regs(acc1);
      if (m2 == 1) {
        mbar_arrive(ring.empty(s));
        cur.advance();
      }
      if (n0 < a.hidden) reduce_tile<N>(a, it, acc0, wt, prs, stg, n0, wl, lane, tid);
      if (n0 + 64 < a.hidden) reduce_tile<N>(a, it, acc1, wt, prs, stg, n0 + 64, wl, lane, tid);
    }
  }
}

}  // namespace
#endif  // EPMOE_SM90A_DEVICE

__global__ void __launch_bounds__(kSwapThreads, 1)
    sm90_fused_swap_kernel(const __grid_constant__ CUtensorMap tm_w1, const __grid_constant__ CUtensorMap tm_w2,
                           const SwapArgs a) {
#if EPMOE_SM90A_DEVICE
  __shared__ __align__(8) uint64_t bars[2 * kSwapStages];  // full[0..S), empty[0..S)
  extern __shared__ uint8_t dyn_smem[];
  uint8_t* ring_mem = align_1024(dyn_smem);
  const uint32_t ring_base = smem_u32(ring_mem);
  const uint32_t act_tile = ring_base + kSwapStages * kSwapStageBytes;  // 1024-aligned
  const uint32_t stg = act_tile + kFusedActBytes;
  const Ring<kSwapStages> ring{smem_u32(&bars[0]), smem_u32(&bars[kSwapStages])};

  const int64_t tiles = a.padded_offsets[a.experts] / kBM;
  const int64_t half_items = tiles * ceil_div(a.ffn, 32), items = 2 * half_items;
  const int num_k = ceil_div(a.hidden, kBK), num_d = (a.hidden + kFusedDownRows - 1) / kFusedDownRows;
  ZeroPlan no_zeroing{};  // (the write-out writes every row of out)
  // (the bf16 write-out's launch may start; it waits for this grid)
  if (!start_persistent_kernel</*kUp=*/true>(ring, no_zeroing, items, kSwapThreads, 1 + kSwapGatherThreads, 128)) return;

  const int warp = int(threadIdx.x / 32), lane = int(threadIdx.x & 31);
  const int64_t first = blockIdx.x, stride = gridDim.x;
  if (warp < 4) {
    // ---- B: the half tile's first N rows of x, every UP stage; an arrival on every DOWN stage ----
    const int t = int(threadIdx.x);
    const RowGather<kSwapGatherThreads, 1, 4> gather(ring_base + kSwapATileBytes, t, a.hidden);
    grid_dependency_wait();  // x comes from the previous kernel (no-op unless PDL-launched)
    RingCursor<kSwapStages> cur;
    for (int64_t w = first; w < items; w += stride) {
      const SwapItem it = swap_item(a, w, tiles, half_items);
      if (it.rows == 0) continue;
      const int rows = it.rows, n = swap_ab_n(rows);
      const GatherRows<4> src = gather.rows(a.src, a.src_rows, a.hidden, [&](int i) {
        const int r = gather.row(i);
        return r < rows ? a.pair_row[it.m0 + r] : int32_t(-1);
      });
      for (int kt = 0; kt < num_k; ++kt, cur.advance()) {
        const uint32_t s = cur.stage();
        ring.wait_empty(cur);
        gather.copy_below(src, s * kSwapStageBytes, kt, n);
        cp_async_mbar_arrive_noinc(ring.full(s));
      }
      for (int d = 0; d < num_d; ++d, cur.advance()) {
        ring.wait_empty(cur);
        mbar_arrive(ring.full(cur.stage()));
      }
    }
    cp_async_wait_all();
  } else if (warp < 8) {
    // ---- consumer warpgroup ----
    RingCursor<kSwapStages> cur;
    for (int64_t w = first; w < items; w += stride) {
      const SwapItem it = swap_item(a, w, tiles, half_items);
      if (it.rows == 0) continue;  // an upper half of padding: nothing to add
      with_swap_n(it.rows, [&](auto n) {
        fused_consume<decltype(n)::value>(a, it, cur, ring, ring_base, act_tile, stg, num_k, num_d, warp - 4, lane);
      });
    }
  } else {
    // ---- weights: the item's W1 box per UP stage, then its W2 slice, 256 rows per DOWN stage ----
    if (lane == 0) {
      tma_prefetch_desc(&tm_w1);
      tma_prefetch_desc(&tm_w2);
    }
    swap_weight_warp(a, tiles, half_items, items, ring, ring_base, kSwapStageBytes, num_k + num_d, lane,
                     [&](uint32_t dst, uint32_t full, int kt, const SwapItem& it) {
                       if (kt < num_k) {
                         mbar_arrive_expect_tx(full, kSwapATileBytes);
                         tma_load_5d(dst, &tm_w1, full, kt * kBK, 0, 0, 4 * it.j, it.e);
                       } else {
                         mbar_arrive_expect_tx(full, kFusedDownBoxBytes);
                         tma_load_3d(dst, &tm_w2, full, 32 * it.j, kFusedDownRows * (kt - num_k), it.e);
                       }
                     });
  }
#else
  (void)a;
#endif
}

// out = bf16(out_acc), out_acc = 0, 8 elements per thread step; the fused grid's programmatic
// dependent (its launch overlaps that grid; its reads wait for the grid's completion).
__global__ void __launch_bounds__(256)
    sm90_fused_write_out_kernel(float* __restrict__ out_acc, __nv_bfloat16* __restrict__ out, int64_t chunks) {
#if EPMOE_SM90A_DEVICE
  grid_dependency_wait();
  float4* acc4 = reinterpret_cast<float4*>(out_acc);
  const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < chunks; i += int64_t(gridDim.x) * blockDim.x) {
    const float4 lo = acc4[2 * i], hi = acc4[2 * i + 1];
    acc4[2 * i] = zero;
    acc4[2 * i + 1] = zero;
    const uint32_t w[4] = {pack_bf16x2(lo.x, lo.y), pack_bf16x2(lo.z, lo.w), pack_bf16x2(hi.x, hi.y),
                           pack_bf16x2(hi.z, hi.w)};
    st_global_16(out + 8 * i, w);
  }
#else
  (void)out_acc, (void)out, (void)chunks;
#endif
}

void launch_fused_swap_kernel(const ExpertProblem& p, cudaStream_t s) {
  EPMOE_CHECK(p.out_acc != nullptr && p.preact == nullptr && p.pair_out == nullptr, ErrorCode::internal,
              "fused swap-AB kernel: needs out_acc, and keeps neither h nor per-pair rows");
  EPMOE_CHECK(reinterpret_cast<uintptr_t>(p.out_acc) % 16 == 0 && reinterpret_cast<uintptr_t>(p.out) % 16 == 0,
              ErrorCode::invalid_argument, "fused swap-AB kernel: out and out_acc must be 16-byte aligned");
  SwapArgs a{};
  a.padded_offsets = p.padded_offsets;
  a.experts = p.experts, a.hidden = p.hidden, a.ffn = p.ffn;
  a.src = p.x;
  a.src_rows = p.x_rows;
  a.pair_row = p.pair_row, a.pair_weight = p.pair_weight;
  a.out = p.out, a.out_rows = p.out_rows;
  a.out_acc = p.out_acc;
  const CUtensorMap tm_w1 = make_w1_swap_map(p.w1, p.experts, p.hidden, p.ffn);
  const CUtensorMap tm_w2 = make_w2_slice_map(p.w2, p.experts, p.hidden, p.ffn);
  const int64_t tiles = (p.rows_capacity + kBM - 1) / kBM;
  sm90_launch_threads(sm90_fused_swap_kernel, unsigned(kSwapThreads), /*cluster=*/false, /*pdl=*/false,
                      2 * tiles * ceil_div(p.ffn, 32), kFusedSmemBytes, s, "sm90_fused_swap", tm_w1, tm_w2, a);
  launch_fused_write_out(p.out_acc, p.out, p.out_rows, p.hidden, s);
}

void launch_fused_write_out(float* out_acc, __nv_bfloat16* out, int64_t out_rows, int hidden, cudaStream_t s) {
  const int64_t chunks = out_rows * int64_t(hidden) / 8;
  if (chunks > 0)
    sm90_launch_threads(sm90_fused_write_out_kernel, 256u, /*cluster=*/false, /*pdl=*/true, (chunks + 255) / 256, 0,
                        s, "sm90_fused_write_out", out_acc, out, chunks);
}

}  // namespace epmoe::kernels::sm90
