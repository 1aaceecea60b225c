// Work order of the sm_90a kernels (host and device; no CUDA needed to include it, so CPU tests check
// the decode exhaustively and the heuristics tier reuses its counts).
//
// Why: a scheduling group (a few row tiles swept over every column block, see WorkGrid in
// work_items.cuh) reads its experts' whole weight matrices once from HBM. Groups cut from the
// global tile sequence straddle expert boundaries, so an expert whose tiles fall in two groups is
// read twice (E=32 k=8 7168/2048 at T=8k: ~16.5 tiles per expert, group 16: ~2x the 1.9 GB of W1).
// Here groups never leave an expert: expert e's items come in one contiguous block of the item
// space, its units are split into ceil(units / group) groups of near-equal size, and each group is
// swept column-block-major (units fastest).
//
// Units: single CTAs, one row tile. 2-CTA clusters: a PAIR of tiles of one expert (both CTAs load
// half of the weight tile and multicast it). An odd expert's last tile (the leftover) would leave
// rank 1 idle; instead the pair computes it for two column blocks at once (rank r: block 2j + r,
// weights loaded locally, no multicast), interleaved into the expert's last group after column
// blocks 2j and 2j + 1 so its weight tiles are still in L2. Only an odd column-block count leaves
// rank 1 idle on the leftover's last item (it runs its peer's block and writes nothing).
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define EPMOE_SCHED_FN __host__ __device__ __forceinline__
#else
#define EPMOE_SCHED_FN inline
#endif

namespace epmoe::kernels::sm90 {

// Work items of an expert with `tiles` row tiles and nn column blocks. All counts here are int32:
// the launcher keeps the item total below 2^31 (and tiles < 2^24 since rows < 2^31), and 32-bit
// division keeps the per-item decode short in the kernels' register-tight producer.
EPMOE_SCHED_FN int expert_items(int tiles, int nn, bool cluster) {
  if (!cluster) return tiles * nn;
  return (tiles / 2) * nn + (tiles & 1) * ((nn + 1) / 2);
}

// Upper bound of the item count over all experts given only the total tile count (host grid sizing):
// in cluster mode every odd expert adds at most half a unit.
EPMOE_SCHED_FN int64_t expert_items_bound(int64_t tiles, int experts, int nn, bool cluster) {
  if (!cluster) return tiles * nn;
  const int64_t odd = experts < tiles ? experts : tiles;
  return ((tiles + odd) / 2) * nn;
}

struct ScheduledItem {
  int tile;      // this CTA's row tile (rows [128 tile, +128)), also the tile whose rows it loads
  int nb;        // this CTA's column block
  bool compute;  // false: an idle rank running its peer's block, writes nothing
  bool multicast;  // the cluster pair shares this weight tile (tiles 2u, 2u + 1 of one expert)
};

// Item `local` (0 <= local < expert_items) of an expert whose tiles are [first_tile, first_tile +
// tiles), for cluster CTA `rank` (0 for single CTAs); group = units per group (>= 1).
EPMOE_SCHED_FN ScheduledItem expert_item(int local, int first_tile, int tiles, int nn, int group, bool cluster,
                                         uint32_t rank) {
  const int units = cluster ? tiles / 2 : tiles;
  const bool leftover = cluster && (tiles & 1) != 0;
  int gs = 0, r = local, first_unit = 0;  // units in the item's group, index in it, its first unit
  bool last = true;
  if (units > 0) {
    const int ng = (units + group - 1) / group;  // groups of near-equal size q or q + 1
    const int q = units / ng, big_groups = units % ng;
    const int big_items = big_groups * (q + 1) * nn;
    int g = local < big_items ? local / ((q + 1) * nn) : big_groups + (local - big_items) / (q * nn);
    if (g > ng - 1) g = ng - 1;  // the leftover's items trail the last group's
    gs = g < big_groups ? q + 1 : q;
    first_unit = g < big_groups ? g * (q + 1) : big_groups * (q + 1) + (g - big_groups) * q;
    r = local - (g < big_groups ? g * (q + 1) * nn : big_items + (g - big_groups) * q * nn);
    last = g == ng - 1;
  }
  ScheduledItem s{};
  int unit = 0;
  if (last && leftover) {
    // Blocks of 2 gs + 1 items per column pair j: units at block 2j, units at block 2j + 1, the
    // leftover tile at both (the last block of an odd nn: units at 2j, then the leftover).
    const int blk = 2 * gs + 1;
    const int j = r / blk, x = r - j * blk;
    if (x < gs) {
      unit = x;
      s.nb = 2 * j;
    } else if (x < 2 * gs && 2 * j + 1 < nn) {
      unit = x - gs;
      s.nb = 2 * j + 1;
    } else {
      s.tile = first_tile + 2 * units;
      const int nb = 2 * j + int(rank);
      s.compute = nb < nn;
      s.nb = s.compute ? nb : 2 * j;
      s.multicast = false;
      return s;
    }
  } else {
    s.nb = r / gs;
    unit = r - s.nb * gs;
  }
  unit += first_unit;
  s.tile = cluster ? first_tile + 2 * unit + int(rank) : first_tile + unit;
  s.compute = true;
  s.multicast = cluster;
  return s;
}

// Last-wave halving (global order, single CTAs). With `grid` persistent CTAs taking items b, b + grid,
// ..., the items past the last full wave run on only `items % grid` SMs while the rest idle. When they
// fill at most half a wave, each of them is run as two half items instead - rows [0, 64) of its tile
// on one CTA, rows [64, 128) on the next - so the last wave takes about half as long. Half items come
// only after every whole item, so no CTA runs ahead of its partners on a shared weight stream in the
// full waves (the lockstep that makes the weights' DRAM reads cheap; docs/ARCHITECTURE.md).
struct TailSplit {
  int64_t split_from;  // first halved item (== items when nothing is halved)
  int64_t items;       // item indices after halving: split_from + 2 (original items - split_from)
};
EPMOE_SCHED_FN TailSplit tail_split(int64_t items, int64_t grid) {
  const int64_t r = grid > 0 ? items % grid : 0;
  if (r == 0 || 2 * r > grid) return {items, items};
  return {items - r, items + r};
}
// Index w < t.items after halving -> the original item and its part: 0 whole, 1 rows [0, 64) only,
// 2 rows [64, 128) only.
EPMOE_SCHED_FN int64_t tail_item(int64_t w, const TailSplit& t, int& half) {
  if (w < t.split_from) {
    half = 0;
    return w;
  }
  const int64_t j = w - t.split_from;
  half = 1 + int(j & 1);
  return t.split_from + j / 2;
}

// 192-row tiles (the split's 192-row kernels, up_tall_kernel.cu / down_tall_kernel.cu) over a segment of seg_rows rows (a
// multiple of 128: the layout's padding) whose real rows come first. tall_tile_count: ceil(seg_rows /
// 192) tiles, one fewer when that last tile would start in the padding (`last_starts_in_padding`: the
// kernel reads pair_row at its first row), i.e. ceil(real / 192) for every real count the segment can
// hold (seg_rows - 128 < real <= seg_rows). tall_tile_rows: the rows of tile i inside the segment
// (64, 128 or 192); a tile's rows past the segment belong to the next one and reduce nothing.
EPMOE_SCHED_FN int tall_tile_count(int64_t seg_rows, bool last_starts_in_padding) {
  const int t = int((seg_rows + 191) / 192);
  return t > 0 && last_starts_in_padding ? t - 1 : t;
}
EPMOE_SCHED_FN int tall_tile_rows(int64_t seg_rows, int i) {
  const int64_t left = seg_rows - 192 * int64_t(i);
  return int(left < 192 ? left : 192);
}
// tall_tile_count's `last_starts_in_padding` for the segment [seg, seg + seg_rows) of a layout:
// whether the first row of its ceil(seg_rows / 192)-th tile is padding (pair_row -1; real rows come
// first). One pair_row read.
EPMOE_SCHED_FN bool tall_last_starts_in_padding(const int32_t* pair_row, int64_t seg, int64_t seg_rows) {
  const int64_t t = (seg_rows + 191) / 192;
  return t > 0 && pair_row[seg + 192 * (t - 1)] < 0;
}
// The split (Sm90Plan::up_split / down_split): expert e runs on 192-row tiles iff they cover strictly fewer
// MMA rows than its segment (the 128-row tiles cover exactly the segment), i.e. they save >= 64
// padding rows. Rows are costed alike: the tall tile's ~4% clock gain at 7168/T=2k is absent at T=8k
// and weighting by it sent 93% of the experts at T=8k to the tall half for no saving (+1.1% layer). Arguments as tall_tile_count's; an empty segment stays on the
// 128-row kernel (no items either way).
EPMOE_SCHED_FN bool expert_prefers_tall(int64_t seg_rows, bool last_starts_in_padding) {
  const int64_t tall_rows = int64_t(192) * tall_tile_count(seg_rows, last_starts_in_padding);
  return tall_rows < seg_rows;
}
// The split UP's wave rule. The experts expert_prefers_tall picks are taken in expert order; sending
// the first of them to the 192-row UP frees `freed` 128-row items (their tiles x the column blocks)
// and adds `tall` 192-row items, 1.5 the time each, which run in ceil(tall / ctas) waves after the
// 128-row half (whose own last wave is halved, TailSplit). split_cut_score: that cost less the
// saving, in half item-times x ctas; the 192-row half gets the prefix of least score, none (score 0)
// included, the shortest on ties. Why: a lone tall expert's items are a partial wave of long items
// behind the 128-row half (+0.6% at 7168/T=4k); a simulation puts
// the rule at UP x0.96 at 7168/T=2k against x0.97 for every picked expert. With ctas = 1 every
// picked expert goes (each lowers the score), i.e. the rule is expert_prefers_tall alone.
EPMOE_SCHED_FN int64_t split_cut_score(int64_t tall_items, int64_t freed_items, int ctas) {
  return 3 * int64_t(ctas) * ((tall_items + ctas - 1) / ctas) - 2 * freed_items;
}
// Expert e's part in the rule: whether expert_prefers_tall picks it (from its segment and the
// pair_row of its last tall tile's first row: padding is the segment's tail), its 192-row items and
// the 128-row items it frees, over `blocks` column blocks.
struct SplitExpert {
  bool picked;
  int64_t tall_items, freed_items;
};
EPMOE_SCHED_FN SplitExpert split_expert(const int64_t* padded_offsets, const int32_t* pair_row, int e, int blocks) {
  const int64_t seg = padded_offsets[e], p = padded_offsets[e + 1] - seg;
  const bool pad = tall_last_starts_in_padding(pair_row, seg, p);
  if (!expert_prefers_tall(p, pad)) return {false, 0, 0};
  return {true, int64_t(tall_tile_count(p, pad)) * blocks, p / 128 * blocks};
}
// The rule, sequentially (host: tests and the test harness; the kernels run it 32 experts at a time,
// warp_split_tall_cut in work_items.cuh): expert e goes tall iff split_expert picks it and e < the
// returned bound.
inline int split_tall_cut(const int64_t* padded_offsets, const int32_t* pair_row, int experts, int blocks, int ctas) {
  int64_t tall = 0, freed = 0, best = 0;
  int cut = 0;
  for (int e = 0; e < experts; ++e) {
    const SplitExpert x = split_expert(padded_offsets, pair_row, e, blocks);
    if (!x.picked) continue;
    tall += x.tall_items;
    freed += x.freed_items;
    const int64_t score = split_cut_score(tall, freed, ctas);
    if (score < best) best = score, cut = e + 1;
  }
  return cut;
}
// The expert owning item w: the largest e < experts with item_off[e] <= w, for a non-decreasing
// item_off[0..experts] with item_off[0] = 0 <= w < item_off[experts] (empty experts repeat a value).
EPMOE_SCHED_FN int expert_of_item(const int32_t* item_off, int experts, int w) {
  int lo = 0, hi = experts;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (item_off[mid] <= w) lo = mid;
    else hi = mid;
  }
  return lo;
}

}  // namespace epmoe::kernels::sm90
