// epmoe_bench_scaling: one point of the scaling benchmark: the layer's forward and its training
// step (forward with save, then backward) at one world size and one shape. launch/scaling_bench.py
// runs it over world sizes 1..N (weak and strong scaling) beside the torch EP baseline and writes the
// table, the JSON and the plot.
//
//   mpirun -np N epmoe_bench_scaling --shape E,k,hidden,ffn,T [options]   one rank per process: NCCL
//                                                                          on GPUs, else MPI on CPU
//   epmoe_bench_scaling --mock-ranks N --shape E,k,hidden,ffn,T [options] N CPU ranks as threads
//   options: [--iters 10] [--warmup 2] [--warmup-ms 300] [--check-tokens 4] [--cpu-threads 1]
//            [--device auto|cpu|cuda] [--seed 1] [--label TEXT] [--json out.json]
//
// T is tokens per rank. Every rank, in lockstep:
//  data: this rank's experts, w1 ~ N(0,1)/sqrt(hidden), w2 ~ N(0,1)/sqrt(ffn) (bench_data.h's
//        generators: any rank can regenerate any expert); x, dy ~ N(0,1); routing = top-k of
//        softmax(N(0,1) logits), renormalised, bf16 (the torch baselines' draws).
//  fwd:     forward without save;
//  fwd+bwd: forward with save (rows and h) then backward, dW written in bf16;
//  each:    `warmup` calls (and at least `warmup-ms` of them), then `iters` calls, each timed alone
//           (CUDA events on the layer's stream; the host clock on CPU). Median per rank; the point
//           is the slowest rank's median (the calls are collective).
//  checks:  y of `check-tokens` sampled tokens per rank against reference_moe (relative L2 <= 1e-2:
//           bf16 operands and output); one more backward into NaN-poisoned dx and d_topk_weights must
//           leave none. The exit status is non-zero when a check fails.
// TFLOP/s per GPU counts the routed pairs actually computed: 6 hidden ffn per pair forward, 18 for
// fwd+bwd (the two data-gradient and two weight-gradient GEMMs), over the world size.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "bench_data.h"
#include "comm/mock_comm.h"
#include "epmoe/bf16.h"
#include "epmoe/build_config.h"
#include "epmoe/error.h"
#include "epmoe/moe_config.h"
#include "epmoe/moe_layer.h"
#include "epmoe/tensor_view.h"
#if EPMOE_WITH_MPI
#include "epmoe/mpi_communicator.h"
#endif
#if EPMOE_WITH_NCCL
#include <cuda_runtime.h>

#include "epmoe/nccl_communicator.h"
#include "kernels/cuda_check.cuh"
#endif

namespace {

using namespace epmoe::bench;
using epmoe::bf16;
using epmoe::Communicator;
using epmoe::DeviceType;
using epmoe::DType;
using epmoe::ErrorCode;
using epmoe::TensorView;

constexpr double kRelTolerance = 1e-2;

struct Options {
  Shape shape;
  bool have_shape = false;
  int mock_ranks = 0;
  int iters = 10, warmup = 2, check_tokens = 4, cpu_threads = 1;
  double warmup_ms = 300;
  std::string device = "auto", label, json;
  uint64_t seed = 1;
};

void usage(FILE* f) {
  std::fprintf(f,
               "usage: mpirun -np N epmoe_bench_scaling --shape E,k,hidden,ffn,T [options]\n"
               "       epmoe_bench_scaling --mock-ranks N --shape E,k,hidden,ffn,T [options]\n"
               "  options: [--iters 10] [--warmup 2] [--warmup-ms 300] [--check-tokens 4] [--cpu-threads 1]\n"
               "           [--device auto|cpu|cuda] [--seed 1] [--label TEXT] [--json out.json]\n"
               "  T is tokens per rank; under mpirun: NCCL on GPUs (one per rank), else MPI on CPU\n");
}

Options parse_args(int argc, char** argv) {
  Options o;
  auto need = [&](int& i) -> std::string {
    EPMOE_CHECK(i + 1 < argc, ErrorCode::invalid_argument, argv[i], " needs a value");
    return argv[++i];
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--shape") {
      const std::string v = need(i);
      EPMOE_CHECK(scan_shape(v, o.shape), ErrorCode::invalid_argument, "--shape wants E,k,hidden,ffn,T (got '", v,
                  "')");
      o.have_shape = true;
    } else if (a == "--mock-ranks") o.mock_ranks = std::stoi(need(i));
    else if (a == "--iters") o.iters = std::stoi(need(i));
    else if (a == "--warmup") o.warmup = std::stoi(need(i));
    else if (a == "--warmup-ms") o.warmup_ms = std::stod(need(i));
    else if (a == "--check-tokens") o.check_tokens = std::stoi(need(i));
    else if (a == "--cpu-threads") o.cpu_threads = std::stoi(need(i));
    else if (a == "--device") o.device = need(i);
    else if (a == "--seed") o.seed = std::stoull(need(i));
    else if (a == "--label") o.label = need(i);
    else if (a == "--json") o.json = need(i);
    else if (a == "-h" || a == "--help") usage(stdout), std::exit(0);
    else EPMOE_FAIL(ErrorCode::invalid_argument, "unknown argument '", a, "' (--help lists them)");
  }
  const Shape& s = o.shape;
  EPMOE_CHECK(o.have_shape, ErrorCode::invalid_argument, "--shape E,k,hidden,ffn,T is required");
  EPMOE_CHECK(valid_shape(s, 0), ErrorCode::invalid_argument, "--shape: bad shape");
  EPMOE_CHECK(o.iters >= 1 && o.warmup >= 0 && o.warmup_ms >= 0 && o.check_tokens >= 0 && o.cpu_threads >= 1 &&
                  o.mock_ranks >= 0,
              ErrorCode::invalid_argument, "--iters >= 1, --warmup / --warmup-ms / --check-tokens >= 0, "
              "--cpu-threads >= 1, --mock-ranks >= 0");
  EPMOE_CHECK(o.device == "auto" || o.device == "cpu" || o.device == "cuda", ErrorCode::invalid_argument,
              "--device must be auto, cpu or cuda (got '", o.device, "')");
  return o;
}

// ---- where the tensors live ----------------------------------------------------------------------

// One buffer in host memory or, for the GPU engine, device memory (a host copy comes and goes).
class Buffer {
 public:
  Buffer(size_t bytes, bool on_gpu) : bytes_(bytes), gpu_(on_gpu) {
#if EPMOE_WITH_NCCL
    if (gpu_) {
      EPMOE_CUDA_CHECK(cudaMalloc(&ptr_, std::max<size_t>(bytes, 16)));
      return;
    }
#endif
    EPMOE_CHECK(!gpu_, ErrorCode::unsupported, "this build has no CUDA");
    host_.resize(std::max<size_t>(bytes, 16));
    ptr_ = host_.data();
  }
  ~Buffer() {
#if EPMOE_WITH_NCCL
    if (gpu_ && ptr_) cudaFree(ptr_);
#endif
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  void* get() const { return ptr_; }
  void upload(const void* src, size_t offset, size_t bytes) {
#if EPMOE_WITH_NCCL
    if (gpu_) {
      EPMOE_CUDA_CHECK(cudaMemcpy(static_cast<char*>(ptr_) + offset, src, bytes, cudaMemcpyHostToDevice));
      EPMOE_CUDA_CHECK(cudaDeviceSynchronize());  // (a pageable upload returns before the device has it)
      return;
    }
#endif
    std::memcpy(static_cast<char*>(ptr_) + offset, src, bytes);
  }
  void download(void* dst) const {
#if EPMOE_WITH_NCCL
    if (gpu_) {
      EPMOE_CUDA_CHECK(cudaMemcpy(dst, ptr_, bytes_, cudaMemcpyDeviceToHost));
      return;
    }
#endif
    std::memcpy(dst, ptr_, bytes_);
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  bool gpu_ = false;
  std::vector<unsigned char> host_;
};

// ---- collective reductions over the layer's communicator (host memory on every backend) ---------

int64_t max_over_ranks(Communicator& c, int64_t v) {
  c.allreduce_max_i64(&v, 1);
  return v;
}
int64_t sum_over_ranks(Communicator& c, int64_t v) {
  std::vector<int64_t> slot(size_t(c.world_size()), std::numeric_limits<int64_t>::min());
  slot[size_t(c.rank())] = v;
  c.allreduce_max_i64(slot.data(), slot.size());
  int64_t s = 0;
  for (int64_t x : slot) s += x;
  return s;
}

struct Point {
  double fwd_ms = 0, fwdbwd_ms = 0;
  int64_t pairs = 0, check_tokens = 0, nonfinite_grads = 0;
  double rel_err = 0;
  int iters_fwd = 0, iters_fwdbwd = 0;
};

// ---- one rank ------------------------------------------------------------------------------------

Point run_rank(const Options& o, const std::shared_ptr<Communicator>& comm, bool on_gpu) {
  const Shape& s = o.shape;
  const int me = comm->rank(), W = comm->world_size();
  EPMOE_CHECK(s.E % W == 0, ErrorCode::invalid_argument, "E=", s.E, " is not divisible by the world size ", W);
  const int El = s.E / W;
  const int64_t T = s.tokens;
  const float w1_std = 1.f / std::sqrt(float(s.hidden)), w2_std = 1.f / std::sqrt(float(s.ffn));
  int dev = 0;
#if EPMOE_WITH_NCCL
  if (on_gpu) EPMOE_CUDA_CHECK(cudaGetDevice(&dev));
#endif
  const DeviceType where = on_gpu ? DeviceType::cuda : DeviceType::cpu;
  auto view = [&](const Buffer& b, DType t, std::initializer_list<int64_t> shape) {
    return TensorView::contiguous(b.get(), t, shape, where, dev);
  };

  // data
  const size_t n1 = size_t(2) * s.ffn * s.hidden, n2 = size_t(s.hidden) * s.ffn;
  Buffer w1(El * n1 * sizeof(bf16), on_gpu), w2(El * n2 * sizeof(bf16), on_gpu);
  {
    std::vector<bf16> h1(n1), h2(n2);
    for (int le = 0; le < El; ++le) {
      generate_expert(o.seed, s, me * El + le, h1.data(), h2.data(), w1_std, w2_std);
      w1.upload(h1.data(), le * n1 * sizeof(bf16), n1 * sizeof(bf16));
      w2.upload(h2.data(), le * n2 * sizeof(bf16), n2 * sizeof(bf16));
    }
  }
  std::vector<bf16> hx(size_t(T) * s.hidden), hdy(size_t(T) * s.hidden);
  std::vector<int32_t> hids(size_t(T) * s.k);
  std::vector<float> hwts(size_t(T) * s.k);
  fill_normal_bf16(hx.data(), int64_t(hx.size()), stream_key(o.seed, kTagX, uint64_t(me), 0), 1.f);
  fill_normal_bf16(hdy.data(), int64_t(hdy.size()), stream_key(o.seed, kTagDy, uint64_t(me), 0), 1.f);
  route_softmax_topk(stream_key(o.seed, kTagLogits, uint64_t(me), 0), T, s.E, s.k, hids.data(), hwts.data());
  const size_t act_bytes = hx.size() * sizeof(bf16), slot_n = hids.size();
  Buffer x(act_bytes, on_gpu), dy(act_bytes, on_gpu), y(act_bytes, on_gpu), dx(act_bytes, on_gpu);
  Buffer ids(slot_n * 4, on_gpu), wts(slot_n * 4, on_gpu), dtw(slot_n * 4, on_gpu);
  Buffer dw1(El * n1 * sizeof(bf16), on_gpu), dw2(El * n2 * sizeof(bf16), on_gpu);
  x.upload(hx.data(), 0, act_bytes);
  dy.upload(hdy.data(), 0, act_bytes);
  ids.upload(hids.data(), 0, slot_n * 4);
  wts.upload(hwts.data(), 0, slot_n * 4);

  const TensorView vx = view(x, DType::bf16, {T, s.hidden}), vy = view(y, DType::bf16, {T, s.hidden});
  const TensorView vdy = view(dy, DType::bf16, {T, s.hidden}), vdx = view(dx, DType::bf16, {T, s.hidden});
  const TensorView vids = view(ids, DType::i32, {T, s.k}), vwts = view(wts, DType::f32, {T, s.k});
  const TensorView vdtw = view(dtw, DType::f32, {T, s.k});
  epmoe::ExpertGradients grads{view(dw1, DType::bf16, {El, 2 * int64_t(s.ffn), s.hidden}),
                               view(dw2, DType::bf16, {El, int64_t(s.hidden), s.ffn}), false};

  epmoe::MoeConfig cfg{.num_experts = s.E, .top_k = s.k, .hidden = s.hidden, .ffn = s.ffn, .world_size = W,
                       .rank = me};
  epmoe::LayerOptions lo;
  lo.cpu_threads = o.cpu_threads;
  lo.save_policy = epmoe::SavePolicy::rows_and_preactivation;
  epmoe::MoeLayer layer(cfg,
                        {view(w1, DType::bf16, {El, 2 * int64_t(s.ffn), s.hidden}),
                         view(w2, DType::bf16, {El, int64_t(s.hidden), s.ffn})},
                        comm, lo);
  void* stream = nullptr;
#if EPMOE_WITH_NCCL
  cudaEvent_t ev0 = nullptr, ev1 = nullptr;
  if (on_gpu) {
    cudaStream_t st = nullptr;
    EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    stream = st;
    EPMOE_CUDA_CHECK(cudaEventCreate(&ev0));
    EPMOE_CUDA_CHECK(cudaEventCreate(&ev1));
  }
#endif
  epmoe::MoeForwardContext ctx;
  auto fwd = [&] { layer.forward(vx, vids, vwts, vy, stream); };
  auto fwdbwd = [&] {
    layer.forward(vx, vids, vwts, vy, stream, &ctx);
    layer.backward(ctx, vdy, vdx, vdtw, grads, stream);
  };
  // One call timed alone: events around it on the GPU, the host clock on CPU.
  auto timed = [&](const auto& call) {
#if EPMOE_WITH_NCCL
    if (on_gpu) {
      auto* st = static_cast<cudaStream_t>(stream);
      EPMOE_CUDA_CHECK(cudaEventRecord(ev0, st));
      call();
      EPMOE_CUDA_CHECK(cudaEventRecord(ev1, st));
      EPMOE_CUDA_CHECK(cudaEventSynchronize(ev1));
      float ms = 0;
      EPMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, ev0, ev1));
      return double(ms);
    }
#endif
    const auto t0 = std::chrono::steady_clock::now();
    call();
    return seconds_since(t0) * 1e3;
  };
  // warm-up (a count, then enough more to last warmup_ms, the same count on every rank), then iters
  auto phase = [&](const auto& call, int& iters_out) {
    double first = 0;
    for (int i = 0; i < std::max(1, o.warmup); ++i) first = timed(call);
    const int64_t more = o.warmup_ms > 0 ? int64_t(std::ceil(o.warmup_ms / std::max(first, 1e-3))) : 0;
    const int64_t n = std::min<int64_t>(max_over_ranks(*comm, more), 100000);
    for (int64_t i = 0; i < n; ++i) timed(call);
    std::vector<double> ts;
    for (int i = 0; i < o.iters; ++i) ts.push_back(timed(call));
    iters_out = o.iters;
    const int64_t ns = max_over_ranks(*comm, int64_t(median(ts) * 1e6));
    return double(ns) * 1e-6;
  };
  Point p;
  p.fwd_ms = phase(fwd, p.iters_fwd);
  p.pairs = sum_over_ranks(*comm, layer.last_stats().expert_pairs);
  p.fwdbwd_ms = phase(fwdbwd, p.iters_fwdbwd);

  // checks: y of the last forward against the reference; one more backward into poisoned outputs
  std::vector<bf16> hy(hx.size());
  y.download(hy.data());
  const CheckResult chk =
      check_sampled(o.seed, s, hx.data(), hids.data(), hwts.data(), hy.data(), o.check_tokens, w1_std, w2_std);
  {
    const std::vector<uint16_t> nan_bf16(hx.size(), 0x7fc0);
    const std::vector<float> nan_f32(slot_n, std::numeric_limits<float>::quiet_NaN());
    dx.upload(nan_bf16.data(), 0, act_bytes);
    dtw.upload(nan_f32.data(), 0, slot_n * 4);
    layer.backward(ctx, vdy, vdx, vdtw, grads, stream);
#if EPMOE_WITH_NCCL
    if (on_gpu) EPMOE_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
#endif
    std::vector<bf16> hdx(hx.size());
    std::vector<float> hdtw(slot_n);
    dx.download(hdx.data());
    dtw.download(hdtw.data());
    int64_t bad = 0;
    for (const bf16& v : hdx) bad += !std::isfinite(v.f());
    for (float v : hdtw) bad += !std::isfinite(v);
    p.nonfinite_grads = sum_over_ranks(*comm, bad);
  }
  p.check_tokens = sum_over_ranks(*comm, chk.tokens);
  const double rel = chk.ref2 > 0 ? std::sqrt(chk.err2 / chk.ref2) : (chk.err2 > 0 ? INFINITY : 0.0);
  p.rel_err = double(max_over_ranks(*comm, std::isfinite(rel) ? int64_t(rel * 1e12) : INT64_MAX)) * 1e-12;
#if EPMOE_WITH_NCCL
  if (on_gpu) {
    cudaEventDestroy(ev0);
    cudaEventDestroy(ev1);
    cudaStreamDestroy(static_cast<cudaStream_t>(stream));
  }
#endif
  return p;
}

// ---- rank 0's report -----------------------------------------------------------------------------

std::string device_name(bool on_gpu) {
#if EPMOE_WITH_NCCL
  if (on_gpu) {
    int d = 0;
    cudaDeviceProp prop{};
    if (cudaGetDevice(&d) == cudaSuccess && cudaGetDeviceProperties(&prop, d) == cudaSuccess) return prop.name;
  }
#endif
  return "cpu";
}

bool report(const Options& o, const Point& p, int world, const std::string& comm_name, bool on_gpu) {
  const Shape& s = o.shape;
  const double hf = double(s.hidden) * s.ffn;
  const double tf_fwd = 6 * hf * double(p.pairs) / (p.fwd_ms * 1e-3) / world / 1e12;
  const double tf_fb = 18 * hf * double(p.pairs) / (p.fwdbwd_ms * 1e-3) / world / 1e12;
  const bool ok = p.rel_err <= kRelTolerance && p.nonfinite_grads == 0;
  std::printf("# epmoe_bench_scaling: %s, %s, world %d, E=%d k=%d hidden=%d ffn=%d, %lld tokens/rank%s%s\n",
              device_name(on_gpu).c_str(), comm_name.c_str(), world, s.E, s.k, s.hidden, s.ffn,
              (long long)s.tokens, o.label.empty() ? "" : ", ", o.label.c_str());
  std::printf("%6s %12s %12s | %10s %10s | %10s %10s | %9s %6s\n", "world", "tokens/rank", "pairs", "fwd_ms",
              "TF/GPU", "fwdbwd_ms", "TF/GPU", "rel_err", "check");
  std::printf("%6d %12lld %12lld | %10.3f %10.2f | %10.3f %10.2f | %9.2e %6s\n", world, (long long)s.tokens,
              (long long)p.pairs, p.fwd_ms, tf_fwd, p.fwdbwd_ms, tf_fb, p.rel_err, ok ? "OK" : "FAIL");
  if (p.nonfinite_grads) std::printf("# %lld non-finite dx / d_topk_weights values\n", (long long)p.nonfinite_grads);
  std::fflush(stdout);
  if (!o.json.empty()) {
    std::ofstream f(o.json);
    f << "{\"program\": \"epmoe_bench_scaling\", \"backend\": \"" << (on_gpu ? "cuda" : "cpu") << "\", \"device\": \""
      << device_name(on_gpu) << "\", \"comm\": \"" << comm_name << "\", \"label\": \"" << o.label
      << "\", \"world\": " << world << ", \"E\": " << s.E << ", \"k\": " << s.k << ", \"hidden\": " << s.hidden
      << ", \"ffn\": " << s.ffn << ", \"tokens_per_rank\": " << s.tokens << ", \"pairs\": " << p.pairs
      << ", \"iters\": " << o.iters << ", \"fwd_ms\": " << json_num(p.fwd_ms) << ", \"fwdbwd_ms\": "
      << json_num(p.fwdbwd_ms) << ", \"fwd_tflops_per_gpu\": " << json_num(tf_fwd)
      << ", \"fwdbwd_tflops_per_gpu\": " << json_num(tf_fb) << ", \"check_tokens\": " << p.check_tokens
      << ", \"check_rel_err\": " << json_num(p.rel_err) << ", \"nonfinite_grads\": " << p.nonfinite_grads
      << ", \"check_ok\": " << (ok ? "true" : "false") << "}\n";
    EPMOE_CHECK(f.good(), ErrorCode::invalid_argument, "cannot write ", o.json);
  }
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse_args(argc, argv);
    const bool under_mpi = std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE");
    bool gpu = false;
#if EPMOE_WITH_NCCL
    int ndev = 0;
    if (o.device != "cpu" && cudaGetDeviceCount(&ndev) == cudaSuccess && ndev > 0) gpu = true;
#endif
    if (under_mpi && o.mock_ranks == 0) {
#if EPMOE_WITH_MPI
      MPI_Init(&argc, &argv);
      int rc = 0;
      try {
        EPMOE_CHECK(o.device != "cuda" || gpu, ErrorCode::unsupported, "--device cuda but no CUDA device / NCCL");
        std::shared_ptr<Communicator> comm;
#if EPMOE_WITH_NCCL
        if (gpu) comm = epmoe::make_nccl_communicator_from_mpi(MPI_COMM_WORLD);
#endif
        if (!comm) comm = epmoe::make_mpi_communicator(MPI_COMM_WORLD);
        const Point p = run_rank(o, comm, gpu);
        if (comm->rank() == 0 && !report(o, p, comm->world_size(), comm->name(), gpu)) rc = 1;
        MPI_Bcast(&rc, 1, MPI_INT, 0, MPI_COMM_WORLD);
      } catch (const std::exception& e) {
        int r = 0;
        MPI_Comm_rank(MPI_COMM_WORLD, &r);
        std::fprintf(stderr, "epmoe_bench_scaling: rank %d: %s\n", r, e.what());
        std::fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 2);  // peers may wait in a collective
      }
      MPI_Finalize();
      return rc;
#else
      EPMOE_FAIL(ErrorCode::unsupported, "launched by mpirun but this build has no MPI");
#endif
    }
    // Mock ranks: the CPU engine on threads of this process (a GPU runs under mpirun instead).
    EPMOE_CHECK(o.device != "cuda", ErrorCode::unsupported, "--device cuda runs under mpirun (one rank per GPU)");
    const int n = std::max(1, o.mock_ranks);
    std::vector<Point> pts(static_cast<size_t>(n));
    auto errors = epmoe::run_mock_ranks(n, [&](int rank, std::shared_ptr<Communicator> comm) {
      pts[size_t(rank)] = run_rank(o, comm, false);
    }, 600.0);
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
    return report(o, pts[0], n, "mock", false) ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epmoe_bench_scaling: %s\n", e.what());
    return 2;
  }
}
