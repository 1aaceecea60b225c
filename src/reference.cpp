// The dense reference: token by token, slot by slot, straight from the definition. fp64 dot
// products (an oracle one precision above every backend); the activation is rounded to bf16, as
// the backends hand it to the down projection.
#include "epmoe/reference.h"

#include <cmath>
#include <vector>

#include "epmoe/error.h"

namespace epmoe {

namespace {
double dot(const bf16* w, const float* x, int n) {
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int c = 0;
  for (; c + 4 <= n; c += 4) {
    s0 += double(w[c].f()) * x[c];
    s1 += double(w[c + 1].f()) * x[c + 1];
    s2 += double(w[c + 2].f()) * x[c + 2];
    s3 += double(w[c + 3].f()) * x[c + 3];
  }
  for (; c < n; ++c) s0 += double(w[c].f()) * x[c];
  return (s0 + s1) + (s2 + s3);
}
}  // namespace

void reference_moe(const bf16* x, const int32_t* ids, const float* wts, int64_t T, int k, const bf16* w1,
                   const bf16* w2, int E, int H, int F, float* y) {
  std::vector<float> xf(H), act(F);
  std::vector<double> acc(H);
  for (int64_t t = 0; t < T; ++t) {
    for (int c = 0; c < H; ++c) xf[c] = x[t * H + c].f();
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int j = 0; j < k; ++j) {
      const int e = ids[t * k + j];
      if (e == -1) continue;
      EPMOE_CHECK(e >= 0 && e < E, ErrorCode::expert_id_out_of_range, "reference_moe: id ", e, " at token ", t);
      const bf16* w1e = w1 + int64_t(e) * 2 * F * H;
      const bf16* w2e = w2 + int64_t(e) * H * F;
      for (int i = 0; i < F; ++i) {
        const double g = dot(w1e + int64_t(i) * H, xf.data(), H);
        const double u = dot(w1e + int64_t(F + i) * H, xf.data(), H);
        act[i] = round_bf16(float(g / (1.0 + std::exp(-g)) * u));
      }
      for (int c = 0; c < H; ++c) acc[c] += double(wts[t * k + j]) * dot(w2e + int64_t(c) * F, act.data(), F);
    }
    for (int c = 0; c < H; ++c) y[t * H + c] = float(acc[c]);
  }
}

}  // namespace epmoe
