// The sm_90a split expert pipeline (sm90 UP gathering its rows from x -> sm90 DOWN, or gather_rows
// -> UP from xs -> DOWN in the SeparateGather cases) against the dense reference. Skips without a CUDA device or on a device that is not compute capability 9.0; fails
// (does not skip) on a 9.0 device whose build lacks the sm_90a kernels.
//
// Routing and the expert layout are built on the host by this file's own simple code (pairs per
// expert in token order, slot order; segments padded to kExpertTile), so pair_row is the token index
// and `out` is in token order (out_rows = T). x is generated on the device from a counter hash
// that the host recomputes for the tokens it checks, so large cases need no host copy of x.
//
// Checks per case:
//  * gather (separate mode): xs rows below padded_total bit-exact (x row or zeros), rows past it untouched (poison);
//  * act (poisoned with 0xFFFF NaNs before UP): no NaN below padded_total, padding rows exactly 0,
//    sampled rows against a host fp64 SwiGLU within 2^-7 relative + 1e-3 of the row RMS (bf16
//    rounding of both sides, 1 ulp flips where the fp32 and fp64 sums straddle a boundary);
//  * out (zeroed, token order): tokens without pairs exactly 0; sampled tokens against
//    epmoe::reference_moe. Tolerance: the kernel rounds each weighted expert term to bf16 and adds
//    the k terms with bf16 reductions (red.add.bf16x2): 2k - 1 roundings of at most 2^-8 relative
//    each, of values bounded by the row's largest |term|, so |y - ref| <= 2k * 2^-8 * rowmax|ref|
//    per element (the terms are of the size of the row maximum; routing weights sum to 1). Plus the
//    global relative L2 error < 1e-2 (the bf16 noise is ~2^-8 / sqrt(3) * sqrt(k) ~ 0.5% at k = 8;
//    any indexing error is O(1)). NaN/Inf never pass.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <ostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "epmoe/bf16.h"
#include "ep_protocol.h"
#include "epmoe/reference.h"
#include "kernels/expert_problem.cuh"
#include "kernels/gather_rows.cuh"
#include "kernels/hash_fill.cuh"
#include "kernels/sm90_experts.cuh"

namespace {

using epmoe::bf16;
using epmoe::kernels::ExpertProblem;
using epmoe::kernels::kExpertTile;

#define TCHECK(call)                                                                                    \
  do {                                                                                                  \
    cudaError_t e_ = (call);                                                                            \
    if (e_ != cudaSuccess)                                                                              \
      throw std::runtime_error(std::string(#call) + " failed: " + cudaGetErrorString(e_) + " at line " + \
                               std::to_string(__LINE__));                                               \
  } while (0)

// ---- deterministic data (identical on host and device): kernels/hash_fill.cuh ------------------
using epmoe::kernels::hash_fill::fill_hash_kernel;
using epmoe::kernels::hash_fill::hash_bf16;
using epmoe::kernels::hash_fill::mix64;

template <class T>
struct DevBuf {
  T* p = nullptr;
  size_t n = 0;
  explicit DevBuf(size_t count) : n(count) {
    if (n) TCHECK(cudaMalloc(&p, n * sizeof(T)));
  }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  size_t bytes() const { return n * sizeof(T); }
  void upload(const std::vector<T>& h) {
    if (!h.empty()) TCHECK(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download(size_t first = 0, size_t count = SIZE_MAX) const {
    count = std::min(count, n - first);
    std::vector<T> h(count);
    if (count) TCHECK(cudaMemcpy(h.data(), p + first, count * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

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

#define REQUIRE_SM90()                           \
  do {                                           \
    std::string why_;                            \
    const int st_ = device_state(why_);          \
    if (st_ == 1) GTEST_SKIP() << why_;          \
    if (st_ == 2) FAIL() << why_;                \
  } while (0)

// ---- routing + layout ---------------------------------------------------------------------------
enum class Route { uniform, zipf, one_expert, single_rows, with_drops };

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
  for (int64_t t = 0; t < T; ++t) {
    int32_t* id = &r.ids[size_t(t) * k];
    switch (kind) {
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
enum class Mode { experts_launch, separate_no_pdl, graph };

struct Case {
  int E, k, hidden, ffn;
  int64_t T;
  Route route;
  int64_t extra_capacity;  // rows_capacity = padded_total + extra (tiles past the total must exit)
  int ref_tokens;          // tokens checked against reference_moe
  Mode mode = Mode::experts_launch;
  uint64_t seed = 1;
  // true: the UP kernel gathers its rows from x (ExpertProblem::x, the engine's default);
  // false: gather_rows writes xs first and UP reads xs by TMA.
  bool fused_gather = true;
};

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

void run_pipeline(const ExpertProblem& p, const __nv_bfloat16* x, int64_t T, Mode mode) {
  const int64_t* total = p.padded_offsets + p.experts;
  const size_t out_bytes = size_t(p.out_rows) * p.hidden * sizeof(__nv_bfloat16);
  if (mode == Mode::graph) {
    // The benchmark's shape: out zeroed on a side stream (event-ordered), gather, up, down (PDL).
    cudaStream_t s, side;
    TCHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    TCHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    cudaEvent_t fork, zeroed;
    TCHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    TCHECK(cudaEventCreateWithFlags(&zeroed, cudaEventDisableTiming));
    cudaGraph_t g;
    cudaGraphExec_t ge;
    TCHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    TCHECK(cudaEventRecord(fork, s));
    TCHECK(cudaStreamWaitEvent(side, fork, 0));
    TCHECK(cudaMemsetAsync(p.out, 0, out_bytes, side));
    TCHECK(cudaEventRecord(zeroed, side));
    if (p.x == nullptr)
      epmoe::kernels::gather_rows_launch(x, T, p.hidden, p.pair_row, total, p.rows_capacity,
                                         const_cast<__nv_bfloat16*>(p.xs), s);
    TCHECK(cudaStreamWaitEvent(s, zeroed, 0));
    epmoe::kernels::sm90_experts_launch(p, s);
    TCHECK(cudaStreamEndCapture(s, &g));
    TCHECK(cudaGraphInstantiate(&ge, g, 0));
    for (int rep = 0; rep < 2; ++rep) TCHECK(cudaGraphLaunch(ge, s));  // twice: the zeroing must reset
    TCHECK(cudaStreamSynchronize(s));
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    cudaEventDestroy(fork);
    cudaEventDestroy(zeroed);
    cudaStreamDestroy(side);
    cudaStreamDestroy(s);
    return;
  }
  TCHECK(cudaMemset(p.out, 0, out_bytes));
  if (p.x == nullptr)
    epmoe::kernels::gather_rows_launch(x, T, p.hidden, p.pair_row, total, p.rows_capacity,
                                       const_cast<__nv_bfloat16*>(p.xs), nullptr);
  if (mode == Mode::experts_launch) {
    epmoe::kernels::sm90_experts_launch(p, nullptr);
  } else {
    epmoe::kernels::sm90_up_launch(p, nullptr);
    epmoe::kernels::sm90_down_launch(p, nullptr, /*pdl=*/false);
  }
  TCHECK(cudaGetLastError());
  TCHECK(cudaDeviceSynchronize());
}

void run_case(const Case& cs) {
  const int E = cs.E, k = cs.k, H = cs.hidden, F = cs.ffn;
  const int64_t T = cs.T;
  REQUIRE_SM90();
  const uint64_t xseed = cs.seed * 1000 + 11;
  SCOPED_TRACE("E=" + std::to_string(E) + " k=" + std::to_string(k) + " hidden=" + std::to_string(H) +
               " ffn=" + std::to_string(F) + " T=" + std::to_string(T) +
               (cs.fused_gather ? " (UP gathers from x)" : " (gather_rows + UP from xs)"));

  // Weights (host, for the reference) scaled so gate/up and y are O(1).
  std::vector<bf16> w1(size_t(E) * 2 * F * H), w2(size_t(E) * H * F);
  const float s1 = std::sqrt(3.0f / H), s2 = std::sqrt(3.0f / F) * 2.0f;
  for (size_t i = 0; i < w1.size(); ++i) w1[i].bits = hash_bf16(cs.seed * 1000 + 21, i, s1);
  for (size_t i = 0; i < w2.size(); ++i) w2[i].bits = hash_bf16(cs.seed * 1000 + 31, i, s2);

  const Routing rt = make_routing(T, E, k, cs.route, cs.seed * 1000 + 41);
  const Layout L = build_layout(rt, T, k, E);
  const int64_t total = L.total();
  const int64_t cap = std::max<int64_t>(total + cs.extra_capacity, 1);

  DevBuf<uint16_t> d_x(size_t(T) * H), d_w1(w1.size()), d_w2(w2.size()), d_xs(cs.fused_gather ? 0 : size_t(cap) * H),
      d_act(size_t(cap) * F), d_out(size_t(T) * H);
  DevBuf<int64_t> d_offs{size_t(E) + 1};
  DevBuf<int32_t> d_prow{size_t(cap)};
  DevBuf<float> d_pw{size_t(cap)};
  fill_hash_kernel<<<1024, 256>>>(d_x.p, int64_t(d_x.n), xseed, 1.0f);
  TCHECK(cudaGetLastError());
  TCHECK(cudaMemcpy(d_w1.p, w1.data(), w1.size() * 2, cudaMemcpyHostToDevice));
  TCHECK(cudaMemcpy(d_w2.p, w2.data(), w2.size() * 2, cudaMemcpyHostToDevice));
  d_offs.upload(L.x.padded_offsets);
  // pair arrays past the total hold garbage on purpose: nothing may read them.
  TCHECK(cudaMemset(d_prow.p, 0x7f, d_prow.bytes()));
  TCHECK(cudaMemset(d_pw.p, 0x7f, d_pw.bytes()));
  if (total) {
    TCHECK(cudaMemcpy(d_prow.p, L.x.pair_row.data(), size_t(total) * 4, cudaMemcpyHostToDevice));
    TCHECK(cudaMemcpy(d_pw.p, L.x.pair_weight.data(), size_t(total) * 4, cudaMemcpyHostToDevice));
  }
  if (d_xs.p) TCHECK(cudaMemset(d_xs.p, 0xFF, d_xs.bytes()));  // bf16 0xFFFF = NaN
  TCHECK(cudaMemset(d_act.p, 0xFF, d_act.bytes()));
  TCHECK(cudaMemset(d_out.p, 0xFF, d_out.bytes()));  // the pipeline zeroes it
  TCHECK(cudaDeviceSynchronize());

  ExpertProblem p;
  if (cs.fused_gather) {
    p.x = reinterpret_cast<const __nv_bfloat16*>(d_x.p);
    p.x_rows = T;
  } else {
    p.xs = reinterpret_cast<const __nv_bfloat16*>(d_xs.p);
  }
  p.padded_offsets = d_offs.p;
  p.pair_row = d_prow.p;
  p.pair_weight = d_pw.p;
  p.w1 = reinterpret_cast<const __nv_bfloat16*>(d_w1.p);
  p.w2 = reinterpret_cast<const __nv_bfloat16*>(d_w2.p);
  p.act = reinterpret_cast<__nv_bfloat16*>(d_act.p);
  p.out = reinterpret_cast<__nv_bfloat16*>(d_out.p);
  p.rows_capacity = cap;
  p.out_rows = T;
  p.experts = E;
  p.hidden = H;
  p.ffn = F;
  run_pipeline(p, reinterpret_cast<const __nv_bfloat16*>(d_x.p), T, cs.mode);

  // ---- gather (separate mode): sampled rows (all when small) bit-exact; rows past the total untouched ----
  if (!cs.fused_gather) {
    const RowFetcher xsf(d_xs, H, total);
    const std::vector<int64_t> rows = sample_indices(total, xsf.bulk_mode ? int(total) : 256, 5);
    int64_t bad = 0;
    for (int64_t r : rows) {
      const std::vector<uint16_t> got = xsf.row(r);
      const int32_t src = L.x.pair_row[size_t(r)];
      std::vector<bf16> want = src >= 0 ? host_x_row(xseed, src, H) : std::vector<bf16>(H);
      for (int c = 0; c < H; ++c)
        if (got[c] != want[c].bits && bad++ < 5)
          ADD_FAILURE() << "xs[" << r << "][" << c << "] = " << got[c] << " want " << want[c].bits << " (src " << src << ")";
    }
    EXPECT_EQ(bad, 0) << "gather mismatches";
    if (cap > total) {
      const std::vector<uint16_t> tail = d_xs.download(size_t(total) * H, size_t(std::min<int64_t>(cap - total, 256)) * H);
      EXPECT_TRUE(std::all_of(tail.begin(), tail.end(), [](uint16_t v) { return v == 0xFFFF; }))
          << "gather wrote rows at or past padded_total";
    }
  }

  // ---- act: NaN-free below the total, padding rows zero, sampled rows vs host SwiGLU ----
  {
    const RowFetcher actf(d_act, F, total);
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
    std::printf("[sm90] E=%d k=%d hidden=%d ffn=%d T=%lld rows=%lld cap=%lld: %lld tokens checked, rel_l2 %.3e, "
                "worst |err|/rowmax %.3e\n",
                E, k, H, F, (long long)T, (long long)total, (long long)cap, (long long)n, rel_l2, worst);
  }
}

// Sets an environment variable for one test (the sm90 launchers read theirs at every launch).
struct EnvGuard {
  std::string name;  // empty: no variable (n null)
  EnvGuard(const char* n, const char* v) : name(n != nullptr ? n : "") {  // v null: unset (the default)
    if (name.empty()) return;
    if (v) setenv(n, v, 1);
    else unsetenv(n);
  }
  ~EnvGuard() {
    if (!name.empty()) unsetenv(name.c_str());
  }
};

// ---- tests --------------------------------------------------------------------------------------

TEST(Sm90Experts, GatherRowsBitExact) {
  REQUIRE_SM90();  // gather itself runs anywhere, but keep the suite's gate uniform
  const int H = 384;
  const int64_t x_rows = 1000, cap = 3000, total = 2560;
  std::vector<int32_t> prow(static_cast<size_t>(cap));
  for (int64_t i = 0; i < cap; ++i) {
    const uint64_t h = mix64(i + 12345);
    prow[size_t(i)] = (h % 5 == 0) ? -1 : int32_t((h >> 8) % uint64_t(x_rows));
  }
  DevBuf<uint16_t> x(size_t(x_rows) * H), xs(size_t(cap) * H);
  DevBuf<int32_t> d_prow{size_t(cap)};
  DevBuf<int64_t> d_total(1);
  fill_hash_kernel<<<256, 256>>>(x.p, int64_t(x.n), 77, 1.0f);
  d_prow.upload(prow);
  d_total.upload(std::vector<int64_t>{total});
  TCHECK(cudaMemset(xs.p, 0xFF, xs.bytes()));
  epmoe::kernels::gather_rows_launch(reinterpret_cast<const __nv_bfloat16*>(x.p), x_rows, H, d_prow.p, d_total.p, cap,
                                     reinterpret_cast<__nv_bfloat16*>(xs.p), nullptr);
  TCHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> got = xs.download();
  int64_t bad = 0;
  for (int64_t r = 0; r < cap; ++r)
    for (int c = 0; c < H; ++c) {
      uint16_t want;
      if (r >= total) want = 0xFFFF;
      else if (prow[size_t(r)] < 0) want = 0;
      else want = hash_bf16(77, uint64_t(prow[size_t(r)]) * H + c, 1.0f);
      bad += got[size_t(r) * H + c] != want;
    }
  EXPECT_EQ(bad, 0);
}

// A small case for compute-sanitizer memcheck/racecheck in gpu_check (the filter is *Small*).
TEST(Sm90Experts, SmallE4K2H256F256T64) { run_case({4, 2, 256, 256, 64, Route::uniform, 0, 64}); }

// Uniform routing, the main shapes.
TEST(Sm90Experts, UniformE8K2H2048F1024T128) { run_case({8, 2, 2048, 1024, 128, Route::uniform, 0, 128}); }
TEST(Sm90Experts, UniformE16K4H4096F768T7) { run_case({16, 4, 4096, 768, 7, Route::uniform, 384, 7}); }
TEST(Sm90Experts, UniformE4K2H7168F2048T1) { run_case({4, 2, 7168, 2048, 1, Route::uniform, 130, 1}); }
TEST(Sm90Experts, UniformE8K4H7168F2048T512) { run_case({8, 4, 7168, 2048, 512, Route::uniform, 0, 12}); }
TEST(Sm90Experts, UniformE32K4H2048F1024T4096) { run_case({32, 4, 2048, 1024, 4096, Route::uniform, 31 * 128, 48}); }
// Skewed routing: hot experts with many tiles, a cold tail with few or no rows.
TEST(Sm90Experts, ZipfE32K4H2048F1024T4096) { run_case({32, 4, 2048, 1024, 4096, Route::zipf, 1000, 48}); }
TEST(Sm90Experts, ZipfE64K8H4096F768T1024) { run_case({64, 8, 4096, 768, 1024, Route::zipf, 0, 16}); }
// Every token to one expert (all other experts empty; other slots dropped).
TEST(Sm90Experts, OneExpertE8K2H2048F768T1000) { run_case({8, 2, 2048, 768, 1000, Route::one_expert, 128, 48}); }
// Experts with exactly one row each (and empty ones).
TEST(Sm90Experts, SingleRowExpertsE16K1H4096F1024T12) {
  run_case({16, 1, 4096, 1024, 12, Route::single_rows, 0, 12});
}
// Dropped slots and tokens routed nowhere.
TEST(Sm90Experts, WithDropsE16K4H2048F1024T777) { run_case({16, 4, 2048, 1024, 777, Route::with_drops, 77, 48}); }
// hidden % 256 == 128: the DOWN kernel's last column tile is half out of range.
TEST(Sm90Experts, HalfTileE4K2H640F768T300) { run_case({4, 2, 640, 768, 300, Route::uniform, 0, 64}); }
// Many tiles, small dims.
TEST(Sm90Experts, LargeTE16K2H256F256T65536) { run_case({16, 2, 256, 256, 65536, Route::uniform, 5000, 64}); }
// The pieces launched separately (no PDL) and the CUDA-graph form (side-stream zeroing, replayed).
TEST(Sm90Experts, SeparateNoPdl) {
  Case c{16, 4, 2048, 1024, 2048, Route::zipf, 256, 32};
  c.mode = Mode::separate_no_pdl;
  c.seed = 3;
  run_case(c);
}
TEST(Sm90Experts, GraphCaptured) {
  Case c{32, 4, 2048, 1024, 4096, Route::uniform, 31 * 128, 32};
  c.mode = Mode::graph;
  c.seed = 4;
  run_case(c);
}
// The gather_rows kernel + UP reading xs by TMA (EPMOE_SM90_GATHER=separate in the engine): the same
// checks, plus the xs rows bit-exact.
Case separate(Case c) {
  c.fused_gather = false;
  return c;
}
TEST(Sm90Experts, SeparateGatherSmallE4K2H256F256T64) { run_case(separate({4, 2, 256, 256, 64, Route::uniform, 0, 64})); }
TEST(Sm90Experts, SeparateGatherUniformE32K4H2048F1024T4096) {
  run_case(separate({32, 4, 2048, 1024, 4096, Route::uniform, 31 * 128, 48}));
}
TEST(Sm90Experts, SeparateGatherZipfE64K8H4096F768T1024) {
  run_case(separate({64, 8, 4096, 768, 1024, Route::zipf, 0, 16}));
}
TEST(Sm90Experts, SeparateGatherWithDropsE16K4H2048F1024T777) {
  run_case(separate({16, 4, 2048, 1024, 777, Route::with_drops, 77, 48}));
}
TEST(Sm90Experts, SeparateGatherGraphCaptured) {
  Case c{32, 4, 2048, 1024, 4096, Route::uniform, 31 * 128, 32};
  c.mode = Mode::graph;
  c.seed = 8;
  run_case(separate(c));
}
TEST(Sm90Experts, SeparateGatherLargeTE16K2H256F256T65536) {
  run_case(separate({16, 2, 256, 256, 65536, Route::uniform, 5000, 32}));
}

// One CTA per work item (EPMOE_SM90_PERSISTENT=0) instead of the persistent grid (one CTA per SM
// looping over items): every loop runs once, the ring never wraps across items.
TEST(Sm90Experts, NonPersistentGrid) {
  EnvGuard guard("EPMOE_SM90_PERSISTENT", "0");
  Case c{32, 4, 2048, 1024, 4096, Route::zipf, 300, 32};
  c.seed = 6;
  run_case(c);
}
TEST(Sm90Experts, NonPersistentLargeT) {
  EnvGuard guard("EPMOE_SM90_PERSISTENT", "0");
  Case c{16, 2, 256, 256, 65536, Route::uniform, 5000, 32};
  c.seed = 7;
  run_case(c);
}
// The UP kernel's fallback W1 map (two rank-3 boxes per stage instead of the folded rank-4 box).
TEST(Sm90Experts, PlainW1MapFallback) {
  EnvGuard guard("EPMOE_SM90_W1_PLAIN", "1");
  Case c{8, 2, 4096, 768, 600, Route::uniform, 0, 24};
  c.seed = 5;
  run_case(c);
}
// ---- kernel variants: EPMOE_SM90_CLUSTER x EPMOE_SM90_GROUP x EPMOE_SM90_ORDER -----------------
// The default (single CTAs, groups of 16 row tiles cut from the global tile sequence) runs every case
// above. Pinned here: 2-CTA clusters multicasting the weight tile (mode 1) on the cases that stress
// the tile pairing - one tile in all (rank 1 idles), an odd tile count in one expert, pairs
// straddling expert boundaries (1-row and empty experts, skew), a half-out-of-range last W2 block,
// many tiles, graph capture, no PDL, the TMA (xs) A path, one cluster per item - with group sizes
// that leave short last groups; mode 2 (clusters in DOWN only while UP gathers); single CTAs in
// tile-major order and with other group sizes; and the by-expert order (EPMOE_SM90_ORDER=expert) on
// the cases that stress it: an odd expert's last tile runs as a column pair - the single-row experts
// make every tile such a leftover, ffn 640 / hidden 640 give odd column-block counts (rank 1 idle on
// the last pair) - and groups split an expert's units into near-equal parts.
struct Variant {
  const char* name;
  const char* cluster;  // EPMOE_SM90_CLUSTER
  const char* group;    // EPMOE_SM90_GROUP
  Case c;
  const char* order = nullptr;  // EPMOE_SM90_ORDER (unset: the default, global)
  const char* knob = nullptr;   // one more EPMOE_SM90_* variable set to `value` (the non-default paths)
  const char* value = nullptr;
};
Case with(Case c, int seed, Mode mode = Mode::experts_launch) {
  c.seed = uint64_t(seed);
  c.mode = mode;
  return c;
}
const std::vector<Variant>& variants() {
  static const std::vector<Variant> v = {
      {"ClusterSmallE4K2H256F256T64", "1", "16", {4, 2, 256, 256, 64, Route::uniform, 0, 64}},
      {"ClusterSeparateGatherSmallE4K2H256F256T64", "1", "16", separate({4, 2, 256, 256, 64, Route::uniform, 0, 64})},
      // Two experts of ~2 tiles each: pairs inside one expert, so the multicast path runs under the
      // sanitizers too (the cases above pair tiles of different experts).
      {"ClusterSmallMulticastE2K1H256F256T512", "1", "16", {2, 1, 256, 256, 512, Route::uniform, 0, 64}},
      {"ClusterSeparateGatherSmallMulticastE2K1H256F256T512", "1", "16",
       separate({2, 1, 256, 256, 512, Route::uniform, 0, 64})},
      {"ClusterOneTileE4K1H7168F2048T1", "1", "16", {4, 1, 7168, 2048, 1, Route::uniform, 130, 1}},
      {"ClusterUniformE8K4H7168F2048T512", "1", "16", with({8, 4, 7168, 2048, 512, Route::uniform, 0, 12}, 11)},
      {"ClusterUniformE32K4H2048F1024T4096", "1", "1",
       with({32, 4, 2048, 1024, 4096, Route::uniform, 31 * 128, 48}, 12)},
      {"ClusterZipfE64K8H4096F768T1024", "1", "16", with({64, 8, 4096, 768, 1024, Route::zipf, 0, 16}, 13)},
      {"ClusterSingleRowExpertsE16K1H4096F1024T12", "1", "16",
       with({16, 1, 4096, 1024, 12, Route::single_rows, 0, 12}, 14)},
      // 1100 rows in one expert: 9 tiles, the last pair has no second tile.
      {"ClusterOneExpertOddTilesE8K2H2048F768T1100", "1", "16",
       with({8, 2, 2048, 768, 1100, Route::one_expert, 128, 48}, 15)},
      {"ClusterOneExpertOddTilesGroup6E8K2H2048F768T1100", "1", "6",
       with({8, 2, 2048, 768, 1100, Route::one_expert, 128, 48}, 25)},
      {"ClusterWithDropsE16K4H2048F1024T777", "1", "16", with({16, 4, 2048, 1024, 777, Route::with_drops, 77, 48}, 16)},
      {"ClusterHalfTileE4K2H640F768T300", "1", "16", with({4, 2, 640, 768, 300, Route::uniform, 0, 64}, 17)},
      {"ClusterLargeTE16K2H256F256T65536", "1", "16", with({16, 2, 256, 256, 65536, Route::uniform, 5000, 32}, 18)},
      {"ClusterSeparateGatherZipfE32K4H2048F1024T4096", "1", "16",
       separate(with({32, 4, 2048, 1024, 4096, Route::zipf, 1000, 48}, 19))},
      {"ClusterGraphCaptured", "1", "16", with({32, 4, 2048, 1024, 4096, Route::uniform, 31 * 128, 32}, 20, Mode::graph)},
      {"ClusterSeparateNoPdl", "1", "16",
       with({16, 4, 2048, 1024, 2048, Route::zipf, 256, 32}, 21, Mode::separate_no_pdl)},
      {"ClusterMode2GraphCaptured", "2", "16", with({32, 4, 2048, 1024, 4096, Route::zipf, 31 * 128, 32}, 27, Mode::graph)},
      {"ClusterMode2SeparateGatherE16K4H2048F1024T777", "2", "16",
       separate(with({16, 4, 2048, 1024, 777, Route::with_drops, 77, 48}, 32))},
      {"SingleCtaSmallE4K2H256F256T64", "0", "1", {4, 2, 256, 256, 64, Route::uniform, 0, 64}},
      {"SingleCtaUniformE32K4H2048F1024T4096", "0", "1",
       with({32, 4, 2048, 1024, 4096, Route::uniform, 31 * 128, 48}, 28)},
      {"SingleCtaZipfE64K8H4096F768T1024", "0", "1", with({64, 8, 4096, 768, 1024, Route::zipf, 0, 16}, 29)},
      {"SingleCtaHalfTileE4K2H640F768T300", "0", "1", with({4, 2, 640, 768, 300, Route::uniform, 0, 64}, 30)},
      {"SingleCtaSeparateGatherGraphCaptured", "0", "1",
       separate(with({32, 4, 2048, 1024, 4096, Route::uniform, 31 * 128, 32}, 31, Mode::graph))},
      {"SingleCtaGroup3ZipfE32K4H2048F1024T4096", "0", "3", with({32, 4, 2048, 1024, 4096, Route::zipf, 1000, 48}, 23)},
      {"SingleCtaGroup5UniformE8K4H7168F2048T512", "0", "5", with({8, 4, 7168, 2048, 512, Route::uniform, 0, 12}, 24)},
      {"ByExpertClusterSmallE4K2H256F256T64", "1", "16", {4, 2, 256, 256, 64, Route::uniform, 0, 64}, "expert"},
      {"ByExpertClusterSmallMulticastE2K1H256F256T512", "1", "16", {2, 1, 256, 256, 512, Route::uniform, 0, 64},
       "expert"},
      {"ByExpertClusterOddColumnBlocksE4K2H640F640T300", "1", "16",
       with({4, 2, 640, 640, 300, Route::uniform, 0, 64}, 37), "expert"},
      {"ByExpertClusterOddColumnBlocksGroup2ZipfE8K4H640F640T700", "1", "2",
       with({8, 4, 640, 640, 700, Route::zipf, 0, 64}, 38), "expert"},
      {"ByExpertSingleCtaGroup3OddColumnBlocksE4K2H640F640T300", "0", "3",
       with({4, 2, 640, 640, 300, Route::uniform, 0, 64}, 39), "expert"},
      {"ByExpertClusterSingleRowExpertsE16K1H4096F1024T12", "1", "16",
       with({16, 1, 4096, 1024, 12, Route::single_rows, 0, 12}, 40), "expert"},
      {"ByExpertClusterOneExpertOddTilesE8K2H2048F768T1100", "1", "6",
       with({8, 2, 2048, 768, 1100, Route::one_expert, 128, 48}, 41), "expert"},
      {"ByExpertClusterZipfE64K8H4096F768T1024", "1", "16", with({64, 8, 4096, 768, 1024, Route::zipf, 0, 16}, 42),
       "expert"},
      {"ByExpertClusterWithDropsGraphCaptured", "1", "16",
       with({16, 4, 2048, 1024, 777, Route::with_drops, 77, 32}, 43, Mode::graph), "expert"},
      {"ByExpertSingleCtaGroup3ZipfE32K4H2048F1024T4096", "0", "3",
       with({32, 4, 2048, 1024, 4096, Route::zipf, 1000, 48}, 44), "expert"},
      {"ByExpertClusterSeparateGatherUniformE8K4H7168F2048T512", "1", "16",
       separate(with({8, 4, 7168, 2048, 512, Route::uniform, 0, 12}, 45)), "expert"},
      {"ByExpertManyExpertsE256K8H256F256T2048", "0", "16", with({256, 8, 256, 256, 2048, Route::zipf, 0, 64}, 49),
       "expert"},  // more experts than DOWN's schedule fits next to its staging: UP by expert, DOWN global
      // One CTA (cluster) per work item, no persistent loop.
      {"ClusterNonPersistentGrid", "1", "16", with({32, 4, 2048, 1024, 4096, Route::zipf, 300, 32}, 22), nullptr,
       "EPMOE_SM90_PERSISTENT", "0"},
      // The gathering producer's older signalling (each thread waits for its copies two stages later
      // and arrives itself) on single CTAs and clusters.
      {"GatherArriveWaitSmallE4K2H256F256T64", "0", "16", {4, 2, 256, 256, 64, Route::uniform, 0, 64}, nullptr,
       "EPMOE_SM90_GATHER_ARRIVE", "wait"},
      {"GatherArriveWaitZipfE32K4H2048F1024T4096", "0", "16", with({32, 4, 2048, 1024, 4096, Route::zipf, 1000, 48}, 35),
       nullptr, "EPMOE_SM90_GATHER_ARRIVE", "wait"},
      {"GatherArriveWaitClusterOneExpertE8K2H2048F768T1100", "1", "16",
       with({8, 2, 2048, 768, 1100, Route::one_expert, 128, 48}, 36), nullptr, "EPMOE_SM90_GATHER_ARRIVE", "wait"},
      // DOWN's direct epilogue (the consumers reduce from registers): the small case (sanitizers), a
      // half-out-of-range last column block, clusters with idle ranks.
      {"DownDirectSmallE4K2H256F256T64", "0", "16", with({4, 2, 256, 256, 64, Route::uniform, 0, 64}, 46), nullptr,
       "EPMOE_SM90_DOWN_EPILOGUE", "direct"},
      {"DownDirectHalfTileE4K2H640F768T300", "0", "16", with({4, 2, 640, 768, 300, Route::uniform, 0, 64}, 47), nullptr,
       "EPMOE_SM90_DOWN_EPILOGUE", "direct"},
      {"DownDirectClusterOneExpertOddTilesE8K2H2048F768T1100", "1", "16",
       with({8, 2, 2048, 768, 1100, Route::one_expert, 128, 48}, 48), nullptr, "EPMOE_SM90_DOWN_EPILOGUE", "direct"},
      // UP's direct epilogue (quad transpose, 16-byte stores of act from registers).
      {"UpDirectSmallE4K2H256F256T64", "0", "16", with({4, 2, 256, 256, 64, Route::uniform, 0, 64}, 50), nullptr,
       "EPMOE_SM90_UP_EPILOGUE", "direct"},
      {"UpDirectZipfE64K8H4096F768T1024", "0", "16", with({64, 8, 4096, 768, 1024, Route::zipf, 0, 16}, 51), nullptr,
       "EPMOE_SM90_UP_EPILOGUE", "direct"},
      {"UpDirectClusterOneExpertOddTilesE8K2H2048F768T1100", "1", "16",
       with({8, 2, 2048, 768, 1100, Route::one_expert, 128, 48}, 52), nullptr, "EPMOE_SM90_UP_EPILOGUE", "direct"},
      {"UpDirectSeparateGatherGraphCaptured", "0", "16",
       separate(with({32, 4, 2048, 1024, 4096, Route::uniform, 31 * 128, 32}, 53, Mode::graph)), nullptr,
       "EPMOE_SM90_UP_EPILOGUE", "direct"},
  };
  return v;
}
void PrintTo(const Variant& v, std::ostream* os) { *os << v.name; }
class Sm90Variant : public ::testing::TestWithParam<Variant> {};
TEST_P(Sm90Variant, MatchesReference) {
  EnvGuard cluster("EPMOE_SM90_CLUSTER", GetParam().cluster);
  EnvGuard group("EPMOE_SM90_GROUP", GetParam().group);
  EnvGuard order("EPMOE_SM90_ORDER", GetParam().order);
  EnvGuard knob(GetParam().knob, GetParam().value);
  run_case(GetParam().c);
}
INSTANTIATE_TEST_SUITE_P(Sm90Experts, Sm90Variant, ::testing::ValuesIn(variants()),
                         [](const ::testing::TestParamInfo<Variant>& info) { return std::string(info.param.name); });
// Byte and element offsets past 2^31 in xs, act-free dims, and out: 310k rows of 7168.
TEST(Sm90Experts, Large64BitOffsets) {
  size_t free_b = 0, total_b = 0;
  REQUIRE_SM90();
  TCHECK(cudaMemGetInfo(&free_b, &total_b));
  if (free_b < (size_t(16) << 30)) GTEST_SKIP() << "needs 16 GiB of free device memory";
  run_case({2, 1, 7168, 128, 310000, Route::uniform, 0, 24});
}
TEST(Sm90Experts, Large64BitOffsetsSeparateGather) {
  size_t free_b = 0, total_b = 0;
  REQUIRE_SM90();
  TCHECK(cudaMemGetInfo(&free_b, &total_b));
  if (free_b < (size_t(16) << 30)) GTEST_SKIP() << "needs 16 GiB of free device memory";
  run_case(separate({2, 1, 7168, 128, 310000, Route::uniform, 0, 24}));
}

}  // namespace
