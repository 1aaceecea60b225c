// The FP8 kernels' arguments (swap_mx_kernel.cu: MX swap-AB form; fused_mx_kernel.cu: MX fused form;
// tile_mx_kernel.cu: MX tile form; tile_fp8b_kernel.cu: block-128 tile form), how their launchers fill
// them from an MxExpertProblem, and the tile forms' work item.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "epmoe/mxfp8.h"
#include "kernels/sm90/swap_items.cuh"
#include "kernels/sm90/swap_mx.cuh"

namespace epmoe::kernels::sm90 {

struct MxArgs {
  const int64_t* padded_offsets;
  int experts, hidden, ffn;
  const uint8_t* src;  // UP: x (packed rows pair_row[r]); DOWN: act (packed rows r)
  int64_t src_rows, src_row_bytes;
  const uint8_t* w_scale;  // UP: w1_scale; DOWN: w2_scale
  const int32_t* pair_row;
  const float* pair_weight;
  uint8_t* act;  // UP
  int64_t act_row_bytes;
  __nv_bfloat16* out;  // DOWN
  int64_t out_rows;
  __nv_bfloat16* zero_out;  // UP, optional
  int64_t zero_chunks;
  const uint8_t* w2_scale;  // the fused pipeline's DOWN (its w_scale is UP's)
  float* out_acc;           // the fused pipeline's fp32 split-K accumulator [out_rows, hidden]
};

inline MxArgs make_mx_args(const MxExpertProblem& p, bool up) {
  MxArgs a{};
  a.padded_offsets = p.padded_offsets;
  a.experts = p.experts, a.hidden = p.hidden, a.ffn = p.ffn;
  a.src = up ? p.x : p.act;
  a.src_rows = up ? p.x_rows : p.rows_capacity;
  a.src_row_bytes = fp8_packed_row_bytes(p.scales, up ? p.hidden : p.ffn);
  a.w_scale = up ? p.w1_scale : p.w2_scale;
  a.pair_row = p.pair_row, a.pair_weight = p.pair_weight;
  a.act = p.act, a.act_row_bytes = fp8_packed_row_bytes(p.scales, p.ffn);
  a.out = p.out, a.out_rows = p.out_rows;
  a.zero_out = up && p.zero_out ? p.out : nullptr;
  a.zero_chunks = up && p.zero_out ? p.out_rows * int64_t(p.hidden) / 8 : 0;
  a.w2_scale = p.w2_scale;
  a.out_acc = p.out_acc;
  return a;
}

#if EPMOE_SM90A_DEVICE
// The tile forms' work item (tile_mx_kernel.cu, tile_fp8b_kernel.cu): item w of `blocks` weight
// blocks per 128-row tile, tile-major.
struct MxTileItem {
  int64_t m0;  // first row of the tile
  int j;       // weight block
  int e;       // expert
  int rows;    // its real rows (the segment's prefix)
};
// Whole warp (ballots).
__device__ __forceinline__ MxTileItem mx_tile_item(const MxArgs& a, int64_t w, int blocks) {
  MxTileItem it;
  const int64_t t = w / blocks;
  it.j = int(w - t * blocks);
  it.m0 = t * kBM;
  it.e = expert_of_tile(a.padded_offsets, a.experts, it.m0);
  it.rows = count_real_rows<kBM>(a.pair_row, it.m0);
  return it;
}
#endif

}  // namespace epmoe::kernels::sm90
