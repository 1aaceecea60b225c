// Single-GPU benchmark of the sm_90a split expert pipeline, in the method of
// shared/baselines/baseline_moe.py so the numbers line up with launch/baseline_moe.py:
//   full   = the layer as the engine runs it: out zeroed by the UP kernel itself (--zero up, the
//            default: ExpertProblem::zero_out) or by a memset on a side stream (--zero side,
//            event-ordered, joined before UP or with --zero-before-down before DOWN), UP gathering
//            its rows from x, DOWN PDL-chained behind it
//   serial = the full layer with the zeroing as a memset on the main stream first (no overlap)
//   zero   = that memset alone; up, down = each kernel alone (UP without the zeroing)
// There is no seed region (UP + DOWN from a pre-gathered xs): the UP always gathers from x, so
// launch/compare_experts.py sets torch's seed region against our full layer, which does more work.
// Every region is captured in CUDA graphs and timed as the median of --iters replays, rotating
// among enough input sets that the inputs of consecutive replays exceed the 60 MB L2. FLOPs =
// 6 * T * k * hidden * ffn. Routing: softmax over N(0,1) logits, top-k, renormalized. Correctness
// is checked once per shape and plan on a few sampled tokens against epmoe::reference_moe (fp64).
//
// The kernels run the heuristics' default plan for each shape (kernels/heuristics), with --plan
// SPEC on top; --ab-plan SPEC_A/SPEC_B times two overrides (on top of that) in one process.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ep_protocol.h"
#include "epmoe/bf16.h"
#include "epmoe/error.h"
#include "epmoe/reference.h"
#include "epmoe/sm90_plan.h"
#include "bench_hbm.cuh"
#include "kernels/cuda_check.cuh"
#include "kernels/expert_problem.cuh"
#include "kernels/hash_fill.cuh"
#include "kernels/sm90/experts.cuh"

namespace {

using epmoe::bf16;
using epmoe::Sm90Plan;
using epmoe::Sm90PlanOverride;
using epmoe::kernels::ExpertProblem;
using epmoe::kernels::kExpertTile;

using epmoe::kernels::hash_fill::fill_hash_kernel;
using epmoe::kernels::hash_fill::hash_bf16;
using epmoe::kernels::hash_fill::mix64;

const char* const kUsage =
    "usage: %s [--shapes quick|full] [--shape E,k,hidden,ffn,T]... [--iters N] [--warmup-ms MS] [--json PATH]\n"
    "          [--no-check] [--routing softmax|balanced] [--zero up|side [--zero-before-down]] [--plan SPEC]\n"
    "          [--ab-plan SPEC_A/SPEC_B [--ab-blocks N] [--ab-only] [--ab-region full|up|down]] [--forms]\n"
    "  SPEC: a plan override, key=value,... (epmoe/sm90_plan.h): up=single|cluster|pairs, order=global|expert,\n"
    "        up_order=, down_order=, down=single|cluster, split=none|up|down|up+down, split_ctas=N,\n"
    "        pad=none|up|down|up+down, tail=on|off, swap=on|off, fused=on|off. An empty --ab-plan side is the default\n"
    "        plan (with --plan).\n"
    "  --forms: the full layer under the automatic plan, the 128-row kernels, split swap-AB and fused swap-AB,\n"
    "        interleaved, beside the weight-streaming floor (touched experts' weights / HBM read rate, this run).\n";

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

// Capacity the engine would size from the host-known bound: every pair plus worst-case padding.
int64_t capacity(const Shape& s) {
  return (s.T * s.k + int64_t(s.E) * (kExpertTile - 1) + kExpertTile - 1) / kExpertTile * kExpertTile;
}

struct Result {
  Shape s;
  int sets = 1;
  Sm90Plan plan, plan_a, plan_b;  // the table's plan; --ab-plan's two
  double full_ms = 0, up_ms = 0, down_ms = 0;
  double zero_ms = 0, full_serial_zero_ms = 0;  // the zeroing alone; the full layer with it serialized
  double max_rel_err = -1, rel_l2 = -1;         // the worst over the plans timed
  int checked_tokens = 0;
  double ab_a_ms = 0, ab_b_ms = 0;  // --ab-plan: the region under each plan (median of all its replays)
  std::vector<double> ab_block_ms;  // --ab-blocks: each block's median, in run order (A B B A A B ...)
  // --forms: the full layer under each form of kForms (0: not valid for the shape), and the floor
  double form_ms[4] = {0, 0, 0, 0};
  int touched = 0;
  double hbm_tbs = 0, floor_ms = 0;
};

// --forms: the automatic plan (the default, with --plan), then each form forced on top of it.
constexpr const char* kFormNames[4] = {"auto", "row128", "swap", "fused"};
constexpr const char* kFormSpecs[4] = {"", "swap=off,fused=off", "swap=on,fused=off", "fused=on"};

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
  // --zero up|side: the UP kernel zeroes out under its GEMM (the engine's way), or a memset on a
  // side stream joined before UP (before DOWN with --zero-before-down: more overlap, but the
  // UP -> DOWN edge is then no pure PDL edge).
  bool zero_in_up = true;
  bool zero_before_down = false;
  // --routing balanced: token t's slot j goes to expert (t k + j) mod E, weight 1/k, so every expert
  // gets exactly T k / E rows (when E divides T k) - isolates work-order effects from expert sizes.
  bool balanced = false;
  std::string plan_spec;  // --plan: on top of the default plan of every shape
  // --ab-plan A/B: the region captured once under each plan, then replayed alternately (ABBA order)
  // in one process, so clock and thermal drift fall on both alike. Interleaved replays share one
  // clock: on this power-capped board a plan that draws more power is then timed at the mix's
  // clock, above its own steady state (-4.2% interleaved against -0.4% in separate steady-state
  // processes, measured). --ab-blocks N instead runs N rounds (AB, BA, AB, ...) of blocks: each
  // block replays its plan for --warmup-ms (to its own steady state) before timing iters / N (at
  // least 5) replays of it.
  bool ab = false;
  std::string ab_a, ab_b;
  int ab_blocks = 0;
  // --ab-only: skip the table's own timings (five warm-ups per shape) and time only the A/B; the
  // table then prints zeros in those columns.
  bool ab_only = false;
  bool forms = false;  // --forms (kFormSpecs)
  // --ab-region: what the A/B replays: the full layer, or UP (without the zeroing) or DOWN alone
  // (a probe of one kernel's steady state, e.g. under launch/power_probe.sh).
  std::string ab_region = "full";
};

// The override of one A/B side: --plan's spec, then the side's (the parser applies tokens in
// order, so the side's keys win).
Sm90PlanOverride side_override(const Options& o, const std::string& side) {
  return epmoe::parse_sm90_plan_override(o.plan_spec + "," + side);
}

// A problem carrying only what the heuristics read (dims, capacity): to resolve and check the plans
// of every shape before any buffer is allocated.
ExpertProblem dims_problem(const Shape& s) {
  ExpertProblem p = epmoe::kernels::make_expert_problem({nullptr, nullptr, s.E, s.hidden, s.ffn}, nullptr, s.T,
                                                        {nullptr, nullptr, nullptr, capacity(s)}, nullptr, nullptr, s.T);
  p.pairs = s.T * s.k;  // (the bound the engine gives the heuristics)
  return p;
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
  const int64_t cap = capacity(sh);
  Dev offs(size_t(E + 1) * 8), prow(size_t(cap) * 4), pw(size_t(cap) * 4);
  EPMOE_CUDA_CHECK(cudaMemcpy(offs.p, L.padded_offsets.data(), L.padded_offsets.size() * 8, cudaMemcpyHostToDevice));
  EPMOE_CUDA_CHECK(cudaMemset(prow.p, 0xff, prow.bytes));
  EPMOE_CUDA_CHECK(cudaMemset(pw.p, 0, pw.bytes));
  EPMOE_CUDA_CHECK(cudaMemcpy(prow.p, L.pair_row.data(), L.pair_row.size() * 4, cudaMemcpyHostToDevice));
  EPMOE_CUDA_CHECK(cudaMemcpy(pw.p, L.pair_weight.data(), L.pair_weight.size() * 4, cudaMemcpyHostToDevice));

  // Input sets: x rotates so consecutive replays miss in L2. The count follows baseline_moe.py's
  // rule (x plus its gathered copy per set) although only x exists here: the same sets as torch and
  // as the older builds of this bench, which rotated a pre-gathered xs too.
  const size_t x_bytes = size_t(T) * H * 2, per_set = x_bytes + size_t(cap) * H * 2;
  const int sets = int(std::clamp<size_t>((size_t(180) << 20) / std::max<size_t>(per_set, 1) + 1, 1, 8));
  res.sets = sets;
  std::vector<Dev> xbuf;
  for (int i = 0; i < sets; ++i) {
    xbuf.emplace_back(x_bytes);
    fill_hash(xbuf.back().as<uint16_t>(), T * H, 1000 + i, 1.0f);
  }
  Dev act(size_t(cap) * F * 2), out(size_t(T) * H * 2), out_acc(size_t(T) * H * 4);
  EPMOE_CUDA_CHECK(cudaMemset(out_acc.p, 0, out_acc.bytes));  // (the fused pipeline leaves it zero)
  // The uploads and fills above are on the legacy stream, which the timed streams do not wait for.
  EPMOE_CUDA_CHECK(cudaDeviceSynchronize());

  const epmoe::kernels::ExpertWeightsView wv{w1.as<__nv_bfloat16>(), w2.as<__nv_bfloat16>(), E, H, F};
  const epmoe::kernels::ExpertLayoutView lv{offs.as<int64_t>(), prow.as<int32_t>(), pw.as<float>(), cap};
  auto problem = [&](int set, bool zero_out = false) {
    ExpertProblem p = epmoe::kernels::make_expert_problem(wv, xbuf[size_t(set)].as<__nv_bfloat16>(), T, lv,
                                                          act.as<__nv_bfloat16>(), out.as<__nv_bfloat16>(), T, zero_out);
    p.pairs = T * k;
    p.out_acc = out_acc.as<float>();  // (read by a fused plan only)
    return p;
  };
  const bool table = !opt.ab_only && !opt.forms;  // (--forms times the automatic plan itself)
  res.plan = epmoe::kernels::sm90_plan_for(problem(0), epmoe::parse_sm90_plan_override(opt.plan_spec));
  if (opt.ab) {
    res.plan_a = epmoe::kernels::sm90_plan_for(problem(0), side_override(opt, opt.ab_a));
    res.plan_b = epmoe::kernels::sm90_plan_for(problem(0), side_override(opt, opt.ab_b));
  }

  cudaStream_t s, side;
  EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  cudaEvent_t fork, zeroed, t0, t1;
  EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&zeroed, cudaEventDisableTiming));
  EPMOE_CUDA_CHECK(cudaEventCreate(&t0));
  EPMOE_CUDA_CHECK(cudaEventCreate(&t1));

  // serial_zero: the zeroing on the main stream first (no overlap), to measure what the overlap saves.
  auto enqueue_full = [&](int set, const Sm90Plan& plan, bool serial_zero = false) {
    if (plan.fused) {  // the fused pipeline writes every out row itself: no zeroing to wait for
      epmoe::kernels::sm90_experts_launch(problem(set), plan, s);
      return;
    }
    if (serial_zero || opt.zero_in_up) {
      if (serial_zero) EPMOE_CUDA_CHECK(cudaMemsetAsync(out.p, 0, out.bytes, s));
      epmoe::kernels::sm90_experts_launch(problem(set, /*zero_out=*/!serial_zero), plan, s);
      return;
    }
    const ExpertProblem p = problem(set);
    EPMOE_CUDA_CHECK(cudaEventRecord(fork, s));
    EPMOE_CUDA_CHECK(cudaStreamWaitEvent(side, fork, 0));
    EPMOE_CUDA_CHECK(cudaMemsetAsync(out.p, 0, out.bytes, side));
    EPMOE_CUDA_CHECK(cudaEventRecord(zeroed, side));
    if (opt.zero_before_down) {
      epmoe::kernels::sm90_up_launch(p, plan, s);
      EPMOE_CUDA_CHECK(cudaStreamWaitEvent(s, zeroed, 0));
      epmoe::kernels::sm90_down_launch(p, plan, s, /*pdl=*/true);
    } else {
      EPMOE_CUDA_CHECK(cudaStreamWaitEvent(s, zeroed, 0));
      epmoe::kernels::sm90_experts_launch(p, plan, s);
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
  // One graph per input set of launch(set).
  auto capture_sets = [&](auto&& launch) {
    std::vector<cudaGraphExec_t> gs;
    for (int i = 0; i < sets; ++i) gs.push_back(capture([&] { launch(i); }));
    return gs;
  };
  auto destroy = [](std::vector<cudaGraphExec_t>& gs) {
    for (auto g : gs) cudaGraphExecDestroy(g);
    gs.clear();
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
  auto replay_all = [&](const std::vector<cudaGraphExec_t>& gs) {
    for (auto g : gs) EPMOE_CUDA_CHECK(cudaGraphLaunch(g, s));
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
  // Warm-up, then the median of iters replays; every region is a graph (a plain launch timed with
  // events would include the host's launch work - tensor-map encoding - while the GPU idles).
  auto time_region = [&](auto&& launch) {
    std::vector<cudaGraphExec_t> gs = capture_sets(launch);
    warm_up([&] { replay_all(gs); });
    std::vector<float> ts;
    for (int i = 0; i < opt.iters; ++i) ts.push_back(time_replay(gs[size_t(i) % gs.size()]));
    destroy(gs);
    return median(ts);
  };

  if (table) {
    const Sm90Plan& plan = res.plan;
    res.full_ms = time_region([&](int i) { enqueue_full(i, plan); });
    res.full_serial_zero_ms = time_region([&](int i) { enqueue_full(i, plan, /*serial_zero=*/true); });
    res.zero_ms = time_region([&](int) { EPMOE_CUDA_CHECK(cudaMemsetAsync(out.p, 0, out.bytes, s)); });
    res.up_ms = time_region([&](int i) { epmoe::kernels::sm90_up_launch(problem(i), plan, s); });
    // (after UP alone: act holds real values, as DOWN reads them in the layer)
    res.down_ms = time_region([&](int i) { epmoe::kernels::sm90_down_launch(problem(i), plan, s, /*pdl=*/false); });
  }
  if (opt.ab) {
    auto capture_plan = [&](const Sm90Plan& plan) {
      return capture_sets([&](int i) {
        if (opt.ab_region == "up") epmoe::kernels::sm90_up_launch(problem(i), plan, s);
        else if (opt.ab_region == "down") epmoe::kernels::sm90_down_launch(problem(i), plan, s, /*pdl=*/false);
        else enqueue_full(i, plan);
      });
    };
    if (opt.ab_region == "down") {  // DOWN alone reads act: UP writes it first (zeros draw less power)
      for (int i = 0; i < sets; ++i) epmoe::kernels::sm90_up_launch(problem(i), res.plan, s);
      EPMOE_CUDA_CHECK(cudaStreamSynchronize(s));
    }
    std::vector<cudaGraphExec_t> ga = capture_plan(res.plan_a), gb = capture_plan(res.plan_b);
    std::vector<float> ta, tb;
    if (opt.ab_blocks > 0) {
      const int per_block = std::max(5, opt.iters / opt.ab_blocks);
      for (int r = 0; r < opt.ab_blocks; ++r) {
        for (int half = 0; half < 2; ++half) {
          const bool a = (half == 0) == (r % 2 == 0);  // AB, BA, AB, ...
          const std::vector<cudaGraphExec_t>& gs = a ? ga : gb;
          warm_up([&] { replay_all(gs); });
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
    destroy(ga);
    destroy(gb);
  }
  std::vector<Sm90Plan> form_plans;  // (checked below with the others)
  if (opt.forms) {
    // Every form's graphs, replayed round-robin (each round in a rotated order) so drift falls on
    // all alike; a form the shape cannot run stays at 0.
    std::vector<int> fs;
    std::vector<std::vector<cudaGraphExec_t>> gs(4);
    for (int f = 0; f < 4; ++f) {
      Sm90Plan plan;
      try {
        plan = epmoe::kernels::sm90_plan_for(problem(0), side_override(opt, kFormSpecs[f]));
      } catch (const epmoe::Error&) {
        continue;
      }
      gs[size_t(f)] = capture_sets([&](int i) { enqueue_full(i, plan); });
      fs.push_back(f);
      form_plans.push_back(plan);
    }
    warm_up([&] {
      for (int f : fs) replay_all(gs[size_t(f)]);
    });
    std::vector<std::vector<float>> ts(4);
    const int nf = int(fs.size());
    for (int i = 0; i < opt.iters * nf; ++i) {
      const int round = i / nf, f = fs[size_t((i + round) % nf)];
      ts[size_t(f)].push_back(time_replay(gs[size_t(f)][size_t(round) % size_t(sets)]));
    }
    for (int f : fs) {
      res.form_ms[f] = median(ts[size_t(f)]);
      destroy(gs[size_t(f)]);
    }
    res.full_ms = res.form_ms[0];  // the table's full layer: the automatic plan
    // The floor: the touched experts' W1 and W2 streamed once at the read rate of all the weights
    // (this process: bench_hbm.cuh).
    for (int e = 0; e < E; ++e) res.touched += L.padded_offsets[size_t(e) + 1] > L.padded_offsets[size_t(e)];
    res.hbm_tbs = epmoe::bench::hbm_read_tbs(s, {{w1.p, w1.bytes}, {w2.p, w2.bytes}});
    res.floor_ms = double(res.touched) * 3.0 * H * F * 2 / (res.hbm_tbs * 1e12) * 1e3;
  }

  // ---- correctness: one full layer on set 0 per plan timed, sampled tokens vs the reference ----
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
    std::vector<Sm90Plan> plans;  // each distinct plan timed, once
    for (const Sm90Plan* p : {table ? &res.plan : nullptr, opt.ab ? &res.plan_a : nullptr, opt.ab ? &res.plan_b : nullptr})
      if (p != nullptr && std::find(plans.begin(), plans.end(), *p) == plans.end()) plans.push_back(*p);
    for (const Sm90Plan& p : form_plans)
      if (std::find(plans.begin(), plans.end(), p) == plans.end()) plans.push_back(p);
    res.max_rel_err = 0;
    res.rel_l2 = 0;
    for (const Sm90Plan& plan : plans) {
      EPMOE_CUDA_CHECK(cudaMemsetAsync(out.p, 0xff, out.bytes, s));  // poison: the layer must zero and fill it
      EPMOE_CUDA_CHECK(cudaStreamSynchronize(s));
      enqueue_full(0, plan);
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

double tflops(const Shape& s, double ms) { return ms > 0 ? 6.0 * double(s.T) * s.k * s.hidden * s.ffn / ms / 1e9 : 0.0; }

// Specs and plans are plain tokens (letters, digits, = , + _ and spaces): no JSON escaping needed.
void write_json(const std::string& path, const std::vector<Result>& rs, const char* device, const Options& o) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) throw std::runtime_error("cannot write " + path);
  std::fprintf(f,
               "{\n \"impl\": \"epmoe_sm90_split\",\n \"device\": \"%s\",\n \"warmup_ms\": %.0f,\n \"iters\": %d,\n"
               " \"zero\": \"%s\",\n \"zero_before_down\": %s,\n \"routing\": \"%s\",\n \"plan_override\": \"%s\",\n",
               device, o.warmup_ms, o.iters, o.zero_in_up ? "up" : "side", o.zero_before_down ? "true" : "false",
               o.balanced ? "balanced" : "softmax", o.plan_spec.c_str());
  if (o.ab)
    std::fprintf(f, " \"ab_plan\": \"%s/%s\",\n \"ab_region\": \"%s\",\n \"ab_blocks\": %d,\n", o.ab_a.c_str(),
                 o.ab_b.c_str(), o.ab_region.c_str(), o.ab_blocks);
  std::fprintf(f, " \"moe\": [\n");
  for (size_t i = 0; i < rs.size(); ++i) {
    const Result& r = rs[i];
    std::fprintf(f,
                 "  {\"E\": %d, \"k\": %d, \"hidden\": %d, \"ffn\": %d, \"T\": %lld, \"sets\": %d, "
                 "\"full_ms\": %.6f, \"full_tflops\": %.3f, \"up_ms\": %.6f, \"down_ms\": %.6f, \"zero_ms\": %.6f, "
                 "\"full_serial_zero_ms\": %.6f, \"checked_tokens\": %d, \"max_rel_err\": %.6g, \"rel_l2\": %.6g, "
                 "\"plan\": \"%s\"",
                 r.s.E, r.s.k, r.s.hidden, r.s.ffn, (long long)r.s.T, r.sets, r.full_ms, tflops(r.s, r.full_ms),
                 r.up_ms, r.down_ms, r.zero_ms, r.full_serial_zero_ms, r.checked_tokens,
                 std::isfinite(r.max_rel_err) ? r.max_rel_err : 1e30, std::isfinite(r.rel_l2) ? r.rel_l2 : 1e30,
                 to_string(r.plan).c_str());
    if (o.ab)
      std::fprintf(f, ", \"ab_a_ms\": %.6f, \"ab_b_ms\": %.6f, \"plan_a\": \"%s\", \"plan_b\": \"%s\"", r.ab_a_ms,
                   r.ab_b_ms, to_string(r.plan_a).c_str(), to_string(r.plan_b).c_str());
    if (o.forms) {
      std::fprintf(f, ", \"forms_ms\": {");
      for (int m = 0; m < 4; ++m) std::fprintf(f, "%s\"%s\": %.6f", m ? ", " : "", kFormNames[m], r.form_ms[m]);
      std::fprintf(f, "}, \"touched_experts\": %d, \"hbm_read_tbs\": %.4f, \"floor_ms\": %.6f", r.touched, r.hbm_tbs,
                   r.floor_ms);
    }
    std::fprintf(f, "}%s\n", i + 1 < rs.size() ? "," : "");
  }
  std::fprintf(f, " ]\n}\n");
  std::fclose(f);
}

// Parses argv into opt; returns -1 to go on, else the exit code (help: 0, bad argument: 2).
// Plan specs are parsed here, before any CUDA call (their validity per shape needs the device).
int parse_args(int argc, char** argv, Options& opt) {
  bool ab_sub = false;  // an --ab-* option besides --ab-plan
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
    } else if (a == "--zero") {
      const std::string v = next();
      if (v != "up" && v != "side") throw std::runtime_error("--zero up|side");
      opt.zero_in_up = v == "up";
    } else if (a == "--zero-before-down") {
      opt.zero_before_down = true;
    } else if (a == "--routing") {
      const std::string v = next();
      if (v != "softmax" && v != "balanced") throw std::runtime_error("--routing softmax|balanced");
      opt.balanced = v == "balanced";
    } else if (a == "--plan") {
      opt.plan_spec = next();
      (void)epmoe::parse_sm90_plan_override(opt.plan_spec);  // throws on a bad spec
    } else if (a == "--ab-plan") {
      const std::string v = next();
      const size_t slash = v.find('/');
      if (slash == std::string::npos || v.find('/', slash + 1) != std::string::npos)
        throw std::runtime_error("--ab-plan SPEC_A/SPEC_B (one '/'; an empty side is the default plan), got '" + v + "'");
      opt.ab = true;
      opt.ab_a = v.substr(0, slash);
      opt.ab_b = v.substr(slash + 1);
      (void)epmoe::parse_sm90_plan_override(opt.ab_a);
      (void)epmoe::parse_sm90_plan_override(opt.ab_b);
    } else if (a == "--forms") {
      opt.forms = true;
    } else if (a == "--ab-only") {
      opt.ab_only = ab_sub = true;
    } else if (a == "--ab-region") {
      opt.ab_region = next();
      ab_sub = true;
      if (opt.ab_region != "full" && opt.ab_region != "up" && opt.ab_region != "down")
        throw std::runtime_error("--ab-region full|up|down");
    } else if (a == "--ab-blocks") {
      opt.ab_blocks = std::atoi(next().c_str());
      ab_sub = true;
      if (opt.ab_blocks < 1) throw std::runtime_error("--ab-blocks N (N >= 1 rounds of an A block and a B block)");
    } else if (a == "-h" || a == "--help") {
      std::printf(kUsage, argv[0]);
      return 0;
    } else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      std::fprintf(stderr, kUsage, argv[0]);
      return 2;
    }
  }
  if (ab_sub && !opt.ab) throw std::runtime_error("--ab-blocks, --ab-only and --ab-region need --ab-plan SPEC_A/SPEC_B");
  if (opt.zero_before_down && opt.zero_in_up)
    throw std::runtime_error("--zero-before-down places the side-stream zeroing: it needs --zero side");
  return -1;
}

std::string shape_name(const Shape& s) {
  return std::to_string(s.E) + "," + std::to_string(s.k) + "," + std::to_string(s.hidden) + "," +
         std::to_string(s.ffn) + "," + std::to_string(s.T);
}
std::string side_label(const std::string& spec) { return spec.empty() ? "default" : spec; }

}  // namespace

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
    // Every plan of every shape resolved and checked before the first shape runs: an override the
    // kernels cannot run for some shape (pairs with ffn % 256 != 0, ...) is a bad argument.
    for (const Shape& sh : shapes) {
      const std::pair<const char*, std::string> specs[] = {
          {"--plan", opt.plan_spec}, {"--ab-plan A", opt.ab_a}, {"--ab-plan B", opt.ab_b}};
      for (int i = 0; i < (opt.ab ? 3 : 1); ++i) {
        try {
          (void)epmoe::kernels::sm90_plan_for(dims_problem(sh), i == 0 ? epmoe::parse_sm90_plan_override(opt.plan_spec)
                                                                       : side_override(opt, specs[i].second));
        } catch (const epmoe::Error& e) {
          if (e.code() != epmoe::ErrorCode::invalid_argument) throw;
          std::fprintf(stderr, "bad argument: %s '%s'%s is not a valid plan for shape %s: %s\n", specs[i].first,
                       specs[i].second.c_str(), i > 0 && !opt.plan_spec.empty() ? " (on top of --plan)" : "",
                       shape_name(sh).c_str(), e.what());
          return 2;
        }
      }
    }
    std::printf("# epmoe sm_90a split pipeline on %s (%d SMs), %d iters, median, after >= %.0f ms of warm-up replays\n",
                prop.name, prop.multiProcessorCount, opt.iters, opt.warmup_ms);
    std::printf("# full: the layer as the engine runs it (UP gathers its rows from x, DOWN PDL-chained); out zeroed %s\n",
                opt.zero_in_up ? "by the UP kernel under its GEMM (--zero up)"
                : opt.zero_before_down ? "by a side-stream memset joined before DOWN (--zero side --zero-before-down)"
                                       : "by a side-stream memset joined before UP (--zero side)");
    std::printf("# zero ms: the output memset alone; serial ms: the full layer with it first on the main stream (no "
                "overlap); up ms, down ms: each kernel alone (UP without the zeroing)\n");
    std::printf("# no seed region: our UP always gathers from x (no UP from a pre-gathered xs); compare torch's seed "
                "region against our full layer, which does more work\n");
    std::printf("# plans: the heuristics' default per shape%s%s%s, on each shape's '#   plan:' line\n",
                opt.plan_spec.empty() ? "" : " with --plan '", opt.plan_spec.c_str(), opt.plan_spec.empty() ? "" : "'");
    if (opt.ab)
      std::printf("# A/B: plan A=[%s] B=[%s] on top of that, %s, %s%s\n", side_label(opt.ab_a).c_str(),
                  side_label(opt.ab_b).c_str(), opt.ab_region == "full" ? "full layer" : (opt.ab_region + " alone").c_str(),
                  opt.ab_blocks > 0 ? (std::to_string(opt.ab_blocks) + " rounds of steady-state blocks").c_str()
                                    : "interleaved replays",
                  opt.ab_only ? " (--ab-only: the table's columns are not timed)" : "");
    std::printf("# %4s %2s %6s %5s %7s | %9s %8s | %9s %9s | %8s %9s | %10s %9s\n", "E", "k", "hidden", "ffn", "T",
                "full ms", "TFLOP/s", "up ms", "down ms", "zero ms", "serial ms", "max_rel", "rel_l2");
    std::vector<Result> rs;
    bool ok = true;
    for (const Shape& sh : shapes) {
      const Result r = run_shape(sh, opt);
      rs.push_back(r);
      std::printf("  %4d %2d %6d %5d %7lld | %9.4f %8.1f | %9.4f %9.4f | %8.4f %9.4f | %10.3e %9.3e\n", sh.E, sh.k,
                  sh.hidden, sh.ffn, (long long)sh.T, r.full_ms, tflops(sh, r.full_ms), r.up_ms, r.down_ms, r.zero_ms,
                  r.full_serial_zero_ms, r.max_rel_err, r.rel_l2);
      std::printf("#   plan: %s\n", to_string(r.plan).c_str());
      if (opt.ab) {
        // Parsed by launch/ab_summary.py: keep the format in step with its AB / PLAN patterns.
        std::printf("#   A/B plan A=[%s] B=[%s]: %.4f ms, %.4f ms, B/A %.4f (%s, %s)\n", side_label(opt.ab_a).c_str(),
                    side_label(opt.ab_b).c_str(), r.ab_a_ms, r.ab_b_ms, r.ab_a_ms > 0 ? r.ab_b_ms / r.ab_a_ms : 0.0,
                    opt.ab_region == "full" ? "full layer" : (opt.ab_region + " alone").c_str(),
                    opt.ab_blocks > 0 ? (std::to_string(opt.ab_blocks) + " rounds of steady-state blocks").c_str()
                                      : "interleaved replays");
        std::printf("#   A/B plan A: %s\n#   A/B plan B: %s\n", to_string(r.plan_a).c_str(), to_string(r.plan_b).c_str());
      }
      if (opt.forms) {
        double best = 0;
        for (double m : r.form_ms)
          if (m > 0 && (best == 0 || m < best)) best = m;
        std::printf("#   forms (full layer, interleaved): auto %.4f ms, 128-row %.4f, swap %.4f, fused %.4f; auto / best "
                    "%.3f; floor %.4f ms (%d of %d experts, HBM read %.2f TB/s), auto / floor %.2f\n",
                    r.form_ms[0], r.form_ms[1], r.form_ms[2], r.form_ms[3], best > 0 ? r.form_ms[0] / best : 0.0,
                    r.floor_ms, r.touched, sh.E, r.hbm_tbs, r.floor_ms > 0 ? r.form_ms[0] / r.floor_ms : 0.0);
      }
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
    if (!opt.json.empty()) write_json(opt.json, rs, prop.name, opt);
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
