// epmoe_run: the main job. Runs the expert-parallel MoE forward on synthetic data and checks it
// against the dense reference.
//   mpirun -np N epmoe_run [...]   one process per rank: NCCL on the GPUs present, else MPI on CPU
//   epmoe_run --mock-ranks N [...] N ranks as threads of this process (CPU engine)
// Prints per-rank token counts, rows and bytes dispatched, time per phase, and the max error
// against the dense reference.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/mock_comm.h"
#include "epmoe/build_config.h"
#include "epmoe/error.h"
#include "epmoe/moe_layer.h"
#include "epmoe/reference.h"
#if EPMOE_WITH_MPI
#include "epmoe/mpi_communicator.h"
#endif
#if EPMOE_WITH_NCCL
#include <cuda_runtime.h>

#include "epmoe/nccl_communicator.h"
#endif

namespace {

using namespace epmoe;

struct Args {
  int mock_ranks = 0;  // 0: MPI if launched by mpirun, else 1 mock rank
  int64_t tokens = 256;
  int experts = 32, top_k = 4, hidden = 512, ffn = 256;
  int iters = 2;
  int check_tokens = 64;  // tokens per rank checked against the reference (it is slow: fp64)
  std::string device = "auto";  // auto | cpu | cuda
  std::string routing = "zipf"; // uniform | zipf
  uint64_t seed = 2026;
};

void usage() {
  std::puts(
      "usage: epmoe_run [--mock-ranks N] [--tokens T] [--experts E] [--topk K] [--hidden H] [--ffn F]\n"
      "                 [--iters N] [--check-tokens N] [--device auto|cpu|cuda] [--routing uniform|zipf] [--seed S]\n"
      "Under mpirun: one rank per process (NCCL on GPUs when present, else MPI on CPU).");
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) EPMOE_FAIL(ErrorCode::invalid_argument, k, " needs a value");
      return argv[++i];
    };
    if (k == "--mock-ranks") a.mock_ranks = std::stoi(next());
    else if (k == "--tokens") a.tokens = std::stoll(next());
    else if (k == "--experts") a.experts = std::stoi(next());
    else if (k == "--topk") a.top_k = std::stoi(next());
    else if (k == "--hidden") a.hidden = std::stoi(next());
    else if (k == "--ffn") a.ffn = std::stoi(next());
    else if (k == "--iters") a.iters = std::stoi(next());
    else if (k == "--check-tokens") a.check_tokens = std::stoi(next());
    else if (k == "--device") a.device = next();
    else if (k == "--routing") a.routing = next();
    else if (k == "--seed") a.seed = std::stoull(next());
    else if (k == "-h" || k == "--help") usage(), std::exit(0);
    else EPMOE_FAIL(ErrorCode::invalid_argument, "unknown argument '", k, "' (see --help)");
  }
  return a;
}

// ---- synthetic data: a function of (seed, indices), identical on every rank -------------------
uint64_t hash(uint64_t a, uint64_t b, uint64_t c = 0) {
  uint64_t h = a * 0x9E3779B97F4A7C15ull ^ (b + 0xD6E8FEB86659FD93ull) ^ (c * 0xC4CEB9FE1A85EC53ull);
  h ^= h >> 31; h *= 0xBF58476D1CE4E5B9ull; h ^= h >> 29; h *= 0x94D049BB133111EBull; h ^= h >> 32;
  return h;
}
float u01(uint64_t h) { return (float(h >> 40) + 0.5f) / 16777216.f; }
float gauss(uint64_t h) { return std::sqrt(-2.f * std::log(u01(h))) * std::cos(6.2831853f * u01(hash(h, 1))); }

std::vector<bf16> gauss_bf16(size_t n, uint64_t seed, float scale) {
  std::vector<bf16> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = bf16(scale * gauss(hash(seed, i)));
  return v;
}

// Softmax-free router stand-in: k distinct experts per token (uniform or Zipf-skewed), weights
// normalised to 1.
void make_routing(const Args& a, int rank, std::vector<int32_t>& ids, std::vector<float>& w) {
  const int64_t T = a.tokens;
  const int E = a.experts, k = a.top_k;
  ids.assign(T * k, -1);
  w.assign(T * k, 0.f);
  std::vector<double> cdf(E);
  double s = 0;
  for (int e = 0; e < E; ++e) cdf[e] = (s += a.routing == "zipf" ? 1.0 / std::pow(e + 1.0, 1.1) : 1.0);
  for (double& c : cdf) c /= s;
  for (int64_t t = 0; t < T; ++t) {
    float sum = 0;
    uint64_t draw = 0;
    for (int j = 0; j < k; ++j) {
      int e;
      bool dup;
      do {
        const double u = u01(hash(a.seed + 17 * rank, t, ++draw));
        e = int(std::lower_bound(cdf.begin(), cdf.end(), u) - cdf.begin());
        e = std::min(e, E - 1);
        dup = false;
        for (int i = 0; i < j; ++i) dup |= ids[t * k + i] == e;
      } while (dup);
      ids[t * k + j] = e;
      sum += (w[t * k + j] = 0.1f + u01(hash(a.seed, t, 1000 + j)));
    }
    for (int j = 0; j < k; ++j) w[t * k + j] /= sum;
  }
}

struct RankResult {  // plain doubles only: gathered over MPI as sizeof/8 doubles
  double tokens = 0, rows_sent = 0, rows_recv = 0, dispatch_mb = 0, pairs = 0;
  double layout_ms = 0, exchange_ms = 0, dispatch_ms = 0, experts_ms = 0, combine_ms = 0, reduce_ms = 0;
  double max_abs_err = 0, max_rel_err = 0;

};

RankResult run_rank(const Args& a, std::shared_ptr<Communicator> comm, bool on_gpu) {
  const int me = comm->rank(), W = comm->world_size(), El = a.experts / W;
  MoeConfig cfg{.num_experts = a.experts, .top_k = a.top_k, .hidden = a.hidden, .ffn = a.ffn, .world_size = W,
                .rank = me};
  const int64_t T = a.tokens;
  const size_t w1n = size_t(a.experts) * 2 * a.ffn * a.hidden, w2n = size_t(a.experts) * a.hidden * a.ffn;
  // Every rank generates all experts (the reference needs them) and owns its slice.
  const auto w1 = gauss_bf16(w1n, a.seed ^ 0x1, 1.f / std::sqrt(float(a.hidden)));
  const auto w2 = gauss_bf16(w2n, a.seed ^ 0x2, 2.f / std::sqrt(float(a.ffn)));
  const auto x = gauss_bf16(size_t(T) * a.hidden, a.seed + 1000 * (me + 1), 1.f);
  std::vector<int32_t> ids;
  std::vector<float> wts;
  make_routing(a, me, ids, wts);
  std::vector<bf16> y(size_t(T) * a.hidden);
  const size_t w1_off = size_t(me) * El * 2 * a.ffn * a.hidden, w2_off = size_t(me) * El * a.hidden * a.ffn;

  LayerOptions opt;
  opt.record_phase_times = true;
  ForwardStats st;
  if (!on_gpu) {
    ExpertWeights W_{TensorView::contiguous(const_cast<bf16*>(w1.data() + w1_off), DType::bf16,
                                            {El, 2 * int64_t(a.ffn), a.hidden}),
                     TensorView::contiguous(const_cast<bf16*>(w2.data() + w2_off), DType::bf16,
                                            {El, int64_t(a.hidden), a.ffn})};
    MoeLayer layer(cfg, W_, comm, opt);
    for (int i = 0; i < a.iters; ++i)
      layer.forward(TensorView::contiguous(const_cast<bf16*>(x.data()), DType::bf16, {T, a.hidden}),
                    TensorView::contiguous(ids.data(), DType::i32, {T, a.top_k}),
                    TensorView::contiguous(wts.data(), DType::f32, {T, a.top_k}),
                    TensorView::contiguous(y.data(), DType::bf16, {T, a.hidden}));
    st = layer.last_stats();
  } else {
#if EPMOE_WITH_NCCL
    auto dev_copy = [](const void* src, size_t bytes) {
      void* p = nullptr;
      if (cudaMalloc(&p, bytes ? bytes : 16) != cudaSuccess) EPMOE_FAIL(ErrorCode::cuda_error, "cudaMalloc failed");
      if (bytes) cudaMemcpy(p, src, bytes, cudaMemcpyHostToDevice);
      return p;
    };
    void* d_w1 = dev_copy(w1.data() + w1_off, size_t(El) * 2 * a.ffn * a.hidden * 2);
    void* d_w2 = dev_copy(w2.data() + w2_off, size_t(El) * a.hidden * a.ffn * 2);
    void* d_x = dev_copy(x.data(), x.size() * 2);
    void* d_ids = dev_copy(ids.data(), ids.size() * 4);
    void* d_w = dev_copy(wts.data(), wts.size() * 4);
    void* d_y = dev_copy(y.data(), y.size() * 2);
    int cur = 0;
    cudaGetDevice(&cur);
    {
      ExpertWeights W_{TensorView::contiguous(d_w1, DType::bf16, {El, 2 * int64_t(a.ffn), a.hidden}, DeviceType::cuda, cur),
                       TensorView::contiguous(d_w2, DType::bf16, {El, int64_t(a.hidden), a.ffn}, DeviceType::cuda, cur)};
      MoeLayer layer(cfg, W_, comm, opt);
      for (int i = 0; i < a.iters; ++i)
        layer.forward(TensorView::contiguous(d_x, DType::bf16, {T, a.hidden}, DeviceType::cuda, cur),
                      TensorView::contiguous(d_ids, DType::i32, {T, a.top_k}, DeviceType::cuda, cur),
                      TensorView::contiguous(d_w, DType::f32, {T, a.top_k}, DeviceType::cuda, cur),
                      TensorView::contiguous(d_y, DType::bf16, {T, a.hidden}, DeviceType::cuda, cur), nullptr);
      if (cudaDeviceSynchronize() != cudaSuccess) EPMOE_FAIL(ErrorCode::cuda_error, "forward failed on the GPU");
      st = layer.last_stats();
    }
    cudaMemcpy(y.data(), d_y, y.size() * 2, cudaMemcpyDeviceToHost);
    for (void* p : {d_w1, d_w2, d_x, d_ids, d_w, d_y}) cudaFree(p);
#else
    EPMOE_FAIL(ErrorCode::unsupported, "this build has no NCCL/CUDA support");
#endif
  }

  RankResult r;
  r.tokens = double(T);
  for (int64_t v : st.send_rows) r.rows_sent += double(v);
  for (int64_t v : st.recv_rows) r.rows_recv += double(v);
  r.dispatch_mb = st.dispatch_bytes / 1e6;
  r.pairs = double(st.expert_pairs);
  r.layout_ms = st.layout_ms, r.exchange_ms = st.exchange_ms, r.dispatch_ms = st.dispatch_ms;
  r.experts_ms = st.experts_ms, r.combine_ms = st.combine_ms, r.reduce_ms = st.reduce_ms;
  // Check the first check_tokens tokens against the dense reference (fp64, all experts).
  const int64_t n = std::min<int64_t>(T, a.check_tokens);
  std::vector<float> ref(size_t(n) * a.hidden);
  reference_moe(x.data(), ids.data(), wts.data(), n, a.top_k, w1.data(), w2.data(), a.experts, a.hidden, a.ffn,
                ref.data());
  for (size_t i = 0; i < ref.size(); ++i) {
    const double e = std::fabs(double(y[i].f()) - ref[i]);
    r.max_abs_err = std::max(r.max_abs_err, e);
    r.max_rel_err = std::max(r.max_rel_err, e / (std::fabs(ref[i]) + 1.0));
  }
  return r;
}

void print_table(const Args& a, const std::string& how, const std::vector<RankResult>& rs) {
  std::printf("# epmoe_run: %s, world=%zu, E=%d k=%d hidden=%d ffn=%d tokens/rank=%lld iters=%d routing=%s\n",
              how.c_str(), rs.size(), a.experts, a.top_k, a.hidden, a.ffn, (long long)a.tokens, a.iters,
              a.routing.c_str());
  std::printf("%5s %8s %9s %9s %9s %8s | %8s %8s %8s %8s %8s %8s | %10s %10s\n", "rank", "tokens", "rows_sent",
              "rows_recv", "pairs", "disp_MB", "layout", "exch", "dispatch", "experts", "combine", "reduce",
              "max_abs", "max_rel");
  double worst = 0;
  for (size_t i = 0; i < rs.size(); ++i) {
    const RankResult& r = rs[i];
    std::printf("%5zu %8.0f %9.0f %9.0f %9.0f %8.2f | %8.3f %8.3f %8.3f %8.3f %8.3f %8.3f | %10.3e %10.3e\n", i,
                r.tokens, r.rows_sent, r.rows_recv, r.pairs, r.dispatch_mb, r.layout_ms, r.exchange_ms,
                r.dispatch_ms, r.experts_ms, r.combine_ms, r.reduce_ms, r.max_abs_err, r.max_rel_err);
    worst = std::max(worst, r.max_rel_err);
  }
  // Tolerance: bf16 output and bf16 partial sums per destination rank: |err| <= 2^-5 (|ref| + 1).
  const double tol = 1.0 / 32;
  std::printf("# (times in ms, last iteration; rows are deduplicated tokens per destination rank)\n");
  std::printf("# max error vs dense reference: %.3e (tolerance %.3e): %s\n", worst, tol, worst <= tol ? "OK" : "FAIL");
  if (worst > tol) std::exit(1);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Args a = parse(argc, argv);
    const bool under_mpi = std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE");
    if (under_mpi && a.mock_ranks == 0) {
#if EPMOE_WITH_MPI
      MPI_Init(&argc, &argv);
      int me, W;
      MPI_Comm_rank(MPI_COMM_WORLD, &me);
      MPI_Comm_size(MPI_COMM_WORLD, &W);
      bool gpu = false;
#if EPMOE_WITH_NCCL
      int ndev = 0;
      if (a.device != "cpu" && cudaGetDeviceCount(&ndev) == cudaSuccess && ndev > 0) gpu = true;
#endif
      if (a.device == "cuda" && !gpu) EPMOE_FAIL(ErrorCode::unsupported, "--device cuda but no CUDA device/NCCL");
      std::shared_ptr<Communicator> comm;
#if EPMOE_WITH_NCCL
      if (gpu) comm = make_nccl_communicator_from_mpi(MPI_COMM_WORLD);
#endif
      if (!comm) comm = make_mpi_communicator(MPI_COMM_WORLD);
      RankResult r = run_rank(a, comm, gpu);
      std::vector<RankResult> all(W);
      MPI_Gather(&r, int(sizeof(RankResult) / sizeof(double)), MPI_DOUBLE, all.data(), int(sizeof(RankResult) / sizeof(double)), MPI_DOUBLE, 0,
                 MPI_COMM_WORLD);
      if (me == 0) print_table(a, gpu ? "NCCL on GPUs" : "MPI on CPU", all);
      comm.reset();
      MPI_Finalize();
      return 0;
#else
      EPMOE_FAIL(ErrorCode::unsupported, "launched by mpirun but this build has no MPI support");
#endif
    }
    const int n = std::max(1, a.mock_ranks);
    bool gpu = false;
#if EPMOE_WITH_NCCL
    int ndev = 0;
    if (n == 1 && a.device != "cpu" && cudaGetDeviceCount(&ndev) == cudaSuccess && ndev > 0) gpu = true;
#endif
    if (a.device == "cuda" && !gpu) EPMOE_FAIL(ErrorCode::unsupported, "--device cuda needs one rank, a GPU and NCCL");
    std::vector<RankResult> all(n);
    if (gpu) {
#if EPMOE_WITH_NCCL
      all[0] = run_rank(a, make_nccl_communicator_single(), true);
#endif
    } else {
      auto errors = run_mock_ranks(n, [&](int rank, std::shared_ptr<Communicator> comm) {
        all[rank] = run_rank(a, comm, false);
      });
      for (int r = 0; r < n; ++r)
        if (errors[r]) std::rethrow_exception(errors[r]);
    }
    print_table(a, gpu ? "1 GPU (NCCL, world 1)" : "CPU mock ranks", all);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epmoe_run: %s\n", e.what());
    return 2;
  }
}
