// The MX swap-AB item's UP/DOWN k loop, shared by the split MX kernels (swap_mx_kernel.cu) and the
// fused MX pipeline (fused_mx_kernel.cu): the gathering warps' copies of one item (token rows and
// every row's E8M0 scales, per 128-K stage) and the consumer warpgroup's k loop with MX promotion.
//
// A stage holds 128 K elements: 64 weight rows x 128 bytes (A, one TMA box of the e4m3 maps) and the
// half tile's first N token rows x 128 bytes (B, gathered by cp.async from packed MX rows), plus, in
// a scale ring beside it, the 4 E8M0 scales (k32 blocks) of each weight row and of each token row.
// The gathering threads copy the scales too: thread t < 64 weight row t's 4 bytes, thread 64 + i
// token row i's (zeros past the real rows), 4-byte cp.async arriving on the stage's full barrier
// with the row copies. (Scales stay row-major as the format stores them: a stage needs 4 bytes per
// row, below TMA's 16-byte box minimum.)
//
// Consumer: every k32 block's wgmma m64nNk32 into a partial fragment of its own, each promoted once
// it lands, acc += D_q * Xw[row] * Xx[token], while the stage's later blocks are still queued. A
// fragment is N/2 <= 32 registers, a promotion N/2 FMUL + N/2 FFMA per thread per k32. (Two partials
// issued two blocks apart at every N: the UP at T = 1 took 11.3 us for 12.6 MB, 3.4x its floor.)
#pragma once
#include <cstdint>

#include "epmoe/mxfp8.h"
#include "kernels/mx_device.cuh"
#include "kernels/sm90/core/gather.cuh"
#include "kernels/sm90/core/ring.cuh"
#include "kernels/sm90/core/wgmma_fp8.cuh"
#include "kernels/sm90/mx_common.cuh"
#include "kernels/sm90/swap_items.cuh"
#include "kernels/sm90/up_common.cuh"

namespace epmoe::kernels::sm90 {
#if EPMOE_SM90A_DEVICE

// The weight row (in w*_scale's rows) of A-tile row i. UP: the e4m3 swap map's box {128, 8, 2, 4}
// lands row i = r + 8p + 16b as W1 row p * ffn + 32j + 8b + r of expert e.
template <bool kUp>
__device__ __forceinline__ int64_t mx_weight_row(const MxArgs& a, const SwapItem& it, int i) {
  if constexpr (kUp) {
    const int r = i & 7, p = (i >> 3) & 1, b = i >> 4;
    return int64_t(it.e) * 2 * a.ffn + int64_t(p) * a.ffn + 32 * it.j + 8 * b + r;
  } else {
    return int64_t(it.e) * a.hidden + kSwapWeightRows * it.j + i;
  }
}

// The gathering warps (thread t < 128) on one item: B (the half tile's first N token rows) and every
// row's scales, for each of its num_k stages from the cursor on (advanced past them).
template <bool kUp>
__device__ __forceinline__ void mx_gather_item(const MxArgs& a, const SwapItem& it,
                                               const RowGather<kSwapGatherThreads, 1, 4>& gather,
                                               RingCursor<kMxSwapStages>& cur, const Ring<kMxSwapStages>& ring,
                                               uint32_t sc_base, int num_k, int k_dim, int t) {
  // RowGather moves 16-byte chunks of bf16 rows: a packed row of row_bytes is row_bytes / 2 of them,
  // a stage's 128 bytes kBK of them.
  const __nv_bfloat16* src16 = reinterpret_cast<const __nv_bfloat16*>(a.src);
  const int src_row16 = int(a.src_row_bytes / 2);
  const int rows = it.rows, n = swap_ab_n(rows);
  auto src_row = [&](int r) { return r >= rows ? int32_t(-1) : kUp ? a.pair_row[it.m0 + r] : int32_t(it.m0 + r); };
  const GatherRows<4> src = gather.rows(src16, a.src_rows, src_row16, [&](int i) { return src_row(gather.row(i)); });
  // This thread's scale row: weight row t, or token row t - 64 (below N only: the MMA reads no more).
  const uint8_t* sc_src = a.src;
  uint32_t sc_bytes = 0;
  bool sc_copy = true;
  if (t < kSwapWeightRows) {
    sc_src = a.w_scale + mx_weight_row<kUp>(a, it, t) * (k_dim / mx::kBlock);
    sc_bytes = 4;
  } else {
    const int32_t r = src_row(t - kSwapWeightRows);
    sc_copy = t - kSwapWeightRows < n;
    if (r >= 0 && int64_t(r) < a.src_rows) {
      sc_src = a.src + int64_t(r) * a.src_row_bytes + k_dim;
      sc_bytes = 4;
    }
  }
  for (int kt = 0; kt < num_k; ++kt, cur.advance()) {
    const uint32_t s = cur.stage();
    ring.wait_empty(cur);
    gather.copy_below(src, s * kMxSwapStageBytes, kt, n);
    if (sc_copy) cp_async_4_zfill(sc_base + s * kMxScaleStageBytes + uint32_t(t) * 4u, sc_src + 4 * kt, sc_bytes);
    cp_async_mbar_arrive_noinc(ring.full(s));
  }
}

// Byte q of each word: the E8M0 codes of k32 block q.
template <int N>
__device__ __forceinline__ void mx_promote_block(float (&acc)[N / 2], const float (&part)[N / 2],
                                                 const uint32_t (&wa)[2], const uint32_t (&wb)[N / 4], int q) {
  float xa[2], xb[N / 4];
#pragma unroll
  for (int h = 0; h < 2; ++h) xa[h] = e8m0_to_f32((wa[h] >> (8 * q)) & 0xFFu);
#pragma unroll
  for (int i = 0; i < N / 4; ++i) xb[i] = e8m0_to_f32((wb[i] >> (8 * q)) & 0xFFu);
  promote_mx<N>(acc, part, xa, xb);
}

// The consumer warpgroup's k loop of one item at N: acc (zeroed here) = the promoted sum over num_k
// stages from the cursor on (advanced past them), each stage released once its blocks are promoted.
// wl: warp in the warpgroup (0..3); fragment rows (weight rows) 16 wl + lane / 4 + 8 h, token
// columns 8 g + 2 (lane % 4) + b.
template <int N>
__device__ __forceinline__ void mx_swap_k_loop(float (&acc)[N / 2], RingCursor<kMxSwapStages>& cur,
                                               const Ring<kMxSwapStages>& ring, uint32_t ring_base, uint32_t sc_base,
                                               int num_k, int wl, int lane) {
  float part[N == 64 ? 2 : 4][N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.0f;
  const uint32_t d0 = pin_u32(smem_desc_sw128_lo(ring_base));
  uint32_t wa[2], wb[N / 4];  // one stage's scale words (byte q: k32 block q), rows then tokens
  auto load_scales = [&](uint32_t s) {
    const uint32_t sc = sc_base + s * kMxScaleStageBytes;
#pragma unroll
    for (int h = 0; h < 2; ++h) wa[h] = ld_shared_u32(sc + uint32_t(16 * wl + (lane >> 2) + 8 * h) * 4u);
#pragma unroll
    for (int g = 0; g < N / 8; ++g)
#pragma unroll
      for (int b = 0; b < 2; ++b)
        wb[2 * g + b] = ld_shared_u32(sc + 4u * kSwapWeightRows + uint32_t(8 * g + 2 * (lane & 3) + b) * 4u);
  };
  // All four k32 wgmmas of a stage are queued before the first promotion (two at N = 64, where four
  // partial fragments do not fit the 168 registers of a 288-thread CTA), each promotion waiting only
  // for its own block. (Keeping wgmmas in flight across the stage loop's back edge makes ptxas
  // serialize every wgmma: C7514.)
  constexpr int kDepth = N == 64 ? 2 : 4;
  for (int kt = 0; kt < num_k; ++kt) {
    const uint32_t s = cur.stage();
    mbar_wait(ring.full(s), cur.parity());
    fence_proxy_async_shared();  // B came by cp.async (generic proxy); wgmma reads through the async one
    const uint32_t da = d0 + s * (kMxSwapStageBytes >> 4), db = da + (kMxSwapATileBytes >> 4);
    auto mma = [&](float (&p)[N / 2], int q) {
      WgmmaE4m3<N>::mma(p, smem_desc_sw128_join(da + kKMajorK16Step * q), smem_desc_sw128_join(db + kKMajorK16Step * q),
                        /*scale_d=*/0);
      wgmma_commit();
    };
    wgmma_fence();
    if constexpr (kDepth == 4) {
      mma(part[0], 0);
      mma(part[1], 1);
      mma(part[2], 2);
      mma(part[3], 3);
      load_scales(s);
      wgmma_wait<3>();
      fence_regs(part[0]);
      mx_promote_block<N>(acc, part[0], wa, wb, 0);
      wgmma_wait<2>();
      fence_regs(part[1]);
      mx_promote_block<N>(acc, part[1], wa, wb, 1);
      wgmma_wait<1>();
      fence_regs(part[2]);
      mx_promote_block<N>(acc, part[2], wa, wb, 2);
      wgmma_wait<0>();
      fence_regs(part[3]);
      mx_promote_block<N>(acc, part[3], wa, wb, 3);
    } else {
      mma(part[0], 0);
      mma(part[1], 1);
      load_scales(s);
      wgmma_wait<1>();
      fence_regs(part[0]);
      mx_promote_block<N>(acc, part[0], wa, wb, 0);
      wgmma_fence();  // (part[0] was read since its wgmma)
      mma(part[0], 2);
      wgmma_wait<1>();
      fence_regs(part[1]);
      mx_promote_block<N>(acc, part[1], wa, wb, 1);
      wgmma_fence();
      mma(part[1], 3);
      wgmma_wait<1>();
      fence_regs(part[0]);
      mx_promote_block<N>(acc, part[0], wa, wb, 2);
      wgmma_wait<0>();
      fence_regs(part[1]);
      mx_promote_block<N>(acc, part[1], wa, wb, 3);
    }
    mbar_arrive(ring.empty(s));  // every wgmma read of the stage and this thread's scale reads are done
    cur.advance();
  }
}

// UP's SwiGLU into the fp32 staging tile [64 tokens][kMxUpStride] (act column c of token t).
template <int N>
__device__ __forceinline__ void mx_stage_swiglu(const float (&acc)[N / 2], uint32_t stg, int wl, int lane) {
  for_each_gate_up<N>(acc, wl, lane, [&](int t, int c, float gate, float up) {
    st_shared_f32(stg + uint32_t(t * kMxUpStride + c) * 4u, silu_tanh(gate) * up);
  });
}

// Token `tid`'s 32 staged act values as one MX block: its E8M0 scale (returned) and 32 E4M3 codes in
// 8 words (mxdev::quantize_block32, the host quantizer's rule).
__device__ __forceinline__ uint32_t mx_quantize_staged_row(uint32_t stg, int tid, uint32_t (&q)[8]) {
  float v[32];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    uint32_t w[4];
    ld_shared_16(stg + uint32_t(tid * kMxUpStride + 4 * i) * 4u, w);
#pragma unroll
    for (int e = 0; e < 4; ++e) v[4 * i + e] = __uint_as_float(w[e]);
  }
  return mxdev::quantize_block32(v, q);
}

#endif  // EPMOE_SM90A_DEVICE
}  // namespace epmoe::kernels::sm90
