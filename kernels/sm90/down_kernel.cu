// The 128-row DOWN: projection with the top-k reduction and the scatter to token order done by the
// memory system.
//   act[rows_capacity, ffn] bf16, w2[E, hidden, ffn] bf16, pair_row/pair_weight[rows_capacity]
//   -> out[pair_row[r], n] += bf16(pair_weight[r] * (act[r] . w2[e, n]))   (red.global.add bf16x2)
//
// Work item: rows [128 tile, +128) of one expert's segment and output columns [256nb, +256),
// nb < ceil(hidden / 256); K = ffn in steps of 64. Persistent grid and item order as in the UP
// kernels (work_items.cuh); kCluster: pairs of tiles of one expert share W2 blocks, each CTA
// multicasting one 128-row half. A = act through a 2-D TMA map, B = W2 through a rank-3 map {ffn,
// hidden, E} (rows past `hidden` read as zero, so a last block of 128 columns when hidden % 256 ==
// 128 computes zeros that the epilogue skips).
//
// Warpgroup 0: warp 0 produces (lane 0 issues act's and W2's boxes; the whole warp decodes the next
// item right after the current item's first stage is issued, in the slack of the empty waits), warps
// 1..3 reduce. Warpgroups 1 and 2 consume: the core's mainloop on Tile128, then the staged epilogue -
// each warpgroup stores the weighted bf16 of its 64 rows in two 128-column halves to shared memory
// with stmatrix, half 0 at once and half 1 from registers in the middle of the next item's k loop
// (k step num_k / 2), and the reducer warps add the rows into out with 16-byte red.global.add while
// the tensor cores work on (1.7-3.4% off the full layer against reducing from registers).
//
// PDL: the prologue (barriers, schedule, descriptor prefetch, the W2 loads of the first stages of the
// CTA's first item) runs before griddepcontrol.wait, so it overlaps the UP grid's tail; act is loaded
// only after it. padded_offsets, pair_row and pair_weight must therefore be complete before UP starts
// (layout outputs).
#include "kernels/sm90/core/kernel.cuh"
#include "kernels/sm90/core/mainloop.cuh"
#include "kernels/sm90/core/ring.cuh"
#include "kernels/sm90/down_staging.cuh"
#include "kernels/sm90/launch.cuh"
#include "kernels/sm90/tensor_maps.cuh"
#include "kernels/sm90/work_items.cuh"

namespace epmoe::kernels::sm90 {

// Registers after setmaxnreg: the reducer warps spilled at 56; the consumers (accumulators + the held
// half) fit in 216 without spills.
inline constexpr uint32_t kDownProducerRegs = 64, kDownConsumerRegs = 216;

#if EPMOE_SM90A_DEVICE
// Thread 0's W2 loads of one stage (kBTileBytes into dst, completing on `full`): one 256-row box, or
// in the cluster form (128-row map) both halves, or - in a multicasting pair - only this CTA's half
// (rows n0 + 128 rank), which also lands in the peer. When hidden % 256 == 128 the last block's upper
// half lies wholly past `hidden`: it is loaded from rows n0 again (full box bytes, columns the
// epilogue skips) rather than from a box entirely out of bounds.
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
                     int hidden, int ffn, int by_expert, int tail_split, int pad_halves, int split_ctas,
                     int store_pairs) {
#if EPMOE_SM90A_DEVICE
  __shared__ __align__(8) uint64_t bars[2 * kStages];  // full[0..S), empty[0..S)
  __shared__ int2 item_slots[kStages];                 // the producer's item hand-off (publish_item)
  __shared__ __align__(8) uint64_t epi_bars[4];        // staged[0..1], drained[0..1]
  extern __shared__ uint8_t dyn_smem[];

  // Dynamic shared memory: the ring, the staged epilogue's buffers (kDownStagingBytes), then - by
  // expert - the schedule's offsets.
  uint8_t* ring_mem = align_1024(dyn_smem);
  uint8_t* staging = ring_mem + kStages * kStageBytes;
  int32_t* stage_rows = reinterpret_cast<int32_t*>(staging + 2 * kStageHalfBytes);  // [2][64] out rows
  int2* stage_hdr = reinterpret_cast<int2*>(stage_rows + 128);                        // [2] (n0, compute)
  int32_t* sched = by_expert ? reinterpret_cast<int32_t*>(staging + kDownStagingBytes) : nullptr;
  // Split (split_ctas > 0, by expert only): the experts the split rule sends to the 192-row DOWN,
  // queued next (PDL), get no items here; this grid releases it once thread 0 of every CTA has seen
  // the UP grid complete, since that kernel reads act without a wait of its own.
  const bool split = split_ctas > 0;
  const int nn_all = (hidden + kBN - 1) / kBN;
  const WorkGrid grid =
      make_work_grid<kCluster>(nn_all, padded_offsets, experts, kGroupTiles, sched,
                               tail_split != 0 ? work_stride<kCluster>() : 0,
                               split ? SplitRule{pair_row, nn_all, split_ctas} : SplitRule{});
  if (work_first<kCluster>() >= grid.items) {  // no work (in a cluster: both CTAs alike)
    if (split && threadIdx.x == 0) grid_dependency_wait();  // (see above: exiting releases the 192-row half)
    return;
  }

  const uint32_t sA = smem_u32(ring_mem);              // kStages x [128 rows][64] bf16 (act)
  const uint32_t sB = sA + kStages * kATileBytes;      // kStages x [256 rows][64] bf16 (W2)
  const Ring<kStages> ring{smem_u32(&bars[0]), smem_u32(&bars[kStages])};
  const uint32_t staged0 = smem_u32(&epi_bars[0]), drained0 = smem_u32(&epi_bars[2]);
  if (threadIdx.x == 0) {  // before init_ring_barriers' fence and CTA (cluster) barrier
    for (int c = 0; c < 2; ++c) {
      mbar_init(staged0 + 8 * c, 128);
      mbar_init(drained0 + 8 * c, kReducerWarps * 32);
    }
  }
  init_ring_barriers<kCluster>(ring, 1);  // full: the producer's arrive.expect_tx
  const int num_k = ceil_div(ffn, kBK);  // act's and W2's columns past ffn read as zeros
  const int flush_step = num_k / 2;  // the reducers get about half an item for each half
  const int64_t stride = work_stride<kCluster>();

  run_warp_roles<kDownProducerRegs, kDownConsumerRegs>(
      [&] {
        if (threadIdx.x < 32) {
          // ---------------- producer (warp 0) ----------------
          if (threadIdx.x == 0) {
            tma_prefetch_desc(&tm_act);
            tma_prefetch_desc(&tm_w2);
          }
          // Padding halves as in the UP kernel: each item's flag row is loaded an item ahead.
          ItemWalk<kCluster> walk(grid, pad_halves != 0 ? pair_row : nullptr);
          const int npre = num_k < kStages ? num_k : kStages;  // the first item's uses 0..npre-1: no empty waits
          // Thread 0, the CTA's first item: weights do not depend on the UP kernel, so the first stages'
          // B halves are loaded before the PDL wait. Each stage's barrier expects both halves' bytes, so
          // it cannot complete before the act half lands too.
          auto arm_first_stages = [&](const WorkItem& wi, int n0, int e, bool multicast) {
            publish_item(item_slots, 0, wi);
            for (int st = 0; st < npre; ++st) {
              mbar_arrive_expect_tx(ring.full(uint32_t(st)), kStageBytes);
              load_w2_stage<kCluster>(&tm_w2, ring.full(uint32_t(st)), sB + st * kBTileBytes, st * kBK, n0, hidden, e,
                                      multicast, grid.rank);
            }
            grid_dependency_wait();  // act is complete and visible from here on
            if (split) grid_launch_dependents();  // the 192-row half may start (see above)
            for (int st = 0; st < npre; ++st)
              tma_load_2d(sA + st * kATileBytes, &tm_act, ring.full(uint32_t(st)), st * kBK, int(wi.load_m0));
          };
          // Thread 0: the cursor's use = k step kt of item wi, once the consumers released its stage.
          auto issue_stage = [&](const RingCursor<kStages>& cur, int kt, const WorkItem& wi, int n0, int e,
                                 bool multicast) {
            uint32_t full;
            const uint32_t s = arm_stage(cur, kt, wi, ring, item_slots, kStageBytes, full);
            tma_load_2d(sA + s * kATileBytes, &tm_act, full, kt * kBK, int(wi.load_m0));
            load_w2_stage<kCluster>(&tm_w2, full, sB + s * kBTileBytes, kt * kBK, n0, hidden, e, multicast, grid.rank);
          };
          // The whole warp walks the stages (thread 0 waits and issues) and decodes the next item right
          // after this item's first stage is issued (the decode took 1.3k-2.4k cycles per item between
          // two items' stages).
          bool mc_next;
          int e_next = work_expert<kCluster>(padded_offsets, experts, walk.cur, grid, mc_next);  // whole warp
          auto decode_next = [&]() {
            __syncwarp();
            walk.fetch_next();
            e_next = work_expert<kCluster>(padded_offsets, experts, walk.next, grid, mc_next);  // whole warp
          };
          RingCursor<kStages> cur;
          bool first = true;
          for (; walk.cur.valid; walk.advance()) {
            const WorkItem& wi = walk.cur;
            const int n0 = wi.nb * kBN, e = e_next;
            const bool multicast = mc_next;
            int kt = 0;
            if (first) {
              if (threadIdx.x == 0) arm_first_stages(wi, n0, e, multicast);
              kt = npre;
              cur.advance(uint32_t(npre));
              first = false;
            }
            bool pending = true;  // the next item is still to decode
            for (; kt < num_k; ++kt, cur.advance()) {
              if (threadIdx.x == 0) issue_stage(cur, kt, wi, n0, e, multicast);
              if (pending) {
                pending = false;
                decode_next();
              }
            }
            if (pending) decode_next();  // (a first item of npre == num_k stages)
            __syncwarp();
          }
        } else {
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
                    if (orow < 0 || col0 + 8 * j >= hidden) continue;
                    __nv_bfloat16* dst = out + int64_t(orow) * hidden + col0 + 8 * j;
                    if (store_pairs) st_global_16(dst, v);
                    else red_add_bf16x8(dst, v);
                  }
                }
                mbar_arrive(drained0 + 8 * c);  // every lane: its arrival releases its own reads
              }
            }
          }
        }
      },
      [&](int c) {
        // ---------------- consumers: rows [64c, +64) of each tile ----------------
        const int warp = int(threadIdx.x / 32) & 3, lane = int(threadIdx.x & 31);
        const uint32_t peer_empty0 = kCluster ? mapa_shared(ring.empty0, grid.rank ^ 1u) : 0u;
        auto release = [&](uint32_t s, uint32_t n) { release_stage<kCluster>(ring.empty0, peer_empty0, s, n); };
        const Tile128::Descs descs = Tile128::descs(sA, sB, uint32_t(c) * 64 * 128);
        RingCursor<kStages> cur;
        uint32_t epi_round = 0;  // staged halves handed to the reducers so far
        const uint32_t stg = smem_u32(staging) + uint32_t(c) * kStageHalfBytes;
        uint32_t held[32];  // the previous item's half 1, packed
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
          // This thread's two output rows (tile rows 64c + 16warp + lane/4, +8) and weights, loaded once
          // the item's first stage is issued; their latency hides under the k loop.
          int32_t prow[2] = {-1, -1};
          float pw[2] = {0.0f, 0.0f};
          Tile128::Acc acc;
          const ItemView iv = consume_item(acc, cur, num_k, ring.full0, descs, /*proxy_fence=*/false, c, item_slots,
                                           release, [&](const ItemView& item, int kt) {
                                             if (kt == flush_step) flush_held();
                                             if (kt != 0 || !item.compute || item.idle(c)) return;
                                             const int64_t row0 = item.m0 + c * 64 + warp * 16 + (lane >> 2);
#pragma unroll
                                             for (int h = 0; h < 2; ++h) {
                                               // (store_pairs: the pair's own row of pair_out)
                                               prow[h] = pair_row[row0 + 8 * h];
                                               if (store_pairs && prow[h] >= 0) prow[h] = int32_t(row0 + 8 * h);
                                               pw[h] = pair_weight[row0 + 8 * h];
                                             }
                                           });
          flush_held();  // (a k loop of flush_step stages or fewer)
          // Nothing to reduce: a cluster rank without a tile, or the other warpgroup's half item. Half 0
          // goes to the staging buffer now (after the reducers have read the previous half); half 1 stays
          // packed in registers until the next item's k step flush_step (or the end), once the reducers
          // have drained half 0. Also for an idle item (flagged in the header) so both sides walk the
          // same phases.
          const bool mine = iv.compute && !iv.idle(c);
          if (epi_round > 0) mbar_wait(drained0 + 8 * c, (epi_round - 1) & 1u);
          if ((lane & 3) == 0) {
            stage_rows[64 * c + 16 * warp + (lane >> 2)] = prow[0];
            stage_rows[64 * c + 16 * warp + (lane >> 2) + 8] = prow[1];
          }
          if ((threadIdx.x & 127) == 0) stage_hdr[c] = make_int2(iv.nb * kBN, mine ? 1 : 0);
          if (mine) {
            uint32_t v[32];
            pack_half(v, acc.d, 0, pw[0], pw[1]);
            store_half(stg, v, warp, lane);
            pack_half(held, acc.d, 1, pw[0], pw[1]);
          }
          held_compute = mine;
          mbar_arrive(staged0 + 8 * c);
          ++epi_round;
        }
        flush_held();  // the last item's half 1
        grid_launch_dependents();
      });
  if constexpr (kCluster) cluster_sync();  // as in the UP kernel
#else
  (void)padded_offsets, (void)pair_row, (void)pair_weight, (void)out, (void)experts, (void)hidden, (void)ffn,
      (void)by_expert, (void)tail_split, (void)pad_halves, (void)split_ctas, (void)store_pairs;
#endif
}

void launch_down_kernel(const ExpertProblem& p, const Sm90Plan& plan, int split_ctas, bool pdl, cudaStream_t s) {
  const bool cluster = plan.down_cluster;
  const bool by_expert = plan.down_order == Sm90Order::by_expert;
  const CUtensorMap tm_act = make_matrix_map(p.act, p.rows_capacity, p.ffn, kBM);
  // The cluster form loads W2 in 128-row halves (one per CTA of a multicasting pair).
  const CUtensorMap tm_w2 = make_w2_map(p.w2, p.experts, p.hidden, p.ffn, cluster ? kBN / 2 : kBN);
  const int64_t tiles = (p.rows_capacity + kBM - 1) / kBM;
  const int64_t items = sm90_work_items(tiles, p.experts, (p.hidden + kBN - 1) / kBN, cluster, by_expert);
  const size_t smem = dyn_smem_bytes(by_expert, p.experts, kDownStagingBytes);
  sm90_launch(cluster ? sm90_down_kernel<true> : sm90_down_kernel<false>, cluster, pdl, items, smem, s,
              "sm90_down_kernel", tm_act, tm_w2, p.padded_offsets, p.pair_row, p.pair_weight,
              p.pair_out ? p.pair_out : p.out, p.experts, p.hidden, p.ffn, by_expert ? 1 : 0, plan.tail_split ? 1 : 0,
              plan.down_pad_halves ? 1 : 0, split_ctas, p.pair_out ? 1 : 0);
}

}  // namespace epmoe::kernels::sm90
