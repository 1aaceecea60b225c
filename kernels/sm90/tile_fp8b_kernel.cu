// The FP8 block-128 tile form (swap_mx.cuh, Fp8Scales::block128): the large-T UP and DOWN on FP8 with
// DeepSeek-V3's block scales (epmoe/fp8_block.h: 1 x 128 activation blocks, 128 x 128 weight blocks,
// fp32 scales). The MX tile form's operands, stages and roles (tile_mx_kernel.cu), with the scales
// applied once per stage instead of once per k32 block: a stage's 4 k32 wgmmas accumulate into one
// partial fragment (its 128 K elements share every scale), waited for once, promoted as
// acc += part * (Xw * Xx[token]) - 64 FFMA + 64 FMUL per thread per 4 wgmmas, a quarter of the MX
// form's promotion work and one wait instead of four. The stage is released as soon as its wgmmas
// have landed (the scales it needs were read into registers before the wait); the other warpgroup's
// wgmmas keep the tensor cores busy through this one's promotion.
//
// Work item: one 128-row tile of one expert's segment (segments are multiples of 128) x one weight
// block: UP 128 act columns (one act scale block), as two halves of 64 (W1 rows [64 h, +64) of the
// gate half and their up partners: two boxes of the swap map, 32 act columns each), DOWN 128 output
// columns (W2 rows [128 j, +128), one weight scale block). Items (total rows / 128) x blocks from the
// device total, tile-major; persistent grid.
//
// Scales in a stage's scale slot: the 128 token rows' fp32 scale of this K block (thread t: token
// row t, from its packed row's scale words; 0 past the tile's real rows, whose data is zero), then
// the weight blocks' (UP: gate block j and up block ffn / 128 + j, which every row of both halves
// shares; DOWN: block (j, kt)). Within a warpgroup, fragment rows h = 0 are gate rows and h = 1 their
// up partners (the swap map's 8-row interleave), so each thread needs the two weight scales and the
// 32 token scales of its columns.
//
// Epilogues through one staging buffer: UP stages silu(g) * u as fp32 [128 tokens][128 columns]
// (half h at columns [64 h, +64)); once the second half is in, thread u < 256 takes token u / 2's
// columns [64 (u % 2), +64), the pair of threads of a token share their amax by a shuffle, and each
// quantizes its 64 values (kernels/fp8b_device.cuh: the host quantizer's rule) into the token's packed
// act row. DOWN stages the weighted bf16 rows in one of two buffers and thread r < rows hands its
// row's 128 columns to one bulk reduction into out[pair_row[r]] (cp.reduce.async.bulk .add.bf16: the
// copy engine adds while the consumers start the next item; a buffer is rewritten once its
// reductions of two items ago have read it).
#include "epmoe/fp8_block.h"
#include "kernels/fp8b_device.cuh"
#include "kernels/sm90/core/gather.cuh"
#include "kernels/sm90/core/kernel.cuh"
#include "kernels/sm90/core/ring.cuh"
#include "kernels/sm90/core/wgmma_fp8.cuh"
#include "kernels/sm90/launch.cuh"
#include "kernels/sm90/mx_common.cuh"
#include "kernels/sm90/swap_items.cuh"
#include "kernels/sm90/swap_mx.cuh"
#include "kernels/sm90/tensor_maps.cuh"
#include "kernels/sm90/tile_fp8_common.cuh"
#include "kernels/sm90/up_common.cuh"
#include "kernels/sm90/zero_out.cuh"

namespace epmoe::kernels::sm90 {

inline constexpr uint32_t kFp8bProducerRegs = 104, kFp8bConsumerRegs = 200;
inline constexpr int kFp8bGatherThreads = 128;
inline constexpr uint32_t kFp8bWeightScaleOff = kBM * 4;  // in a scale slot, after the token scales

#if EPMOE_SM90A_DEVICE
namespace {

__device__ __forceinline__ void ld_shared_f32x2(uint32_t addr, float& a, float& b) {
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(a), "=f"(b) : "r"(addr) : "memory");
}
__device__ __forceinline__ float ld_shared_f32(uint32_t addr) { return __uint_as_float(ld_shared_u32(addr)); }

}  // namespace
#endif  // EPMOE_SM90A_DEVICE

template <bool kUp>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_fp8b_tile_kernel(const __grid_constant__ CUtensorMap tm_w, const MxArgs a) {
#if EPMOE_SM90A_DEVICE
  __shared__ __align__(8) uint64_t bars[2 * kFp8bTileStages];  // full[0..S), empty[0..S)
  extern __shared__ uint8_t dyn_smem[];
  uint8_t* ring_mem = align_1024(dyn_smem);
  const uint32_t ring_base = smem_u32(ring_mem);  // S x (A: 128 weight rows x 128 B, B: 128 token rows x 128 B)
  const uint32_t sc_base = ring_base + kFp8bTileStages * kMxTileStageBytes;  // S x scale slots
  const uint32_t stg = sc_base + kFp8bTileStages * kFp8bScaleStageBytes;
  const Ring<kFp8bTileStages> ring{smem_u32(&bars[0]), smem_u32(&bars[kFp8bTileStages])};

  constexpr int kHalves = kUp ? 2 : 1;
  const int64_t tiles = a.padded_offsets[a.experts] / kBM;
  const int blocks = (kUp ? a.ffn : a.hidden) / fp8b::kBlock;
  const int64_t items = tiles * blocks;
  const int k_dim = kUp ? a.hidden : a.ffn;
  const int num_k = k_dim / kMxBK;
  ZeroPlan zero = kUp ? make_zero_plan<false>(a.zero_out, a.zero_chunks, items) : ZeroPlan{};
  if (!start_persistent_kernel<kUp>(ring, zero, items, kThreads, 1 + kFp8bGatherThreads, kConsumerThreads)) return;

  const int64_t first = blockIdx.x, stride = gridDim.x;
  const float* w_scale = reinterpret_cast<const float*>(a.w_scale);
  run_warp_roles<kFp8bProducerRegs, kFp8bConsumerRegs>(
      [&] {
        // ---- producer: token rows and their scales; threads 0 / 1 also the weight scales, 0 the boxes ----
        const int t = int(threadIdx.x);
        const RowGather<kFp8bGatherThreads, 1, 8> gather(ring_base + kMxTileATileBytes, t, k_dim / 2);
        // (RowGather moves 16-byte chunks of bf16 rows: a packed row of row_bytes is row_bytes / 2 of
        // them, a stage's 128 bytes kBK of them; the scale words past k_dim bytes are not data.)
        const __nv_bfloat16* src16 = reinterpret_cast<const __nv_bfloat16*>(a.src);
        const int src_row16 = int(a.src_row_bytes / 2);
        if (t == 0) tma_prefetch_desc(&tm_w);
        grid_dependency_wait();  // x / act come from the previous kernel (no-op unless PDL-launched)
        RingCursor<kFp8bTileStages> cur;
        for (int64_t w = first; w < items; w += stride) {
          const MxTileItem it = mx_tile_item(a, w, blocks);
          const GatherRows<8> src =
              gather.rows(src16, a.src_rows, src_row16, [&](int i) { return tile_src_row<kUp>(a, it, gather.row(i)); });
          const int32_t tr = tile_src_row<kUp>(a, it, t);
          const bool tok_ok = tr >= 0 && int64_t(tr) < a.src_rows;
          const uint8_t* tok_sc = a.src + (tok_ok ? int64_t(tr) * a.src_row_bytes + k_dim : 0);
          // Thread t < kHalves: the weight scale block row of the item (UP: gate, then up).
          const int kb = k_dim / fp8b::kBlock;
          const int64_t w_block_row = kUp ? int64_t(it.e) * (2 * a.ffn / fp8b::kBlock) + (t == 0 ? 0 : a.ffn / fp8b::kBlock) + it.j
                                          : int64_t(it.e) * (a.hidden / fp8b::kBlock) + it.j;
          const float* w_sc = w_scale + w_block_row * kb;
          zero_step(zero, zero.per_item, t, kFp8bGatherThreads);
          for (int hf = 0; hf < kHalves; ++hf)
            for (int kt = 0; kt < num_k; ++kt, cur.advance()) {
              const uint32_t s = cur.stage(), full = ring.full(s), dst = ring_base + s * kMxTileStageBytes;
              ring.wait_empty(cur);
              if (t == 0) load_tile_weights<kUp>(dst, &tm_w, full, kt, it.e, kUp ? 2 * it.j + hf : it.j);  // (UP: the half)
              gather.copy(src, s * kMxTileStageBytes, kt);
              const uint32_t sc = sc_base + s * kFp8bScaleStageBytes;
              cp_async_4_zfill(sc + uint32_t(t) * 4u, tok_sc + 4 * kt, tok_ok ? 4u : 0u);
              if (t < kHalves) cp_async_4_zfill(sc + kFp8bWeightScaleOff + uint32_t(t) * 4u, w_sc + kt, 4u);
              cp_async_mbar_arrive_noinc(full);  // full[s] hears of these copies when they land
            }
        }
        zero_step(zero, zero.end - zero.next, t, kFp8bGatherThreads);
        cp_async_wait_all();
      },
      [&](int c) {
        // ---- consumers: weight rows [64 c, +64) of each stage ----
        const int wl = int(threadIdx.x / 32) & 3, lane = int(threadIdx.x & 31);
        const int u = int(threadIdx.x) - 128;  // 0..255: the epilogues' copy-out thread
        const uint32_t d0 = pin_u32(smem_desc_sw128_lo(ring_base));
        grid_dependency_wait();  // DOWN reduces into out, which UP zeroed
        RingCursor<kFp8bTileStages> cur;
        uint32_t n_item = 0;  // (DOWN: the staging buffer of this item, n_item % 2)
        for (int64_t w = first; w < items; w += stride, ++n_item) {
          const MxTileItem it = mx_tile_item(a, w, blocks);
          const int rows = it.rows;
          const uint32_t dstg = stg + (n_item & 1u) * kFp8bDownStagingBytes;  // DOWN's buffer
          for (int hf = 0; hf < kHalves; ++hf) {
            float acc[64], part[64];
#pragma unroll
            for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
            for (int kt = 0; kt < num_k; ++kt, cur.advance()) {
              const uint32_t s = cur.stage();
              mbar_wait(ring.full(s), cur.parity());
              fence_proxy_async_shared();  // B came by cp.async (generic proxy); wgmma reads through the async one
              const uint32_t da = d0 + ((s * kMxTileStageBytes + uint32_t(c) * (kMxTileATileBytes / 2)) >> 4);
              const uint32_t db = d0 + ((s * kMxTileStageBytes + kMxTileATileBytes) >> 4);
              wgmma_fence();  // (part was read by the previous promotion)
#pragma unroll
              for (int q = 0; q < kMxBK / 32; ++q)
                WgmmaE4m3N128::mma(part, smem_desc_sw128_join(da + kKMajorK16Step * q),
                                   smem_desc_sw128_join(db + kKMajorK16Step * q), /*scale_d=*/q > 0 ? 1 : 0);
              wgmma_commit();
              // The scales, while the wgmmas run: token columns 8 g + 2 (lane % 4) + b, weight rows h.
              const uint32_t sc = sc_base + s * kFp8bScaleStageBytes;
              float xs[32];
#pragma unroll
              for (int g = 0; g < 16; ++g) ld_shared_f32x2(sc + uint32_t(8 * g + 2 * (lane & 3)) * 4u, xs[2 * g], xs[2 * g + 1]);
              const float sw0 = ld_shared_f32(sc + kFp8bWeightScaleOff);
              const float sw1 = kUp ? ld_shared_f32(sc + kFp8bWeightScaleOff + 4) : sw0;
              wgmma_wait<0>();
              fence_regs(part);
              mbar_arrive(ring.empty(s));  // the stage's wgmma reads and this thread's scale reads are done
#pragma unroll
              for (int g = 0; g < 16; ++g)
#pragma unroll
                for (int b = 0; b < 2; ++b) {
                  const float x = xs[2 * g + b];
                  acc[4 * g + b] = fmaf(part[4 * g + b], x * sw0, acc[4 * g + b]);
                  acc[4 * g + 2 + b] = fmaf(part[4 * g + 2 + b], x * sw1, acc[4 * g + 2 + b]);
                }
            }

            if constexpr (kUp) {
              // The previous item's quantizers have read the staging rows (before the first half's writes).
              if (hf == 0) named_barrier_sync(1, kConsumerThreads);
              stage_tile_swiglu<kFp8bUpStride>(stg, 64 * hf + 32 * c + 8 * wl + (lane >> 2), acc, lane);
            } else {
              // This buffer's bulk reductions (two items ago) have read it: the issuing threads wait,
              // the barrier tells the others.
              if (u < kBM) bulk_wait_read_one();
              named_barrier_sync(1, kConsumerThreads);
              stage_tile_weighted(dstg, a, it, acc, c, wl, lane);
              fence_proxy_async_shared();  // the bulk reductions read these rows through the async proxy
            }
          }

          named_barrier_sync(1, kConsumerThreads);  // the item's staging rows are in
          if constexpr (kUp) {
            // Token tok's act block j: this thread's 64 columns, the block's amax shared with its partner
            // thread (u ^ 1, the same warp; every thread of the warp takes part).
            const int tok = u >> 1, part_half = u & 1;
            float v[64];
#pragma unroll
            for (int i = 0; i < 16; ++i) {
              uint32_t wv[4];
              ld_shared_16(stg + uint32_t(tok * kFp8bUpStride + 64 * part_half + 4 * i) * 4u, wv);
#pragma unroll
              for (int e = 0; e < 4; ++e) v[4 * i + e] = __uint_as_float(wv[e]);
            }
            float amax = 0.0f;
            int nan = 0;
#pragma unroll
            for (int i = 0; i < 64; ++i) nan |= isnan(v[i]) ? 1 : 0, amax = fmaxf(amax, fabsf(v[i]));
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
            nan |= __shfl_xor_sync(0xffffffffu, nan, 1);
            const float scale = fp8bdev::scale_for(amax, nan != 0);
            if (tok < rows) {
              uint8_t* dst = a.act + (it.m0 + tok) * a.act_row_bytes;
              const int64_t col0 = int64_t(fp8b::kBlock) * it.j + 64 * part_half;
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                uint32_t q[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                  const float* x = &v[16 * i + 4 * e];
                  q[e] = fp8bdev::quantize4(x[0], x[1], x[2], x[3], scale);
                }
                st_global_16(dst + col0 + 16 * i, q);
              }
              if (part_half == 0) reinterpret_cast<float*>(dst + a.ffn)[it.j] = scale;
            }
          } else {
            // Thread u < rows: its token row's 128 columns reduced into out by one bulk reduction (the
            // copy engine's, while the consumers go on to the next item).
            if (u < rows) {
              const int32_t pr = a.pair_row[it.m0 + u];
              if (pr >= 0 && int64_t(pr) < a.out_rows)
                bulk_reduce_add_bf16(a.out + int64_t(pr) * a.hidden + int64_t(kMxTileWeightRows) * it.j,
                                     dstg + uint32_t(u * kMxTileDownStride) * 2u, kMxTileWeightRows * 2);
            }
            if (u < kBM) bulk_commit();
          }
        }
        if (!kUp && u < kBM) bulk_wait_all();  // the staging rows stay until read, out until written
      });
#else
  (void)tm_w;
  (void)a;
#endif
}

void launch_fp8b_tile(const MxExpertProblem& p, bool up, bool pdl, cudaStream_t s) {
  check_mx_expert_problem(p, up ? "sm90_mx_up_launch (block-128 tile)" : "sm90_mx_down_launch (block-128 tile)");
  const MxArgs a = make_mx_args(p, up);
  const CUtensorMap tm = up ? make_w1_swap_map_e4m3(p.w1, p.experts, p.hidden, p.ffn)
                            : make_w2_map_e4m3(p.w2, p.experts, p.hidden, p.ffn, kMxTileWeightRows);
  const int64_t tiles = (p.rows_capacity + kBM - 1) / kBM;
  const int64_t items = tiles * ((up ? p.ffn : p.hidden) / fp8b::kBlock);
  sm90_launch(up ? sm90_fp8b_tile_kernel<true> : sm90_fp8b_tile_kernel<false>, /*cluster=*/false, pdl, items,
              kFp8bTileSmemBytes, s, up ? "sm90_fp8b_tile_up" : "sm90_fp8b_tile_down", tm, a);
}

}  // namespace epmoe::kernels::sm90
