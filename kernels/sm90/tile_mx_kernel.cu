// The MX tile form (swap_mx.cuh, MxForm::tile): the large-T MXFP8 UP and DOWN. swap_mx_kernel.cu's
// operands, scales and promotion, on whole 128-row layout tiles against 128 weight rows, so a weight
// stage serves 128 tokens instead of a half tile's <= 64.
//
// Work item: one 128-row tile of one expert's segment (segments are multiples of 128) x one weight
// block: UP 64 act columns (W1 rows [64 j, +64) of the gate half and their up partners, as two boxes
// of the swap map, 32 act columns each), DOWN 128 output columns (W2 rows [128 j, +128)). Items
// (total rows / 128) x blocks from the device total, tile-major; persistent grid.
//
// Roles (384 threads): warpgroup 0 gathers the tile's token rows (RowGather<128, 1, 8> over packed MX
// rows; zeros past the tile's real rows) and, per stage, every row's 4 E8M0 scale bytes (thread t:
// weight row t and token row t), thread 0 also issues the weights' TMA boxes. Warpgroups 1 and 2:
// weight rows [64 c, +64) against the 128 tokens (weights in M, tokens in N: the FP8 wgmma has no
// transpose, so both operands stay K-major), each k32 block's wgmma m64n128k32 into one partial
// fragment promoted by its two scales (acc += D * Xw * Xx) before the next block's wgmma; the other
// warpgroup's wgmmas keep the tensor cores busy meanwhile. (Two partials in flight do not fit: 64
// accumulators + 2 x 64 partial + 32 scale words exceed the 200 registers of a consumer here.)
//
// Epilogues, through one staging buffer shared by both warpgroups: UP stages silu(g) * u as fp32
// [128 tokens][64 columns]; thread u < 256 then quantizes token u / 2's MX block u % 2
// (mxdev::quantize_block32) into its packed act row. DOWN stages the weighted bf16 rows [128 tokens]
// [128 columns] and reduces them into out[pair_row] with 16-byte red.global.add.
#include "epmoe/mxfp8.h"
#include "kernels/mx_device.cuh"
#include "kernels/sm90/core/gather.cuh"
#include "kernels/sm90/core/kernel.cuh"
#include "kernels/sm90/core/ring.cuh"
#include "kernels/sm90/core/wgmma_fp8.cuh"
#include "kernels/sm90/mx_common.cuh"
#include "kernels/sm90/launch.cuh"
#include "kernels/sm90/swap_items.cuh"
#include "kernels/sm90/swap_mx.cuh"
#include "kernels/sm90/tensor_maps.cuh"
#include "kernels/sm90/tile_fp8_common.cuh"
#include "kernels/sm90/up_common.cuh"
#include "kernels/sm90/zero_out.cuh"

namespace epmoe::kernels::sm90 {

inline constexpr uint32_t kMxTileProducerRegs = 104, kMxTileConsumerRegs = 200;
inline constexpr int kMxTileGatherThreads = 128;

#if EPMOE_SM90A_DEVICE
namespace {

// The weight row (in w*_scale's rows) of A-tile row i < 128. UP: box c = i / 64 of the e4m3 swap map
// (box {128, 8, 2, 4} at 32-column block 2 j + c) lands row r + 8 p + 16 b of the box as W1 row
// p * ffn + 32 (2 j + c) + 8 b + r of expert e.
template <bool kUp>
__device__ __forceinline__ int64_t tile_weight_row(const MxArgs& a, const MxTileItem& it, int i) {
  if constexpr (kUp) {
    const int c = i >> 6, r = i & 7, p = (i >> 3) & 1, b = (i >> 4) & 3;
    return int64_t(it.e) * 2 * a.ffn + int64_t(p) * a.ffn + 32 * (2 * it.j + c) + 8 * b + r;
  } else {
    return int64_t(it.e) * a.hidden + int64_t(kMxTileWeightRows) * it.j + i;
  }
}

// acc += part * Xw[row] * Xx[token] for k32 block q: byte q of wa[h] (rows 16 wl + lane / 4 + 8 h)
// and of wb[2 g + b] (tokens 8 g + 2 (lane % 4) + b).
__device__ __forceinline__ void promote_tile_block(float (&acc)[64], const float (&part)[64], const uint32_t (&wa)[2],
                                                   const uint32_t (&wb)[32], int q) {
  const float xa0 = e8m0_to_f32((wa[0] >> (8 * q)) & 0xFFu), xa1 = e8m0_to_f32((wa[1] >> (8 * q)) & 0xFFu);
#pragma unroll
  for (int g = 0; g < 16; ++g)
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const float xb = e8m0_to_f32((wb[2 * g + b] >> (8 * q)) & 0xFFu);
      acc[4 * g + b] = fmaf(part[4 * g + b], xa0 * xb, acc[4 * g + b]);
      acc[4 * g + 2 + b] = fmaf(part[4 * g + 2 + b], xa1 * xb, acc[4 * g + 2 + b]);
    }
}

}  // namespace
#endif  // EPMOE_SM90A_DEVICE

template <bool kUp>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_mx_tile_kernel(const __grid_constant__ CUtensorMap tm_w, const MxArgs a) {
#if EPMOE_SM90A_DEVICE
  __shared__ __align__(8) uint64_t bars[2 * kMxTileStages];  // full[0..S), empty[0..S)
  extern __shared__ uint8_t dyn_smem[];
  uint8_t* ring_mem = align_1024(dyn_smem);
  const uint32_t ring_base = smem_u32(ring_mem);  // S x (A: 128 weight rows x 128 B, B: 128 token rows x 128 B)
  const uint32_t sc_base = ring_base + kMxTileStages * kMxTileStageBytes;  // S x (128 + 128 rows x 4 scales)
  const uint32_t stg = sc_base + kMxTileStages * kMxTileScaleStageBytes;
  const Ring<kMxTileStages> ring{smem_u32(&bars[0]), smem_u32(&bars[kMxTileStages])};

  const int64_t tiles = a.padded_offsets[a.experts] / kBM;
  const int blocks = kUp ? a.ffn / 64 : a.hidden / kMxTileWeightRows;
  const int64_t items = tiles * blocks;
  const int k_dim = kUp ? a.hidden : a.ffn;
  const int num_k = k_dim / kMxBK;
  ZeroPlan zero = kUp ? make_zero_plan<false>(a.zero_out, a.zero_chunks, items) : ZeroPlan{};
  if (!start_persistent_kernel<kUp>(ring, zero, items, kThreads, 1 + kMxTileGatherThreads, kConsumerThreads)) return;

  const int64_t first = blockIdx.x, stride = gridDim.x;
  run_warp_roles<kMxTileProducerRegs, kMxTileConsumerRegs>(
      [&] {
        // ---- producer: token rows and every row's scales; thread 0 also the weights' boxes ----
        const int t = int(threadIdx.x);
        const RowGather<kMxTileGatherThreads, 1, 8> gather(ring_base + kMxTileATileBytes, t, k_dim / 2);
        // (RowGather moves 16-byte chunks of bf16 rows: a packed row of row_bytes is row_bytes / 2 of
        // them, a stage's 128 bytes kBK of them; the scales past k_dim bytes are not data.)
        const __nv_bfloat16* src16 = reinterpret_cast<const __nv_bfloat16*>(a.src);
        const int src_row16 = int(a.src_row_bytes / 2);
        if (t == 0) tma_prefetch_desc(&tm_w);
        grid_dependency_wait();  // x / act come from the previous kernel (no-op unless PDL-launched)
        RingCursor<kMxTileStages> cur;
        for (int64_t w = first; w < items; w += stride) {
          const MxTileItem it = mx_tile_item(a, w, blocks);
          const GatherRows<8> src =
              gather.rows(src16, a.src_rows, src_row16, [&](int i) { return tile_src_row<kUp>(a, it, gather.row(i)); });
          const uint8_t* w_sc = a.w_scale + tile_weight_row<kUp>(a, it, t) * (k_dim / mx::kBlock);
          const int32_t tr = tile_src_row<kUp>(a, it, t);
          const bool tok_ok = tr >= 0 && int64_t(tr) < a.src_rows;
          const uint8_t* tok_sc = a.src + (tok_ok ? int64_t(tr) * a.src_row_bytes + k_dim : 0);
          zero_step(zero, zero.per_item, t, kMxTileGatherThreads);
          for (int kt = 0; kt < num_k; ++kt, cur.advance()) {
            const uint32_t s = cur.stage(), full = ring.full(s), dst = ring_base + s * kMxTileStageBytes;
            ring.wait_empty(cur);
            if (t == 0) load_tile_weights<kUp>(dst, &tm_w, full, kt, it.e, it.j);
            gather.copy(src, s * kMxTileStageBytes, kt);
            const uint32_t sc = sc_base + s * kMxTileScaleStageBytes;
            cp_async_4_zfill(sc + uint32_t(t) * 4u, w_sc + 4 * kt, 4u);
            cp_async_4_zfill(sc + uint32_t(kMxTileWeightRows + t) * 4u, tok_sc + 4 * kt, tok_ok ? 4u : 0u);
            cp_async_mbar_arrive_noinc(full);  // full[s] hears of these copies when they land
          }
        }
        zero_step(zero, zero.end - zero.next, t, kMxTileGatherThreads);
        cp_async_wait_all();
      },
      [&](int c) {
        // ---- consumers: weight rows [64 c, +64) of each item ----
        const int wl = int(threadIdx.x / 32) & 3, lane = int(threadIdx.x & 31);
        const int u = int(threadIdx.x) - 128;  // 0..255: the epilogues' copy-out thread
        const uint32_t d0 = pin_u32(smem_desc_sw128_lo(ring_base));
        grid_dependency_wait();  // DOWN reduces into out, which UP zeroed
        RingCursor<kMxTileStages> cur;
        for (int64_t w = first; w < items; w += stride) {
          const MxTileItem it = mx_tile_item(a, w, blocks);
          float acc[64], part[64];
#pragma unroll
          for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
          for (int kt = 0; kt < num_k; ++kt, cur.advance()) {
            const uint32_t s = cur.stage();
            mbar_wait(ring.full(s), cur.parity());
            fence_proxy_async_shared();  // B came by cp.async (generic proxy); wgmma reads through the async one
            const uint32_t da = d0 + ((s * kMxTileStageBytes + uint32_t(c) * (kMxTileATileBytes / 2)) >> 4);
            const uint32_t db = d0 + ((s * kMxTileStageBytes + kMxTileATileBytes) >> 4);
            const uint32_t sc = sc_base + s * kMxTileScaleStageBytes;
            uint32_t wa[2], wb[32];
#pragma unroll
            for (int h = 0; h < 2; ++h) wa[h] = ld_shared_u32(sc + uint32_t(64 * c + 16 * wl + (lane >> 2) + 8 * h) * 4u);
#pragma unroll
            for (int g = 0; g < 16; ++g)
#pragma unroll
              for (int b = 0; b < 2; ++b)
                wb[2 * g + b] = ld_shared_u32(sc + uint32_t(kMxTileWeightRows + 8 * g + 2 * (lane & 3) + b) * 4u);
#pragma unroll
            for (int q = 0; q < kMxBK / 32; ++q) {
              wgmma_fence();  // (part was read by the previous promotion)
              WgmmaE4m3N128::mma(part, smem_desc_sw128_join(da + kKMajorK16Step * q),
                                 smem_desc_sw128_join(db + kKMajorK16Step * q), /*scale_d=*/0);
              wgmma_commit();
              wgmma_wait<0>();
              fence_regs(part);
              promote_tile_block(acc, part, wa, wb, q);
            }
            mbar_arrive(ring.empty(s));  // the stage's wgmma reads and this thread's scale reads are done
          }

          const int rows = it.rows;
          named_barrier_sync(1, kConsumerThreads);  // the previous item's copy-out has read the staging rows
          if constexpr (kUp) {
            stage_tile_swiglu<kMxTileUpStride>(stg, 32 * c + 8 * wl + (lane >> 2), acc, lane);  // of the item's 64
            named_barrier_sync(1, kConsumerThreads);
            const int tok = u >> 1, blk = u & 1;
            if (tok < rows) {
              float v[32];
#pragma unroll
              for (int i = 0; i < 8; ++i) {
                uint32_t wv[4];
                ld_shared_16(stg + uint32_t(tok * kMxTileUpStride + 32 * blk + 4 * i) * 4u, wv);
#pragma unroll
                for (int e = 0; e < 4; ++e) v[4 * i + e] = __uint_as_float(wv[e]);
              }
              uint32_t qv[8];
              const uint32_t scale = mxdev::quantize_block32(v, qv);
              uint8_t* dst = a.act + (it.m0 + tok) * a.act_row_bytes;
              const uint32_t lo[4] = {qv[0], qv[1], qv[2], qv[3]}, hi[4] = {qv[4], qv[5], qv[6], qv[7]};
              const int64_t col0 = 64 * int64_t(it.j) + 32 * blk;
              st_global_16(dst + col0, lo);
              st_global_16(dst + col0 + 16, hi);
              dst[a.ffn + 2 * it.j + blk] = uint8_t(scale);
            }
          } else {
            stage_tile_weighted(stg, a, it, acc, c, wl, lane);
            named_barrier_sync(1, kConsumerThreads);
            for (int q = u; q < rows * 16; q += kConsumerThreads) {
              const int r = q >> 4, piece = q & 15;
              const int32_t pr = a.pair_row[it.m0 + r];
              if (pr < 0 || int64_t(pr) >= a.out_rows) continue;
              uint32_t v[4];
              ld_shared_16(stg + uint32_t(r * kMxTileDownStride + 8 * piece) * 2u, v);
              red_add_bf16x8(a.out + int64_t(pr) * a.hidden + int64_t(kMxTileWeightRows) * it.j + 8 * piece, v);
            }
          }
        }
      });
#else
  (void)a;
#endif
}

void launch_mx_tile(const MxExpertProblem& p, bool up, bool pdl, cudaStream_t s) {
  check_mx_expert_problem(p, up ? "sm90_mx_up_launch (tile)" : "sm90_mx_down_launch (tile)");
  const MxArgs a = make_mx_args(p, up);
  const CUtensorMap tm = up ? make_w1_swap_map_e4m3(p.w1, p.experts, p.hidden, p.ffn)
                            : make_w2_map_e4m3(p.w2, p.experts, p.hidden, p.ffn, kMxTileWeightRows);
  const int64_t tiles = (p.rows_capacity + kBM - 1) / kBM;
  const int64_t items = tiles * (up ? p.ffn / 64 : p.hidden / kMxTileWeightRows);
  sm90_launch(up ? sm90_mx_tile_kernel<true> : sm90_mx_tile_kernel<false>, /*cluster=*/false, pdl, items,
              kMxTileSmemBytes, s, up ? "sm90_mx_tile_up" : "sm90_mx_tile_down", tm, a);
}

}  // namespace epmoe::kernels::sm90
