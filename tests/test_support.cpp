#include "test_support.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <sstream>

namespace epmoe::test {

uint64_t mix(uint64_t seed, uint64_t a, uint64_t b, uint64_t c) {
  uint64_t h = seed * 0x9E3779B97F4A7C15ull ^ (a + 0x632BE59BD9B4E019ull);
  for (uint64_t v : {b, c, a}) {
    h ^= v + 0xD6E8FEB86659FD93ull + (h << 6) + (h >> 2);
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDull;
    h ^= h >> 33;
    h *= 0xC4CEB9FE1A85EC53ull;
    h ^= h >> 33;
  }
  return h;
}

float uniform01(uint64_t h) { return (float((h >> 40) & 0xFFFFFF) + 0.5f) / 16777216.0f; }

float normal(uint64_t h) {
  const float u1 = uniform01(h), u2 = uniform01(h * 0x2545F4914F6CDD1Dull + 1);
  return std::sqrt(-2.0f * std::log(u1)) * std::cos(6.2831853f * u2);
}

bf16 x_value(uint64_t seed, int rank, int64_t token, int col) { return bf16(normal(mix(seed, rank, token, col))); }

std::vector<bf16> make_x(uint64_t seed, int rank, int64_t T, int hidden) {
  std::vector<bf16> x(size_t(T) * hidden);
  for (int64_t t = 0; t < T; ++t)
    for (int c = 0; c < hidden; ++c) x[size_t(t) * hidden + c] = x_value(seed, rank, t, c);
  return x;
}

int64_t count_mismatched_rows(const void* rows, const int32_t* meta, const std::vector<int64_t>& per_rank,
                              int top_k, uint64_t x_seed, int64_t T, int hidden, int64_t row_bytes,
                              const QuantizeRow& quantize_row) {
  std::vector<uint8_t> want(static_cast<size_t>(row_bytes));
  int64_t i = 0, bad = 0;
  for (int s = 0; s < static_cast<int>(per_rank.size()); ++s) {
    const std::vector<bf16> xs = make_x(x_seed, s, T, hidden);
    for (int64_t n = 0; n < per_rank[size_t(s)]; ++n, ++i) {
      const int32_t t = meta[i * (1 + 2 * top_k)];
      quantize_row(xs.data() + int64_t(t) * hidden, hidden, want.data());
      bad += std::memcmp(static_cast<const uint8_t*>(rows) + i * row_bytes, want.data(), size_t(row_bytes)) != 0;
    }
  }
  return bad;
}

std::vector<bf16> random_bf16(size_t n, uint64_t seed, float scale) {
  std::vector<bf16> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = bf16(scale * normal(mix(seed, i)));
  return v;
}

const char* routing_name(RoutingKind k) {
  switch (k) {
    case RoutingKind::uniform: return "uniform";
    case RoutingKind::zipf: return "zipf";
    case RoutingKind::one_expert: return "one_expert";
    case RoutingKind::with_drops: return "with_drops";
    case RoutingKind::all_dropped: return "all_dropped";
    case RoutingKind::local_only: return "local_only";
  }
  return "?";
}

Routing make_routing(int64_t T, int E, int k, RoutingKind kind, uint64_t seed, int focus, int world) {
  Routing R;
  R.ids.assign(size_t(T) * k, -1);
  R.weights.assign(size_t(T) * k, 0.f);
  std::vector<double> zipf_cdf;
  if (kind == RoutingKind::zipf) {
    zipf_cdf.resize(E);
    double s = 0;
    for (int e = 0; e < E; ++e) zipf_cdf[e] = (s += 1.0 / std::pow(e + 1.0, 1.2));
    for (double& v : zipf_cdf) v /= s;
  }
  const int El = E / std::max(world, 1);
  for (int64_t t = 0; t < T; ++t) {
    int32_t* row = &R.ids[size_t(t) * k];
    float* w = &R.weights[size_t(t) * k];
    uint64_t draw = 0;
    auto next = [&] { return uniform01(mix(seed, t, ++draw)); };
    // At most `pool` distinct experts exist for the kind: slots past that stay -1 (dropped).
    auto pick_distinct = [&](auto sample, int pool = 1 << 30) {
      for (int j = 0; j < std::min(k, pool); ++j) {
        int32_t e;
        do e = sample();
        while (std::find(row, row + j, e) != row + j);
        row[j] = e;
      }
    };
    switch (kind) {
      case RoutingKind::uniform:
      case RoutingKind::with_drops:
        pick_distinct([&] { return int32_t(std::min<float>(E - 1, next() * E)); });
        break;
      case RoutingKind::zipf:
        pick_distinct([&] {
          const double u = next();
          return int32_t(std::lower_bound(zipf_cdf.begin(), zipf_cdf.end(), u) - zipf_cdf.begin());
        });
        break;
      case RoutingKind::local_only:
        pick_distinct([&] { return int32_t(focus * El + std::min<float>(El - 1, next() * El)); }, El);
        break;
      case RoutingKind::one_expert: row[0] = focus; break;
      case RoutingKind::all_dropped: break;
    }
    if (kind == RoutingKind::with_drops) {
      for (int j = 0; j < k; ++j)
        if (next() < 0.25f || t % 7 == 3) row[j] = -1;
    }
    float s = 0;
    for (int j = 0; j < k; ++j)
      if (row[j] >= 0) s += (w[j] = 0.05f + next());
    for (int j = 0; j < k; ++j)
      if (row[j] >= 0) w[j] /= s;
  }
  return R;
}

ModelWeights make_weights(int E, int hidden, int ffn, uint64_t seed) {
  ModelWeights M;
  M.E = E;
  M.hidden = hidden;
  M.ffn = ffn;
  // 1/sqrt(fan_in) keeps gate/up O(1) and the output O(1) whatever the shape.
  M.w1 = random_bf16(size_t(E) * 2 * ffn * hidden, mix(seed, 1), 1.0f / std::sqrt(float(hidden)));
  M.w2 = random_bf16(size_t(E) * hidden * ffn, mix(seed, 2), 2.0f / std::sqrt(float(ffn)));
  return M;
}

::testing::AssertionResult close_to_reference(const bf16* y, const float* ref, int64_t T, int hidden,
                                              const Tolerance& tol) {
  const size_t n = size_t(T) * hidden;
  double ss_ref = 0, ss_err = 0;
  for (size_t i = 0; i < n; ++i) ss_ref += double(ref[i]) * ref[i];
  const double rms = n ? std::sqrt(ss_ref / n) : 0.0;
  size_t bad = 0, worst = 0;
  double worst_excess = -1;
  for (size_t i = 0; i < n; ++i) {
    const double v = y[i].f(), r = ref[i], err = std::fabs(v - r);
    ss_err += (v - r) * (v - r);
    const double allowed = tol.rel_elem * std::fabs(r) + tol.rel_rms * rms;
    if (!std::isfinite(v) || err > allowed) {
      ++bad;
      const double excess = std::isfinite(v) ? err - allowed : 1e300;
      if (excess > worst_excess) worst_excess = excess, worst = i;
    }
  }
  const double rel_l2 = ss_ref > 0 ? std::sqrt(ss_err / ss_ref) : std::sqrt(ss_err);
  std::ostringstream os;
  os << "T=" << T << " hidden=" << hidden << " rel_l2=" << rel_l2 << " (max " << tol.rel_l2 << "), rms(ref)=" << rms;
  if (bad) {
    os << ", " << bad << " elements out of tolerance; worst at [" << worst / hidden << ", " << worst % hidden
       << "]: got " << y[worst].f() << " want " << ref[worst];
    return ::testing::AssertionFailure() << os.str();
  }
  if (!(rel_l2 <= tol.rel_l2)) return ::testing::AssertionFailure() << os.str();
  return ::testing::AssertionSuccess() << os.str();
}

void expect_close_to_reference(const bf16* y, const float* ref, int64_t T, int hidden, const Tolerance& tol) {
  EXPECT_TRUE(close_to_reference(y, ref, T, hidden, tol));
}

void report_rank_errors(const std::vector<std::exception_ptr>& errors, const std::string& what) {
  for (size_t r = 0; r < errors.size(); ++r) {
    if (!errors[r]) continue;
    try {
      std::rethrow_exception(errors[r]);
    } catch (const std::exception& e) {
      ADD_FAILURE() << what << ": rank " << r << " threw: " << e.what();
    }
  }
}

int64_t resident_bytes() {
  long pages = 0, resident = 0;
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return -1;
  const int n = std::fscanf(f, "%ld %ld", &pages, &resident);
  std::fclose(f);
  return n == 2 ? int64_t(resident) * sysconf(_SC_PAGESIZE) : -1;
}

void matrix_row(const std::string& name, const std::string& expected, const std::string& observed) {
  auto field = [](std::string v) {  // one line, no column separators inside a field
    for (char& c : v)
      if (c == '|' || c == '\n' || c == '\r') c = c == '|' ? '/' : ' ';
    return v;
  };
  std::printf("[matrix] %s | %s | %s\n", field(name).c_str(), field(expected).c_str(), field(observed).c_str());
  std::fflush(stdout);
}

}  // namespace epmoe::test
