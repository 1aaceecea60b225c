// The 192-row kernels' schedule (sm90_down_tall_kernel.cu, sm90_up_tall_kernel.cu): tile sizes, the
// per-expert tall tiles over the unchanged 128-padded layout (tall_tile_count / tall_tile_rows in
// sm90_schedule.cuh), the shared-memory schedule and the by-expert item decode.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/sm90_common.cuh"
#include "kernels/sm90_schedule.cuh"
#include "kernels/sm90_wgmma_n.cuh"
#include "kernels/sm90_work_items.cuh"

namespace epmoe::kernels::sm90 {

inline constexpr int kTallRows = 192;  // = tall_tile_count / tall_tile_rows' tile (sm90_schedule.cuh)
inline constexpr uint32_t kTallATileBytes = kTallRows * kBK * 2;  // 24 KB
inline constexpr uint32_t kTallStageBytes = kTallATileBytes + kBTileBytes;
inline constexpr uint32_t kTallProducerRegs = 40, kTallConsumerRegs = 232;
static_assert(setmaxnreg_split_fits(kTallProducerRegs, kTallConsumerRegs), "the consumers would wait forever in setmaxnreg.inc");
static_assert(kTallATileBytes % 1024 == 0, "the B stages after the A stages must keep 1024 B alignment");
// Dynamic shared memory: alignment slack, a ring of `stages` tall stages, `extra` bytes after it (the
// 192-row DOWN's staging buffer), then the schedule (item_off and seg64, E + 1 each).
inline size_t tall_smem_bytes(int experts, int stages = kStages, size_t extra = 0) {
  return 1024 + size_t(stages) * kTallStageBytes + extra +
         (size_t(2) * (size_t(experts) + 1) * sizeof(int32_t) + 15) / 16 * 16;
}
// Item hand-off slot (producer -> consumers, per stage): {first row / 64, column block | (rows in the
// segment / 64) << 28 | gap << 30}; gap (the 192-row UP with EPMOE_SM90_UP_ZERO_GAP=on): the 64 rows
// after this tile are the segment's padding that no tile covers, which the consumers zero.
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
// before the UP grid started: safe before griddepcontrol.wait). split_ctas (the split UP's 192-row
// half; 0: none): only the experts the split rule sends here get items (SplitRule over nn = ffn / 128
// column blocks, as the 128-row half counts them).
__device__ __forceinline__ void build_tall_schedule(const int64_t* __restrict__ padded_offsets,
                                                    const int32_t* __restrict__ pair_row, int experts, int nn,
                                                    int32_t* item_off, int32_t* seg64, int split_ctas = 0) {
  if (threadIdx.x < 32) {
    const SplitRule rule{pair_row, nn, split_ctas};
    const int cut = split_ctas > 0 ? warp_split_tall_cut(padded_offsets, experts, rule) : 0;
    warp_item_prefix(experts, item_off, [&](int e) {
      const int64_t seg = padded_offsets[e], p = padded_offsets[e + 1] - seg;
      seg64[e] = int32_t(seg / 64);
      if (split_ctas > 0) {  // (the rule's tall items are this kernel's: tall tiles x nn)
        const SplitExpert x = e < cut ? split_expert(padded_offsets, pair_row, e, nn) : SplitExpert{false, 0, 0};
        return int32_t(x.picked ? x.tall_items : 0);
      }
      return int32_t(tall_tile_count(p, tall_last_starts_in_padding(pair_row, seg, p)) * nn);
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
// One ring stage of the 192 x 256 tile for a consumer warpgroup, between the caller's wgmma_fence
// and wgmma_commit: m64n256 on its own 64 rows (A descriptor da, B db) and m64n128 on the tile's rows
// [128, 192) against its half of the B box (dx, dbx), over the stage's kBK / 16 k slices.
__device__ __forceinline__ void tall_stage_mma(float (&acc)[128], float (&acc2)[64], uint32_t da, uint32_t dx,
                                               uint32_t db, uint32_t dbx) {
#pragma unroll
  for (int kk = 0; kk < kBK / 16; ++kk) {
    wgmma_m64n256k16_bf16(acc, smem_desc_sw128_join(da + 2 * kk), smem_desc_sw128_join(db + 2 * kk), 1);
    WgmmaN<128>::run(acc2, smem_desc_sw128_join(dx + 2 * kk), smem_desc_sw128_join(dbx + 2 * kk));
  }
}
// A consumer warpgroup's descriptors of the tall tile (stage 0; a stage adds its offset): its own 64
// rows of A, the tile's extra rows [128, 192) and its half of the B box as fixed offsets from them.
struct TallDescs {
  uint32_t da0, db0, dx_off, dbx_off;
};
__device__ __forceinline__ TallDescs tall_descs(uint32_t sA, uint32_t sB, int c) {
  return {smem_desc_sw128_lo(sA + uint32_t(c) * 64 * 128), smem_desc_sw128_lo(sB),
          (128u * 128u - uint32_t(c) * 64u * 128u) >> 4, (uint32_t(c) * 128u * 128u) >> 4};
}
// One k step on ring stage s: wgmma fence, tall_stage_mma, commit (the caller waits and releases).
__device__ __forceinline__ void tall_k_step(float (&acc)[128], float (&acc2)[64], const TallDescs& d, uint32_t s) {
  const uint32_t da = d.da0 + s * (kTallATileBytes >> 4), db = d.db0 + s * (kBTileBytes >> 4);
  wgmma_fence();
  tall_stage_mma(acc, acc2, da, da + d.dx_off, db, db + d.dbx_off);
  wgmma_commit();
}
__device__ __forceinline__ int2 tall_slot(const TallItem& t, bool zero_gap = false) {
  return make_int2(int(t.m0 >> 6), t.nb | ((t.rows / 64) << kTallRowsShift) | (zero_gap && t.gap > 0 ? 1 << kTallGapBit : 0));
}
#endif

}  // namespace epmoe::kernels::sm90
