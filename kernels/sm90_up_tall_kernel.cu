// UP projection + SwiGLU on 192-row tiles (the split UP's tall half, the default; every expert with
// EPMOE_SM90_UP_ROWS=192): the contract of
// sm90_up_kernel.cu (xs, w1 -> act = bf16(silu(gate) * up)), with taller items.
//
// Why: a 192 x 256 tile runs the mainloop 6-7% (L2-resident) to 10-12% (weights from DRAM) cheaper per
// MAC at the 700 W cap than the 128 x 256 one (docs/PERF.md, session 27). In DOWN the tall tile did
// not pay: its epilogue (a 256-column row of reductions per row) has no room beside 192 accumulators.
// UP's is smaller (128 activation columns per row after SwiGLU, plain stores) and its items at
// hidden 7168 are 112 k steps long, so here it is stored from registers (the "direct" form).
// Measured (session 28): the 7168/T=2k layer 1.5-2% faster than with the 128-row pairs, all of it
// clock (per cycle the two tiles do the same work). Opt-in: a 192-row tile costs 1.5 of a 128-row one
// whatever it holds, and the rows the tall tiles cover swing with the per-expert counts (+12.5% over
// the 128-row tiles' at 448 rows per expert), which the launch cannot see.
//
// The tile: warpgroup c runs rows [64c, 64c + 64) against the whole 256-row W1 box (m64n256) and the
// tile's rows [128, 192) against its half [128c, 128c + 128) of the box (m64n128). For the second to
// hold gate/up partners, W1 comes through the interleaved map (try_make_w1_interleaved_map): the box
// is gate rows [128j, +64), their up partners, gate rows [128j + 64, +64), theirs. So in the m64n256
// fragment, column group g < 8 is gate with its up partner at g + 8 (act columns [0, 64)) and
// 16 <= g < 24 likewise (act columns [64, 128)); in the m64n128 fragment of warpgroup c, g < 8 is gate
// with its partner at g + 8 (act columns [64c, 64c + 64)).
//
// Tiles, schedule and ring as in sm90_down_tall_kernel.cu (sm90_tall_schedule.cuh): each segment
// runs as ceil(real / 192) tiles; rows of a tile past its segment are computed and never stored, and
// a segment's 64 rows past its last tall tile (padding only; no tile covers them) are zeroed by that
// tile's consumers (store_gap_zeros; EPMOE_SM90_UP_ZERO_GAP=off leaves them unwritten) - DOWN masks
// padding rows by pair_row, so their act is never reduced, but it multiplies them. By expert, single
// CTAs, persistent; the producer decodes each item and zeroes its share of out (zero_out) as the 128-row UP does. PDL dependents
// are released as the CTA starts, as there.
//
// A rows: from xs by TMA (p.x null: gather_rows ran first), or gathered from the token-ordered x
// (p.x set, the engine's default) by all 128 producer threads with cp.async, as the 128-row UP's
// produce_gathered: the layer then skips gather_rows' write and re-read of xs. The gathering
// producer keeps only 3 source-row pointers of the current item (4 chunks each) and loads them as
// the item starts, so it fits 56 registers beside consumers at 224 (kTallUpProducerRegs).
#include "kernels/cuda_check.cuh"
#include "kernels/sm90_common.cuh"
#include "kernels/sm90_experts.cuh"
#include "kernels/sm90_launch_config.cuh"
#include "kernels/sm90_tall_schedule.cuh"
#include "kernels/sm90_tensor_maps.cuh"
#include "kernels/sm90_wgmma_n.cuh"
#include "kernels/sm90_work_items.cuh"
#include "kernels/sm90_zero_out.cuh"

namespace epmoe::kernels {
namespace sm90 {

// Registers after setmaxnreg: the gathering producer needs more than the 192-row DOWN's 40, so the
// consumers (192 accumulators) run at 224, which ptxas builds without spills here.
inline constexpr uint32_t kTallUpProducerRegs = 56, kTallUpConsumerRegs = 224;
static_assert(setmaxnreg_split_fits(kTallUpProducerRegs, kTallUpConsumerRegs), "the consumers would wait forever in setmaxnreg.inc");
inline constexpr int kTallGatherRows = kTallRows / 64;  // rows per gathering producer thread (4 chunks each)

#if EPMOE_SM90A_DEVICE
// SwiGLU of 32 gate values and their 32 up partners (one 64-column half of act for this thread's two
// rows), stored from registers: lane q of a quad gets 16 contiguous bytes per 32-column block by a
// quad transpose. Rows at or past `rows` (outside the segment) are not stored. All lanes must call.
__device__ __forceinline__ void store_act_half(__nv_bfloat16* __restrict__ act, const float* gate, const float* up,
                                               bool tanh_form, int64_t m0, int r0, int rows, int ffn, int col0, int q) {
  uint32_t words[16];
  swiglu_words(words, gate, up, tanh_form);
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
// tile, which no tile covers (EPMOE_SM90_UP_ZERO_GAP=on). DOWN computes them and masks their output, so
// zeros change no result; left unwritten they hold whatever an earlier call left (stale activations,
// or NaNs in a fresh workspace), so act's padding is zero everywhere as after the 128-row UP. Measured
// neutral at 7168/T=2k (session 30). Both consumer warpgroups, 4 coalesced 16-byte stores per thread
// (16 KB).
__device__ __forceinline__ void store_gap_zeros(__nv_bfloat16* __restrict__ act, int64_t r, int ffn, int col) {
  const int i = int(threadIdx.x) - 128;  // 0..255
  const uint32_t zero[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int chunk = i + 256 * j;  // 16 chunks of 8 columns per row
    st_global_16(act + (r + (chunk >> 4)) * int64_t(ffn) + col + 8 * (chunk & 15), zero);
  }
}

// The consumer warpgroups' loop over this CTA's items (blockIdx.x, then every gridDim.x-th): per
// stage m64n256 on the warpgroup's own 64 rows and m64n128 on the tile's rows [128, 192) against its
// half of the W1 box; the previous stage released once its group is done; then SwiGLU and 16-byte
// stores of act from registers. gathered: the A rows came by cp.async (generic proxy), so each stage
// takes a proxy fence before wgmma reads it.
__device__ __forceinline__ void consume_tall_items(int items, int num_k, uint32_t sA, uint32_t sB, uint32_t full0,
                                                   uint32_t empty0, const int2* item_slots,
                                                   __nv_bfloat16* __restrict__ act, int ffn, bool tanh_form,
                                                   bool gathered_in) {
  const int c = warpgroup_index() - 1;
  const int warp = int(threadIdx.x / 32) & 3, lane = int(threadIdx.x & 31), q = lane & 3;
  const TallDescs d = tall_descs(sA, sB, c);
  const uint32_t fb = pin_u32(full0);
  const bool gathered = pin_u32(gathered_in ? 1u : 0u) != 0;
  auto release = [&](uint32_t s) { mbar_arrive(empty0 + 8 * s); };
  uint32_t it = 0;
  for (int w = int(blockIdx.x); w < items; w += int(gridDim.x)) {
    float acc[128], acc2[64];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
#pragma unroll
    for (int i = 0; i < 64; ++i) acc2[i] = 0.0f;
    int2 slot_v = make_int2(0, 0);
    for (int kt = 0; kt < num_k; ++kt, ++it) {
      const uint32_t s = it % kStages;
      mbar_wait(fb + 8 * s, (it / kStages) & 1u);
      if (gathered) fence_proxy_async_shared();  // the producers' cp.async writes, before wgmma reads them
      if (kt == 0) slot_v = item_slots[s];
      tall_k_step(acc, acc2, d, s);
      if (kt > 0) {
        wgmma_wait<1>();  // the previous stage's group is done: release it
        release((it - 1) % kStages);
      }
    }
    wgmma_wait<0>();
    fence_regs(acc);
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(acc2[i])::"memory");
    release((it - 1) % kStages);  // the item's last stage

    // ---------------- epilogue: SwiGLU, 16-byte stores of act (rows inside the segment) ----------------
    const int64_t m0 = int64_t(slot_v.x) * 64;
    const int rows = tall_slot_rows(slot_v.y), col = tall_slot_block(slot_v.y) * 128;
    const int r0 = 16 * warp + (lane >> 2);
    store_act_half(act, acc, acc + 32, tanh_form, m0, 64 * c + r0, rows, ffn, col, q);            // act [0, 64)
    store_act_half(act, acc + 64, acc + 96, tanh_form, m0, 64 * c + r0, rows, ffn, col + 64, q);  // [64, 128)
    store_act_half(act, acc2, acc2 + 32, tanh_form, m0, 128 + r0, rows, ffn, col + 64 * c, q);    // extra rows
    if ((slot_v.y >> kTallGapBit) & 1) store_gap_zeros(act, m0 + kTallRows, ffn, col);
  }
}

// Producer warpgroup in gather mode (all 128 threads): each stage's 192 x 64 A tile is copied from
// the token-ordered x with cp.async (zeros for padding rows and rows past the segment), in the
// 128B-swizzled layout the TMA would write; thread 0 also issues the W1 box. Thread t copies 16-byte
// chunks (t & 1) + 2j (j < 4) of tile rows t / 2 + 64 i (i < 3): only 3 row pointers per thread
// (with 12 rows of one chunk each, the producer spilled at 56 registers), a warp instruction reads
// one whole 32-byte sector of each of 16 rows, and all rows of a thread share one swizzle phase
// (row % 8). Each thread's copies arrive on full[s] when they land
// (cp.async.mbarrier.arrive.noinc; full counts 1 + 128 arrivals).
__device__ __forceinline__ void produce_tall_gathered(const CUtensorMap& tm_w1, const __nv_bfloat16* __restrict__ x,
                                                      int64_t x_rows, const int32_t* __restrict__ pair_row,
                                                      int hidden, uint32_t sA, uint32_t sB, uint32_t full0,
                                                      uint32_t empty0, int2* item_slots, const int32_t* item_off,
                                                      const int32_t* seg64, int experts, int nn, int group,
                                                      ZeroPlan& zero, bool split, bool zero_gap) {
  const int t = int(threadIdx.x);  // 0..127
  const int c0 = t & 1, rg = t >> 1;
  const uint32_t a_dst = sA + uint32_t(rg) * 128;
  const uint32_t phase = uint32_t(rg & 7);
  const int num_k = hidden / kBK;
  if (t == 0) tma_prefetch_desc(&tm_w1);
  // x comes from the previous kernel (no-op unless PDL-launched); in the split UP the previous kernel
  // is the 128-row UP, which started after x was complete (split_up_finish).
  if (!split) grid_dependency_wait();
  uint32_t it = 0;
  for (int64_t w = blockIdx.x;; w += gridDim.x) {
    const TallItem ti = tall_item(w, item_off, seg64, experts, nn, group);
    if (!ti.valid) break;
    const __nv_bfloat16* src[kTallGatherRows];
    uint32_t valid = 0;
#pragma unroll
    for (int i = 0; i < kTallGatherRows; ++i) {
      const int l = rg + 64 * i;
      const int32_t r = l < ti.rows ? pair_row[ti.m0 + l] : -1;  // rows past the segment: zeros, not stored
      const bool ok = r >= 0 && int64_t(r) < x_rows;
      src[i] = x + 8 * c0 + (ok ? int64_t(r) * hidden : 0);
      valid |= ok ? (1u << i) : 0u;
    }
    zero_step(zero, zero.per_item, t, 128);
    for (int kt = 0; kt < num_k; ++kt, ++it) {
      const uint32_t s = it % kStages, full = full0 + 8 * s;
      if (it >= uint32_t(kStages)) mbar_wait(empty0 + 8 * s, ((it / kStages) - 1) & 1u);
      if (t == 0) {
        if (kt == 0) item_slots[s] = tall_slot(ti, zero_gap);
        mbar_arrive_expect_tx(full, kBTileBytes);
        tma_load_4d(sB + s * kBTileBytes, &tm_w1, full, kt * kBK, 0, 2 * ti.e, 2 * ti.nb);
      }
      const uint32_t dst = a_dst + s * kTallATileBytes;
#pragma unroll
      for (int i = 0; i < kTallGatherRows; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
          cp_async_16_zfill(dst + uint32_t(i) * 64 * 128 + ((uint32_t(c0 + 2 * j) ^ phase) << 4),
                            src[i] + kt * kBK + 16 * j, (valid >> i) & 1u ? 16u : 0u);
      cp_async_mbar_arrive_noinc(full);  // full[s] hears of these copies when they land
    }
  }
  zero_step(zero, zero.end - zero.next, t, 128);  // (the share's rounding remainder)
  cp_async_wait_all();  // leave with no copies of its own in flight
}

// The split UP's 192-row half runs PDL-launched after the 128-row half and reads nothing it writes
// (its inputs were complete before that kernel started), so it does not wait for it up front. DOWN
// waits (griddepcontrol.wait) for this grid only, so thread 0 of every CTA waits here for the 128-row
// half before it exits: this grid then completes after that one, and DOWN sees both halves of act.
__device__ __forceinline__ void split_up_finish(bool split) {
  if (split && threadIdx.x == 0) grid_dependency_wait();
}
#endif

__global__ void __launch_bounds__(kThreads, 1)
    sm90_up_tall_kernel(const __grid_constant__ CUtensorMap tm_xs, const __grid_constant__ CUtensorMap tm_w1,
                        const int64_t* __restrict__ padded_offsets, const int32_t* __restrict__ pair_row,
                        __nv_bfloat16* __restrict__ act, int experts, int hidden, int ffn, int group_tiles,
                        __nv_bfloat16* __restrict__ zero_out, int64_t zero_chunks, int silu_tanh_form,
                        const __nv_bfloat16* __restrict__ x, int64_t x_rows, int split_ctas, int zero_gap_in) {
#if EPMOE_SM90A_DEVICE
  __shared__ __align__(8) uint64_t bars[2 * kStages];  // full[0..S), empty[0..S)
  __shared__ int2 item_slots[kStages];
  extern __shared__ uint8_t dyn_smem[];
  uint8_t* ring = align_1024(dyn_smem);
  int32_t* item_off = reinterpret_cast<int32_t*>(ring + size_t(kStages) * kTallStageBytes);
  int32_t* seg64 = item_off + experts + 1;
  const int nn = ffn / 128, num_k = hidden / kBK;
  const int group = group_tiles < 1 ? 1 : group_tiles;
  const uint32_t sA = smem_u32(ring), sB = sA + kStages * kTallATileBytes;
  const uint32_t full0 = smem_u32(&bars[0]), empty0 = smem_u32(&bars[kStages]);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full0 + 8 * s, x != nullptr ? 1 + 128 : 1);  // gather: + each producer thread's copies
      mbar_init(empty0 + 8 * s, kConsumerThreads);
    }
    mbar_fence_init();
  }
  const bool split = split_ctas > 0;  // the split UP's 192-row half (its rule's CTA count)
  const bool zero_gap = zero_gap_in != 0;
  build_tall_schedule(padded_offsets, pair_row, experts, nn, item_off, seg64, split_ctas);  // (ends in a CTA barrier)
  const int64_t items = warp_uniform_i64(item_off[experts]);  // (uniform: the consumers' loop bound)
  ZeroPlan zero = make_zero_plan<false>(zero_out, zero_chunks, items);
  if (int64_t(blockIdx.x) >= items) {  // no work: zero this CTA's share of out and leave
    zero_step(zero, zero.end - zero.next, int(threadIdx.x), kThreads);
    split_up_finish(split);
    return;
  }
  grid_launch_dependents();  // as in sm90_up_kernel: DOWN waits for this whole grid before reading act
  const int wg = warpgroup_index();

  if (wg == 0) {
    // ---------------- producer: warp 0 decodes (every lane), lane 0 issues ----------------
    setmaxnreg_dec<kTallUpProducerRegs>();
    if (x != nullptr) {
      produce_tall_gathered(tm_w1, x, x_rows, pair_row, hidden, sA, sB, full0, empty0, item_slots, item_off, seg64,
                            experts, nn, group, zero, split, zero_gap);
      split_up_finish(split);
      return;
    }
    if (threadIdx.x >= 32) return;
    const int lane = int(threadIdx.x);
    if (lane == 0) {
      tma_prefetch_desc(&tm_xs);
      tma_prefetch_desc(&tm_w1);
      if (!split) grid_dependency_wait();  // xs comes from the previous kernel (as in the gathering form)
    }
    uint32_t it = 0;
    for (int64_t w = blockIdx.x;; w += gridDim.x) {
      const TallItem t = tall_item(w, item_off, seg64, experts, nn, group);
      if (!t.valid) break;
      zero_step(zero, zero.per_item, lane, 32);
      if (lane == 0) {
        for (int kt = 0; kt < num_k; ++kt, ++it) {
          const uint32_t s = it % kStages, full = full0 + 8 * s;
          if (it >= uint32_t(kStages)) mbar_wait(empty0 + 8 * s, ((it / kStages) - 1) & 1u);
          if (kt == 0) item_slots[s] = tall_slot(t, zero_gap);
          mbar_arrive_expect_tx(full, kTallStageBytes);
          tma_load_2d(sA + s * kTallATileBytes, &tm_xs, full, kt * kBK, int(t.m0));
          tma_load_4d(sB + s * kBTileBytes, &tm_w1, full, kt * kBK, 0, 2 * t.e, 2 * t.nb);
        }
      }
      __syncwarp();
    }
    zero_step(zero, zero.end - zero.next, lane, 32);  // (the share's rounding remainder)
    split_up_finish(split);
  } else {
    // ---------------- consumers ----------------
    setmaxnreg_inc<kTallUpConsumerRegs>();
    consume_tall_items(int(items), num_k, sA, sB, full0, empty0, item_slots, act, ffn, silu_tanh_form != 0,
                       x != nullptr);
  }
#else
  (void)padded_offsets, (void)pair_row, (void)act, (void)experts, (void)hidden, (void)ffn, (void)group_tiles,
      (void)zero_out, (void)zero_chunks, (void)silu_tanh_form, (void)x, (void)x_rows, (void)split_ctas,
      (void)zero_gap_in;
#endif
}

}  // namespace sm90

namespace {
// The 192-row UP's launch arguments; ok false where it cannot run (the driver rejects the interleaved
// W1 map, or the schedule does not fit beside the ring).
struct TallUpArgs {
  bool ok = false;
  CUtensorMap tm_xs{}, tm_w1{};  // tm_xs: a zero map in gather mode (p.x set), never used then
  size_t smem = 0;
  int64_t items = 0;  // >= the sum of ceil(P_e / 192) x ffn / 128
};
TallUpArgs tall_up_args(const ExpertProblem& p) {
  using namespace sm90;
  TallUpArgs a;
  a.smem = tall_smem_bytes(p.experts);
  if (a.smem > kMaxDynSmemBytes - kStaticSmemReserve) return a;
  if (!try_make_w1_interleaved_map(p.w1, p.experts, p.hidden, p.ffn, &a.tm_w1)) return a;
  if (p.x == nullptr) a.tm_xs = make_matrix_map(p.xs, p.rows_capacity, p.hidden, kTallRows);
  a.items = (p.rows_capacity / kTallRows + p.experts + 1) * (p.ffn / 128);
  a.ok = true;
  return a;
}
// split_ctas > 0: the split UP's second kernel (PDL after the 128-row half, which zeroes out if
// asked), with the rule's CTA count the 128-row half was given.
void launch_tall_up(const ExpertProblem& p, const TallUpArgs& a, cudaStream_t s, int split_ctas) {
  using namespace sm90;
  const bool split = split_ctas > 0;
  const bool zero = p.zero_out && !split;
  sm90_launch(sm90_up_tall_kernel, /*cluster=*/false, /*pdl=*/split, a.items, a.smem, s, "sm90_up_tall_launch",
              a.tm_xs, a.tm_w1, p.padded_offsets, p.pair_row, p.act, p.experts, p.hidden, p.ffn, sm90_group_tiles(),
              zero ? p.out : nullptr, zero ? p.out_rows * int64_t(p.hidden) / 8 : int64_t(0),
              sm90_up_silu_tanh() ? 1 : 0, p.x, p.x_rows, split_ctas, sm90_up_zero_gap() ? 1 : 0);
}
}  // namespace

bool sm90_up_tall_launch(const ExpertProblem& p, cudaStream_t s) {
  if (sm90_up_rows() != sm90::kTallRows) return false;
  const TallUpArgs a = tall_up_args(p);
  if (!a.ok) return false;
  launch_tall_up(p, a, s, /*split_ctas=*/0);
  return true;
}

bool sm90_up_tall_split_ready(const ExpertProblem& p) { return tall_up_args(p).ok; }

void sm90_up_tall_split_launch(const ExpertProblem& p, cudaStream_t s, int split_ctas) {
  const TallUpArgs a = tall_up_args(p);
  EPMOE_CHECK(a.ok, ErrorCode::internal, "sm90_up_tall_split_launch: the 192-row UP cannot run here (check "
              "sm90_up_tall_split_ready before the 128-row half)");
  EPMOE_CHECK(split_ctas > 0, ErrorCode::internal, "sm90_up_tall_split_launch: split_ctas must be > 0");
  launch_tall_up(p, a, s, split_ctas);
}

}  // namespace epmoe::kernels
