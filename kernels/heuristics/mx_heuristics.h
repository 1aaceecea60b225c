// The heuristics tier's rule for the MXFP8 layer's kernel form (kernels/sm90/swap_mx.cuh), plain C++
// (its golden rows in tests/test_sm90_heuristics.cpp run without CUDA).
#pragma once
#include <cstdint>

namespace epmoe::kernels {

// The swap-AB form streams an expert's weights once per 64-row half tile that has rows; the tile form
// once per 128-row tile, but computes (and promotes) all 128 token columns of a tile whatever its real
// rows. So swap-AB while the experts' segments are short, the tile form from a mean of 64 real rows
// per expert (where a segment's second half starts to cost swap-AB a second pass over the weights).
// First rule from that count, before a measured crossover (issue 50: epmoe_bench_mxfp8 both forms).
inline constexpr int64_t kMxTileMeanRows = 64;

inline bool mx_tile_form_pays(int64_t pairs, int experts) {
  return experts > 0 && pairs >= kMxTileMeanRows * int64_t(experts);
}

}  // namespace epmoe::kernels
