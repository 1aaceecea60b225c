// Shared test helpers: deterministic data, routing generators and the tolerance check.
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "epmoe/bf16.h"

namespace epmoe::test {

// Counter-based hash: the same (seed, a, b, c) gives the same value on every rank and thread.
uint64_t mix(uint64_t seed, uint64_t a, uint64_t b = 0, uint64_t c = 0);
float uniform01(uint64_t h);  // (0, 1)
float normal(uint64_t h);     // ~N(0, 1)

// x on `rank`: x[t, c] is a function of (seed, rank, t, c), so a receiver can recompute any row it
// got and check its origin exactly.
bf16 x_value(uint64_t seed, int rank, int64_t token, int col);
std::vector<bf16> make_x(uint64_t seed, int rank, int64_t T, int hidden);
std::vector<bf16> random_bf16(size_t n, uint64_t seed, float scale);

// A quantized layer's dispatch sends each row as the packed quantization of its source token's x
// (make_x(x_seed, source rank, T, hidden)): how many of the received `rows` (row_bytes each, in
// source-rank order, per_rank[s] from rank s; meta holds 1 + 2 * top_k int32 per row, the token
// first) differ from quantize_row(x row) byte for byte.
using QuantizeRow = std::function<void(const bf16* row, int hidden, uint8_t* packed)>;
int64_t count_mismatched_rows(const void* rows, const int32_t* meta, const std::vector<int64_t>& per_rank,
                              int top_k, uint64_t x_seed, int64_t T, int hidden, int64_t row_bytes,
                              const QuantizeRow& quantize_row);

enum class RoutingKind {
  uniform,      // k distinct experts uniformly at random
  zipf,         // k distinct experts, P(e) ~ 1/(e+1)^1.2: a few hot experts, a long cold tail
  one_expert,   // every token's first slot is expert `focus`, other slots -1
  with_drops,   // uniform with ~25% of slots -1 and every 7th token all -1
  all_dropped,  // every slot -1
  local_only,   // min(k, E_local) distinct experts of rank `focus`, other slots -1 (other ranks idle)
};
const char* routing_name(RoutingKind k);
struct Routing {
  std::vector<int32_t> ids;   // [T, k]
  std::vector<float> weights; // [T, k], rows sum to 1 over kept slots
};
Routing make_routing(int64_t T, int E, int k, RoutingKind kind, uint64_t seed, int focus = 0, int world = 1);

// One gtest failure per mock rank that threw (run_mock_ranks' results), naming `what` and the rank.
void report_rank_errors(const std::vector<std::exception_ptr>& errors, const std::string& what);

// All experts' weights, deterministic from a seed; scaled so activations and outputs are O(1).
struct ModelWeights {
  int E = 0, hidden = 0, ffn = 0;
  std::vector<bf16> w1;  // [E, 2*ffn, hidden]
  std::vector<bf16> w2;  // [E, hidden, ffn]
  const bf16* w1_of(int e) const { return w1.data() + size_t(e) * 2 * ffn * hidden; }
  const bf16* w2_of(int e) const { return w2.data() + size_t(e) * hidden * ffn; }
};
ModelWeights make_weights(int E, int hidden, int ffn, uint64_t seed);

// y (bf16) against the fp32 reference: every element within rel_elem*|ref| + rel_rms*rms(ref), and
// ||y - ref|| / ||ref|| <= rel_l2. NaN/Inf always fail. Reports the worst element.
struct Tolerance {
  double rel_elem = 0.0;
  double rel_rms = 0.0;
  double rel_l2 = 0.0;
};
::testing::AssertionResult close_to_reference(const bf16* y, const float* ref, int64_t T, int hidden,
                                              const Tolerance& tol);
void expect_close_to_reference(const bf16* y, const float* ref, int64_t T, int hidden, const Tolerance& tol);

// CPU path tolerance. Both sides round the activation to bf16 identically (up to rare 1-ulp
// flips when fp32 and fp64 sums straddle a rounding boundary). The EP path then rounds each
// destination rank's partial row to bf16 (2^-9 of the partial's magnitude, and partials may be
// several times larger than their sum when they cancel) and the final sum once more: elementwise
// 2^-6 relative plus 2^-6 of the output RMS, and 4e-3 in relative L2 norm (measured: ~2.4e-3).
inline constexpr Tolerance kCpuTolerance{1.0 / 64, 1.0 / 64, 4e-3};

// This process's resident memory (/proc/self/statm), or -1 where it cannot be read: the soaks'
// flatness check.
int64_t resident_bytes();

// One row of the reliability matrix (issue 49): the case, what it must do, what this run saw. Printed
// as "[matrix] case | expected | observed" on stdout; launch/reliability_matrix.py collects the rows
// from ctest's JUnit output (gpu_check's summary prints them). Call it after the checks that back
// `observed`, from the test's thread.
void matrix_row(const std::string& name, const std::string& expected, const std::string& observed);
// printf into a string (a matrix row's fields), cut at 511 characters.
template <class... A>
std::string strprintf(const char* f, A... a) {
  char buf[512];
  std::snprintf(buf, sizeof buf, f, a...);
  return buf;
}

}  // namespace epmoe::test
