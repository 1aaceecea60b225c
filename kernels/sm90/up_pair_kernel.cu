// The pair UP (Sm90UpForm::pairs, the form wherever ffn % 256 == 0): the 128-row UP's contract
// (up_kernel.cu: x gathered through pair_row, w1 -> act = bf16(silu(gate) * up), and h with store_h) on 2-CTA clusters
// whose two CTAs take the SAME row tile and the two column blocks 2jp and 2jp + 1.
//
// Why: each CTA gathers only its 64 rows of the A tile (half the cp.async copies and half the
// gather's global reads per CTA) and a forwarder thread copies that half into the peer's ring (one
// 8 KB shared::cta -> shared::cluster bulk copy per stage, completing on the peer's full barrier);
// the gathering UP's cost over a UP reading a pre-gathered copy is in those copies, not in the shared-
// memory bytes (layer 2.3-3.8% faster at hidden 2048 than single CTAs). W1 is loaded by each CTA for
// its own column block.
//
// Items: the single-CTA schedule (work_items.cuh) over (row tile, column pair) units in the plan's
// order; the last wave's items halved over the clusters (tail split: rows [0, 64) and [64, 128) of a
// tile on two clusters; each CTA then gathers and forwards 32 rows and one consumer warpgroup idles);
// no padding halves.
// Producer warpgroup roles: warps 0-1 gather (RowGather<64, 1, 8>), thread 64 forwards, warp 3 finds
// the expert and lane 0 loads W1 and publishes the item. Barriers per stage: full (2 arrivals: the W1
// thread's arrive.expect_tx of W1 + the peer's half, and the forwarder's arrive once this CTA's half
// landed), half_full (64 cp.async arrivals: this CTA's half landed; the forwarder waits on it), empty
// (both CTAs' consumers, as for the multicast clusters). Consumers as in up_kernel.cu.
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

inline constexpr uint32_t kPairProducerRegs = 104, kPairConsumerRegs = 200;
inline constexpr int kPairGatherThreads = 64;
inline constexpr uint32_t kPairHalfBytes = kATileBytes / 2;  // 64 rows x 128 B, one CTA's half

#if EPMOE_SM90A_DEVICE
struct PairItem {
  bool valid;
  int64_t m0;  // the pair's row tile
  int nb;      // this CTA's column block
  int half;    // kHalfWhole, or kHalfLower / kHalfUpper: the tile's rows [0, 64) / [64, 128) only
};
// Item w of the pair grid decoded by work_item; CTA rank r computes column block 2 pair + r.
__device__ __forceinline__ PairItem pair_item(const WorkItem& t, uint32_t rank) {
  return {t.valid, t.m0, 2 * t.nb + int(rank), t.half};
}
// The rows of an item this CTA gathers and forwards: the first (as a byte offset in the A tile) and
// the bytes - 64 rows of a whole item, 32 of a half item's 64.
__device__ __forceinline__ uint32_t pair_fwd_offset(const PairItem& p, uint32_t rank) {
  return p.half == kHalfWhole ? rank * kPairHalfBytes : uint32_t(64 * (p.half - 1) + 32 * int(rank)) * 128u;
}
__device__ __forceinline__ uint32_t pair_fwd_bytes(const PairItem& p) {
  return p.half == kHalfWhole ? kPairHalfBytes : kPairHalfBytes / 2;
}
#endif

__global__ void __launch_bounds__(kThreads, 1)
    sm90_up_pair_kernel(const __grid_constant__ CUtensorMap tm_w1, const __grid_constant__ CUtensorMap tm_act,
                   const __grid_constant__ CUtensorMap tm_h, int store_h,
                        const int64_t* __restrict__ padded_offsets, int experts, int hidden, int ffn, int w1_folded,
                        const __nv_bfloat16* __restrict__ x, int64_t x_rows, const int32_t* __restrict__ pair_row,
                        int by_expert, int tail_split, int split_ctas, __nv_bfloat16* __restrict__ zero_out,
                        int64_t zero_chunks) {
#if EPMOE_SM90A_DEVICE
  __shared__ __align__(8) uint64_t bars[3 * kStages];  // full, empty, half_full
  __shared__ int2 item_slots[kStages];
  extern __shared__ uint8_t dyn_smem[];
  uint8_t* ring_mem = align_1024(dyn_smem);
  uint8_t* staging = ring_mem + kStages * kStageBytes;

  // By expert: the schedule's offsets after the staging boxes (make_work_grid builds it; CTA barrier).
  int32_t* sched = by_expert ? reinterpret_cast<int32_t*>(staging + kUpStagingBytes) : nullptr;
  // Single-CTA row units x column pairs, the last wave halved over the clusters (not the CTAs).
  const WorkGrid g = make_work_grid<false>(ffn / 256, padded_offsets, experts, kGroupTiles, sched,
                                           tail_split != 0 ? work_stride<true>() : 0,
                                           split_rule(pair_row, ffn, split_ctas));  // (by expert only)
  const int64_t items = g.items;
  const uint32_t rank = cluster_ctarank();
  ZeroPlan zero = make_zero_plan<true>(zero_out, zero_chunks, items);
  if (work_first<true>() >= items) {  // both CTAs of the cluster alike
    zero_step(zero, zero.end - zero.next, int(threadIdx.x), kThreads);
    return;
  }
  grid_launch_dependents();  // as in up_kernel.cu

  const uint32_t sA = smem_u32(ring_mem), sB = sA + kStages * kATileBytes;
  const Ring<kStages> ring{smem_u32(&bars[0]), smem_u32(&bars[kStages])};
  const uint32_t half0 = smem_u32(&bars[2 * kStages]);
  if (threadIdx.x == 0)
    for (int st = 0; st < kStages; ++st) mbar_init(half0 + 8 * st, kPairGatherThreads);
  init_ring_barriers<true>(ring, 2);  // (its fence and cluster barrier cover half_full too)

  const int num_k = ceil_div(hidden, kBK);
  const int64_t first = work_first<true>(), stride = work_stride<true>();

  run_warp_roles<kPairProducerRegs, kPairConsumerRegs>(
      [&] {
        const int t = int(threadIdx.x), warp = t / 32;
        if (warp < 2) {
          // ---- gatherers: this CTA's rows of the tile (pair_fwd_offset: 64 from row 64 rank, or a half
          // item's 32) ----
          const RowGather<kPairGatherThreads, 1, 8> gather(sA, t, hidden);
          grid_dependency_wait();
          auto rows_of = [&](const PairItem& pi) {
            const int64_t r0 = pi.m0 + int64_t(pair_fwd_offset(pi, rank) / 128u);
            const int n = pi.half == kHalfWhole ? 8 : 4;
            return gather.rows(x, x_rows, hidden, [&](int i) {
              return pi.valid && i < n ? pair_row[r0 + gather.row(i)] : int32_t(-1);
            });
          };
          PairItem cur_item = pair_item(work_item<false>(first, g), rank);
          GatherRows<8> cur_rows = rows_of(cur_item);
          RingCursor<kStages> cur;
          for (int64_t w = first; cur_item.valid; w += stride) {
            const PairItem nxt = pair_item(work_item<false>(w + stride, g), rank);
            const GatherRows<8> next_rows = rows_of(nxt);  // an item ahead
            zero_step(zero, zero.per_item, t, kPairGatherThreads);
            const uint32_t off = pair_fwd_offset(cur_item, rank);
            const bool whole = cur_item.half == kHalfWhole;
            for (int kt = 0; kt < num_k; ++kt, cur.advance()) {
              const uint32_t st = cur.stage();
              ring.wait_empty(cur);
              if (whole) gather.copy<8>(cur_rows, st * kATileBytes + off, kt);
              else gather.copy<4>(cur_rows, st * kATileBytes + off, kt);
              cp_async_mbar_arrive_noinc(half0 + 8 * st);
            }
            cur_rows = next_rows;
            cur_item = nxt;
          }
          zero_step(zero, zero.end - zero.next, t, kPairGatherThreads);
          cp_async_wait_all();
        } else if (t == 64) {
          // ---- forwarder: this CTA's rows of each stage -> the peer's ring, once they have landed ----
          const uint32_t peer_a = mapa_shared(sA, rank ^ 1u), peer_full0 = mapa_shared(ring.full0, rank ^ 1u);
          RingCursor<kStages> cur;
          for (int64_t w = first; w < items; w += stride) {
            const PairItem pi = pair_item(work_item<false>(w, g), rank);
            const uint32_t off = pair_fwd_offset(pi, rank), bytes = pair_fwd_bytes(pi);
            for (int kt = 0; kt < num_k; ++kt, cur.advance()) {
              const uint32_t st = cur.stage();
              mbar_wait(half0 + 8 * st, cur.parity());
              fence_proxy_async_shared();  // the gatherers' cp.async writes, before the bulk copy reads them
              bulk_copy_to_peer(peer_a + st * kATileBytes + off, sA + st * kATileBytes + off, bytes,
                                peer_full0 + 8 * st);
              mbar_arrive(ring.full(st));  // this CTA's rows are here
            }
          }
        } else if (warp == 3) {
          // ---- W1: the whole warp finds the expert, lane 0 arms the stages and loads ----
          if (t == 96) tma_prefetch_desc(&tm_w1);
          RingCursor<kStages> cur;
          for (int64_t w = first; w < items; w += stride) {
            const WorkItem wt = work_item<false>(w, g);
            const PairItem pi = pair_item(wt, rank);
            bool multicast;  // (always false for single-CTA units)
            const int e = work_expert<false>(padded_offsets, experts, wt, g, multicast);  // whole warp
            if (t == 96) {
              WorkItem wi{};
              wi.valid = true;
              wi.m0 = wi.base = wi.load_m0 = pi.m0;
              wi.nb = pi.nb;
              wi.compute = true;
              wi.half = pi.half;  // (a half item: consume_item idles the other warpgroup)
              const uint32_t bytes = kBTileBytes + pair_fwd_bytes(pi);  // W1 and the peer's rows
              for (int kt = 0; kt < num_k; ++kt, cur.advance()) {
                uint32_t full;
                const uint32_t st = arm_stage(cur, kt, wi, ring, item_slots, bytes, full);
                load_w1_stage(&tm_w1, full, sB + st * kBTileBytes, kt * kBK, e, pi.nb, ffn, w1_folded != 0, false,
                              rank);
              }
            }
            __syncwarp();
          }
        }
        __syncwarp();  // (warp 2's idle lanes reconverge with the forwarder before the cluster barrier)
      },
      [&](int c) {
        // ---- consumers: as in up_kernel.cu, releasing to both CTAs ----
        const int warp = int(threadIdx.x / 32) & 3, lane = int(threadIdx.x & 31);
        const uint32_t peer_empty0 = mapa_shared(ring.empty0, rank ^ 1u);
        auto release = [&](uint32_t st, uint32_t n) { release_stage<true>(ring.empty0, peer_empty0, st, n); };
        const Tile128::Descs descs = Tile128::descs(sA, sB, uint32_t(c) * 64 * 128);
        const uint32_t stg = smem_u32(staging) + uint32_t(c) * (kUpStagingBytes / 2);
        RingCursor<kStages> cur;
        for (int64_t w = first; w < items; w += stride) {
          Tile128::Acc acc;
          const ItemView iv = consume_item(acc, cur, num_k, ring.full0, descs, /*proxy_fence=*/true, c, item_slots,
                                           release, [](const ItemView&, int) {});
          if (iv.idle(c)) continue;  // the other warpgroup's half item
          uint32_t words[32];
          swiglu_words(words, acc.d, acc.d + 64);
          store_act_staged(&tm_act, stg, words, c, warp, lane, iv.m0, iv.nb);
          if (store_h) store_preact_staged(&tm_h, stg, acc.d, c, warp, lane, iv.m0, iv.nb);
        }
        if ((threadIdx.x & 127) == 0) bulk_wait_all();
      });
  cluster_sync();  // no CTA leaves while its peer may still copy into it or arrive on its barriers
#else
  (void)store_h, (void)padded_offsets, (void)experts, (void)hidden, (void)ffn, (void)w1_folded, (void)x, (void)x_rows,
      (void)pair_row, (void)by_expert, (void)tail_split, (void)split_ctas, (void)zero_out, (void)zero_chunks;
#endif
}

void launch_up_pair_kernel(const ExpertProblem& p, const Sm90Plan& plan, int split_ctas, cudaStream_t s) {
  EPMOE_CHECK(p.ffn % 256 == 0, ErrorCode::invalid_argument, "sm90 up=pairs needs ffn % 256 == 0, got ", p.ffn);
  const bool by_expert = plan.up_order == Sm90Order::by_expert;
  bool folded = false;
  const CUtensorMap tm_w1 = make_w1_box_map(p.w1, p.experts, p.hidden, p.ffn, /*allow_folded=*/true, &folded);
  const CUtensorMap tm_act = make_matrix_map(p.act, p.rows_capacity, p.ffn, 64);
  const CUtensorMap tm_h = p.preact ? make_preact_map(p.preact, p.rows_capacity, p.ffn) : tm_act;
  // Its units are single row tiles with ffn / 256 column pairs each: the single-CTA item count over those.
  const int64_t tiles = (p.rows_capacity + kBM - 1) / kBM;
  const int64_t items = sm90_work_items(tiles, p.experts, p.ffn / 256, false, by_expert);
  const size_t smem = dyn_smem_bytes(by_expert, p.experts, kUpStagingBytes);
  sm90_launch(sm90_up_pair_kernel, /*cluster=*/true, /*pdl=*/false, items, smem, s, "sm90_up_pair_kernel", tm_w1,
              tm_act, tm_h, p.preact ? 1 : 0, p.padded_offsets, p.experts, p.hidden, p.ffn, folded ? 1 : 0, p.x, p.x_rows, p.pair_row,
              by_expert ? 1 : 0, plan.tail_split ? 1 : 0, split_ctas, zero_out_ptr(p), zero_out_chunks(p));
}

}  // namespace epmoe::kernels::sm90
