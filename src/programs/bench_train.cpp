// epmoe_bench_train: the layer's training step (forward with save, then backward), timed per phase.
//
//   mpirun -np N epmoe_bench_train [--shapes default|all|E,k,hidden,ffn,T[;...]] [--policy preact|recompute|both]
//                                  [--grad-dtype bf16|f32] [--budget-ms 400 | --iters N] [--warmup-ms 500]
//                                  [--path auto|sm90|cublas] [--wgrad auto|sm90|cublas] [--dgrad auto|grouped|per-gemm]
//                                  [--seed 1] [--commit REV] [--json out.json]
//
// One rank per GPU, NCCL bootstrapped over MPI, as epmoe_bench_ep. For each shape (T tokens per rank)
// and save policy, every rank in lockstep:
//  data: w1 ~ N(0,1)/sqrt(hidden), w2 ~ N(0,1)/sqrt(ffn) in bf16; x, dy ~ N(0,1); routing = top-k of
//        softmax(N(0,1) logits), renormalised, bf16: the draws of ../shared/baselines/train_baseline.py
//        (bench_common.h's generators, so any rank can regenerate any expert).
//  phases, each timed between two cudaEvents per iteration (median per rank; the slowest rank shown):
//    fwd       forward without save
//    fwd_save  forward with save into one MoeForwardContext (the policy's)
//    fwd+bwd   forward(save) then backward, dW written (accumulate = false)
//    bwd       backward alone, re-run on the last saved context (a context may be consumed again)
//  The JSON also has bwd_derived_ms = fwd+bwd - fwd_save.
//  check: one more backward into a NaN-poisoned dx and d_topk_weights; any NaN/Inf left fails the row.
// Iterations per phase: --iters, or as many as fill --budget-ms (5 to 500), counted from one untimed
// call that also takes the phase's first-call costs (workspace growth, handles) out of the timing.
// A row whose layer throws (e.g. Error(unsupported) while a backward is not built) keeps the phases
// it measured, prints the error and the run goes on; the exit status is non-zero if any row failed.
#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <fstream>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "bench_common.h"
#include "epmoe/bf16.h"
#include "epmoe/build_config.h"
#include "epmoe/error.h"
#include "epmoe/moe_config.h"
#include "epmoe/moe_layer.h"
#include "epmoe/nccl_communicator.h"
#include "epmoe/tensor_view.h"

#if !EPMOE_WITH_MPI || !EPMOE_WITH_NCCL
#error "epmoe_bench_train needs epmoe built with MPI and NCCL (EPMOE_ENABLE_MPI, EPMOE_ENABLE_NCCL)"
#endif

namespace {

using namespace epmoe::bench;
using epmoe::bf16;
using epmoe::DeviceType;
using epmoe::DType;
using epmoe::SavePolicy;
using epmoe::TensorView;

constexpr int kMinIters = 5, kMaxIters = 500;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// ---- options -----------------------------------------------------------------------------------

struct Options {
  std::string shapes = "default";
  std::vector<Shape> list;
  std::string policy = "both";
  std::vector<SavePolicy> policies;
  DType grad_dtype = DType::bf16;
  int iters = 0;  // 0: from budget_ms
  double budget_ms = 400;
  // Forwards before a row's timing last at least this long (the board is power-capped: steps timed
  // right after the idle setup would start in a power headroom a training loop never has).
  double warmup_ms = 500;
  uint64_t seed = 1;
  epmoe::ExpertPath path = epmoe::ExpertPath::automatic;
  epmoe::ExpertPath wgrad = epmoe::ExpertPath::automatic;  // LayerOptions::weight_grad_path
  epmoe::GemmGrouping dgrad = epmoe::GemmGrouping::automatic;  // LayerOptions::data_grad_grouping
  std::string json, commit = "unknown";
  bool help = false;
};

// The five shapes of ../shared/baselines/train_baseline.py, in its order.
const std::vector<Shape> kDefaultShapes = {{32, 4, 2048, 1024, 16384}, {32, 4, 2048, 1024, 4096},
                                           {128, 8, 2048, 768, 16384}, {32, 8, 7168, 2048, 8192},
                                           {8, 2, 4096, 14336, 4096}};
// default + a decode-sized step and epmoe_bench_ep's larger shapes.
const std::vector<Shape> kExtraShapes = {{32, 4, 2048, 1024, 128}, {128, 8, 2048, 768, 8192}, {256, 8, 7168, 2048, 4096}};

const char* policy_name(SavePolicy p) { return p == SavePolicy::rows_recompute ? "recompute" : "preact"; }

void usage(FILE* f) {
  std::fprintf(f,
               "usage: mpirun -np N epmoe_bench_train [--shapes default|all|E,k,hidden,ffn,T[;...]]\n"
               "       [--policy preact|recompute|both] [--grad-dtype bf16|f32] [--budget-ms 400 | --iters N]\n"
               "       [--warmup-ms 500] [--path auto|sm90|cublas] [--wgrad auto|sm90|cublas]\n"
               "       [--dgrad auto|grouped|per-gemm] [--seed 1] [--commit REV] [--json out.json]\n"
               "  default: the torch baseline's five (E,k,hidden,ffn,T per rank): 32,4,2048,1024,16384;\n"
               "           32,4,2048,1024,4096; 128,8,2048,768,16384; 32,8,7168,2048,8192; 8,2,4096,14336,4096\n"
               "  all:     default + 32,4,2048,1024,128; 128,8,2048,768,8192; 256,8,7168,2048,4096\n"
               "  --budget-ms: timing per phase (5 to 500 iterations); --iters N fixes the count instead\n"
               "  --commit: a revision label copied into the JSON\n");
}

std::vector<Shape> parse_shapes(const std::string& v) {
  if (v == "default") return kDefaultShapes;
  if (v == "all") {
    std::vector<Shape> all = kDefaultShapes;
    all.insert(all.end(), kExtraShapes.begin(), kExtraShapes.end());
    return all;
  }
  std::vector<Shape> out;
  std::stringstream ss(v);
  std::string item;
  while (std::getline(ss, item, ';')) {
    if (item.empty()) continue;
    Shape s;
    EPMOE_CHECK(scan_shape(item, s), epmoe::ErrorCode::invalid_argument,
                "--shapes wants default, all or E,k,hidden,ffn,T[;...] (got '", item, "')");
    EPMOE_CHECK(valid_shape(s, 1), epmoe::ErrorCode::invalid_argument, "--shapes: bad shape '", item, "'");
    out.push_back(s);
  }
  EPMOE_CHECK(!out.empty(), epmoe::ErrorCode::invalid_argument, "--shapes: no shape in '", v, "'");
  return out;
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
    else if (a == "--policy") o.policy = need(i);
    else if (a == "--json") o.json = need(i);
    else if (a == "--commit") o.commit = need(i);
    else if (a == "--iters") o.iters = std::stoi(need(i));
    else if (a == "--budget-ms") o.budget_ms = std::stod(need(i));
    else if (a == "--warmup-ms") o.warmup_ms = std::stod(need(i));
    else if (a == "--seed") o.seed = std::stoull(need(i));
    else if (a == "--grad-dtype") {
      const std::string d = need(i);
      if (d == "bf16") o.grad_dtype = DType::bf16;
      else if (d == "f32") o.grad_dtype = DType::f32;
      else EPMOE_FAIL(epmoe::ErrorCode::invalid_argument, "--grad-dtype must be bf16 or f32 (got '", d, "')");
    } else if (a == "--path") {
      o.path = parse_expert_path("--path", need(i));
    } else if (a == "--wgrad") {
      o.wgrad = parse_expert_path("--wgrad", need(i));
    } else if (a == "--dgrad") {
      const std::string d = need(i);
      if (d == "auto") o.dgrad = epmoe::GemmGrouping::automatic;
      else if (d == "grouped") o.dgrad = epmoe::GemmGrouping::grouped;
      else if (d == "per-gemm") o.dgrad = epmoe::GemmGrouping::per_gemm;
      else EPMOE_FAIL(epmoe::ErrorCode::invalid_argument, "--dgrad must be auto, grouped or per-gemm (got '", d, "')");
    } else if (a == "-h" || a == "--help") {
      o.help = true;
    } else {
      EPMOE_FAIL(epmoe::ErrorCode::invalid_argument, "unknown argument '", a, "' (--help lists them)");
    }
  }
  if (o.help) return o;
  o.list = parse_shapes(o.shapes);
  if (o.policy == "preact" || o.policy == "both") o.policies.push_back(SavePolicy::rows_and_preactivation);
  if (o.policy == "recompute" || o.policy == "both") o.policies.push_back(SavePolicy::rows_recompute);
  EPMOE_CHECK(!o.policies.empty(), epmoe::ErrorCode::invalid_argument,
              "--policy must be preact, recompute or both (got '", o.policy, "')");
  EPMOE_CHECK(o.iters >= 0 && o.budget_ms > 0 && o.warmup_ms >= 0, epmoe::ErrorCode::invalid_argument,
              "--iters must be >= 0, --budget-ms > 0, --warmup-ms >= 0");
  return o;
}

// ---- small helpers -------------------------------------------------------------------------------

std::string json_str(const std::string& s) {
  std::string o = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') o += '\\', o += c;
    else if (static_cast<unsigned char>(c) < 0x20) o += ' ';
    else o += c;
  }
  return o + "\"";
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char b[32];
  std::strftime(b, sizeof b, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return b;
}

// Device memory in use = cudaMemGetInfo's total - free: everything on this rank's device (the CUDA
// context, NCCL's buffers, cuBLAS workspaces, the layer's buffers, the saved context, ours). Sampled
// on the host after each synchronized call (each timed iteration and each phase's first call), so a
// buffer allocated and freed inside one call is missed; the GPU engine's buffers grow and stay.
int64_t device_in_use() {
  size_t free_b = 0, total_b = 0;
  BENCH_CUDA(cudaMemGetInfo(&free_b, &total_b));
  return int64_t(total_b) - int64_t(free_b);
}

struct Context {
  int rank = 0, world = 1, device = 0;
  std::shared_ptr<epmoe::Communicator> comm;
  cudaStream_t stream = nullptr;
  cudaEvent_t ev_a = nullptr, ev_b = nullptr;
  int64_t context_in_use = 0;  // device memory in use with the bare CUDA context (before NCCL)
  int64_t peak_in_use = 0;     // the current row's largest device_in_use() sample
  void sample_memory() { peak_in_use = std::max(peak_in_use, device_in_use()); }
};

// ---- one row (shape x policy) --------------------------------------------------------------------

// A row's phases in order; `done` holds the last one completed, so done + 1 names where it failed.
enum Phase : int { kNone = 0, kSetup, kFwd, kFwdSave, kFwdBwd, kBwd, kCheck, kPhases };
const char* phase_name(int p) {
  static const char* names[kPhases] = {"none", "setup", "fwd", "fwd_save", "fwd+bwd", "bwd", "check"};
  return p >= 0 && p < kPhases ? names[p] : "?";
}

struct Row {
  Shape s;
  int world = 1;
  SavePolicy policy = SavePolicy::rows_and_preactivation;
  std::string path = "?";
  int done = kNone;  // the last phase every rank completed
  double fwd_ms = kNaN, fwd_save_ms = kNaN, fwd_bwd_ms = kNaN, bwd_ms = kNaN, bwd_derived_ms = kNaN;
  int iters[kPhases] = {};  // per timed phase
  int64_t pairs_total = 0;
  double pairs_per_gpu = 0, fwd_tf = kNaN, bwd_tf = kNaN, fwd_bwd_tf = kNaN;
  int64_t saved_bytes = 0;  // largest rank
  double bytes_per_pair = kNaN;
  double peak_in_use_gb = kNaN, peak_gb = kNaN, layer_peak_gb = kNaN;
  double dx_l2 = kNaN, dtw_l2 = kNaN;
  int64_t dx_nonfinite = 0, dtw_nonfinite = 0;
  bool ok = false;
  std::string error;  // rank 0's, or a note that another rank failed
};

// Host inputs of one shape on this rank.
struct Inputs {
  std::vector<bf16> x, dy;    // [T, hidden]
  std::vector<int32_t> ids;   // [T, k]
  std::vector<float> wts;     // [T, k]
};

Inputs make_inputs(uint64_t seed, const Shape& s, int shape_index, int rank) {
  Inputs in;
  const int64_t T = s.tokens;
  in.x.resize(size_t(T) * s.hidden);
  in.dy.resize(size_t(T) * s.hidden);
  in.ids.resize(size_t(T) * s.k);
  in.wts.resize(size_t(T) * s.k);
  fill_normal_bf16(in.x.data(), int64_t(in.x.size()), stream_key(seed, kTagX, uint64_t(rank), uint64_t(shape_index)),
                   1.0f);
  fill_normal_bf16(in.dy.data(), int64_t(in.dy.size()),
                   stream_key(seed, kTagDy, uint64_t(rank), uint64_t(shape_index)), 1.0f);
  route_softmax_topk(stream_key(seed, kTagLogits, uint64_t(rank), uint64_t(shape_index)), T, s.E, s.k,
                     in.ids.data(), in.wts.data());
  return in;
}

template <class F>
double time_once(Context& cx, const F& f) {
  BENCH_CUDA(cudaEventRecord(cx.ev_a, cx.stream));
  f();
  BENCH_CUDA(cudaEventRecord(cx.ev_b, cx.stream));
  BENCH_CUDA(cudaEventSynchronize(cx.ev_b));
  float ms = 0;
  BENCH_CUDA(cudaEventElapsedTime(&ms, cx.ev_a, cx.ev_b));
  cx.sample_memory();
  return double(ms);
}

// One untimed call (first-call costs; it also sizes the loop, from the slowest rank since every call
// is collective), then the timed iterations; this rank's median.
template <class F>
double time_phase(Context& cx, const Options& o, int& iters, const F& f) {
  const double one = allreduce_max(time_once(cx, f));
  iters = o.iters > 0 ? o.iters : std::clamp(int(std::ceil(o.budget_ms / std::max(one, 1e-3))), kMinIters, kMaxIters);
  MPI_Barrier(MPI_COMM_WORLD);
  std::vector<double> times;
  times.reserve(size_t(iters));
  for (int i = 0; i < iters; ++i) times.push_back(time_once(cx, f));
  return median(times);
}

// Sum of squares and the count of NaN/Inf of n device values (bf16 or f32).
template <class T>
void host_norm(const void* dev, int64_t n, double& sum2, int64_t& nonfinite) {
  std::vector<T> h(size_t(std::max<int64_t>(n, 0)));
  if (n > 0) BENCH_CUDA(cudaMemcpy(h.data(), dev, h.size() * sizeof(T), cudaMemcpyDeviceToHost));
  for (const T& v : h) {
    double d;
    if constexpr (std::is_same_v<T, bf16>) d = double(v.f());
    else d = double(v);
    if (std::isfinite(d)) sum2 += d * d;
    else ++nonfinite;
  }
}

Row run_row(Context& cx, const Options& o, const Shape& s, SavePolicy policy, const Inputs& in, const WeightSet& ws) {
  const bool r0 = cx.rank == 0;
  Row row;
  row.s = s, row.world = cx.world, row.policy = policy;
  const int64_t el = s.E / cx.world, T = s.tokens, H = s.hidden, F = s.ffn;
  const int dev = cx.device;
  const int64_t before_row = device_in_use();  // the shape's weights are in it; the rest below is not
  cx.peak_in_use = before_row;

  // This rank's progress; every rank then agrees on the phases all of them completed.
  int done = kNone;
  std::string error;
  double ms[kPhases];
  std::fill(std::begin(ms), std::end(ms), kNaN);
  int64_t saved = 0, pairs = 0;
  double per_pair = 0, dx2 = 0, dtw2 = 0;
  int64_t dx_bad = 0, dtw_bad = 0;
  try {
    epmoe::MoeConfig cfg;
    cfg.num_experts = s.E, cfg.top_k = s.k, cfg.hidden = s.hidden, cfg.ffn = s.ffn;
    cfg.world_size = cx.world, cfg.rank = cx.rank;
    cfg.validate();

    const size_t act_bytes = size_t(T) * H * sizeof(bf16), route_bytes = size_t(T) * s.k * 4;
    const size_t g = epmoe::dtype_size(o.grad_dtype);
    DeviceBuffer bx(act_bytes), bdy(act_bytes), by(act_bytes), bdx(act_bytes), bids(route_bytes), bwts(route_bytes),
        bdtw(route_bytes), bdw1(size_t(el) * 2 * F * H * g), bdw2(size_t(el) * H * F * g);
    BENCH_CUDA(cudaMemcpy(bx.get(), in.x.data(), act_bytes, cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaMemcpy(bdy.get(), in.dy.data(), act_bytes, cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaMemcpy(bids.get(), in.ids.data(), route_bytes, cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaMemcpy(bwts.get(), in.wts.data(), route_bytes, cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaDeviceSynchronize());  // (pageable uploads return before the device has the bytes)
    auto view = [&](const DeviceBuffer& b, DType t, int64_t rows, int64_t cols) {
      return TensorView::contiguous(b.get(), t, {rows, cols}, DeviceType::cuda, dev);
    };
    const TensorView x = view(bx, DType::bf16, T, H), dy = view(bdy, DType::bf16, T, H), y = view(by, DType::bf16, T, H),
                     dx = view(bdx, DType::bf16, T, H), ids = view(bids, DType::i32, T, s.k),
                     wts = view(bwts, DType::f32, T, s.k), dtw = view(bdtw, DType::f32, T, s.k);
    epmoe::ExpertWeights w;
    w.w1 = TensorView::contiguous(ws.w1.get(), DType::bf16, {el, 2 * F, H}, DeviceType::cuda, dev);
    w.w2 = TensorView::contiguous(ws.w2.get(), DType::bf16, {el, H, F}, DeviceType::cuda, dev);
    epmoe::ExpertGradients grads;
    grads.dw1 = TensorView::contiguous(bdw1.get(), o.grad_dtype, {el, 2 * F, H}, DeviceType::cuda, dev);
    grads.dw2 = TensorView::contiguous(bdw2.get(), o.grad_dtype, {el, H, F}, DeviceType::cuda, dev);
    grads.accumulate = false;

    epmoe::LayerOptions lo;
    lo.expert_path = o.path;
    lo.weight_grad_path = o.wgrad;
    lo.data_grad_grouping = o.dgrad;
    lo.save_policy = policy;
    epmoe::MoeLayer layer(cfg, w, cx.comm, lo);
    epmoe::MoeForwardContext ctx;  // after the layer: destroyed first
    row.path = path_name(layer.expert_path());
    cx.sample_memory();
    done = kSetup;

    auto fwd = [&] { layer.forward(x, ids, wts, y, cx.stream); };
    auto fwd_save = [&] { layer.forward(x, ids, wts, y, cx.stream, &ctx); };
    auto bwd = [&] { layer.backward(ctx, dy, dx, dtw, grads, cx.stream); };
    auto fwd_bwd = [&] { fwd_save(), bwd(); };
    auto report = [&](int p) {
      if (r0)
        std::fprintf(stderr, "[bench_train]     %-8s %9.3f ms (median of %d)\n", phase_name(p), ms[p], row.iters[p]);
    };

    // Warm-up: forwards for o.warmup_ms (count from the slowest rank: every forward is collective).
    const double one = allreduce_max(time_once(cx, fwd));
    const int nwarm = std::max(2, int(std::ceil(o.warmup_ms / std::max(one, 1e-3))));
    for (int i = 0; i < nwarm; ++i) fwd();
    BENCH_CUDA(cudaStreamSynchronize(cx.stream));

    ms[kFwd] = time_phase(cx, o, row.iters[kFwd], fwd);
    pairs = layer.last_stats().expert_pairs;  // the same count as routed_pairs(), for a row without save
    done = kFwd, report(kFwd);
    ms[kFwdSave] = time_phase(cx, o, row.iters[kFwdSave], fwd_save);
    saved = ctx.saved_bytes(), pairs = ctx.routed_pairs(), per_pair = ctx.activation_bytes_per_pair();
    done = kFwdSave, report(kFwdSave);
    ms[kFwdBwd] = time_phase(cx, o, row.iters[kFwdBwd], fwd_bwd);
    done = kFwdBwd, report(kFwdBwd);
    ms[kBwd] = time_phase(cx, o, row.iters[kBwd], bwd);
    done = kBwd, report(kBwd);

    // Every dx and d_topk_weights element must be written: poison them (bf16 0xffff, f32 0xffffffff:
    // NaN) and run backward once more.
    BENCH_CUDA(cudaMemsetAsync(bdx.get(), 0xff, bdx.bytes(), cx.stream));
    BENCH_CUDA(cudaMemsetAsync(bdtw.get(), 0xff, bdtw.bytes(), cx.stream));
    bwd();
    BENCH_CUDA(cudaStreamSynchronize(cx.stream));
    cx.sample_memory();
    host_norm<bf16>(bdx.get(), T * H, dx2, dx_bad);
    host_norm<float>(bdtw.get(), T * s.k, dtw2, dtw_bad);
    done = kCheck;
  } catch (const std::exception& e) {
    error = e.what();
    (void)cudaStreamSynchronize(cx.stream);  // queued work ends before its buffers go (its error is e)
    std::fprintf(stderr, "[bench_train] rank %d: E=%d k=%d hidden=%d ffn=%d T=%lld %s: %s failed: %s\n", cx.rank,
                 s.E, s.k, s.hidden, s.ffn, (long long)s.tokens, policy_name(policy), phase_name(done + 1), e.what());
  }

  // -- over ranks (every rank gets here, failed or not)
  row.done = allreduce_min(done);
  const bool any_error = allreduce_min(error.empty() ? 1 : 0) == 0;
  // row.done is the same on every rank, so every rank makes the same collectives.
  auto slowest = [&](int p) { return row.done >= p ? allreduce_max(ms[p]) : kNaN; };
  row.fwd_ms = slowest(kFwd);
  row.fwd_save_ms = slowest(kFwdSave);
  row.fwd_bwd_ms = slowest(kFwdBwd);
  row.bwd_ms = slowest(kBwd);
  row.bwd_derived_ms = row.fwd_bwd_ms - row.fwd_save_ms;
  row.saved_bytes = allreduce_max(saved);
  row.pairs_total = allreduce_sum(pairs);
  const double per_pair_max = allreduce_max(per_pair);
  if (row.done >= kFwdSave) row.bytes_per_pair = per_pair_max;
  // Per-GPU FLOPs: 6 (fwd), 12 (bwd), 18 (both) x pairs x hidden x ffn; recomputation not counted.
  row.pairs_per_gpu = double(row.pairs_total) / cx.world;
  const double mac = row.pairs_per_gpu * double(H) * double(F);
  auto tflops = [](double flops, double t_ms) { return t_ms > 0 ? flops / (t_ms * 1e-3) / 1e12 : kNaN; };
  row.fwd_tf = tflops(6 * mac, row.fwd_ms);
  row.bwd_tf = tflops(12 * mac, row.bwd_ms);
  row.fwd_bwd_tf = tflops(18 * mac, row.fwd_bwd_ms);
  const int64_t peak = allreduce_max(cx.peak_in_use);
  const int64_t peak_above_context = allreduce_max(cx.peak_in_use - cx.context_in_use);
  const int64_t peak_layer = allreduce_max(cx.peak_in_use - before_row);
  row.peak_in_use_gb = double(peak) / 1e9;
  row.peak_gb = double(peak_above_context) / 1e9;
  row.layer_peak_gb = double(peak_layer) / 1e9;
  const double dx2_all = allreduce_sum(dx2), dtw2_all = allreduce_sum(dtw2);
  row.dx_nonfinite = allreduce_sum(dx_bad);
  row.dtw_nonfinite = allreduce_sum(dtw_bad);
  if (row.done >= kCheck) row.dx_l2 = std::sqrt(dx2_all), row.dtw_l2 = std::sqrt(dtw2_all);
  row.ok = !any_error && row.done == kCheck && row.dx_nonfinite == 0 && row.dtw_nonfinite == 0;
  if (any_error) {
    row.error = !error.empty() ? std::string(phase_name(done + 1)) + ": " + error
                               : std::string("failed on another rank (its stderr has the error)");
  } else if (!row.ok) {
    row.error = "check: " + std::to_string(row.dx_nonfinite) + " NaN/Inf in dx, " +
                std::to_string(row.dtw_nonfinite) + " in d_topk_weights";
  }
  if (r0 && row.done >= kCheck)
    std::fprintf(stderr, "[bench_train]     ||dx|| = %.6g, ||d_topk_weights|| = %.6g, NaN/Inf %lld + %lld\n",
                 row.dx_l2, row.dtw_l2, (long long)row.dx_nonfinite, (long long)row.dtw_nonfinite);
  return row;
}

// ---- output --------------------------------------------------------------------------------------

std::string device_name(const Context& cx) {
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, cx.device));
  return prop.name;
}

std::string nccl_version() {
  int v = 0;
  ncclGetVersion(&v);
  return std::to_string(v / 10000) + "." + std::to_string((v / 100) % 100) + "." + std::to_string(v % 100);
}

void print_header(const Context& cx, const Options& o) {
  std::printf("# epmoe_bench_train: world %d, %s (rank 0 on device %d), NCCL %s, requested path %s, dW %s, "
              "warm-up >= %.0f ms, %s, seed %llu, commit %s\n",
              cx.world, device_name(cx).c_str(), cx.device, nccl_version().c_str(), path_name(o.path),
              epmoe::dtype_name(o.grad_dtype), o.warmup_ms,
              (o.iters > 0 ? std::to_string(o.iters) + " iterations per phase"
                           : "~" + json_num(o.budget_ms) + " ms per phase (" + std::to_string(kMinIters) + " to " +
                                 std::to_string(kMaxIters) + " iterations)")
                  .c_str(),
              (unsigned long long)o.seed, o.commit.c_str());
  std::printf("# ms: median per rank between cudaEvents, slowest rank; bwd = backward alone, re-run on the saved "
              "context; T = tokens per rank\n");
  std::printf("# TF = TFLOP/s per GPU: fwd+bwd 18, bwd 12 x pairs x hidden x ffn (pairs: routed (token, expert) "
              "pairs per GPU; recomputation not counted)\n");
  std::printf("# saved MB: MoeForwardContext::saved_bytes (largest rank, 1e6 B); B/pair: its activation bytes per "
              "routed pair\n");
  std::printf("# peak GB: device memory in use (cudaMemGetInfo, 1e9 B) above the bare CUDA context, the row's peak: "
              "weights, inputs, dW, NCCL, the layer's buffers, the saved context\n#\n");
  std::printf("# %4s %2s %6s %5s %6s %9s %6s | %8s | %11s | %8s | %10s | %10s | %7s | %8s | %7s | %7s | %s\n", "E",
              "k", "hidden", "ffn", "T", "policy", "path", "fwd ms", "fwd_save ms", "bwd ms", "fwd+bwd ms",
              "fwd+bwd TF", "bwd TF", "saved MB", "B/pair", "peak GB", "status");
  std::fflush(stdout);
}

std::string cell(double v, int width, int prec) {
  char b[64];
  if (std::isfinite(v)) std::snprintf(b, sizeof b, "%*.*f", width, prec, v);
  else std::snprintf(b, sizeof b, "%*s", width, "-");
  return b;
}

void print_row(const Row& r) {
  const bool saved = r.done >= kFwdSave;
  std::printf("  %4d %2d %6d %5d %6lld %9s %6s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s\n", r.s.E, r.s.k,
              r.s.hidden, r.s.ffn, (long long)r.s.tokens, policy_name(r.policy), r.path.c_str(),
              cell(r.fwd_ms, 8, 3).c_str(), cell(r.fwd_save_ms, 11, 3).c_str(), cell(r.bwd_ms, 8, 3).c_str(),
              cell(r.fwd_bwd_ms, 10, 3).c_str(), cell(r.fwd_bwd_tf, 10, 1).c_str(), cell(r.bwd_tf, 7, 1).c_str(),
              cell(saved ? double(r.saved_bytes) / 1e6 : kNaN, 8, 1).c_str(), cell(r.bytes_per_pair, 7, 0).c_str(),
              cell(r.peak_gb, 7, 2).c_str(), r.ok ? "ok" : ("FAILED at " + std::string(phase_name(r.done + 1))).c_str());
  std::fflush(stdout);
}

std::string row_json(const Row& r) {
  std::ostringstream j;
  j << "{\"E\": " << r.s.E << ", \"k\": " << r.s.k << ", \"hidden\": " << r.s.hidden << ", \"ffn\": " << r.s.ffn
    << ", \"T\": " << r.s.tokens << ", \"tokens_per_rank\": " << r.s.tokens << ", \"world\": " << r.world
    << ", \"policy\": \"" << policy_name(r.policy) << "\", \"expert_path\": \"" << r.path
    << "\", \"fwd_ms\": " << json_num(r.fwd_ms) << ", \"fwd_save_ms\": " << json_num(r.fwd_save_ms)
    << ", \"bwd_ms\": " << json_num(r.bwd_ms) << ", \"fwd_bwd_ms\": " << json_num(r.fwd_bwd_ms)
    << ", \"bwd_derived_ms\": " << json_num(r.bwd_derived_ms) << ", \"iters\": {\"fwd\": " << r.iters[kFwd]
    << ", \"fwd_save\": " << r.iters[kFwdSave] << ", \"fwd_bwd\": " << r.iters[kFwdBwd] << ", \"bwd\": " << r.iters[kBwd]
    << "}, \"routed_pairs_total\": " << r.pairs_total << ", \"pairs_per_gpu\": " << json_num(r.pairs_per_gpu)
    << ", \"fwd_TF\": " << json_num(r.fwd_tf) << ", \"bwd_TF\": " << json_num(r.bwd_tf)
    << ", \"fwd_bwd_TF\": " << json_num(r.fwd_bwd_tf) << ", \"saved_bytes\": "
    << (r.done >= kFwdSave ? std::to_string(r.saved_bytes) : std::string("null"))
    << ", \"activation_bytes_per_pair\": " << json_num(r.bytes_per_pair) << ", \"peak_GB\": " << json_num(r.peak_gb)
    << ", \"peak_in_use_GB\": " << json_num(r.peak_in_use_gb) << ", \"layer_peak_GB\": " << json_num(r.layer_peak_gb)
    << ", \"dx_l2\": " << json_num(r.dx_l2) << ", \"d_topk_weights_l2\": " << json_num(r.dtw_l2)
    << ", \"dx_nonfinite\": " << r.dx_nonfinite << ", \"d_topk_weights_nonfinite\": " << r.dtw_nonfinite
    << ", \"phases_done\": \"" << phase_name(r.done) << "\", \"ok\": "
    << (r.ok ? "true" : "false") << ", \"error\": " << (r.error.empty() ? std::string("null") : json_str(r.error))
    << "}";
  return j.str();
}

void write_json(const Options& o, const Context& cx, const std::string& date, const std::vector<Row>& rows) {
  std::ofstream f(o.json);
  EPMOE_CHECK(f.good(), epmoe::ErrorCode::invalid_argument, "cannot write --json ", o.json);
  f << "{\"program\": \"epmoe_bench_train\", \"world\": " << cx.world << ", \"device\": " << json_str(device_name(cx))
    << ", \"nccl\": \"" << nccl_version() << "\", \"commit\": " << json_str(o.commit) << ", \"date\": \"" << date
    << "\", \"shapes\": " << json_str(o.shapes) << ", \"policy\": \"" << o.policy << "\", \"grad_dtype\": \""
    << epmoe::dtype_name(o.grad_dtype) << "\", \"iters\": " << o.iters << ", \"budget_ms\": " << json_num(o.budget_ms)
    << ", \"warmup_ms\": " << json_num(o.warmup_ms) << ", \"seed\": " << o.seed << ", \"requested_path\": \""
    << path_name(o.path) << "\", \"context_in_use_GB\": " << json_num(double(cx.context_in_use) / 1e9)
    << ", \"flops\": \"fwd 6, bwd 12, fwd_bwd 18 x pairs_per_gpu x hidden x ffn\""
    << ", \"peak\": \"peak_GB: cudaMemGetInfo in use above the bare CUDA context (rank max); peak_in_use_GB: total "
       "in use; layer_peak_GB: above the row's start (weights excluded)\", \"results\": [\n";
  for (size_t i = 0; i < rows.size(); ++i) f << "  " << row_json(rows[i]) << (i + 1 < rows.size() ? ",\n" : "\n");
  f << "]}\n";
  EPMOE_CHECK(f.good(), epmoe::ErrorCode::invalid_argument, "writing --json ", o.json, " failed");
}

int run(int argc, char** argv) {
  using clock = std::chrono::steady_clock;
  Context cx;
  MPI_Comm_rank(MPI_COMM_WORLD, &cx.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &cx.world);
  const Options o = parse_args(argc, argv);
  if (o.help) {  // before any collective: every rank returns alike
    if (cx.rank == 0) usage(stdout);
    return 0;
  }
  for (const Shape& s : o.list)
    EPMOE_CHECK(s.E % cx.world == 0, epmoe::ErrorCode::invalid_config, "E=", s.E, " is not divisible by world=",
                cx.world);
  const std::string date = utc_now();
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  g_threads = int(std::max(1u, hw / unsigned(cx.world)));

  cx.device = epmoe::select_local_device();
  BENCH_CUDA(cudaSetDevice(cx.device));
  BENCH_CUDA(cudaFree(nullptr));  // create the context now, so that what follows is measured above it
  cx.context_in_use = device_in_use();
  epmoe::NcclCommOptions co;
  co.device = cx.device;
  cx.comm = epmoe::make_nccl_communicator_from_mpi(MPI_COMM_WORLD, co);
  BENCH_CUDA(cudaStreamCreateWithFlags(&cx.stream, cudaStreamNonBlocking));
  BENCH_CUDA(cudaEventCreate(&cx.ev_a));
  BENCH_CUDA(cudaEventCreate(&cx.ev_b));

  const bool r0 = cx.rank == 0;
  if (r0) print_header(cx, o);
  std::vector<Row> rows;
  WeightSet ws;
  const auto t_start = clock::now();
  for (size_t i = 0; i < o.list.size(); ++i) {
    const Shape& s = o.list[i];
    if (r0)
      std::fprintf(stderr, "[bench_train] shape %zu/%zu: world %d E=%d k=%d hidden=%d ffn=%d T/rank=%lld (%.0f s in)\n",
                   i + 1, o.list.size(), cx.world, s.E, s.k, s.hidden, s.ffn, (long long)s.tokens,
                   seconds_since(t_start));
    if (!ws.matches(s)) {
      if (r0) std::fprintf(stderr, "[bench_train]   generating weights (%d experts per rank)\n", s.E / cx.world);
      upload_weights(ws, o.seed, s, cx.rank, cx.world, 1.0f / std::sqrt(float(s.hidden)), 1.0f / std::sqrt(float(s.ffn)));
    }
    const Inputs in = make_inputs(o.seed, s, int(i), cx.rank);
    for (const SavePolicy p : o.policies) {
      if (r0) std::fprintf(stderr, "[bench_train]   policy %s\n", policy_name(p));
      rows.push_back(run_row(cx, o, s, p, in, ws));
      if (r0) print_row(rows.back());
      if (r0 && !o.json.empty()) write_json(o, cx, date, rows);  // rewritten after each row
    }
  }
  ws = WeightSet{};

  int failed = 0;
  if (r0) {
    std::printf("#\n");
    for (const Row& r : rows) {
      if (r.ok) continue;
      ++failed;
      std::printf("# FAILED E=%d k=%d hidden=%d ffn=%d T=%lld %s: %s\n", r.s.E, r.s.k, r.s.hidden, r.s.ffn,
                  (long long)r.s.tokens, policy_name(r.policy), r.error.c_str());
    }
    if (failed == 0)
      std::printf("# all %zu rows: every phase ran; dx and d_topk_weights written and finite\n", rows.size());
    std::printf("# %.0f s\n", seconds_since(t_start));
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

int main(int argc, char** argv) { return epmoe::bench::mpi_bench_main(argc, argv, "bench_train", run); }
