// The MX swap-AB UP and DOWN (swap_mx.cuh): swap_ab_kernel.cu's items, roles and ring with E4M3
// operands and MX promotion.
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
//
// UP's epilogue: silu(g) * u into an fp32 staging tile [64 tokens][32 act columns]: the item's 32
// columns are exactly one MX block of each token's act row, so thread i < rows quantizes token i's
// block (mxdev::quantize_block32, the host quantizer's rule) and stores its 32 E4M3 bytes and its
// scale into the token's packed act row. DOWN's epilogue is the bf16 swap DOWN's: weighted bf16 rows
// reduced into out with red.global.add.
#include "epmoe/mxfp8.h"
#include "kernels/mx_device.cuh"
#include "kernels/sm90/core/gather.cuh"
#include "kernels/sm90/core/ring.cuh"
#include "kernels/sm90/core/wgmma_fp8.cuh"
#include "kernels/sm90/mx_common.cuh"
#include "kernels/sm90/launch.cuh"
#include "kernels/sm90/swap_items.cuh"
#include "kernels/sm90/swap_mx.cuh"
#include "kernels/sm90/tensor_maps.cuh"
#include "kernels/sm90/up_common.cuh"
#include "kernels/sm90/zero_out.cuh"

namespace epmoe::kernels::sm90 {


#if EPMOE_SM90A_DEVICE
namespace {

// The weight row (in w*_scale's rows) of A-tile row i. UP: the e4m3 swap map's box {128, 8, 2, 4}
// lands row i = r + 8p + 16b as W1 row p * ffn + 32j + 8b + r of expert e.
template <bool kUp>
__device__ __forceinline__ int64_t weight_row(const MxArgs& a, const SwapItem& it, int i) {
  if constexpr (kUp) {
    const int r = i & 7, p = (i >> 3) & 1, b = i >> 4;
    return int64_t(it.e) * 2 * a.ffn + int64_t(p) * a.ffn + 32 * it.j + 8 * b + r;
  } else {
    return int64_t(it.e) * a.hidden + kSwapWeightRows * it.j + i;
  }
}

// Byte q of each word: the E8M0 codes of k32 block q.
template <int N>
__device__ __forceinline__ void promote_block(float (&acc)[N / 2], const float (&part)[N / 2], const uint32_t (&wa)[2],
                                              const uint32_t (&wb)[N / 4], int q) {
  float xa[2], xb[N / 4];
#pragma unroll
  for (int h = 0; h < 2; ++h) xa[h] = e8m0_to_f32((wa[h] >> (8 * q)) & 0xFFu);
#pragma unroll
  for (int i = 0; i < N / 4; ++i) xb[i] = e8m0_to_f32((wb[i] >> (8 * q)) & 0xFFu);
  promote_mx<N>(acc, part, xa, xb);
}

// The consumer warpgroup's item at N: the k loop with promotion, then the epilogue. wl: warp in the
// warpgroup (0..3); fragment rows (weight rows) 16 wl + lane / 4 + 8 h, token columns 8 g + 2 (lane % 4) + b.
template <bool kUp, int N>
__device__ __forceinline__ void mx_consume(const MxArgs& a, const SwapItem& it, RingCursor<kMxSwapStages>& cur,
                                           const Ring<kMxSwapStages>& ring, uint32_t ring_base, uint32_t sc_base,
                                           uint32_t stg, int num_k, int wl, int lane) {
  float acc[N / 2], part[N == 64 ? 2 : 4][N / 2];
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
      promote_block<N>(acc, part[0], wa, wb, 0);
      wgmma_wait<2>();
      fence_regs(part[1]);
      promote_block<N>(acc, part[1], wa, wb, 1);
      wgmma_wait<1>();
      fence_regs(part[2]);
      promote_block<N>(acc, part[2], wa, wb, 2);
      wgmma_wait<0>();
      fence_regs(part[3]);
      promote_block<N>(acc, part[3], wa, wb, 3);
    } else {
      mma(part[0], 0);
      mma(part[1], 1);
      load_scales(s);
      wgmma_wait<1>();
      fence_regs(part[0]);
      promote_block<N>(acc, part[0], wa, wb, 0);
      wgmma_fence();  // (part[0] was read since its wgmma)
      mma(part[0], 2);
      wgmma_wait<1>();
      fence_regs(part[1]);
      promote_block<N>(acc, part[1], wa, wb, 1);
      wgmma_fence();
      mma(part[1], 3);
      wgmma_wait<1>();
      fence_regs(part[0]);
      promote_block<N>(acc, part[0], wa, wb, 2);
      wgmma_wait<0>();
      fence_regs(part[1]);
      promote_block<N>(acc, part[1], wa, wb, 3);
    }
    mbar_arrive(ring.empty(s));  // every wgmma read of the stage and this thread's scale reads are done
    cur.advance();
  }

  const int rows = it.rows;
  const int tid = int(threadIdx.x) - 128;  // 0..127
  named_barrier_sync(1, 128);              // the previous item's copy-out has read the staging rows
  if constexpr (kUp) {
    const int c = 8 * wl + (lane >> 2);  // act column in the item's 32: gate row (h 0), partner (h 1)
#pragma unroll
    for (int g = 0; g < N / 8; ++g)
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int t = 8 * g + 2 * (lane & 3) + b;
        st_shared_f32(stg + uint32_t(t * kMxUpStride + c) * 4u, silu_tanh(acc[4 * g + b]) * acc[4 * g + 2 + b]);
      }
    named_barrier_sync(1, 128);
    if (tid < rows) {
      float v[32];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        uint32_t w[4];
        ld_shared_16(stg + uint32_t(tid * kMxUpStride + 4 * i) * 4u, w);
#pragma unroll
        for (int e = 0; e < 4; ++e) v[4 * i + e] = __uint_as_float(w[e]);
      }
      uint32_t q[8];
      const uint32_t scale = mxdev::quantize_block32(v, q);
      uint8_t* dst = a.act + (it.m0 + tid) * a.act_row_bytes;
      const uint32_t lo[4] = {q[0], q[1], q[2], q[3]}, hi[4] = {q[4], q[5], q[6], q[7]};
      st_global_16(dst + 32 * int64_t(it.j), lo);
      st_global_16(dst + 32 * int64_t(it.j) + 16, hi);
      dst[a.ffn + it.j] = uint8_t(scale);
    }
  } else {
#pragma unroll
    for (int g = 0; g < N / 8; ++g)
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int t = 8 * g + 2 * (lane & 3) + b;
        const float wt = t < rows ? a.pair_weight[it.m0 + t] : 0.0f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int f = 16 * wl + (lane >> 2) + 8 * h;
          st_shared_bf16(stg + uint32_t(t * kSwapDownStride + f) * 2u, wt * acc[4 * g + 2 * h + b]);
        }
      }
    named_barrier_sync(1, 128);
    for (int q = tid; q < rows * 8; q += 128) {
      const int r = q >> 3, part = q & 7;
      const int32_t pr = a.pair_row[it.m0 + r];
      if (pr < 0 || int64_t(pr) >= a.out_rows) continue;
      uint32_t v[4];
      ld_shared_16(stg + uint32_t(r * kSwapDownStride + 8 * part) * 2u, v);
      red_add_bf16x8(a.out + int64_t(pr) * a.hidden + kSwapWeightRows * int64_t(it.j) + 8 * part, v);
    }
  }
}

}  // namespace
#endif  // EPMOE_SM90A_DEVICE

template <bool kUp>
__global__ void __launch_bounds__(kSwapThreads, 1)
    sm90_mx_swap_kernel(const __grid_constant__ CUtensorMap tm_w, const MxArgs a) {
#if EPMOE_SM90A_DEVICE
  __shared__ __align__(8) uint64_t bars[2 * kMxSwapStages];  // full[0..S), empty[0..S)
  extern __shared__ uint8_t dyn_smem[];
  uint8_t* ring_mem = align_1024(dyn_smem);
  const uint32_t ring_base = smem_u32(ring_mem);  // S x (A: 64 weight rows x 128 B, B: 64 token rows x 128 B)
  const uint32_t sc_base = ring_base + kMxSwapStages * kMxSwapStageBytes;  // S x (64 + 64 rows x 4 scales)
  const uint32_t stg = sc_base + kMxSwapStages * kMxScaleStageBytes;
  const Ring<kMxSwapStages> ring{smem_u32(&bars[0]), smem_u32(&bars[kMxSwapStages])};

  const int64_t tiles = a.padded_offsets[a.experts] / kBM;
  const int blocks = kUp ? a.ffn / 32 : a.hidden / kSwapWeightRows;
  const int64_t half_items = tiles * blocks, items = 2 * half_items;
  const int k_dim = kUp ? a.hidden : a.ffn;
  const int num_k = k_dim / kMxBK;
  ZeroPlan zero = kUp ? make_zero_plan<false>(a.zero_out, a.zero_chunks, items) : ZeroPlan{};
  if (int64_t(blockIdx.x) >= items) {  // no work: zero this CTA's share of out and leave
    zero_step(zero, zero.end - zero.next, int(threadIdx.x), kSwapThreads);
    return;
  }
  if (threadIdx.x == 0) {
    ring.init(1 + kSwapGatherThreads, 128);
    mbar_fence_init();
  }
  __syncthreads();
  if constexpr (kUp) grid_launch_dependents();  // DOWN's prologue and weight loads may start

  const int warp = int(threadIdx.x / 32), lane = int(threadIdx.x & 31);
  const int64_t first = blockIdx.x, stride = gridDim.x;
  if (warp < 4) {
    // ---- B (the tile's first N token rows) and every row's scales, every K step ----
    const int t = int(threadIdx.x);
    const RowGather<kSwapGatherThreads, 1, 4> gather(ring_base + kMxSwapATileBytes, t, k_dim / 2);
    // RowGather moves 16-byte chunks of bf16 rows: a packed row of row_bytes is row_bytes / 2 of them,
    // a stage's 128 bytes kBK of them.
    const __nv_bfloat16* src16 = reinterpret_cast<const __nv_bfloat16*>(a.src);
    const int src_row16 = int(a.src_row_bytes / 2);
    grid_dependency_wait();  // x / act come from the previous kernel (no-op unless PDL-launched)
    RingCursor<kMxSwapStages> cur;
    for (int64_t w = first; w < items; w += stride) {
      const SwapItem it = swap_item(a, w, tiles, half_items);
      if (it.rows == 0) continue;
      const int rows = it.rows, n = swap_ab_n(rows);
      auto src_row = [&](int r) { return r >= rows ? int32_t(-1) : kUp ? a.pair_row[it.m0 + r] : int32_t(it.m0 + r); };
      const GatherRows<4> src = gather.rows(src16, a.src_rows, src_row16, [&](int i) { return src_row(gather.row(i)); });
      // This thread's scale row: weight row t, or token row t - 64 (below N only: the MMA reads no more).
      const uint8_t* sc_src = a.src;
      uint32_t sc_bytes = 0;
      bool sc_copy = true;
      if (t < kSwapWeightRows) {
        sc_src = a.w_scale + weight_row<kUp>(a, it, t) * (k_dim / mx::kBlock);
        sc_bytes = 4;
      } else {
        const int32_t r = src_row(t - kSwapWeightRows);
        sc_copy = t - kSwapWeightRows < n;
        if (r >= 0 && int64_t(r) < a.src_rows) {
          sc_src = a.src + int64_t(r) * a.src_row_bytes + k_dim;
          sc_bytes = 4;
        }
      }
      zero_step(zero, zero.per_item, t, kSwapGatherThreads);
      for (int kt = 0; kt < num_k; ++kt, cur.advance()) {
        const uint32_t s = cur.stage();
        ring.wait_empty(cur);
        gather.copy_below(src, s * kMxSwapStageBytes, kt, n);
        if (sc_copy) cp_async_4_zfill(sc_base + s * kMxScaleStageBytes + uint32_t(t) * 4u, sc_src + 4 * kt, sc_bytes);
        cp_async_mbar_arrive_noinc(ring.full(s));
      }
    }
    zero_step(zero, zero.end - zero.next, t, kSwapGatherThreads);
    cp_async_wait_all();
  } else if (warp < 8) {
    // ---- consumer warpgroup ----
    grid_dependency_wait();  // DOWN reduces into out, which UP zeroed
    RingCursor<kMxSwapStages> cur;
    for (int64_t w = first; w < items; w += stride) {
      const SwapItem it = swap_item(a, w, tiles, half_items);
      if (it.rows == 0) continue;
      switch (swap_ab_n(it.rows)) {
        case 8: mx_consume<kUp, 8>(a, it, cur, ring, ring_base, sc_base, stg, num_k, warp - 4, lane); break;
        case 16: mx_consume<kUp, 16>(a, it, cur, ring, ring_base, sc_base, stg, num_k, warp - 4, lane); break;
        case 32: mx_consume<kUp, 32>(a, it, cur, ring, ring_base, sc_base, stg, num_k, warp - 4, lane); break;
        default: mx_consume<kUp, 64>(a, it, cur, ring, ring_base, sc_base, stg, num_k, warp - 4, lane); break;
      }
    }
  } else {
    // ---- weights: one 64-row box per stage ----
    if (lane == 0) tma_prefetch_desc(&tm_w);
    RingCursor<kMxSwapStages> cur;
    for (int64_t w = first; w < items; w += stride) {
      const SwapItem it = swap_item(a, w, tiles, half_items);
      if (it.rows == 0) continue;
      for (int kt = 0; kt < num_k; ++kt, cur.advance()) {
        const uint32_t s = cur.stage(), full = ring.full(s), dst = ring_base + s * kMxSwapStageBytes;
        ring.wait_empty(cur);
        if (lane == 0) {
          mbar_arrive_expect_tx(full, kMxSwapATileBytes);
          if constexpr (kUp) tma_load_4d(dst, &tm_w, full, kt * kMxBK, 0, 2 * it.e, 4 * it.j);
          else tma_load_3d(dst, &tm_w, full, kt * kMxBK, kSwapWeightRows * it.j, it.e);
        }
        __syncwarp();
      }
    }
  }
#else
  (void)a;
#endif
}

void launch_mx_tile(const MxExpertProblem& p, bool up, bool pdl, cudaStream_t s);    // tile_mx_kernel.cu
void launch_fp8b_tile(const MxExpertProblem& p, bool up, bool pdl, cudaStream_t s);  // tile_fp8b_kernel.cu

namespace {
void launch_mx_swap(const MxExpertProblem& p, bool up, bool pdl, cudaStream_t s) {
  check_mx_expert_problem(p, up ? "sm90_mx_up_launch" : "sm90_mx_down_launch");
  const MxArgs a = make_mx_args(p, up);
  const CUtensorMap tm = up ? make_w1_swap_map_e4m3(p.w1, p.experts, p.hidden, p.ffn)
                            : make_w2_map_e4m3(p.w2, p.experts, p.hidden, p.ffn, kSwapWeightRows);
  const int64_t tiles = (p.rows_capacity + kBM - 1) / kBM;
  const int64_t items = 2 * tiles * (up ? p.ffn / 32 : p.hidden / kSwapWeightRows);
  sm90_launch_threads(up ? sm90_mx_swap_kernel<true> : sm90_mx_swap_kernel<false>, unsigned(kSwapThreads),
                      /*cluster=*/false, pdl, items, kMxSwapSmemBytes, s, up ? "sm90_mx_swap_up" : "sm90_mx_swap_down",
                      tm, a);
}
}  // namespace

}  // namespace epmoe::kernels::sm90

namespace epmoe::kernels {

void check_mx_expert_problem(const MxExpertProblem& p, const char* who) {
  auto aligned = [](const void* q) { return q != nullptr && reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  EPMOE_CHECK(p.experts > 0, ErrorCode::invalid_argument, who, ": experts must be > 0, got ", p.experts);
  EPMOE_CHECK(p.hidden > 0 && p.hidden % sm90::kMxBK == 0 && p.ffn > 0 && p.ffn % sm90::kMxBK == 0,
              ErrorCode::invalid_argument, who, ": hidden and ffn must be positive multiples of ", sm90::kMxBK,
              ", got ", p.hidden, " and ", p.ffn);
  EPMOE_CHECK(p.rows_capacity > 0 && p.rows_capacity < (int64_t(1) << 31) && p.rows_capacity % kExpertTile == 0,
              ErrorCode::invalid_argument, who, ": rows_capacity must be a multiple of ", kExpertTile,
              " in (0, 2^31), got ", p.rows_capacity);
  EPMOE_CHECK(p.padded_offsets != nullptr && p.pair_row != nullptr && p.pair_weight != nullptr,
              ErrorCode::invalid_argument, who, ": null layout pointer");
  EPMOE_CHECK(aligned(p.x) && aligned(p.w1) && aligned(p.w1_scale) && aligned(p.w2) && aligned(p.w2_scale) &&
                  aligned(p.act) && aligned(p.out),
              ErrorCode::invalid_argument, who, ": x, w1, w1_scale, w2, w2_scale, act and out must be non-null and "
              "16-byte aligned");
  EPMOE_CHECK(p.x_rows > 0 && p.out_rows >= 0, ErrorCode::invalid_argument, who, ": x_rows ", p.x_rows,
              ", out_rows ", p.out_rows);
  EPMOE_CHECK(p.scales == Fp8Scales::mx32 || p.form == MxForm::tile, ErrorCode::invalid_argument, who,
              ": FP8 block-128 scales run in the tile form only (there is no block-128 swap-AB kernel)");
}

void sm90_mx_up_launch(const MxExpertProblem& p, cudaStream_t s) {
  if (p.scales == Fp8Scales::block128) sm90::launch_fp8b_tile(p, /*up=*/true, false, s);
  else if (p.form == MxForm::tile) sm90::launch_mx_tile(p, /*up=*/true, false, s);
  else sm90::launch_mx_swap(p, /*up=*/true, false, s);
}
void sm90_mx_down_launch(const MxExpertProblem& p, cudaStream_t s, bool pdl) {
  if (p.scales == Fp8Scales::block128) sm90::launch_fp8b_tile(p, /*up=*/false, pdl, s);
  else if (p.form == MxForm::tile) sm90::launch_mx_tile(p, /*up=*/false, pdl, s);
  else sm90::launch_mx_swap(p, /*up=*/false, pdl, s);
}
void sm90_mx_experts_launch(const MxExpertProblem& p, cudaStream_t s) {
  sm90_mx_up_launch(p, s);
  sm90_mx_down_launch(p, s, /*pdl=*/true);
}

}  // namespace epmoe::kernels
