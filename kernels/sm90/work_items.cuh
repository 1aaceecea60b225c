// Work items of the 128-row sm_90a kernels (up_kernel.cu, up_pair_kernel.cu, down_kernel.cu): the
// grid of (row unit, column block) items in the global or by-expert order with its half items, the
// producer's item walk, the producer -> consumer item hand-off, and the consumers' loop over one
// item (consume_item: the core's mainloop on Tile128, plus the half items' idle warpgroup).
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/sm90/core/mainloop.cuh"
#include "kernels/sm90/core/ptx.cuh"
#include "kernels/sm90/core/ring.cuh"
#include "kernels/sm90/schedule.cuh"
#include "kernels/sm90/tile_config.h"

namespace epmoe::kernels::sm90 {

// ---- work items of the 128-row kernels ------------------------------------------------------------
// Items cover (row unit) x (column block): nn column blocks per row unit. Single CTA (kCluster =
// false): a row unit is one 128-row tile and CTA blockIdx.x takes items blockIdx.x, + gridDim.x, ...
// 2-CTA cluster: a row unit is the PAIR of consecutive tiles 2p, 2p+1; cluster %clusterid takes items
// %clusterid, + %nclusterid, ... and CTA rank r computes tile 2p + r. When both tiles of a pair lie
// in one expert, both CTAs need the same weight tile (W1 / W2 rows of the column block) at every K
// step: each loads one half and multicasts it into both (half the weight bytes from L2 per CTA). A
// pair straddling an expert boundary loads the weights locally in each CTA. With an odd tile count
// the last pair has no second tile: rank 1 runs the pipeline on its peer's rows (so both rings and
// barrier phases stay in lock step) and writes nothing.
//
// Order, global (Sm90Order::global): groups of `group` row units, column-block-major inside a
// group (unit fastest), so the CTAs running at one time share few weight blocks (each read from HBM
// about once while the group's rows stay in L2) instead of streaming an expert's whole weight matrix
// once per few tiles; group 1 is plain tile-major order. Items are counted from padded_offsets[E]
// (units * nn), so every item below the count is real and the first one at or past it ends a CTA's
// list. Groups cut from the global tile sequence straddle experts (a group touching two experts
// reads both weight matrices).
// Order by expert (Sm90Order::by_expert; kernels/sm90/schedule.cuh): the same groups cut inside each expert,
// expert after expert; pairs never straddle experts, an odd expert's last tile runs as a column
// pair. Needs the per-expert item offsets in shared memory (build_expert_schedule).
struct WorkGrid {
  int64_t total;  // padded_offsets[E]: rows in use (a multiple of 128)
  int64_t items;  // work items
  int64_t units;  // tiles, or tile pairs (global order)
  int nn;         // column blocks per unit
  int group;      // units per group
  uint32_t rank;  // cluster CTA rank (0 for single CTAs)
  int experts;
  const int32_t* item_off;    // by expert: items before expert e, e = 0..E (shared memory); else null
  const int32_t* tile_first;  // by expert: first tile of expert e, e = 0..E (shared memory)
  TailSplit tail;             // last-wave halving (schedule.cuh); tail.split_from == items: none
};
// Half items: which 64-row halves of a tile an item computes. Whole; lower or upper only (the last
// wave's TailSplit: the other half runs on another CTA); lower only because the upper half is all
// padding (Sm90Plan padding halves; UP's idle warpgroup still writes its act rows, as zeros).
inline constexpr int kHalfWhole = 0, kHalfLower = 1, kHalfUpper = 2, kHalfPadUpper = 3;
// Whether warpgroup c (rows [64c, 64c + 64)) computes in an item of this kind.
EPMOE_SCHED_FN bool half_has_rows(int half, int c) {
  return half == kHalfWhole || (c == 0 ? half == kHalfLower || half == kHalfPadUpper : half == kHalfUpper);
}
struct WorkItem {
  bool valid;       // w < items
  int64_t base;     // global order: first row of the unit (this CTA's tile, or the pair's first tile)
  int64_t m0;       // first row of this CTA's tile (global order: >= total when !compute)
  int64_t load_m0;  // row the A tile is loaded from
  int nb;           // column block
  bool compute;     // this CTA has a tile to write: run the epilogue
  int expert;       // by expert: the weights' expert (global order: found by work_expert)
  bool multicast;   // by expert: the pair shares the weight tile
  int half;         // kHalf*: the whole tile, or the rows of one warpgroup only (half items)
};

#if EPMOE_SM90A_DEVICE
// Expert owning the 128-row tile at m0 (< padded_offsets[experts]): the largest e with
// padded_offsets[e] <= m0, i.e. (count of e in [0, E) with padded_offsets[e] <= m0) - 1, since the
// offsets are non-decreasing (empty experts repeat a value). Whole warp; every lane gets the result.
__device__ __forceinline__ int expert_of_tile(const int64_t* __restrict__ padded_offsets, int experts, int64_t m0) {
  const int lane = threadIdx.x & 31;
  int count = 0;
  for (int base = 0; base < experts; base += 32) {
    const int e = base + lane;
    const bool le = e < experts && padded_offsets[e] <= m0;
    count += __popc(__ballot_sync(0xffffffffu, le));
  }
  return count - 1;
}

// Warp 0 (all its lanes call): item_off[0..E] = the exclusive prefix over the experts of items(e),
// which lane e % 32 evaluates once per expert (and may write per-expert schedule entries in). Item
// counts fit in int32 (the launchers bound them). The caller ends with a CTA barrier.
template <class Items>
__device__ __forceinline__ void warp_item_prefix(int experts, int32_t* item_off, Items items) {
  const int lane = int(threadIdx.x & 31);
  int32_t carry = 0;
  for (int base = 0; base < experts; base += 32) {
    const int e = base + lane;
    int32_t n = e < experts ? items(e) : 0;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {  // inclusive warp scan
      const int32_t v = __shfl_up_sync(0xffffffffu, n, d);
      if (lane >= d) n += v;
    }
    if (e < experts) item_off[e + 1] = carry + n;
    carry += __shfl_sync(0xffffffffu, n, 31);
  }
  if (lane == 0) item_off[0] = 0;
}
// The split UP / DOWN (Sm90Plan::up_split / down_split) as their two halves see it: pair_row (null:
// no split), the column blocks the rule counts items over (UP: ffn / 128 in both halves, whatever
// their own units; DOWN: hidden / 256) and the rule's CTA count (split_cut_score in schedule.cuh).
// The 128-row half calls split_expert per expert twice (in the cut, then for its item counts): once
// per CTA start, a few loads per expert, so it is not cached.
struct SplitRule {
  const int32_t* pair_row = nullptr;
  int blocks = 0;
  int ctas = 1;
};
// The 128-row half's rule from its kernel arguments (split_ctas 0: no split; ffn / 128 blocks).
__device__ __forceinline__ SplitRule split_rule(const int32_t* pair_row, int ffn, int split_ctas) {
  return split_ctas > 0 ? SplitRule{pair_row, ceil_div(ffn, 128), split_ctas} : SplitRule{};
}
// Warp 0 (all its lanes call): split_tall_cut, 32 experts per step (lane e % 32 reads expert e's
// segment and one pair_row); the same value in every lane and in every CTA of both halves.
__device__ __forceinline__ int warp_split_tall_cut(const int64_t* __restrict__ padded_offsets, int experts,
                                                   const SplitRule& r) {
  const int lane = int(threadIdx.x & 31);
  long long tall_carry = 0, freed_carry = 0, best = 0;
  int cut = 0;
  for (int base = 0; base < experts; base += 32) {
    const int e = base + lane;
    const SplitExpert x = e < experts ? split_expert(padded_offsets, r.pair_row, e, r.blocks) : SplitExpert{false, 0, 0};
    long long tall = x.tall_items, freed = x.freed_items;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {  // inclusive warp scans
      const long long t = __shfl_up_sync(0xffffffffu, tall, d), f = __shfl_up_sync(0xffffffffu, freed, d);
      if (lane >= d) tall += t, freed += f;
    }
    // Each picked expert's prefix score; the least (then the lowest expert) over the warp.
    long long score = x.picked ? split_cut_score(tall_carry + tall, freed_carry + freed, r.ctas) : best;
    int at = x.picked ? e + 1 : cut;
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) {
      const long long os = __shfl_xor_sync(0xffffffffu, score, d);
      const int oa = __shfl_xor_sync(0xffffffffu, at, d);
      if (os < score || (os == score && oa < at)) score = os, at = oa;
    }
    if (score < best) best = score, cut = at;
    tall_carry += __shfl_sync(0xffffffffu, tall, 31);
    freed_carry += __shfl_sync(0xffffffffu, freed, 31);
  }
  return cut;
}
// All threads: warp 0 fills item_off[0..E] (exclusive prefix of expert_items) and tile_first[0..E]
// from padded_offsets, then a CTA barrier. split (the split UP's 128-row half; default: none): the
// experts the rule sends to the 192-row UP get no items here.
template <bool kCluster>
__device__ __forceinline__ void build_expert_schedule(const int64_t* __restrict__ padded_offsets, int experts, int nn,
                                                      int32_t* item_off, int32_t* tile_first,
                                                      const SplitRule& split = SplitRule{}) {
  if (threadIdx.x < 32) {
    const int cut = split.pair_row != nullptr ? warp_split_tall_cut(padded_offsets, experts, split) : 0;
    warp_item_prefix(experts, item_off, [&](int e) {
      const int t0 = int(padded_offsets[e] / kBM), t1 = int(padded_offsets[e + 1] / kBM);
      tile_first[e] = t0;
      if (e < cut && split_expert(padded_offsets, split.pair_row, e, split.blocks).picked) return int32_t(0);
      return int32_t(expert_items(t1 - t0, nn, kCluster));
    });
    if (threadIdx.x == 0) tile_first[experts] = int32_t(padded_offsets[experts] / kBM);
  }
  __syncthreads();
}

// All threads. sched: the shared-memory schedule area (by expert), or null for the global order.
// tail_workers: halve the last wave's items over this many persistent workers (the CTAs, or the
// A-sharing pairs' clusters), 0 = no halving; single-CTA row units only (see TailSplit). In either
// order: the half items map onto the original item indices before they are decoded. split: see
// build_expert_schedule (by expert only).
template <bool kCluster>
__device__ __forceinline__ WorkGrid make_work_grid(int nn, const int64_t* __restrict__ padded_offsets, int experts,
                                                   int group_tiles, int32_t* sched, int64_t tail_workers = 0,
                                                   const SplitRule& split = SplitRule{}) {
  WorkGrid g;
  g.total = padded_offsets[experts];
  g.nn = nn;
  g.experts = experts;
  const int64_t tiles = g.total / kBM;
  g.units = kCluster ? (tiles + 1) / 2 : tiles;
  const int group = kCluster ? group_tiles / 2 : group_tiles;
  g.group = group < 1 ? 1 : group;
  g.rank = kCluster ? cluster_ctarank() : 0u;
  if (sched != nullptr) {
    build_expert_schedule<kCluster>(padded_offsets, experts, nn, sched, sched + experts + 1, split);
    g.item_off = sched;
    g.tile_first = sched + experts + 1;
    g.items = g.item_off[experts];
  } else {
    g.item_off = g.tile_first = nullptr;
    g.items = g.units * nn;
  }
  g.tail = {g.items, g.items};
  if (!kCluster && tail_workers > 0) {
    g.tail = tail_split(g.items, tail_workers);
    g.items = g.tail.items;
  }
  g.total = warp_uniform_i64(g.total);  // (uniform: the early exits and the consumers' loop bounds)
  g.items = warp_uniform_i64(g.items);
  return g;
}
template <bool kCluster>
__device__ __forceinline__ int64_t work_first() {
  if constexpr (kCluster) return int64_t(cluster_id_x());
  else return int64_t(blockIdx.x);
}
template <bool kCluster>
__device__ __forceinline__ int64_t work_stride() {
  if constexpr (kCluster) return int64_t(nclusters_x());
  else return int64_t(gridDim.x);
}
template <bool kCluster>
__device__ __forceinline__ WorkItem work_item(int64_t w, const WorkGrid& g) {
  WorkItem t;
  t.valid = w < g.items;
  t.expert = -1;
  t.multicast = false;
  t.half = 0;
  if (t.valid && w >= g.tail.split_from) w = tail_item(w, g.tail, t.half);
  if (!t.valid) {
    t.base = t.m0 = t.load_m0 = g.total;
    t.nb = 0;
    t.compute = false;
    return t;
  }
  if (g.item_off != nullptr) {
    const int e = expert_of_item(g.item_off, g.experts, int(w));
    const int t0 = g.tile_first[e];
    const ScheduledItem s =
        expert_item(int(w) - g.item_off[e], t0, g.tile_first[e + 1] - t0, g.nn, g.group, kCluster, g.rank);
    t.base = t.m0 = t.load_m0 = int64_t(s.tile) * kBM;
    t.nb = s.nb;
    t.compute = s.compute;
    t.expert = e;
    t.multicast = s.multicast;
    return t;
  }
  const int64_t per_group = int64_t(g.group) * g.nn;
  const int64_t gi = w / per_group;
  const int64_t r = w - gi * per_group;
  const int64_t first_unit = gi * g.group;
  const int64_t left = g.units - first_unit;
  const int gs = int(left < g.group ? left : g.group);  // units in this (possibly last, short) group
  t.nb = int(r / gs);
  const int64_t unit = first_unit + r % gs;
  t.base = unit * (kCluster ? 2 : 1) * kBM;
  t.m0 = t.base + (kCluster ? int64_t(g.rank) * kBM : 0);
  t.compute = t.m0 < g.total;
  t.load_m0 = t.compute ? t.m0 : t.base;
  return t;
}
// Expert whose weights this CTA loads for a valid item, and whether the pair shares them
// (multicast; always false for single CTAs). Whole warp (the global order searches padded_offsets).
template <bool kCluster>
__device__ __forceinline__ int work_expert(const int64_t* __restrict__ padded_offsets, int experts, const WorkItem& t,
                                           const WorkGrid& g, bool& multicast) {
  if (g.item_off != nullptr) {
    multicast = t.multicast;
    return t.expert;
  }
  const int e0 = expert_of_tile(padded_offsets, experts, t.base);
  multicast = false;
  if constexpr (kCluster) {
    if (t.base + kBM < g.total) {  // uniform: the pair has a second tile
      const int e1 = expert_of_tile(padded_offsets, experts, t.base + kBM);
      multicast = e0 == e1;
      if (t.m0 != t.base) return e1;
    }
  }
  return e0;
}

// Padding halves (Sm90Plan::*_pad_halves): a segment's padding rows are its tail, so a whole tile whose
// row 64 is padding (pair_row -1) has nothing in rows [64, 128) and runs as a half item. The
// producers read pair_row of an item's row 64 an item ahead (pad_row64, null pad_pair_row: off) and
// apply it when the item starts (apply_pad_half), so the load never stalls an item boundary.
__device__ __forceinline__ int32_t pad_row64(const int32_t* __restrict__ pad_pair_row, const WorkItem& w,
                                             const WorkGrid& g) {
  const bool candidate = w.valid && w.compute && w.half == kHalfWhole && w.m0 < g.total;
  return pad_pair_row != nullptr && candidate ? pad_pair_row[w.m0 + 64] : 0;
}
__device__ __forceinline__ void apply_pad_half(WorkItem& w, int32_t row64) {
  if (row64 < 0) w.half = kHalfPadUpper;
}
// A producer's walk over its items, an item ahead: fetch_next() decodes the next item and issues the
// load of its flag row while `cur` streams; advance() applies the flag and makes it current.
template <bool kCluster>
struct ItemWalk {
  const WorkGrid& grid;
  const int32_t* pad_pair_row;  // null: no padding halves
  int64_t w;                    // index of cur
  WorkItem cur, next;
  int32_t next_row64 = 0;
  __device__ __forceinline__ ItemWalk(const WorkGrid& g, const int32_t* pad)
      : grid(g), pad_pair_row(pad), w(work_first<kCluster>()), cur(work_item<kCluster>(w, g)), next(cur) {
    apply_pad_half(cur, pad_row64(pad, cur, g));
  }
  __device__ __forceinline__ void fetch_next() {
    next = work_item<kCluster>(w + work_stride<kCluster>(), grid);
    next_row64 = pad_row64(pad_pair_row, next, grid);
  }
  __device__ __forceinline__ void advance() {
    apply_pad_half(next, next_row64);
    cur = next;
    w += work_stride<kCluster>();
  }
};

// ---- item hand-off from the producer to the consumers ------------------------------------------
// The consumers do not decode work items: the producer, which runs stages ahead, writes each item's
// (tile, column block, compute) into a per-stage slot before it arms the item's first stage, and the
// consumers read it after their full-barrier wait on that stage (the producer's arrive releases, the
// wait acquires). A slot is rewritten only after the consumers released that stage, which they do
// after reading it. Measured: with the by-expert decode (a search and a few integer divisions) run by
// every consumer warp at each item start, the layer was 2-5% slower, the same on a routing where
// both orders produce identical item sequences.
struct ItemView {
  int64_t m0;    // first row of this CTA's tile
  int nb;        // column block
  bool compute;  // run the epilogue
  int half;      // WorkItem::half (kHalf*)
  // Whether warpgroup c (rows [64c, 64c + 64)) has no rows in this item (a half item of the other).
  __device__ __forceinline__ bool idle(int c) const { return !half_has_rows(half, c); }
};
static_assert(kBM == 128, "item slots store m0 / 128");
inline constexpr int kItemIdleBit = 0x40000000, kItemHalfShift = 28, kItemNbMask = (1 << kItemHalfShift) - 1;
__device__ __forceinline__ void publish_item(int2* slots, uint32_t s, const WorkItem& wi) {
  slots[s] = make_int2(int(wi.m0 >> 7), wi.nb | (wi.half << kItemHalfShift) | (wi.compute ? 0 : kItemIdleBit));
}
__device__ __forceinline__ ItemView read_item(const int2* slots, uint32_t s) {
  // Made warp-uniform (every lane read the same slot), so the item's branches and the k loop's
  // descriptors can stay in the uniform datapath.
  int2 v = slots[s];
  v.x = warp_uniform_i32(v.x);
  v.y = warp_uniform_i32(v.y);
  return {int64_t(v.x) * kBM, v.y & kItemNbMask, (v.y & kItemIdleBit) == 0, (v.y >> kItemHalfShift) & 3};
}

// ---- the consumers' loop over one item ---------------------------------------------------------
// acc (zeroed here) = this warpgroup's 64 rows of A (at a_off in each A stage) times the 256 rows of
// B, over num_k stages of the ring from the cursor's use on (advanced past the item): the core's
// mainloop on Tile128. Returns the item the producer published with its first stage (read after that
// stage's wait, before the first wgmma). after_issue(iv, kt) runs after stage kt's wgmma group is
// issued (and before the wait for stage kt - 1's), so work there overlaps two queued groups.
// Half items (ItemView::half: the last wave's tail split, padding halves): the warpgroup without rows
// leaves the ring alone - it releases the first stage itself (after reading its slot, so the slot's
// reuse stays ordered by its own arrival), the other warpgroup releases the rest for both (n = 2:
// each of its threads arrives for itself and its idle partner) - and both meet at named barrier
// kHalfItemBarrier after the item, so the idle one's next full-barrier wait is not a round early.
// acc stays zero; the caller skips the idle warpgroup's epilogue (its rows belong to another CTA's
// half item) except UP's for a padding half (its act rows are written as zeros).
inline constexpr uint32_t kHalfItemBarrier = 3;  // named barrier id (UP's epilogue uses 1 and 2)
template <typename Release, typename AfterIssue>
__device__ __forceinline__ ItemView consume_item(Tile128::Acc& acc, RingCursor<kStages>& cur, int num_k,
                                                 uint32_t full0, const Tile128::Descs& descs, bool proxy_fence,
                                                 int c, const int2* item_slots, Release&& release,
                                                 AfterIssue&& after_issue) {
  Tile128::zero(acc);
  mbar_wait(full0 + 8 * cur.stage(), cur.parity());
  const ItemView iv = read_item(item_slots, cur.stage());
  if (iv.idle(c)) {
    release(cur.stage(), 1u);
    for (int kt = 0; kt < num_k; ++kt) after_issue(iv, kt);
    cur.advance(uint32_t(num_k));
    named_barrier_sync_any_pc(kHalfItemBarrier, 256);
    return iv;
  }
  const uint32_t both = iv.half != 0 ? 2u : 1u;  // arrivals per release from stage 1 on
  mainloop<Tile128>(
      acc, cur, num_k, full0, descs, proxy_fence, [&](uint32_t s, int kt) { release(s, kt > 0 ? both : 1u); },
      [&](int kt) { after_issue(iv, kt); });
  if (iv.half != 0) named_barrier_sync_any_pc(kHalfItemBarrier, 256);
  return iv;
}

// A TMA producer thread's arming of the cursor's use (k step kt of item wi): waits until the
// consumers released the stage's previous round, publishes the item with its first k step, and
// expects `bytes` on the stage's full barrier. Returns the stage and (full) that barrier, for the
// caller's loads.
__device__ __forceinline__ uint32_t arm_stage(const RingCursor<kStages>& cur, int kt, const WorkItem& wi,
                                              const Ring<kStages>& ring, int2* item_slots, uint32_t bytes,
                                              uint32_t& full) {
  const uint32_t s = cur.stage();
  ring.wait_empty(cur);
  full = ring.full(s);
  if (kt == 0) publish_item(item_slots, s, wi);
  mbar_arrive_expect_tx(full, bytes);
  return s;
}

// The ring's barriers, set up by thread 0 before any use: full[s] expects `full_count` arrivals (plus
// its TMA bytes), empty[s] one arrival per consumer thread (release_stage) - of both CTAs in a
// cluster, since the peer's multicast writes into this CTA's ring. Then a CTA barrier, or a cluster
// barrier so that no peer multicasts into or arrives on a barrier before it is initialized. All
// threads call it; other barriers thread 0 initialized before are covered by its fence.
template <bool kCluster>
__device__ __forceinline__ void init_ring_barriers(const Ring<kStages>& ring, uint32_t full_count) {
  if (threadIdx.x == 0) {
    ring.init(full_count, kConsumerThreads * (kCluster ? 2 : 1));
    mbar_fence_init();
  }
  if constexpr (kCluster) cluster_sync();
  else __syncthreads();
}

#endif  // EPMOE_SM90A_DEVICE

}  // namespace epmoe::kernels::sm90
