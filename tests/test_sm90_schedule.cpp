// The sm_90a pipeline's by-expert work order (kernels/sm90/schedule.cuh), decoded on the host the way
// each kernel CTA decodes it: every (row tile, column block) of every expert is computed exactly once,
// weights are those of the tile's expert, multicast pairs share expert and block, and groups stay
// inside an expert. Runs without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "kernels/sm90/schedule.cuh"

namespace {

using epmoe::kernels::sm90::expert_item;
using epmoe::kernels::sm90::expert_items;
using epmoe::kernels::sm90::expert_items_bound;
using epmoe::kernels::sm90::expert_of_item;
using epmoe::kernels::sm90::expert_prefers_tall;
using epmoe::kernels::sm90::split_expert;
using epmoe::kernels::sm90::split_tall_cut;
using epmoe::kernels::sm90::SplitExpert;
using epmoe::kernels::sm90::ScheduledItem;
using epmoe::kernels::sm90::tall_tile_count;
using epmoe::kernels::sm90::tall_tile_rows;

struct Case {
  std::vector<int> tiles;  // per expert
  int nn;
  int group;  // units per group
  bool cluster;
};

// Builds item_off / tile_first as build_expert_schedule does, decodes every item for every rank and
// checks the invariants.
void check_schedule(const Case& c) {
  const int E = int(c.tiles.size());
  std::vector<int32_t> item_off(E + 1, 0), tile_first(E + 1, 0);
  for (int e = 0; e < E; ++e) {
    item_off[e + 1] = item_off[e] + expert_items(c.tiles[e], c.nn, c.cluster);
    tile_first[e + 1] = tile_first[e] + c.tiles[e];
  }
  const int total_tiles = tile_first[E];
  const int items = item_off[E];
  SCOPED_TRACE(::testing::Message() << "E=" << E << " nn=" << c.nn << " group=" << c.group
                                    << " cluster=" << c.cluster << " tiles=" << total_tiles);
  ASSERT_LE(int64_t(items), expert_items_bound(total_tiles, E, c.nn, c.cluster));

  std::map<std::pair<int, int>, int> computed;  // (tile, nb) -> times
  const uint32_t ranks = c.cluster ? 2u : 1u;
  for (int w = 0; w < items; ++w) {
    const int e = expert_of_item(item_off.data(), E, w);
    ASSERT_GE(w, item_off[e]);
    ASSERT_LT(w, item_off[e + 1]) << "item " << w << " decoded to expert " << e;
    ScheduledItem s[2];
    for (uint32_t r = 0; r < ranks; ++r) {
      s[r] = expert_item(w - item_off[e], tile_first[e], c.tiles[e], c.nn, c.group, c.cluster, r);
      // The tile whose rows a CTA loads always belongs to the expert whose weights it loads.
      ASSERT_GE(s[r].tile, tile_first[e]) << "item " << w << " rank " << r;
      ASSERT_LT(s[r].tile, tile_first[e + 1]) << "item " << w << " rank " << r;
      ASSERT_GE(s[r].nb, 0);
      ASSERT_LT(s[r].nb, c.nn);
      if (s[r].compute) ++computed[{s[r].tile, s[r].nb}];
    }
    if (c.cluster) {
      // Both CTAs agree on multicast (they exchange weight halves only then); a multicast pair is
      // tiles 2u, 2u + 1 (relative to the expert) at one column block, both computing.
      ASSERT_EQ(s[0].multicast, s[1].multicast) << "item " << w;
      if (s[0].multicast) {
        EXPECT_EQ(s[0].nb, s[1].nb);
        EXPECT_EQ(s[1].tile, s[0].tile + 1);
        EXPECT_EQ((s[0].tile - tile_first[e]) % 2, 0);
        EXPECT_TRUE(s[0].compute && s[1].compute);
      } else {
        // The odd expert's last tile as a column pair: same rows, blocks 2j and 2j + 1 (rank 1
        // idle on its peer's block past an odd nn).
        EXPECT_EQ(c.tiles[e] % 2, 1) << "item " << w;
        EXPECT_EQ(s[0].tile, tile_first[e + 1] - 1);
        EXPECT_EQ(s[1].tile, s[0].tile);
        EXPECT_TRUE(s[0].compute);
        EXPECT_EQ(s[0].nb % 2, 0);
        if (s[1].compute) EXPECT_EQ(s[1].nb, s[0].nb + 1);
        else EXPECT_EQ(s[1].nb, s[0].nb);
      }
    } else {
      EXPECT_FALSE(s[0].multicast);
      EXPECT_TRUE(s[0].compute);
    }
  }
  // Exactly once: every (tile, block) pair of every tile.
  EXPECT_EQ(computed.size(), size_t(total_tiles) * size_t(c.nn));
  for (const auto& [key, n] : computed) EXPECT_EQ(n, 1) << "tile " << key.first << " block " << key.second;
}

TEST(Sm90Schedule, DegenerateExperts) {
  for (bool cluster : {false, true}) {
    for (int nn : {1, 2, 3, 8, 16, 28}) {
      for (int group : {1, 2, 3, 8}) {
        check_schedule({{0, 0, 0}, nn, group, cluster});    // no rows at all
        check_schedule({{1}, nn, group, cluster});          // one tile
        check_schedule({{0, 1, 0, 1, 0}, nn, group, cluster});  // single tiles between empty experts
        check_schedule({{0, 0, 37, 0}, nn, group, cluster});    // all rows on one expert
        check_schedule({{2, 3, 4, 5, 6, 7}, nn, group, cluster});
      }
    }
  }
}

TEST(Sm90Schedule, RandomExpertSizes) {
  std::mt19937 rng(20261130);
  for (int round = 0; round < 300; ++round) {
    Case c;
    const int E = 1 + int(rng() % 70);
    std::uniform_int_distribution<int> tiles(0, round % 3 == 0 ? 3 : 40);
    for (int e = 0; e < E; ++e) c.tiles.push_back(rng() % 5 == 0 ? 0 : tiles(rng));
    c.nn = 1 + int(rng() % 29);
    c.group = 1 + int(rng() % 12);
    c.cluster = (round & 1) != 0;
    check_schedule(c);
  }
}

// Groups never straddle experts, are swept column-block-major, and split an expert's units into
// near-equal parts: with 17 pair units and group 8, three groups of 6, 6, 5 units.
TEST(Sm90Schedule, GroupsAreBalancedAndColumnMajor) {
  const int nn = 4, group = 8;
  const int tiles = 34;  // 17 pairs
  std::vector<std::pair<int, int>> order;  // (unit, nb) of rank 0, in item order
  for (int w = 0; w < expert_items(tiles, nn, true); ++w) {
    const ScheduledItem s = expert_item(w, 0, tiles, nn, group, true, 0);
    order.push_back({s.tile / 2, s.nb});
  }
  ASSERT_EQ(order.size(), size_t(17 * nn));
  // Group 0: units 0..5 at nb 0, then 0..5 at nb 1, ...; group 1: units 6..11; group 2: 12..16.
  const int sizes[3] = {6, 6, 5};
  size_t i = 0;
  int first = 0;
  for (int g = 0; g < 3; ++g) {
    for (int nb = 0; nb < nn; ++nb)
      for (int u = 0; u < sizes[g]; ++u, ++i) EXPECT_EQ(order[i], std::make_pair(first + u, nb)) << "item " << i;
    first += sizes[g];
  }
}

// An odd expert's leftover tile runs right after the column blocks it pairs, inside the last group.
TEST(Sm90Schedule, LeftoverInterleavedAfterItsColumnPair) {
  const int nn = 3, group = 8, tiles = 5;  // 2 pairs + 1 leftover; blocks (0,1) then (2, idle)
  std::vector<std::tuple<int, int, int, bool>> seq;  // tile, nb rank 0, nb rank 1, rank 1 computes
  for (int w = 0; w < expert_items(tiles, nn, true); ++w) {
    const ScheduledItem a = expert_item(w, 10, tiles, nn, group, true, 0);
    const ScheduledItem b = expert_item(w, 10, tiles, nn, group, true, 1);
    seq.emplace_back(a.tile, a.nb, b.nb, b.compute);
  }
  const std::vector<std::tuple<int, int, int, bool>> want = {
      {10, 0, 0, true}, {12, 0, 0, true}, {10, 1, 1, true}, {12, 1, 1, true}, {14, 0, 1, true},
      {10, 2, 2, true}, {12, 2, 2, true}, {14, 2, 2, false}};
  EXPECT_EQ(seq, want);
}

}  // namespace

// Last-wave halving: with `grid` CTAs taking items b, b + grid, ..., every original item is covered
// exactly once whole or exactly twice as halves 1 and 2; halves only when the last wave is at most
// half full, all of them in that last wave (so no CTA runs a half item before a whole one).
TEST(Sm90Schedule, TailSplitHalvesOnlyTheLastWave) {
  using epmoe::kernels::sm90::tail_item;
  using epmoe::kernels::sm90::tail_split;
  using epmoe::kernels::sm90::TailSplit;
  for (int64_t grid : {1, 2, 7, 132}) {
    for (int64_t items = 0; items <= 5 * grid + 3; ++items) {
      const TailSplit t = tail_split(items, grid);
      const int64_t r = items % grid;
      const bool split = r != 0 && 2 * r <= grid;
      EXPECT_EQ(t.split_from, split ? items - r : items) << grid << " " << items;
      EXPECT_EQ(t.items, split ? items + r : items);
      EXPECT_EQ(t.split_from % grid, split ? 0 : t.split_from % grid);
      EXPECT_LE(t.items - t.split_from, grid);  // every half item in one wave
      std::vector<int> whole(size_t(items), 0), lower(size_t(items), 0), upper(size_t(items), 0);
      for (int64_t w = 0; w < t.items; ++w) {
        int half = -1;
        const int64_t base = tail_item(w, t, half);
        ASSERT_GE(base, 0);
        ASSERT_LT(base, items);
        if (half == 0) {
          EXPECT_LT(w, t.split_from);
          ++whole[size_t(base)];
        } else {
          EXPECT_GE(w, t.split_from);
          ++(half == 1 ? lower : upper)[size_t(base)];
        }
      }
      for (int64_t i = 0; i < items; ++i) {
        const bool halved = i >= t.split_from;
        EXPECT_EQ(whole[size_t(i)], halved ? 0 : 1) << grid << " " << items << " " << i;
        EXPECT_EQ(lower[size_t(i)], halved ? 1 : 0);
        EXPECT_EQ(upper[size_t(i)], halved ? 1 : 0);
      }
    }
  }
}

// The 192-row DOWN's tiles: for every segment the layout can produce (128-row multiples) and every real
// count it can hold, the kernel's count (from the padding flag of the last tile's first row) is
// ceil(real / 192), the tiles cover every real row exactly once, start inside the segment, and say
// how many of their rows lie in it.
TEST(Sm90Schedule, TallTilesCoverTheRealRows) {
  EXPECT_EQ(tall_tile_count(0, false), 0);
  for (int64_t seg = 128; seg <= 4096; seg += 128) {
    for (int64_t real = seg - 127; real <= seg; ++real) {
      const int t0 = int((seg + 191) / 192);
      const int t = tall_tile_count(seg, 192 * int64_t(t0 - 1) >= real);
      ASSERT_EQ(t, int((real + 191) / 192)) << "seg " << seg << " real " << real;
      int64_t covered = 0;
      for (int i = 0; i < t; ++i) {
        const int rows = tall_tile_rows(seg, i);
        ASSERT_GT(rows, 0);
        ASSERT_LE(rows, 192);
        ASSERT_EQ(rows % 64, 0);
        ASSERT_LE(192 * int64_t(i) + rows, seg);
        covered += std::min<int64_t>(rows, std::max<int64_t>(0, real - 192 * int64_t(i)));
      }
      ASSERT_EQ(covered, real) << "seg " << seg << " real " << real;
    }
  }
}
// The split UP's choice: tall exactly where 192-row tiles cover fewer MMA rows than the segment
// (checked against the definition), a few fixed points, and no empty segment goes tall.
TEST(Sm90Schedule, SplitUpPrefersTallWhereItsRowsCostLess) {
  EXPECT_FALSE(expert_prefers_tall(0, false));
  EXPECT_FALSE(expert_prefers_tall(128, false));  // 1 tall tile = 192 rows for 128
  EXPECT_TRUE(expert_prefers_tall(256, true));    // real <= 192: 1 tall tile = 192 < 256
  EXPECT_FALSE(expert_prefers_tall(384, false));  // 2 tall tiles = 384 rows: a tie stays on 128
  EXPECT_FALSE(expert_prefers_tall(512, false));  // real > 384: 3 tall tiles = 576 > 512
  EXPECT_TRUE(expert_prefers_tall(512, true));    // real <= 384: 2 tall tiles = 384 < 512
  EXPECT_TRUE(expert_prefers_tall(640, true));    // real <= 576: 3 tall tiles = 576 < 640
  EXPECT_FALSE(expert_prefers_tall(640, false));  // real > 576: 4 tall tiles = 768 > 640
  for (int64_t seg = 128; seg <= 4096; seg += 128) {
    for (int64_t real = seg - 127; real <= seg; ++real) {
      const int t0 = int((seg + 191) / 192);
      const bool pad = 192 * int64_t(t0 - 1) >= real;
      const int64_t tall = 192 * int64_t(tall_tile_count(seg, pad));
      ASSERT_EQ(expert_prefers_tall(seg, pad), tall < seg) << "seg " << seg << " real " << real;
    }
  }
}

// The split rule's wave test (split_tall_cut), on layouts built from per-expert real counts
// (segments padded to 128 rows, padding rows pair_row -1 at each segment's tail).
struct SplitLayout {
  std::vector<int64_t> offsets{0};
  std::vector<int32_t> pair_row;
  explicit SplitLayout(const std::vector<int>& counts) {
    for (int n : counts) {
      const int64_t seg = (int64_t(n) + 127) / 128 * 128;
      for (int64_t r = 0; r < seg; ++r) pair_row.push_back(r < n ? int32_t(pair_row.size()) : -1);
      offsets.push_back(offsets.back() + seg);
    }
  }
  int cut(int blocks, int ctas) const {
    return split_tall_cut(offsets.data(), pair_row.data(), int(offsets.size()) - 1, blocks, ctas);
  }
};
TEST(Sm90Schedule, SplitWaveRuleTakesThePrefixThatFillsWaves) {
  // The tile-edge counts of the SplitWaves GPU rows: per 8 experts, 129 and 192 rows are picked (one
  // 192-row tile against a 256-row segment: 1 tall item and 2 freed per column block).
  const int edges[8] = {64, 65, 1, 128, 129, 63, 192, 193};
  std::vector<int> counts;
  for (int e = 0; e < 40; ++e) counts.push_back(edges[e % 8]);
  const SplitLayout l40(counts);
  // 16 blocks: prefix m scores 396 ceil(16 m / 132) - 64 m: -116 at m = 8 (one full wave), above it
  // at m = 9, 10. The 8th picked expert is 30.
  EXPECT_EQ(l40.cut(16, 132), 31);
  EXPECT_EQ(l40.cut(16, 1), 39);  // no wave test: every picked expert (the last is 38)
  const SplitLayout l8(std::vector<int>(counts.begin(), counts.begin() + 8));
  EXPECT_EQ(l8.cut(8, 132), 0);  // 2 picked, 16 items: a partial wave costs more than it frees
  EXPECT_EQ(l8.cut(8, 1), 7);
  // 12 experts of 520 rows (640-row segments, 3 tall tiles: 48 items against 80 freed each): the
  // best prefix is 11 experts, 528 items = 4 waves of 132 exactly (score -176).
  const SplitLayout l12(std::vector<int>(12, 520));
  EXPECT_EQ(l12.cut(16, 132), 11);
  // Nothing picked, nothing cut: empty experts and exact multiples of 128.
  EXPECT_EQ(SplitLayout({0, 128, 512, 0}).cut(16, 132), 0);
  EXPECT_EQ(SplitLayout({}).cut(16, 132), 0);
}
TEST(Sm90Schedule, SplitWaveRuleIsTheLeastScorePrefix) {
  std::mt19937_64 rng(29);
  for (int trial = 0; trial < 300; ++trial) {
    const int E = 1 + int(rng() % 80), mean = 64 + int(rng() % 1200), ctas = 1 + int(rng() % 160);
    const int blocks = 1 + int(rng() % 24);
    std::vector<int> counts(static_cast<size_t>(E));
    for (int& n : counts) n = int(rng() % uint64_t(2 * mean));
    const SplitLayout l(counts);
    const int cut = l.cut(blocks, ctas);
    // Brute force: the score of every prefix end (0 = none), the first of the least.
    int64_t tall = 0, freed = 0, best = 0;
    int want = 0;
    for (int e = 0; e < E; ++e) {
      const SplitExpert x = split_expert(l.offsets.data(), l.pair_row.data(), e, blocks);
      ASSERT_EQ(x.picked, x.tall_items * 3 < x.freed_items * 2 && x.tall_items > 0) << "e " << e;
      if (!x.picked) continue;
      tall += x.tall_items, freed += x.freed_items;
      const int64_t score = 3 * int64_t(ctas) * ((tall + ctas - 1) / ctas) - 2 * freed;
      if (score < best) best = score, want = e + 1;
    }
    ASSERT_EQ(cut, want) << "trial " << trial;
    if (ctas == 1) {  // every picked expert goes
      int last = 0;
      for (int e = 0; e < E; ++e)
        if (split_expert(l.offsets.data(), l.pair_row.data(), e, blocks).picked) last = e + 1;
      ASSERT_EQ(cut, last);
    }
  }
}
