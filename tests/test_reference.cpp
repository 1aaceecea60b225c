// The oracle itself: a hand-computed case and the properties every MoE layer has.
#include <gtest/gtest.h>

#include <cmath>

#include "epmoe/error.h"
#include "epmoe/reference.h"
#include "test_support.h"

namespace epmoe::test {
namespace {

TEST(Reference, HandComputedSingleExpert) {
  // E=1, hidden=2, ffn=1: gate row (1, 0), up row (0, 1), w2 column (2, -1).
  const std::vector<bf16> w1 = {bf16(1.f), bf16(0.f), bf16(0.f), bf16(1.f)};
  const std::vector<bf16> w2 = {bf16(2.f), bf16(-1.f)};
  const std::vector<bf16> x = {bf16(1.f), bf16(3.f)};
  const int32_t ids[] = {0};
  const float wt[] = {0.5f};
  float y[2];
  reference_moe(x.data(), ids, wt, 1, 1, w1.data(), w2.data(), 1, 2, 1, y);
  const float act = round_bf16(float(1.0 / (1.0 + std::exp(-1.0)) * 3.0));  // silu(1) * 3, in bf16
  EXPECT_NEAR(y[0], 0.5f * 2.f * act, 1e-6);
  EXPECT_NEAR(y[1], 0.5f * -1.f * act, 1e-6);
}

TEST(Reference, LinearInWeightsAndDropsContributeNothing) {
  const int T = 6, E = 4, k = 2, H = 128, F = 128;
  auto M = make_weights(E, H, F, 11);
  auto x = make_x(3, 0, T, H);
  auto R = make_routing(T, E, k, RoutingKind::uniform, 5);
  std::vector<float> y1(T * H), y2(T * H), ysplit(T * H);
  reference_moe(x.data(), R.ids.data(), R.weights.data(), T, k, M.w1.data(), M.w2.data(), E, H, F, y1.data());
  auto R2 = R;
  for (float& w : R2.weights) w *= 2;
  reference_moe(x.data(), R2.ids.data(), R2.weights.data(), T, k, M.w1.data(), M.w2.data(), E, H, F, y2.data());
  for (int i = 0; i < T * H; ++i) EXPECT_NEAR(y2[i], 2 * y1[i], 1e-5 * (1 + std::fabs(y1[i])));
  // Slot 1 dropped == slot 1 with weight 0; and the sum of the two single-slot runs is the whole.
  auto Ra = R, Rb = R;
  for (int t = 0; t < T; ++t) Ra.ids[t * k + 1] = -1, Rb.ids[t * k + 0] = -1;
  std::vector<float> ya(T * H), yb(T * H);
  reference_moe(x.data(), Ra.ids.data(), Ra.weights.data(), T, k, M.w1.data(), M.w2.data(), E, H, F, ya.data());
  reference_moe(x.data(), Rb.ids.data(), Rb.weights.data(), T, k, M.w1.data(), M.w2.data(), E, H, F, yb.data());
  for (int i = 0; i < T * H; ++i) EXPECT_NEAR(ya[i] + yb[i], y1[i], 1e-5 * (1 + std::fabs(y1[i])));
  // Outputs are O(1) with these weights (so relative tolerances elsewhere mean something).
  double ss = 0;
  for (float v : y1) ss += double(v) * v;
  const double rms = std::sqrt(ss / (T * H));
  EXPECT_GT(rms, 0.05);
  EXPECT_LT(rms, 20.0);
}

TEST(Reference, AllDroppedIsZero) {
  const int T = 3, E = 2, k = 2, H = 128, F = 128;
  auto M = make_weights(E, H, F, 1);
  auto x = make_x(1, 0, T, H);
  std::vector<int32_t> ids(T * k, -1);
  std::vector<float> w(T * k, 1.f), y(T * H, 7.f);
  reference_moe(x.data(), ids.data(), w.data(), T, k, M.w1.data(), M.w2.data(), E, H, F, y.data());
  for (float v : y) EXPECT_EQ(v, 0.f);
}

TEST(Reference, RejectsBadId) {
  const int H = 128, F = 128;
  auto M = make_weights(2, H, F, 1);
  auto x = make_x(1, 0, 1, H);
  const int32_t ids[] = {2};
  const float w[] = {1.f};
  std::vector<float> y(H);
  EXPECT_THROW(reference_moe(x.data(), ids, w, 1, 1, M.w1.data(), M.w2.data(), 2, H, F, y.data()), Error);
}

}  // namespace
}  // namespace epmoe::test
