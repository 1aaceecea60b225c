// The FP8 tile forms' shared pieces (tile_mx_kernel.cu: MX scales per k32 block; tile_fp8b_kernel.cu:
// block-128 scales per stage): the same 128-row token tile x 128 weight rows per stage, the same
// weight boxes, source rows and epilogue fragment walks; only the scales and their promotion differ.
#pragma once
#include <cstdint>

#include "kernels/sm90/core/ptx.cuh"
#include "kernels/sm90/mx_common.cuh"
#include "kernels/sm90/swap_items.cuh"
#include "kernels/sm90/tile_config.h"
#include "kernels/sm90/up_common.cuh"

namespace epmoe::kernels::sm90 {

#if EPMOE_SM90A_DEVICE
// The source row of the item's tile row r (UP: the pair's token row in x; DOWN: the act row itself),
// -1 past the tile's real rows.
template <bool kUp>
__device__ __forceinline__ int32_t tile_src_row(const MxArgs& a, const MxTileItem& it, int r) {
  return r >= it.rows ? int32_t(-1) : kUp ? a.pair_row[it.m0 + r] : int32_t(it.m0 + r);
}

// One stage's weight tile (thread 0): UP the 64-column act block j64 as two boxes of the e4m3 swap
// map (32 act columns each: gate rows and their up partners interleaved), DOWN W2 rows
// [128 j, +128).
template <bool kUp>
__device__ __forceinline__ void load_tile_weights(uint32_t dst, const CUtensorMap* tm, uint32_t full, int kt, int e,
                                                  int j) {
  mbar_arrive_expect_tx(full, kMxTileATileBytes);
  if constexpr (kUp) {
    tma_load_4d(dst, tm, full, kt * kMxBK, 0, 2 * e, 4 * (2 * j));
    tma_load_4d(dst + kMxTileATileBytes / 2, tm, full, kt * kMxBK, 0, 2 * e, 4 * (2 * j + 1));
  } else {
    tma_load_3d(dst, tm, full, kt * kMxBK, kMxTileWeightRows * j, e);
  }
}

// The consumer fragment of an m64n128 wgmma over weight rows (M) x tokens (N): element 4 g + 2 h + b
// is weight row 16 wl + lane / 4 + 8 h, token 8 g + 2 (lane % 4) + b; in UP rows h = 0 are gate
// rows and h = 1 their up partners (the swap map's interleave).

// UP epilogue: silu(gate) * up of the fragment into fp32 staging rows [128 tokens][stride] at act
// column col.
template <int kStride>
__device__ __forceinline__ void stage_tile_swiglu(uint32_t stg, int col, const float (&acc)[64], int lane) {
#pragma unroll
  for (int g = 0; g < 16; ++g)
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const int t = 8 * g + 2 * (lane & 3) + b;
      st_shared_f32(stg + uint32_t(t * kStride + col) * 4u, silu_tanh(acc[4 * g + b]) * acc[4 * g + 2 + b]);
    }
}

// DOWN epilogue: the fragment times each token's routing weight (0 past the real rows) into bf16
// staging rows [128 tokens][kMxTileDownStride], warpgroup c's 64 output columns.
__device__ __forceinline__ void stage_tile_weighted(uint32_t stg, const MxArgs& a, const MxTileItem& it,
                                                    const float (&acc)[64], int c, int wl, int lane) {
#pragma unroll
  for (int g = 0; g < 16; ++g)
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const int t = 8 * g + 2 * (lane & 3) + b;
      const float wt = t < it.rows ? a.pair_weight[it.m0 + t] : 0.0f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int f = 64 * c + 16 * wl + (lane >> 2) + 8 * h;
        st_shared_bf16(stg + uint32_t(t * kMxTileDownStride + f) * 2u, wt * acc[4 * g + 2 * h + b]);
      }
    }
}
#endif  // EPMOE_SM90A_DEVICE

}  // namespace epmoe::kernels::sm90
