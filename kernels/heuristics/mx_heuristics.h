// The heuristics tier's rule for the FP8 layers' kernel form (kernels/sm90/swap_mx.cuh), plain C++
// (its golden rows in tests/test_mx_heuristics.cpp run without CUDA).
#pragma once
#include <cstdint>
#include <optional>

namespace epmoe::kernels {

// The kernels' form: swap-AB (weights in M, a half tile's real rows in N = 8 ... 64; decode), the
// fused pipeline in that form (fused_mx_kernel.cu: UP, act requantized in shared memory, DOWN into an
// fp32 accumulator, one grid + the bf16 write-out; act never goes through HBM), or the tile form
// (tile_mx_kernel.cu / tile_fp8b_kernel.cu: whole 128-row tiles against 128 weight rows; large T).
enum class MxForm : uint8_t { swap, tile, fused };

// The swap-AB form streams an expert's weights once per 64-row half tile that has rows; the tile form
// once per 128-row tile, but computes (and promotes) all 128 token columns of a tile whatever its real
// rows. So swap-AB while the experts' segments are short, the tile form from a mean of 64 real rows
// per expert (where a segment's second half starts to cost swap-AB a second pass over the weights).
// First rule from that count, before a measured crossover (issue 50: epmoe_bench_mxfp8 both forms).
inline constexpr int64_t kMxTileMeanRows = 64;

inline bool mx_tile_form_pays(int64_t pairs, int experts) {
  return experts > 0 && pairs >= kMxTileMeanRows * int64_t(experts);
}

// The fused pipeline saves the split form's second launch, its PDL hand-over and act's round trip
// through HBM, and pays ffn / 32 fp32 reductions per pair and output element (the split DOWN: one bf16
// reduction per pair) plus the write-out pass over out. So fused while the pairs are few: at most one
// per kMxFusedExpertsPerPair local experts. Measured (epmoe_bench_mxfp8 on an H200, 7b970aa; fused /
// split swap-AB time): E=32 k=4 2048/1024 T=1 0.88, T=2 0.94 | T=4 1.03, T=8 1.11; E=128 k=8 2048/768
// T=1 0.94, T=2 0.91, T=4 0.98 | T=8 1.05, T=16 1.10 - the crossover sits between a quarter and a half
// pair per expert at both shapes.
inline constexpr int64_t kMxFusedExpertsPerPair = 4;

inline bool mx_fused_form_pays(int64_t pairs, int experts) {
  return experts > 0 && pairs > 0 && pairs * kMxFusedExpertsPerPair <= int64_t(experts);
}

// The MX (per-32) layer's form for `pairs` routed pairs over `experts` local experts, the caller's
// overrides on top (Sm90PlanOverride's swap=on|off and fused=on|off): fused=on asks for the fused form
// (built in the swap-AB form), swap=off for the tile form, swap=on for a split swap-AB form unless
// fused=on; an unset field leaves the rule's choice where the set ones allow it. The FP8 block-128
// layer has the tile form only.
inline MxForm choose_mx_form(int64_t pairs, int experts, std::optional<bool> swap, std::optional<bool> fused) {
  if (fused.value_or(false)) return MxForm::fused;
  if (swap.has_value()) return *swap ? MxForm::swap : MxForm::tile;
  if (mx_tile_form_pays(pairs, experts)) return MxForm::tile;
  if (!fused.has_value() && mx_fused_form_pays(pairs, experts)) return MxForm::fused;
  return MxForm::swap;
}

}  // namespace epmoe::kernels
