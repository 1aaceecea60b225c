// Gathered A operand of the sm_90a kernel core: an A tile of a ring stage copied row by row from a
// token-ordered matrix x[x_rows, K] (row r of the tile = x[pair_row[...]], zeros for padding) with
// 16-byte cp.async, in the 128B-swizzled K-major layout a TMA box would write, so the MMA reads it
// like any TMA tile (after a proxy fence: cp.async writes through the generic proxy).
//
// Why not TMA: the rows are scattered, and the TMA engine is far too slow per row request for a row
// gather; cp.async from every producer thread keeps up. Gathering in the kernel removes the separate
// gather's write and re-read of the whole expert-sorted copy (rows x K x 2 B each way).
//
// Thread mapping (kThreads producer threads, kChunks 16-byte chunks of each 128-byte row slice per
// thread, kRows rows per thread): C = 8 / kChunks threads share a row; thread t takes chunks cg + C j
// (cg = t % C, j < kChunks) of tile rows rg + R i (rg = t / C, i < kRows, R = kThreads / C). R is a
// multiple of 8, so all rows of a thread share one swizzle phase (rg % 8), and a warp instruction
// covers whole 32-byte sectors of several rows. Chunks at or past K (a multiple of 8, not
// necessarily of 64) are zero-filled, as TMA fills the weights' out-of-bounds columns, so a last
// partial k step adds zeros. The kernels pick the mapping for their registers:
//   128-row UP:   RowGather<128, 1, 8>  (16 rows per instruction, 8 row pointers per thread)
//   pair UP:      RowGather<64, 1, 8>   (each CTA gathers 64 rows of the shared tile)
//   192-row UP:   RowGather<128, 4, 3>  (3 row pointers: the producer fits 56 registers)
//   swap-AB:      RowGather<128, 1, 8>  (the B tile: a tile's first N rows only, copy_below)
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/sm90/core/ptx.cuh"

namespace epmoe::kernels::sm90 {
#if EPMOE_SM90A_DEVICE

// The source rows of one item for one thread: bit i of `valid` says row i is real (else zeros).
template <int kRows>
struct GatherRows {
  const __nv_bfloat16* src[kRows];
  uint32_t valid;
};

template <int kThreads, int kChunks, int kRows>
struct RowGather {
  static constexpr int C = 8 / kChunks;    // threads per 128-byte row slice
  static constexpr int R = kThreads / C;   // rows between a thread's rows
  static_assert(8 % kChunks == 0 && kThreads % C == 0 && R % 8 == 0, "rows of a thread must share a swizzle phase");
  int cg, rg;
  int k_dim;      // row length: chunks at or past it are zero-filled (K % 64 != 0: the last k step)
  uint32_t base;  // this thread's first row (and, with one chunk, its chunk) in a stage's A tile

  __device__ __forceinline__ RowGather(uint32_t sA, int t, int k) : cg(t % C), rg(t / C), k_dim(k) {
    base = sA + uint32_t(rg) * 128u + (kChunks == 1 ? (uint32_t(cg ^ (rg & 7)) << 4) : 0u);
  }
  // Tile row of this thread's row i.
  __device__ __forceinline__ int row(int i) const { return rg + R * i; }
  // The item's rows: pair_row_of(i) is the x row of this thread's row i, or < 0 for a zero row.
  template <class RowOf>
  __device__ __forceinline__ GatherRows<kRows> rows(const __nv_bfloat16* __restrict__ x, int64_t x_rows, int k_dim,
                                                   RowOf&& pair_row_of) const {
    GatherRows<kRows> g;
    g.valid = 0;
    const __nv_bfloat16* xc = x + 8 * cg;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int32_t r = pair_row_of(i);
      const bool ok = r >= 0 && int64_t(r) < x_rows;
      g.src[i] = xc + (ok ? int64_t(r) * k_dim : 0);
      g.valid |= ok ? (1u << i) : 0u;
    }
    return g;
  }
  // Copies this thread's first n rows (n <= kRows, a compile-time count) of k step kt into the stage
  // whose A tile starts `stage_off` bytes after the ring's (plus `row_off` bytes: a sub-tile).
  template <int N = kRows>
  __device__ __forceinline__ void copy(const GatherRows<kRows>& g, uint32_t stage_off, int kt) const {
    static_assert(N <= kRows, "more rows than the thread holds");
    const uint32_t dst = base + stage_off;
    const uint32_t phase = uint32_t(rg & 7);
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        const uint32_t chunk = kChunks == 1 ? 0u : ((uint32_t(cg + C * j) ^ phase) << 4);
        const int col = kt * kBK + 8 * (cg + C * j);
        cp_async_16_zfill(dst + uint32_t(R * i) * 128u + chunk, g.src[i] + kt * kBK + 8 * C * j,
                          ((g.valid >> i) & 1u) && col < k_dim ? 16u : 0u);
      }
  }
  // copy, but only of this thread's tile rows below n_rows (a run-time count): the swap-AB kernels'
  // B tile, whose MMA reads only its first N rows.
  __device__ __forceinline__ void copy_below(const GatherRows<kRows>& g, uint32_t stage_off, int kt, int n_rows) const {
    const uint32_t dst = base + stage_off;
    const uint32_t phase = uint32_t(rg & 7);
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      if (row(i) >= n_rows) break;
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        const uint32_t chunk = kChunks == 1 ? 0u : ((uint32_t(cg + C * j) ^ phase) << 4);
        const int col = kt * kBK + 8 * (cg + C * j);
        cp_async_16_zfill(dst + uint32_t(R * i) * 128u + chunk, g.src[i] + kt * kBK + 8 * C * j,
                          ((g.valid >> i) & 1u) && col < k_dim ? 16u : 0u);
      }
    }
  }
};

#endif  // EPMOE_SM90A_DEVICE
}  // namespace epmoe::kernels::sm90
