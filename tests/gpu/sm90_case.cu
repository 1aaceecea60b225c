// Harness of the sm_90a split expert pipeline suite (the UP gathering its rows from x -> DOWN, on the
// plan the heuristics pick for the case's shape with the test's override on top) against the dense
// reference. Skips without a CUDA device or on a device that is not compute capability 9.0; fails
// (does not skip) on a 9.0 device whose build lacks the sm_90a kernels.
//
// Routing and the expert layout are built on the host by this file's own simple code (pairs per
// expert in token order, slot order; segments padded to kExpertTile), so pair_row is the token index
// and `out` is in token order (out_rows = T). x (and the weights) are generated on the device from a
// counter hash that the host recomputes (or downloads) for what it checks, so large cases need no
// host copy of x.
//
// Checks per case:
//  * act (poisoned with 0xFFFF NaNs before UP): no NaN below padded_total, padding rows exactly 0
//    (also the 64 rows after the last 192-row tile of each expert the split rule sends to the 192-row
//    UP, which that kernel zeroes: first and last row of each such gap, which must be padding),
//    sampled rows against a host fp64 SwiGLU within 2^-7 relative + 1e-3 of the row RMS (bf16
//    rounding of both sides, 1 ulp flips where the fp32 and fp64 sums straddle a boundary);
//    (not with the fused pipeline, which never writes act; it must leave its fp32 accumulator zero);
//  * out (poisoned with NaNs, zeroed by the pipeline, token order): no NaN/Inf anywhere (when it is
//    small enough to scan); tokens without pairs exactly 0; sampled tokens against
//    epmoe::reference_moe. Tolerance: the kernel rounds each weighted expert term to bf16 and adds
//    the k terms with bf16 reductions (red.add.bf16x2): 2k - 1 roundings of at most 2^-8 relative
//    each, of values bounded by the row's largest |term|, so |y - ref| <= 2k * 2^-8 * rowmax|ref|
//    per element (the terms are of the size of the row maximum; routing weights sum to 1). Plus the
//    global relative L2 error < 1e-2 (the bf16 noise is ~2^-8 / sqrt(3) * sqrt(k) ~ 0.5% at k = 8;
//    any indexing error is O(1)). NaN/Inf never pass.
#include "sm90_case.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <ostream>

#include "ep_protocol.h"
#include "epmoe/reference.h"
#include "kernels/sm90/experts.cuh"
#include "kernels/sm90/schedule.cuh"

namespace sm90_case {

// ---- device gate --------------------------------------------------------------------------------
// 0: run; 1: skip (message); 2: fail (message).
int device_state(std::string& msg) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    (void)cudaGetLastError();
    msg = "no CUDA device";
    return 1;
  }
  int dev = 0, major = 0, minor = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  if (major != 9 || minor != 0) {
    msg = "device is compute capability " + std::to_string(major) + "." + std::to_string(minor) +
          ", the sm_90a pipeline needs 9.0";
    return 1;
  }
  if (!epmoe::kernels::sm90_experts_supported(dev)) {
    msg = "compute capability 9.0 device but sm90_experts_supported() is false: build with sm_90a "
          "(CMAKE_CUDA_ARCHITECTURES containing 90a)";
    return 2;
  }
  return 0;
}

// ---- routing + layout ---------------------------------------------------------------------------
struct Routing {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

Routing make_routing(int64_t T, int E, int k, Route kind, uint64_t seed) {
  Routing r;
  r.ids.assign(size_t(T) * k, -1);
  r.weights.assign(size_t(T) * k, 0.0f);
  uint64_t ctr = 0;
  auto rnd = [&]() { return mix64(seed ^ (0x51ed27ull + ctr++ * 0x9e3779b97f4a7c15ull)); };
  auto u01 = [&]() { return (double(rnd() >> 11) + 0.5) / 9007199254740992.0; };
  std::vector<double> zcdf;
  if (kind == Route::zipf) {
    double s = 0;
    for (int e = 0; e < E; ++e) zcdf.push_back(s += 1.0 / std::pow(e + 1.0, 1.2));
    for (double& v : zcdf) v /= s;
  }
  std::vector<int> perm(E);
  std::vector<int32_t> edge_expert;  // tile_edges: token t -> expert edge_expert[t]
  if (kind == Route::tile_edges)
    for (int e = 0; e < E; ++e) edge_expert.insert(edge_expert.end(), size_t(kTileEdgeCounts[e % 8]), e);
  for (int64_t t = 0; t < T; ++t) {
    int32_t* id = &r.ids[size_t(t) * k];
    switch (kind) {
      case Route::tile_edges:
        if (t < int64_t(edge_expert.size())) id[0] = edge_expert[size_t(t)];
        break;
      case Route::all_dropped:  // every slot -1: no rows at all, out must still come back zero
        break;
      case Route::uniform:
      case Route::with_drops: {
        std::iota(perm.begin(), perm.end(), 0);
        for (int j = 0; j < k; ++j) {
          const int pick = j + int(rnd() % uint64_t(E - j));
          std::swap(perm[j], perm[pick]);
          id[j] = perm[j];
        }
        if (kind == Route::with_drops) {
          for (int j = 0; j < k; ++j)
            if (rnd() % 4 == 0) id[j] = -1;
          if (t % 7 == 3)
            for (int j = 0; j < k; ++j) id[j] = -1;
        }
        break;
      }
      case Route::zipf: {
        for (int j = 0; j < k; ++j) {
          for (;;) {
            const double u = u01();
            const int e = int(std::lower_bound(zcdf.begin(), zcdf.end(), u) - zcdf.begin());
            const int ec = std::min(e, E - 1);
            if (std::find(id, id + j, ec) == id + j) {
              id[j] = ec;
              break;
            }
          }
        }
        break;
      }
      case Route::one_expert:
        id[0] = E / 2;  // every token to one expert; other slots dropped
        break;
      case Route::single_rows:
        id[0] = int32_t(t % E);  // T <= E: each used expert gets exactly one row
        break;
    }
    double sum = 0;
    float w[64];
    for (int j = 0; j < k; ++j) {
      w[j] = id[j] >= 0 ? float(0.05 + u01()) : 0.0f;
      sum += w[j];
    }
    for (int j = 0; j < k; ++j) r.weights[size_t(t) * k + j] = sum > 0 ? float(w[j] / sum) : 0.0f;
  }
  return r;
}

// The token-order expert layout (src/ep_protocol, world 1) plus, host side only, each padded row's
// expert.
struct Layout {
  epmoe::protocol::ExpertLayout x;
  std::vector<int32_t> row_expert;
  int64_t total() const { return x.padded_total(); }
};

Layout build_layout(const Routing& r, int64_t T, int k, int E) {
  Layout L;
  L.x = epmoe::protocol::token_expert_layout(r.ids.data(), r.weights.data(), T, k, E, kExpertTile);
  L.row_expert.assign(size_t(L.total()), -1);
  for (int e = 0; e < E; ++e)
    for (int64_t i = L.x.padded_offsets[e]; i < L.x.padded_offsets[e + 1]; ++i) L.row_expert[size_t(i)] = e;
  return L;
}

// Rows of a [rows, width] device matrix: one bulk copy of the first `rows` rows when small, else a
// copy per requested row.
struct RowFetcher {
  const DevBuf<uint16_t>& buf;
  int width;
  bool bulk_mode;
  std::vector<uint16_t> bulk;
  RowFetcher(const DevBuf<uint16_t>& b, int w, int64_t rows) : buf(b), width(w) {
    bulk_mode = rows * int64_t(w) <= (int64_t(1) << 26);
    if (bulk_mode) bulk = buf.download(0, size_t(rows) * size_t(w));
  }
  std::vector<uint16_t> row(int64_t r) const {
    if (bulk_mode) return std::vector<uint16_t>(bulk.begin() + r * width, bulk.begin() + (r + 1) * width);
    return buf.download(size_t(r) * size_t(width), size_t(width));
  }
};

// ---- one case -----------------------------------------------------------------------------------
std::vector<bf16> host_x_row(uint64_t seed, int64_t t, int hidden) {
  std::vector<bf16> row(hidden);
  for (int c = 0; c < hidden; ++c) row[c].bits = hash_bf16(seed, uint64_t(t) * uint64_t(hidden) + c, 1.0f);
  return row;
}

std::vector<int64_t> sample_indices(int64_t n, int count, uint64_t seed) {
  std::vector<int64_t> s;
  if (n <= count) {
    for (int64_t i = 0; i < n; ++i) s.push_back(i);
    return s;
  }
  s.push_back(0);
  s.push_back(n - 1);
  for (int i = 2; i < count; ++i) s.push_back(int64_t(mix64(seed + 977 * i) % uint64_t(n)));
  std::sort(s.begin(), s.end());
  s.erase(std::unique(s.begin(), s.end()), s.end());
  return s;
}

// The host side of a case: routing, layout, capacity.
struct HostCase {
  Routing rt;
  Layout L;
  int64_t cap = 0;
  int64_t pairs = 0;  // real (row, expert) pairs: what the engine's regular forward tells the heuristics
};
HostCase host_case(const Case& cs) {
  HostCase h;
  h.rt = make_routing(cs.T, cs.E, cs.k, cs.route, cs.seed * 1000 + 41);
  h.L = build_layout(h.rt, cs.T, cs.k, cs.E);
  h.cap = std::max<int64_t>({h.L.total() + cs.extra_capacity, cs.min_capacity, 1});
  for (int32_t r : h.L.x.pair_row) h.pairs += r >= 0;
  return h;
}
// The host split rule over `blocks` column blocks: the experts it sends to the 192-row half (their
// count; `tall`, when given, gets each one's flag).
int host_tall_experts(const Layout& L, int E, int blocks, int ctas, std::vector<char>* tall = nullptr) {
  namespace k90 = epmoe::kernels::sm90;
  const int cut = k90::split_tall_cut(L.x.padded_offsets.data(), L.x.pair_row.data(), E, blocks, ctas);
  if (tall != nullptr) tall->assign(size_t(E), 0);
  int n = 0;
  for (int e = 0; e < cut; ++e)
    if (k90::split_expert(L.x.padded_offsets.data(), L.x.pair_row.data(), e, blocks).picked) {
      ++n;
      if (tall != nullptr) (*tall)[size_t(e)] = 1;
    }
  return n;
}
CaseStats stats_of(const Case& cs, const HostCase& h, const epmoe::Sm90Plan& plan) {
  CaseStats st;
  st.shape = {cs.E, cs.hidden, cs.ffn, h.cap, cs.keep_preact ? 0 : h.pairs};
  st.plan = plan;
  if (plan.up_split) st.up_tall_experts = host_tall_experts(h.L, cs.E, cs.ffn / 128, plan.split_ctas);
  if (plan.down_split) st.down_tall_experts = host_tall_experts(h.L, cs.E, (cs.hidden + 255) / 256, plan.split_ctas);
  return st;
}

CaseStats case_stats(const Case& cs, const epmoe::Sm90Plan& plan) { return stats_of(cs, host_case(cs), plan); }
epmoe::kernels::Sm90Shape case_shape(const Case& cs) {
  const HostCase h = host_case(cs);
  return {cs.E, cs.hidden, cs.ffn, h.cap, cs.keep_preact ? 0 : h.pairs};
}

void run_pipeline(const ExpertProblem& p, const epmoe::Sm90Plan& plan, Mode mode) {
  const size_t out_bytes = size_t(p.out_rows) * p.hidden * sizeof(__nv_bfloat16);
  if (mode == Mode::graph) {
    // The benchmark's shape: out zeroed on a side stream (event-ordered; none with zero_out), up,
    // down (PDL), captured once and replayed twice (the zeroing must reset what the first wrote).
    cudaStream_t s, side;
    EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    cudaEvent_t fork, zeroed;
    EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&zeroed, cudaEventDisableTiming));
    cudaGraph_t g;
    cudaGraphExec_t ge;
    EPMOE_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    if (!p.zero_out) {
      EPMOE_CUDA_CHECK(cudaEventRecord(fork, s));
      EPMOE_CUDA_CHECK(cudaStreamWaitEvent(side, fork, 0));
      EPMOE_CUDA_CHECK(cudaMemsetAsync(p.out, 0, out_bytes, side));
      EPMOE_CUDA_CHECK(cudaEventRecord(zeroed, side));
      EPMOE_CUDA_CHECK(cudaStreamWaitEvent(s, zeroed, 0));
    }
    epmoe::kernels::sm90_experts_launch(p, plan, s);
    EPMOE_CUDA_CHECK(cudaStreamEndCapture(s, &g));
    EPMOE_CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
    for (int rep = 0; rep < 2; ++rep) EPMOE_CUDA_CHECK(cudaGraphLaunch(ge, s));
    EPMOE_CUDA_CHECK(cudaStreamSynchronize(s));
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    cudaEventDestroy(fork);
    cudaEventDestroy(zeroed);
    cudaStreamDestroy(side);
    cudaStreamDestroy(s);
    return;
  }
  if (!p.zero_out) EPMOE_CUDA_CHECK(cudaMemset(p.out, 0, out_bytes));
  if (mode == Mode::experts_launch) {
    epmoe::kernels::sm90_experts_launch(p, plan, nullptr);
  } else {
    epmoe::kernels::sm90_up_launch(p, plan, nullptr);
    epmoe::kernels::sm90_down_launch(p, plan, nullptr, /*pdl=*/false);
  }
  EPMOE_CUDA_CHECK(cudaGetLastError());
  EPMOE_CUDA_CHECK(cudaDeviceSynchronize());
}

void run_case(const Case& cs, const epmoe::Sm90PlanOverride& plan_override, CaseStats* stats) {
  const int E = cs.E, k = cs.k, H = cs.hidden, F = cs.ffn;
  const int64_t T = cs.T;
  REQUIRE_SM90();
  const uint64_t xseed = cs.seed * 1000 + 11;
  SCOPED_TRACE("E=" + std::to_string(E) + " k=" + std::to_string(k) + " hidden=" + std::to_string(H) +
               " ffn=" + std::to_string(F) + " T=" + std::to_string(T));

  const HostCase hc = host_case(cs);
  const Routing& rt = hc.rt;
  const Layout& L = hc.L;
  const int64_t total = L.total();
  const int64_t cap = hc.cap;

  DevBuf<uint16_t> d_x(size_t(T) * H), d_w1(size_t(E) * 2 * F * H), d_w2(size_t(E) * H * F), d_act(size_t(cap) * F),
      d_out(size_t(T) * H);
  DevBuf<int64_t> d_offs{size_t(E) + 1};
  DevBuf<int32_t> d_prow{size_t(cap)};
  DevBuf<float> d_pw{size_t(cap)};
  // Weights scaled so gate/up and y are O(1), generated on the device and copied back for the
  // host's references (hash_bf16 gives the same bits on both sides).
  const float s1 = std::sqrt(3.0f / H), s2 = std::sqrt(3.0f / F) * 2.0f;
  fill_hash_kernel<<<1024, 256>>>(d_x.p, int64_t(d_x.n), xseed, 1.0f);
  fill_hash_kernel<<<1024, 256>>>(d_w1.p, int64_t(d_w1.n), cs.seed * 1000 + 21, s1);
  fill_hash_kernel<<<1024, 256>>>(d_w2.p, int64_t(d_w2.n), cs.seed * 1000 + 31, s2);
  EPMOE_CUDA_CHECK(cudaGetLastError());
  std::vector<bf16> w1(d_w1.n), w2(d_w2.n);
  EPMOE_CUDA_CHECK(cudaMemcpy(w1.data(), d_w1.p, d_w1.bytes(), cudaMemcpyDeviceToHost));
  EPMOE_CUDA_CHECK(cudaMemcpy(w2.data(), d_w2.p, d_w2.bytes(), cudaMemcpyDeviceToHost));
  for (size_t i : {size_t(0), w1.size() / 2, w1.size() - 1})  // (the device fill is the host's hash)
    ASSERT_EQ(w1[i].bits, hash_bf16(cs.seed * 1000 + 21, i, s1)) << "w1[" << i << "]";
  d_offs.upload(L.x.padded_offsets);
  // pair arrays past the total hold garbage on purpose: nothing may read them.
  EPMOE_CUDA_CHECK(cudaMemset(d_prow.p, 0x7f, d_prow.bytes()));
  EPMOE_CUDA_CHECK(cudaMemset(d_pw.p, 0x7f, d_pw.bytes()));
  if (total) {
    EPMOE_CUDA_CHECK(cudaMemcpy(d_prow.p, L.x.pair_row.data(), size_t(total) * 4, cudaMemcpyHostToDevice));
    EPMOE_CUDA_CHECK(cudaMemcpy(d_pw.p, L.x.pair_weight.data(), size_t(total) * 4, cudaMemcpyHostToDevice));
  }
  EPMOE_CUDA_CHECK(cudaMemset(d_act.p, 0xFF, d_act.bytes()));  // bf16 0xFFFF = NaN
  DevBuf<uint16_t> d_h(cs.keep_preact ? size_t(cap) * 2 * F : 0);
  if (cs.keep_preact) EPMOE_CUDA_CHECK(cudaMemset(d_h.p, 0xFF, d_h.bytes()));
  EPMOE_CUDA_CHECK(cudaMemset(d_out.p, 0xFF, d_out.bytes()));  // the pipeline zeroes it
  EPMOE_CUDA_CHECK(cudaDeviceSynchronize());

  const ExpertProblem p0 = epmoe::kernels::make_expert_problem(
      {reinterpret_cast<const __nv_bfloat16*>(d_w1.p), reinterpret_cast<const __nv_bfloat16*>(d_w2.p), E, H, F},
      reinterpret_cast<const __nv_bfloat16*>(d_x.p), T, {d_offs.p, d_prow.p, d_pw.p, cap},
      reinterpret_cast<__nv_bfloat16*>(d_act.p), reinterpret_cast<__nv_bfloat16*>(d_out.p), T, cs.zero_out);
  ExpertProblem p = p0;
  p.preact = cs.keep_preact ? reinterpret_cast<__nv_bfloat16*>(d_h.p) : nullptr;
  p.pairs = cs.keep_preact ? 0 : hc.pairs;  // (as the engine: a saving forward leaves it unknown)
  epmoe::Sm90Plan plan;
  try {
    plan = epmoe::kernels::sm90_plan_for(p, plan_override);
  } catch (const epmoe::Error& e) {
    FAIL() << "no valid plan for E=" << E << " hidden=" << H << " ffn=" << F << " rows_capacity=" << cap << ": "
           << e.what();
  }
  const std::string plan_text = to_string(plan);
  SCOPED_TRACE("plan: " + plan_text);
  const CaseStats st = stats_of(cs, hc, plan);
  if (stats != nullptr) *stats = st;
  // The fused pipeline (through sm90_experts_launch; a saving forward runs the split kernels) reduces
  // into an fp32 accumulator that must be zero on entry and that it must leave zero (checked below,
  // and by the graph mode's second replay); it never writes act.
  const bool fused = plan.fused && !cs.keep_preact && cs.mode != Mode::separate_no_pdl;
  DevBuf<float> d_acc(plan.fused ? size_t(T) * H : 0);
  if (plan.fused) {
    EPMOE_CUDA_CHECK(cudaMemset(d_acc.p, 0, d_acc.bytes()));
    EPMOE_CUDA_CHECK(cudaDeviceSynchronize());  // (the graph mode runs on a non-blocking stream)
    p.out_acc = d_acc.p;
  }
  run_pipeline(p, plan, cs.mode);
  if (fused) {
    const std::vector<float> acc = d_acc.download();
    EXPECT_EQ(std::count_if(acc.begin(), acc.end(), [](float v) { return v != 0.0f; }), 0)
        << "the fused pipeline left its fp32 accumulator non-zero";
  }

  // ---- act: NaN-free below the total, padding rows zero, sampled rows vs host SwiGLU ----
  // (the fused pipeline keeps act on chip: nothing to check)
  if (!fused) {
    // UP writes every row below the total. The split's 192-row UP (plan.up_split) runs the experts
    // the split rule sends to it (the host rule here; the device's equals it, see
    // Sm90Schedule.DeviceSplitCutMatchesHost): its last tile of such an expert leaves 64 padding
    // rows of the segment uncovered, which its consumers zero. Checked: those gaps (first and last
    // row) are padding and zero. (Where the split falls back to the 128-row UP for every expert the
    // rows are padding rows of 128-row tiles, zero too.)
    namespace k90 = epmoe::kernels::sm90;
    std::vector<int64_t> gap_ends;  // first and last uncovered row of each expert sent to 192-row tiles
    if (plan.up_split) {
      std::vector<char> tall;
      host_tall_experts(L, E, F / 128, plan.split_ctas, &tall);
      for (int e = 0; e < E; ++e) {
        if (!tall[size_t(e)]) continue;
        const int64_t seg = L.x.padded_offsets[e], rows = L.x.padded_offsets[e + 1] - seg;
        const int tiles = k90::tall_tile_count(rows, k90::tall_last_starts_in_padding(L.x.pair_row.data(), seg, rows));
        int64_t covered = 0;
        for (int i = 0; i < tiles; ++i) covered += k90::tall_tile_rows(rows, i);
        EXPECT_LT(covered, rows) << "expert " << e << ": a picked expert's tall tiles cover its whole segment";
        if (covered < rows) gap_ends.insert(gap_ends.end(), {seg + covered, seg + rows - 1});
      }
    }
    const RowFetcher actf(d_act, F, total);
    for (int64_t r : gap_ends) {
      EXPECT_LT(L.x.pair_row[size_t(r)], 0) << "act row " << r << " is real but no 192-row tile covers it";
      const std::vector<uint16_t> a = actf.row(r);
      EXPECT_TRUE(std::all_of(a.begin(), a.end(), [](uint16_t v) { return v == 0 || v == 0x8000; }))
          << "act row " << r << ": padding after an expert's last 192-row tile not zeroed";
    }
    const std::vector<int64_t> rows = sample_indices(total, actf.bulk_mode ? int(total) : 512, 7);
    int64_t nan_count = 0, pad_nonzero = 0;
    for (int64_t r : rows) {
      const std::vector<uint16_t> a = actf.row(r);
      for (int c = 0; c < F; ++c) {
        const float v = bf16::to_float(a[c]);
        if (std::isnan(v)) ++nan_count;
        if (L.x.pair_row[size_t(r)] < 0 && a[c] != 0 && a[c] != 0x8000) ++pad_nonzero;
      }
    }
    EXPECT_EQ(nan_count, 0) << "act elements left unwritten (NaN poison) or NaN below padded_total";
    EXPECT_EQ(pad_nonzero, 0) << "padding rows of act must be zero";

    // numeric check on a few real rows
    std::vector<int64_t> real;
    for (int64_t r : sample_indices(total, 64, 9))
      if (L.x.pair_row[size_t(r)] >= 0) real.push_back(r);
    if (real.size() > 8) real.resize(8);
    int64_t act_bad = 0;
    for (int64_t r : real) {
      const int e = L.row_expert[size_t(r)];
      const std::vector<bf16> xr = host_x_row(xseed, L.x.pair_row[size_t(r)], H);
      const std::vector<uint16_t> a = actf.row(r);
      std::vector<double> ref(F);
      double ss = 0;
      for (int c = 0; c < F; ++c) {
        const bf16* wg = &w1[(size_t(e) * 2 * F + c) * H];
        const bf16* wu = &w1[(size_t(e) * 2 * F + F + c) * H];
        double g = 0, u = 0;
        for (int i = 0; i < H; ++i) {
          g += double(xr[i].f()) * wg[i].f();
          u += double(xr[i].f()) * wu[i].f();
        }
        ref[c] = g / (1.0 + std::exp(-g)) * u;
        ss += ref[c] * ref[c];
      }
      const double rms = std::sqrt(ss / F);
      for (int c = 0; c < F; ++c) {
        const double got = bf16::to_float(a[c]);
        if (!(std::fabs(got - ref[c]) <= std::fabs(ref[c]) / 128.0 + 1e-3 * rms) && act_bad++ < 5)
          ADD_FAILURE() << "act[" << r << "][" << c << "] = " << got << " want " << ref[c] << " (expert " << e << ")";
      }
    }
    EXPECT_EQ(act_bad, 0) << "act numeric mismatches";

    // h (keep_preact): every row below the total written (no NaN poison), padding rows zero, and real
    // rows' g and u against fp64 dot products. Tolerance: bf16 rounding of an fp32 sum of H
    // products (|ref| / 256 rounding, doubled for the fp32 accumulation order), plus 1e-3 of the
    // row's rms for entries near zero.
    if (cs.keep_preact) {
      const RowFetcher hf(d_h, 2 * F, total);
      int64_t h_nan = 0, h_pad = 0, h_bad = 0;
      for (int64_t r : rows) {
        const std::vector<uint16_t> hv = hf.row(r);
        for (int c = 0; c < 2 * F; ++c) {
          if (std::isnan(bf16::to_float(hv[c]))) ++h_nan;
          if (L.x.pair_row[size_t(r)] < 0 && hv[c] != 0 && hv[c] != 0x8000) ++h_pad;
        }
      }
      for (int64_t r : real) {
        const int e = L.row_expert[size_t(r)];
        const std::vector<bf16> xr = host_x_row(xseed, L.x.pair_row[size_t(r)], H);
        const std::vector<uint16_t> hv = hf.row(r);
        std::vector<double> ref(2 * size_t(F));
        double ss = 0;
        for (int c = 0; c < 2 * F; ++c) {
          const bf16* wr = &w1[(size_t(e) * 2 * F + c) * H];
          double acc = 0;
          for (int i = 0; i < H; ++i) acc += double(xr[i].f()) * wr[i].f();
          ref[size_t(c)] = acc;
          ss += acc * acc;
        }
        const double rms = std::sqrt(ss / (2 * F));
        for (int c = 0; c < 2 * F; ++c) {
          const double got = bf16::to_float(hv[c]);
          if (!(std::fabs(got - ref[size_t(c)]) <= std::fabs(ref[size_t(c)]) / 128.0 + 1e-3 * rms) && h_bad++ < 5)
            ADD_FAILURE() << "h[" << r << "][" << c << "] = " << got << " want " << ref[size_t(c)] << " (expert " << e
                          << ")";
        }
      }
      EXPECT_EQ(h_nan, 0) << "h elements left unwritten (NaN poison) below padded_total";
      EXPECT_EQ(h_pad, 0) << "padding rows of h must be zero";
      EXPECT_EQ(h_bad, 0) << "h numeric mismatches";
    }
  }

  // ---- out: no poison (NaN) left anywhere when it is small enough to scan (a missed zeroing, e.g.
  // of an in-kernel zero_out share, shows here even where no token is sampled) ----
  if (int64_t(d_out.n) <= (int64_t(1) << 26)) {
    const std::vector<uint16_t> all = d_out.download();
    const int64_t nan_out = std::count_if(all.begin(), all.end(), [](uint16_t v) { return (v & 0x7F80) == 0x7F80; });
    EXPECT_EQ(nan_out, 0) << "out elements still NaN/Inf (poison not zeroed, or non-finite results)";
  }

  // ---- out: tokens with no pair exactly zero; sampled tokens vs reference_moe ----
  {
    std::vector<int> npairs(size_t(T), 0);
    for (int64_t t = 0; t < T; ++t)
      for (int j = 0; j < k; ++j) npairs[size_t(t)] += rt.ids[size_t(t) * k + j] >= 0;
    std::vector<int64_t> toks = sample_indices(T, cs.ref_tokens, 13);
    // add a few dropped tokens if any
    for (int64_t t = 0, added = 0; t < T && added < 4; ++t)
      if (npairs[size_t(t)] == 0 && !std::binary_search(toks.begin(), toks.end(), t)) {
        toks.push_back(t);
        ++added;
      }
    std::sort(toks.begin(), toks.end());
    const int64_t n = int64_t(toks.size());
    std::vector<bf16> xs_h(size_t(n) * H);
    std::vector<int32_t> ids_h(size_t(n) * k);
    std::vector<float> w_h(size_t(n) * k);
    for (int64_t i = 0; i < n; ++i) {
      const std::vector<bf16> xr = host_x_row(xseed, toks[size_t(i)], H);
      std::copy(xr.begin(), xr.end(), xs_h.begin() + i * H);
      for (int j = 0; j < k; ++j) {
        ids_h[size_t(i) * k + j] = rt.ids[size_t(toks[size_t(i)]) * k + j];
        w_h[size_t(i) * k + j] = rt.weights[size_t(toks[size_t(i)]) * k + j];
      }
    }
    std::vector<float> ref(size_t(n) * H);
    epmoe::reference_moe(xs_h.data(), ids_h.data(), w_h.data(), n, k, w1.data(), w2.data(), E, H, F, ref.data());

    double err2 = 0, ref2 = 0;
    int64_t bad = 0, nonfinite = 0, dropped_nonzero = 0;
    double worst = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = toks[size_t(i)];
      const std::vector<uint16_t> y = d_out.download(size_t(t) * H, size_t(H));
      double rowmax = 0;
      for (int c = 0; c < H; ++c) rowmax = std::max(rowmax, double(std::fabs(ref[size_t(i) * H + c])));
      const double tol = 2.0 * k * std::ldexp(1.0, -8) * rowmax + 1e-6;
      for (int c = 0; c < H; ++c) {
        const double got = bf16::to_float(y[c]);
        const double want = ref[size_t(i) * H + c];
        if (!std::isfinite(got)) {
          ++nonfinite;
          continue;
        }
        if (npairs[size_t(t)] == 0 && y[c] != 0 && y[c] != 0x8000) ++dropped_nonzero;
        const double d = std::fabs(got - want);
        err2 += d * d;
        ref2 += want * want;
        if (rowmax > 0) worst = std::max(worst, d / rowmax);
        if (!(d <= tol) && bad++ < 5)
          ADD_FAILURE() << "out[" << t << "][" << c << "] = " << got << " want " << want << " (tol " << tol << ")";
      }
    }
    EXPECT_EQ(nonfinite, 0) << "NaN/Inf in out";
    EXPECT_EQ(dropped_nonzero, 0) << "tokens without experts must stay exactly zero";
    EXPECT_EQ(bad, 0) << "elementwise mismatches";
    const double rel_l2 = ref2 > 0 ? std::sqrt(err2 / ref2) : std::sqrt(err2);
    EXPECT_LT(rel_l2, 1e-2) << "relative L2 error";
    std::printf("[sm90] E=%d k=%d hidden=%d ffn=%d T=%lld rows=%lld cap=%lld plan {%s} tall up/down %d/%d: %lld "
                "tokens checked, rel_l2 %.3e, worst |err|/rowmax %.3e\n",
                E, k, H, F, (long long)T, (long long)total, (long long)cap, plan_text.c_str(), st.up_tall_experts,
                st.down_tall_experts, (long long)n, rel_l2, worst);
  }
}

}  // namespace sm90_case
