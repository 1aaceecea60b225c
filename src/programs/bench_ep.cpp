// epmoe_bench_ep: the expert-parallel layer's forward, timed the way nccl-tests times a collective.
//
//   mpirun -np N epmoe_bench_ep [--shapes default|decode|all] [--shape E,k,hidden,ffn,T]...
//                               [--iters 20] [--warmup 5] [--warmup-ms 500] [--path auto|sm90|cublas]
//                               [--check-tokens 8] [--seed 1] [--json out.json]
//
// One rank per GPU, NCCL bootstrapped over MPI. For each shape, every rank in lockstep:
//  1. weights: each expert's w1/w2 come from a counter-based generator keyed by (seed, expert, dims),
//     so any rank can regenerate any expert; only this rank's slice is generated and uploaded.
//  2. inputs (seeded per rank): x ~ N(0,1); routing = top-k of softmax(N(0,1) logits), renormalised
//     and rounded to bf16, as ../shared/baselines/ep_baseline.py does with torch.
//  3. timing pass: `warmup` forwards (and at least `warmup-ms` of them), then `iters` forwards each
//     between two cudaEvents; median per rank; the table shows the slowest rank's median.
//  4. phase pass: a second layer with LayerOptions.record_phase_times; median of each phase.
//  5. checks: rows sent == deduplicated (token, destination rank) pairs, never T*k; every element of
//     y written; y of `check-tokens` sampled tokens per rank against reference_moe on the CPU.
// The exit status is non-zero when any check fails (after every shape ran).
//
// The random numbers, the routing and the weight upload are bench_common.h's (shared with
// epmoe_bench_train).
#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <memory>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "epmoe/bf16.h"
#include "epmoe/build_config.h"
#include "epmoe/error.h"
#include "kernels/cuda_check.cuh"
#include "epmoe/moe_config.h"
#include "epmoe/moe_layer.h"
#include "epmoe/nccl_communicator.h"
#include "epmoe/reference.h"
#include "epmoe/tensor_view.h"
#include "bench_common.h"

#if !EPMOE_WITH_MPI || !EPMOE_WITH_NCCL
#error "epmoe_bench_ep needs epmoe built with MPI and NCCL (EPMOE_ENABLE_MPI, EPMOE_ENABLE_NCCL)"
#endif

namespace {

using namespace epmoe::bench;
using epmoe::bf16;
using epmoe::DeviceType;
using epmoe::DType;
using epmoe::TensorView;

constexpr float kWeightStd = 0.02f;
constexpr double kRelTolerance = 1e-2;  // ||y - ref|| / ||ref|| on the sampled tokens (bf16 operands)

// ---- options -----------------------------------------------------------------------------------

struct Options {
  std::string shapes = "default";
  std::vector<Shape> custom;
  int iters = 20, warmup = 5, check_tokens = 8;
  // Warm-up also lasts at least this long (the board is power-capped: forwards timed right after the
  // idle setup would start in a power headroom a training loop never has; see bench_experts).
  double warmup_ms = 500;
  uint64_t seed = 1;
  epmoe::ExpertPath path = epmoe::ExpertPath::automatic;
  std::string json;
  bool help = false;
};

// Shapes sharing (E, hidden, ffn) sit together so the weights are generated once for them.
std::vector<Shape> shape_list(const Options& o) {
  if (!o.custom.empty()) return o.custom;
  const std::vector<Shape> def = {{32, 4, 2048, 1024, 4096}, {32, 4, 2048, 1024, 16384}};
  const std::vector<Shape> decode = {{256, 8, 7168, 2048, 128}, {32, 4, 2048, 1024, 128}};
  if (o.shapes == "default") return def;
  if (o.shapes == "decode") return decode;
  if (o.shapes == "all")
    return {{32, 4, 2048, 1024, 4096}, {32, 4, 2048, 1024, 16384}, {32, 4, 2048, 1024, 128},
            {128, 8, 2048, 768, 8192}, {256, 8, 7168, 2048, 128},  {256, 8, 7168, 2048, 4096}};
  EPMOE_FAIL(epmoe::ErrorCode::invalid_argument, "--shapes must be default, decode or all (got '", o.shapes, "')");
}

void usage(FILE* f) {
  std::fprintf(f,
               "usage: mpirun -np N epmoe_bench_ep [--shapes default|decode|all] [--shape E,k,hidden,ffn,T]...\n"
               "       [--iters 20] [--warmup 5] [--warmup-ms 500] [--path auto|sm90|cublas] [--check-tokens 8] [--seed 1]\n"
               "       [--json out.json]\n"
               "  default: E=32 k=4 hidden=2048 ffn=1024 at 4096 and 16384 tokens per rank\n"
               "  decode:  E=256 k=8 hidden=7168 ffn=2048 and E=32 k=4 hidden=2048 ffn=1024 at 128 tokens\n"
               "  all:     default + decode + 128,8,2048,768 at 8192 + 256,8,7168,2048 at 4096\n"
               "  --check-tokens 0 skips the CPU reference check\n");
}

// Every rank parses the same argv, so every rank takes the same branch.
Options parse_args(int argc, char** argv) {
  Options o;
  auto need = [&](int& i) -> std::string {
    EPMOE_CHECK(i + 1 < argc, epmoe::ErrorCode::invalid_argument, argv[i], " needs a value");
    return argv[++i];
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--shapes") o.shapes = need(i);
    else if (a == "--json") o.json = need(i);
    else if (a == "--iters") o.iters = std::stoi(need(i));
    else if (a == "--warmup") o.warmup = std::stoi(need(i));
    else if (a == "--warmup-ms") o.warmup_ms = std::stod(need(i));
    else if (a == "--check-tokens") o.check_tokens = std::stoi(need(i));
    else if (a == "--seed") o.seed = std::stoull(need(i));
    else if (a == "--path") {
      o.path = parse_expert_path("--path", need(i));
    } else if (a == "--shape") {
      Shape s;
      long long t = 0;
      const std::string v = need(i);
      EPMOE_CHECK(std::sscanf(v.c_str(), "%d,%d,%d,%d,%lld", &s.E, &s.k, &s.hidden, &s.ffn, &t) == 5,
                  epmoe::ErrorCode::invalid_argument, "--shape wants E,k,hidden,ffn,T (got '", v, "')");
      s.tokens = t;
      o.custom.push_back(s);
    } else if (a == "-h" || a == "--help") {
      o.help = true;
    } else {
      EPMOE_FAIL(epmoe::ErrorCode::invalid_argument, "unknown argument '", a, "' (--help lists them)");
    }
  }
  EPMOE_CHECK(o.iters >= 1 && o.warmup >= 0 && o.warmup_ms >= 0 && o.check_tokens >= 0,
              epmoe::ErrorCode::invalid_argument, "--iters must be >= 1, --warmup, --warmup-ms and --check-tokens >= 0");
  return o;
}

// ---- inputs --------------------------------------------------------------------------------------

struct Inputs {
  std::vector<bf16> x;        // [T, hidden]
  std::vector<int32_t> ids;   // [T, k]
  std::vector<float> wts;     // [T, k]
  int64_t dedup_rows = 0;     // sum over tokens of the distinct destination ranks
  int64_t valid_slots = 0;    // T*k (no slot is dropped here)
};

Inputs make_inputs(uint64_t seed, const Shape& s, int shape_index, int rank, int world) {
  Inputs in;
  const int64_t T = s.tokens;
  const int E = s.E, k = s.k, el = s.E / world;
  in.x.resize(size_t(T) * s.hidden);
  fill_normal_bf16(in.x.data(), int64_t(in.x.size()), stream_key(seed, kTagX, uint64_t(rank), uint64_t(shape_index)),
                   1.0f);
  in.ids.resize(size_t(T) * k);
  in.wts.resize(size_t(T) * k);
  const uint64_t lkey = stream_key(seed, kTagLogits, uint64_t(rank), uint64_t(shape_index));
  route_softmax_topk(lkey, T, E, k, in.ids.data(), in.wts.data());
  for (int64_t t = 0; t < T; ++t) {
    uint64_t mask = 0;
    for (int j = 0; j < k; ++j) {
      const int id = in.ids[size_t(t) * k + j];
      if (id < 0) continue;
      mask |= uint64_t(1) << (id / el);
      ++in.valid_slots;
    }
    in.dedup_rows += std::popcount(mask);
  }
  return in;
}

// ---- one shape -----------------------------------------------------------------------------------

struct Phases {
  double layout = 0, exchange = 0, dispatch = 0, experts = 0, combine = 0, reduce = 0;
  double sum() const { return layout + exchange + dispatch + experts + combine + reduce; }
};

struct Result {
  Shape s;
  int world = 1;
  std::string path;
  double ms = 0, ms_min_rank = 0, ms_phase_pass = 0, tflops = 0;
  std::vector<double> ms_per_rank;
  Phases ph;
  int64_t dispatch_bytes = 0, combine_bytes = 0, rows_sent = 0, rows_dedup = 0, rows_tk = 0, expert_pairs = 0;
  double disp_algbw = 0, disp_busbw = 0, comb_algbw = 0, comb_busbw = 0;
  bool rows_ok = false;
  int64_t unwritten = 0;  // y elements still holding the poison (or NaN) after a forward
  int check_tokens = 0;
  double max_abs_err = 0, rel_err = 0;
  bool check_ok = false;
  bool ok() const { return rows_ok && check_ok; }
};

struct Context {
  int rank = 0, world = 1, device = 0;
  std::shared_ptr<epmoe::Communicator> comm;
  cudaStream_t stream = nullptr;
  cudaEvent_t ev_a = nullptr, ev_b = nullptr;
};

Result run_shape(Context& cx, const Options& o, const Shape& s, int shape_index, WeightSet& ws) {
  using clock = std::chrono::steady_clock;
  const bool r0 = cx.rank == 0;
  const auto t_start = clock::now();
  Result res;
  res.s = s;
  res.world = cx.world;

  EPMOE_CHECK(s.E % cx.world == 0, epmoe::ErrorCode::invalid_config, "E=", s.E, " is not divisible by world=", cx.world);
  epmoe::MoeConfig cfg;
  cfg.num_experts = s.E, cfg.top_k = s.k, cfg.hidden = s.hidden, cfg.ffn = s.ffn;
  cfg.world_size = cx.world, cfg.rank = cx.rank;
  cfg.validate();
  const int64_t el = s.E / cx.world, T = s.tokens;

  if (!ws.matches(s)) {
    if (r0) std::fprintf(stderr, "[bench_ep]   generating weights (%lld experts per rank)\n", (long long)el);
    upload_weights(ws, o.seed, s, cx.rank, cx.world, kWeightStd, kWeightStd);
  }
  const Inputs in = make_inputs(o.seed, s, shape_index, cx.rank, cx.world);

  DeviceBuffer dx(in.x.size() * sizeof(bf16)), dids(in.ids.size() * 4), dwts(in.wts.size() * 4),
      dy(size_t(T) * s.hidden * sizeof(bf16));
  if (T > 0) {
    BENCH_CUDA(cudaMemcpy(dx.get(), in.x.data(), dx.bytes(), cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaMemcpy(dids.get(), in.ids.data(), dids.bytes(), cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaMemcpy(dwts.get(), in.wts.data(), dwts.bytes(), cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaDeviceSynchronize());  // (pageable uploads return before the device has the bytes)
  }
  const int dev = cx.device;
  const TensorView x = TensorView::contiguous(dx.get(), DType::bf16, {T, int64_t(s.hidden)}, DeviceType::cuda, dev);
  const TensorView ids = TensorView::contiguous(dids.get(), DType::i32, {T, int64_t(s.k)}, DeviceType::cuda, dev);
  const TensorView wts = TensorView::contiguous(dwts.get(), DType::f32, {T, int64_t(s.k)}, DeviceType::cuda, dev);
  const TensorView y = TensorView::contiguous(dy.get(), DType::bf16, {T, int64_t(s.hidden)}, DeviceType::cuda, dev);
  epmoe::ExpertWeights w;
  w.w1 = TensorView::contiguous(ws.w1.get(), DType::bf16, {el, 2 * int64_t(s.ffn), int64_t(s.hidden)},
                                DeviceType::cuda, dev);
  w.w2 = TensorView::contiguous(ws.w2.get(), DType::bf16, {el, int64_t(s.hidden), int64_t(s.ffn)},
                                DeviceType::cuda, dev);

  auto timed_forward = [&](epmoe::MoeLayer& layer) -> double {
    BENCH_CUDA(cudaEventRecord(cx.ev_a, cx.stream));
    layer.forward(x, ids, wts, y, cx.stream);
    BENCH_CUDA(cudaEventRecord(cx.ev_b, cx.stream));
    BENCH_CUDA(cudaEventSynchronize(cx.ev_b));
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, cx.ev_a, cx.ev_b));
    return double(ms);
  };
  // `min_count` forwards, and enough to last o.warmup_ms: the count comes from one timed forward,
  // the largest over the ranks (every forward is collective, so all ranks must run the same number).
  auto warm_up = [&](epmoe::MoeLayer& layer, int min_count) {
    const double one = allreduce_max(timed_forward(layer));
    const int n = std::max(min_count - 1, int(std::ceil(o.warmup_ms / std::max(one, 1e-3))));
    for (int i = 0; i < n; ++i) layer.forward(x, ids, wts, y, cx.stream);
  };

  // -- pass 1: total time; then one forward on a poisoned y for the checks
  std::vector<double> times;
  epmoe::ForwardStats stats;
  std::vector<bf16> y_host(size_t(T) * s.hidden);
  {
    epmoe::LayerOptions lo;
    lo.expert_path = o.path;
    epmoe::MoeLayer layer(cfg, w, cx.comm, lo);
    res.path = path_name(layer.expert_path());
    if (r0) std::fprintf(stderr, "[bench_ep]   path %s: warm-up %d, timing %d\n", res.path.c_str(), o.warmup, o.iters);
    warm_up(layer, o.warmup);
    BENCH_CUDA(cudaStreamSynchronize(cx.stream));
    MPI_Barrier(MPI_COMM_WORLD);
    for (int i = 0; i < o.iters; ++i) times.push_back(timed_forward(layer));

    if (T > 0) BENCH_CUDA(cudaMemsetAsync(dy.get(), 0xff, dy.bytes(), cx.stream));  // bf16 0xffff: NaN
    layer.forward(x, ids, wts, y, cx.stream);
    BENCH_CUDA(cudaStreamSynchronize(cx.stream));
    stats = layer.last_stats();
    if (T > 0) BENCH_CUDA(cudaMemcpy(y_host.data(), dy.get(), dy.bytes(), cudaMemcpyDeviceToHost));
  }

  // -- pass 2: per-phase times
  std::vector<double> pl, px, pd, pe, pc, pr, t2;
  {
    epmoe::LayerOptions lo;
    lo.expert_path = o.path;
    lo.record_phase_times = true;
    epmoe::MoeLayer layer(cfg, w, cx.comm, lo);
    warm_up(layer, std::min(o.warmup, 3));
    BENCH_CUDA(cudaStreamSynchronize(cx.stream));
    MPI_Barrier(MPI_COMM_WORLD);
    for (int i = 0; i < o.iters; ++i) {
      t2.push_back(timed_forward(layer));
      const epmoe::ForwardStats& st = layer.last_stats();
      pl.push_back(st.layout_ms), px.push_back(st.exchange_ms), pd.push_back(st.dispatch_ms);
      pe.push_back(st.experts_ms), pc.push_back(st.combine_ms), pr.push_back(st.reduce_ms);
    }
  }

  // -- checks on this rank
  for (const bf16& v : y_host)
    if (!std::isfinite(v.f())) ++res.unwritten;
  if (r0 && o.check_tokens > 0)
    std::fprintf(stderr, "[bench_ep]   CPU reference on %d tokens per rank\n", int(std::min<int64_t>(o.check_tokens, T)));
  const CheckResult chk =
      check_sampled(o.seed, s, in.x.data(), in.ids.data(), in.wts.data(), y_host.data(), o.check_tokens, kWeightStd, kWeightStd);
  int64_t rows_local = 0;
  for (int64_t r : stats.send_rows) rows_local += r;

  // -- over ranks
  const double ms_local = median(times);
  res.ms = allreduce_max(ms_local);
  res.ms_min_rank = -allreduce_max(-ms_local);
  res.ms_per_rank.assign(size_t(cx.world), 0.0);
  MPI_Gather(&ms_local, 1, MPI_DOUBLE, res.ms_per_rank.data(), 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  res.ms_phase_pass = allreduce_max(median(t2));
  res.ph.layout = allreduce_max(median(pl));
  res.ph.exchange = allreduce_max(median(px));
  res.ph.dispatch = allreduce_max(median(pd));
  res.ph.experts = allreduce_max(median(pe));
  res.ph.combine = allreduce_max(median(pc));
  res.ph.reduce = allreduce_max(median(pr));
  res.dispatch_bytes = allreduce_sum(stats.dispatch_bytes);
  res.combine_bytes = allreduce_sum(stats.combine_bytes);
  res.expert_pairs = allreduce_sum(stats.expert_pairs);
  res.rows_sent = allreduce_sum(rows_local);
  res.rows_dedup = allreduce_sum(in.dedup_rows);
  res.rows_tk = allreduce_sum(in.valid_slots);
  res.unwritten = allreduce_sum(res.unwritten);
  res.check_tokens = int(allreduce_sum(int64_t(chk.tokens)));
  res.max_abs_err = allreduce_max(chk.max_abs);
  const double err2 = allreduce_sum(chk.err2), ref2 = allreduce_sum(chk.ref2);
  res.rel_err = ref2 > 0 ? std::sqrt(err2 / ref2) : (err2 > 0 ? INFINITY : 0.0);

  res.tflops = 6.0 * double(T) * s.k * s.hidden * s.ffn / (res.ms * 1e-3) / 1e12;
  // nccl-tests alltoall convention: algbw = bytes per rank / time, busbw = algbw * (n-1)/n.
  const double nw = cx.world, bus = (nw - 1) / nw;
  auto gbps = [&](int64_t total_bytes, double ms) { return ms > 0 ? double(total_bytes) / nw / 1e9 / (ms * 1e-3) : 0.0; };
  res.disp_algbw = gbps(res.dispatch_bytes, res.ph.dispatch), res.disp_busbw = res.disp_algbw * bus;
  res.comb_algbw = gbps(res.combine_bytes, res.ph.combine), res.comb_busbw = res.comb_algbw * bus;
  res.rows_ok = res.rows_sent == res.rows_dedup;
  res.check_ok = res.unwritten == 0 && std::isfinite(res.rel_err) && res.rel_err <= kRelTolerance;
  if (r0) std::fprintf(stderr, "[bench_ep]   done in %.1f s\n", seconds_since(t_start));
  return res;
}

// ---- output --------------------------------------------------------------------------------------

void print_header(const Context& cx, const Options& o) {
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, cx.device));
  int nccl_version = 0;
  ncclGetVersion(&nccl_version);
  std::printf("# epmoe_bench_ep: world %d, %s (rank 0 on device %d), NCCL %d.%d.%d, requested path %s, "
              "warm-up %d forwards and >= %.0f ms, iters %d, seed %llu\n",
              cx.world, prop.name, cx.device, nccl_version / 10000, (nccl_version / 100) % 100, nccl_version % 100,
              path_name(o.path), o.warmup, o.warmup_ms, o.iters, (unsigned long long)o.seed);
  std::printf("# time: slowest rank's median forward (cudaEvents); phases: medians from a second pass with "
              "record_phase_times (slowest rank each)\n");
  std::printf("# TFLOP/s per GPU = 6*T*k*hidden*ffn / time; dispatch GB = bytes sent summed over ranks; "
              "algbw = GB/world / dispatch time; busbw = algbw*(world-1)/world\n");
  std::printf("# rows sent: dispatched rows summed over ranks; must equal the deduplicated (token, destination "
              "rank) count, never T*k\n#\n");
  std::printf("# %5s %4s %2s %6s %5s %6s %6s | %8s %7s | %7s %7s %7s %7s %7s %7s | %8s %7s %7s | %10s %10s %10s %4s | "
              "%8s %8s %4s\n",
              "world", "E", "k", "hidden", "ffn", "tokens", "path", "time(ms)", "TFLOP/s", "layout", "exch", "disp",
              "experts", "combine", "reduce", "disp(GB)", "algbw", "busbw", "rows_sent", "dedup", "T*k", "ok",
              "max|err|", "rel_err", "ok");
  std::fflush(stdout);
}

void print_row(const Result& r) {
  std::printf("  %5d %4d %2d %6d %5d %6lld %6s | %8.3f %7.1f | %7.3f %7.3f %7.3f %7.3f %7.3f %7.3f | %8.3f %7.1f %7.1f | "
              "%10lld %10lld %10lld %4s | %8.2e %8.2e %4s\n",
              r.world, r.s.E, r.s.k, r.s.hidden, r.s.ffn, (long long)r.s.tokens, r.path.c_str(), r.ms, r.tflops,
              r.ph.layout, r.ph.exchange, r.ph.dispatch, r.ph.experts, r.ph.combine, r.ph.reduce,
              double(r.dispatch_bytes) / 1e9, r.disp_algbw, r.disp_busbw, (long long)r.rows_sent,
              (long long)r.rows_dedup, (long long)r.rows_tk, r.rows_ok ? "yes" : "NO", r.max_abs_err, r.rel_err,
              r.check_ok ? "yes" : "NO");
  std::fflush(stdout);
}

std::string result_json(const Result& r) {
  std::ostringstream j;
  j << "{\"world\": " << r.world << ", \"E\": " << r.s.E << ", \"k\": " << r.s.k << ", \"hidden\": " << r.s.hidden
    << ", \"ffn\": " << r.s.ffn << ", \"tokens_per_rank\": " << r.s.tokens << ", \"expert_path\": \"" << r.path
    << "\", \"ms\": " << json_num(r.ms) << ", \"ms_min_rank\": " << json_num(r.ms_min_rank) << ", \"ms_per_rank\": [";
  for (size_t i = 0; i < r.ms_per_rank.size(); ++i) j << (i ? ", " : "") << json_num(r.ms_per_rank[i]);
  j << "], \"tflops_per_gpu\": " << json_num(r.tflops) << ", \"ms_phase_pass\": " << json_num(r.ms_phase_pass)
    << ", \"layout_ms\": " << json_num(r.ph.layout) << ", \"exchange_ms\": " << json_num(r.ph.exchange)
    << ", \"dispatch_ms\": " << json_num(r.ph.dispatch) << ", \"experts_ms\": " << json_num(r.ph.experts)
    << ", \"combine_ms\": " << json_num(r.ph.combine) << ", \"reduce_ms\": " << json_num(r.ph.reduce)
    << ", \"phase_sum_ms\": " << json_num(r.ph.sum()) << ", \"dispatch_bytes\": " << r.dispatch_bytes
    << ", \"combine_bytes\": " << r.combine_bytes << ", \"dispatch_algbw_GBps\": " << json_num(r.disp_algbw)
    << ", \"dispatch_busbw_GBps\": " << json_num(r.disp_busbw) << ", \"combine_algbw_GBps\": " << json_num(r.comb_algbw)
    << ", \"combine_busbw_GBps\": " << json_num(r.comb_busbw) << ", \"rows_sent\": " << r.rows_sent
    << ", \"rows_dedup\": " << r.rows_dedup << ", \"rows_tk\": " << r.rows_tk
    << ", \"rows_ok\": " << (r.rows_ok ? "true" : "false") << ", \"expert_pairs\": " << r.expert_pairs
    << ", \"y_unwritten\": " << r.unwritten << ", \"check_tokens\": " << r.check_tokens
    << ", \"check_max_abs_err\": " << json_num(r.max_abs_err) << ", \"check_rel_err\": " << json_num(r.rel_err)
    << ", \"check_ok\": " << (r.check_ok ? "true" : "false") << "}";
  return j.str();
}

void write_json(const std::string& path, const Context& cx, const Options& o, const std::vector<Result>& rs) {
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, cx.device));
  std::ofstream f(path);
  EPMOE_CHECK(f.good(), epmoe::ErrorCode::invalid_argument, "cannot write --json ", path);
  f << "{\"program\": \"epmoe_bench_ep\", \"world\": " << cx.world << ", \"device\": \"" << prop.name
    << "\", \"shapes\": \"" << (o.custom.empty() ? o.shapes : std::string("custom")) << "\", \"iters\": " << o.iters
    << ", \"warmup\": " << o.warmup << ", \"warmup_ms\": " << o.warmup_ms << ", \"seed\": " << o.seed
    << ", \"requested_path\": \"" << path_name(o.path)
    << "\", \"results\": [\n";
  for (size_t i = 0; i < rs.size(); ++i) f << "  " << result_json(rs[i]) << (i + 1 < rs.size() ? ",\n" : "\n");
  f << "]}\n";
  EPMOE_CHECK(f.good(), epmoe::ErrorCode::invalid_argument, "writing --json ", path, " failed");
}

int run(int argc, char** argv) {
  Context cx;
  MPI_Comm_rank(MPI_COMM_WORLD, &cx.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &cx.world);
  const Options o = parse_args(argc, argv);
  if (o.help) {  // before any collective: every rank returns alike
    if (cx.rank == 0) usage(stdout);
    return 0;
  }
  const std::vector<Shape> shapes = shape_list(o);

  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  g_threads = int(std::max(1u, hw / unsigned(cx.world)));

  cx.device = epmoe::select_local_device();
  BENCH_CUDA(cudaSetDevice(cx.device));
  epmoe::NcclCommOptions co;
  co.device = cx.device;
  cx.comm = epmoe::make_nccl_communicator_from_mpi(MPI_COMM_WORLD, co);
  BENCH_CUDA(cudaStreamCreateWithFlags(&cx.stream, cudaStreamNonBlocking));
  BENCH_CUDA(cudaEventCreate(&cx.ev_a));
  BENCH_CUDA(cudaEventCreate(&cx.ev_b));

  const bool r0 = cx.rank == 0;
  if (r0) print_header(cx, o);
  std::vector<Result> results;
  WeightSet ws;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const Shape& s = shapes[i];
    if (r0)
      std::fprintf(stderr, "[bench_ep] shape %zu/%zu: world %d E=%d k=%d hidden=%d ffn=%d tokens/rank=%lld\n", i + 1,
                   shapes.size(), cx.world, s.E, s.k, s.hidden, s.ffn, (long long)s.tokens);
    results.push_back(run_shape(cx, o, s, int(i), ws));
    if (r0) print_row(results.back());
    if (r0 && !o.json.empty()) write_json(o.json, cx, o, results);  // rewritten after each shape
  }
  ws = WeightSet{};

  int failed = 0;
  if (r0) {
    std::printf("#\n");
    for (const Result& r : results) {
      if (r.ok()) continue;
      ++failed;
      std::printf("# FAILED E=%d k=%d hidden=%d ffn=%d tokens=%lld:%s%s\n", r.s.E, r.s.k, r.s.hidden, r.s.ffn,
                  (long long)r.s.tokens,
                  r.rows_ok ? "" : (" rows sent " + std::to_string(r.rows_sent) + " != deduplicated " +
                                    std::to_string(r.rows_dedup) + " (T*k " + std::to_string(r.rows_tk) + ");")
                                       .c_str(),
                  r.check_ok ? "" : (" y check: rel_err " + json_num(r.rel_err) + ", unwritten " +
                                     std::to_string(r.unwritten) + ";")
                                        .c_str());
    }
    if (failed == 0)
      std::printf("# all %zu shapes: rows sent == deduplicated count (never T*k); sampled y within rel %.0e of "
                  "the CPU reference; y fully written\n",
                  results.size(), kRelTolerance);
    std::fflush(stdout);
  }
  MPI_Bcast(&failed, 1, MPI_INT, 0, MPI_COMM_WORLD);

  cudaEventDestroy(cx.ev_a);
  cudaEventDestroy(cx.ev_b);
  cudaStreamDestroy(cx.stream);
  cx.comm.reset();
  return failed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) { return epmoe::bench::mpi_bench_main(argc, argv, "bench_ep", run); }
