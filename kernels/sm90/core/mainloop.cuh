// The consumers' k loop of the sm_90a kernel core, and the MMA tiles it runs.
//
// A tile policy says what one consumer warpgroup computes from one ring stage (A rows, B rows, K = 64
// in four k16 slices) and how its accumulators and descriptors look:
//   Tile128: the 128-row tiles (UP, pair UP, DOWN) - warpgroup c: its 64 rows [64c, +64) of A against
//            all 256 rows of B (m64n256, 128 fp32 accumulators);
//   Tile192: the 192-row tiles (the split's tall halves) - the same, plus the tile's rows [128, 192)
//            against its half [128c, +128) of B (m64n128, 64 more).
// The expert kernels read K-major A and B (Tile128Of also takes MN-major ones, as the backward's
// weight-gradient GEMMs will) through 128B-swizzled descriptors (core/wgmma.cuh); the descriptors'
// low words stay in uniform registers (one UIADD3 per warp and k16 step), which needs every value they
// are built from to be provably warp-uniform (warp_uniform_*, pin_u32 in core/ptx.cuh).
//
// mainloop: the k loop over one item's num_k stages. The caller has waited for the item's first
// stage (to read the item's slot); each later stage is waited for, its MMAs issued, after_issue(kt)
// called (work placed there overlaps two queued groups of tensor work), and the previous stage
// released once its group is done: release(stage, kt of that stage). proxy_fence: the A rows came by
// cp.async (generic proxy), so wgmma's async-proxy reads need a fence after each wait.
#pragma once
#include <cstdint>

#include "kernels/sm90/core/ring.cuh"
#include "kernels/sm90/core/wgmma.cuh"

namespace epmoe::kernels::sm90 {
#if EPMOE_SM90A_DEVICE

template <int kTransA, int kTransB>
struct Tile128Of {
  static constexpr uint32_t kABytes = kATileBytes;  // per stage: A 128 x 64, B 256 x 64
  // K-major operands (TMA boxes of 64 K x rows): a k16 slice is 32 B further; MN-major (boxes of 64
  // MN x 64 K, 8 KB each, one per 64 rows / columns): two 8-k atoms further, and the leading offset
  // steps from one 64-element MN block to the next.
  static constexpr uint32_t kAStep = kTransA ? kMnMajorK16Step : kKMajorK16Step;
  static constexpr uint32_t kBStep = kTransB ? kMnMajorK16Step : kKMajorK16Step;
  struct Acc {
    float d[128];
  };
  struct Descs {
    uint32_t da0, db0;  // warpgroup c's A rows and B at stage 0 (descriptor low words)
  };
  static __device__ __forceinline__ uint32_t desc_lo(uint32_t saddr, bool mn_major) {
    return mn_major ? uint32_t(smem_desc_sw128_mn(saddr, kMnBlockBytes)) : smem_desc_sw128_lo(saddr);
  }
  // a_off: the byte offset of warpgroup c's 64 rows in the A tile (8 KB c in either majorness).
  static __device__ __forceinline__ Descs descs(uint32_t sA, uint32_t sB, uint32_t a_off) {
    return {desc_lo(sA + a_off, kTransA != 0), desc_lo(sB, kTransB != 0)};
  }
  static __device__ __forceinline__ void zero(Acc& a) {
#pragma unroll
    for (int i = 0; i < 128; ++i) a.d[i] = 0.0f;
  }
  static __device__ __forceinline__ void step(Acc& a, const Descs& d, uint32_t s) {
    const uint32_t da = d.da0 + s * (kABytes >> 4), db = d.db0 + s * (kBTileBytes >> 4);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk)
      Wgmma<256, kTransA, kTransB>::mma(a.d, smem_desc_sw128_join(da + kAStep * kk),
                                        smem_desc_sw128_join(db + kBStep * kk));
    wgmma_commit();
  }
  static __device__ __forceinline__ void fence(Acc& a) { fence_regs(a.d); }
};
// The expert kernels' tile: A and B K-major.
using Tile128 = Tile128Of<0, 0>;

struct Tile192 {
  static constexpr uint32_t kABytes = kTallATileBytes;  // per stage: A 192 x 64, B 256 x 64
  struct Acc {
    float d[128];  // rows [64c, +64) x B rows [0, 256)
    float x[64];   // rows [128, 192) x B rows [128c, +128)
  };
  struct Descs {
    uint32_t da0, db0, dx_off, dbx_off;  // the extra rows and the B half as offsets from da / db
  };
  static __device__ __forceinline__ Descs descs(uint32_t sA, uint32_t sB, int c) {
    return {smem_desc_sw128_lo(sA + uint32_t(c) * 64 * 128), smem_desc_sw128_lo(sB),
            (128u * 128u - uint32_t(c) * 64u * 128u) >> 4, (uint32_t(c) * 128u * 128u) >> 4};
  }
  static __device__ __forceinline__ void zero(Acc& a) {
#pragma unroll
    for (int i = 0; i < 128; ++i) a.d[i] = 0.0f;
#pragma unroll
    for (int i = 0; i < 64; ++i) a.x[i] = 0.0f;
  }
  static __device__ __forceinline__ void step(Acc& a, const Descs& d, uint32_t s) {
    const uint32_t da = d.da0 + s * (kABytes >> 4), db = d.db0 + s * (kBTileBytes >> 4);
    const uint32_t dx = da + d.dx_off, dbx = db + d.dbx_off;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      Wgmma<256>::mma(a.d, smem_desc_sw128_join(da + 2 * kk), smem_desc_sw128_join(db + 2 * kk));
      Wgmma<128>::mma(a.x, smem_desc_sw128_join(dx + 2 * kk), smem_desc_sw128_join(dbx + 2 * kk));
    }
    wgmma_commit();
  }
  static __device__ __forceinline__ void fence(Acc& a) {
    fence_regs(a.d);
    fence_regs(a.x);
  }
};

template <class Tile, int kS, class Release, class AfterIssue>
__device__ __forceinline__ void mainloop(typename Tile::Acc& acc, RingCursor<kS>& cur, int num_k, uint32_t full0,
                                         const typename Tile::Descs& d, bool proxy_fence, Release&& release,
                                         AfterIssue&& after_issue) {
  // Pinned: else the barrier base and the flag are recomputed from the shared-memory symbol / kernel
  // parameters at every step.
  full0 = pin_u32(full0);
  const bool fence_each_stage = pin_u32(proxy_fence ? 1u : 0u) != 0;
  for (int kt = 0; kt < num_k; ++kt) {
    const uint32_t s = cur.stage();
    if (kt > 0) mbar_wait(full0 + 8 * s, cur.parity());
    if (fence_each_stage) fence_proxy_async_shared();
    Tile::step(acc, d, s);
    after_issue(kt);
    if (kt > 0) {
      wgmma_wait<1>();  // the previous stage's group is done: it may be refilled
      release(cur.prev_stage(), kt - 1);
    }
    cur.advance();
  }
  wgmma_wait<0>();
  Tile::fence(acc);
  release(cur.prev_stage(), num_k - 1);  // the item's last stage
}

#endif  // EPMOE_SM90A_DEVICE
}  // namespace epmoe::kernels::sm90
