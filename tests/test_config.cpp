#include <gtest/gtest.h>

#include "engine.h"
#include "epmoe/error.h"
#include "epmoe/moe_config.h"
#include "epmoe/tensor_view.h"

namespace epmoe {
namespace {

MoeConfig good() { return {.num_experts = 32, .top_k = 4, .hidden = 2048, .ffn = 1024, .world_size = 4, .rank = 1}; }

void expect_invalid(const MoeConfig& c, const std::string& needle) {
  try {
    c.validate();
    ADD_FAILURE() << "validate() accepted " << c.describe();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_config);
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(MoeConfig, AcceptsGood) {
  EXPECT_NO_THROW(good().validate());
  EXPECT_EQ(good().experts_per_rank(), 8);
  EXPECT_EQ(good().first_expert(), 8);
  EXPECT_EQ(good().owner_of(31), 3);
}

TEST(MoeConfig, RejectsEachRule) {
  auto c = good(); c.num_experts = 30; expect_invalid(c, "% world_size");
  c = good(); c.top_k = 33; expect_invalid(c, "top_k (33) > num_experts (32)");
  c = good(); c.top_k = 0; expect_invalid(c, "top_k must be > 0");
  c = good(); c.hidden = 2000 + 8; expect_invalid(c, "hidden (2008) must be a multiple of 16");
  c = good(); c.ffn = 100; expect_invalid(c, "ffn (100) must be a multiple of 16");
  c = good(); c.ffn = 0; expect_invalid(c, "ffn must be > 0");
  c = good(); c.rank = 4; expect_invalid(c, "rank 4 outside [0, 4)");
  c = good(); c.world_size = 0; expect_invalid(c, "world_size must be in");
  c = good(); c.num_experts = -8; expect_invalid(c, "num_experts must be > 0");
}

TEST(MoeConfig, AcceptsMultiplesOf16) {
  auto c = good();
  c.hidden = 144;
  c.ffn = 80;
  EXPECT_NO_THROW(c.validate());
}

TEST(MoeConfig, AgreementWordsIgnoreRank) {
  auto a = good(), b = good();
  b.rank = 3;
  EXPECT_EQ(a.agreement_words(), b.agreement_words());
  b.hidden = 4096;
  EXPECT_NE(a.agreement_words(), b.agreement_words());
}

TEST(TensorView, ContiguousAndChecks) {
  float buf[24];
  auto t = TensorView::contiguous(buf, DType::f32, {2, 3, 4});
  EXPECT_EQ(t.numel(), 24);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.stride[0], 12);
  EXPECT_EQ(t.describe(), "f32[2, 3, 4] cpu");
  EXPECT_NO_THROW(check_tensor(t, "t", DType::f32, {2, 3, 4}, DeviceType::cpu));
  EXPECT_THROW(check_tensor(t, "t", DType::bf16, {2, 3, 4}, DeviceType::cpu), Error);
  EXPECT_THROW(check_tensor(t, "t", DType::f32, {2, 3, 5}, DeviceType::cpu), Error);
  EXPECT_THROW(check_tensor(t, "t", DType::f32, {2, 3, 4}, DeviceType::cuda), Error);
  t.stride[0] = 13;
  EXPECT_FALSE(t.is_contiguous());
}

}  // namespace
}  // namespace epmoe
