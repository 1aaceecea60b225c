// What every benchmark shares on the host, with no CUDA or MPI (epmoe_bench_scaling also builds on
// CPU-only machines): the counter-based random numbers that let any rank regenerate any expert, the
// softmax top-k routing of the torch baselines, the sampled-token check against reference_moe, and
// small formatting helpers. bench_common.h adds the device buffers and the MPI helpers.
//
// Normal draws are Irwin-Hall sums of four 16-bit uniforms (mean 0, variance 1, |z| <= 3.47): close
// enough to N(0,1) for timing and cheap enough to draw 11 G weights per shape in seconds.
#pragma once
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "epmoe/bf16.h"
#include "epmoe/error.h"
#include "epmoe/moe_layer.h"
#include "epmoe/reference.h"

namespace epmoe::bench {

struct Shape {
  int E = 0, k = 0, hidden = 0, ffn = 0;
  int64_t tokens = 0;  // per rank
};

// "E,k,hidden,ffn,T" -> s; false when the text is anything else (trailing characters too).
inline bool scan_shape(const std::string& text, Shape& s) {
  long long t = 0;
  char tail = 0;
  if (std::sscanf(text.c_str(), "%d,%d,%d,%d,%lld%c", &s.E, &s.k, &s.hidden, &s.ffn, &t, &tail) != 5) return false;
  s.tokens = t;
  return true;
}
inline bool valid_shape(const Shape& s, int64_t min_tokens) {
  return s.E > 0 && s.k > 0 && s.k <= s.E && s.hidden > 0 && s.ffn > 0 && s.tokens >= min_tokens;
}

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


// ---- the CPU check of sampled tokens ------------------------------------------------------------

struct CheckResult {
  int tokens = 0;
  double max_abs = 0, err2 = 0, ref2 = 0;
};

// x[T, hidden], ids / wts[T, k], y[T, hidden]: one rank's forward. Regenerates, per sampled token
// (n spread evenly over T), the k experts it routes to (generate_expert with w1_std / w2_std) and runs
// reference_moe on that token once per slot (one expert each, in parallel), summing the slots.
inline CheckResult check_sampled(uint64_t seed, const Shape& s, const bf16* x, const int32_t* ids, const float* wts,
                                 const bf16* y, int n, float w1_std, float w2_std) {
  CheckResult r;
  const int64_t T = s.tokens;
  n = int(std::min<int64_t>(n, T));
  if (n <= 0) return r;
  const size_t n1 = size_t(2) * s.ffn * s.hidden, n2 = size_t(s.hidden) * s.ffn;
  std::vector<bf16> w1c(n1 * s.k), w2c(n2 * s.k);
  std::vector<int32_t> idc(s.k);
  std::vector<float> part(size_t(s.k) * s.hidden);
  for (int i = 0; i < n; ++i) {
    const int64_t t = (2 * int64_t(i) + 1) * T / (2 * int64_t(n));
    for (int j = 0; j < s.k; ++j) {
      const int e = ids[size_t(t) * s.k + j];
      idc[j] = e < 0 ? -1 : j;
      if (e >= 0) generate_expert(seed, s, e, w1c.data() + j * n1, w2c.data() + j * n2, w1_std, w2_std);
    }
    // One thread per slot: slot j's weighted expert output, then the sum over slots.
    std::vector<std::thread> pool;
    for (int j = 0; j < s.k; ++j)
      pool.emplace_back([&, j] {
        const int32_t id = idc[j] < 0 ? -1 : 0;
        epmoe::reference_moe(x + size_t(t) * s.hidden, &id, wts + size_t(t) * s.k + j, 1, 1, w1c.data() + j * n1,
                             w2c.data() + j * n2, 1, s.hidden, s.ffn, part.data() + size_t(j) * s.hidden);
      });
    for (auto& th : pool) th.join();
    for (int h = 0; h < s.hidden; ++h) {
      double want = 0;
      for (int j = 0; j < s.k; ++j) want += double(part[size_t(j) * s.hidden + h]);
      const double got = double(y[size_t(t) * s.hidden + h].f());
      const double d = std::isfinite(got) ? std::fabs(got - want) : INFINITY;
      r.max_abs = std::max(r.max_abs, d);
      r.err2 += d * d;
      r.ref2 += want * want;
    }
    ++r.tokens;
  }
  return r;
}

// ---- small helpers -------------------------------------------------------------------------------

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
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

}  // namespace epmoe::bench
