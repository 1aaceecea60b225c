#include "backward_case.h"

#include <cmath>
#include <sstream>
#include <vector>

#include "epmoe/reference.h"

namespace epmoe::test {

std::string BackwardCase::name() const {
  std::ostringstream os;
  os << ep.name() << (policy == SavePolicy::rows_recompute ? "_recompute" : "_saveh")
     << (grad_dtype == DType::bf16 ? "_bf16" : "_f32");
  return os.str();
}

std::vector<bf16> dy_of(const EpCase& c, int rank) {
  return random_bf16(size_t(c.tokens_of(rank)) * c.hidden, mix(c.seed, 900 + rank), 1.0f);
}

// got (float) against ref (double) by the criteria of kGradElem / kGradL2 (+ one bf16 rounding).
::testing::AssertionResult grad_close(const char* what, const std::vector<float>& got, const std::vector<double>& ref) {
  double maxref = 0, e2 = 0, r2 = 0, worst = 0;
  for (double v : ref) maxref = std::max(maxref, std::fabs(v));
  size_t bad = 0, first_bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = std::fabs(double(got[i]) - ref[i]);
    if (!std::isfinite(got[i]) || d > kGradElem * maxref + 1e-30) {
      if (bad++ == 0) first_bad = i;
    }
    worst = std::max(worst, d);
    e2 += d * d;
    r2 += ref[i] * ref[i];
  }
  const double l2 = r2 > 0 ? std::sqrt(e2 / r2) : std::sqrt(e2);
  if (bad == 0 && l2 <= kGradL2) return ::testing::AssertionSuccess();
  auto f = ::testing::AssertionFailure();
  f << what << ": " << bad << " elements off, relative L2 " << l2 << ", worst |err| " << worst << " (max |ref| "
    << maxref << ")";
  if (bad) f << "; first at " << first_bad << ": " << got[first_bad] << " vs " << ref[first_bad];
  return f;
}

std::vector<float> as_float(const std::vector<bf16>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = v[i].f();
  return f;
}

ReferenceGrads reference_grads(const EpCase& c, int me) {
  const int W = c.world, E = c.E, k = c.k, H = c.hidden, F = c.ffn, El = E / W;
  const ModelWeights mw = make_weights(E, H, F, c.seed);
  std::vector<double> w1d(mw.w1.size()), w2d(mw.w2.size());
  for (size_t i = 0; i < w1d.size(); ++i) w1d[i] = mw.w1[i].f();
  for (size_t i = 0; i < w2d.size(); ++i) w2d[i] = mw.w2[i].f();
  std::vector<double> dw1_ref(w1d.size(), 0.0), dw2_ref(w2d.size(), 0.0);
  std::vector<double> t1(w1d.size()), t2(w2d.size());
  ReferenceGrads r;
  for (int p = 0; p < W; ++p) {
    const int64_t Tp = c.tokens_of(p);
    const std::vector<bf16> xp = make_x(c.seed, p, Tp, H), dyp = dy_of(c, p);
    const Routing Rp = routing_of(c, p);
    std::vector<double> xd(xp.size()), dyd(dyp.size()), wd(Rp.weights.begin(), Rp.weights.end());
    for (size_t i = 0; i < xd.size(); ++i) xd[i] = xp[i].f();
    for (size_t i = 0; i < dyd.size(); ++i) dyd[i] = dyp[i].f();
    std::vector<double> dxp(xd.size()), dwp(wd.size());
    reference_moe_backward_f64(xd.data(), Rp.ids.data(), wd.data(), Tp, k, w1d.data(), w2d.data(), E, H, F, dyd.data(),
                               dxp.data(), dwp.data(), t1.data(), t2.data());
    for (size_t i = 0; i < t1.size(); ++i) dw1_ref[i] += t1[i];
    for (size_t i = 0; i < t2.size(); ++i) dw2_ref[i] += t2[i];
    if (p == me) {
      r.dx = dxp;
      r.dwts = dwp;
    }
    for (int64_t t = 0; t < Tp; ++t)  // rows this rank received from p: p's tokens with an expert here
      for (int j = 0; j < k; ++j)
        if (Rp.ids[t * k + j] >= 0 && Rp.ids[t * k + j] / El == me) {
          ++r.recv_rows;
          break;
        }
  }
  r.dw1.assign(dw1_ref.begin() + int64_t(me) * El * 2 * F * H, dw1_ref.begin() + int64_t(me + 1) * El * 2 * F * H);
  r.dw2.assign(dw2_ref.begin() + int64_t(me) * El * H * F, dw2_ref.begin() + int64_t(me + 1) * El * H * F);
  return r;
}

namespace {

struct Grads {
  std::vector<bf16> dx;
  std::vector<float> dw;
  std::vector<float> dw1_f, dw2_f;  // f32 tensors, or the bf16 ones widened
  std::vector<bf16> dw1_b, dw2_b;
};

}  // namespace

BackwardReport run_backward_case_cpu(const BackwardCase& bc, std::shared_ptr<Communicator> comm) {
  const EpCase& c = bc.ep;
  const int me = comm->rank(), W = c.world, E = c.E, k = c.k, H = c.hidden, F = c.ffn, El = E / W;
  const int64_t T = c.tokens_of(me);
  const ModelWeights mw = make_weights(E, H, F, c.seed);
  const MoeConfig cfg{.num_experts = E, .top_k = k, .hidden = H, .ffn = F, .world_size = W, .rank = me};
  std::vector<bf16> w1(mw.w1_of(me * El), mw.w1_of(me * El) + size_t(El) * 2 * F * H);
  std::vector<bf16> w2(mw.w2_of(me * El), mw.w2_of(me * El) + size_t(El) * H * F);
  const ExpertWeights weights{TensorView::contiguous(w1.data(), DType::bf16, {El, 2 * F, H}),
                              TensorView::contiguous(w2.data(), DType::bf16, {El, H, F})};
  LayerOptions opt;
  opt.save_policy = bc.policy;
  MoeLayer layer(cfg, weights, comm, opt);
  LayerOptions other_opt;
  other_opt.save_policy = bc.policy == SavePolicy::rows_recompute ? SavePolicy::rows_and_preactivation
                                                                   : SavePolicy::rows_recompute;
  MoeLayer other(cfg, weights, comm, other_opt);

  const std::vector<bf16> x = make_x(c.seed, me, T, H);
  const Routing R = routing_of(c, me);
  const std::vector<bf16> dy = dy_of(c, me);
  std::vector<bf16> y(size_t(T) * H);
  auto view = [](const auto& v, DType t, std::initializer_list<int64_t> s) {
    return TensorView::contiguous(const_cast<void*>(static_cast<const void*>(v.data())), t, s);
  };
  std::vector<int32_t> ids = R.ids;
  std::vector<float> wts = R.weights;

  auto run = [&](MoeLayer& l, Grads& g, bool accumulate) {
    MoeForwardContext ctx;
    l.forward(view(x, DType::bf16, {T, H}), view(ids, DType::i32, {T, k}), view(wts, DType::f32, {T, k}),
              view(y, DType::bf16, {T, H}), nullptr, &ctx);
    g.dx.assign(size_t(T) * H, bf16(-7.0f));  // poison: backward must write every element
    g.dw.assign(size_t(T) * k, -7.0f);
    ExpertGradients eg;
    eg.accumulate = accumulate;
    if (bc.grad_dtype == DType::f32) {
      if (!accumulate) {
        g.dw1_f.assign(size_t(El) * 2 * F * H, -7.0f);
        g.dw2_f.assign(size_t(El) * H * F, -7.0f);
      }
      eg.dw1 = view(g.dw1_f, DType::f32, {El, 2 * F, H});
      eg.dw2 = view(g.dw2_f, DType::f32, {El, H, F});
    } else {
      if (!accumulate) {
        g.dw1_b.assign(size_t(El) * 2 * F * H, bf16(-7.0f));
        g.dw2_b.assign(size_t(El) * H * F, bf16(-7.0f));
      }
      eg.dw1 = view(g.dw1_b, DType::bf16, {El, 2 * F, H});
      eg.dw2 = view(g.dw2_b, DType::bf16, {El, H, F});
    }
    l.backward(ctx, view(dy, DType::bf16, {T, H}), view(g.dx, DType::bf16, {T, H}), view(g.dw, DType::f32, {T, k}),
               eg);
    return ctx;
  };

  Grads g;
  const MoeForwardContext ctx = run(layer, g, /*accumulate=*/false);
  BackwardReport rep;
  rep.pairs = ctx.routed_pairs();
  rep.activation_bytes_per_pair = ctx.activation_bytes_per_pair();
  EXPECT_EQ(ctx.policy(), bc.policy);

  // ---- the fp64 reference, over every rank's tokens -------------------------------------------------
  const ReferenceGrads ref = reference_grads(c, me);
  const int64_t recv_rows = ref.recv_rows;
  rep.recv_rows = recv_rows;
  const std::string tag = bc.name() + " rank " + std::to_string(me);
  EXPECT_TRUE(grad_close("dx", as_float(g.dx), ref.dx)) << tag;
  EXPECT_TRUE(grad_close("d_topk_weights", g.dw, ref.dwts)) << tag;
  for (int64_t i = 0; i < T * k; ++i)
    if (ids[size_t(i)] < 0) EXPECT_EQ(g.dw[size_t(i)], 0.0f) << tag << ": dropped slot " << i << " needs d = 0";
  const std::vector<float> dw1 = bc.grad_dtype == DType::f32 ? g.dw1_f : as_float(g.dw1_b);
  const std::vector<float> dw2 = bc.grad_dtype == DType::f32 ? g.dw2_f : as_float(g.dw2_b);
  EXPECT_TRUE(grad_close("dw1", dw1, ref.dw1)) << tag;
  EXPECT_TRUE(grad_close("dw2", dw2, ref.dw2)) << tag;

  // ---- the saved bytes: the rows, plus h (2 ffn bf16 per pair) when kept -----------------------------
  if (rep.pairs > 0) {
    const double rows_share = double(recv_rows) * H * 2 / double(rep.pairs);
    const double want = rows_share + (bc.policy == SavePolicy::rows_and_preactivation ? 2.0 * F * 2 : 0.0);
    EXPECT_DOUBLE_EQ(rep.activation_bytes_per_pair, want) << tag;
    EXPECT_LE(rep.activation_bytes_per_pair, 2.0 * F * 2 + double(H) * 2) << tag;  // <= 2 ffn bf16 + a row
  } else {
    EXPECT_EQ(rep.activation_bytes_per_pair, 0.0) << tag;
  }

  // ---- determinism, the other policy, accumulation --------------------------------------------------
  Grads again, other_g;
  (void)run(layer, again, false);
  (void)run(other, other_g, false);
  auto same_bits = [&](const Grads& a, const char* what) {
    bool same = a.dw == g.dw;
    for (size_t i = 0; same && i < g.dx.size(); ++i) same = a.dx[i].bits == g.dx[i].bits;
    if (bc.grad_dtype == DType::f32) {
      same = same && a.dw1_f == g.dw1_f && a.dw2_f == g.dw2_f;
    } else {
      for (size_t i = 0; same && i < g.dw1_b.size(); ++i) same = a.dw1_b[i].bits == g.dw1_b[i].bits;
      for (size_t i = 0; same && i < g.dw2_b.size(); ++i) same = a.dw2_b[i].bits == g.dw2_b[i].bits;
    }
    EXPECT_TRUE(same) << tag << ": " << what << " gave other gradients";
  };
  same_bits(again, "a second backward");
  same_bits(other_g, "the other save policy");
  if (bc.grad_dtype == DType::f32) {
    Grads acc;
    acc.dw1_f.resize(g.dw1_f.size());
    acc.dw2_f.resize(g.dw2_f.size());
    for (size_t i = 0; i < acc.dw1_f.size(); ++i) acc.dw1_f[i] = float(int(i % 7) - 3) * 0.25f;
    for (size_t i = 0; i < acc.dw2_f.size(); ++i) acc.dw2_f[i] = float(int(i % 5) - 2) * 0.5f;
    const std::vector<float> p1 = acc.dw1_f, p2 = acc.dw2_f;
    (void)run(layer, acc, /*accumulate=*/true);
    size_t off = 0;
    for (size_t i = 0; i < p1.size(); ++i) off += acc.dw1_f[i] != p1[i] + g.dw1_f[i];
    for (size_t i = 0; i < p2.size(); ++i) off += acc.dw2_f[i] != p2[i] + g.dw2_f[i];
    EXPECT_EQ(off, 0u) << tag << ": accumulate must add the gradient (f32, exactly)";
  }
  return rep;
}

}  // namespace epmoe::test
