// The 192-row UP: the split UP's second half (Sm90Plan::up_split), the 128-row UP's contract
// (x gathered through pair_row, w1 -> act = bf16(silu(gate) * up)) on 192-row tiles, for the experts
// the split rule sends here (decided on the device from the counts: tall tiles cover fewer padding
// rows, and their items fill the waves well enough; split_tall_cut in schedule.cuh).
//
// Why: a 192 x 256 tile runs the mainloop 6-7% (weights in L2) to 10-12% (from DRAM) cheaper per MAC
// at the 700 W cap than the 128 x 256 one; as the split UP, the 7168/T=2k layer got 2.5-2.7% faster.
// Its epilogue stores act from registers (store_act_half): with 192 accumulators there is no room for
// staging boxes beside a 4-deep ring, and items at hidden 7168 are 112 k steps long.
//
// The tile (core Tile192): warpgroup c runs rows [64c, +64) against the whole 256-row W1 box and the
// tile's rows [128, 192) against its half [128c, +128) of the box. For the second to hold gate/up
// partners, W1 comes through the interleaved map (try_make_w1_interleaved_map): gate rows [128j, +64),
// their up partners, gate rows [128j + 64, +64), theirs. So in the m64n256 fragment column group g < 8
// is gate with its up partner at g + 8 (act columns [0, 64)) and 16 <= g < 24 likewise (act columns
// [64, 128)); in the m64n128 fragment of warpgroup c, g < 8 is gate with its partner at g + 8 (act
// columns [64c, +64)).
//
// Tiles and schedule: tall_schedule.cuh (each picked segment as ceil(real / 192) tiles over the
// unchanged 128-padded layout; rows past the segment are computed and never stored; the segment's 64
// rows past its last tall tile, which no tile covers, are zeroed by that tile's consumers). By expert,
// single CTAs, persistent. A rows gathered by the 128 producer threads (RowGather<128, 4, 3>: 3 row
// pointers of the current item, loaded as the item starts, so the producer fits 56 registers).
// PDL: launched after the 128-row half, which started after x was complete; thread 0 of every CTA
// waits for the 128-row half before it exits, so DOWN's wait for this grid covers both halves of act.
#include "kernels/sm90/core/gather.cuh"
#include "kernels/sm90/core/kernel.cuh"
#include "kernels/sm90/core/mainloop.cuh"
#include "kernels/sm90/core/ring.cuh"
#include "kernels/sm90/launch.cuh"
#include "kernels/sm90/tall_schedule.cuh"
#include "kernels/sm90/tensor_maps.cuh"
#include "kernels/sm90/up_common.cuh"

namespace epmoe::kernels::sm90 {

inline constexpr uint32_t kTallUpProducerRegs = 56, kTallUpConsumerRegs = 224;
inline constexpr int kTallGatherRows = kTallRows / 64;  // rows per producer thread (4 chunks each)

__global__ void __launch_bounds__(kThreads, 1)
    sm90_up_tall_kernel(const __grid_constant__ CUtensorMap tm_w1, const int64_t* __restrict__ padded_offsets,
                        const int32_t* __restrict__ pair_row, __nv_bfloat16* __restrict__ act, int experts, int hidden,
                        int ffn, const __nv_bfloat16* __restrict__ x, int64_t x_rows, int split_ctas) {
#if EPMOE_SM90A_DEVICE
  constexpr int S = kTallUpStages;
  __shared__ __align__(8) uint64_t bars[2 * S];  // full[0..S), empty[0..S)
  __shared__ int2 item_slots[S];
  extern __shared__ uint8_t dyn_smem[];
  uint8_t* ring_mem = align_1024(dyn_smem);
  int32_t* item_off = reinterpret_cast<int32_t*>(ring_mem + size_t(S) * kTallStageBytes);
  int32_t* seg64 = item_off + experts + 1;
  const int nn = ffn / 128, num_k = ceil_div(hidden, kBK);  // (ffn % 128 == 0: the interleaved map)
  const uint32_t sA = smem_u32(ring_mem), sB = sA + S * kTallATileBytes;
  const Ring<S> ring{smem_u32(&bars[0]), smem_u32(&bars[S])};
  if (threadIdx.x == 0) {
    ring.init(1 + 128, kConsumerThreads);  // full: thread 0's expect_tx + each producer thread's copies
    mbar_fence_init();
  }
  build_tall_schedule(padded_offsets, pair_row, experts, nn, item_off, seg64, split_ctas);  // (ends in a CTA barrier)
  const int64_t items = warp_uniform_i64(item_off[experts]);  // (uniform: the consumers' loop bound)
  // The split's second half: leaving waits for the 128-row half (see the header).
  auto finish = [&] {
    if (threadIdx.x == 0) grid_dependency_wait();
  };
  if (int64_t(blockIdx.x) >= items) {
    finish();
    return;
  }
  grid_launch_dependents();  // as in up_kernel.cu: DOWN waits for this whole grid before reading act

  run_warp_roles<kTallUpProducerRegs, kTallUpConsumerRegs>(
      [&] {
        // ---- producer: every thread gathers its A rows, thread 0 loads W1 and publishes the item ----
        const int t = int(threadIdx.x);
        const RowGather<128, 4, kTallGatherRows> gather(sA, t, hidden);
        if (t == 0) tma_prefetch_desc(&tm_w1);
        RingCursor<S> cur;
        for (int64_t w = blockIdx.x;; w += gridDim.x) {
          const TallItem ti = tall_item(w, item_off, seg64, experts, nn, kGroupTiles);
          if (!ti.valid) break;
          // Rows past the segment: zeros, not stored.
          const GatherRows<kTallGatherRows> rows = gather.rows(x, x_rows, hidden, [&](int i) {
            const int l = gather.row(i);
            return l < ti.rows ? pair_row[ti.m0 + l] : int32_t(-1);
          });
          for (int kt = 0; kt < num_k; ++kt, cur.advance()) {
            const uint32_t s = cur.stage(), full = ring.full(s);
            ring.wait_empty(cur);
            if (t == 0) {
              if (kt == 0) item_slots[s] = tall_slot(ti, /*zero_gap=*/true);
              mbar_arrive_expect_tx(full, kBTileBytes);
              tma_load_4d(sB + s * kBTileBytes, &tm_w1, full, kt * kBK, 0, 2 * ti.e, 2 * ti.nb);
            }
            gather.copy(rows, s * kTallATileBytes, kt);
            cp_async_mbar_arrive_noinc(full);  // full[s] hears of these copies when they land
          }
        }
        cp_async_wait_all();  // leave with no copies of its own in flight
        finish();
      },
      [&](int c) {
        // ---- consumers: the core's mainloop on Tile192, then SwiGLU and act stores from registers ----
        const int warp = int(threadIdx.x / 32) & 3, lane = int(threadIdx.x & 31), q = lane & 3;
        const Tile192::Descs d = Tile192::descs(sA, sB, c);
        auto release = [&](uint32_t s, int) { mbar_arrive(ring.empty(s)); };
        RingCursor<S> cur;
        for (int w = int(blockIdx.x); w < int(items); w += int(gridDim.x)) {
          Tile192::Acc acc;
          Tile192::zero(acc);
          ring.wait_full(cur);
          const int2 slot = item_slots[cur.stage()];
          mainloop<Tile192>(acc, cur, num_k, ring.full0, d, /*proxy_fence=*/true, release, [](int) {});
          const int64_t m0 = int64_t(slot.x) * 64;
          const int rows = tall_slot_rows(slot.y), col = tall_slot_block(slot.y) * 128;
          const int r0 = 16 * warp + (lane >> 2);
          store_act_half(act, acc.d, acc.d + 32, m0, 64 * c + r0, rows, ffn, col, q);            // act [0, 64)
          store_act_half(act, acc.d + 64, acc.d + 96, m0, 64 * c + r0, rows, ffn, col + 64, q);  // [64, 128)
          store_act_half(act, acc.x, acc.x + 32, m0, 128 + r0, rows, ffn, col + 64 * c, q);      // extra rows
          if ((slot.y >> kTallGapBit) & 1) store_gap_zeros(act, m0 + kTallRows, ffn, col);
        }
      });
#else
  (void)padded_offsets, (void)pair_row, (void)act, (void)experts, (void)hidden, (void)ffn, (void)x, (void)x_rows,
      (void)split_ctas;
#endif
}

bool up_tall_kernel_ready(const ExpertProblem& p) {
  CUtensorMap m;
  return fits_smem(tall_up_smem_bytes(p.experts)) && try_make_w1_interleaved_map(p.w1, p.experts, p.hidden, p.ffn, &m);
}

void launch_up_tall_kernel(const ExpertProblem& p, int split_ctas, cudaStream_t s) {
  EPMOE_CHECK(split_ctas > 0, ErrorCode::internal, "launch_up_tall_kernel: split_ctas must be > 0");
  CUtensorMap tm_w1;
  EPMOE_CHECK(fits_smem(tall_up_smem_bytes(p.experts)) &&
                  try_make_w1_interleaved_map(p.w1, p.experts, p.hidden, p.ffn, &tm_w1),
              ErrorCode::internal, "launch_up_tall_kernel: the 192-row UP cannot run here (check up_tall_kernel_ready "
              "before the 128-row half)");
  // Items: at most ceil(P_e / 192) tiles per expert, sum <= capacity / 192 + E, times ffn / 128.
  const int64_t items = (p.rows_capacity / kTallRows + p.experts + 1) * (p.ffn / 128);
  sm90_launch(sm90_up_tall_kernel, /*cluster=*/false, /*pdl=*/true, items, tall_up_smem_bytes(p.experts), s,
              "sm90_up_tall_kernel", tm_w1, p.padded_offsets, p.pair_row, p.act, p.experts, p.hidden, p.ffn, p.x,
              p.x_rows, split_ctas);
}

}  // namespace epmoe::kernels::sm90
