// Test harness of the sm_90a split pipeline suite (test_sm90_experts.cu): device buffers, the device
// gate, routings, one case run end to end against the dense reference (run_case; the checks are
// listed in sm90_case.cu), and the helpers the case tables use.
#pragma once
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "epmoe/bf16.h"
#include "epmoe/sm90_plan.h"
#include "kernels/cuda_check.cuh"
#include "kernels/expert_problem.cuh"
#include "kernels/hash_fill.cuh"
#include "kernels/heuristics/sm90_heuristics.h"

namespace sm90_case {

using epmoe::bf16;
using epmoe::kernels::ExpertProblem;
using epmoe::kernels::kExpertTile;

// ---- deterministic data (identical on host and device): kernels/hash_fill.cuh ------------------
using epmoe::kernels::hash_fill::fill_hash_kernel;
using epmoe::kernels::hash_fill::hash_bf16;
using epmoe::kernels::hash_fill::mix64;

template <class T>
struct DevBuf {
  T* p = nullptr;
  size_t n = 0;
  explicit DevBuf(size_t count) : n(count) {
    if (n) EPMOE_CUDA_CHECK(cudaMalloc(&p, n * sizeof(T)));
  }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  size_t bytes() const { return n * sizeof(T); }
  void upload(const std::vector<T>& h) {
    if (!h.empty()) EPMOE_CUDA_CHECK(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    EPMOE_CUDA_CHECK(cudaDeviceSynchronize());  // (a pageable upload may still be in flight: device_array.h)
  }
  std::vector<T> download(size_t first = 0, size_t count = SIZE_MAX) const {
    count = std::min(count, n - first);
    std::vector<T> h(count);
    if (count) EPMOE_CUDA_CHECK(cudaMemcpy(h.data(), p + first, count * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

// 0: run; 1: skip (message); 2: fail (message).
int device_state(std::string& msg);

#define REQUIRE_SM90()                           \
  do {                                           \
    std::string why_;                            \
    const int st_ = device_state(why_);          \
    if (st_ == 1) GTEST_SKIP() << why_;          \
    if (st_ == 2) FAIL() << why_;                \
  } while (0)

// The H200 (132 SMs, 60 MiB of L2): the device the case tables are written for, and the one whose
// plans the catalog and the variants' CPU-side checks resolve (gtest parameters exist before any
// device is known).
inline constexpr epmoe::kernels::Sm90Device kH200{132, int64_t(60) << 20};

// ---- routing, one case ----------------------------------------------------------------------------
// tile_edges: expert e gets kTileEdgeCounts[e % 8] rows (k = 1; T = their sum over the experts, more
// tokens are dropped): segments that end exactly at, just past and just before the 64-row warpgroup
// halves and the 128-row tiles.
enum class Route { uniform, zipf, one_expert, single_rows, with_drops, all_dropped, tile_edges };
inline constexpr int kTileEdgeCounts[8] = {64, 65, 1, 128, 129, 63, 192, 193};

enum class Mode { experts_launch, separate_no_pdl, graph };

struct Case {
  int E, k, hidden, ffn;
  int64_t T;
  Route route;
  int64_t extra_capacity;  // rows_capacity = padded_total + extra (tiles past the total must exit)
  int ref_tokens;          // tokens checked against reference_moe
  Mode mode = Mode::experts_launch;
  uint64_t seed = 1;
  // true: ExpertProblem::zero_out - the UP kernel zeroes out (no memset; out stays poisoned otherwise).
  bool zero_out = false;
  // rows_capacity at least this (the catalog cases: the capacity of the catalog's shape).
  int64_t min_capacity = 0;
  // true: ExpertProblem::preact - UP also stores h = [g | u] (a saving forward), checked like act.
  bool keep_preact = false;
};

// What a case's layout gives the split rule, on the host (the UP always gathers from x; no test
// selects a kernel but through the plan): the shape the heuristics read, and - when the plan splits
// that kernel - the experts the HOST rule (split_tall_cut, schedule.cuh) sends to the 192-row half:
// UP over ffn / 128 column blocks, DOWN over ceil(hidden / 256), both with the plan's split_ctas
// (-1: the plan does not split that kernel). The device runs the same rule (warp_split_tall_cut,
// checked against this one by Sm90Schedule.DeviceSplitCutMatchesHost).
struct CaseStats {
  epmoe::kernels::Sm90Shape shape;
  epmoe::Sm90Plan plan;  // (run_case: the plan it ran; case_stats: the plan given)
  int up_tall_experts = -1;
  int down_tall_experts = -1;
};
// Routing and layout on the host only (no device needed): the case's shape, and the split counts
// for `plan`.
CaseStats case_stats(const Case& cs, const epmoe::Sm90Plan& plan);
epmoe::kernels::Sm90Shape case_shape(const Case& cs);

// Runs one case (layout on the host, pipeline on the device) with the default plan for its shape
// and `plan` on top (sm90_plan_for), and checks it; gtest failures on mismatch.
void run_case(const Case& cs, const epmoe::Sm90PlanOverride& plan = {}, CaseStats* stats = nullptr);

inline Case zero_in_up(Case c) {
  c.zero_out = true;
  return c;
}
inline Case keeping_preact(Case c) {
  c.keep_preact = true;
  return c;
}
inline Case with(Case c, int seed, Mode mode = Mode::experts_launch) {
  c.seed = uint64_t(seed);
  c.mode = mode;
  return c;
}
}  // namespace sm90_case
