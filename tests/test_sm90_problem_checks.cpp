// The sm_90a pipeline's problem checks (sm90::check_expert_problem, kernels/sm90/launch.cuh; the FP8
// kernels' check_mx_expert_problem, kernels/sm90/swap_mx.cuh): every problem the kernels cannot run
// is a clear invalid_argument error before anything launches. Needs
// the CUDA headers (the ExpertProblem's bf16 pointers), not a GPU: built where CUDA is enabled.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "epmoe/error.h"
#include "kernels/expert_problem.cuh"
#include "kernels/sm90/launch.cuh"
#include "kernels/sm90/swap_mx.cuh"

namespace {

using epmoe::kernels::ExpertProblem;
using epmoe::kernels::sm90::check_expert_problem;

// A problem that passes (through make_expert_problem, as every caller builds it), then one field
// broken at a time.
ExpertProblem good_problem() {
  alignas(16) static unsigned char buf[1024];
  auto* bf = reinterpret_cast<__nv_bfloat16*>(buf);
  const epmoe::kernels::ExpertWeightsView w{bf, bf, 4, 256, 384};
  const epmoe::kernels::ExpertLayoutView layout{reinterpret_cast<const int64_t*>(buf),
                                                reinterpret_cast<const int32_t*>(buf),
                                                reinterpret_cast<const float*>(buf), 256};
  return epmoe::kernels::make_expert_problem(w, bf, 100, layout, bf, bf, 100);
}

TEST(Sm90ProblemChecks, RejectsWhatTheKernelsCannotRun) {
  EXPECT_NO_THROW(check_expert_problem(good_problem(), "test"));
  {
    ExpertProblem p = good_problem();
    p.zero_out = true;
    p.xs = nullptr;  // (the cuBLAS path's input: the sm_90 UP never reads it)
    EXPECT_NO_THROW(check_expert_problem(p, "test"));
  }
  auto expect_bad = [](const ExpertProblem& p, const char* what, const char* named) {
    try {
      check_expert_problem(p, "test");
      ADD_FAILURE() << what << ": accepted";
    } catch (const epmoe::Error& e) {
      EXPECT_EQ(e.code(), epmoe::ErrorCode::invalid_argument) << what;
      EXPECT_NE(std::string(e.what()).find(named), std::string::npos) << what << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find("test"), std::string::npos) << "the caller's name: " << e.what();
    }
  };
  auto p = good_problem();
  p.hidden = 200;  // a multiple of 8, not of 16
  expect_bad(p, "hidden % 16", "hidden");
  p = good_problem();
  p.ffn = 0;
  expect_bad(p, "ffn 0", "ffn");
  p = good_problem();
  p.ffn = 328;
  expect_bad(p, "ffn % 16", "ffn");
  p = good_problem();
  p.experts = 0;
  expect_bad(p, "no experts", "experts");
  p = good_problem();
  p.rows_capacity = int64_t(1) << 31;
  expect_bad(p, "rows_capacity 2^31", "rows_capacity");
  p = good_problem();
  p.rows_capacity = 0;
  expect_bad(p, "rows_capacity 0", "rows_capacity");
  p = good_problem();
  p.pair_row = nullptr;
  expect_bad(p, "null pair_row", "layout");
  p = good_problem();
  p.padded_offsets = nullptr;
  expect_bad(p, "null padded_offsets", "layout");
  p = good_problem();
  p.pair_weight = nullptr;
  expect_bad(p, "null pair_weight", "layout");
  p = good_problem();
  p.w2 = reinterpret_cast<const __nv_bfloat16*>(reinterpret_cast<const unsigned char*>(p.w2) + 2);
  expect_bad(p, "misaligned w2", "aligned");
  p = good_problem();
  p.act = nullptr;
  expect_bad(p, "null act", "aligned");
  // The UP always gathers its rows from x: x is required (xs alone does not do), with rows.
  p = good_problem();
  p.xs = p.x;
  p.x = nullptr;
  expect_bad(p, "xs without x", "x");
  p = good_problem();
  p.x_rows = 0;
  expect_bad(p, "x without rows", "x_rows");
}

// The FP8 problems: both scale formats in the tile form, MXFP8 in the swap-AB form too; block-128 in
// the swap-AB form (no such kernel) and dims off 128 refused; the packed row sizes of each format.
TEST(Sm90ProblemChecks, Fp8ProblemsByScaleFormat) {
  alignas(16) static unsigned char buf[1024];
  epmoe::kernels::MxExpertProblem p;
  p.x = p.w1 = p.w1_scale = p.w2 = p.w2_scale = p.act = buf;
  p.out = reinterpret_cast<__nv_bfloat16*>(buf);
  p.padded_offsets = reinterpret_cast<const int64_t*>(buf);
  p.pair_row = reinterpret_cast<const int32_t*>(buf);
  p.pair_weight = reinterpret_cast<const float*>(buf);
  p.x_rows = 10, p.out_rows = 10, p.experts = 4, p.hidden = 256, p.ffn = 384, p.rows_capacity = 512;
  using epmoe::kernels::Fp8Scales;
  using epmoe::kernels::MxForm;
  for (Fp8Scales f : {Fp8Scales::mx32, Fp8Scales::block128})
    for (MxForm form : {MxForm::swap, MxForm::tile}) {
      p.scales = f, p.form = form;
      if (f == Fp8Scales::block128 && form == MxForm::swap) {
        try {
          epmoe::kernels::check_mx_expert_problem(p, "test");
          ADD_FAILURE() << "block-128 in the swap-AB form was taken";
        } catch (const epmoe::Error& e) {
          EXPECT_EQ(e.code(), epmoe::ErrorCode::invalid_argument);
          EXPECT_NE(std::string(e.what()).find("tile form"), std::string::npos) << e.what();
        }
      } else {
        EXPECT_NO_THROW(epmoe::kernels::check_mx_expert_problem(p, "test"));
      }
    }
  // The fused form: MX scales and a 16-byte aligned fp32 accumulator.
  alignas(16) static float acc[64];
  p.scales = Fp8Scales::mx32, p.form = MxForm::fused;
  EXPECT_THROW(epmoe::kernels::check_mx_expert_problem(p, "test"), epmoe::Error);  // no out_acc
  p.out_acc = acc + 1;
  EXPECT_THROW(epmoe::kernels::check_mx_expert_problem(p, "test"), epmoe::Error);  // misaligned
  p.out_acc = acc;
  EXPECT_NO_THROW(epmoe::kernels::check_mx_expert_problem(p, "test"));
  p.scales = Fp8Scales::block128;
  EXPECT_THROW(epmoe::kernels::check_mx_expert_problem(p, "test"), epmoe::Error);
  // The fused form has no separate UP / DOWN launch (refused before anything is launched).
  p.scales = Fp8Scales::mx32;
  EXPECT_THROW(epmoe::kernels::sm90_mx_up_launch(p, nullptr), epmoe::Error);
  EXPECT_THROW(epmoe::kernels::sm90_mx_down_launch(p, nullptr, false), epmoe::Error);
  p.out_acc = nullptr;
  p.scales = Fp8Scales::block128, p.form = MxForm::tile, p.ffn = 320;  // (a multiple of 32 and 64, not 128)
  EXPECT_THROW(epmoe::kernels::check_mx_expert_problem(p, "test"), epmoe::Error);
  // hidden 2048: MX 2048 + 64 scale bytes; block-128 2048 + 16 fp32 scales; 384: 12 and 3 x 4 bytes, padded to 16.
  EXPECT_EQ(epmoe::kernels::fp8_packed_row_bytes(Fp8Scales::mx32, 2048), 2048 + 64);
  EXPECT_EQ(epmoe::kernels::fp8_packed_row_bytes(Fp8Scales::block128, 2048), 2048 + 64);
  EXPECT_EQ(epmoe::kernels::fp8_packed_row_bytes(Fp8Scales::mx32, 384), 384 + 16);
  EXPECT_EQ(epmoe::kernels::fp8_packed_row_bytes(Fp8Scales::block128, 384), 384 + 16);
  EXPECT_EQ(epmoe::kernels::fp8_packed_row_bytes(Fp8Scales::block128, 7168), 7168 + 224);
}

}  // namespace
