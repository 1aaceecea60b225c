// DOWN projection on token-granular tiles (EPMOE_SM90_DOWN_TILES=granular, opt-in; docs/PERF.md
// session 13). The DOWN half of the swap-AB design of the granular UP
// kernel (sm90_up_granular_kernel.cu says why).
//   out[pair_row[r], n] += bf16(pair_weight[r] * (act[r] . w2[e, n]))   (red.global.add bf16x2)
//
// Work item: one granular tile of an expert (granular_tile: rows [row0, row0 + N), N = 16..128) and
// output columns [256 nb, +256). wgmma M is W2's rows - warpgroup c owns output columns 128c..128c+127
// as two m64 blocks - and N is the tile's tokens; act rows come through the 128-row TMA box at row0
// (rows past N are loaded and not used). Items of the 128-row kernel's order (global or by expert)
// are claimed from work_counters[2] (lane 0 of the producer warp, three K steps before the current
// item ends; the last CTA resets [2] and [3]), as in the granular UP kernel, for the same reasons
// (uneven items and the weight streams' lockstep).
//
// Epilogue, staged as in sm90_down_kernel.cu but by token halves: each consumer warpgroup writes the
// weighted bf16 of tokens [0, 64) x its 128 columns with stmatrix.trans into its 16 KB staging buffer
// (rows of 256 bytes, 16-byte chunks XOR-swizzled by row), and tokens [64, N) at k step flush_step of
// the next item; the reducer warps (1..3 of the producer warpgroup) take each staged half's header
// (first column, first row, rows, flag; flag -1: the end) and reduce its rows into out[pair_row[...]]
// with 16-byte red.global.add. The routing weights of an item are staged by warpgroup 0 (double-
// buffered by item parity) and read by both warpgroups after a 256-thread named barrier.
#include "kernels/cuda_check.cuh"
#include "kernels/sm90_common.cuh"
#include "kernels/sm90_work_items.cuh"
#include "kernels/sm90_experts.cuh"
#include "kernels/sm90_launch_config.cuh"
#include "kernels/sm90_tensor_maps.cuh"
#include "kernels/sm90_wgmma_n.cuh"

namespace epmoe::kernels {
namespace sm90 {

inline constexpr uint32_t kGranDownProducerRegs = 64, kGranDownConsumerRegs = 216;
static_assert(setmaxnreg_split_fits(kGranDownProducerRegs, kGranDownConsumerRegs), "setmaxnreg split");
inline constexpr uint32_t kGranWeightsBarrier = 5;  // the 256 consumer threads (UP-side ids 1..4 unused here)
// Staging after the ring: 2 x 16 KB halves (one per consumer warpgroup), 2 headers, 2 x 128 weights.
inline constexpr size_t kGranDownStagingBytes = 2 * size_t(kStageHalfBytes) + 2 * 16 + 2 * 128 * sizeof(float);
static_assert(kGranDownStagingBytes % 16 == 0, "16-byte aligned");

#if EPMOE_SM90A_DEVICE
struct GranularDownItem {  // the item slot: first act row, column block, tokens (0: the end)
  int32_t row0, nb, n, pad;
};
struct StagedHalf {  // a staged half for the reducers: columns [col0, +128) of rows row_base + [0, rows)
  int32_t col0, row_base, rows, flag;  // flag 1: reduce, 0: nothing (still a phase), -1: the end
};

// The consumer side of one item with N tokens.
struct GranularDownConsumer {
  uint32_t full0, empty0, sA, sB, stg, staged, drained;
  StagedHalf* hdr;
  float* wts;  // [2][128]
  int c, warp, lane, hidden, flush_step;
  uint32_t it = 0, epi_round = 0, items = 0;
  uint32_t held[32];
  StagedHalf held_hdr{};

  // Stores the held token half (there is one exactly when epi_round is odd) once the reducers drained
  // the previous half.
  __device__ __forceinline__ void flush_held() {
    if ((epi_round & 1u) == 0) return;
    mbar_wait(drained, (epi_round - 1) & 1u);
    if ((threadIdx.x & 127) == 0) *hdr = held_hdr;
    if (held_hdr.flag > 0) store(held, held_hdr.rows);
    mbar_arrive(staged);
    ++epi_round;
  }
  // stmatrix.trans of packed words [(mb * 8 + g) * 2 + h] (tokens 8g + .., columns 64 mb + 16 warp + 8h
  // + ..) into the staging rows (token r at r * 256, chunk 8 mb + 2 warp + h, XOR r % 8).
  __device__ __forceinline__ void store(const uint32_t (&w)[32], int rows) const {
#pragma unroll
    for (int mb = 0; mb < 2; ++mb)
#pragma unroll
      for (int g = 0; g < 8; g += 2) {
        if (8 * g >= rows) break;  // rows is a multiple of 16: whole pairs of 8-token groups
        const uint32_t v[4] = {w[(mb * 8 + g) * 2], w[(mb * 8 + g) * 2 + 1], w[(mb * 8 + g + 1) * 2],
                               w[(mb * 8 + g + 1) * 2 + 1]};
        stmatrix_x4_trans(stg + stmatrix_trans_offset(g, mb, warp, lane, 256u), v);
      }
  }
  // Packs tokens [64 half, 64 half + 64) of the two column blocks, weighted.
  template <int N>
  __device__ __forceinline__ void pack(uint32_t (&w)[32], const float (&a0)[N / 2], const float (&a1)[N / 2],
                                       const float* wb, int half) const {
    const int q = lane & 3;
#pragma unroll
    for (int gl = 0; gl < 8; ++gl) {
      const int g = 8 * half + gl;
      if (g < N / 8) {
        const float w0 = wb[8 * g + 2 * q], w1 = wb[8 * g + 2 * q + 1];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          w[(0 * 8 + gl) * 2 + h] = pack_bf16x2(w0 * a0[4 * g + 2 * h], w1 * a0[4 * g + 2 * h + 1]);
          w[(1 * 8 + gl) * 2 + h] = pack_bf16x2(w0 * a1[4 * g + 2 * h], w1 * a1[4 * g + 2 * h + 1]);
        }
      }
    }
  }

  template <int N>
  __device__ __forceinline__ void item(const GranularDownItem& gi, const float* __restrict__ pair_weight, int num_k) {
    float a0[N / 2], a1[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; ++i) a0[i] = a1[i] = 0.0f;
    const int tt = int(threadIdx.x & 127);
    float wv = 0.0f;  // warpgroup 0: token tt's weight, loaded under the main loop, staged after it
    for (int kt = 0; kt < num_k; ++kt, ++it) {
      const uint32_t s = it % kStages;
      mbar_wait(full0 + 8 * s, (it / kStages) & 1u);
      const uint64_t dw0 = smem_desc_sw128(sB + s * kBTileBytes + uint32_t(c) * 16384u);
      const uint64_t dw1 = dw0 + (8192u >> 4);
      const uint64_t dt = smem_desc_sw128(sA + s * kATileBytes);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) {
        WgmmaN<N>::run(a0, dw0 + 2 * kk, dt + 2 * kk);
        WgmmaN<N>::run(a1, dw1 + 2 * kk, dt + 2 * kk);
      }
      wgmma_commit();
      if (kt == 0 && c == 0 && tt < N) wv = pair_weight[gi.row0 + tt];
      if (kt == flush_step) flush_held();
      if (kt > 0) {
        wgmma_wait<1>();
        release_stage<false>(empty0, 0u, (it - 1) % kStages, 1u);
      }
    }
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < N / 2; ++i) asm volatile("" : "+f"(a0[i]), "+f"(a1[i])::"memory");
    release_stage<false>(empty0, 0u, (it - 1) % kStages, 1u);
    flush_held();  // (a main loop of flush_step stages or fewer)

    float* wb = wts + 128 * (items & 1u);
    if (c == 0 && tt < N) wb[tt] = wv;
    named_barrier_sync(kGranWeightsBarrier, 256);
    const int col0 = gi.nb * 256 + 128 * c;
    const int32_t flag = col0 < hidden ? 1 : 0;  // hidden % 256 == 128: the last block's upper half is out
    uint32_t v[32];
    pack<N>(v, a0, a1, wb, 0);
    if (epi_round > 0) mbar_wait(drained, (epi_round - 1) & 1u);
    const int rows0 = N < 64 ? N : 64;
    if (tt == 0) *hdr = StagedHalf{col0, gi.row0, rows0, flag};
    if (flag > 0) store(v, rows0);
    mbar_arrive(staged);
    ++epi_round;
    // Tokens [64, N) stay packed until the next item's k step flush_step (an empty half is still a
    // phase, so both sides count the same halves).
    if constexpr (N > 64) pack<N>(held, a0, a1, wb, 1);
    held_hdr = StagedHalf{col0, gi.row0 + 64, N > 64 ? N - 64 : 0, N > 64 ? flag : 0};
    ++items;
  }
};
#endif

__global__ void __launch_bounds__(kThreads, 1)
    sm90_down_granular_kernel(const __grid_constant__ CUtensorMap tm_act, const __grid_constant__ CUtensorMap tm_w2,
                              const int64_t* __restrict__ padded_offsets, const int64_t* __restrict__ expert_counts,
                              const int32_t* __restrict__ pair_row, const float* __restrict__ pair_weight,
                              __nv_bfloat16* __restrict__ out, int experts, int hidden, int ffn,
                              int32_t* __restrict__ work_counters, int group_tiles, int flush_step, int claim_kt,
                              int by_expert) {
#if EPMOE_SM90A_DEVICE
  __shared__ __align__(8) uint64_t bars[2 * kStages];
  __shared__ __align__(16) GranularDownItem slots[kStages];
  __shared__ __align__(8) uint64_t epi_bars[4];  // staged[0..1], drained[0..1]
  extern __shared__ uint8_t dyn_smem[];
  uint8_t* ring = align_1024(dyn_smem);
  uint8_t* staging = ring + kStages * kStageBytes;
  StagedHalf* hdrs = reinterpret_cast<StagedHalf*>(staging + 2 * kStageHalfBytes);  // [2]
  float* wts = reinterpret_cast<float*>(staging + 2 * kStageHalfBytes + 2 * 16);    // [2][128]
  const uint32_t sA = smem_u32(ring);
  const uint32_t sB = sA + kStages * kATileBytes;
  const uint32_t full0 = smem_u32(&bars[0]), empty0 = smem_u32(&bars[kStages]);
  const uint32_t staged0 = smem_u32(&epi_bars[0]), drained0 = smem_u32(&epi_bars[2]);
  // By expert, the schedule's offsets follow the staging area (as in the 128-row kernel).
  int32_t* sched = by_expert ? reinterpret_cast<int32_t*>(staging + kGranDownStagingBytes) : nullptr;
  const WorkGrid grid =
      make_work_grid<false>((hidden + kBN - 1) / kBN, padded_offsets, experts, group_tiles, sched);
  if (threadIdx.x == 0) {
    for (int c = 0; c < 2; ++c) {
      mbar_init(staged0 + 8 * c, 128);
      mbar_init(drained0 + 8 * c, kReducerWarps * 32);
    }
  }
  init_ring_barriers<false>(full0, empty0, 1);  // full: thread 0's arrive.expect_tx (or its end marker)
  const int wg = warpgroup_index();
  const int num_k = ffn / kBK;

  if (wg == 0) {
    setmaxnreg_dec<kGranDownProducerRegs>();
    const int lane = int(threadIdx.x & 31);
    if (threadIdx.x < 32) {
      // ---------------- producer (warp 0; lane 0 issues) ----------------
      if (lane == 0) {
        tma_prefetch_desc(&tm_act);
        tma_prefetch_desc(&tm_w2);
      }
      int64_t w = __shfl_sync(0xffffffffu, lane == 0 ? atomicAdd(&work_counters[2], 1) : 0, 0);
      uint32_t it = 0;
      bool first = true;
      while (w < grid.items) {
        int32_t claimed = -1;  // the next item (lane 0), claimed at k step claim_kt of this one
        const WorkItem wi = work_item<false>(w, grid);
        const int e = wi.expert >= 0 ? wi.expert : expert_of_tile(padded_offsets, experts, wi.m0);
        const int64_t seg = padded_offsets[e];
        const int tiles = int((padded_offsets[e + 1] - seg) / kBM);
        int64_t row0;
        int n;
        granular_tile(seg, tiles, expert_counts[e], int((wi.m0 - seg) / kBM), row0, n);
        const GranularDownItem item{int32_t(row0), wi.nb, n, 0};
        const int n0 = wi.nb * kBN;
        if (lane == 0) {
          int kt = 0;
          if (first) {
            // W2 does not depend on the UP kernel: the first stages' weights before the PDL wait.
            const int npre = num_k < kStages ? num_k : kStages;
            slots[0] = item;
            for (int p = 0; p < npre; ++p) {
              mbar_arrive_expect_tx(full0 + 8 * p, kStageBytes);
              tma_load_3d(sB + p * kBTileBytes, &tm_w2, full0 + 8 * p, p * kBK, n0, e);
            }
            grid_dependency_wait();  // act is complete and visible from here on
            for (int p = 0; p < npre; ++p)
              tma_load_2d(sA + p * kATileBytes, &tm_act, full0 + 8 * p, p * kBK, int(row0));
            kt = npre;
            it = uint32_t(npre);
          }
          for (; kt < num_k; ++kt, ++it) {
            const uint32_t s = it % kStages;
            if (it >= uint32_t(kStages)) mbar_wait(empty0 + 8 * s, ((it / kStages) - 1) & 1u);
            const uint32_t full = full0 + 8 * s;
            if (kt == 0) slots[s] = item;
            mbar_arrive_expect_tx(full, kStageBytes);
            tma_load_2d(sA + s * kATileBytes, &tm_act, full, kt * kBK, int(row0));
            tma_load_3d(sB + s * kBTileBytes, &tm_w2, full, kt * kBK, n0, e);
            if (kt == claim_kt) claimed = atomicAdd(&work_counters[2], 1);
          }
          if (claimed < 0) claimed = atomicAdd(&work_counters[2], 1);  // (claim_kt among the first item's prefetched stages)
        }
        first = false;
        w = __shfl_sync(0xffffffffu, claimed, 0);
        it = __shfl_sync(0xffffffffu, it, 0);
      }
      if (lane == 0) {
        if (first) grid_dependency_wait();  // (no item: nothing to overlap)
        const uint32_t s = it % kStages;  // the end marker
        if (it >= uint32_t(kStages)) mbar_wait(empty0 + 8 * s, ((it / kStages) - 1) & 1u);
        slots[s] = GranularDownItem{0, 0, 0, 0};
        mbar_arrive(full0 + 8 * s);
        if (atomicAdd(&work_counters[3], 1) == int32_t(gridDim.x) - 1) {
          atomicExch(&work_counters[2], 0);
          atomicExch(&work_counters[3], 0);
        }
      }
    } else {
      // ---------------- reducers (warps 1..3): staged halves -> out ----------------
      grid_dependency_wait();  // out is written only after the UP grid (and the zeroing before it)
      const int rw = int(threadIdx.x / 32) - 1;
      const int j = lane & 15;
      for (uint32_t ph = 0;; ++ph) {
        bool end = false;
        for (int c = 0; c < 2; ++c) {
          mbar_wait(staged0 + 8 * c, ph & 1u);
          const StagedHalf hd = hdrs[c];
          if (hd.flag < 0) {
            end = true;
            continue;
          }
          if (hd.flag > 0) {
            const uint32_t stg = smem_u32(staging) + uint32_t(c) * kStageHalfBytes;
#pragma unroll 4
            for (int rp = rw; rp < 32; rp += kReducerWarps) {
              const int r = 2 * rp + (lane >> 4);
              if (r < hd.rows) {
                const int32_t orow = pair_row[hd.row_base + r];
                uint32_t v[4];
                ld_shared_16(stg + staged_chunk_offset(r, j, 256u), v);
                if (orow >= 0) red_add_bf16x8(out + int64_t(orow) * hidden + hd.col0 + 8 * j, v);
              }
            }
          }
          mbar_arrive(drained0 + 8 * c);  // every lane: its arrival releases its own reads
        }
        if (end) break;
      }
    }
  } else {
    // ---------------- consumers ----------------
    setmaxnreg_inc<kGranDownConsumerRegs>();
    GranularDownConsumer cs;
    cs.full0 = full0;
    cs.empty0 = empty0;
    cs.sA = sA;
    cs.sB = sB;
    cs.c = wg - 1;
    cs.stg = smem_u32(staging) + uint32_t(cs.c) * kStageHalfBytes;
    cs.staged = staged0 + 8 * uint32_t(cs.c);
    cs.drained = drained0 + 8 * uint32_t(cs.c);
    cs.hdr = hdrs + cs.c;
    cs.wts = wts;
    cs.warp = int(threadIdx.x / 32) & 3;
    cs.lane = int(threadIdx.x & 31);
    cs.hidden = hidden;
    cs.flush_step = flush_step;
    for (;;) {
      const uint32_t s0 = cs.it % kStages;
      mbar_wait(full0 + 8 * s0, (cs.it / kStages) & 1u);
      GranularDownItem gi = slots[s0];
      gi.n = warp_uniform_i32(gi.n);  // (uniform: it picks the k loop, whose descriptors then stay uniform)
      if (gi.n == 0) break;
      switch (gi.n) {
#define EPMOE_GRANULAR_DOWN_CASE(N) \
  case N:                           \
    cs.item<N>(gi, pair_weight, num_k); \
    break;
        EPMOE_GRANULAR_DOWN_CASE(16)
        EPMOE_GRANULAR_DOWN_CASE(32)
        EPMOE_GRANULAR_DOWN_CASE(48)
        EPMOE_GRANULAR_DOWN_CASE(64)
        EPMOE_GRANULAR_DOWN_CASE(80)
        EPMOE_GRANULAR_DOWN_CASE(96)
        EPMOE_GRANULAR_DOWN_CASE(112)
        EPMOE_GRANULAR_DOWN_CASE(128)
#undef EPMOE_GRANULAR_DOWN_CASE
        default:
          __trap();
      }
    }
    cs.flush_held();  // the last item's second token half
    // The end marker for the reducers (a phase of its own).
    if (cs.epi_round > 0) mbar_wait(cs.drained, (cs.epi_round - 1) & 1u);
    if ((threadIdx.x & 127) == 0) *cs.hdr = StagedHalf{0, 0, 0, -1};
    mbar_arrive(cs.staged);
    grid_launch_dependents();
  }
#else
  (void)padded_offsets, (void)expert_counts, (void)pair_row, (void)pair_weight, (void)out, (void)experts,
      (void)hidden, (void)ffn, (void)work_counters, (void)group_tiles, (void)flush_step, (void)claim_kt,
      (void)by_expert;
#endif
}

}  // namespace sm90

bool sm90_down_granular_launch(const ExpertProblem& p, cudaStream_t s, bool pdl) {
  using namespace sm90;
  if (p.expert_counts == nullptr || p.work_counters == nullptr || sm90_cluster_knob() > 0)
    return false;  // clusters asked for: the 128-row kernel's option
  check_expert_problem(p, "sm90_down_granular_launch");
  const CUtensorMap tm_act = make_matrix_map(p.act, p.rows_capacity, p.ffn, kBM);
  const CUtensorMap tm_w2 = make_w2_map(p.w2, p.experts, p.hidden, p.ffn, kBN);
  const int64_t tiles = (p.rows_capacity + kBM - 1) / kBM;
  const int64_t items = tiles * ((p.hidden + kBN - 1) / kBN);
  const bool by_expert = sm90_kernel_order_by_expert(p.experts, p.hidden, kGranDownStagingBytes);
  const size_t smem = sm90_dyn_smem_bytes(by_expert, p.experts, kGranDownStagingBytes);
  sm90_launch(sm90_down_granular_kernel, /*cluster=*/false, pdl, items, smem, s, "sm90_down_granular_launch", tm_act,
              tm_w2, p.padded_offsets, p.expert_counts, p.pair_row, p.pair_weight, p.out, p.experts, p.hidden, p.ffn,
              p.work_counters, sm90_group_tiles(), sm90_down_flush_step(p.ffn / kBK),
              sm90_granular_claim_kt(p.ffn / kBK), by_expert ? 1 : 0);
  return true;
}

}  // namespace epmoe::kernels
