// The 128-row UP: projection + SwiGLU, gathering its rows from the token-ordered input.
//   x[x_rows, hidden] bf16 (rows pair_row[r]), w1[E, 2*ffn, hidden] bf16 -> act[rows_capacity, ffn] bf16
//   act[r, c] = bf16(silu(g) * u), g = x[pair_row[r]] . w1[e, c], u = x[pair_row[r]] . w1[e, ffn + c]
// (zero rows where pair_row[r] < 0: the segments' padding). Sm90UpForm::single and ::cluster; the
// form for ffn % 256 == 0 is up_pair_kernel.cu. With store_h (a saving forward, ExpertProblem::preact)
// also h[r] = bf16([g | u]) into preact[rows_capacity, 2 ffn].
//
// Work item: rows [128 tile, +128) of one expert's segment (segments are multiples of 128) and act
// columns [128j, +128). Persistent grid (one CTA per SM, or one 2-CTA cluster per SM pair) walking
// the items in the plan's order (work_items.cuh); the ring runs on across items, so the producer fills
// the next item's stages during the epilogue. kCluster: the two CTAs of a cluster take consecutive
// tiles and, when both are in one expert, each multicasts one W1 half into both rings.
//
// Warpgroup 0 produces: all 128 threads gather the A tile with cp.async (RowGather<128, 1, 8>, each
// stage's copies signalling its full barrier as they land), thread 0 issues W1's box (load_w1_stage)
// and publishes the item. Warpgroups 1 and 2 consume: the core's mainloop on Tile128, then SwiGLU in
// registers and the staged TMA store of act (store_act_staged), which runs on under the next item.
// PDL dependents (DOWN) are released as soon as the CTA starts; DOWN reads act only after its
// griddepcontrol.wait, i.e. after this grid completed.
//
// Registers: producer 104 (the gathering producer holds two items' 8 row pointers and their decode;
// it spilled at 56..96), consumers 200.
#include "kernels/sm90/core/gather.cuh"
#include "kernels/sm90/core/kernel.cuh"
#include "kernels/sm90/core/mainloop.cuh"
#include "kernels/sm90/core/ring.cuh"
#include "kernels/sm90/launch.cuh"
#include "kernels/sm90/tensor_maps.cuh"
#include "kernels/sm90/up_common.cuh"
#include "kernels/sm90/work_items.cuh"
#include "kernels/sm90/zero_out.cuh"

namespace epmoe::kernels::sm90 {

inline constexpr uint32_t kUpProducerRegs = 104, kUpConsumerRegs = 200;
inline constexpr int kUpGatherThreads = 128;

template <bool kCluster>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_up_kernel(const __grid_constant__ CUtensorMap tm_w1, const __grid_constant__ CUtensorMap tm_act,
                   const __grid_constant__ CUtensorMap tm_h, int store_h,
                   const int64_t* __restrict__ padded_offsets, int experts, int hidden, int ffn, int w1_folded,
                   const __nv_bfloat16* __restrict__ x, int64_t x_rows, const int32_t* __restrict__ pair_row,
                   int by_expert, int tail_split, int pad_halves, int split_ctas, __nv_bfloat16* __restrict__ zero_out,
                   int64_t zero_chunks) {
#if EPMOE_SM90A_DEVICE
  __shared__ __align__(8) uint64_t bars[2 * kStages];  // full[0..S), empty[0..S)
  __shared__ int2 item_slots[kStages];                 // the producer's item hand-off (publish_item)
  extern __shared__ uint8_t dyn_smem[];

  // Dynamic shared memory: the ring, the act staging boxes, then (by expert) the schedule's offsets.
  uint8_t* ring_mem = align_1024(dyn_smem);
  uint8_t* staging = ring_mem + kStages * kStageBytes;
  int32_t* sched = by_expert ? reinterpret_cast<int32_t*>(staging + kUpStagingBytes) : nullptr;
  const WorkGrid grid = make_work_grid<kCluster>(ceil_div(ffn, 128), padded_offsets, experts, kGroupTiles, sched,
                                                 tail_split != 0 ? work_stride<kCluster>() : 0,
                                                 split_rule(pair_row, ffn, split_ctas));  // (by expert only)
  ZeroPlan zero = make_zero_plan<kCluster>(zero_out, zero_chunks, grid.items);
  // No work: the whole CTA zeroes its share of out and leaves (in a cluster both CTAs alike, before
  // any cross-CTA traffic).
  if (work_first<kCluster>() >= grid.items) {
    zero_step(zero, zero.end - zero.next, int(threadIdx.x), kThreads);
    return;
  }
  grid_launch_dependents();

  const uint32_t sA = smem_u32(ring_mem);               // kStages x [128 rows][64] bf16, swizzled
  const uint32_t sB = sA + kStages * kATileBytes;       // kStages x [256 rows][64] bf16, swizzled
  const Ring<kStages> ring{smem_u32(&bars[0]), smem_u32(&bars[kStages])};
  // full[s]: thread 0's arrive.expect_tx (+ the W1 bytes, some from the peer's multicast) and one
  // arrival per producer thread once its cp.async rows of the stage have landed. A peer's complete_tx
  // can land before the local expect_tx (the pending arrivals keep the phase open) but never a round
  // early: the peer refills slot s only after this CTA's consumers released it (empty counts both).
  init_ring_barriers<kCluster>(ring, 1 + kUpGatherThreads);
  const int num_k = ceil_div(hidden, kBK);

  run_warp_roles<kUpProducerRegs, kUpConsumerRegs>(
      [&] {
        // ---- producer: every thread gathers its A rows, thread 0 also loads W1 ----
        const int t = int(threadIdx.x);
        const RowGather<kUpGatherThreads, 1, 8> gather(sA, t, hidden);
        if (t == 0) tma_prefetch_desc(&tm_w1);
        grid_dependency_wait();  // x comes from the previous kernel (no-op unless PDL-launched)
        // A rows of an item: its tile's rows (none past the total: an idle rank or the end); a half
        // item gathers only its own 64 rows (the other warpgroup's read zeros and are not used).
        auto rows_of = [&](const WorkItem& wi) {
          return gather.rows(x, x_rows, hidden, [&](int i) {
            const bool mine = wi.m0 < grid.total && half_has_rows(wi.half, i < 4 ? 0 : 1);
            return mine ? pair_row[wi.m0 + gather.row(i)] : int32_t(-1);
          });
        };
        // Each item is decoded an item ahead, so its pair_row loads (and its padding-half flag row:
        // every thread reads it, so all keep the same WorkItem) are in flight early.
        ItemWalk<kCluster> walk(grid, pad_halves != 0 ? pair_row : nullptr);
        GatherRows<8> cur_rows = rows_of(walk.cur);
        RingCursor<kStages> cur;
        for (; walk.cur.valid; walk.advance()) {
          const WorkItem& wi = walk.cur;
          bool multicast;
          const int e = work_expert<kCluster>(padded_offsets, experts, wi, grid, multicast);  // whole warp
          walk.fetch_next();
          const GatherRows<8> next_rows = rows_of(walk.next);
          zero_step(zero, zero.per_item, t, kUpGatherThreads);
          for (int kt = 0; kt < num_k; ++kt, cur.advance()) {
            const uint32_t s = cur.stage(), full = ring.full(s);
            ring.wait_empty(cur);
            if (t == 0) {
              if (kt == 0) publish_item(item_slots, s, wi);
              mbar_arrive_expect_tx(full, kBTileBytes);
              load_w1_stage(&tm_w1, full, sB + s * kBTileBytes, kt * kBK, e, wi.nb, ffn, w1_folded != 0, multicast,
                            grid.rank);
            }
            gather.copy(cur_rows, s * kATileBytes, kt);
            cp_async_mbar_arrive_noinc(full);  // full[s] hears of these copies when they land
          }
          cur_rows = next_rows;
        }
        zero_step(zero, zero.end - zero.next, t, kUpGatherThreads);  // (the share's rounding remainder)
        cp_async_wait_all();  // leave with no copies of its own in flight
      },
      [&](int c) {
        // ---- consumers: rows [64c, +64) of each tile ----
        const int warp = int(threadIdx.x / 32) & 3, lane = int(threadIdx.x & 31);
        const uint32_t peer_empty0 = kCluster ? mapa_shared(ring.empty0, grid.rank ^ 1u) : 0u;
        auto release = [&](uint32_t s, uint32_t n) { release_stage<kCluster>(ring.empty0, peer_empty0, s, n); };
        const Tile128::Descs descs = Tile128::descs(sA, sB, uint32_t(c) * 64 * 128);
        const uint32_t stg = smem_u32(staging) + uint32_t(c) * (kUpStagingBytes / 2);
        RingCursor<kStages> cur;
        for (int64_t w = work_first<kCluster>(); w < grid.items; w += work_stride<kCluster>()) {
          Tile128::Acc acc;
          const ItemView iv = consume_item(acc, cur, num_k, ring.full0, descs, /*proxy_fence=*/true, c, item_slots,
                                           release, [](const ItemView&, int) {});
          // A cluster rank without a tile, or the other warpgroup's half item: nothing to write (an
          // all-padding half writes its act rows as zeros: acc stayed zero, and silu(0) * 0 = 0).
          if (!iv.compute || (iv.idle(c) && iv.half != kHalfPadUpper)) continue;
          uint32_t words[32];
          swiglu_words(words, acc.d, acc.d + 64);
          store_act_staged(&tm_act, stg, words, c, warp, lane, iv.m0, iv.nb);
          if (store_h) store_preact_staged(&tm_h, stg, acc.d, c, warp, lane, iv.m0, iv.nb);
        }
        if ((threadIdx.x & 127) == 0) bulk_wait_all();  // act written before the CTA retires
      });
  // No CTA of a cluster exits while its peer may still multicast into it or arrive on its barriers.
  if constexpr (kCluster) cluster_sync();
#else
  // Built for a target without sm_90a features: sm90_experts_supported() is false there.
  (void)store_h, (void)padded_offsets, (void)experts, (void)hidden, (void)ffn, (void)w1_folded, (void)x, (void)x_rows,
      (void)pair_row, (void)by_expert, (void)tail_split, (void)pad_halves, (void)split_ctas, (void)zero_out,
      (void)zero_chunks;
#endif
}

// The image check of sm90_experts_supported (experts.cu): the kernel's attributes on a device.
cudaError_t up_kernel_attributes(cudaFuncAttributes* attr) { return cudaFuncGetAttributes(attr, sm90_up_kernel<false>); }

void launch_up_kernel(const ExpertProblem& p, const Sm90Plan& plan, int split_ctas, cudaStream_t s) {
  const bool cluster = plan.up_form == Sm90UpForm::cluster;
  const bool by_expert = plan.up_order == Sm90Order::by_expert;
  // W1: the folded map (one box per stage) unless the driver rejects it; the multicast pairs load
  // the plain map's boxes (each CTA one half).
  bool folded = false;
  const CUtensorMap tm_w1 = make_w1_box_map(p.w1, p.experts, p.hidden, p.ffn, /*allow_folded=*/!cluster, &folded);
  const CUtensorMap tm_act = make_matrix_map(p.act, p.rows_capacity, p.ffn, 64);  // 64x64 store boxes
  const CUtensorMap tm_h = p.preact ? make_preact_map(p.preact, p.rows_capacity, p.ffn) : tm_act;
  const int64_t tiles = (p.rows_capacity + kBM - 1) / kBM;
  const int64_t items = sm90_work_items(tiles, p.experts, ceil_div(p.ffn, 128), cluster, by_expert);
  const size_t smem = dyn_smem_bytes(by_expert, p.experts, kUpStagingBytes);
  sm90_launch(cluster ? sm90_up_kernel<true> : sm90_up_kernel<false>, cluster, /*pdl=*/false, items, smem, s,
              "sm90_up_kernel", tm_w1, tm_act, tm_h, p.preact ? 1 : 0, p.padded_offsets, p.experts, p.hidden, p.ffn,
              folded ? 1 : 0, p.x, p.x_rows, p.pair_row, by_expert ? 1 : 0, plan.tail_split ? 1 : 0, plan.up_pad_halves ? 1 : 0,
              split_ctas, zero_out_ptr(p), zero_out_chunks(p));
}

}  // namespace epmoe::kernels::sm90
