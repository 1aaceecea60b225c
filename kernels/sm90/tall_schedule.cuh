// The 192-row kernels' schedule (down_tall_kernel.cu, up_tall_kernel.cu): the per-expert tall tiles
// over the unchanged 128-padded layout (tall_tile_count / tall_tile_rows in schedule.cuh), the
// shared-memory schedule, the by-expert item decode and the item hand-off slot.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/sm90/core/ptx.cuh"
#include "kernels/sm90/schedule.cuh"
#include "kernels/sm90/tile_config.h"
#include "kernels/sm90/work_items.cuh"

namespace epmoe::kernels::sm90 {

// Item hand-off slot (producer -> consumers, per stage): {first row / 64, column block | (rows in the
// segment / 64) << 28 | gap << 30}; gap (the 192-row UP): the 64 rows after this tile are the
// segment's padding that no tile covers, which the consumers zero.
inline constexpr int kTallRowsShift = 28, kTallGapBit = 30;
__host__ __device__ constexpr int tall_slot_rows(int y) { return ((y >> kTallRowsShift) & 3) * 64; }
__host__ __device__ constexpr int tall_slot_block(int y) { return y & ((1 << kTallRowsShift) - 1); }
#if EPMOE_SM90A_DEVICE
struct TallItem {
  bool valid;
  int64_t m0;  // first row of the tile
  int nb;      // column block
  int e;       // expert
  int rows;    // rows of the tile inside the expert's segment: 64, 128 or 192
  int gap;     // rows of the segment after its last tile that no tile covers (0 or 64; last tile only)
};
// Warp 0 fills item_off[0..E] (exclusive prefix of the experts' items) and seg64[0..E] (segment
// starts / 64), then a CTA barrier. Reads padded_offsets and pair_row (layout outputs, complete
// before the UP grid started: safe before griddepcontrol.wait). Only the experts the split rule sends
// here get items (SplitRule over the rule's split_ctas and nn column blocks, as the 128-row half
// counts them: its tall items are this kernel's, tall tiles x nn).
__device__ __forceinline__ void build_tall_schedule(const int64_t* __restrict__ padded_offsets,
                                                    const int32_t* __restrict__ pair_row, int experts, int nn,
                                                    int32_t* item_off, int32_t* seg64, int split_ctas) {
  if (threadIdx.x < 32) {
    const SplitRule rule{pair_row, nn, split_ctas};
    const int cut = warp_split_tall_cut(padded_offsets, experts, rule);
    warp_item_prefix(experts, item_off, [&](int e) {
      seg64[e] = int32_t(padded_offsets[e] / 64);
      const SplitExpert x = e < cut ? split_expert(padded_offsets, pair_row, e, nn) : SplitExpert{false, 0, 0};
      return int32_t(x.picked ? x.tall_items : 0);
    });
    if (threadIdx.x == 0) seg64[experts] = int32_t(padded_offsets[experts] / 64);
  }
  __syncthreads();
}
__device__ __forceinline__ TallItem tall_item(int64_t w, const int32_t* item_off, const int32_t* seg64, int experts,
                                              int nn, int group) {
  TallItem t{};
  t.valid = w < item_off[experts];
  if (!t.valid) return t;
  t.e = expert_of_item(item_off, experts, int(w));
  const int tiles = (item_off[t.e + 1] - item_off[t.e]) / nn;
  const ScheduledItem s = expert_item(int(w) - item_off[t.e], 0, tiles, nn, group, false, 0u);
  const int64_t seg = int64_t(seg64[t.e]) * 64;
  t.m0 = seg + int64_t(kTallRows) * s.tile;
  t.nb = s.nb;
  const int64_t seg_rows = int64_t(seg64[t.e + 1]) * 64 - seg;
  t.rows = tall_tile_rows(seg_rows, s.tile);
  // Past the last tile: seg_rows - covered, a multiple of 64 below 128 (the dropped or unpicked tile
  // starts in the padding, and a 128-padded segment holds < 128 padding rows), so 0 or 64.
  t.gap = s.tile == tiles - 1 ? int(seg_rows - int64_t(kTallRows) * s.tile - t.rows) : 0;
  return t;
}
// zero_gap: the 192-row UP (its consumers zero the uncovered rows); DOWN reads no gap.
__device__ __forceinline__ int2 tall_slot(const TallItem& t, bool zero_gap) {
  return make_int2(int(t.m0 >> 6), t.nb | ((t.rows / 64) << kTallRowsShift) | (zero_gap && t.gap > 0 ? 1 << kTallGapBit : 0));
}
#endif

}  // namespace epmoe::kernels::sm90
