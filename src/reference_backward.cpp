// The fp64 layer and its exact gradients (epmoe/reference.h), straight from the definition, token
// by token and slot by slot: the oracle the backends' backward is checked against.
#include <cmath>
#include <vector>

#include "epmoe/error.h"
#include "epmoe/reference.h"

namespace epmoe {

namespace {
struct Slot {
  std::vector<double> g, u, a, o;
};
// [g, u], a and o of token t through expert e.
void slot_forward(const double* xt, const double* w1e, const double* w2e, int H, int F, Slot& s) {
  s.g.assign(F, 0.0);
  s.u.assign(F, 0.0);
  s.a.assign(F, 0.0);
  s.o.assign(H, 0.0);
  for (int i = 0; i < F; ++i) {
    for (int c = 0; c < H; ++c) {
      s.g[i] += w1e[int64_t(i) * H + c] * xt[c];
      s.u[i] += w1e[int64_t(F + i) * H + c] * xt[c];
    }
    s.a[i] = s.g[i] / (1.0 + std::exp(-s.g[i])) * s.u[i];
  }
  for (int c = 0; c < H; ++c)
    for (int i = 0; i < F; ++i) s.o[c] += w2e[int64_t(c) * F + i] * s.a[i];
}
int checked_expert(const int32_t* ids, int64_t t, int k, int j, int E) {
  const int e = ids[t * k + j];
  EPMOE_CHECK(e >= -1 && e < E, ErrorCode::expert_id_out_of_range, "reference: id ", e, " at token ", t);
  return e;
}
}  // namespace

void reference_moe_f64(const double* x, const int32_t* ids, const double* wts, int64_t T, int k, const double* w1,
                       const double* w2, int E, int H, int F, double* y) {
  Slot s;
  for (int64_t t = 0; t < T; ++t) {
    double* yt = y + t * H;
    for (int c = 0; c < H; ++c) yt[c] = 0.0;
    for (int j = 0; j < k; ++j) {
      const int e = checked_expert(ids, t, k, j, E);
      if (e < 0) continue;
      slot_forward(x + t * H, w1 + int64_t(e) * 2 * F * H, w2 + int64_t(e) * H * F, H, F, s);
      for (int c = 0; c < H; ++c) yt[c] += wts[t * k + j] * s.o[c];
    }
  }
}

void reference_moe_backward_f64(const double* x, const int32_t* ids, const double* wts, int64_t T, int k,
                                const double* w1, const double* w2, int E, int H, int F, const double* dy, double* dx,
                                double* dwts, double* dw1, double* dw2) {
  for (int64_t i = 0; i < int64_t(E) * 2 * F * H; ++i) dw1[i] = 0.0;
  for (int64_t i = 0; i < int64_t(E) * H * F; ++i) dw2[i] = 0.0;
  Slot s;
  std::vector<double> da(F), dh(size_t(2) * F);
  for (int64_t t = 0; t < T; ++t) {
    const double* xt = x + t * H;
    const double* dyt = dy + t * H;
    double* dxt = dx + t * H;
    for (int c = 0; c < H; ++c) dxt[c] = 0.0;
    for (int j = 0; j < k; ++j) {
      const int e = checked_expert(ids, t, k, j, E);
      dwts[t * k + j] = 0.0;
      if (e < 0) continue;
      const double* w1e = w1 + int64_t(e) * 2 * F * H;
      const double* w2e = w2 + int64_t(e) * H * F;
      const double sw = wts[t * k + j];
      slot_forward(xt, w1e, w2e, H, F, s);
      double ds = 0.0;
      for (int c = 0; c < H; ++c) ds += dyt[c] * s.o[c];
      dwts[t * k + j] = ds;
      for (int i = 0; i < F; ++i) {
        double v = 0.0;
        for (int c = 0; c < H; ++c) v += w2e[int64_t(c) * F + i] * dyt[c];
        da[i] = sw * v;
        const double sg = 1.0 / (1.0 + std::exp(-s.g[i]));
        dh[i] = da[i] * s.u[i] * sg * (1.0 + s.g[i] * (1.0 - sg));
        dh[F + i] = da[i] * s.g[i] * sg;
      }
      for (int c = 0; c < H; ++c) {
        double v = 0.0;
        for (int o = 0; o < 2 * F; ++o) v += w1e[int64_t(o) * H + c] * dh[o];
        dxt[c] += v;
      }
      double* dw2e = dw2 + int64_t(e) * H * F;
      for (int c = 0; c < H; ++c)
        for (int i = 0; i < F; ++i) dw2e[int64_t(c) * F + i] += sw * dyt[c] * s.a[i];
      double* dw1e = dw1 + int64_t(e) * 2 * F * H;
      for (int o = 0; o < 2 * F; ++o)
        for (int c = 0; c < H; ++c) dw1e[int64_t(o) * H + c] += dh[o] * xt[c];
    }
  }
}

}  // namespace epmoe
