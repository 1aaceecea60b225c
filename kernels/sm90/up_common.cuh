// Pieces shared by the UP kernels (up_kernel.cu, up_pair_kernel.cu, up_tall_kernel.cu): the W1 box
// loads of a ring stage, SwiGLU of a consumer warpgroup's accumulators, and the stores of act (and of
// h, for a saving forward).
//   act[r, c] = bf16(silu(g) * u): g a gate column, u its up partner, at the same fragment position
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/sm90/core/ptx.cuh"

namespace epmoe::kernels::sm90 {
#if EPMOE_SM90A_DEVICE

// The 128-row UP's W1 loads of one stage (kBTileBytes into dst, completing on `full`): 128 gate rows
// [128j, +128) of expert e, then their 128 up partners [ffn + 128j, +128) - so each gate column and
// its up partner land in the same thread's accumulators and SwiGLU happens in registers (seed 000,
// Trick 1). One folded rank-4 box, or (the fallback where the driver rejects the folded strides) the
// plain map's two boxes; in a multicasting cluster pair only this CTA's half (rank 0 gate, rank 1 up),
// which also lands in the peer.
__device__ __forceinline__ void load_w1_stage(const CUtensorMap* tm_w1, uint32_t full, uint32_t dst, int k0, int e,
                                              int j, int ffn, bool w1_folded, bool multicast, uint32_t rank) {
  if (multicast) {
    tma_load_3d_multicast(dst + rank * (kBTileBytes / 2), tm_w1, full, k0, rank != 0 ? ffn + 128 * j : 128 * j, e,
                          uint16_t(0x3));
  } else if (w1_folded) {
    tma_load_4d(dst, tm_w1, full, k0, 128 * j, 0, e);
  } else {
    tma_load_3d(dst, tm_w1, full, k0, 128 * j, e);
    tma_load_3d(dst + kBTileBytes / 2, tm_w1, full, k0, ffn + 128 * j, e);
  }
}

// silu(x) = x * sigmoid(x) with ONE MUFU op and three FP32 ops: sigmoid(x) = (1 + tanh(x/2)) / 2, so
// silu(x) = h + h tanh(h), h = x/2. The epilogue runs with the tensor cores idle (64 elements per
// thread per item), where MUFU ops (a quarter of the FP32 rate) and issue slots both count: this form
// beat ex2 + rcp by 0.8-2.6% of the layer. Accuracy: absolute |x| 2^-18 at worst on the H200 (the
// PTX ISA promises tanh.approx to 2^-11; Sm90Experts.SiluAccuracy asserts |x| 2^-14).
__device__ __forceinline__ float tanh_approx(float x) {
  float r;
  asm("tanh.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ float silu_tanh(float x) {
  const float h = 0.5f * x;
  return fmaf(h, tanh_approx(h), h);
}

// Word j = bf16x2(silu(gate[2j]) * up[2j], silu(gate[2j+1]) * up[2j+1]).
template <int W>
__device__ __forceinline__ void swiglu_words(uint32_t (&w)[W], const float* gate, const float* up) {
#pragma unroll
  for (int j = 0; j < W; ++j)
    w[j] = pack_bf16x2(silu_tanh(gate[2 * j]) * up[2 * j], silu_tanh(gate[2 * j + 1]) * up[2 * j + 1]);
}

// The 128-row tiles' staged store of consumer warpgroup c's 64 x 128 bf16 words (fragment order):
// stmatrix into its two 64x64 staging boxes at stg (the TMA's 128B-swizzled layout), then one thread
// stores them with TMA to rows [m0 + 64c, +64), columns [col0, +128) of tm's matrix and the warpgroup
// goes on under the store; the boxes are rewritten only after that store has read them (checked at
// the next store, so no wait in practice between items). Named barriers 1 + c. plane >= 0: tm is the
// rank-3 preact map and the boxes go to its half `plane`. Columns past the map's end are dropped.
__device__ __forceinline__ void store_words_staged(const CUtensorMap* tm, uint32_t stg, const uint32_t (&words)[32],
                                                   int c, int warp, int lane, int64_t m0, int col0, int plane = -1) {
  if ((threadIdx.x & 127) == 0) bulk_wait_read_all();
  named_barrier_sync(1 + c, 128);
  const int mi = lane >> 3, rr = lane & 7;
  const uint32_t row_off = uint32_t(16 * warp + rr + 8 * (mi & 1)) * 128u;
#pragma unroll
  for (int gp = 0; gp < 8; ++gp) {  // gate-group pairs (2gp, 2gp + 1): words 4gp .. 4gp + 3
    const uint32_t v[4] = {words[4 * gp], words[4 * gp + 1], words[4 * gp + 2], words[4 * gp + 3]};
    const int chunk = 2 * gp + (mi >> 1);  // 8-column group of the 128: box chunk / 8, column chunk % 8
    stmatrix_x4(stg + uint32_t(chunk >> 3) * 8192u + row_off + (uint32_t((chunk & 7) ^ rr) << 4), v);
  }
  fence_proxy_async_shared();  // the stmatrix writes, before the TMA (async proxy) reads them
  named_barrier_sync(1 + c, 128);
  if ((threadIdx.x & 127) == 0) {
    const int row = int(m0) + 64 * c;
    if (plane < 0) {
      tma_store_2d(tm, stg, col0, row);
      tma_store_2d(tm, stg + 8192u, col0 + 64, row);
    } else {
      tma_store_3d(tm, stg, col0, plane, row);
      tma_store_3d(tm, stg + 8192u, col0 + 64, plane, row);
    }
    bulk_commit();
  }
}
// act columns [128 nb, +128).
__device__ __forceinline__ void store_act_staged(const CUtensorMap* tm_act, uint32_t stg, const uint32_t (&words)[32],
                                                 int c, int warp, int lane, int64_t m0, int nb) {
  store_words_staged(tm_act, stg, words, c, warp, lane, m0, 128 * nb);
}

// What a saving forward keeps for backward (ExpertProblem::preact): h = [g | u] in bf16, the gate
// columns [128 nb, +128) and their up partners [ffn + 128 nb, +128) of warpgroup c's 64 rows, from
// the same fp32 accumulators act came from, through the same staging boxes after act (tm_h:
// make_preact_map). Rows at padding hold zeros (their accumulators stayed zero), as act's do.
__device__ __forceinline__ void store_preact_staged(const CUtensorMap* tm_h, uint32_t stg, const float* acc, int c,
                                                    int warp, int lane, int64_t m0, int nb) {
  uint32_t words[32];
#pragma unroll
  for (int half = 0; half < 2; ++half) {  // 0: gate (acc[0, 64)), 1: up (acc[64, 128))
#pragma unroll
    for (int j = 0; j < 32; ++j) words[j] = pack_bf16x2(acc[64 * half + 2 * j], acc[64 * half + 2 * j + 1]);
    store_words_staged(tm_h, stg, words, c, warp, lane, m0, 128 * nb, half);
  }
}

// The 192-row tiles' store of 32 gate values and their 32 up partners (one 64-column half of act for
// this thread's two rows) from registers: lane q of a quad gets 16 contiguous bytes per 32-column
// block by a quad transpose. Rows at or past `rows` (outside the segment) are not stored. All lanes.
// (The tall tile keeps 192 accumulators: no room for staging boxes beside its 4-deep ring.)
__device__ __forceinline__ void store_act_half(__nv_bfloat16* __restrict__ act, const float* gate, const float* up,
                                               int64_t m0, int r0, int rows, int ffn, int col0, int q) {
  uint32_t words[16];
  swiglu_words(words, gate, up);
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // rows r0 and r0 + 8
    const int r = r0 + 8 * h;
    __nv_bfloat16* dst = act + (m0 + r) * int64_t(ffn) + col0 + 8 * q;
#pragma unroll
    for (int gi = 0; gi < 2; ++gi) {  // 8-column groups 4gi .. 4gi+3 of the half's 8
      uint32_t wd[4];
#pragma unroll
      for (int t = 0; t < 4; ++t) wd[t] = words[2 * (4 * gi + t) + h];
      quad_transpose(wd, q);  // lane q: all 8 columns of group 4gi + q
      if (r < rows) st_global_16(dst + 32 * gi, wd);
    }
  }
}

// Zeroes act rows [r, r + 64) x columns [col, col + 128): the padding rows after an expert's last tall
// tile, which no tile covers. DOWN computes them and masks their output, so zeros change no result;
// left unwritten they would hold whatever an earlier call left (stale activations, or NaNs in a fresh
// workspace) - the 128-row UP writes every padding row as zeros, and so does this. Both consumer
// warpgroups, 4 coalesced 16-byte stores per thread (16 KB).
__device__ __forceinline__ void store_gap_zeros(__nv_bfloat16* __restrict__ act, int64_t r, int ffn, int col) {
  const int i = int(threadIdx.x) - 128;  // 0..255
  const uint32_t zero[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int chunk = i + 256 * j;  // 16 chunks of 8 columns per row
    st_global_16(act + (r + (chunk >> 4)) * int64_t(ffn) + col + 8 * (chunk & 15), zero);
  }
}

#endif  // EPMOE_SM90A_DEVICE
}  // namespace epmoe::kernels::sm90
