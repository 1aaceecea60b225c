// The sm_90a split expert pipeline against the dense reference: named cases on their default plans,
// one case per plan the heuristics can pick (the catalog), and the table of non-default plans (the
// variants); plus the kernels' pieces that have a unit test of their own (SwiGLU, the cuBLAS path's
// row gather, the device's split rule). No test selects a kernel through the environment: every
// choice is the plan's (epmoe/sm90_plan.h). The harness and what each case checks: sm90_case.h / .cu.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "epmoe/error.h"
#include "epmoe/sm90_plan.h"
#include "kernels/fallback/gather_rows.cuh"
#include "kernels/heuristics/sm90_heuristics.h"
#include "kernels/sm90/core/ptx.cuh"
#include "kernels/sm90/experts.cuh"
#include "kernels/sm90/schedule.cuh"
#include "kernels/sm90/up_common.cuh"
#include "kernels/sm90/work_items.cuh"
#include "sm90_case.h"
#include "sm90_variants.h"

namespace {

using namespace sm90_case;
using epmoe::parse_sm90_plan_override;
using epmoe::Sm90Plan;
using epmoe::Sm90PlanOverride;

// The UP epilogue's SwiGLU on n inputs (sm_90a only; elsewhere nothing is written).
__global__ void silu_kernel(const float* x, float* y, int n) {
#if EPMOE_SM90A_DEVICE
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) y[i] = epmoe::kernels::sm90::silu_tanh(x[i]);
#else
  (void)x, (void)y, (void)n;
#endif
}

// The kernels' split rule (warp_split_tall_cut), one warp, every lane's result (sm_90a only; -2
// elsewhere).
__global__ void split_cut_kernel(const int64_t* padded_offsets, const int32_t* pair_row, int experts, int blocks,
                                 int ctas, int* cut) {
#if EPMOE_SM90A_DEVICE
  const epmoe::kernels::sm90::SplitRule rule{pair_row, blocks, ctas};
  cut[threadIdx.x] = epmoe::kernels::sm90::warp_split_tall_cut(padded_offsets, experts, rule);
#else
  (void)padded_offsets, (void)pair_row, (void)experts, (void)blocks, (void)ctas;
  cut[threadIdx.x] = -2;
#endif
}

// ---- the kernels' pieces ------------------------------------------------------------------------

// The cuBLAS fallback's gather (kernels/fallback/gather_rows.cuh): rows below the total bit-exact (x
// row or zeros), rows past it untouched.
TEST(Sm90Experts, GatherRowsBitExact) {
  REQUIRE_SM90();  // gather itself runs anywhere, but keep the suite's gate uniform
  const int H = 384;
  const int64_t x_rows = 1000, cap = 3000, total = 2560;
  std::vector<int32_t> prow(static_cast<size_t>(cap));
  for (int64_t i = 0; i < cap; ++i) {
    const uint64_t h = mix64(i + 12345);
    prow[size_t(i)] = (h % 5 == 0) ? -1 : int32_t((h >> 8) % uint64_t(x_rows));
  }
  DevBuf<uint16_t> x(size_t(x_rows) * H), xs(size_t(cap) * H);
  DevBuf<int32_t> d_prow{size_t(cap)};
  DevBuf<int64_t> d_total(1);
  fill_hash_kernel<<<256, 256>>>(x.p, int64_t(x.n), 77, 1.0f);
  d_prow.upload(prow);
  d_total.upload(std::vector<int64_t>{total});
  EPMOE_CUDA_CHECK(cudaMemset(xs.p, 0xFF, xs.bytes()));
  epmoe::kernels::gather_rows_launch(reinterpret_cast<const __nv_bfloat16*>(x.p), x_rows, H, d_prow.p, d_total.p, cap,
                                     reinterpret_cast<__nv_bfloat16*>(xs.p), nullptr);
  EPMOE_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> got = xs.download();
  int64_t bad = 0;
  for (int64_t r = 0; r < cap; ++r)
    for (int c = 0; c < H; ++c) {
      uint16_t want;
      if (r >= total) want = 0xFFFF;
      else if (prow[size_t(r)] < 0) want = 0;
      else want = hash_bf16(77, uint64_t(prow[size_t(r)]) * H + c, 1.0f);
      bad += got[size_t(r) * H + c] != want;
    }
  EXPECT_EQ(bad, 0);
}

// The one-MUFU SwiGLU (silu(x) = h + h tanh.approx(h), h = x/2) against silu in double, x in [-64, 64]
// every 2^-7 plus large magnitudes. Bound: |x| 2^-14 + 2^-24 absolute (an absolute bound: for x << 0
// the result is h (1 + tanh(h)), a difference of nearly equal numbers). The PTX ISA promises
// tanh.approx.f32 to about 2^-11, i.e. |x| 2^-12 here; the H200 measured |x| 2^-18 at worst (0.007 of
// |x| 2^-11), so 2^-14 keeps a factor 16 of margin and still fails a regression to the
// documented 2^-11. For x > 0 it is under 2^-13 of silu(x) >= x/2, far inside the bf16 rounding act
// gets anyway.
TEST(Sm90Experts, SiluAccuracy) {
  REQUIRE_SM90();
  std::vector<float> xs;
  for (int i = -64 * 128; i <= 64 * 128; ++i) xs.push_back(float(i) / 128.0f);
  for (float v : {1e-6f, 1e-3f, 100.0f, 1000.0f, 3.0e4f}) {
    xs.push_back(v);
    xs.push_back(-v);
  }
  const int n = int(xs.size());
  DevBuf<float> dx{size_t(n)}, dy{size_t(n)};
  dx.upload(xs);
  EPMOE_CUDA_CHECK(cudaMemset(dy.p, 0xFF, dy.bytes()));  // NaN: an unwritten output fails
  silu_kernel<<<(n + 255) / 256, 256>>>(dx.p, dy.p, n);
  EPMOE_CUDA_CHECK(cudaGetLastError());
  EPMOE_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> y = dy.download();
  double worst = 0;  // |err| over the bound
  for (int i = 0; i < n; ++i) {
    const double x = xs[size_t(i)], ref = x / (1.0 + std::exp(-x));
    const double bound = std::fabs(x) * std::ldexp(1.0, -14) + std::ldexp(1.0, -24);
    const double e = std::fabs(double(y[size_t(i)]) - ref) / bound;
    worst = std::max(worst, std::isnan(e) ? 1e30 : e);
    EXPECT_LE(e, 1.0) << "x = " << x << ": " << y[size_t(i)] << " vs " << ref;
  }
  std::printf("[silu] %d inputs: worst |err| / bound %.3f\n", n, worst);
}

// The device's split rule (warp_split_tall_cut: 32 experts a step, warp scans) equals the host's
// sequential one (split_tall_cut, which the CPU suite checks against its definition) on random
// layouts: segments padded to 128 rows with their padding at the tail, empty ones among them, up to
// 300 experts, 1 and 132 CTAs, several column-block counts. Every lane must return the same cut.
TEST(Sm90Schedule, DeviceSplitCutMatchesHost) {
  REQUIRE_SM90();
  std::mt19937_64 rng(90);
  const int experts[] = {1, 2, 5, 31, 32, 33, 64, 100, 255, 256, 300};
  int trials = 0, nonzero = 0, partial = 0;
  DevBuf<int> d_cut{32};
  for (int E : experts)
    for (int ctas : {1, 132})
      for (int round = 0; round < 6; ++round) {
        const int blocks = std::vector<int>{1, 2, 5, 8, 16, 28}[size_t(round)];
        const int mean = std::vector<int>{1, 60, 150, 400, 900, 2000}[size_t((round + E) % 6)];
        std::vector<int64_t> offs{0};
        std::vector<int32_t> prow;
        int picked = 0;
        for (int e = 0; e < E; ++e) {
          const int n = rng() % 5 == 0 ? 0 : int(rng() % uint64_t(2 * mean + 1));
          const int64_t seg = (int64_t(n) + 127) / 128 * 128;
          for (int64_t r = 0; r < seg; ++r) prow.push_back(r < n ? int32_t(prow.size()) : -1);
          offs.push_back(offs.back() + seg);
        }
        for (int e = 0; e < E; ++e)
          picked += epmoe::kernels::sm90::split_expert(offs.data(), prow.data(), e, blocks).picked;
        const int want = epmoe::kernels::sm90::split_tall_cut(offs.data(), prow.data(), E, blocks, ctas);
        DevBuf<int64_t> d_offs{offs.size()};
        DevBuf<int32_t> d_prow{std::max<size_t>(prow.size(), 1)};
        d_offs.upload(offs);
        d_prow.upload(prow);
        EPMOE_CUDA_CHECK(cudaMemset(d_cut.p, 0xFF, d_cut.bytes()));
        split_cut_kernel<<<1, 32>>>(d_offs.p, d_prow.p, E, blocks, ctas, d_cut.p);
        EPMOE_CUDA_CHECK(cudaGetLastError());
        EPMOE_CUDA_CHECK(cudaDeviceSynchronize());
        const std::vector<int> got = d_cut.download();
        for (int lane = 0; lane < 32; ++lane)
          ASSERT_EQ(got[size_t(lane)], want) << "E=" << E << " ctas=" << ctas << " blocks=" << blocks << " mean rows "
                                             << mean << " lane " << lane << " (" << picked << " experts picked)";
        ++trials;
        nonzero += want > 0;
        // The wave test kept a picked expert on 128 rows (the cut below the last picked expert).
        int last_picked = 0;
        for (int e = 0; e < E; ++e)
          if (epmoe::kernels::sm90::split_expert(offs.data(), prow.data(), e, blocks).picked) last_picked = e + 1;
        partial += want > 0 && want < last_picked;
      }
  // The layouts exercise the rule: some cut nothing, some cut every picked expert, some stop between.
  EXPECT_GT(nonzero, trials / 4) << trials << " layouts";
  EXPECT_LT(nonzero, trials);
  EXPECT_GT(partial, 0) << "no layout where the wave test stops inside the picked experts";
  std::printf("[split] %d layouts: %d with a cut, %d stopping inside the picked experts\n", trials, nonzero, partial);
}

// ---- named cases, default plans -------------------------------------------------------------------
// A small case for compute-sanitizer memcheck/racecheck in gpu_check (the filter is *Small*).
TEST(Sm90Experts, SmallE4K2H256F256T64) { run_case({4, 2, 256, 256, 64, Route::uniform, 0, 64}); }
// Also a sanitizer case, with several items per CTA (67 row tiles: UP ~540 and DOWN ~270 items on
// 132 persistent CTAs): the ring's stages, item slots and DOWN's staging rows are reused across
// items, which the one-item cases above never do - racecheck checks each rewrite against the
// previous item's reads.
TEST(Sm90Experts, SmallMultiItemE4K2H1024F1024T4096) { run_case({4, 2, 1024, 1024, 4096, Route::uniform, 0, 64}); }

// Uniform routing, the main shapes.
TEST(Sm90Experts, UniformE8K2H2048F1024T128) { run_case({8, 2, 2048, 1024, 128, Route::uniform, 0, 128}); }
TEST(Sm90Experts, UniformE16K4H4096F768T7) { run_case({16, 4, 4096, 768, 7, Route::uniform, 384, 7}); }
TEST(Sm90Experts, UniformE4K2H7168F2048T1) { run_case({4, 2, 7168, 2048, 1, Route::uniform, 130, 1}); }
TEST(Sm90Experts, UniformE8K4H7168F2048T512) { run_case({8, 4, 7168, 2048, 512, Route::uniform, 0, 12}); }
// The defaults at hidden 7168 with >= 1024 rows per expert: DOWN on 2-CTA clusters in the by-expert
// order with both splits, as at E=32 k=8 T=8k.
TEST(Sm90Experts, DefaultClustersByExpertE4K2H7168F2048T2048) {
  const Case c{4, 2, 7168, 2048, 2048, Route::zipf, 0, 12};
  const Sm90Plan want = epmoe::kernels::choose_sm90_plan(case_shape(c), kH200);
  ASSERT_TRUE(want.down_cluster && want.up_order == epmoe::Sm90Order::by_expert && want.up_split)
      << "the case no longer runs clusters by expert by default: " << to_string(want);
  CaseStats st;
  run_case(c, {}, &st);
  if (IsSkipped() || HasFatalFailure()) return;
  // (the device's SMs and L2 only move split_ctas and the padding halves)
  EXPECT_TRUE(st.plan.down_cluster && st.plan.up_order == want.up_order && st.plan.down_order == want.down_order)
      << to_string(st.plan);
}
TEST(Sm90Experts, UniformE32K4H2048F1024T4096) { run_case({32, 4, 2048, 1024, 4096, Route::uniform, 31 * 128, 48}); }
// Skewed routing: hot experts with many tiles, a cold tail with few or no rows.
TEST(Sm90Experts, ZipfE32K4H2048F1024T4096) { run_case({32, 4, 2048, 1024, 4096, Route::zipf, 1000, 48}); }
TEST(Sm90Experts, ZipfE64K8H4096F768T1024) { run_case({64, 8, 4096, 768, 1024, Route::zipf, 0, 16}); }
// Every token to one expert (all other experts empty; other slots dropped).
TEST(Sm90Experts, OneExpertE8K2H2048F768T1000) { run_case({8, 2, 2048, 768, 1000, Route::one_expert, 128, 48}); }
// Experts with exactly one row each (and empty ones).
TEST(Sm90Experts, SingleRowExpertsE16K1H4096F1024T12) {
  run_case({16, 1, 4096, 1024, 12, Route::single_rows, 0, 12});
}
// Dropped slots and tokens routed nowhere.
TEST(Sm90Experts, WithDropsE16K4H2048F1024T777) { run_case({16, 4, 2048, 1024, 777, Route::with_drops, 77, 48}); }
// hidden % 256 == 128: the DOWN kernel's last column tile is half out of range.
TEST(Sm90Experts, HalfTileE4K2H640F768T300) { run_case({4, 2, 640, 768, 300, Route::uniform, 0, 64}); }
// Many tiles, small dims.
TEST(Sm90Experts, LargeTE16K2H256F256T65536) { run_case({16, 2, 256, 256, 65536, Route::uniform, 5000, 64}); }
// The pieces launched separately (no PDL) and the CUDA-graph form (side-stream zeroing, replayed).
// A saving forward's UP also stores h (ExpertProblem::preact): each 128-row form (pairs where ffn % 256
// == 0, single, cluster), skew, drops and the tile edges; a plan that splits runs no 192-row UP then.
TEST(Sm90Experts, KeepsPreactPairsZipfE32K4H2048F1024T4096) {
  run_case(keeping_preact({32, 4, 2048, 1024, 4096, Route::zipf, 1000, 48}));
}
TEST(Sm90Experts, KeepsPreactSingleTileEdgesE16H1024F768) {
  run_case(keeping_preact({16, 1, 1024, 768, 16 * 128, Route::tile_edges, 0, 48}),
           parse_sm90_plan_override("up=single,pad=up"));
}
TEST(Sm90Experts, KeepsPreactClusterDropsE16K4H2048F1024T777) {
  run_case(keeping_preact({16, 4, 2048, 1024, 777, Route::with_drops, 77, 48}), parse_sm90_plan_override("up=cluster"));
}
TEST(Sm90Experts, KeepsPreactSplitPlanE8K4H7168F2048T512) {
  run_case(keeping_preact({8, 4, 7168, 2048, 512, Route::zipf, 0, 12}),
           parse_sm90_plan_override("order=expert,split=up,split_ctas=1"));
}

TEST(Sm90Experts, SeparateNoPdl) {
  Case c{16, 4, 2048, 1024, 2048, Route::zipf, 256, 32};
  c.mode = Mode::separate_no_pdl;
  c.seed = 3;
  run_case(c);
}
TEST(Sm90Experts, GraphCaptured) {
  Case c{32, 4, 2048, 1024, 4096, Route::uniform, 31 * 128, 32};
  c.mode = Mode::graph;
  c.seed = 4;
  run_case(c);
}
// (The UP from xs, one CTA per item and the plain-W1-map fallback cases are gone with their paths;
// the plain W1 map is the cluster form's path, which the catalog and the variants run.)

// Byte and element offsets past 2^31 in x, act-free dims, and out: 310k rows of 7168.
TEST(Sm90Experts, Large64BitOffsets) {
  size_t free_b = 0, total_b = 0;
  REQUIRE_SM90();
  EPMOE_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  if (free_b < (size_t(16) << 30)) GTEST_SKIP() << "needs 16 GiB of free device memory";
  run_case({2, 1, 7168, 128, 310000, Route::uniform, 0, 24});
}
// The same on the 192-row UP: the split UP with split_ctas=1 on one expert of 310080 = 192 x 1615 rows
// (an odd multiple of 192: its 1615 tall tiles cover 64 rows fewer than its 310144-row segment, so
// the split rule sends it tall).
TEST(Sm90Experts, TallUpLarge64BitOffsets) {
  size_t free_b = 0, total_b = 0;
  REQUIRE_SM90();
  EPMOE_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  if (free_b < (size_t(16) << 30)) GTEST_SKIP() << "needs 16 GiB of free device memory";
  CaseStats st;
  run_case({2, 1, 7168, 128, 192 * 1615, Route::one_expert, 0, 24},
           parse_sm90_plan_override("order=expert,split=up,split_ctas=1"), &st);
  if (IsSkipped() || HasFatalFailure()) return;
  EXPECT_TRUE(st.plan.up_split) << to_string(st.plan);
  EXPECT_EQ(st.up_tall_experts, 1) << "the split rule must send the one expert to the 192-row UP";
}

// ---- the catalog: one case per plan the default rules pick (sm90_variants.h) -------------------------
class Sm90Catalog : public ::testing::TestWithParam<CatalogCase> {};
TEST_P(Sm90Catalog, MatchesReference) {
  const CatalogCase& cc = GetParam();
  CaseStats st;
  run_case(cc.c, epmoe::kernels::full_override(cc.plan), &st);
  if (IsSkipped() || HasFatalFailure()) return;
  EXPECT_EQ(st.plan, cc.plan) << "ran " << to_string(st.plan) << ", the catalog's " << to_string(cc.plan);
  EXPECT_EQ(st.shape.rows_capacity, cc.shape.rows_capacity);
}
INSTANTIATE_TEST_SUITE_P(Sm90Experts, Sm90Catalog, ::testing::ValuesIn(catalog_cases()),
                         [](const ::testing::TestParamInfo<CatalogCase>& info) { return info.param.name; });

// Host only: each catalog case has its entry's shape (the capacity the layout fits in) and that
// shape picks the entry's plan on the H200, so the suite runs every default plan.
TEST(Sm90CatalogCases, MatchTheCatalog) {
  const auto catalog = epmoe::kernels::sm90_plan_catalog(kH200);
  ASSERT_EQ(catalog_cases().size(), catalog.size());
  ASSERT_FALSE(catalog.empty());
  for (size_t i = 0; i < catalog.size(); ++i) {
    const CatalogCase& cc = catalog_cases()[i];
    SCOPED_TRACE(cc.name);
    const epmoe::kernels::Sm90Shape s = case_shape(cc.c);
    EXPECT_EQ(s.experts, catalog[i].first.experts);
    EXPECT_EQ(s.hidden, catalog[i].first.hidden);
    EXPECT_EQ(s.ffn, catalog[i].first.ffn);
    EXPECT_EQ(s.rows_capacity, catalog[i].first.rows_capacity) << "the padded rows outgrow the catalog's capacity";
    EXPECT_EQ(epmoe::kernels::choose_sm90_plan(s, kH200), catalog[i].second) << to_string(catalog[i].second);
    EXPECT_LE(s.rows_capacity, int64_t(1) << 18) << "a catalog case too large to run in seconds";
    std::printf("[catalog] %s: E=%d k=%d hidden=%d ffn=%d T=%lld rows_capacity=%lld\n", cc.name.c_str(), cc.c.E,
                cc.c.k, cc.c.hidden, cc.c.ffn, (long long)cc.c.T, (long long)s.rows_capacity);
  }
}

// ---- kernel variants: non-default plans (the table: sm90_variants.cu) ---------------------------------
// `want` (1 some, 0 none, -1 either) against the experts the host rule sends tall (-1: not split).
void expect_tall(const char* what, int want, int got) {
  if (want < 0) return;
  ASSERT_GE(got, 0) << what << ": the row expects a split its plan does not have";
  if (want == 0) EXPECT_EQ(got, 0) << what << ": experts went to the 192-row half";
  else EXPECT_GT(got, 0) << what << ": no expert went to the 192-row half";
}

class Sm90Variant : public ::testing::TestWithParam<Variant> {};
TEST_P(Sm90Variant, MatchesReference) {
  const Variant& v = GetParam();
  Sm90PlanOverride o;
  try {
    o = variant_override(v);
  } catch (const epmoe::Error& e) {
    FAIL() << "'" << v.plan << "': " << e.what();
  }
  CaseStats st;
  run_case(v.c, o, &st);
  if (IsSkipped() || HasFatalFailure()) return;
  // The split rows must run both halves (else they test only the 128-row kernels), unless they say
  // otherwise.
  expect_tall("UP", v.up_tall, st.up_tall_experts);
  expect_tall("DOWN", v.down_tall, st.down_tall_experts);
}
INSTANTIATE_TEST_SUITE_P(Sm90Experts, Sm90Variant, ::testing::ValuesIn(variants()),
                         [](const ::testing::TestParamInfo<Variant>& info) { return std::string(info.param.name); });

// Host only: every row's override is valid for its shape on the H200 (an invalid row would fail on
// the GPU only; here it fails loudly without one) and its split expectation holds for the host rule;
// names are unique.
TEST(Sm90Variants, PlansAreValid) {
  std::set<std::string> names;
  ASSERT_GE(variants().size(), 60u);
  for (const Variant& v : variants()) {
    SCOPED_TRACE(v.name);
    EXPECT_TRUE(names.insert(v.name).second) << "duplicate name";
    Sm90PlanOverride o;
    try {
      o = variant_override(v);
    } catch (const epmoe::Error& e) {
      ADD_FAILURE() << "'" << v.plan << "': " << e.what();
      continue;
    }
    const epmoe::kernels::Sm90Shape s = case_shape(v.c);
    Sm90Plan plan;
    try {
      plan = epmoe::kernels::resolve_sm90_plan(s, kH200, o);
    } catch (const epmoe::Error& e) {
      ADD_FAILURE() << "'" << v.plan << "' invalid for E=" << s.experts << " hidden=" << s.hidden << " ffn=" << s.ffn
                    << " rows_capacity=" << s.rows_capacity << ": " << e.what();
      continue;
    }
    const CaseStats st = case_stats(v.c, plan);
    expect_tall("UP", v.up_tall, st.up_tall_experts);
    expect_tall("DOWN", v.down_tall, st.down_tall_experts);
    std::printf("[variant] %s: {%s} tall up/down %d/%d\n", v.name, to_string(plan).c_str(), st.up_tall_experts,
                st.down_tall_experts);
  }
}

}  // namespace
