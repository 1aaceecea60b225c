// DOWN projection of the sm_90a split pipeline, with the top-k reduction and the scatter to token
// order done by the memory system.
//   act[rows_capacity, ffn] bf16, w2[E, hidden, ffn] bf16, pair_row/pair_weight[rows_capacity]
//   -> out[pair_row[r], n] += bf16(pair_weight[r] * (act[r] . w2[e, n]))   (red.global.add bf16x2)
//
// Work item: rows [128*tile, +128) (one expert's segment tile) and output columns [256nb, +256),
// nb < ceil(hidden/256); K = ffn in steps of 64. Persistent grid and item order as in the UP kernel
// (WorkGrid); kCluster: pairs of tiles of one expert share W2 blocks, each CTA multicasting one
// 128-row half. A = act through a 2-D TMA map, B = W2 through a rank-3 map {ffn, hidden, E} (rows
// past `hidden` read as zero, so a last tile of 128 columns when hidden % 256 == 128 computes zeros
// that the epilogue skips). Same 384-thread producer / 2-consumer structure and 4-stage ring as the
// UP kernel. Epilogue (default, "staged"): each consumer warpgroup stores the weighted bf16 of its 64
// rows in two 128-column halves to shared memory with stmatrix - half 0 at once, half 1 from
// registers in the middle of the next item's main loop (flush_step) - and warps 1..3 of the
// producer warpgroup reduce the rows into out with 16-byte red.global.add.noftz.v4.bf16x2 (a half
// warp per 256-byte row) while the tensor cores work on (measured: 1.7-3.4% off the full layer).
// "direct" (EPMOE_SM90_DOWN_EPILOGUE): a quad transpose gives each consumer thread 8 consecutive
// columns, reduced from registers.
//
// PDL: the prologue (barrier init, work schedule, descriptor prefetch, the W2 loads of the first
// kStages stages of the CTA's first item) runs before griddepcontrol.wait, so it overlaps the UP
// grid's tail; the act loads are issued only after it. padded_offsets must therefore have been
// written before the UP kernel started (a layout output, as are pair_row and pair_weight, which the
// consumers load when an item's first stage arrives).
#include "kernels/cuda_check.cuh"
#include "kernels/sm90_common.cuh"
#include "kernels/sm90_down_staging.cuh"
#include "kernels/sm90_work_items.cuh"
#include "kernels/sm90_experts.cuh"
#include "kernels/sm90_launch_config.cuh"
#include "kernels/sm90_tensor_maps.cuh"

namespace epmoe::kernels {
namespace sm90 {

// Registers per thread after setmaxnreg: the staged epilogue's reducer warps spilled at 56 (ptxas),
// the consumers (accumulators + the held half) fit in 216 without spills.
inline constexpr uint32_t kDownProducerRegs = 64, kDownConsumerRegs = 216;
static_assert(setmaxnreg_split_fits(kDownProducerRegs, kDownConsumerRegs), "the consumers would wait forever in setmaxnreg.inc");

#if EPMOE_SM90A_DEVICE
// Thread 0's W2 loads of one stage (kBTileBytes into dst, completing on `full`): one 256-row box,
// or in the cluster variant (128-row map) both halves, or - in a multicasting pair - only this CTA's
// half (rows n0 + 128 rank), which also lands in the peer.
// When hidden % 256 == 128 the last block's upper half lies wholly past `hidden`: it is loaded from
// rows n0 again (full box bytes, columns the epilogue skips) rather than from a box entirely out of
// bounds.
template <bool kCluster>
__device__ __forceinline__ void load_w2_stage(const CUtensorMap* tm_w2, uint32_t full, uint32_t dst, int k0, int n0,
                                              int hidden, int e, bool multicast, uint32_t rank) {
  if constexpr (kCluster) {
    const int n1 = n0 + 128 < hidden ? n0 + 128 : n0;
    if (multicast) {
      tma_load_3d_multicast(dst + rank * (kBTileBytes / 2), tm_w2, full, k0, rank != 0 ? n1 : n0, e, uint16_t(0x3));
    } else {
      tma_load_3d(dst, tm_w2, full, k0, n0, e);
      tma_load_3d(dst + kBTileBytes / 2, tm_w2, full, k0, n1, e);
    }
  } else {
    tma_load_3d(dst, tm_w2, full, k0, n0, e);
  }
}

#endif

template <bool kCluster>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_down_kernel(const __grid_constant__ CUtensorMap tm_act, const __grid_constant__ CUtensorMap tm_w2,
                     const int64_t* __restrict__ padded_offsets, const int32_t* __restrict__ pair_row,
                     const float* __restrict__ pair_weight, __nv_bfloat16* __restrict__ out, int experts,
                     int hidden, int ffn, int group_tiles, int by_expert, int staged_epi, int tail_split,
                     int pad_halves, int flush_step, int early_decode, int split_ctas) {
#if EPMOE_SM90A_DEVICE
  __shared__ __align__(8) uint64_t bars[2 * kStages];  // full[0..S), empty[0..S)
  __shared__ int2 item_slots[kStages];                 // the producer's item hand-off (publish_item)
  __shared__ __align__(8) uint64_t epi_bars[4];        // staged[0..1], drained[0..1] (staged epilogue)
  extern __shared__ uint8_t dyn_smem[];

  uint8_t* ring = align_1024(dyn_smem);
  // After the ring: the staged epilogue's buffers (kDownStagingBytes), then - by expert - the work
  // schedule's offsets. Work items (see WorkItem in sm90_work_items.cuh): nn = ceil(hidden/256) column blocks.
  uint8_t* staging = ring + kStages * kStageBytes;
  int32_t* stage_rows = reinterpret_cast<int32_t*>(staging + 2 * kStageHalfBytes);  // [2][64] out rows
  int2* stage_hdr = reinterpret_cast<int2*>(stage_rows + 128);                        // [2] (n0, compute)
  int32_t* sched = by_expert ? reinterpret_cast<int32_t*>(staging + (staged_epi ? kDownStagingBytes : 0)) : nullptr;
  // Split DOWN (split_ctas > 0, by expert only): the experts the split rule sends to the 192-row DOWN,
  // queued next (PDL), get no items here; this grid releases it once thread 0 of every CTA has seen
  // the UP grid complete, since that kernel reads act without a wait of its own.
  const bool split = split_ctas > 0;
  const int nn_all = (hidden + kBN - 1) / kBN;
  const WorkGrid grid =
      make_work_grid<kCluster>(nn_all, padded_offsets, experts, group_tiles, sched,
                               tail_split != 0 ? work_stride<kCluster>() : 0,
                               split ? SplitRule{pair_row, nn_all, split_ctas} : SplitRule{});
  if (work_first<kCluster>() >= grid.items) {  // no work (in a cluster: both CTAs alike)
    if (split && threadIdx.x == 0) grid_dependency_wait();  // (see above: exiting releases the 192-row half)
    return;
  }

  const uint32_t sA = smem_u32(ring);                  // kStages x [128 rows][64] bf16 (act)
  const uint32_t sB = sA + kStages * kATileBytes;      // kStages x [256 rows][64] bf16 (W2)
  const uint32_t full0 = smem_u32(&bars[0]);
  const uint32_t empty0 = smem_u32(&bars[kStages]);

  const uint32_t staged0 = smem_u32(&epi_bars[0]), drained0 = smem_u32(&epi_bars[2]);
  if (threadIdx.x == 0) {  // before init_ring_barriers' fence and CTA (cluster) barrier
    for (int c = 0; c < 2; ++c) {
      mbar_init(staged0 + 8 * c, 128);
      mbar_init(drained0 + 8 * c, kReducerWarps * 32);
    }
  }
  init_ring_barriers<kCluster>(full0, empty0, 1);  // full: the producer's arrive.expect_tx

  const int wg = warpgroup_index();
  const int num_k = ffn / kBK;
  const int64_t stride = work_stride<kCluster>();
  // Ring accounting as in the UP kernel: use `it` (over all items) takes stage it % kStages, round
  // it / kStages.

  if (wg == 0) {
    // ---------------- producer ----------------
    setmaxnreg_dec<kDownProducerRegs>();
    if (threadIdx.x < 32) {
      if (threadIdx.x == 0) {
        tma_prefetch_desc(&tm_act);
        tma_prefetch_desc(&tm_w2);
      }
      uint32_t it = 0;
      bool first = true;
      // Padding halves as in the UP kernel: each item's flag row is loaded an item ahead.
      const int32_t* pad_pair_row = pad_halves != 0 ? pair_row : nullptr;
      ItemWalk<kCluster> walk(grid, pad_pair_row);
      const int npre = num_k < kStages ? num_k : kStages;  // the first item's uses 0..npre-1: no empty waits
      // Thread 0, the CTA's first item: weights do not depend on the UP kernel, so the first stages'
      // B halves are loaded before the PDL wait. Each stage's barrier expects both halves' bytes, so
      // it cannot complete before the act half lands too.
      auto arm_first_stages = [&](const WorkItem& wi, int n0, int e, bool multicast) {
        publish_item(item_slots, 0, wi);
        for (int p = 0; p < npre; ++p) {
          mbar_arrive_expect_tx(full0 + 8 * p, kStageBytes);
          load_w2_stage<kCluster>(&tm_w2, full0 + 8 * p, sB + p * kBTileBytes, p * kBK, n0, hidden, e, multicast,
                                  grid.rank);
        }
        grid_dependency_wait();  // act is complete and visible from here on
        if (split) grid_launch_dependents();  // the 192-row half may start (see above)
        for (int p = 0; p < npre; ++p)
          tma_load_2d(sA + p * kATileBytes, &tm_act, full0 + 8 * p, p * kBK, int(wi.load_m0));
      };
      // Thread 0: use `u` of the ring = k step kt of item wi, once the consumers released its stage.
      auto issue_stage = [&](uint32_t u, int kt, const WorkItem& wi, int n0, int e, bool multicast) {
        uint32_t full;
        const uint32_t s = arm_stage(u, kt, wi, full0, empty0, item_slots, kStageBytes, full);
        tma_load_2d(sA + s * kATileBytes, &tm_act, full, kt * kBK, int(wi.load_m0));
        load_w2_stage<kCluster>(&tm_w2, full, sB + s * kBTileBytes, kt * kBK, n0, hidden, e, multicast, grid.rank);
      };
      if ((early_decode & 1) != 0) {
        // EPMOE_SM90_EARLY_DECODE bit 0 (opt-in): the whole warp walks the stages (thread 0 waits and
        // issues) and decodes the next item right after this item's first stage is issued, in the
        // slack of the empty waits, instead of between an item's last stage and the next one's first
        // (measured: the decode took 1.3k cycles (global order) - 2.4k (by expert) per item there).
        bool mc_next;
        int e_next = work_expert<kCluster>(padded_offsets, experts, walk.cur, grid, mc_next);  // whole warp
        auto decode_next = [&]() {
          __syncwarp();
          walk.fetch_next();
          e_next = work_expert<kCluster>(padded_offsets, experts, walk.next, grid, mc_next);  // whole warp
        };
        for (; walk.cur.valid; walk.advance()) {
          const WorkItem& wi = walk.cur;
          const int n0 = wi.nb * kBN, e = e_next;
          const bool multicast = mc_next;
          int kt = 0;
          if (first) {
            if (threadIdx.x == 0) arm_first_stages(wi, n0, e, multicast);
            kt = npre;
            it = uint32_t(npre);
            first = false;
          }
          bool pending = true;  // the next item is still to decode
          for (; kt < num_k; ++kt, ++it) {
            if (threadIdx.x == 0) issue_stage(it, kt, wi, n0, e, multicast);
            if (pending) {
              pending = false;
              decode_next();
            }
          }
          if (pending) decode_next();  // (a first item of npre == num_k stages)
          __syncwarp();
        }
      } else {
        for (; walk.cur.valid; walk.advance()) {
          const WorkItem& wi = walk.cur;
          walk.fetch_next();
          const int n0 = wi.nb * kBN;
          bool multicast;
          const int e = work_expert<kCluster>(padded_offsets, experts, wi, grid, multicast);  // whole warp
          if (threadIdx.x == 0) {
            int kt = 0;
            if (first) {
              arm_first_stages(wi, n0, e, multicast);
              kt = npre;
              it = uint32_t(npre);
              first = false;
            }
            for (; kt < num_k; ++kt, ++it) issue_stage(it, kt, wi, n0, e, multicast);
          }
        }
      }
    } else if (staged_epi) {
      // ---------------- reducers (warps 1..3): staged halves -> out ----------------
      grid_dependency_wait();  // out is written only after the UP grid (and the zeroing before it)
      const int rw = int(threadIdx.x / 32) - 1;  // 0 .. kReducerWarps-1
      const int lane = int(threadIdx.x & 31);
      const int j = lane & 15;  // 16-byte chunk of the row
      uint32_t ph = 0;          // phases of staged[c] / drained[c] used so far (same for both c)
      for (int64_t w = work_first<kCluster>(); w < grid.items; w += stride) {
        for (int half = 0; half < 2; ++half, ++ph) {
          for (int c = 0; c < 2; ++c) {
            mbar_wait(staged0 + 8 * c, ph & 1u);
            const int2 hd = stage_hdr[c];
            const int col0 = hd.x + 128 * half;
            if (hd.y != 0 && col0 < hidden) {  // (hidden % 256 == 128: the last block's upper half is out)
              const uint32_t stg = smem_u32(staging) + uint32_t(c) * kStageHalfBytes;
#pragma unroll 4
              for (int rp = rw; rp < 32; rp += kReducerWarps) {  // row pairs: a half warp per row
                const int r = 2 * rp + (lane >> 4);
                const int32_t orow = stage_rows[64 * c + r];
                uint32_t v[4];
                ld_shared_16(stg + staged_half_offset(r, j), v);
                if (orow >= 0) red_add_bf16x8(out + int64_t(orow) * hidden + col0 + 8 * j, v);
              }
            }
            mbar_arrive(drained0 + 8 * c);  // every lane: its arrival releases its own reads
          }
        }
      }
    }
  } else {
    // ---------------- consumers ----------------
    setmaxnreg_inc<kDownConsumerRegs>();
    const int c = wg - 1;  // rows [64c, 64c + 64) of each tile
    const int warp = int(threadIdx.x / 32) & 3;
    const int lane = int(threadIdx.x & 31);
    const int q = lane & 3;
    const uint32_t a_off = uint32_t(c) * 64 * 128;
    const uint32_t peer_empty0 = kCluster ? mapa_shared(empty0, grid.rank ^ 1u) : 0u;
    auto release = [&](uint32_t s, uint32_t n) { release_stage<kCluster>(empty0, peer_empty0, s, n); };

    uint32_t it = 0;
    uint32_t epi_round = 0;  // staged halves handed to the reducers so far
    const uint32_t stg = smem_u32(staging) + uint32_t(c) * kStageHalfBytes;
    uint32_t held[32];        // the previous item's half 1, packed (staged epilogue)
    bool held_compute = false;
    // Stores the held half (there is one exactly when epi_round is odd: half 0 of its item went out)
    // once the reducers have drained the one before it.
    auto flush_held = [&]() {
      if ((epi_round & 1u) == 0) return;
      mbar_wait(drained0 + 8 * c, (epi_round - 1) & 1u);
      if (held_compute) store_half(stg, held, warp, lane);
      mbar_arrive(staged0 + 8 * c);
      ++epi_round;
    };
    for (int64_t w = work_first<kCluster>(); w < grid.items; w += stride) {
      // This thread's two output rows (tile rows 64c + 16warp + lane/4, +8) and weights, loaded when
      // the item's first stage arrives; their latency hides under the main loop (the layout was
      // complete before the UP kernel started).
      int32_t prow[2] = {-1, -1};
      float pw[2] = {0.0f, 0.0f};
      float acc[128];
      const ItemView iv =
          consume_item(acc, it, num_k, full0, sA, sB, a_off, /*proxy_fence=*/false, c, item_slots, release,
                       [&](const ItemView& first) {
                         if (!first.compute || first.idle(c)) return;
                         const int64_t row0 = first.m0 + c * 64 + warp * 16 + (lane >> 2);
#pragma unroll
                         for (int h = 0; h < 2; ++h) {
                           prow[h] = pair_row[row0 + 8 * h];
                           pw[h] = pair_weight[row0 + 8 * h];
                         }
                       },
                       [&](int kt) {
                         if (kt == flush_step) flush_held();
                       });
      flush_held();  // (a main loop of flush_step stages or fewer)
      // Nothing to reduce: a cluster rank without a tile, or the other warpgroup's half item.
      const bool mine = iv.compute && !iv.idle(c);
      if (staged_epi) {
        // Half 0 goes to the staging buffer now (after the reducers have read the previous half);
        // half 1 stays packed in registers and is stored at the next item's k step flush_step (or
        // after its main loop, or after the last item), once the reducers have drained half 0.
        // Also for a cluster's idle item (flagged in the header) so both sides walk the same phases.
        if (epi_round > 0) mbar_wait(drained0 + 8 * c, (epi_round - 1) & 1u);
        if (q == 0) {
          stage_rows[64 * c + 16 * warp + (lane >> 2)] = prow[0];
          stage_rows[64 * c + 16 * warp + (lane >> 2) + 8] = prow[1];
        }
        if ((threadIdx.x & 127) == 0) stage_hdr[c] = make_int2(iv.nb * kBN, mine ? 1 : 0);
        if (mine) {
          uint32_t v[32];
          pack_half(v, acc, 0, pw[0], pw[1]);
          store_half(stg, v, warp, lane);
          pack_half(held, acc, 1, pw[0], pw[1]);
        }
        held_compute = mine;
        mbar_arrive(staged0 + 8 * c);
        ++epi_round;
        continue;
      }
      if (!mine) continue;
      const int n0 = iv.nb * kBN;

      // ---------------- epilogue: weighted bf16 reduction into out, 16 bytes per red ----------------
      grid_dependency_wait();  // (already satisfied: the producer waited before any act load)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int32_t r = prow[h];
        const float wt = pw[h];
        __nv_bfloat16* dst = out + int64_t(r < 0 ? 0 : r) * int64_t(hidden) + n0 + 8 * q;
#pragma unroll
        for (int gi = 0; gi < 8; ++gi) {  // 32-column blocks; hidden % 32 == 0: a block is all in or out
          if (n0 + 32 * gi < hidden) {    // uniform over the CTA
            uint32_t wd[4];
#pragma unroll
            for (int t = 0; t < 4; ++t) {
              const int g = 4 * gi + t;
              wd[t] = pack_bf16x2(wt * acc[4 * g + 2 * h], wt * acc[4 * g + 2 * h + 1]);
            }
            quad_transpose(wd, q);  // lane q: all 8 columns of group 4gi + q
            if (r >= 0) red_add_bf16x8(dst + 32 * gi, wd);
          }
        }
      }
    }
    flush_held();  // the last item's half 1
    grid_launch_dependents();
  }
  if constexpr (kCluster) cluster_sync();  // as in the UP kernel
#else
  (void)padded_offsets, (void)pair_row, (void)pair_weight, (void)out, (void)experts, (void)hidden, (void)ffn,
      (void)group_tiles, (void)by_expert, (void)staged_epi, (void)tail_split, (void)pad_halves, (void)flush_step,
      (void)early_decode, (void)split_ctas;
#endif
}

}  // namespace sm90

void sm90_down_launch(const ExpertProblem& p, cudaStream_t s, bool pdl) {
  using namespace sm90;
  check_expert_problem(p, "sm90_down_launch");
  if (sm90_down_tall_launch(p, s, pdl)) return;
  if (sm90_down_granular() && sm90_down_granular_launch(p, s, pdl)) return;
  const bool cluster = sm90_down_uses_cluster(p.hidden, p.rows_capacity, p.experts);
  const CUtensorMap tm_act = make_matrix_map(p.act, p.rows_capacity, p.ffn, kBM);
  // The cluster variant loads W2 in 128-row halves (one per CTA of a multicasting pair).
  const CUtensorMap tm_w2 = make_w2_map(p.w2, p.experts, p.hidden, p.ffn, cluster ? kBN / 2 : kBN);
  const int64_t tiles = (p.rows_capacity + kBM - 1) / kBM;
  const int nn = (p.hidden + kBN - 1) / kBN;
  const bool staged = sm90_down_staged_epilogue();
  const Sm90LaunchPlan plan = sm90_launch_plan(tiles, p.experts, p.hidden, nn, cluster, staged ? kDownStagingBytes : 0);
  const bool pad_halves = sm90_skip_pad_halves(tiles, p.experts, p.ffn, plan.items, cluster);
  // Split DOWN (EPMOE_SM90_DOWN_ROWS=split): by expert only, where the 192-row DOWN can run.
  const bool split = sm90_down_split() && plan.by_expert && sm90_down_tall_split_ready(p);
  const int split_ctas = split ? sm90_up_split_ctas() : 0;
  sm90_launch(cluster ? sm90_down_kernel<true> : sm90_down_kernel<false>, cluster, pdl, plan.items, plan.smem, s,
              "sm90_down_launch", tm_act, tm_w2, p.padded_offsets, p.pair_row, p.pair_weight, p.out, p.experts,
              p.hidden, p.ffn, sm90_group_tiles(), plan.by_expert ? 1 : 0, staged ? 1 : 0,
              sm90_tail_split_in(plan.by_expert, sm90_tail_split()) ? 1 : 0, pad_halves ? 1 : 0,
              sm90_down_flush_step(p.ffn / kBK), sm90_early_decode(), split_ctas);
  if (split) sm90_down_tall_split_launch(p, s, split_ctas);
}

void sm90_experts_launch(const ExpertProblem& p, cudaStream_t s) {
  sm90_up_launch(p, s);
  sm90_down_launch(p, s, /*pdl=*/true);
}

}  // namespace epmoe::kernels
