// The heuristics tier of the sm_90a expert kernels (host C++, no CUDA): a shape and a device in, an
// Sm90Plan out (epmoe/sm90_plan.h), as DeepGEMM keeps its heuristics apart from kernels and API.
// Every default rule of the kernels lives here; tests/test_sm90_heuristics.cpp holds its golden
// table. The measurements behind each rule: docs/DECISIONS.md.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "epmoe/sm90_plan.h"

namespace epmoe::kernels {

// What the rules read of a problem: this rank's experts, the dims and the rows the layout may fill
// (a bound the host knows before the counts, as the engine sizes its buffers).
struct Sm90Shape {
  int experts = 0;
  int hidden = 0;
  int ffn = 0;
  int64_t rows_capacity = 0;
  // The real (row, expert) pairs, or a bound of them; 0: unknown (never swap-AB). Set only where the
  // same value reaches every launch that must match (a saving forward and its recomputing backward
  // leave it 0, so both run the same kernels and the same h bits).
  int64_t pairs = 0;
};
// What they read of the device.
struct Sm90Device {
  int sms = 0;
  int64_t l2_bytes = 0;
};

// Thresholds of the rules.
// 2-CTA weight multicast (W1 in the 128-row UP's cluster form, W2 in DOWN) pays where the weights
// stream from DRAM more than once per wave: hidden >= 4096 with >= 1024 rows per expert.
inline constexpr int kClusterMinHidden = 4096;
inline constexpr int64_t kClusterMinRowsPerExpert = 1024;
// The by-expert order pays where an expert's weights are large (its decode costs more than the bytes
// it saves at hidden 2048).
inline constexpr int kOrderByExpertMinHidden = 4096;
// Padding halves pay while L2 holds what one wave of CTAs streams: a quarter of L2 at most.
inline constexpr int kPadHalvesL2Fraction = 4;

// Swap-AB (weights in M, tokens in N) where the 128-row UP would have at most SMs / kSwapAbSmsDivisor
// items (tiles x ffn / 128), i.e. leave most SMs without a weight stream: the swap kernels run 64
// weight rows per item. Tiles bound: min(rows_capacity / 128, min(E, pairs) + pairs / 128) - a
// segment of c rows takes ceil(c / 128) tiles.
inline constexpr int kSwapAbSmsDivisor = 2;
// The fused swap-AB pipeline (Sm90Plan::fused) is never a default: measured against the split swap-AB
// kernels it ties at T <= 8 (0.99-1.02) and loses above (fp32 split-K reductions, ffn / 32 per pair
// and column; tests/test_sm90_heuristics.cpp FusedRuleFollowsTheMeasuredCrossover). Override only.
// The tiles a layout of `pairs` pairs over the shape's experts can use, at most.
int64_t sm90_tiles_bound(const Sm90Shape& s);

// A row count for checking a plan where only the shape's dims matter (check_sm90_plan reads
// rows_capacity only to require it positive).
inline constexpr int64_t kExpertRowsForChecks = 128;

// Today's default rules as code.
Sm90Plan choose_sm90_plan(const Sm90Shape& s, const Sm90Device& d);
// Throws Error(invalid_argument) naming the field when the kernels cannot run `p` for `s` (pairs
// with ffn % 256 != 0, a by-expert schedule too large for shared memory, a split without the
// by-expert order, padding halves on clusters, ...).
void check_sm90_plan(const Sm90Plan& p, const Sm90Shape& s);
// choose_sm90_plan, the caller's override on top (fields it leaves unset drop a default that the
// set ones rule out: padding halves off clusters and pairs, no split without the by-expert order),
// then check_sm90_plan.
Sm90Plan resolve_sm90_plan(const Sm90Shape& s, const Sm90Device& d, const Sm90PlanOverride& o = {});
// Every field of `p` set: forces p as a whole.
Sm90PlanOverride full_override(const Sm90Plan& p);

// The pieces of the rules that the launchers reuse.
// Whether the by-expert schedule of E experts fits beside a 128-row kernel's ring and `staging`.
bool sm90_by_expert_fits(int experts, size_t staging);
// Work items (cluster mode: cluster items) a 128-row kernel is sized for: an upper bound of what the
// device schedule counts, over `tiles` capacity row tiles and `blocks` column blocks.
int64_t sm90_work_items(int64_t tiles, int experts, int blocks, bool cluster, bool by_expert);
// The padding-halves rule: the weight bytes one wave of `grid` CTAs streams - grid / partners
// distinct 256-row slices of K x 2 bytes, partners = the tiles per expert, at most a scheduling group
// - fit in 1 / kPadHalvesL2Fraction of L2 (a half item then leads or trails its partners on the same
// weight stream at no DRAM cost).
bool sm90_pad_halves_pay(int64_t tiles, int experts, int k_dim, int64_t grid, int group, int64_t l2_bytes);

// One shape per distinct plan that choose_sm90_plan returns over a sweep of shapes (E 1..256,
// hidden 256..7168, ffn 256..2048, 1..4096 rows per expert), the smallest problem for each: what
// the GPU suite runs so that every plan the rules can pick is tested. The swap-AB plans, whose other
// fields select nothing, count as one.
std::vector<std::pair<Sm90Shape, Sm90Plan>> sm90_plan_catalog(const Sm90Device& d);

}  // namespace epmoe::kernels
