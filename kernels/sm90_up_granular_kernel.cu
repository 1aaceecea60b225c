// UP projection + SwiGLU on token-granular tiles (EPMOE_SM90_UP_TILES=granular, opt-in; measured in
// docs/PERF.md sessions 12 (prototype) and 13).
//   act[r, c] = bf16(silu(x[pair_row[r]] . w1[e, c]) * (x[pair_row[r]] . w1[e, ffn + c]))
//
// Why: wgmma's M is 64 rows per warpgroup, so the 128-row UP kernel computes every expert's last tile
// whole - 12% of the rows at E=32 k=8 T=2k are padding, and at hidden 7168 that kernel keeps the
// tensor pipe 95-96% busy, so the padding's MMA is what is left. Here A and B are swapped: wgmma M
// is W1's rows (warpgroup c: gate rows 64c.. and up rows 128 + 64c.. of the folded 256-row box, two
// m64nNk16 per K step of 16) and N is the item's tokens, N = 16..128. The layout is unchanged
// (segments padded to 128 rows, DOWN untouched): the ceil(r/128) row tiles of an expert with r real
// rows become tiles of near-equal N (multiples of 16, granular_tile), so the padding computed is < 16
// rows per expert and the expert's tiles stay equal in length; the act rows of the segment past the
// granular ones are written as zeros (DOWN computes them and drops them; zeros keep that cheap).
//
// Items (tile, column block) are the 128-row kernel's order (WorkGrid: global, or by expert with the
// schedule's offsets after the staging boxes; no tail split, no padding halves), but CLAIMED in that
// order from work_counters[0] instead of the static b, b + grid, ... walk: items of different N make
// statically striped CTAs drift apart, and the CTAs reading one weight slice then no longer meet in
// L2 (prototype: +10% at 7168/T=2k). Thread 0 claims the next item three K steps before the current
// one ends (sm90_granular_claim_kt), so a CTA starts an item a few stages after claiming it, and
// items claimed in a row start together.
// The producer ends with an end marker in the item slot; the CTA that retires last resets the
// counters. Every consumer thread arrives on the empty barriers (release_stage), which also orders
// the slot reads against the marker.
//
// Producer warpgroup: all 128 threads gather the item's N token rows of x with cp.async into the A
// region of the stage (the 128-row kernel's layout), thread 0 TMA-loads the folded W1 box into the B
// region. Consumers: acc is [act column][token]; SwiGLU in registers, stmatrix.trans into the
// warpgroup's [token][64 columns] staging (128B-swizzled rows), then 16-byte stores of act.
#include "kernels/cuda_check.cuh"
#include "kernels/sm90_common.cuh"
#include "kernels/sm90_work_items.cuh"
#include "kernels/sm90_experts.cuh"
#include "kernels/sm90_launch_config.cuh"
#include "kernels/sm90_tensor_maps.cuh"
#include "kernels/sm90_wgmma_n.cuh"

namespace epmoe::kernels {
namespace sm90 {

inline constexpr uint32_t kGranProducerRegs = 96, kGranConsumerRegs = 200;
static_assert(setmaxnreg_split_fits(kGranProducerRegs, kGranConsumerRegs), "setmaxnreg split");
inline constexpr uint32_t kGranClaimBarrier = 4;  // named barrier of the 128 producer threads (1, 2: epilogue)

#if EPMOE_SM90A_DEVICE
struct GranularItem {  // the item slot: first act row, column block, tokens (0: end), zero rows to
  int32_t row0, nb, n, zero_end;  // [row0 + n, zero_end) (the segment's tail after its last tile)
};

template <int N>
__device__ __forceinline__ void granular_item(uint32_t& it, int num_k, uint32_t full0, uint32_t empty0, uint32_t sA,
                                              uint32_t sB, uint32_t stg, int c, int warp, int lane,
                                              const GranularItem& gi, __nv_bfloat16* __restrict__ act, int ffn,
                                              bool silu_tanh_form) {
  float ag[N / 2], au[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) ag[i] = au[i] = 0.0f;
  for (int kt = 0; kt < num_k; ++kt, ++it) {
    const uint32_t s = it % kStages;
    mbar_wait(full0 + 8 * s, (it / kStages) & 1u);
    fence_proxy_async_shared();  // the tokens were written by cp.async (generic proxy)
    const uint64_t dg = smem_desc_sw128(sB + s * kBTileBytes + uint32_t(c) * 8192u);
    const uint64_t du = smem_desc_sw128(sB + s * kBTileBytes + 16384u + uint32_t(c) * 8192u);
    const uint64_t dt = smem_desc_sw128(sA + s * kATileBytes);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      WgmmaN<N>::run(ag, dg + 2 * kk, dt + 2 * kk);
      WgmmaN<N>::run(au, du + 2 * kk, dt + 2 * kk);
    }
    wgmma_commit();
    if (kt > 0) {
      wgmma_wait<1>();
      release_stage<false>(empty0, 0u, (it - 1) % kStages, 1u);
    }
  }
  wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < N / 2; ++i) asm volatile("" : "+f"(ag[i]), "+f"(au[i])::"memory");
  release_stage<false>(empty0, 0u, (it - 1) % kStages, 1u);

  // SwiGLU: word 2g + h = the act of columns 16 warp + lane/4 + 8h, tokens 8g + 2(lane%4) + {0, 1}.
  uint32_t words[N / 4];
  swiglu_words(words, ag, au, silu_tanh_form);
  named_barrier_sync(1 + c, 128);  // the staging's previous copy-out is done
  // stmatrix.trans: matrices (g, 0), (g, 1), (g + 1, 0), (g + 1, 1); lane l addresses matrix l/8, stored
  // row j = l%8, i.e. token 8g' + j, 16-byte chunk 2 warp + h' of the 64 columns (XOR-swizzled by row).
#pragma unroll
  for (int g = 0; g < N / 8; g += 2) {
    const uint32_t v[4] = {words[2 * g], words[2 * g + 1], words[2 * g + 2], words[2 * g + 3]};
    stmatrix_x4_trans(stg + stmatrix_trans_offset(g, 0, warp, lane, 128u), v);
  }
  named_barrier_sync(1 + c, 128);
  // Copy-out: thread t of the warpgroup moves 16-byte chunk t%8 of rows t/8, t/8 + 16, ...
  const int t = int(threadIdx.x & 127), ch = t & 7;
  __nv_bfloat16* col = act + int64_t(gi.nb) * 128 + 64 * c + 8 * ch;
  for (int r = t >> 3; r < N; r += 16) {
    uint32_t w4[4];
    ld_shared_16(stg + staged_chunk_offset(r, ch, 128u), w4);
    st_global_16(col + (int64_t(gi.row0) + r) * ffn, w4);
  }
  const uint32_t zero4[4] = {0u, 0u, 0u, 0u};
  for (int64_t r = int64_t(gi.row0) + N + (t >> 3); r < gi.zero_end; r += 16) st_global_16(col + r * ffn, zero4);
}
#endif

__global__ void __launch_bounds__(kThreads, 1)
    sm90_up_granular_kernel(const __grid_constant__ CUtensorMap tm_w1, const int64_t* __restrict__ padded_offsets,
                            const int64_t* __restrict__ expert_counts, int experts, int hidden, int ffn,
                            const __nv_bfloat16* __restrict__ x, int64_t x_rows, const int32_t* __restrict__ pair_row,
                            __nv_bfloat16* __restrict__ act, int32_t* __restrict__ work_counters, int group_tiles,
                            int silu_tanh_form, __nv_bfloat16* __restrict__ zero_out, int64_t zero_chunks,
                            int claim_kt, int by_expert) {
#if EPMOE_SM90A_DEVICE
  __shared__ __align__(8) uint64_t bars[2 * kStages];
  __shared__ __align__(16) GranularItem slots[kStages];
  __shared__ int32_t claim[2];
  extern __shared__ uint8_t dyn_smem[];
  uint8_t* ring = align_1024(dyn_smem);
  const uint32_t sA = smem_u32(ring);              // kStages x [<= 128 tokens][64] bf16
  const uint32_t sB = sA + kStages * kATileBytes;  // kStages x [256 W1 rows][64] bf16
  const uint32_t staging = sA + kStages * kStageBytes;  // 2 x [128 tokens][64 columns] bf16
  const uint32_t full0 = smem_u32(&bars[0]), empty0 = smem_u32(&bars[kStages]);
  // By expert, the schedule's offsets follow the staging boxes (as in the 128-row kernel); items are
  // then claimed in the by-expert order, so a group's CTAs never straddle two experts' weights.
  int32_t* sched = by_expert ? reinterpret_cast<int32_t*>(ring + kStages * kStageBytes + kUpStagingBytes) : nullptr;
  const WorkGrid grid = make_work_grid<false>(ffn / 128, padded_offsets, experts, group_tiles, sched);
  init_ring_barriers<false>(full0, empty0, 1 + 128);  // thread 0's expect_tx + one cp.async arrival per thread
  // As in the 128-row UP kernel: let the DOWN grid (PDL) launch once every CTA has started; DOWN reads
  // act only after griddepcontrol.wait, which waits for this whole grid.
  grid_launch_dependents();
  const int wg = warpgroup_index();
  const int num_k = hidden / kBK;

  if (wg == 0) {
    setmaxnreg_dec<kGranProducerRegs>();
    const int t = int(threadIdx.x);
    const int chunk = t & 7, rg = t >> 3;
    const uint32_t a_dst = sA + uint32_t(rg) * 128 + (uint32_t(chunk ^ (rg & 7)) << 4);
    if (t == 0) {
      tma_prefetch_desc(&tm_w1);
      claim[0] = atomicAdd(&work_counters[0], 1);
    }
    grid_dependency_wait();  // x and the layout come from earlier kernels (no-op unless PDL-launched)
    named_barrier_sync(kGranClaimBarrier, 128);
    int64_t w = claim[0];
    int p = 0;
    int32_t next_claim = 0;
    uint32_t it = 0;
    while (w < grid.items) {
      const WorkItem wi = work_item<false>(w, grid);
      const int e = wi.expert >= 0 ? wi.expert : expert_of_tile(padded_offsets, experts, wi.m0);
      const int64_t seg = padded_offsets[e];
      const int tiles = int((padded_offsets[e + 1] - seg) / kBM);
      const int i = int((wi.m0 - seg) / kBM);
      int64_t row0;
      int n;
      granular_tile(seg, tiles, expert_counts[e], i, row0, n);
      const GranularItem item{int32_t(row0), wi.nb, n, int32_t(i == tiles - 1 ? seg + int64_t(tiles) * kBM : row0 + n)};
      const __nv_bfloat16* src[8];
      uint32_t valid = 0, live = 0;
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const int row = rg + 16 * r;
        const int32_t pr = row < n ? pair_row[row0 + row] : -1;
        const bool ok = pr >= 0 && int64_t(pr) < x_rows;
        src[r] = x + (ok ? int64_t(pr) * hidden : 0) + chunk * 8;
        valid |= ok ? (1u << r) : 0u;
        live |= row < n ? (1u << r) : 0u;
      }
      for (int kt = 0; kt < num_k; ++kt, ++it) {
        const uint32_t s = it % kStages;
        if (it >= uint32_t(kStages)) mbar_wait(empty0 + 8 * s, ((it / kStages) - 1) & 1u);
        const uint32_t full = full0 + 8 * s;
        if (t == 0) {
          if (kt == 0) slots[s] = item;
          mbar_arrive_expect_tx(full, kBTileBytes);
          tma_load_4d(sB + s * kBTileBytes, &tm_w1, full, kt * kBK, 0, 2 * e, wi.nb);
          if (kt == claim_kt) next_claim = atomicAdd(&work_counters[0], 1);  // the next item
        }
        const uint32_t dst = a_dst + s * kATileBytes;
#pragma unroll
        for (int r = 0; r < 8; ++r)
          if ((live >> r) & 1u)
            cp_async_16_zfill(dst + uint32_t(r) * 16 * 128, src[r] + kt * kBK, (valid >> r) & 1u ? 16u : 0u);
        cp_async_mbar_arrive_noinc(full);
      }
      if (t == 0) claim[p ^ 1] = next_claim;
      named_barrier_sync(kGranClaimBarrier, 128);  // thread 0's claim is in claim[p ^ 1]
      w = claim[p ^ 1];
      p ^= 1;
    }
    // End marker: the consumers leave on n == 0.
    {
      const uint32_t s = it % kStages;
      if (it >= uint32_t(kStages)) mbar_wait(empty0 + 8 * s, ((it / kStages) - 1) & 1u);
      if (t == 0) {
        slots[s] = GranularItem{0, 0, 0, 0};
        mbar_arrive(full0 + 8 * s);
      }
      mbar_arrive(full0 + 8 * s);
    }
    // This CTA's share of out's zeroing (ExpertProblem::zero_out), after its items: DOWN reduces only
    // after this whole grid completed.
    if (zero_out != nullptr && zero_chunks > 0) {
      const int64_t per = (zero_chunks + gridDim.x - 1) / gridDim.x;
      const int64_t z0 = min(int64_t(blockIdx.x) * per, zero_chunks), z1 = min(z0 + per, zero_chunks);
      uint4* z = reinterpret_cast<uint4*>(zero_out);
      for (int64_t q = z0 + t; q < z1; q += 128) z[q] = make_uint4(0u, 0u, 0u, 0u);
    }
    cp_async_wait_all();
    // The CTA that retires last resets the claim counters for the next launch (every CTA has made
    // its last claim before it counts itself here).
    if (t == 0 && atomicAdd(&work_counters[1], 1) == int32_t(gridDim.x) - 1) {
      atomicExch(&work_counters[0], 0);
      atomicExch(&work_counters[1], 0);
    }
  } else {
    setmaxnreg_inc<kGranConsumerRegs>();
    const int c = wg - 1;
    const int warp = int(threadIdx.x / 32) & 3, lane = int(threadIdx.x & 31);
    const uint32_t stg = staging + uint32_t(c) * (kUpStagingBytes / 2);
    uint32_t it = 0;
    for (;;) {
      const uint32_t s0 = it % kStages;
      mbar_wait(full0 + 8 * s0, (it / kStages) & 1u);
      GranularItem gi = slots[s0];
      gi.n = warp_uniform_i32(gi.n);  // (uniform: it picks the k loop, whose descriptors then stay uniform)
      if (gi.n == 0) break;
      switch (gi.n) {
#define EPMOE_GRANULAR_CASE(N)                                                                                   \
  case N:                                                                                                        \
    granular_item<N>(it, num_k, full0, empty0, sA, sB, stg, c, warp, lane, gi, act, ffn, silu_tanh_form != 0); \
    break;
        EPMOE_GRANULAR_CASE(16)
        EPMOE_GRANULAR_CASE(32)
        EPMOE_GRANULAR_CASE(48)
        EPMOE_GRANULAR_CASE(64)
        EPMOE_GRANULAR_CASE(80)
        EPMOE_GRANULAR_CASE(96)
        EPMOE_GRANULAR_CASE(112)
        EPMOE_GRANULAR_CASE(128)
#undef EPMOE_GRANULAR_CASE
        default:
          __trap();
      }
    }
  }
#else
  (void)padded_offsets, (void)expert_counts, (void)experts, (void)hidden, (void)ffn, (void)x, (void)x_rows,
      (void)pair_row, (void)act, (void)work_counters, (void)group_tiles, (void)silu_tanh_form, (void)zero_out,
      (void)zero_chunks, (void)claim_kt, (void)by_expert;
#endif
}

}  // namespace sm90

bool sm90_up_granular_launch(const ExpertProblem& p, cudaStream_t s) {
  using namespace sm90;
  if (p.x == nullptr || p.expert_counts == nullptr || p.work_counters == nullptr) return false;
  // Clusters asked for explicitly: the 128-row kernel's option.
  if (sm90_cluster_knob() == 1) return false;
  check_expert_problem(p, "sm90_up_granular_launch");
  CUtensorMap tm_w1;
  if (!try_make_w1_folded_map(p.w1, p.experts, p.hidden, p.ffn, &tm_w1)) return false;
  const int64_t tiles = (p.rows_capacity + kBM - 1) / kBM;
  const int64_t items = tiles * (p.ffn / 128);
  const bool by_expert = sm90_kernel_order_by_expert(p.experts, p.hidden, kUpStagingBytes);
  const size_t smem = sm90_dyn_smem_bytes(by_expert, p.experts, kUpStagingBytes);
  sm90_launch(sm90_up_granular_kernel, /*cluster=*/false, /*pdl=*/false, items, smem, s, "sm90_up_granular_launch",
              tm_w1, p.padded_offsets, p.expert_counts, p.experts, p.hidden, p.ffn, p.x, p.x_rows, p.pair_row, p.act,
              p.work_counters, sm90_group_tiles(), sm90_up_silu_tanh() ? 1 : 0, p.zero_out ? p.out : nullptr,
              p.zero_out ? p.out_rows * int64_t(p.hidden) / 8 : int64_t(0),
              sm90_granular_claim_kt(p.hidden / kBK), by_expert ? 1 : 0);
  return true;
}

}  // namespace epmoe::kernels
