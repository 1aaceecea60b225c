// Single-GPU benchmark of the sm_90a split expert pipeline, in the method of
// shared/baselines/baseline_moe.py so the numbers line up with launch/baseline_moe.py:
//   seed region = UP + DOWN from a pre-gathered xs (the seed's timed region: routing, sort, gather,
//                 scatter outside)
//   full layer  = out zeroed by the UP kernel itself (ExpertProblem::zero_out; EPMOE_BENCH_ZERO=side:
//                 a memset on a side stream, event-ordered) + UP gathering its rows from x
//                 (ExpertProblem::x, the engine's default) + DOWN (PDL)
//   full, separate gather = the same with the gather_rows kernel writing xs before UP (A/B)
// both captured in CUDA graphs, median of --iters replays, rotating among enough input sets that
// the inputs of consecutive replays exceed the 60 MB L2. Each kernel is also timed alone (its own
// graph, median of replays). FLOPs = 6 * T * k * hidden * ffn. Routing: softmax over N(0,1) logits, top-k,
// renormalized. Correctness is checked once per shape on a few sampled tokens against
// epmoe::reference_moe (fp64 host oracle).
//
//   epmoe_bench_experts [--shapes quick|full] [--shape E,k,hidden,ffn,T]... [--iters N] [--warmup-ms MS] [--json PATH]
//                       [--routing softmax|balanced] [--ab VAR=A,B [--ab-blocks N] [--ab-only]]   (a knob's two
//                       values timed in one process, interleaved or in steady-state blocks (Options
//                       says why blocks); balanced: every expert T k / E rows)
//                       [--no-check] [--zero-before-down] [--ab-region full|up|down]
// --ab-region: what the --ab blocks replay: the full layer (default), or UP (gathering from x, without
// the zeroing) or DOWN alone (a probe of one kernel's steady state, e.g. under launch/power_probe.sh).
// --zero-before-down joins the side-stream zeroing right before DOWN (seed 000's placement, more
// overlap) instead of before UP (the default, which keeps the UP -> DOWN edge a pure PDL edge).
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "epmoe/bf16.h"
#include "ep_protocol.h"
#include "epmoe/reference.h"
#include "kernels/cuda_check.cuh"
#include "kernels/expert_problem.cuh"
#include "kernels/gather_rows.cuh"
#include "kernels/hash_fill.cuh"
#include "kernels/sm90_experts.cuh"

namespace {

using epmoe::bf16;
using epmoe::kernels::ExpertProblem;
using epmoe::kernels::kExpertTile;

using epmoe::kernels::hash_fill::fill_hash_kernel;
using epmoe::kernels::hash_fill::hash_bf16;
using epmoe::kernels::hash_fill::mix64;

void fill_hash(uint16_t* p, int64_t n, uint64_t seed, float scale) {
  fill_hash_kernel<<<2048, 256>>>(p, n, seed, scale);
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

struct Dev {
  void* p = nullptr;
  size_t bytes = 0;
  Dev() = default;
  explicit Dev(size_t b) : bytes(b) {
    if (b) EPMOE_CUDA_CHECK(cudaMalloc(&p, b));
  }
  ~Dev() {
    if (p) cudaFree(p);
  }
  Dev(Dev&& o) noexcept : p(o.p), bytes(o.bytes) { o.p = nullptr; }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

struct Shape {
  int E, k, hidden, ffn;
  int64_t T;
};

struct Result {
  Shape s;
  int sets = 1;
  double seed_ms = 0, full_ms = 0, full_sep_ms = 0, gather_ms = 0, up_ms = 0, up_fused_ms = 0, down_ms = 0;
  double zero_ms = 0, full_serial_zero_ms = 0;  // the zeroing alone; the full layer with it serialized
  double max_rel_err = -1, rel_l2 = -1;
  int checked_tokens = 0;
  double ab_a_ms = 0, ab_b_ms = 0;  // --ab: the full layer under each value (median of all its replays)
  std::vector<double> ab_block_ms;   // --ab-blocks: each block's median, in run order (A B B A A B ...)
  int cluster = 0;                   // the cluster mode the kernels ran (sm90_cluster_mode, auto resolved)
  const char* up_gather = "single";  // the gathering UP's form (sm90_up_gather_form): single, cluster, pairs
};

double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct Routing {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};
// softmax(N(0,1) logits) -> top-k -> renormalize, like baseline_moe.py.
Routing softmax_topk_routing(int64_t T, int E, int k, uint64_t seed) {
  Routing r;
  r.ids.resize(size_t(T) * k);
  r.weights.resize(size_t(T) * k);
  std::vector<float> p(E);
  std::vector<int> idx(E);
  for (int64_t t = 0; t < T; ++t) {
    float mx = -1e30f;
    for (int e = 0; e < E; ++e) {
      const uint64_t h1 = mix64(seed ^ (uint64_t(t) * E + e) * 2 + 1), h2 = mix64(h1);
      const double u1 = (double(h1 >> 11) + 0.5) / 9007199254740992.0, u2 = double(h2 >> 11) / 9007199254740992.0;
      p[e] = float(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
      mx = std::max(mx, p[e]);
    }
    double sum = 0;
    for (int e = 0; e < E; ++e) sum += (p[e] = std::exp(p[e] - mx));
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int a, int b) { return p[a] > p[b]; });
    double ks = 0;
    for (int j = 0; j < k; ++j) ks += p[idx[j]] / sum;
    for (int j = 0; j < k; ++j) {
      r.ids[size_t(t) * k + j] = idx[j];
      r.weights[size_t(t) * k + j] = float(p[idx[j]] / sum / ks);
    }
  }
  return r;
}

Routing balanced_routing(int64_t T, int E, int k) {
  Routing r;
  r.ids.resize(size_t(T) * k);
  r.weights.assign(size_t(T) * k, 1.0f / float(k));
  for (int64_t i = 0; i < T * k; ++i) r.ids[size_t(i)] = int32_t(i % E);  // k <= E: a token's k ids differ
  return r;
}

struct Options {
  bool full = false;
  std::vector<Shape> only;  // --shape E,k,hidden,ffn,T (repeatable): these instead of a list
  int iters = 50;
  // Replays before each timed region, for at least this long (and at least 3 rounds): the board is
  // power-capped, and a region timed right after the host's setup (GPU idle) starts in a power
  // headroom that continuous training never sees. launch/baseline_moe.py warms up the same way.
  double warmup_ms = 500;
  std::string json;
  bool check = true;
  bool zero_before_down = false;
  // --routing balanced: token t's slot j goes to expert (t k + j) mod E, weight 1/k, so every expert
  // gets exactly T k / E rows (when E divides T k) - isolates work-order effects from expert sizes.
  bool balanced = false;
  // --ab VAR=A,B: the full layer captured once with VAR=A and once with VAR=B (the sm90 launchers read
  // their knobs when the graph is captured), then replayed alternately (ABBA order) in one process,
  // so clock and thermal drift fall on both alike. VAR may name several variables joined by '+'
  // (VAR1+VAR2=A,B sets each to A, then each to B).
  // Interleaved replays share one clock: on this power-capped board a variant that draws more power
  // is then timed at the mix's clock, higher than its own steady state (session 13: -4.2% interleaved,
  // -0.4% in separate steady-state processes). --ab-blocks N instead runs N rounds (AB, BA, AB, ...)
  // of blocks: each block replays its variant for --warmup-ms (to its own steady state) before timing
  // iters / N (at least 5) replays of it.
  std::string ab_var, ab_a, ab_b;
  int ab_blocks = 0;
  // --ab-only: skip the table's own timings (full, sep, seed, serial, each kernel alone: nine warm-ups)
  // and time only the A/B; the table then prints zeros in those columns.
  bool ab_only = false;
  std::string ab_region = "full";  // --ab-region full|up|down
};

// The variables named by --ab's VAR (one, or several joined by '+').
std::vector<std::string> ab_vars(const std::string& var) {
  std::vector<std::string> out;
  size_t from = 0;
  for (;;) {
    const size_t plus = var.find('+', from);
    out.push_back(var.substr(from, plus == std::string::npos ? std::string::npos : plus - from));
    if (plus == std::string::npos) break;
    from = plus + 1;
  }
  return out;
}

// Sets an environment variable for a scope and restores what was there.
struct ScopedEnv {
  std::string name;
  bool had = false;
  std::string old;
  ScopedEnv(const std::string& n, const std::string& v) : name(n) {
    if (const char* o = std::getenv(n.c_str())) {
      had = true;
      old = o;
    }
    setenv(n.c_str(), v.c_str(), 1);
  }
  ~ScopedEnv() {
    if (had) setenv(name.c_str(), old.c_str(), 1);
    else unsetenv(name.c_str());
  }
};

// How the full layer zeroes out: "up" (the default: the UP kernel zeroes it under its GEMM,
// ExpertProblem::zero_out) or "side" (a memset on a side stream joined before UP, or before DOWN
// with --zero-before-down). Read when the graphs are captured, so --ab EPMOE_BENCH_ZERO=side,up
// times both in one process (session 7: up 0.0-1.2% faster, docs/PERF.md).
bool bench_zero_in_up() {
  const char* v = std::getenv("EPMOE_BENCH_ZERO");
  if (v == nullptr || v[0] == '\0') return true;
  const std::string z(v);
  if (z != "side" && z != "up") throw std::runtime_error("EPMOE_BENCH_ZERO must be side or up, got '" + z + "'");
  return z == "up";
}

Result run_shape(const Shape& sh, const Options& opt) {
  const int E = sh.E, k = sh.k, H = sh.hidden, F = sh.ffn;
  const int64_t T = sh.T;
  Result res;
  res.s = sh;

  // ---- setup (outside timing): weights, routing, layout ----
  Dev w1(size_t(E) * 2 * F * H * 2), w2(size_t(E) * H * F * 2);
  fill_hash(w1.as<uint16_t>(), int64_t(E) * 2 * F * H, 21, std::sqrt(3.0f / H));
  fill_hash(w2.as<uint16_t>(), int64_t(E) * H * F, 31, 2.0f * std::sqrt(3.0f / F));
  const Routing rt = opt.balanced ? balanced_routing(T, E, k) : softmax_topk_routing(T, E, k, 41 + uint64_t(T));
  const epmoe::protocol::ExpertLayout L =
      epmoe::protocol::token_expert_layout(rt.ids.data(), rt.weights.data(), T, k, E, kExpertTile);
  // Capacity the engine would size from the host-known bound: every pair plus worst-case padding.
  const int64_t cap = (T * k + int64_t(E) * (kExpertTile - 1) + kExpertTile - 1) / kExpertTile * kExpertTile;
  res.cluster = epmoe::kernels::sm90_cluster_mode(H, cap, E);
  switch (epmoe::kernels::sm90_up_gather_form(H, F, cap, E, epmoe::kernels::sm90_up_staged_epilogue())) {
    case epmoe::kernels::UpGatherForm::single: res.up_gather = "single"; break;
    case epmoe::kernels::UpGatherForm::cluster: res.up_gather = "cluster"; break;
    case epmoe::kernels::UpGatherForm::pairs: res.up_gather = "pairs"; break;
  }
  Dev offs(size_t(E + 1) * 8), prow(size_t(cap) * 4), pw(size_t(cap) * 4);
  Dev cnts(size_t(E) * 8), counters(4 * sizeof(int32_t));  // the granular kernels' inputs (EPMOE_SM90_*_TILES)
  EPMOE_CUDA_CHECK(cudaMemcpy(offs.p, L.padded_offsets.data(), L.padded_offsets.size() * 8, cudaMemcpyHostToDevice));
  EPMOE_CUDA_CHECK(cudaMemcpy(cnts.p, L.expert_counts.data(), size_t(E) * 8, cudaMemcpyHostToDevice));
  EPMOE_CUDA_CHECK(cudaMemset(counters.p, 0, counters.bytes));
  EPMOE_CUDA_CHECK(cudaMemset(prow.p, 0xff, prow.bytes));
  EPMOE_CUDA_CHECK(cudaMemset(pw.p, 0, pw.bytes));
  EPMOE_CUDA_CHECK(cudaMemcpy(prow.p, L.pair_row.data(), L.pair_row.size() * 4, cudaMemcpyHostToDevice));
  EPMOE_CUDA_CHECK(cudaMemcpy(pw.p, L.pair_weight.data(), L.pair_weight.size() * 4, cudaMemcpyHostToDevice));

  // Input sets: x (and the seed region's xs) rotate so consecutive replays miss in L2.
  const size_t x_bytes = size_t(T) * H * 2, xs_bytes = size_t(cap) * H * 2;
  const size_t per_set = x_bytes + xs_bytes;
  const int sets = int(std::clamp<size_t>((size_t(180) << 20) / std::max<size_t>(per_set, 1) + 1, 1, 8));
  res.sets = sets;
  std::vector<Dev> xbuf, xsbuf;
  for (int i = 0; i < sets; ++i) {
    xbuf.emplace_back(x_bytes);
    xsbuf.emplace_back(xs_bytes);
    fill_hash(xbuf.back().as<uint16_t>(), T * H, 1000 + i, 1.0f);
  }
  Dev act(size_t(cap) * F * 2), out(size_t(T) * H * 2);
  const int64_t* total = offs.as<int64_t>() + E;

  auto problem = [&](int set, bool fused = false) {
    ExpertProblem p;
    if (fused) {
      p.x = xbuf[set].as<__nv_bfloat16>();
      p.x_rows = T;
    } else {
      p.xs = xsbuf[set].as<__nv_bfloat16>();
    }
    p.padded_offsets = offs.as<int64_t>();
    p.expert_counts = cnts.as<int64_t>();
    p.work_counters = counters.as<int32_t>();
    p.pair_row = prow.as<int32_t>();
    p.pair_weight = pw.as<float>();
    p.w1 = w1.as<__nv_bfloat16>();
    p.w2 = w2.as<__nv_bfloat16>();
    p.act = act.as<__nv_bfloat16>();
    p.out = out.as<__nv_bfloat16>();
    p.rows_capacity = cap;
    p.out_rows = T;
    p.experts = E;
    p.hidden = H;
    p.ffn = F;
    return p;
  };

  cudaStream_t s, side;
  EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  cudaEvent_t fork, zeroed, t0, t1;
  EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&zeroed, cudaEventDisableTiming));
  EPMOE_CUDA_CHECK(cudaEventCreate(&t0));
  EPMOE_CUDA_CHECK(cudaEventCreate(&t1));

  // fused: UP gathers from x (no gather kernel). serial_zero: the zeroing on the main stream first
  // (no overlap), to measure what the side stream saves.
  auto enqueue_full = [&](int set, bool fused, bool serial_zero = false) {
    ExpertProblem p = problem(set, fused);
    auto gather_if_separate = [&] {  // sep: the gather_rows kernel writes xs before UP
      if (!fused)
        epmoe::kernels::gather_rows_launch(xbuf[set].as<__nv_bfloat16>(), T, H, p.pair_row, total, cap,
                                           xsbuf[set].as<__nv_bfloat16>(), s);
    };
    if (serial_zero || bench_zero_in_up()) {
      if (serial_zero) EPMOE_CUDA_CHECK(cudaMemsetAsync(p.out, 0, size_t(T) * H * 2, s));
      else p.zero_out = true;  // no memset: UP zeroes out under its GEMM
      gather_if_separate();
      epmoe::kernels::sm90_experts_launch(p, s);
      return;
    }
    EPMOE_CUDA_CHECK(cudaEventRecord(fork, s));
    EPMOE_CUDA_CHECK(cudaStreamWaitEvent(side, fork, 0));
    EPMOE_CUDA_CHECK(cudaMemsetAsync(p.out, 0, size_t(T) * H * 2, side));
    EPMOE_CUDA_CHECK(cudaEventRecord(zeroed, side));
    gather_if_separate();
    if (opt.zero_before_down) {
      epmoe::kernels::sm90_up_launch(p, s);
      EPMOE_CUDA_CHECK(cudaStreamWaitEvent(s, zeroed, 0));
      epmoe::kernels::sm90_down_launch(p, s, true);
    } else {
      EPMOE_CUDA_CHECK(cudaStreamWaitEvent(s, zeroed, 0));
      epmoe::kernels::sm90_experts_launch(p, s);
    }
  };
  auto capture = [&](auto&& body) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    EPMOE_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    body();
    EPMOE_CUDA_CHECK(cudaStreamEndCapture(s, &g));
    EPMOE_CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
    EPMOE_CUDA_CHECK(cudaGraphDestroy(g));
    return ge;
  };
  // Rounds of `round()` (enqueueing one replay of each input set) until opt.warmup_ms of wall time
  // has passed, at least 3, synchronizing every 8 rounds to read the clock.
  auto warm_up = [&](auto&& round) {
    const auto start = std::chrono::steady_clock::now();
    for (int r = 1;; ++r) {
      round();
      if (r % 8 != 0 && r > 3) continue;
      EPMOE_CUDA_CHECK(cudaStreamSynchronize(s));
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      if (r >= 3 && ms >= opt.warmup_ms) break;
    }
  };
  // One replay of g between events, in ms.
  auto time_replay = [&](cudaGraphExec_t g) {
    EPMOE_CUDA_CHECK(cudaEventRecord(t0, s));
    EPMOE_CUDA_CHECK(cudaGraphLaunch(g, s));
    EPMOE_CUDA_CHECK(cudaEventRecord(t1, s));
    EPMOE_CUDA_CHECK(cudaEventSynchronize(t1));
    float ms = 0;
    EPMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, t0, t1));
    return ms;
  };
  auto time_graphs = [&](std::vector<cudaGraphExec_t>& gs) {
    warm_up([&] {
      for (auto g : gs) EPMOE_CUDA_CHECK(cudaGraphLaunch(g, s));
    });
    std::vector<float> ts;
    for (int i = 0; i < opt.iters; ++i) ts.push_back(time_replay(gs[size_t(i) % gs.size()]));
    return median(ts);
  };

  // Fill every xs set once (the seed region reads xs as its input).
  for (int i = 0; i < sets; ++i)
    epmoe::kernels::gather_rows_launch(xbuf[i].as<__nv_bfloat16>(), T, H, prow.as<int32_t>(), total, cap,
                                       xsbuf[i].as<__nv_bfloat16>(), s);
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(s));

  std::vector<cudaGraphExec_t> full_g, sep_g, seed_g, serial_g;
  for (int i = 0; i < sets; ++i) {
    full_g.push_back(capture([&] { enqueue_full(i, /*fused=*/epmoe::kernels::sm90_fused_gather_enabled()); }));
    sep_g.push_back(capture([&] { enqueue_full(i, /*fused=*/false); }));
    seed_g.push_back(capture([&] { epmoe::kernels::sm90_experts_launch(problem(i), s); }));
    serial_g.push_back(capture([&] { enqueue_full(i, /*fused=*/epmoe::kernels::sm90_fused_gather_enabled(), /*serial_zero=*/true); }));
  }
  const bool table = !(opt.ab_only && !opt.ab_var.empty());
  if (table) {
    res.full_ms = time_graphs(full_g);
    res.full_sep_ms = time_graphs(sep_g);
    res.seed_ms = time_graphs(seed_g);
    res.full_serial_zero_ms = time_graphs(serial_g);
  }
  // Each kernel alone, also as graph replays (a plain launch timed with events would include the
  // host's launch work - tensor-map encoding - while the GPU idles).
  auto time_alone = [&](auto&& launch) {
    std::vector<cudaGraphExec_t> gs;
    for (int i = 0; i < sets; ++i) gs.push_back(capture([&] { launch(i); }));
    const double ms = time_graphs(gs);
    for (auto g : gs) cudaGraphExecDestroy(g);
    return ms;
  };
  if (table) {
    res.zero_ms = time_alone([&](int i) { EPMOE_CUDA_CHECK(cudaMemsetAsync(problem(i).out, 0, size_t(T) * H * 2, s)); });
    res.gather_ms = time_alone([&](int i) {
      epmoe::kernels::gather_rows_launch(xbuf[i].as<__nv_bfloat16>(), T, H, prow.as<int32_t>(), total, cap,
                                         xsbuf[i].as<__nv_bfloat16>(), s);
    });
    res.up_ms = time_alone([&](int i) { epmoe::kernels::sm90_up_launch(problem(i), s); });
    res.up_fused_ms = time_alone([&](int i) { epmoe::kernels::sm90_up_launch(problem(i, true), s); });
    res.down_ms = time_alone([&](int i) { epmoe::kernels::sm90_down_launch(problem(i), s, false); });
  }
  if (!opt.ab_var.empty()) {
    std::vector<cudaGraphExec_t> ga, gb;
    const auto capture_with = [&](const std::string& value, std::vector<cudaGraphExec_t>& gs) {
      std::vector<std::unique_ptr<ScopedEnv>> env;
      for (const std::string& v : ab_vars(opt.ab_var)) env.push_back(std::make_unique<ScopedEnv>(v, value));
      for (int i = 0; i < sets; ++i)
        gs.push_back(capture([&] {
          if (opt.ab_region == "up") epmoe::kernels::sm90_up_launch(problem(i, true), s);
          else if (opt.ab_region == "down") epmoe::kernels::sm90_down_launch(problem(i), s, false);
          else enqueue_full(i, /*fused=*/epmoe::kernels::sm90_fused_gather_enabled());
        }));
    };
    if (opt.ab_region == "down") {  // DOWN alone reads act: UP writes it first (zeros draw less power)
      for (int i = 0; i < sets; ++i) epmoe::kernels::sm90_up_launch(problem(i, true), s);
      EPMOE_CUDA_CHECK(cudaStreamSynchronize(s));
    }
    capture_with(opt.ab_a, ga);
    capture_with(opt.ab_b, gb);
    std::vector<float> ta, tb;
    if (opt.ab_blocks > 0) {
      const int per_block = std::max(5, opt.iters / opt.ab_blocks);
      for (int r = 0; r < opt.ab_blocks; ++r) {
        for (int half = 0; half < 2; ++half) {
          const bool a = (half == 0) == (r % 2 == 0);  // AB, BA, AB, ...
          std::vector<cudaGraphExec_t>& gs = a ? ga : gb;
          warm_up([&] {
            for (auto g : gs) EPMOE_CUDA_CHECK(cudaGraphLaunch(g, s));
          });
          std::vector<float> block;
          for (int i = 0; i < per_block; ++i) block.push_back(time_replay(gs[size_t(i) % gs.size()]));
          res.ab_block_ms.push_back(median(block));
          (a ? ta : tb).insert((a ? ta : tb).end(), block.begin(), block.end());
        }
      }
    } else {
      warm_up([&] {
        for (int i = 0; i < sets; ++i) {
          EPMOE_CUDA_CHECK(cudaGraphLaunch(ga[size_t(i)], s));
          EPMOE_CUDA_CHECK(cudaGraphLaunch(gb[size_t(i)], s));
        }
      });
      for (int i = 0; i < 2 * opt.iters; ++i) {
        const size_t set = size_t(i / 2) % size_t(sets);
        if ((i & 1) == (i / 2 & 1)) ta.push_back(time_replay(ga[set]));  // A B, B A, A B, ...
        else tb.push_back(time_replay(gb[set]));
      }
    }
    res.ab_a_ms = median(ta);
    res.ab_b_ms = median(tb);
    for (auto g : ga) cudaGraphExecDestroy(g);
    for (auto g : gb) cudaGraphExecDestroy(g);
  }
  for (auto g : full_g) cudaGraphExecDestroy(g);
  for (auto g : sep_g) cudaGraphExecDestroy(g);
  for (auto g : seed_g) cudaGraphExecDestroy(g);
  for (auto g : serial_g) cudaGraphExecDestroy(g);

  // ---- correctness: one full layer on set 0 per gather mode, sampled tokens vs the reference ----
  if (opt.check) {
    const double macs_per_token = 3.0 * k * double(H) * F;
    const int n = int(std::clamp(2e9 / macs_per_token, 4.0, 16.0));
    std::vector<int64_t> toks;
    for (int i = 0; i < n; ++i) toks.push_back(i == 0 ? 0 : i == 1 ? T - 1 : int64_t(mix64(7 + i) % uint64_t(T)));
    std::vector<bf16> hw1(size_t(E) * 2 * F * H), hw2(size_t(E) * H * F);
    EPMOE_CUDA_CHECK(cudaMemcpy(hw1.data(), w1.p, w1.bytes, cudaMemcpyDeviceToHost));
    EPMOE_CUDA_CHECK(cudaMemcpy(hw2.data(), w2.p, w2.bytes, cudaMemcpyDeviceToHost));
    std::vector<bf16> xh(size_t(n) * H);
    std::vector<int32_t> ids(size_t(n) * k);
    std::vector<float> wts(size_t(n) * k), ref(size_t(n) * H);
    for (int i = 0; i < n; ++i) {
      for (int c = 0; c < H; ++c) xh[size_t(i) * H + c].bits = hash_bf16(1000, uint64_t(toks[i]) * H + c, 1.0f);
      for (int j = 0; j < k; ++j) {
        ids[size_t(i) * k + j] = rt.ids[size_t(toks[i]) * k + j];
        wts[size_t(i) * k + j] = rt.weights[size_t(toks[i]) * k + j];
      }
    }
    epmoe::reference_moe(xh.data(), ids.data(), wts.data(), n, k, hw1.data(), hw2.data(), E, H, F, ref.data());
    res.max_rel_err = 0;
    res.rel_l2 = 0;
    for (const bool fused : {true, false}) {
      EPMOE_CUDA_CHECK(cudaMemsetAsync(out.p, 0xff, out.bytes, s));  // poison: the layer must zero and fill it
      EPMOE_CUDA_CHECK(cudaStreamSynchronize(s));
      enqueue_full(0, fused);
      EPMOE_CUDA_CHECK(cudaStreamSynchronize(s));
      std::vector<uint16_t> y(size_t(n) * H);
      for (int i = 0; i < n; ++i)
        EPMOE_CUDA_CHECK(cudaMemcpy(&y[size_t(i) * H], out.as<uint16_t>() + size_t(toks[i]) * H, size_t(H) * 2,
                          cudaMemcpyDeviceToHost));
      double e2 = 0, r2 = 0, worst = 0;
      bool finite = true;
      for (int i = 0; i < n; ++i) {
        double rowmax = 0;
        for (int c = 0; c < H; ++c) rowmax = std::max(rowmax, double(std::fabs(ref[size_t(i) * H + c])));
        for (int c = 0; c < H; ++c) {
          const double got = bf16::to_float(y[size_t(i) * H + c]), want = ref[size_t(i) * H + c];
          if (!std::isfinite(got)) finite = false;
          const double d = std::fabs(got - want);
          e2 += d * d;
          r2 += want * want;
          if (rowmax > 0) worst = std::max(worst, d / rowmax);
        }
      }
      // The worse of the two gather modes.
      res.max_rel_err = finite ? std::max(res.max_rel_err, worst) : INFINITY;
      res.rel_l2 = finite ? std::max(res.rel_l2, std::sqrt(e2 / std::max(r2, 1e-30))) : INFINITY;
    }
    res.checked_tokens = n;
  }

  cudaEventDestroy(fork);
  cudaEventDestroy(zeroed);
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  cudaStreamDestroy(side);
  cudaStreamDestroy(s);
  return res;
}

// The work order the kernels use for a typical expert count at `hidden` (the knob's value, or auto's
// choice; "global" also when the expert count is too large for the by-expert schedule, which no bench
// shape is).
const char* order_knob() {
  const char* v = std::getenv("EPMOE_SM90_ORDER");
  return v != nullptr && v[0] != '\0' ? v : "auto";
}
const char* order_name(int hidden) {
  return epmoe::kernels::sm90_order_by_expert(32, hidden) ? "expert" : "global";
}
// The tile shape a kernel's knob asks for (EPMOE_SM90_UP_TILES / EPMOE_SM90_DOWN_TILES, default
// whole); the granular kernels still defer to clusters asked for explicitly (EPMOE_SM90_CLUSTER).
const char* tiles_name(bool up) {
  const bool g = up ? epmoe::kernels::sm90_up_granular() : epmoe::kernels::sm90_down_granular();
  return g ? "granular" : "whole";
}

double tflops(const Shape& s, double ms) { return ms > 0 ? 6.0 * double(s.T) * s.k * s.hidden * s.ffn / ms / 1e9 : 0.0; }

void write_json(const std::string& path, const std::vector<Result>& rs, const char* device, bool zbd, double warmup_ms) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) throw std::runtime_error("cannot write " + path);
  std::fprintf(f,
               "{\n \"impl\": \"epmoe_sm90_split\",\n \"device\": \"%s\",\n \"warmup_ms\": %.0f,\n \"zero_before_down\": %s,\n"
               " \"cluster_mode\": %d,\n \"group_tiles\": %d,\n \"order\": \"%s\",\n \"moe\": [\n",
               device, warmup_ms, zbd ? "true" : "false", epmoe::kernels::sm90_cluster_knob(),
               epmoe::kernels::sm90_group_tiles(), order_knob());
  for (size_t i = 0; i < rs.size(); ++i) {
    const Result& r = rs[i];
    std::fprintf(f,
                 "  {\"E\": %d, \"k\": %d, \"hidden\": %d, \"ffn\": %d, \"T\": %lld, \"sets\": %d, "
                 "\"seed_ms\": %.6f, \"seed_tflops\": %.3f, \"full_ms\": %.6f, \"full_tflops\": %.3f, "
                 "\"full_separate_gather_ms\": %.6f, \"gather_ms\": %.6f, \"up_ms\": %.6f, \"up_fused_gather_ms\": %.6f, "
                 "\"down_ms\": %.6f, \"zero_ms\": %.6f, "
                 "\"full_serial_zero_ms\": %.6f, \"checked_tokens\": %d, "
                 "\"max_rel_err\": %.6g, \"rel_l2\": %.6g, \"ab_a_ms\": %.6f, \"ab_b_ms\": %.6f, "
                 "\"up_tiles\": \"%s\", \"down_tiles\": \"%s\", \"order\": \"%s\", \"cluster\": %d, \"up_gather\": \"%s\"}%s\n",
                 r.s.E, r.s.k, r.s.hidden, r.s.ffn, (long long)r.s.T, r.sets, r.seed_ms, tflops(r.s, r.seed_ms), r.full_ms,
                 tflops(r.s, r.full_ms), r.full_sep_ms, r.gather_ms, r.up_ms, r.up_fused_ms, r.down_ms, r.zero_ms,
                 r.full_serial_zero_ms,
                 r.checked_tokens,
                 std::isfinite(r.max_rel_err) ? r.max_rel_err : 1e30, std::isfinite(r.rel_l2) ? r.rel_l2 : 1e30,
                 r.ab_a_ms, r.ab_b_ms, tiles_name(true), tiles_name(false), order_name(r.s.hidden), r.cluster,
                 r.up_gather, i + 1 < rs.size() ? "," : "");
  }
  std::fprintf(f, " ]\n}\n");
  std::fclose(f);
}

}  // namespace

// Parses argv into opt; returns -1 to go on, else the exit code (help: 0, bad argument: 2).
int parse_args(int argc, char** argv, Options& opt) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error("missing value after " + a);
      return argv[++i];
    };
    if (a == "--shapes") {
      const std::string v = next();
      if (v != "quick" && v != "full") throw std::runtime_error("--shapes quick|full");
      opt.full = v == "full";
    } else if (a == "--shape") {
      Shape sh{};
      long long T = 0;
      if (std::sscanf(next().c_str(), "%d,%d,%d,%d,%lld", &sh.E, &sh.k, &sh.hidden, &sh.ffn, &T) != 5 || T <= 0 ||
          sh.E <= 0 || sh.k <= 0 || sh.k > sh.E || sh.hidden <= 0 || sh.ffn <= 0)
        throw std::runtime_error("--shape E,k,hidden,ffn,T");
      sh.T = T;
      opt.only.push_back(sh);
    } else if (a == "--warmup-ms") {
      opt.warmup_ms = std::max(0.0, std::atof(next().c_str()));
    } else if (a == "--iters") {
      opt.iters = std::max(1, std::atoi(next().c_str()));
    } else if (a == "--json") {
      opt.json = next();
    } else if (a == "--no-check") {
      opt.check = false;
    } else if (a == "--zero-before-down") {
      opt.zero_before_down = true;
    } else if (a == "--routing") {
      const std::string v = next();
      if (v != "softmax" && v != "balanced") throw std::runtime_error("--routing softmax|balanced");
      opt.balanced = v == "balanced";
    } else if (a == "--ab") {
      const std::string v = next();
      const size_t eq = v.find('='), comma = v.find(',', eq == std::string::npos ? 0 : eq);
      if (eq == std::string::npos || eq == 0 || comma == std::string::npos || comma + 1 >= v.size())
        throw std::runtime_error("--ab VAR=A,B (for example EPMOE_SM90_GROUP=1,16)");
      opt.ab_var = v.substr(0, eq);
      opt.ab_a = v.substr(eq + 1, comma - eq - 1);
      opt.ab_b = v.substr(comma + 1);
      for (const std::string& name : ab_vars(opt.ab_var))
        if (name.empty()) throw std::runtime_error("--ab VAR1+VAR2=A,B: an empty variable name in '" + opt.ab_var + "'");
    } else if (a == "--ab-only") {
      opt.ab_only = true;
    } else if (a == "--ab-region") {
      opt.ab_region = next();
      if (opt.ab_region != "full" && opt.ab_region != "up" && opt.ab_region != "down")
        throw std::runtime_error("--ab-region full|up|down");
    } else if (a == "--ab-blocks") {
      opt.ab_blocks = std::atoi(next().c_str());
      if (opt.ab_blocks < 1) throw std::runtime_error("--ab-blocks N (N >= 1 rounds of an A block and a B block)");
    } else if (a == "-h" || a == "--help") {
      std::printf("usage: %s [--shapes quick|full] [--shape E,k,hidden,ffn,T]... [--iters N] [--warmup-ms MS] [--json PATH] [--no-check] "
                  "[--zero-before-down] [--routing softmax|balanced] [--ab VAR[+VAR2...]=A,B [--ab-blocks N] [--ab-only] "
                  "[--ab-region full|up|down]]\n",
                  argv[0]);
      return 0;
    } else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  if (opt.ab_region != "full" && opt.ab_var.empty()) throw std::runtime_error("--ab-region needs --ab VAR=A,B");
  return -1;
}

int main(int argc, char** argv) {
  Options opt;
  try {
    const int rc = parse_args(argc, argv, opt);
    if (rc >= 0) return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bad argument: %s\n", e.what());
    return 2;
  }
  try {
    int dev = 0;
    EPMOE_CUDA_CHECK(cudaGetDevice(&dev));
    cudaDeviceProp prop{};
    EPMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    if (!epmoe::kernels::sm90_experts_supported(dev)) {
      std::fprintf(stderr, "device %s (cc %d.%d): the sm_90a pipeline is not supported here\n", prop.name, prop.major,
                   prop.minor);
      return 1;
    }
    std::vector<Shape> shapes;
    if (!opt.only.empty()) {
      shapes = opt.only;
    } else if (opt.full) {
      for (int64_t T : {1024, 4096, 16384, 65536, 131072}) shapes.push_back({32, 4, 2048, 1024, T});
      for (int64_t T : {4096, 16384}) shapes.push_back({128, 8, 2048, 768, T});
      for (int64_t T : {2048, 8192}) shapes.push_back({32, 8, 7168, 2048, T});
    } else {
      for (int64_t T : {4096, 16384}) shapes.push_back({32, 4, 2048, 1024, T});
      shapes.push_back({32, 8, 7168, 2048, 2048});
    }
    std::printf("# epmoe sm_90a split pipeline on %s (%d SMs), %d iters, median, after >= %.0f ms of warm-up replays; "
                "zeroing joined before %s\n",
                prop.name, prop.multiProcessorCount, opt.iters, opt.warmup_ms, opt.zero_before_down ? "DOWN" : "UP");
    std::printf("# full: as the engine runs it (UP gathers its rows unless EPMOE_SM90_GATHER=separate); sep: gather_rows kernel + UP from xs. up: from xs; upG: gathering\n");
    std::printf("# kernels: EPMOE_SM90_CLUSTER=%d (0 single CTAs, 1 2-CTA weight multicast in both, 2 in DOWN and "
                "UP-from-xs, -1 auto: 1 at hidden >= 4096 with >= 1024 capacity rows per expert), EPMOE_SM90_GROUP=%d "
                "row tiles per scheduling group, EPMOE_SM90_ORDER=%s (hidden 2048: %s, 7168: %s)\n",
                epmoe::kernels::sm90_cluster_knob(), epmoe::kernels::sm90_group_tiles(), order_knob(), order_name(2048),
                order_name(7168));
    std::printf("# tiles: UP %s, DOWN %s (EPMOE_SM90_UP_TILES / EPMOE_SM90_DOWN_TILES: whole = 128-row tiles, "
                "granular = swap-AB token-granular tiles)\n",
                tiles_name(true), tiles_name(false));
    std::printf("# gathering UP: EPMOE_SM90_UP_SHARE_A=%s (auto: 2-CTA pairs sharing each gathered A tile, also in "
                "place of the weight-multicast clusters while EPMOE_SM90_CLUSTER is auto; JSON up_gather per shape)\n",
                std::array<const char*, 3>{"off", "on", "auto"}[size_t(epmoe::kernels::sm90_up_share_a_mode())]);
    std::printf("# full zeroes out %s; zero ms: the output memset alone; serial ms: the full layer with it on the main "
                "stream (no overlap)\n",
                bench_zero_in_up() ? "in the UP kernel (EPMOE_BENCH_ZERO=up)" : "on a side stream (EPMOE_BENCH_ZERO=side)");
    std::printf("# %4s %2s %6s %5s %7s | %9s %8s | %9s %8s | %9s %8s | %9s %9s %9s %9s | %8s %9s | %10s %9s\n", "E", "k",
                "hidden", "ffn", "T", "seed ms", "TFLOP/s", "full ms", "TFLOP/s", "sep ms", "TFLOP/s", "gather ms", "up ms",
                "upG ms", "down ms", "zero ms", "serial ms", "max_rel", "rel_l2");
    std::vector<Result> rs;
    bool ok = true;
    for (const Shape& sh : shapes) {
      const Result r = run_shape(sh, opt);
      rs.push_back(r);
      std::printf("  %4d %2d %6d %5d %7lld | %9.4f %8.1f | %9.4f %8.1f | %9.4f %8.1f | %9.4f %9.4f %9.4f %9.4f | %8.4f %9.4f | "
                  "%10.3e %9.3e\n",
                  sh.E, sh.k, sh.hidden, sh.ffn, (long long)sh.T, r.seed_ms, tflops(sh, r.seed_ms), r.full_ms,
                  tflops(sh, r.full_ms), r.full_sep_ms, tflops(sh, r.full_sep_ms), r.gather_ms, r.up_ms, r.up_fused_ms,
                  r.down_ms, r.zero_ms, r.full_serial_zero_ms, r.max_rel_err, r.rel_l2);
      if (!opt.ab_var.empty())
        std::printf("#   A/B %s: %s %.4f ms, %s %.4f ms, B/A %.4f (%s, %s)\n", opt.ab_var.c_str(),
                    opt.ab_a.c_str(), r.ab_a_ms, opt.ab_b.c_str(), r.ab_b_ms, r.ab_a_ms > 0 ? r.ab_b_ms / r.ab_a_ms : 0.0,
                    opt.ab_region == "full" ? "full layer" : (opt.ab_region + " alone").c_str(),
                    opt.ab_blocks > 0 ? (std::to_string(opt.ab_blocks) + " rounds of steady-state blocks").c_str()
                                      : "interleaved replays");
      if (!r.ab_block_ms.empty()) {
        std::printf("#   A/B block medians (ms, in run order; each round AB or BA):");
        for (size_t b = 0; b < r.ab_block_ms.size(); ++b)
          std::printf(" %s%.4f", ((b / 2) % 2 == 0) == (b % 2 == 0) ? "A " : "B ", r.ab_block_ms[b]);
        std::printf("\n");
      }
      std::fflush(stdout);
      // Same bound as the test suite: 2k * 2^-8 of the row maximum, 1e-2 relative L2.
      if (opt.check && !(r.max_rel_err <= 2.0 * sh.k / 256.0 && r.rel_l2 < 1e-2)) ok = false;
    }
    if (!opt.json.empty()) write_json(opt.json, rs, prop.name, opt.zero_before_down, opt.warmup_ms);
    if (!ok) {
      std::printf("# CHECK FAILED: an error above exceeds 2k*2^-8 of the row max or 1e-2 relative L2\n");
      return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
