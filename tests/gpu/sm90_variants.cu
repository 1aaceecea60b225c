// The plan tables of the sm_90a suite: see sm90_variants.h.
#include "sm90_variants.h"

#include <algorithm>
#include <cstdio>

namespace sm90_case {

namespace {
// A short tag of a plan for test names: "<up>_<up order><down order>_<down>_s<split>_p<pad>[_t0]",
// e.g. pairs_EE_dsingle_sUD_pN.
std::string plan_tag(const epmoe::Sm90Plan& p) {
  auto both = [](bool up, bool down) { return std::string(up && down ? "UD" : up ? "U" : down ? "D" : "N"); };
  auto order = [](epmoe::Sm90Order o) { return o == epmoe::Sm90Order::by_expert ? "E" : "G"; };
  return std::string(to_string(p.up_form)) + "_" + order(p.up_order) + order(p.down_order) + "_d" +
         (p.down_cluster ? "cluster" : "single") + "_s" + both(p.up_split, p.down_split) + "_p" +
         both(p.up_pad_halves, p.down_pad_halves) + (p.tail_split ? "" : "_t0") + (p.swap_ab ? "_swap" : "") + (p.fused ? "_fused" : "");
}
}  // namespace

const std::vector<CatalogCase>& catalog_cases() {
  static const std::vector<CatalogCase> v = [] {
    std::vector<CatalogCase> out;
    int i = 0;
    for (const auto& [s, p] : epmoe::kernels::sm90_plan_catalog(kH200)) {
      // The pairs the engine's bound makes room for: capacity = ceil((pairs + 127 E) / 128) * 128.
      const int k = s.experts >= 2 ? 2 : 1;
      // (A swap-AB entry: its own pairs, which the rule reads against the capacity's tiles.)
      const int64_t pairs = p.swap_ab ? s.pairs : std::max<int64_t>(s.rows_capacity - 127 * int64_t(s.experts), 1);
      const int64_t T = std::max<int64_t>(pairs / k, 1);
      CatalogCase cc;
      char idx[8];
      std::snprintf(idx, sizeof idx, "%02d", i);
      cc.name = std::string(idx) + "_" + plan_tag(p);
      // Fewer reference tokens on the large shapes (~100k-260k rows): each costs k experts of fp64
      // reference on the host.
      cc.c = with({s.experts, k, s.hidden, s.ffn, T, Route::uniform, 0, s.rows_capacity > 65536 ? 16 : 48}, 300 + i);
      cc.c.min_capacity = s.rows_capacity;
      cc.shape = s;
      cc.plan = p;
      out.push_back(cc);
      ++i;
    }
    return out;
  }();
  return v;
}

void PrintTo(const CatalogCase& c, std::ostream* os) { *os << c.name; }

// The rows. Each pins the plan fields it is about (spelled out - the padding halves and the split
// too where the row's forms and order decide them - so the row runs the same plan on any device);
// the case is one that stresses that path's edges. Paths of code that no longer exists (the UP from xs, granular tiles, direct
// epilogues, the exp SwiGLU, non-persistent grids, the 192-row-everywhere modes, other group sizes -
// the group is the constant kGroupTiles, every group size's decode is covered by test_sm90_schedule)
// have no rows.
const std::vector<Variant>& variants() {
  static const std::vector<Variant> v = {
      // ---- the 128-row UP's cluster form (W1 multicast; the plain W1 map's path) and DOWN's clusters,
      // global order: one tile in all (rank 1 idles), pairs inside one expert (the multicast path
      // under the sanitizers), an odd tile count in one expert, pairs straddling experts (1-row and
      // empty experts, skew, drops), the half-out-of-range last W2 block, many tiles, graph replays,
      // no PDL; DOWN on clusters under single CTAs and under the pairs.
      {"ClusterSmallE4K2H256F256T64", {4, 2, 256, 256, 64, Route::uniform, 0, 64},
       "up=cluster,down=cluster,order=global,split=none,pad=none"},
      {"ClusterSmallMulticastE2K1H256F256T512", {2, 1, 256, 256, 512, Route::uniform, 0, 64},
       "up=cluster,down=cluster,order=global,split=none,pad=none"},
      {"ClusterOneTileE4K1H7168F2048T1", with({4, 1, 7168, 2048, 1, Route::uniform, 130, 1}, 10),
       "up=cluster,down=cluster,order=global,split=none,pad=none"},
      {"ClusterUniformE8K4H7168F2048T512", with({8, 4, 7168, 2048, 512, Route::uniform, 0, 12}, 11),
       "up=cluster,down=cluster,order=global,split=none,pad=none"},
      {"ClusterZipfE64K8H4096F768T1024", with({64, 8, 4096, 768, 1024, Route::zipf, 0, 16}, 13),
       "up=cluster,down=cluster,order=global,split=none,pad=none"},
      {"ClusterSingleRowExpertsE16K1H4096F1024T12", with({16, 1, 4096, 1024, 12, Route::single_rows, 0, 12}, 14),
       "up=cluster,down=cluster,order=global,split=none,pad=none"},
      {"ClusterOneExpertOddTilesE8K2H2048F768T1100", with({8, 2, 2048, 768, 1100, Route::one_expert, 128, 48}, 15),
       "up=cluster,down=cluster,order=global,split=none,pad=none"},
      {"ClusterWithDropsE16K4H2048F1024T777", with({16, 4, 2048, 1024, 777, Route::with_drops, 77, 48}, 16),
       "up=cluster,down=cluster,order=global,split=none,pad=none"},
      {"ClusterHalfTileE4K2H640F768T300", with({4, 2, 640, 768, 300, Route::uniform, 0, 64}, 17),
       "up=cluster,down=cluster,order=global,split=none,pad=none"},
      {"ClusterLargeTE16K2H256F256T65536", with({16, 2, 256, 256, 65536, Route::uniform, 5000, 32}, 18),
       "up=cluster,down=cluster,order=global,split=none,pad=none"},
      {"ClusterGraphCaptured", with({32, 4, 2048, 1024, 4096, Route::uniform, 31 * 128, 32}, 20, Mode::graph),
       "up=cluster,down=cluster,order=global,split=none,pad=none"},
      {"ClusterSeparateNoPdl", with({16, 4, 2048, 1024, 2048, Route::zipf, 256, 32}, 21, Mode::separate_no_pdl),
       "up=cluster,down=cluster,order=global,split=none,pad=none"},
      {"DownClusterUpSingleGraphCapturedZipfE32K4H2048F1024T4096",
       with({32, 4, 2048, 1024, 4096, Route::zipf, 31 * 128, 32}, 27, Mode::graph),
       "up=single,down=cluster,order=global,split=none,pad=none"},
      {"DownClusterUpPairsWithDropsE16K4H2048F1024T777", with({16, 4, 2048, 1024, 777, Route::with_drops, 77, 48}, 32),
       "up=pairs,down=cluster,order=global,split=none,pad=none"},
      // ---- single CTAs in the global order (the default UP form only where ffn % 256 == 128), and the
      // pairs in the global order at hidden 7168 (by expert by default there).
      {"SingleSmallE4K2H256F256T64", {4, 2, 256, 256, 64, Route::uniform, 0, 64},
       "up=single,down=single,order=global,split=none,pad=none"},
      {"SingleZipfE64K8H4096F768T1024", with({64, 8, 4096, 768, 1024, Route::zipf, 0, 16}, 29),
       "up=single,down=single,order=global,split=none,pad=none"},
      {"SingleHalfTileE4K2H640F768T300", with({4, 2, 640, 768, 300, Route::uniform, 0, 64}, 30),
       "up=single,down=single,order=global,split=none,pad=none"},
      {"PairsGlobalUniformE8K4H7168F2048T512", with({8, 4, 7168, 2048, 512, Route::uniform, 0, 12}, 24),
       "up=pairs,down=single,order=global,split=none,pad=none"},
      // ---- the by-expert order (no split): an odd expert's last tile runs as a column pair - the
      // single-row experts make every tile such a leftover, hidden / ffn 640 give odd column-block
      // counts (rank 1 idle on the last pair; ffn 640 rules out the pairs) - and groups split an
      // expert's units into near-equal parts; below hidden 4096 (global by default) and at 4096 / 7168.
      {"ByExpertClusterSmallE4K2H256F256T64", {4, 2, 256, 256, 64, Route::uniform, 0, 64},
       "up=cluster,down=cluster,order=expert,split=none,pad=none"},
      {"ByExpertClusterSmallMulticastE2K1H256F256T512", {2, 1, 256, 256, 512, Route::uniform, 0, 64},
       "up=cluster,down=cluster,order=expert,split=none,pad=none"},
      {"ByExpertClusterOddColumnBlocksE4K2H640F640T300", with({4, 2, 640, 640, 300, Route::uniform, 0, 64}, 37),
       "up=cluster,down=cluster,order=expert,split=none,pad=none"},
      {"ByExpertClusterOddColumnBlocksZipfE8K4H640F640T700", with({8, 4, 640, 640, 700, Route::zipf, 0, 64}, 38),
       "up=cluster,down=cluster,order=expert,split=none,pad=none"},
      {"ByExpertSingleOddColumnBlocksE4K2H640F640T300", with({4, 2, 640, 640, 300, Route::uniform, 0, 64}, 39),
       "up=single,down=single,order=expert,split=none"},
      {"ByExpertClusterSingleRowExpertsE16K1H4096F1024T12", with({16, 1, 4096, 1024, 12, Route::single_rows, 0, 12}, 40),
       "up=cluster,down=cluster,order=expert,split=none,pad=none"},
      {"ByExpertPairsSingleRowExpertsE16K1H4096F1024T12", with({16, 1, 4096, 1024, 12, Route::single_rows, 0, 12}, 140),
       "up=pairs,down=single,order=expert,split=none,pad=none"},
      {"ByExpertClusterOneExpertOddTilesE8K2H2048F768T1100", with({8, 2, 2048, 768, 1100, Route::one_expert, 128, 48}, 41),
       "up=cluster,down=cluster,order=expert,split=none,pad=none"},
      {"ByExpertClusterZipfE64K8H4096F768T1024", with({64, 8, 4096, 768, 1024, Route::zipf, 0, 16}, 42),
       "up=cluster,down=cluster,order=expert,split=none,pad=none"},
      {"ByExpertClusterWithDropsGraphCaptured", with({16, 4, 2048, 1024, 777, Route::with_drops, 77, 32}, 43, Mode::graph),
       "up=cluster,down=cluster,order=expert,split=none,pad=none"},
      {"ByExpertSingleZipfE32K4H2048F1024T4096", with({32, 4, 2048, 1024, 4096, Route::zipf, 1000, 48}, 44),
       "up=single,down=single,order=expert,split=none"},
      {"ByExpertClusterUniformE8K4H7168F2048T512", with({8, 4, 7168, 2048, 512, Route::uniform, 0, 12}, 45),
       "up=cluster,down=cluster,order=expert,split=none,pad=none"},
      // ---- many experts: at E=200 UP's schedule fits by expert and DOWN's does not (DOWN global), with
      // and without the UP split; at E=256 neither fits (global; most experts hold 0-4 rows).
      {"ManyExpertsUpByExpertZipfE200K8H256F256T2048", with({200, 8, 256, 256, 2048, Route::zipf, 0, 64}, 49),
       "up_order=expert,down_order=global,split=none"},
      {"ManyExpertsSplitUpZipfE200K8H256F256T2048", with({200, 8, 256, 256, 2048, Route::zipf, 0, 64}, 149),
       "up_order=expert,down_order=global,split=up,split_ctas=1", 1},
      {"ManyExpertsGlobalZipfE256K8H256F256T2048", with({256, 8, 256, 256, 2048, Route::zipf, 0, 64}, 50),
       "order=global,split=none"},
      // ---- the UP kernels zero out themselves (ExpertProblem::zero_out; out is poisoned, no memset):
      // a small case (sanitizers), CTAs without items (one tile; no rows at all, also with both
      // splits' kernels), graph replays (the second must re-zero), clusters, single CTAs with padding
      // halves, DOWN without PDL.
      {"ZeroOutSmallE4K2H256F256T64", zero_in_up(with({4, 2, 256, 256, 64, Route::uniform, 0, 64}, 54)), ""},
      {"ZeroOutOneTileE4K1H7168F2048T1", zero_in_up(with({4, 1, 7168, 2048, 1, Route::uniform, 130, 1}, 55)), ""},
      {"ZeroOutAllDroppedE8K2H2048F768T300", zero_in_up(with({8, 2, 2048, 768, 300, Route::all_dropped, 256, 64}, 56)),
       ""},
      {"ZeroOutAllDroppedSplitE8K2H4096F768T300",
       zero_in_up(with({8, 2, 4096, 768, 300, Route::all_dropped, 256, 64}, 61)),
       "order=expert,split=up+down,split_ctas=1", 0, 0},
      {"ZeroOutGraphCapturedZipfE32K4H2048F1024T4096",
       zero_in_up(with({32, 4, 2048, 1024, 4096, Route::zipf, 31 * 128, 32}, 57, Mode::graph)), ""},
      {"ZeroOutClusterOneExpertOddTilesE8K2H2048F768T1100",
       zero_in_up(with({8, 2, 2048, 768, 1100, Route::one_expert, 128, 48}, 59)), "up=cluster,down=cluster,pad=none"},
      {"ZeroOutSinglePadHalvesWithDropsE16K4H2048F1024T777",
       zero_in_up(with({16, 4, 2048, 1024, 777, Route::with_drops, 77, 48}, 58)), "up=single,down=single,pad=up+down"},
      {"ZeroOutSeparateNoPdlE16K4H2048F1024T2048",
       zero_in_up(with({16, 4, 2048, 1024, 2048, Route::zipf, 256, 32}, 60, Mode::separate_no_pdl)), ""},
      // ---- segments of 64, 65, 1, 128, 129, 63, 192, 193 rows (Route::tile_edges): ends exactly at, just
      // past and just before the 64-row halves and 128-row tiles, on each UP form in each order, and
      // graph replays with in-kernel zeroing. Small: also a sanitizer case.
      {"TileEdgesSingleSmallE8K1H256F256T835", with({8, 1, 256, 256, 835, Route::tile_edges, 0, 835}, 161),
       "up=single,down=single,order=global,split=none,pad=none"},
      {"TileEdgesPairsE16K2H2048F768T1670", with({16, 2, 2048, 768, 1670, Route::tile_edges, 128, 256}, 62),
       "up=pairs,down=single,order=global,split=none,pad=none"},
      {"TileEdgesClusterE8K1H7168F2048T835", with({8, 1, 7168, 2048, 835, Route::tile_edges, 0, 64}, 64),
       "up=cluster,down=cluster,order=global,split=none,pad=none"},
      {"TileEdgesByExpertSingleE16K2H2048F768T1670", with({16, 2, 2048, 768, 1670, Route::tile_edges, 128, 256}, 162),
       "up=single,down=single,order=expert,split=none,pad=none"},
      {"TileEdgesByExpertPairsE16K2H2048F768T1670", with({16, 2, 2048, 768, 1670, Route::tile_edges, 128, 256}, 163),
       "up=pairs,down=single,order=expert,split=none,pad=none"},
      {"TileEdgesByExpertClusterE8K1H7168F2048T835", with({8, 1, 7168, 2048, 835, Route::tile_edges, 0, 64}, 164),
       "up=cluster,down=cluster,order=expert,split=none,pad=none"},
      {"TileEdgesGraphCapturedZeroOutE24K1H2048F1024T2505",
       zero_in_up(with({24, 1, 2048, 1024, 2505, Route::tile_edges, 256, 128}, 65, Mode::graph)), ""},
      // ---- the last wave halved (tail=on; TailSplit in schedule.cuh): every item halved (a capacity far
      // above the rows, so the grid has a CTA per SM and the items fill less than half of it; small:
      // also under the sanitizers), only the last wave's (T=16k), graph replays with in-kernel
      // zeroing; single CTAs and the pairs, in each order; DOWN on clusters (UP alone halves); and off.
      {"TailSplitSmallAllHalvedE4K2H256F256T64", with({4, 2, 256, 256, 64, Route::uniform, 132 * 128, 64}, 68),
       "up=single,down=single,order=global,split=none,pad=none,tail=on"},
      {"TailSplitPairsSmallAllHalvedE4K2H256F256T64", with({4, 2, 256, 256, 64, Route::uniform, 132 * 128, 64}, 165),
       "up=pairs,down=single,order=global,split=none,pad=none,tail=on"},
      {"TailSplitAllHalvedZipfE8K2H2048F768T300", with({8, 2, 2048, 768, 300, Route::zipf, 132 * 128, 64}, 69),
       "up=single,down=single,order=global,split=none,pad=none,tail=on"},
      {"TailSplitLastWaveE32K4H2048F1024T16384", with({32, 4, 2048, 1024, 16384, Route::uniform, 0, 48}, 70),
       "tail=on"},
      {"TailSplitGraphCapturedZeroOutE8K2H7168F2048T300",
       zero_in_up(with({8, 2, 7168, 2048, 300, Route::uniform, 132 * 128, 32}, 72, Mode::graph)),
       "up=single,down=single,order=global,split=none,pad=none,tail=on"},
      {"TailSplitByExpertSmallAllHalvedE4K2H256F256T64", with({4, 2, 256, 256, 64, Route::uniform, 132 * 128, 64}, 187),
       "up=single,down=single,order=expert,split=none,tail=on"},
      {"TailSplitByExpertPairsSmallAllHalvedE4K2H256F256T64",
       with({4, 2, 256, 256, 64, Route::uniform, 132 * 128, 64}, 194),
       "up=pairs,down=single,order=expert,split=none,pad=none,tail=on"},
      {"TailSplitByExpertAllHalvedTileEdgesE16K2H2048F768T1670",
       with({16, 2, 2048, 768, 1670, Route::tile_edges, 132 * 128, 256}, 188),
       "up=single,down=single,order=expert,split=none,tail=on"},
      {"TailSplitByExpertLastWaveE32K8H7168F2048T2048", with({32, 8, 7168, 2048, 2048, Route::uniform, 0, 16}, 189),
       "order=expert,split=none,tail=on"},
      {"TailSplitByExpertDownClusterZipfE16K4H4096F1024T4096", with({16, 4, 4096, 1024, 4096, Route::zipf, 0, 32}, 191),
       "up=single,down=cluster,order=expert,split=none,pad=none,tail=on"},
      {"TailSplitOffAllHalvedE8K2H2048F768T300", with({8, 2, 2048, 768, 300, Route::zipf, 132 * 128, 64}, 75),
       "up=single,down=single,order=global,split=none,pad=none,tail=off"},
      {"TailSplitOffPairsByExpertSmallE4K2H256F256T64", with({4, 2, 256, 256, 64, Route::uniform, 132 * 128, 64}, 197),
       "up=pairs,down=single,order=expert,split=none,pad=none,tail=off"},
      {"TailSplitOffE32K8H7168F2048T2048", with({32, 8, 7168, 2048, 2048, Route::uniform, 0, 16}, 198), "tail=off"},
      // ---- all-padding upper tile halves as half items (pad=...; the tile_edges segments of 1, 63, 64,
      // 65, 129 and 193 rows end in such halves, and UP must still write their act rows as zeros):
      // both kernels (small: also under the sanitizers), graph replays with in-kernel zeroing, by
      // expert, DOWN's alone under UP clusters, with every item also tail-halved, with the split,
      // the default where it pays (T=16k: DOWN), and off.
      {"PadHalvesSmallTileEdgesE8K1H256F256T835", with({8, 1, 256, 256, 835, Route::tile_edges, 0, 256}, 76),
       "up=single,down=single,pad=up+down"},
      {"PadHalvesGraphCapturedZeroOutTileEdgesE24K1H2048F1024T2505",
       zero_in_up(with({24, 1, 2048, 1024, 2505, Route::tile_edges, 256, 128}, 78, Mode::graph)),
       "up=single,down=single,pad=up+down"},
      {"PadHalvesByExpertTileEdgesE16K2H2048F768T1670", with({16, 2, 2048, 768, 1670, Route::tile_edges, 0, 256}, 81),
       "up=single,down=single,order=expert,split=none,pad=up+down"},
      {"PadHalvesDownOnlyClusterUpSmallTileEdgesE8K1H256F256T835",
       with({8, 1, 256, 256, 835, Route::tile_edges, 0, 256}, 82), "up=cluster,down=single,pad=down"},
      {"PadHalvesAllTailHalvedTileEdgesE8K1H2048F768T835",
       with({8, 1, 2048, 768, 835, Route::tile_edges, 132 * 128, 256}, 83), "up=single,down=single,pad=up+down,tail=on"},
      {"PadHalvesSplitByExpertTileEdgesE8K1H2048F768T835", with({8, 1, 2048, 768, 835, Route::tile_edges, 0, 256}, 86),
       "up=single,down=single,order=expert,split=up+down,split_ctas=1,pad=up+down", 1, 1},
      {"PadHalvesDefaultZipfE32K4H2048F1024T16384", with({32, 4, 2048, 1024, 16384, Route::zipf, 0, 48}, 84), ""},
      {"PadHalvesOffTileEdgesE8K1H2048F768T835", with({8, 1, 2048, 768, 835, Route::tile_edges, 0, 256}, 85),
       "up=single,down=single,pad=none"},
      // ---- the split (192-row halves after the 128-row kernels, PDL; by expert): split_ctas=1 sends
      // every expert the split rule picks (so small problems put experts in both halves; asserted
      // where the row says 1): tile edges (counts 129 and 192 go tall, the others stay; small: the
      // sanitizers), a small uniform case that picks none, the 128-row halves as single CTAs, pairs
      // and clusters, one expert of 1700 rows (1728 tall rows for a 1792-row segment; the 128-row
      // halves have no item), drops, graph replays with in-kernel zeroing, separate launches without
      // PDL, the 7168/2048 bench shape (split UP only, both, DOWN on clusters, the default wave rule),
      // odd column blocks, single-row experts (none picked), ffn 128 (two k steps in DOWN's 3-deep
      // ring), DOWN's split alone; the wave rule at 132 CTAs (SplitWaves: 40 tile-edge experts, 10
      // picked, UP's rule takes 8 over 16 column blocks, DOWN's none over 4; 8 experts: none) and the
      // 128-row kernels alone by expert.
      {"SplitSmallTileEdgesE8K1H256F256T835", with({8, 1, 256, 256, 835, Route::tile_edges, 0, 835}, 230),
       "order=expert,split=up+down,split_ctas=1", 1, 1},
      {"SplitSmallNoTallE4K2H256F256T64", with({4, 2, 256, 256, 64, Route::uniform, 0, 64}, 231),
       "order=expert,split=up+down,split_ctas=1", 0, 0},
      {"SplitSmallSingleTileEdgesE8K1H256F256T835", with({8, 1, 256, 256, 835, Route::tile_edges, 0, 835}, 232),
       "up=single,down=single,order=expert,split=up+down,split_ctas=1,pad=none", 1, 1},
      {"SplitSmallClusterTileEdgesE8K1H256F256T835", with({8, 1, 256, 256, 835, Route::tile_edges, 0, 835}, 233),
       "up=cluster,down=cluster,order=expert,split=up+down,split_ctas=1,pad=none", 1, 1},
      {"SplitPairsZipfE32K8H7168F2048T2048", with({32, 8, 7168, 2048, 2048, Route::zipf, 0, 16}, 234),
       "up=pairs,order=expert,split=up+down,split_ctas=1", 1, 1},
      {"SplitDefaultUniformE32K8H7168F2048T2048", with({32, 8, 7168, 2048, 2048, Route::uniform, 0, 16}, 235), "", 1, 1},
      {"SplitClusterUniformE8K4H7168F2048T1024", with({8, 4, 7168, 2048, 1024, Route::uniform, 0, 12}, 236),
       "up=cluster,down=cluster,order=expert,split=up+down,split_ctas=1,pad=none", 1, 1},
      {"SplitOneExpertE8K2H2048F768T1700", with({8, 2, 2048, 768, 1700, Route::one_expert, 128, 48}, 237),
       "order=expert,split=up+down,split_ctas=1", 1, 1},
      {"SplitWithDropsE16K4H2048F1024T777", with({16, 4, 2048, 1024, 777, Route::with_drops, 77, 48}, 238),
       "order=expert,split=up+down,split_ctas=1", 1, 1},
      {"SplitGraphCapturedZeroOutTileEdgesE8K1H1024F1024T835",
       zero_in_up(with({8, 1, 1024, 1024, 835, Route::tile_edges, 128, 64}, 239, Mode::graph)),
       "order=expert,split=up+down,split_ctas=1", 1, 1},
      {"SplitSeparateNoPdlTileEdgesE8K1H1024F1024T835",
       with({8, 1, 1024, 1024, 835, Route::tile_edges, 0, 64}, 241, Mode::separate_no_pdl),
       "order=expert,split=up+down,split_ctas=1", 1, 1},
      {"SplitUpOnlyZipfE32K8H7168F2048T2048", with({32, 8, 7168, 2048, 2048, Route::zipf, 0, 16}, 262),
       "order=expert,split=up,split_ctas=1", 1},
      {"SplitDownClusterUniformE8K4H7168F2048T1024", with({8, 4, 7168, 2048, 1024, Route::uniform, 0, 12}, 263),
       "up=pairs,down=cluster,order=expert,split=down,split_ctas=1,pad=none", -1, 1},
      {"SplitOddColumnBlocksWithDropsE16K4H1024F640T777", with({16, 4, 1024, 640, 777, Route::with_drops, 77, 48}, 224),
       "up=single,down=single,order=expert,split=up+down,split_ctas=1,pad=none", 1, 1},
      {"SplitSingleRowExpertsE16K1H4096F1024T12", with({16, 1, 4096, 1024, 12, Route::single_rows, 0, 12}, 244),
       "order=expert,split=up+down,split_ctas=1", 0, 0},
      {"SplitDownSmallOneExpertE4K1H256F256T1700", with({4, 1, 256, 256, 1700, Route::one_expert, 0, 64}, 261),
       "order=expert,split=down,split_ctas=1", -1, 1},
      {"SplitDownSmallTwoKStepsTileEdgesE8K1H384F128T835", with({8, 1, 384, 128, 835, Route::tile_edges, 0, 835}, 268),
       "order=expert,split=down,split_ctas=1", -1, 1},
      {"SplitWavesPartialTileEdgesE40K1H1024F2048T4175", with({40, 1, 1024, 2048, 4175, Route::tile_edges, 0, 64}, 242),
       "order=expert,split=up+down,split_ctas=132", 1, 0},
      {"SplitWavesNoneTileEdgesE8K1H1024F1024T835", with({8, 1, 1024, 1024, 835, Route::tile_edges, 0, 64}, 243),
       "order=expert,split=up+down,split_ctas=132", 0, 0},
      {"NoSplitByExpertZipfE32K8H7168F2048T2048", with({32, 8, 7168, 2048, 2048, Route::zipf, 0, 16}, 271),
       "order=expert,split=none"},
      // ---- swap-AB (swap_ab_kernel.cu; 64-row half tiles, N = 8, 16, 32 or 64 per half from its
      // rows): the decode sizes T = 1, 2, 8, 33, 64, 65 around the N steps on the bench shape (a CTA
      // runs items of different N one after another on one ring: the T = 33..65 cases have ~2000
      // items on 132 CTAs), small (the sanitizers), one expert holding every row (full halves), tile
      // edges (64, 65, 1, 128, 129, 63, 192, 193 rows: every N, upper halves with 0, 1 and 64 rows,
      // and the padding rows' zeros in act and h), skew, drops, single-row experts, the 7168/2048
      // shape, in-kernel zeroing with CTAs without items, graph replays, DOWN without PDL.
      {"SwapSmallE4K2H256F256T64", with({4, 2, 256, 256, 64, Route::uniform, 0, 64}, 300), "swap=on"},
      {"SwapSmallTileEdgesKeepsPreactE8K1H256F256T835",
       keeping_preact(with({8, 1, 256, 256, 835, Route::tile_edges, 0, 835}, 301)), "swap=on"},
      {"SwapT1E32K4H2048F1024", with({32, 4, 2048, 1024, 1, Route::uniform, 0, 1}, 302), "swap=on"},
      {"SwapT2E32K4H2048F1024", with({32, 4, 2048, 1024, 2, Route::uniform, 0, 2}, 303), "swap=on"},
      {"SwapT8E32K4H2048F1024", with({32, 4, 2048, 1024, 8, Route::uniform, 0, 8}, 304), "swap=on"},
      {"SwapT33E32K4H2048F1024", with({32, 4, 2048, 1024, 33, Route::uniform, 0, 33}, 305), "swap=on"},
      {"SwapT64ZipfE32K4H2048F1024", with({32, 4, 2048, 1024, 64, Route::zipf, 0, 64}, 306), "swap=on"},
      {"SwapT65ZipfE32K4H2048F1024", with({32, 4, 2048, 1024, 65, Route::zipf, 0, 65}, 307), "swap=on"},
      {"SwapT512ZipfE32K4H2048F1024", with({32, 4, 2048, 1024, 512, Route::zipf, 0, 48}, 308), "swap=on"},
      {"SwapOneExpertE8K2H2048F768T1000", with({8, 2, 2048, 768, 1000, Route::one_expert, 128, 48}, 309), "swap=on"},
      {"SwapTileEdgesKeepsPreactE16K1H1024F768", keeping_preact(with({16, 1, 1024, 768, 16 * 128, Route::tile_edges, 0, 48}, 310)),
       "swap=on"},
      {"SwapWithDropsE16K4H2048F1024T777", with({16, 4, 2048, 1024, 777, Route::with_drops, 77, 48}, 311), "swap=on"},
      {"SwapSingleRowExpertsE16K1H4096F1024T12", with({16, 1, 4096, 1024, 12, Route::single_rows, 0, 12}, 312),
       "swap=on"},
      {"SwapUniformE32K8H7168F2048T256", with({32, 8, 7168, 2048, 256, Route::uniform, 0, 12}, 313), "swap=on"},
      {"SwapZeroOutAllDroppedE8K2H2048F768T300", zero_in_up(with({8, 2, 2048, 768, 300, Route::all_dropped, 256, 64}, 314)),
       "swap=on"},
      {"SwapZeroOutGraphCapturedZipfE32K4H2048F1024T128",
       zero_in_up(with({32, 4, 2048, 1024, 128, Route::zipf, 31 * 128, 64}, 315, Mode::graph)), "swap=on"},
      {"SwapSeparateNoPdlZipfE16K4H2048F1024T300", with({16, 4, 2048, 1024, 300, Route::zipf, 256, 32}, 316, Mode::separate_no_pdl),
       "swap=on"},
      // ---- the fused swap-AB pipeline (fused_swap_kernel.cu: UP + DOWN in one grid, fp32 split-K
      // accumulator, out written by its PDL dependent): the same decode sizes around the N steps,
      // small (the sanitizers), one expert with full halves, drops, single-row experts, the
      // 7168/2048 shape (56 DOWN stages per item), nothing routed (out all zero from the write-out
      // alone), capacity past the total (CTAs without items), and graph replays (the second replay
      // finds the accumulator zeroed by the first).
      {"FusedSmallE4K2H256F256T64", with({4, 2, 256, 256, 64, Route::uniform, 0, 64}, 320), "fused=on"},
      {"FusedT1E32K4H2048F1024", with({32, 4, 2048, 1024, 1, Route::uniform, 0, 1}, 321), "fused=on"},
      {"FusedT2E32K4H2048F1024", with({32, 4, 2048, 1024, 2, Route::uniform, 0, 2}, 322), "fused=on"},
      {"FusedT8E32K4H2048F1024", with({32, 4, 2048, 1024, 8, Route::uniform, 0, 8}, 323), "fused=on"},
      {"FusedT33E32K4H2048F1024", with({32, 4, 2048, 1024, 33, Route::uniform, 0, 33}, 324), "fused=on"},
      {"FusedT64ZipfE32K4H2048F1024", with({32, 4, 2048, 1024, 64, Route::zipf, 0, 64}, 325), "fused=on"},
      {"FusedT65ZipfE32K4H2048F1024", with({32, 4, 2048, 1024, 65, Route::zipf, 0, 65}, 326), "fused=on"},
      {"FusedOneExpertE8K2H2048F768T1000", with({8, 2, 2048, 768, 1000, Route::one_expert, 128, 48}, 327), "fused=on"},
      {"FusedWithDropsE16K4H2048F1024T777", with({16, 4, 2048, 1024, 777, Route::with_drops, 77, 48}, 328), "fused=on"},
      {"FusedSingleRowExpertsE16K1H4096F1024T12", with({16, 1, 4096, 1024, 12, Route::single_rows, 0, 12}, 329),
       "fused=on"},
      {"FusedUniformE32K8H7168F2048T256", with({32, 8, 7168, 2048, 256, Route::uniform, 0, 12}, 330), "fused=on"},
      {"FusedAllDroppedE8K2H2048F768T300", with({8, 2, 2048, 768, 300, Route::all_dropped, 256, 64}, 331), "fused=on"},
      {"FusedGraphCapturedZipfE32K4H2048F1024T128",
       with({32, 4, 2048, 1024, 128, Route::zipf, 31 * 128, 64}, 332, Mode::graph), "fused=on"},
      {"FusedHiddenNotOf256E8K2H1152F256T40", with({8, 2, 1152, 256, 40, Route::uniform, 0, 40}, 334), "fused=on"},
      {"FusedTileEdgesKeepsPreactE16K1H1024F768", keeping_preact(with({16, 1, 1024, 768, 16 * 128, Route::tile_edges, 0, 48}, 333)),
       "fused=on"},
      // ---- hidden / ffn multiples of 16, not of 128 (issue 48): the weights' boxes read zeros past
      // hidden (the last, partial k step of UP) and past ffn (UP's last column block, DOWN's last k
      // step), the gathers zero-fill past K, and the stores stop at ffn (act, h) and hidden (out).
      // Tails of 16 (144 = 2 x 64 + 16, 2064 = 32 x 64 + 16), blocks narrower than one box (ffn 80,
      // 48, 16), and every form: single, clusters, pairs (ffn % 256 == 0, hidden not), the 192-row
      // halves (split=up needs ffn % 128 == 0; split=down takes any hidden), swap-AB and fused.
      {"Dims16SingleKeepsPreactE8K2H144F80T200", keeping_preact(with({8, 2, 144, 80, 200, Route::zipf, 0, 200}, 400)),
       "up=single,down=single,order=global,split=none,pad=none"},
      {"Dims16SingleTileEdgesE8K1H272F48", with({8, 1, 272, 48, 835, Route::tile_edges, 0, 835}, 401),
       "up=single,down=single,order=global,split=none,pad=none"},
      {"Dims16SmallestE8K4H16F16T64", with({8, 4, 16, 16, 64, Route::uniform, 0, 64}, 402),
       "up=single,down=single,order=global,split=none,pad=none"},
      {"Dims16SinglePadHalvesE16K4H2064F1040T777", with({16, 4, 2064, 1040, 777, Route::with_drops, 77, 48}, 403),
       "up=single,down=single,order=expert,split=none,pad=up+down"},
      {"Dims16SingleGraphE8K2H1040F2064T300", with({8, 2, 1040, 2064, 300, Route::uniform, 128, 48}, 404, Mode::graph),
       "up=single,down=single,order=global,split=none,pad=none"},
      {"Dims16ClusterE8K2H2064F1040T1100", with({8, 2, 2064, 1040, 1100, Route::one_expert, 128, 48}, 405),
       "up=cluster,down=cluster,order=global,split=none,pad=none"},
      {"Dims16ClusterKeepsPreactZipfE16K4H4112F784T1024",
       keeping_preact(with({16, 4, 4112, 784, 1024, Route::zipf, 0, 16}, 406)),
       "up=cluster,down=cluster,order=expert,split=none,pad=none"},
      {"Dims16PairsKeepsPreactE8K2H1040F1024T700", keeping_preact(with({8, 2, 1040, 1024, 700, Route::zipf, 0, 48}, 407)),
       "up=pairs,down=single,order=global,split=none,pad=none"},
      {"Dims16SplitOneExpertE8K2H2064F1024T1700", with({8, 2, 2064, 1024, 1700, Route::one_expert, 128, 48}, 408),
       "order=expert,split=up+down,split_ctas=1", 1, 1},
      {"Dims16SplitDownOneExpertE4K1H2064F1040T1700", with({4, 1, 2064, 1040, 1700, Route::one_expert, 0, 48}, 409),
       "up=single,order=expert,split=down,split_ctas=1", -1, 1},
      {"Dims16SwapT1E32K4H2064F1040", with({32, 4, 2064, 1040, 1, Route::uniform, 0, 1}, 410), "swap=on"},
      {"Dims16SwapT33E32K4H2064F1040", with({32, 4, 2064, 1040, 33, Route::uniform, 0, 33}, 411), "swap=on"},
      {"Dims16SwapT65ZipfE32K4H2064F1040", with({32, 4, 2064, 1040, 65, Route::zipf, 0, 65}, 412), "swap=on"},
      {"Dims16SwapTileEdgesKeepsPreactE8K1H144F80", keeping_preact(with({8, 1, 144, 80, 835, Route::tile_edges, 0, 835}, 413)),
       "swap=on"},
      {"Dims16SwapSmallestE4K2H16F16T64", with({4, 2, 16, 16, 64, Route::uniform, 0, 64}, 414), "swap=on"},
      {"Dims16FusedT1E32K4H2064F1040", with({32, 4, 2064, 1040, 1, Route::uniform, 0, 1}, 415), "fused=on"},
      {"Dims16FusedT65ZipfE32K4H2064F1040", with({32, 4, 2064, 1040, 65, Route::zipf, 0, 65}, 416), "fused=on"},
      {"Dims16FusedE8K2H144F80T200", with({8, 2, 144, 80, 200, Route::zipf, 0, 200}, 417), "fused=on"},
      {"Dims16FusedGraphE32K4H1040F2064T128", with({32, 4, 1040, 2064, 128, Route::zipf, 31 * 128, 64}, 418, Mode::graph),
       "fused=on"},
  };
  return v;
}

void PrintTo(const Variant& v, std::ostream* os) { *os << v.name; }

epmoe::Sm90PlanOverride variant_override(const Variant& v) {
  epmoe::Sm90PlanOverride o = epmoe::parse_sm90_plan_override(v.plan);
  if (!o.swap_ab && !(o.fused && *o.fused)) o.swap_ab = false;
  if (!o.fused) o.fused = false;
  return o;
}

}  // namespace sm90_case
