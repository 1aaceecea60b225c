// The FP8 layers' form rule (kernels/heuristics/mx_heuristics.h): golden rows and the overrides, plain
// C++ (no CUDA).
#include <gtest/gtest.h>

#include <cstdint>
#include <optional>

#include "kernels/heuristics/mx_heuristics.h"

namespace {

// ---- the MXFP8 layer's form (kernels/heuristics/mx_heuristics.h) --------------------------------------
// Golden rows at the benchmark shapes: decode stays swap-AB, T = 16k (E=32 k=4: 2048 rows per expert)
// takes the tile form; the boundary is a mean of 64 real rows per expert.
TEST(MxHeuristics, TileFormFromSixtyFourRowsPerExpert) {
  struct Row {
    int64_t pairs;
    int experts;
    bool tile;
  };
  const Row rows[] = {{0, 8, false},      {4, 32, false},     {512, 32, false},  {2047, 32, false}, {2048, 32, true},
                      {65536, 32, true},  {1024, 128, false}, {8192, 128, true}, {100, 0, false}};
  for (const Row& r : rows)
    EXPECT_EQ(epmoe::kernels::mx_tile_form_pays(r.pairs, r.experts), r.tile) << r.pairs << " pairs, " << r.experts
                                                                              << " experts";
}

// The MXFP8 layer's form with the fused pipeline and the overrides (choose_mx_form), golden rows at the
// benchmark shapes: the fused form up to a quarter pair per local expert (E=32 k=4: T <= 2; E=128 k=8:
// T <= 4), split swap-AB above it, the tile form from 64 rows per expert; fused=on forces the fused
// form, fused=off keeps the rule's split choice, swap=on|off the split forms.
TEST(MxHeuristics, FormsWithTheFusedPipelineAndOverrides) {
  using epmoe::kernels::choose_mx_form;
  using epmoe::kernels::MxForm;
  struct Row {
    int64_t pairs;
    int experts;
    MxForm form;
  };
  const Row rows[] = {{0, 32, MxForm::swap},     {4, 32, MxForm::fused},     {8, 32, MxForm::fused},
                      {9, 32, MxForm::swap},     {16, 32, MxForm::swap},     {512, 32, MxForm::swap},
                      {2048, 32, MxForm::tile},  {8, 128, MxForm::fused},    {32, 128, MxForm::fused},
                      {33, 128, MxForm::swap},   {64, 128, MxForm::swap},    {8192, 128, MxForm::tile},
                      {1, 3, MxForm::swap},      {1, 4, MxForm::fused},      {5, 0, MxForm::swap}};
  for (const Row& r : rows) {
    EXPECT_EQ(choose_mx_form(r.pairs, r.experts, std::nullopt, std::nullopt), r.form) << r.pairs << " pairs, " << r.experts;
    EXPECT_EQ(choose_mx_form(r.pairs, r.experts, std::nullopt, true), MxForm::fused);
    EXPECT_EQ(choose_mx_form(r.pairs, r.experts, true, true), MxForm::fused);
    EXPECT_EQ(choose_mx_form(r.pairs, r.experts, true, std::nullopt), MxForm::swap);
    EXPECT_EQ(choose_mx_form(r.pairs, r.experts, false, std::nullopt), MxForm::tile);
    EXPECT_EQ(choose_mx_form(r.pairs, r.experts, std::nullopt, false), r.form == MxForm::fused ? MxForm::swap : r.form);
  }
}

}  // namespace
