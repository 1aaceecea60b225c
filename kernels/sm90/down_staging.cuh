// DOWN's staged epilogue pieces shared by the 128-row kernel (down_kernel.cu) and the 192-row one
// (down_tall_kernel.cu): a consumer warpgroup's weighted bf16 halves (64 rows x 128 columns)
// packed from its accumulators and stored to shared memory with stmatrix, in the row layout the
// reducer warps read back (row r's 16-byte chunk j at r * 256 + ((j ^ (r % 8)) << 4)).
#pragma once
#include <cstdint>

#include "kernels/sm90/core/ptx.cuh"

namespace epmoe::kernels::sm90 {
#if EPMOE_SM90A_DEVICE
// Staged epilogue: a consumer warpgroup writes its 64 rows x 128 columns (one half of the item's 256)
// of weighted bf16 into its staging buffer with stmatrix (8 per thread, no shuffles) and goes on; the
// reducer warps (warps 1..3 of the producer warpgroup, idle otherwise) read each row back and reduce
// it into out with 16-byte red.global.add - a half warp covers one row's 256 contiguous bytes. Row r's
// 16-byte chunk j sits at r*256 + (j ^ (r % 8))*16, so both the 8-row stmatrix phases and the row reads
// are free of bank conflicts. The 128-row kernel's handshake per warpgroup c: staged[c] (128 consumer
// arrivals) and drained[c] (32 * kReducerWarps arrivals: every reducer lane), one phase per half; its held half is
// stored at k step num_k / 2 of the next item, so the reducers get about half an item for each half
// (storing it at step 2 often waited on drained).
// The 32 packed words of one half (8 column-group pairs x {rows 0-7, 8-15} x 2 groups), weighted.
__device__ __forceinline__ void pack_half(uint32_t (&v)[32], const float (&acc)[128], int half, float w0, float w1) {
#pragma unroll
  for (int gp = 0; gp < 8; ++gp) {  // column-group pairs (g, g + 1) of this half
    const int g = 16 * half + 2 * gp;
    v[4 * gp + 0] = pack_bf16x2(w0 * acc[4 * g + 0], w0 * acc[4 * g + 1]);              // rows 0-7, group g
    v[4 * gp + 1] = pack_bf16x2(w1 * acc[4 * g + 2], w1 * acc[4 * g + 3]);              // rows 8-15, group g
    v[4 * gp + 2] = pack_bf16x2(w0 * acc[4 * (g + 1) + 0], w0 * acc[4 * (g + 1) + 1]);  // rows 0-7, g + 1
    v[4 * gp + 3] = pack_bf16x2(w1 * acc[4 * (g + 1) + 2], w1 * acc[4 * (g + 1) + 3]);  // rows 8-15, g + 1
  }
}
// stmatrix of a packed half into the warpgroup's staging buffer (lane l: row l%8 (+8), pair half l/16).
__device__ __forceinline__ void store_half(uint32_t stg, const uint32_t (&v)[32], int warp, int lane) {
  const int mi = lane >> 3, rr = lane & 7;
  const uint32_t row_addr = stg + uint32_t(16 * warp + rr + 8 * (mi & 1)) * 256u;
#pragma unroll
  for (int gp = 0; gp < 8; ++gp) {
    const uint32_t w[4] = {v[4 * gp], v[4 * gp + 1], v[4 * gp + 2], v[4 * gp + 3]};
    const int chunk = 2 * gp + (mi >> 1);
    stmatrix_x4(row_addr + (uint32_t(chunk ^ rr) << 4), w);
  }
}
// pack_half then store_half, four words at a time: the 192-row kernel's consumers hold 192
// accumulators and have no room for a whole packed half (8 bytes of spills at 232 registers).
template <int N>
__device__ __forceinline__ void pack_store_half(uint32_t stg, const float (&acc)[N], int half, float w0, float w1,
                                                int warp, int lane) {
  static_assert(N == 64 || N == 128, "an m64n128 or m64n256 fragment");
  const int mi = lane >> 3, rr = lane & 7;
  const uint32_t row_addr = stg + uint32_t(16 * warp + rr + 8 * (mi & 1)) * 256u;
#pragma unroll
  for (int gp = 0; gp < 8; ++gp) {
    const int g = 16 * half + 2 * gp;
    const uint32_t w[4] = {pack_bf16x2(w0 * acc[4 * g + 0], w0 * acc[4 * g + 1]),
                           pack_bf16x2(w1 * acc[4 * g + 2], w1 * acc[4 * g + 3]),
                           pack_bf16x2(w0 * acc[4 * (g + 1) + 0], w0 * acc[4 * (g + 1) + 1]),
                           pack_bf16x2(w1 * acc[4 * (g + 1) + 2], w1 * acc[4 * (g + 1) + 3])};
    stmatrix_x4(row_addr + (uint32_t((2 * gp + (mi >> 1)) ^ rr) << 4), w);
  }
}
// Where a reducer lane reads row r's 16-byte chunk j of a staged half.
__device__ __forceinline__ uint32_t staged_half_offset(int r, int j) { return uint32_t(r) * 256u + (uint32_t(j ^ (r & 7)) << 4); }
#endif
}  // namespace epmoe::kernels::sm90
