// The sm_90a pipeline's host-side knobs and problem checks (kernels/sm90_launch_config.cuh): every
// bad value is a clear invalid_argument error, never a silent fallback. Runs without a GPU.
#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <string>
#include <utility>

#include "epmoe/error.h"
#include "kernels/expert_problem.cuh"
#include "kernels/sm90_common.cuh"
#include "kernels/sm90_experts.cuh"
#include "kernels/sm90_launch_config.cuh"

namespace {

using epmoe::kernels::sm90_cluster_mode;
using epmoe::kernels::sm90_down_uses_cluster;
using epmoe::kernels::sm90_gather_async_arrive;
using epmoe::kernels::sm90_group_tiles;
using epmoe::kernels::sm90_up_uses_cluster;
using epmoe::kernels::sm90::check_expert_problem;
using epmoe::kernels::sm90::sm90_pad_halves_auto;
using epmoe::kernels::sm90::kDownStagingBytes;
using epmoe::kernels::sm90::kDynSmemBytes;
using epmoe::kernels::sm90::kMaxDynSmemBytes;
using epmoe::kernels::sm90::kStaticSmemReserve;
using epmoe::kernels::sm90::kUpStagingBytes;
using epmoe::kernels::sm90::sm90_dyn_smem_bytes;
using epmoe::kernels::sm90::sm90_kernel_order_by_expert;
using epmoe::kernels::sm90::sm90_launch_plan;
using epmoe::kernels::sm90::sm90_work_items;

// Sets (or, with nullptr, unsets) one variable for the scope.
struct Env {
  std::string name;
  Env(const char* n, const char* v) : name(n) {
    if (v) setenv(n, v, 1);
    else unsetenv(n);
  }
  ~Env() { unsetenv(name.c_str()); }
};

epmoe::ErrorCode code_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const epmoe::Error& e) {
    return e.code();
  }
  ADD_FAILURE() << "no epmoe::Error thrown";
  return epmoe::ErrorCode::internal;
}

// Every value in `bad` set as `var` makes `read` (a knob's reader) throw invalid_argument.
void expect_rejected(const char* var, std::initializer_list<const char*> bad, const std::function<void()>& read) {
  for (const char* v : bad) {
    Env e(var, v);
    EXPECT_EQ(code_of(read), epmoe::ErrorCode::invalid_argument) << var << "=" << v;
  }
}

// Tile shape per kernel (EPMOE_SM90_UP_TILES / EPMOE_SM90_DOWN_TILES): whole unless set to granular;
// anything else is an error; the two variables are independent.
TEST(Sm90Knobs, TileShapeDefaultsAndValues) {
  using epmoe::kernels::sm90_down_granular;
  using epmoe::kernels::sm90_up_granular;
  for (const char* name : {"EPMOE_SM90_UP_TILES", "EPMOE_SM90_DOWN_TILES"}) {
    SCOPED_TRACE(name);
    const bool up = std::string(name) == "EPMOE_SM90_UP_TILES";
    const auto granular = [&] { return up ? sm90_up_granular() : sm90_down_granular(); };
    for (const char* v : {static_cast<const char*>(nullptr), "", "whole"}) {
      Env e(name, v);
      EXPECT_FALSE(granular());
    }
    {
      Env e(name, "granular");
      EXPECT_TRUE(granular());
    }
    expect_rejected(name, {"Granular", "auto", "1", "whole "}, [&] { granular(); });
  }
  Env up("EPMOE_SM90_UP_TILES", "granular");
  Env down("EPMOE_SM90_DOWN_TILES", nullptr);
  EXPECT_TRUE(sm90_up_granular());
  EXPECT_FALSE(sm90_down_granular());
}

// When the granular kernels claim their next item: end (default) two K steps before the item's last,
// first at step 0; items of 3 or fewer steps claim at step 0 either way.
TEST(Sm90Knobs, GranularClaimStep) {
  using epmoe::kernels::sm90_granular_claim_kt;
  {
    Env e("EPMOE_SM90_GRAN_CLAIM", nullptr);
    EXPECT_EQ(sm90_granular_claim_kt(112), 109);
    EXPECT_EQ(sm90_granular_claim_kt(32), 29);
    EXPECT_EQ(sm90_granular_claim_kt(4), 1);
    EXPECT_EQ(sm90_granular_claim_kt(3), 0);
    EXPECT_EQ(sm90_granular_claim_kt(1), 0);
  }
  {
    Env e("EPMOE_SM90_GRAN_CLAIM", "end");
    EXPECT_EQ(sm90_granular_claim_kt(112), 109);
  }
  {
    Env e("EPMOE_SM90_GRAN_CLAIM", "first");
    EXPECT_EQ(sm90_granular_claim_kt(112), 0);
  }
  {
    Env e("EPMOE_SM90_GRAN_CLAIM", "ahead");
    EXPECT_EQ(code_of([] { sm90_granular_claim_kt(112); }), epmoe::ErrorCode::invalid_argument);
  }
}

TEST(Sm90Knobs, ClusterModeDefaultsAndValues) {
  using epmoe::kernels::kClusterMinHidden;
  using epmoe::kernels::kClusterMinRowsPerExpert;
  using epmoe::kernels::sm90_cluster_knob;
  // Shapes: hidden 2048 with many rows per expert; 7168 with ~640 (E=32 k=8 T=2k) and ~2200 (T=8k).
  const int64_t cap2k = 2048 * 8 + 32 * 127, cap8k = 8192 * 8 + 32 * 127;
  for (const char* v : {static_cast<const char*>(nullptr), "", "auto"}) {
    Env e("EPMOE_SM90_CLUSTER", v);
    EXPECT_EQ(sm90_cluster_knob(), -1);
    EXPECT_EQ(sm90_cluster_mode(2048, 1 << 20, 32), 0);
    EXPECT_EQ(sm90_cluster_mode(7168, cap2k, 32), 0);
    EXPECT_EQ(sm90_cluster_mode(7168, cap8k, 32), 1);
    EXPECT_EQ(sm90_cluster_mode(kClusterMinHidden, 32 * kClusterMinRowsPerExpert, 32), 1);  // both bounds inclusive
    EXPECT_EQ(sm90_cluster_mode(kClusterMinHidden - 128, 32 * kClusterMinRowsPerExpert, 32), 0);
    EXPECT_EQ(sm90_cluster_mode(kClusterMinHidden, 32 * kClusterMinRowsPerExpert - 1, 32), 0);
    EXPECT_EQ(sm90_cluster_mode(7168, cap8k, 0), 0);  // no experts: no division, no clusters
    EXPECT_FALSE(sm90_up_uses_cluster(true, 7168, cap2k, 32));
    EXPECT_FALSE(sm90_down_uses_cluster(7168, cap2k, 32));
    EXPECT_TRUE(sm90_up_uses_cluster(true, 7168, cap8k, 32));
    EXPECT_TRUE(sm90_up_uses_cluster(false, 7168, cap8k, 32));
    EXPECT_TRUE(sm90_down_uses_cluster(7168, cap8k, 32));
  }
  {
    Env e("EPMOE_SM90_CLUSTER", "1");
    EXPECT_EQ(sm90_cluster_knob(), 1);
    EXPECT_TRUE(sm90_up_uses_cluster(true, 2048, 64, 32));
    EXPECT_TRUE(sm90_up_uses_cluster(false, 2048, 64, 32));
    EXPECT_TRUE(sm90_down_uses_cluster(2048, 64, 32));
  }
  {
    Env e("EPMOE_SM90_CLUSTER", "0");
    EXPECT_EQ(sm90_cluster_knob(), 0);
    EXPECT_FALSE(sm90_up_uses_cluster(false, 7168, cap8k, 32));
    EXPECT_FALSE(sm90_down_uses_cluster(7168, cap8k, 32));
  }
  {
    Env e("EPMOE_SM90_CLUSTER", "2");  // DOWN always, UP only when it reads xs
    EXPECT_EQ(sm90_cluster_knob(), 2);
    EXPECT_FALSE(sm90_up_uses_cluster(true, 2048, 64, 32));
    EXPECT_TRUE(sm90_up_uses_cluster(false, 2048, 64, 32));
    EXPECT_TRUE(sm90_down_uses_cluster(2048, 64, 32));
  }
  expect_rejected("EPMOE_SM90_CLUSTER", {"3", "-1", "one", "1x", "Auto"}, [] { (void)sm90_cluster_knob(); });
  expect_rejected("EPMOE_SM90_CLUSTER", {"3", "-1", "one", "1x", "Auto"},
                  [] { (void)sm90_cluster_mode(7168, 1 << 20, 32); });
}

// sm90_up_gather_form: with clusters auto the A-sharing pairs take the weight-multicast clusters' place
// (7168 T=8k) and run wherever the gathering UP is single (2048, 7168 T=2k); an explicit cluster value
// keeps the clusters; without the pairs (SHARE_A=off, the direct epilogue, ffn % 256 != 0, or padding
// halves forced to skip under auto) the 128-row kernel runs as the cluster rule says.
TEST(Sm90Knobs, UpGatherForm) {
  using epmoe::kernels::sm90_up_gather_form;
  using epmoe::kernels::UpGatherForm;
  const int64_t cap2k = 2048 * 8 + 32 * 127, cap8k = 8192 * 8 + 32 * 127;
  Env share("EPMOE_SM90_UP_SHARE_A", nullptr);
  {
    Env c("EPMOE_SM90_CLUSTER", nullptr);
    EXPECT_EQ(sm90_up_gather_form(7168, 2048, cap8k, 32, true), UpGatherForm::pairs);
    EXPECT_EQ(sm90_up_gather_form(7168, 2048, cap2k, 32, true), UpGatherForm::pairs);
    EXPECT_EQ(sm90_up_gather_form(2048, 1024, 1 << 20, 32, true), UpGatherForm::pairs);
    EXPECT_EQ(sm90_up_gather_form(7168, 2048, cap8k, 32, false), UpGatherForm::cluster);  // direct epilogue
    EXPECT_EQ(sm90_up_gather_form(7168, 640, cap8k, 32, true), UpGatherForm::cluster);    // 5 column blocks
    EXPECT_EQ(sm90_up_gather_form(2048, 640, 1 << 20, 32, true), UpGatherForm::single);
    {
      Env s("EPMOE_SM90_UP_SHARE_A", "off");
      EXPECT_EQ(sm90_up_gather_form(7168, 2048, cap8k, 32, true), UpGatherForm::cluster);
      EXPECT_EQ(sm90_up_gather_form(7168, 2048, cap2k, 32, true), UpGatherForm::single);
    }
    {
      Env p("EPMOE_SM90_PAD_HALVES", "skip");  // auto pairs step aside; "on" does not
      EXPECT_EQ(sm90_up_gather_form(7168, 2048, cap8k, 32, true), UpGatherForm::cluster);
      Env s("EPMOE_SM90_UP_SHARE_A", "on");
      EXPECT_EQ(sm90_up_gather_form(7168, 2048, cap8k, 32, true), UpGatherForm::pairs);
    }
  }
  {
    Env c("EPMOE_SM90_CLUSTER", "1");
    EXPECT_EQ(sm90_up_gather_form(7168, 2048, cap8k, 32, true), UpGatherForm::cluster);
    EXPECT_EQ(sm90_up_gather_form(2048, 1024, 1 << 20, 32, true), UpGatherForm::cluster);
    Env s("EPMOE_SM90_UP_SHARE_A", "on");
    EXPECT_EQ(sm90_up_gather_form(7168, 2048, cap8k, 32, true), UpGatherForm::cluster);
  }
  for (const char* mode : {"0", "2"}) {
    Env c("EPMOE_SM90_CLUSTER", mode);
    EXPECT_EQ(sm90_up_gather_form(7168, 2048, cap8k, 32, true), UpGatherForm::pairs) << mode;
    Env s("EPMOE_SM90_UP_SHARE_A", "off");
    EXPECT_EQ(sm90_up_gather_form(7168, 2048, cap8k, 32, true), UpGatherForm::single) << mode;
  }
}

TEST(Sm90Knobs, GroupTiles) {
  {
    Env e("EPMOE_SM90_GROUP", nullptr);
    EXPECT_EQ(sm90_group_tiles(), 16);
  }
  {
    Env e("EPMOE_SM90_GROUP", "5");
    EXPECT_EQ(sm90_group_tiles(), 5);
  }
  {
    Env e("EPMOE_SM90_GROUP", "0");  // 0 and 1 both mean tile-major
    EXPECT_EQ(sm90_group_tiles(), 1);
  }
  expect_rejected("EPMOE_SM90_GROUP", {"-4", "x", "16 ", "99999999"}, [] { (void)sm90_group_tiles(); });
}

TEST(Sm90Knobs, GatherArrive) {
  {
    Env e("EPMOE_SM90_GATHER_ARRIVE", nullptr);
    EXPECT_TRUE(sm90_gather_async_arrive());
  }
  {
    Env e("EPMOE_SM90_GATHER_ARRIVE", "wait");
    EXPECT_FALSE(sm90_gather_async_arrive());
  }
  Env e("EPMOE_SM90_GATHER_ARRIVE", "sync");
  EXPECT_EQ(code_of([] { (void)sm90_gather_async_arrive(); }), epmoe::ErrorCode::invalid_argument);
}

TEST(Sm90Knobs, WorkOrder) {
  using epmoe::kernels::kOrderByExpertMinHidden;
  using epmoe::kernels::sm90_order_by_expert;
  using epmoe::kernels::sm90_order_forced_by_expert;
  for (const char* v : {static_cast<const char*>(nullptr), "", "auto"}) {
    // auto (the default): by expert from hidden 4096 on (faster at 7168, slower at 2048).
    Env e("EPMOE_SM90_ORDER", v);
    EXPECT_FALSE(sm90_order_by_expert(32, 2048));
    EXPECT_FALSE(sm90_order_by_expert(32, kOrderByExpertMinHidden - 128));
    EXPECT_TRUE(sm90_order_by_expert(32, kOrderByExpertMinHidden));
    EXPECT_TRUE(sm90_order_by_expert(32, 7168));
    EXPECT_FALSE(sm90_order_by_expert(8192, 7168));  // the schedule does not fit: global
    EXPECT_FALSE(sm90_order_forced_by_expert());     // the granular kernels still run
  }
  {
    Env e("EPMOE_SM90_ORDER", "global");
    EXPECT_FALSE(sm90_order_by_expert(32, 2048));
    EXPECT_FALSE(sm90_order_by_expert(32, 7168));
    EXPECT_FALSE(sm90_order_forced_by_expert());
  }
  {
    Env e("EPMOE_SM90_ORDER", "expert");
    EXPECT_TRUE(sm90_order_by_expert(1, 2048));
    EXPECT_TRUE(sm90_order_by_expert(4096, 7168));
    // Too many experts for the schedule's offsets next to the ring: the global order.
    EXPECT_FALSE(sm90_order_by_expert(8192, 2048));
    EXPECT_TRUE(sm90_order_forced_by_expert());
  }
  expect_rejected("EPMOE_SM90_ORDER", {"Expert", "1", "tile", "AUTO"}, [] { (void)sm90_order_by_expert(32, 2048); });
  expect_rejected("EPMOE_SM90_ORDER", {"Expert", "1", "tile", "AUTO"}, [] { (void)sm90_order_forced_by_expert(); });
  EXPECT_EQ(sm90_dyn_smem_bytes(false, 32), kDynSmemBytes);
  EXPECT_EQ(sm90_dyn_smem_bytes(true, 32), kDynSmemBytes + 2 * 33 * 4 + 8);  // rounded to 16 B
  EXPECT_LE(sm90_dyn_smem_bytes(true, 4096), kMaxDynSmemBytes);
}

// A two-valued knob whose default is `yes`: unset -> true, `no` -> false, `yes` -> true, and every
// value in `bad` rejected.
void check_two_valued_knob(const char* name, bool (*read)(), const char* yes, const char* no,
                           std::initializer_list<const char*> bad) {
  {
    Env e(name, nullptr);
    EXPECT_TRUE(read()) << name;
  }
  {
    Env e(name, no);
    EXPECT_FALSE(read()) << name;
  }
  {
    Env e(name, yes);
    EXPECT_TRUE(read()) << name;
  }
  expect_rejected(name, bad, [read] { (void)read(); });
}

TEST(Sm90Knobs, DownFlushStep) {
  using epmoe::kernels::sm90_down_flush_step;
  {
    Env e("EPMOE_SM90_DOWN_FLUSH_STEP", nullptr);
    EXPECT_EQ(sm90_down_flush_step(16), 8);  // ffn 1024: the middle of the item's 16 k steps
    EXPECT_EQ(sm90_down_flush_step(32), 16);
    EXPECT_EQ(sm90_down_flush_step(12), 6);
    EXPECT_EQ(sm90_down_flush_step(2), 1);
  }
  {
    Env e("EPMOE_SM90_DOWN_FLUSH_STEP", "0");
    EXPECT_EQ(sm90_down_flush_step(16), 0);
  }
  {
    Env e("EPMOE_SM90_DOWN_FLUSH_STEP", "40");
    EXPECT_EQ(sm90_down_flush_step(16), 40);  // past the main loop: stored after it
  }
  expect_rejected("EPMOE_SM90_DOWN_FLUSH_STEP", {"-1", "half", "2x"}, [] { (void)sm90_down_flush_step(16); });
}

TEST(Sm90Knobs, EarlyDecode) {
  using epmoe::kernels::sm90_early_decode;
  {
    Env e("EPMOE_SM90_EARLY_DECODE", nullptr);
    EXPECT_EQ(sm90_early_decode(), 1);  // default: DOWN decodes its next item early, UP between items
  }
  for (int bits = 0; bits <= 3; ++bits) {
    const std::string v = std::to_string(bits);
    Env e("EPMOE_SM90_EARLY_DECODE", v.c_str());
    EXPECT_EQ(sm90_early_decode(), bits);
  }
  expect_rejected("EPMOE_SM90_EARLY_DECODE", {"4", "7", "-1", "down"}, [] { (void)sm90_early_decode(); });
}

// Default: one tanh.approx per element.
TEST(Sm90Knobs, Silu) {
  check_two_valued_knob("EPMOE_SM90_SILU", epmoe::kernels::sm90_up_silu_tanh, "tanh", "exp", {"Tanh", "1", "sigmoid"});
}

TEST(Sm90Knobs, UpShareA) {
  using epmoe::kernels::sm90_up_share_a_mode;
  {
    Env e("EPMOE_SM90_UP_SHARE_A", nullptr);
    EXPECT_EQ(sm90_up_share_a_mode(), 2);  // default auto
  }
  const std::pair<const char*, int> values[] = {{"off", 0}, {"on", 1}, {"auto", 2}};
  for (const auto& [value, mode] : values) {
    Env e("EPMOE_SM90_UP_SHARE_A", value);
    EXPECT_EQ(sm90_up_share_a_mode(), mode) << value;
  }
  expect_rejected("EPMOE_SM90_UP_SHARE_A", {"On", "1", "share"}, [] { (void)sm90_up_share_a_mode(); });
}

TEST(Sm90Knobs, Epilogues) {
  check_two_valued_knob("EPMOE_SM90_UP_EPILOGUE", epmoe::kernels::sm90_up_staged_epilogue, "staged", "direct",
                        {"Staged", "1", "smem"});
  check_two_valued_knob("EPMOE_SM90_DOWN_EPILOGUE", epmoe::kernels::sm90_down_staged_epilogue, "staged", "direct",
                        {"Staged", "1", "smem"});
  // Each kernel's staging buffers fit next to the ring (and the static barriers) on their own.
  for (size_t staging : {size_t(kUpStagingBytes), kDownStagingBytes}) {
    EXPECT_EQ(sm90_dyn_smem_bytes(false, 32, staging), sm90_dyn_smem_bytes(false, 32) + staging);
    EXPECT_LE(sm90_dyn_smem_bytes(false, 1 << 20, staging), kMaxDynSmemBytes - kStaticSmemReserve);
  }
  EXPECT_EQ(sm90_dyn_smem_bytes(true, 32, kUpStagingBytes),
            sm90_dyn_smem_bytes(true, 32) + kUpStagingBytes);  // schedule after the staging
  {
    Env e("EPMOE_SM90_ORDER", "expert");
    // With DOWN's staging the schedule fits for up to ~150 experts, with UP's for a few more; beyond
    // that the kernel runs the global order; without staging as sm90_order_by_expert.
    EXPECT_TRUE(sm90_kernel_order_by_expert(128, 2048, kDownStagingBytes));
    EXPECT_FALSE(sm90_kernel_order_by_expert(256, 2048, kDownStagingBytes));
    EXPECT_TRUE(sm90_kernel_order_by_expert(128, 2048, kUpStagingBytes));
    EXPECT_FALSE(sm90_kernel_order_by_expert(256, 2048, kUpStagingBytes));
    EXPECT_TRUE(sm90_kernel_order_by_expert(256, 2048, 0));
    EXPECT_TRUE(epmoe::kernels::sm90_order_by_expert(256, 2048));
    for (size_t staging : {size_t(0), size_t(kUpStagingBytes), kDownStagingBytes})
      for (int E : {1, 64, 128, 150, 169, 170, 171, 200, 4096, 8192})
        if (sm90_kernel_order_by_expert(E, 2048, staging))
          EXPECT_LE(sm90_dyn_smem_bytes(true, E, staging), kMaxDynSmemBytes - kStaticSmemReserve) << E;
  }
  {
    Env e("EPMOE_SM90_ORDER", nullptr);
    EXPECT_FALSE(sm90_kernel_order_by_expert(32, 2048, kDownStagingBytes));
    EXPECT_FALSE(sm90_kernel_order_by_expert(32, 2048, 0));
    EXPECT_TRUE(sm90_kernel_order_by_expert(32, 7168, kDownStagingBytes));  // auto at hidden 7168
    EXPECT_FALSE(sm90_kernel_order_by_expert(256, 7168, kDownStagingBytes));  // ... if it fits
  }
}

TEST(Sm90Knobs, TailSplit) {
  check_two_valued_knob("EPMOE_SM90_TAIL_SPLIT", epmoe::kernels::sm90_tail_split, "half", "off", {"1", "on", "Half"});
}

// EPMOE_SM90_UP_PAIR_TAIL: the A-sharing pairs' own last-wave halving follows EPMOE_SM90_TAIL_SPLIT
// unless set; its two values override it either way; bad values rejected.
TEST(Sm90Knobs, UpPairTail) {
  using epmoe::kernels::sm90_up_pair_tail_split;
  for (const char* split : {static_cast<const char*>(nullptr), "half", "off"}) {
    Env t("EPMOE_SM90_TAIL_SPLIT", split);
    {
      Env e("EPMOE_SM90_UP_PAIR_TAIL", nullptr);
      EXPECT_EQ(sm90_up_pair_tail_split(), split == nullptr || std::string(split) == "half");
    }
    {
      Env e("EPMOE_SM90_UP_PAIR_TAIL", "off");
      EXPECT_FALSE(sm90_up_pair_tail_split());
    }
    {
      Env e("EPMOE_SM90_UP_PAIR_TAIL", "half");
      EXPECT_TRUE(sm90_up_pair_tail_split());
    }
  }
  expect_rejected("EPMOE_SM90_UP_PAIR_TAIL", {"on", "1", "Half"}, [] { (void)sm90_up_pair_tail_split(); });
}

// EPMOE_SM90_TAIL_BY_EXPERT: on by default; sm90_tail_split_in passes the tail knob through in the
// global order and, by expert, only with this on.
TEST(Sm90Knobs, TailByExpert) {
  using epmoe::kernels::sm90_tail_by_expert;
  using epmoe::kernels::sm90_tail_split_in;
  {
    Env e("EPMOE_SM90_TAIL_BY_EXPERT", nullptr);
    EXPECT_TRUE(sm90_tail_by_expert());
    EXPECT_TRUE(sm90_tail_split_in(/*by_expert=*/false, true));
    EXPECT_FALSE(sm90_tail_split_in(/*by_expert=*/false, false));
    EXPECT_TRUE(sm90_tail_split_in(/*by_expert=*/true, true));
    EXPECT_FALSE(sm90_tail_split_in(/*by_expert=*/true, false));
  }
  {
    Env e("EPMOE_SM90_TAIL_BY_EXPERT", "on");
    EXPECT_TRUE(sm90_tail_by_expert());
    EXPECT_TRUE(sm90_tail_split_in(true, true));
    EXPECT_FALSE(sm90_tail_split_in(true, false));  // EPMOE_SM90_TAIL_SPLIT=off still wins
    EXPECT_TRUE(sm90_tail_split_in(false, true));
  }
  {
    Env e("EPMOE_SM90_TAIL_BY_EXPERT", "off");
    EXPECT_FALSE(sm90_tail_split_in(true, true));
    EXPECT_TRUE(sm90_tail_split_in(false, true));  // the global order keeps its halving
  }
  expect_rejected("EPMOE_SM90_TAIL_BY_EXPERT", {"half", "1", "On"}, [] { (void)sm90_tail_by_expert(); });
}

// EPMOE_SM90_PAD_HALVES: auto by default, the three values, bad values rejected; and the auto rule on
// the benchmark shapes (132 SMs, 50 MB L2, group 16; tiles from the bench's capacity T*k + E*127):
// it skips where a wave's weight streams fit in a quarter of L2 (E=32 k=4 2048/1024 at T >= 16k,
// DOWN of E=128 k=8 at T=16k and of 7168/2048 at T=8k) and computes elsewhere.
TEST(Sm90Knobs, PadHalves) {
  using epmoe::kernels::sm90_pad_halves_mode;
  {
    Env e("EPMOE_SM90_PAD_HALVES", nullptr);
    EXPECT_EQ(sm90_pad_halves_mode(), 2);
  }
  const std::pair<const char*, int> modes[] = {{"compute", 0}, {"skip", 1}, {"auto", 2}};
  for (const auto& [v, m] : modes) {
    Env e("EPMOE_SM90_PAD_HALVES", v);
    EXPECT_EQ(sm90_pad_halves_mode(), m) << v;
  }
  expect_rejected("EPMOE_SM90_PAD_HALVES", {"1", "Skip", "off"}, [] { (void)sm90_pad_halves_mode(); });
  const int64_t l2 = 50ll << 20;
  auto tiles = [](int64_t T, int k, int E) { return (T * k + int64_t(E) * 127 + 127) / 128; };
  struct Shape {
    int64_t T;
    int k, E, hidden, ffn;
    bool up, down;
  };
  const Shape shapes[] = {{1024, 4, 32, 2048, 1024, false, false},  {4096, 4, 32, 2048, 1024, false, false},
                          {16384, 4, 32, 2048, 1024, true, true},   {65536, 4, 32, 2048, 1024, true, true},
                          {131072, 4, 32, 2048, 1024, true, true},  {4096, 8, 128, 2048, 768, false, false},
                          {16384, 8, 128, 2048, 768, false, true},  {2048, 8, 32, 7168, 2048, false, false},
                          {8192, 8, 32, 7168, 2048, false, true}};
  for (const Shape& s : shapes) {
    EXPECT_EQ(sm90_pad_halves_auto(tiles(s.T, s.k, s.E), s.E, s.hidden, 132, 16, l2), s.up) << "UP T=" << s.T;
    EXPECT_EQ(sm90_pad_halves_auto(tiles(s.T, s.k, s.E), s.E, s.ffn, 132, 16, l2), s.down) << "DOWN T=" << s.T;
  }
  // Degenerate inputs never skip; a larger group means more partners per weight stream.
  EXPECT_FALSE(sm90_pad_halves_auto(0, 32, 2048, 132, 16, l2));
  EXPECT_FALSE(sm90_pad_halves_auto(544, 0, 2048, 132, 16, l2));
  EXPECT_FALSE(sm90_pad_halves_auto(544, 32, 2048, 132, 16, 0));
  EXPECT_FALSE(sm90_pad_halves_auto(544, 32, 2048, 132, 4, l2));
  EXPECT_TRUE(sm90_pad_halves_auto(544, 32, 2048, 132, 16, l2));
}

TEST(Sm90Knobs, GridItemBound) {
  EXPECT_EQ(sm90_work_items(10, 4, 8, false, true), 80);
  EXPECT_EQ(sm90_work_items(10, 4, 8, true, false), 40);
  // By expert, up to one odd expert per expert adds half a unit: (10 + 4) / 2 units.
  EXPECT_EQ(sm90_work_items(10, 4, 8, true, true), 56);
  EXPECT_EQ(sm90_work_items(3, 64, 8, true, true), 24);  // never more odd experts than tiles
}

// The launch plan is its three decisions chained: the fit with the staging, then smem and items.
TEST(Sm90Knobs, LaunchPlan) {
  for (const char* order : {static_cast<const char*>(nullptr), "expert"}) {
    Env e("EPMOE_SM90_ORDER", order);
    for (int hidden : {2048, 7168})
      for (size_t staging : {size_t(0), size_t(kUpStagingBytes), kDownStagingBytes})
        for (int E : {4, 128, 256})
          for (bool cluster : {false, true}) {
            const auto plan = sm90_launch_plan(529, E, hidden, 28, cluster, staging);
            const bool wanted = order != nullptr || hidden >= 4096;    // unset: auto
            const bool fits = wanted && (E <= 128 || staging == 0);  // see Sm90Knobs.Epilogues
            EXPECT_EQ(plan.by_expert, fits) << E << " " << hidden << " " << staging;
            EXPECT_EQ(plan.smem, sm90_dyn_smem_bytes(fits, E, staging));
            EXPECT_EQ(plan.items, sm90_work_items(529, E, 28, cluster, fits));
          }
  }
}

// A problem that passes, then one field broken at a time.
epmoe::kernels::ExpertProblem good_problem() {
  alignas(16) static unsigned char buf[1024];
  epmoe::kernels::ExpertProblem p;
  auto* bf = reinterpret_cast<__nv_bfloat16*>(buf);
  p.xs = bf;
  p.w1 = bf;
  p.w2 = bf;
  p.act = bf;
  p.out = bf;
  p.padded_offsets = reinterpret_cast<const int64_t*>(buf);
  p.pair_row = reinterpret_cast<const int32_t*>(buf);
  p.pair_weight = reinterpret_cast<const float*>(buf);
  p.rows_capacity = 256;
  p.out_rows = 100;
  p.experts = 4;
  p.hidden = 256;
  p.ffn = 384;
  return p;
}

TEST(Sm90Knobs, ExpertProblemChecks) {
  EXPECT_NO_THROW(check_expert_problem(good_problem(), "test"));
  auto expect_bad = [](epmoe::kernels::ExpertProblem p, const char* what) {
    try {
      check_expert_problem(p, "test");
      ADD_FAILURE() << what << ": accepted";
    } catch (const epmoe::Error& e) {
      EXPECT_EQ(e.code(), epmoe::ErrorCode::invalid_argument) << what;
    }
  };
  auto p = good_problem();
  p.hidden = 200;
  expect_bad(p, "hidden % 128");
  p = good_problem();
  p.ffn = 0;
  expect_bad(p, "ffn 0");
  p = good_problem();
  p.experts = 0;
  expect_bad(p, "no experts");
  p = good_problem();
  p.rows_capacity = int64_t(1) << 31;
  expect_bad(p, "rows_capacity 2^31");
  p = good_problem();
  p.pair_row = nullptr;
  expect_bad(p, "null pair_row");
  p = good_problem();
  p.w2 = reinterpret_cast<const __nv_bfloat16*>(reinterpret_cast<const unsigned char*>(p.w2) + 2);
  expect_bad(p, "misaligned w2");
  p = good_problem();
  p.xs = nullptr;
  p.x = p.w1;
  p.x_rows = 0;
  expect_bad(p, "x without rows");
}

}  // namespace
