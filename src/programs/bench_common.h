// What the MPI benchmarks (epmoe_bench_ep, epmoe_bench_train) share: the counter-based random
// numbers that let any rank regenerate any expert, the softmax top-k routing of the torch baselines,
// device buffers and the expert weight set, and the small MPI / JSON helpers.
//
// Normal draws are Irwin-Hall sums of four 16-bit uniforms (mean 0, variance 1, |z| <= 3.47): close
// enough to N(0,1) for timing and cheap enough to draw 11 G weights per shape in seconds.
#pragma once
#include <cuda_runtime.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "epmoe/bf16.h"
#include "epmoe/error.h"
#include "epmoe/moe_layer.h"
#include "kernels/cuda_check.cuh"

#define BENCH_CUDA(call) EPMOE_CUDA_CHECK(call)

namespace epmoe::bench {

struct Shape {
  int E = 0, k = 0, hidden = 0, ffn = 0;
  int64_t tokens = 0;  // per rank
};

// ---- deterministic random numbers ---------------------------------------------------------------

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
// Element i of the stream `key` (splitmix64 at state key + (i+1) * golden): random access.
inline uint64_t hash_at(uint64_t key, uint64_t i) { return mix64(key + (i + 1) * kGolden); }

// ~N(0, 1): Irwin-Hall sum of four 16-bit uniforms, centred, scaled to variance 1.
inline float normal_at(uint64_t key, uint64_t i) {
  const uint64_t h = hash_at(key, i);
  const int32_t s = int32_t(h & 0xffff) + int32_t((h >> 16) & 0xffff) + int32_t((h >> 32) & 0xffff) +
                    int32_t(h >> 48) - 131070;
  return float(s) * 2.6428556e-5f;  // sqrt(3) / 65536
}

enum Tag : uint64_t { kTagW1 = 1, kTagW2 = 2, kTagX = 3, kTagLogits = 4, kTagDy = 5 };

inline uint64_t stream_key(uint64_t seed, Tag tag, uint64_t a, uint64_t b) {
  return mix64(mix64(mix64(seed * kGolden + tag) + a) ^ (b * 0xD1B54A32D192ED03ull));
}

inline int g_threads = 1;  // host threads per rank for generation

// f(begin, end) over [0, n) on g_threads threads (one for small n).
template <class F>
void parallel_for(int64_t n, const F& f) {
  const int nt = n < (int64_t(1) << 16) ? 1 : g_threads;
  if (nt <= 1) {
    f(int64_t(0), n);
    return;
  }
  std::vector<std::thread> pool;
  const int64_t chunk = (n + nt - 1) / nt;
  for (int t = 0; t < nt; ++t) {
    const int64_t b = t * chunk, e = std::min(n, b + chunk);
    if (b >= e) break;
    pool.emplace_back([&f, b, e] { f(b, e); });
  }
  for (auto& th : pool) th.join();
}

inline void fill_normal_bf16(bf16* dst, int64_t n, uint64_t key, float scale) {
  parallel_for(n, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) dst[i] = bf16(scale * normal_at(key, uint64_t(i)));
  });
}

// Global expert `expert`'s weights, identical on every rank: w1[2*ffn, hidden], w2[hidden, ffn],
// each std * N(0,1).
inline void generate_expert(uint64_t seed, const Shape& s, int expert, bf16* w1, bf16* w2, float w1_std,
                            float w2_std) {
  const uint64_t dims = (uint64_t(uint32_t(s.hidden)) << 32) | uint32_t(s.ffn);
  fill_normal_bf16(w1, int64_t(2) * s.ffn * s.hidden, stream_key(seed, kTagW1, uint64_t(expert), dims), w1_std);
  fill_normal_bf16(w2, int64_t(s.hidden) * s.ffn, stream_key(seed, kTagW2, uint64_t(expert), dims), w2_std);
}

// softmax(N(0,1) logits of stream `logits_key`) -> top-k -> renormalise -> bf16, per token, into
// ids[T, k] and wts[T, k] (the torch baselines' routing).
inline void route_softmax_topk(uint64_t logits_key, int64_t T, int E, int k, int32_t* ids, float* wts) {
  parallel_for(T * E, [&](int64_t b, int64_t e) {
    std::vector<float> prob(static_cast<size_t>(E), 0.f);
    std::vector<int> order(static_cast<size_t>(E));
    for (int64_t t = b / E; t < T && t * E < e; ++t) {
      if (t * E < b) continue;  // token owned by the previous chunk
      float mx = -INFINITY;
      for (int j = 0; j < E; ++j) {
        prob[j] = normal_at(logits_key, uint64_t(t * E + j));
        mx = std::max(mx, prob[j]);
      }
      float sum = 0.f;
      for (int j = 0; j < E; ++j) sum += (prob[j] = std::exp(prob[j] - mx));
      for (int j = 0; j < E; ++j) prob[j] /= sum;
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int a, int c) {
        return prob[a] > prob[c] || (prob[a] == prob[c] && a < c);
      });
      float top = 0.f;
      for (int j = 0; j < k; ++j) top += prob[order[j]];
      for (int j = 0; j < k; ++j) {
        ids[size_t(t) * k + j] = order[j];
        wts[size_t(t) * k + j] = epmoe::round_bf16(prob[order[j]] / top);
      }
    }
  });
}

// ---- device memory -------------------------------------------------------------------------------

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes_) BENCH_CUDA(cudaMalloc(&ptr_, bytes_));
  }
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr, o.bytes_ = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      if (ptr_) cudaFree(ptr_);
      ptr_ = o.ptr_, bytes_ = o.bytes_;
      o.ptr_ = nullptr, o.bytes_ = 0;
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// This rank's slice of the experts, kept across shapes with the same (E, hidden, ffn).
struct WeightSet {
  int E = 0, hidden = 0, ffn = 0;
  DeviceBuffer w1, w2;
  bool matches(const Shape& s) const { return E == s.E && hidden == s.hidden && ffn == s.ffn; }
};

inline void upload_weights(WeightSet& ws, uint64_t seed, const Shape& s, int rank, int world, float w1_std,
                           float w2_std) {
  ws = WeightSet{};  // free the previous set first
  const int el = s.E / world;
  const size_t n1 = size_t(2) * s.ffn * s.hidden, n2 = size_t(s.hidden) * s.ffn;
  ws.w1 = DeviceBuffer(size_t(el) * n1 * sizeof(bf16));
  ws.w2 = DeviceBuffer(size_t(el) * n2 * sizeof(bf16));
  std::vector<bf16> h1(n1), h2(n2);
  for (int le = 0; le < el; ++le) {
    generate_expert(seed, s, rank * el + le, h1.data(), h2.data(), w1_std, w2_std);
    BENCH_CUDA(cudaMemcpy(static_cast<char*>(ws.w1.get()) + size_t(le) * n1 * sizeof(bf16), h1.data(),
                          n1 * sizeof(bf16), cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaMemcpy(static_cast<char*>(ws.w2.get()) + size_t(le) * n2 * sizeof(bf16), h2.data(),
                          n2 * sizeof(bf16), cudaMemcpyHostToDevice));
  }
  ws.E = s.E, ws.hidden = s.hidden, ws.ffn = s.ffn;
}

// ---- small helpers -------------------------------------------------------------------------------
// (Overloads of one name stay together here: a program's own overload would hide these.)

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

inline double allreduce_max(double v) {
  double r = 0;
  MPI_Allreduce(&v, &r, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return r;
}
inline double allreduce_sum(double v) {
  double r = 0;
  MPI_Allreduce(&v, &r, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  return r;
}
inline int64_t allreduce_sum(int64_t v) {
  int64_t r = 0;
  MPI_Allreduce(&v, &r, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  return r;
}
inline int64_t allreduce_max(int64_t v) {
  int64_t r = 0;
  MPI_Allreduce(&v, &r, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
  return r;
}
inline int allreduce_min(int v) {
  int r = 0;
  MPI_Allreduce(&v, &r, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return r;
}

inline std::string json_num(double v) {
  if (!std::isfinite(v)) return "null";
  char b[64];
  std::snprintf(b, sizeof b, "%.6g", v);
  return b;
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// --path / --wgrad values: auto | sm90 | cublas.
inline ExpertPath parse_expert_path(const char* flag, const std::string& v) {
  if (v == "auto") return ExpertPath::automatic;
  if (v == "sm90") return ExpertPath::sm90;
  if (v == "cublas") return ExpertPath::cublas;
  EPMOE_FAIL(ErrorCode::invalid_argument, flag, " must be auto, sm90 or cublas (got '", v, "')");
}

// main() of an MPI benchmark: MPI around run(argc, argv); an exception on any rank prints and aborts
// the job (its peers may be waiting in a collective).
inline int mpi_bench_main(int argc, char** argv, const char* name, int (*run)(int, char**)) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int rc = 0;
  try {
    rc = run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[%s] rank %d: error: %s\n", name, rank, e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  MPI_Finalize();
  return rc;
}

}  // namespace epmoe::bench
