// The fp64 reference backward (epmoe/reference.h) against central finite differences of the fp64
// reference forward, f = sum_t <dy_t, y_t>, for every input it returns a gradient of: x, the routing
// weights, W1, W2 - on small shapes with a dropped slot, a token routed nowhere and an idle expert.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "epmoe/reference.h"
#include "test_support.h"

namespace epmoe::test {
namespace {

struct Problem {
  int E, k, H, F;
  int64_t T;
  std::vector<int32_t> ids;
  std::vector<double> x, wts, w1, w2, dy;
};

Problem make_problem(int E, int k, int H, int F, int64_t T, uint64_t seed) {
  Problem p{E, k, H, F, T, {}, {}, {}, {}, {}, {}};
  const Routing r = make_routing(T, E, k, RoutingKind::with_drops, seed);
  p.ids = r.ids;
  p.wts.assign(r.weights.begin(), r.weights.end());
  auto fill = [&](std::vector<double>& v, size_t n, uint64_t s, double scale) {
    v.resize(n);
    for (size_t i = 0; i < n; ++i) v[i] = scale * normal(mix(seed, s, i));
  };
  fill(p.x, size_t(T) * H, 1, 1.0);
  fill(p.w1, size_t(E) * 2 * F * H, 2, 1.0 / std::sqrt(double(H)));
  fill(p.w2, size_t(E) * H * F, 3, 1.0 / std::sqrt(double(F)));
  fill(p.dy, size_t(T) * H, 4, 1.0);
  return p;
}

double objective(const Problem& p) {
  std::vector<double> y(size_t(p.T) * p.H);
  reference_moe_f64(p.x.data(), p.ids.data(), p.wts.data(), p.T, p.k, p.w1.data(), p.w2.data(), p.E, p.H, p.F,
                    y.data());
  double f = 0;
  for (size_t i = 0; i < y.size(); ++i) f += p.dy[i] * y[i];
  return f;
}

// Central differences over every element of `v` (a member of p) against `grad`. Step 1e-5: the
// truncation error ~ h^2 f''' ~ 1e-10 and the cancellation error ~ 1e-16 |f| / h ~ 1e-11 here, so a
// correct gradient agrees to ~1e-8 of its scale; any wrong term is O(1).
void check_fd(Problem& p, std::vector<double>& v, const std::vector<double>& grad, const char* what) {
  const double h = 1e-5;
  double scale = 1e-3;
  for (double g : grad) scale = std::max(scale, std::fabs(g));
  int bad = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    const double keep = v[i];
    v[i] = keep + h;
    const double fp = objective(p);
    v[i] = keep - h;
    const double fm = objective(p);
    v[i] = keep;
    const double fd = (fp - fm) / (2 * h);
    if (!(std::fabs(fd - grad[i]) <= 1e-6 * scale) && bad++ < 5)
      ADD_FAILURE() << what << "[" << i << "]: analytic " << grad[i] << ", finite difference " << fd;
  }
  EXPECT_EQ(bad, 0) << what;
}

void check_problem(Problem p) {
  std::vector<double> dx(p.x.size()), dwts(p.wts.size()), dw1(p.w1.size()), dw2(p.w2.size());
  reference_moe_backward_f64(p.x.data(), p.ids.data(), p.wts.data(), p.T, p.k, p.w1.data(), p.w2.data(), p.E, p.H,
                             p.F, p.dy.data(), dx.data(), dwts.data(), dw1.data(), dw2.data());
  check_fd(p, p.x, dx, "dx");
  check_fd(p, p.w1, dw1, "dw1");
  check_fd(p, p.w2, dw2, "dw2");
  // d(weight) of a dropped slot is 0 by definition (the slot is not in the sum); the others by FD.
  std::vector<double> kept = dwts;
  for (size_t i = 0; i < p.ids.size(); ++i)
    if (p.ids[i] < 0) EXPECT_EQ(dwts[i], 0.0) << "dropped slot " << i;
  check_fd(p, p.wts, kept, "d_topk_weights");
}

TEST(BackwardReference, MatchesFiniteDifferences) { check_problem(make_problem(3, 2, 6, 5, 8, 11)); }
TEST(BackwardReference, MatchesFiniteDifferencesTopOne) { check_problem(make_problem(4, 1, 8, 4, 6, 12)); }
TEST(BackwardReference, MatchesFiniteDifferencesWideK) { check_problem(make_problem(5, 4, 4, 7, 5, 13)); }

// An expert no token uses gets zero weight gradients; a token routed nowhere gets dx = 0.
TEST(BackwardReference, IdleExpertAndUnroutedToken) {
  Problem p = make_problem(4, 2, 6, 5, 4, 14);
  for (int64_t t = 0; t < p.T; ++t)
    for (int j = 0; j < p.k; ++j) {
      int32_t& e = p.ids[size_t(t * p.k + j)];
      if (e == 3) e = -1;  // expert 3 idle
    }
  for (int j = 0; j < p.k; ++j) p.ids[size_t(2 * p.k + j)] = -1;  // token 2 routed nowhere
  std::vector<double> dx(p.x.size()), dwts(p.wts.size()), dw1(p.w1.size()), dw2(p.w2.size());
  reference_moe_backward_f64(p.x.data(), p.ids.data(), p.wts.data(), p.T, p.k, p.w1.data(), p.w2.data(), p.E, p.H,
                             p.F, p.dy.data(), dx.data(), dwts.data(), dw1.data(), dw2.data());
  for (int64_t i = int64_t(3) * 2 * p.F * p.H; i < int64_t(4) * 2 * p.F * p.H; ++i) EXPECT_EQ(dw1[size_t(i)], 0.0);
  for (int64_t i = int64_t(3) * p.H * p.F; i < int64_t(4) * p.H * p.F; ++i) EXPECT_EQ(dw2[size_t(i)], 0.0);
  for (int c = 0; c < p.H; ++c) EXPECT_EQ(dx[size_t(2 * p.H + c)], 0.0);
  check_problem(p);
}

}  // namespace
}  // namespace epmoe::test
