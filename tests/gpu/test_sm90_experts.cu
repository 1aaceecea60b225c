// The sm_90a split expert pipeline against the dense reference: named cases and the table of kernel
// variants (knobs, modes, routings). The harness and what each case checks: sm90_case.h / .cu.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <ostream>
#include <string>
#include <vector>

#include "kernels/gather_rows.cuh"
#include "kernels/sm90_common.cuh"
#include "kernels/sm90_experts.cuh"
#include "sm90_case.h"
#include "sm90_variants.h"

namespace {

using namespace sm90_case;

// Both SwiGLU forms of the UP epilogue on n inputs (sm_90a only; elsewhere nothing is written).
__global__ void silu_forms_kernel(const float* x, float* y_tanh, float* y_exp, int n) {
#if EPMOE_SM90A_DEVICE
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) {
    y_tanh[i] = epmoe::kernels::sm90::silu_tanh(x[i]);
    y_exp[i] = epmoe::kernels::sm90::silu(x[i]);
  }
#else
  (void)x, (void)y_tanh, (void)y_exp, (void)n;
#endif
}

// ---- tests --------------------------------------------------------------------------------------

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

// The one-MUFU SwiGLU (silu(x) = h + h tanh.approx(h), h = x/2; the default, EPMOE_SM90_SILU=tanh)
// and the ex2/rcp form against silu in double, x in [-64, 64] every 2^-7 plus large magnitudes.
// Bound for the tanh form: |x| 2^-14 + 2^-24 absolute (an absolute bound: for x << 0 the result is
// h (1 + tanh(h)), a difference of nearly equal numbers). The PTX ISA promises tanh.approx.f32 to
// about 2^-11, i.e. |x| 2^-12 here; the H200 measured |x| 2^-18 at worst (0.007 of |x| 2^-11, S11-4),
// so 2^-14 keeps a factor 16 of margin and still fails a regression to the documented 2^-11. For
// x > 0 it is under 2^-13 of silu(x) >= x/2, far inside the bf16 rounding act gets anyway. The
// exp form (rcp.approx, ex2.approx): 1e-5 relative + 2^-24.
TEST(Sm90Experts, SiluFormsAccuracy) {
  REQUIRE_SM90();
  std::vector<float> xs;
  for (int i = -64 * 128; i <= 64 * 128; ++i) xs.push_back(float(i) / 128.0f);
  for (float v : {1e-6f, 1e-3f, 100.0f, 1000.0f, 3.0e4f}) {
    xs.push_back(v);
    xs.push_back(-v);
  }
  const int n = int(xs.size());
  DevBuf<float> dx{size_t(n)}, dt{size_t(n)}, de{size_t(n)};
  dx.upload(xs);
  silu_forms_kernel<<<(n + 255) / 256, 256>>>(dx.p, dt.p, de.p, n);
  EPMOE_CUDA_CHECK(cudaGetLastError());
  EPMOE_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> yt = dt.download(), ye = de.download();
  double worst_t = 0, worst_e = 0;  // |err| over each form's bound
  for (int i = 0; i < n; ++i) {
    const double x = xs[size_t(i)], ref = x / (1.0 + std::exp(-x));
    const double bound = std::fabs(x) * std::ldexp(1.0, -14) + std::ldexp(1.0, -24);
    const double et = std::fabs(double(yt[size_t(i)]) - ref) / bound;
    worst_t = std::max(worst_t, et);
    EXPECT_LE(et, 1.0) << "tanh form, x = " << x << ": " << yt[size_t(i)] << " vs " << ref;
    // (exp(-x) overflows for x < -88: the form returns -0 where silu is below 2^-24 anyway)
    const double ee = std::fabs(double(ye[size_t(i)]) - ref) / (std::fabs(ref) * 1e-5 + std::ldexp(1.0, -24));
    worst_e = std::max(worst_e, ee);
    EXPECT_LE(ee, 1.0) << "exp form, x = " << x << ": " << ye[size_t(i)] << " vs " << ref;
  }
  std::printf("[silu] %d inputs: worst |err| / bound: tanh form %.3f, exp form %.3f\n",
              n, worst_t, worst_e);
}

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
// The defaults at hidden 7168 with >= 1024 rows per expert: 2-CTA clusters (cluster auto) in the
// by-expert order (order auto), as at E=32 k=8 T=8k.
TEST(Sm90Experts, AutoClustersByExpertE4K2H7168F2048T2048) {
  ASSERT_EQ(epmoe::kernels::sm90_cluster_mode(7168, 2048 * 2, 4), 1) << "the case no longer runs clusters by default";
  ASSERT_TRUE(epmoe::kernels::sm90_order_by_expert(4, 7168));
  run_case({4, 2, 7168, 2048, 2048, Route::zipf, 0, 12});
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
// The gather_rows kernel + UP reading xs by TMA (EPMOE_SM90_GATHER=separate in the engine): the same
// checks, plus the xs rows bit-exact.
TEST(Sm90Experts, SeparateGatherSmallE4K2H256F256T64) { run_case(separate({4, 2, 256, 256, 64, Route::uniform, 0, 64})); }
TEST(Sm90Experts, SeparateGatherUniformE32K4H2048F1024T4096) {
  run_case(separate({32, 4, 2048, 1024, 4096, Route::uniform, 31 * 128, 48}));
}
TEST(Sm90Experts, SeparateGatherZipfE64K8H4096F768T1024) {
  run_case(separate({64, 8, 4096, 768, 1024, Route::zipf, 0, 16}));
}
TEST(Sm90Experts, SeparateGatherWithDropsE16K4H2048F1024T777) {
  run_case(separate({16, 4, 2048, 1024, 777, Route::with_drops, 77, 48}));
}
TEST(Sm90Experts, SeparateGatherGraphCaptured) {
  Case c{32, 4, 2048, 1024, 4096, Route::uniform, 31 * 128, 32};
  c.mode = Mode::graph;
  c.seed = 8;
  run_case(separate(c));
}
TEST(Sm90Experts, SeparateGatherLargeTE16K2H256F256T65536) {
  run_case(separate({16, 2, 256, 256, 65536, Route::uniform, 5000, 32}));
}

// One CTA per work item (EPMOE_SM90_PERSISTENT=0) instead of the persistent grid (one CTA per SM
// looping over items): every loop runs once, the ring never wraps across items.
TEST(Sm90Experts, NonPersistentGrid) {
  EnvGuard guard("EPMOE_SM90_PERSISTENT", "0");
  Case c{32, 4, 2048, 1024, 4096, Route::zipf, 300, 32};
  c.seed = 6;
  run_case(c);
}
TEST(Sm90Experts, NonPersistentLargeT) {
  EnvGuard guard("EPMOE_SM90_PERSISTENT", "0");
  Case c{16, 2, 256, 256, 65536, Route::uniform, 5000, 32};
  c.seed = 7;
  run_case(c);
}
// The UP kernel's fallback W1 map (two rank-3 boxes per stage instead of the folded rank-4 box).
TEST(Sm90Experts, PlainW1MapFallback) {
  EnvGuard guard("EPMOE_SM90_W1_PLAIN", "1");
  EnvGuard up_rows("EPMOE_SM90_UP_ROWS", "128");  // (pinned: the 192-row UP reads W1 through its own map)
  Case c{8, 2, 4096, 768, 600, Route::uniform, 0, 24};
  c.seed = 5;
  run_case(c);
}
// ---- kernel variants (the table: sm90_variants.cu) ----------------------------------------------
class Sm90Variant : public ::testing::TestWithParam<Variant> {};
TEST_P(Sm90Variant, MatchesReference) {
  EnvGuard cluster("EPMOE_SM90_CLUSTER", GetParam().cluster);
  EnvGuard group("EPMOE_SM90_GROUP", GetParam().group);
  EnvGuard order("EPMOE_SM90_ORDER", GetParam().order);
  // The variants test the 128-row kernels' paths: the gathering UP stays on single CTAs unless a
  // variant names EPMOE_SM90_UP_SHARE_A (the named cases above run the default: pairs wherever the
  // gathering UP runs single CTAs).
  EnvGuard share_a("EPMOE_SM90_UP_SHARE_A", "off");
  // ... and on 128-row tiles (today's default; pinned so that the variants keep testing the 128-row
  // kernels should the default change - the Tall* variants name EPMOE_SM90_UP_ROWS).
  EnvGuard up_rows("EPMOE_SM90_UP_ROWS", "128");
  // The split rows run the split rule without its wave test (every picked expert goes tall), so that
  // small problems put experts in both halves; the SplitWaves rows name EPMOE_SM90_UP_SPLIT_WAVES.
  EnvGuard split_waves("EPMOE_SM90_UP_SPLIT_WAVES", "off");
  // ... and leave the 192-row tiles' uncovered padding rows unwritten, where the harness reads the
  // split's choice from their poison (the named cases run the default: zeroed, and checked so); the
  // ZeroGap rows name EPMOE_SM90_UP_ZERO_GAP.
  EnvGuard zero_gap("EPMOE_SM90_UP_ZERO_GAP", "off");
  EnvGuard knob(GetParam().knob, GetParam().value);
  EnvGuard knob2(GetParam().knob2, GetParam().value2);
  CaseStats stats;
  run_case(GetParam().c, &stats);
  // The split rows must run both halves (else they test only the 128-row UP), unless they say otherwise.
  const Variant& v = GetParam();
  if (v.value != nullptr && std::string(v.value) == "split" && !HasFatalFailure() && !IsSkipped()) {
    if (v.split_tall == 0) EXPECT_EQ(stats.split_tall_experts, 0);
    if (v.split_tall == 1) EXPECT_GT(stats.split_tall_experts, 0) << "no expert went to the 192-row half";
  }
}
INSTANTIATE_TEST_SUITE_P(Sm90Experts, Sm90Variant, ::testing::ValuesIn(variants()),
                         [](const ::testing::TestParamInfo<Variant>& info) { return std::string(info.param.name); });
// Byte and element offsets past 2^31 in xs, act-free dims, and out: 310k rows of 7168.
TEST(Sm90Experts, Large64BitOffsets) {
  size_t free_b = 0, total_b = 0;
  REQUIRE_SM90();
  EPMOE_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  if (free_b < (size_t(16) << 30)) GTEST_SKIP() << "needs 16 GiB of free device memory";
  for (const char* tiles : {"whole", "granular"}) {  // the default 128-row kernels, then the granular ones
    SCOPED_TRACE(tiles);
    EnvGuard up("EPMOE_SM90_UP_TILES", tiles);
    EnvGuard down("EPMOE_SM90_DOWN_TILES", tiles);
    run_case({2, 1, 7168, 128, 310000, Route::uniform, 0, 24});
  }
}
// The same on the 192-row UP.
TEST(Sm90Experts, TallUpLarge64BitOffsets) {
  size_t free_b = 0, total_b = 0;
  REQUIRE_SM90();
  EPMOE_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  if (free_b < (size_t(16) << 30)) GTEST_SKIP() << "needs 16 GiB of free device memory";
  EnvGuard up_rows("EPMOE_SM90_UP_ROWS", "192");
  run_case({2, 1, 7168, 128, 310000, Route::uniform, 0, 24});
}
TEST(Sm90Experts, Large64BitOffsetsSeparateGather) {
  size_t free_b = 0, total_b = 0;
  REQUIRE_SM90();
  EPMOE_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  if (free_b < (size_t(16) << 30)) GTEST_SKIP() << "needs 16 GiB of free device memory";
  run_case(separate({2, 1, 7168, 128, 310000, Route::uniform, 0, 24}));
}

}  // namespace
