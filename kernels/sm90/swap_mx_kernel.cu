// The MX swap-AB UP and DOWN (swap_mx.cuh): swap_ab_kernel.cu's items, roles and ring with E4M3
// operands and MX promotion.
//
// The stages, the gather and the consumers' k loop with MX promotion: mx_swap_loop.cuh.
//
// UP's epilogue: silu(g) * u into an fp32 staging tile [64 tokens][32 act columns]: the item's 32
// columns are exactly one MX block of each token's act row, so thread i < rows quantizes token i's
// block (mxdev::quantize_block32, the host quantizer's rule) and stores its 32 E4M3 bytes and its
// scale into the token's packed act row. DOWN's epilogue is the bf16 swap DOWN's: weighted bf16 rows
// reduced into out with red.global.add.
#include "epmoe/mxfp8.h"
#include "kernels/sm90/launch.cuh"
#include "kernels/sm90/mx_common.cuh"
#include "kernels/sm90/mx_swap_loop.cuh"
#include "kernels/sm90/swap_mx.cuh"
#include "kernels/sm90/tensor_maps.cuh"
#include "kernels/sm90/zero_out.cuh"

namespace epmoe::kernels::sm90 {

#if EPMOE_SM90A_DEVICE
namespace {

// The consumer warpgroup's item at N: the k loop with promotion, then the epilogue. wl: warp in the
// warpgroup (0..3); fragment rows (weight rows) 16 wl + lane / 4 + 8 h, token columns 8 g + 2 (lane % 4) + b.
template <bool kUp, int N>
__device__ __forceinline__ void mx_consume(const MxArgs& a, const SwapItem& it, RingCursor<kMxSwapStages>& cur,
                                           const Ring<kMxSwapStages>& ring, uint32_t ring_base, uint32_t sc_base,
                                           uint32_t stg, int num_k, int wl, int lane) {
  float acc[N / 2];
  mx_swap_k_loop<N>(acc, cur, ring, ring_base, sc_base, num_k, wl, lane);

  const int rows = it.rows;
  const int tid = int(threadIdx.x) - 128;  // 0..127
  named_barrier_sync(1, 128);              // the previous item's copy-out has read the staging rows
  if constexpr (kUp) {
    mx_stage_swiglu<N>(acc, stg, wl, lane);
    named_barrier_sync(1, 128);
    if (tid < rows) {
      uint32_t q[8];
      const uint32_t scale = mx_quantize_staged_row(stg, tid, q);
      uint8_t* dst = a.act + (it.m0 + tid) * a.act_row_bytes;
      const uint32_t lo[4] = {q[0], q[1], q[2], q[3]}, hi[4] = {q[4], q[5], q[6], q[7]};
      st_global_16(dst + 32 * int64_t(it.j), lo);
      st_global_16(dst + 32 * int64_t(it.j) + 16, hi);
      dst[a.ffn + it.j] = uint8_t(scale);
    }
  } else {
    swap_down_epilogue<N, false>(acc, it, rows, a.pair_weight, a.pair_row, a.out, a.out_rows, nullptr, a.hidden, stg,
                                 wl, lane, tid);
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
  // (UP: DOWN's prologue and weight loads may start)
  if (!start_persistent_kernel<kUp>(ring, zero, items, kSwapThreads, 1 + kSwapGatherThreads, 128)) return;

  const int warp = int(threadIdx.x / 32), lane = int(threadIdx.x & 31);
  const int64_t first = blockIdx.x, stride = gridDim.x;
  if (warp < 4) {
    // ---- B (the tile's first N token rows) and every row's scales, every K step ----
    const int t = int(threadIdx.x);
    const RowGather<kSwapGatherThreads, 1, 4> gather(ring_base + kMxSwapATileBytes, t, k_dim / 2);
    grid_dependency_wait();  // x / act come from the previous kernel (no-op unless PDL-launched)
    RingCursor<kMxSwapStages> cur;
    for (int64_t w = first; w < items; w += stride) {
      const SwapItem it = swap_item(a, w, tiles, half_items);
      if (it.rows == 0) continue;
      zero_step(zero, zero.per_item, t, kSwapGatherThreads);
      mx_gather_item<kUp>(a, it, gather, cur, ring, sc_base, num_k, k_dim, t);
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
      with_swap_n(it.rows, [&](auto n) {
        mx_consume<kUp, decltype(n)::value>(a, it, cur, ring, ring_base, sc_base, stg, num_k, warp - 4, lane);
      });
    }
  } else {
    // ---- weights: one 64-row box per stage ----
    if (lane == 0) tma_prefetch_desc(&tm_w);
    swap_weight_warp(a, tiles, half_items, items, ring, ring_base, kMxSwapStageBytes, num_k, lane,
                     [&](uint32_t dst, uint32_t full, int kt, const SwapItem& it) {
                       mbar_arrive_expect_tx(full, kMxSwapATileBytes);
                       if constexpr (kUp) tma_load_4d(dst, &tm_w, full, kt * kMxBK, 0, 2 * it.e, 4 * it.j);
                       else tma_load_3d(dst, &tm_w, full, kt * kMxBK, kSwapWeightRows * it.j, it.e);
                     });
  }
#else
  (void)a;
#endif
}

void launch_mx_tile(const MxExpertProblem& p, bool up, bool pdl, cudaStream_t s);    // tile_mx_kernel.cu
void launch_fp8b_tile(const MxExpertProblem& p, bool up, bool pdl, cudaStream_t s);  // tile_fp8b_kernel.cu
void launch_mx_fused(const MxExpertProblem& p, cudaStream_t s);                      // fused_mx_kernel.cu

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
              ": FP8 block-128 scales run in the tile form only (there is no block-128 swap-AB or fused kernel)");
  EPMOE_CHECK(p.form != MxForm::fused || (p.out_acc != nullptr && reinterpret_cast<uintptr_t>(p.out_acc) % 16 == 0),
              ErrorCode::invalid_argument, who, ": the fused form needs a 16-byte aligned fp32 out_acc");
}

namespace {
void refuse_fused(const MxExpertProblem& p, const char* who) {
  EPMOE_CHECK(p.form != MxForm::fused, ErrorCode::invalid_argument, who,
              ": the fused MX form runs UP and DOWN in one grid (sm90_mx_experts_launch)");
}
}  // namespace

void sm90_mx_up_launch(const MxExpertProblem& p, cudaStream_t s) {
  refuse_fused(p, "sm90_mx_up_launch");
  if (p.scales == Fp8Scales::block128) sm90::launch_fp8b_tile(p, /*up=*/true, false, s);
  else if (p.form == MxForm::tile) sm90::launch_mx_tile(p, /*up=*/true, false, s);
  else sm90::launch_mx_swap(p, /*up=*/true, false, s);
}
void sm90_mx_down_launch(const MxExpertProblem& p, cudaStream_t s, bool pdl) {
  refuse_fused(p, "sm90_mx_down_launch");
  if (p.scales == Fp8Scales::block128) sm90::launch_fp8b_tile(p, /*up=*/false, pdl, s);
  else if (p.form == MxForm::tile) sm90::launch_mx_tile(p, /*up=*/false, pdl, s);
  else sm90::launch_mx_swap(p, /*up=*/false, pdl, s);
}
void sm90_mx_experts_launch(const MxExpertProblem& p, cudaStream_t s) {
  if (p.form == MxForm::fused) return sm90::launch_mx_fused(p, s);
  sm90_mx_up_launch(p, s);
  sm90_mx_down_launch(p, s, /*pdl=*/true);
}

}  // namespace epmoe::kernels
