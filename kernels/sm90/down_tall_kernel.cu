// The 192-row DOWN: the split DOWN's second half (Sm90Plan::down_split), the 128-row DOWN's contract
// (down_kernel.cu: act, w2 -> out += weighted rows, red.global.add bf16x2) on 192-row tiles, for the
// experts the split rule sends here (schedule.cuh, split_tall_cut over DOWN's column blocks).
//
// Why: a 192 x 256 tile moves 56 KB per k step for 1.5x the MACs of the 128 x 256 tile's 48 KB and
// runs 6-12% cheaper per MAC at the 700 W cap; alone it is ~1% slower than the 128-row DOWN at
// 7168/T=2k (the drain of its staged output takes ~5 us per item when every SM ends its item at about
// the same time), so it pays only where its tiles save padding rows: the split (7168/T=2k layer
// 0.985-0.992 against the 128-row DOWN alone).
//
// The tile (core Tile192): warpgroup c runs rows [64c, +64) against the whole 256-row W2 box and the
// tile's rows [128, 192) against its half [128c, +128) of the box; 192 accumulators need the
// consumers at 232 registers, so the producer warpgroup keeps 40 and no packed output fits beside
// them. Epilogue: a 3-deep ring of 56 KB stages leaves 48 KB for a staging buffer; a warpgroup stores
// its weighted bf16 output (three 64 x 128 halves, stmatrix) there and goes on to the next item, and
// warps 1..3 of the producer warpgroup reduce it into out with 16-byte reds. The buffer takes one
// warpgroup's output at a time (warpgroup 0's, then 1's), so warpgroup 1 waits for warpgroup 0's
// drain while warpgroup 0 runs the next item's first k steps alone (one warpgroup's m64n256 chain
// fills the tensor pipe); the ring's slots never wait for the reducers.
//
// Tiles and schedule: tall_schedule.cuh (a last tile may reach past its segment: those rows are
// loaded and computed but never reduced). By expert, single CTAs, persistent grid; no tail split or
// padding halves. PDL: launched once every CTA of the 128-row half has seen the UP grid complete
// (griddepcontrol.wait there), so act and out's zeroing are complete: no wait up front. Thread 0 of
// every CTA waits for the 128-row half before leaving, so this grid completes after it and whatever
// waits on this grid sees all of out.
#include "kernels/sm90/core/kernel.cuh"
#include "kernels/sm90/core/mainloop.cuh"
#include "kernels/sm90/core/ring.cuh"
#include "kernels/sm90/down_staging.cuh"
#include "kernels/sm90/launch.cuh"
#include "kernels/sm90/tall_schedule.cuh"
#include "kernels/sm90/tensor_maps.cuh"

namespace epmoe::kernels::sm90 {

inline constexpr uint32_t kTallDownProducerRegs = 40, kTallDownConsumerRegs = 232;
inline constexpr uint32_t kTallReduceBarrier = 2;  // named barrier of the reducer warps

__global__ void __launch_bounds__(kThreads, 1)
    sm90_down_tall_kernel(const __grid_constant__ CUtensorMap tm_act, const __grid_constant__ CUtensorMap tm_w2,
                          const int64_t* __restrict__ padded_offsets, const int32_t* __restrict__ pair_row,
                          const float* __restrict__ pair_weight, __nv_bfloat16* __restrict__ out, int experts,
                          int hidden, int ffn, int split_ctas, int store_pairs) {
#if EPMOE_SM90A_DEVICE
  constexpr int S = kTallDownStages;
  __shared__ __align__(8) uint64_t bars[2 * S];  // full[0..S), empty[0..S)
  __shared__ __align__(8) uint64_t staged[2];    // consumer warpgroup c's output is in the buffer
  __shared__ __align__(8) uint64_t drained[2];   // the reducers have read warpgroup c's output
  __shared__ int2 item_slots[S];
  __shared__ int32_t tile_rows[kTallRows];       // the reducers' out row of each tile row (-1: none)
  extern __shared__ uint8_t dyn_smem[];
  // (align_1024 computes the same, but ptxas then spills 4 bytes in this kernel under 232 / 40 registers)
  uint8_t* ring_mem = dyn_smem + ((1024u - (smem_u32(dyn_smem) & 1023u)) & 1023u);
  int32_t* item_off = reinterpret_cast<int32_t*>(ring_mem + size_t(S) * kTallStageBytes + kTallDownStagingBytes);
  int32_t* seg64 = item_off + experts + 1;
  const int nn = (hidden + kBN - 1) / kBN, num_k = ceil_div(ffn, kBK);
  const uint32_t sA = smem_u32(ring_mem), sB = sA + S * kTallATileBytes;
  const uint32_t stg = sA + S * kTallStageBytes;  // the staging buffer
  const Ring<S> ring{smem_u32(&bars[0]), smem_u32(&bars[S])};
  const uint32_t staged0 = smem_u32(&staged[0]), drained0 = smem_u32(&drained[0]);
  if (threadIdx.x == 0) {
    ring.init(1, kConsumerThreads);
    for (int c = 0; c < 2; ++c) {
      mbar_init(staged0 + 8 * c, 128);
      mbar_init(drained0 + 8 * c, 32 * kReducerWarps);
    }
    mbar_fence_init();
  }
  build_tall_schedule(padded_offsets, pair_row, experts, nn, item_off, seg64, split_ctas);  // (ends in a CTA barrier)
  const int64_t items = item_off[experts];
  if (int64_t(blockIdx.x) >= items) {
    if (threadIdx.x == 0) grid_dependency_wait();
    return;
  }

  run_warp_roles<kTallDownProducerRegs, kTallDownConsumerRegs>(
      [&] {
        if (threadIdx.x >= 32) {
          // ---------------- reducers (warps 1..3): the staging buffer -> out ----------------
          // Per item, warpgroup 0's output, then warpgroup 1's (the consumers' waits keep that order).
          const int rw = int(threadIdx.x / 32) - 1, lane = int(threadIdx.x & 31), j = lane & 15;
          uint32_t lp = 0;  // the parity of this CTA's items so far
          for (int64_t w = blockIdx.x; w < items; w += gridDim.x, lp ^= 1u) {
            // The item (decoded as the producer does) and its rows' out rows, loaded into tile_rows while
            // the consumers still run its k loop, so the drain reads them from shared memory.
            const TallItem t = tall_item(w, item_off, seg64, experts, nn, kGroupTiles);
            named_barrier_sync(kTallReduceBarrier, 32 * kReducerWarps);  // the previous item's reads are done
            for (int r = int(threadIdx.x) - 32; r < kTallRows; r += 32 * kReducerWarps)
              tile_rows[r] = r >= t.rows || pair_row[t.m0 + r] < 0 ? -1
                             : store_pairs ? int32_t(t.m0 + r)  // (pair_out: the pair's own row)
                                           : pair_row[t.m0 + r];
            named_barrier_sync(kTallReduceBarrier, 32 * kReducerWarps);
            const int n0 = t.nb * kBN;
#pragma unroll 1  // (unrolled, the reducers spill at 40 registers)
            for (int c = 0; c < 2; ++c) {
              mbar_wait(staged0 + 8 * c, lp);
              for (int chunk = 0; chunk < 3; ++chunk) {
                const int col0 = chunk < 2 ? n0 + 128 * chunk : n0 + 128 * c;
                if (col0 >= hidden) continue;  // (hidden % 256 == 128: the last block's upper half)
                const uint32_t half = stg + uint32_t(chunk) * kStageHalfBytes;
                for (int rp = rw; rp < 32; rp += kReducerWarps) {  // row pairs: a half warp per row
                  const int r = 2 * rp + (lane >> 4);
                  const int32_t orow = tile_rows[(chunk < 2 ? 64 * c : 128) + r];
                  uint32_t v[4];
                  ld_shared_16(half + staged_half_offset(r, j), v);
                  if (orow < 0 || col0 + 8 * j >= hidden) continue;
                  __nv_bfloat16* dst = out + int64_t(orow) * hidden + col0 + 8 * j;
                  if (store_pairs) st_global_16(dst, v);
                  else red_add_bf16x8(dst, v);
                }
              }
              mbar_arrive(drained0 + 8 * c);  // every reducer lane releases its own reads
            }
          }
          return;
        }
        if (threadIdx.x != 0) return;
        // ---------------- producer: thread 0 decodes and issues ----------------
        tma_prefetch_desc(&tm_act);
        tma_prefetch_desc(&tm_w2);
        int64_t w = blockIdx.x;
        TallItem cur_item = tall_item(w, item_off, seg64, experts, nn, kGroupTiles);
        RingCursor<S> cur;
        int kt = 0;
        while (cur_item.valid) {
          // The next item is decoded right after this item's first issued stage, in the slack of the
          // empty waits.
          TallItem nxt{};
          bool decoded = false;
          for (; kt < num_k; ++kt, cur.advance()) {
            const uint32_t s = cur.stage(), full = ring.full(s);
            ring.wait_empty(cur);
            if (kt == 0) item_slots[s] = tall_slot(cur_item, /*zero_gap=*/false);
            mbar_arrive_expect_tx(full, kTallStageBytes);
            tma_load_2d(sA + s * kTallATileBytes, &tm_act, full, kt * kBK, int(cur_item.m0));
            tma_load_3d(sB + s * kBTileBytes, &tm_w2, full, kt * kBK, cur_item.nb * kBN, cur_item.e);
            if (!decoded) {
              nxt = tall_item(w + gridDim.x, item_off, seg64, experts, nn, kGroupTiles);
              decoded = true;
            }
          }
          if (!decoded) nxt = tall_item(w + gridDim.x, item_off, seg64, experts, nn, kGroupTiles);
          cur_item = nxt;
          w += gridDim.x;
          kt = 0;
        }
        grid_dependency_wait();  // (see the header: complete after the 128-row half)
      },
      [&](int c) {
        // ---------------- consumers ----------------
        const int warp = int(threadIdx.x / 32) & 3, lane = int(threadIdx.x & 31);
        const Tile192::Descs d = Tile192::descs(sA, sB, c);
        auto release = [&](uint32_t s, int) { mbar_arrive(ring.empty(s)); };
        RingCursor<S> cur;
        uint32_t lp = 0;  // the parity of this CTA's items so far
        const int n_items = int(items);  // < 2^31 (the launcher's bound); 32-bit keeps a register free
        for (int w = int(blockIdx.x); w < n_items; w += int(gridDim.x), lp ^= 1u) {
          Tile192::Acc acc;
          Tile192::zero(acc);
          ring.wait_full(cur);
          // This thread's rows' weights: 64c + 16 warp + lane / 4 (+ 8) against all 256 columns (h = 0,
          // 1), and 128 + 16 warp + lane / 4 (+ 8) against columns [128c, +128) (h = 2, 3). Rows outside
          // the expert's segment weigh 0 (and the reducers skip them).
          float pw[4];
          {
            const int2 slot = item_slots[cur.stage()];
            const int64_t m0 = int64_t(slot.x) * 64;
            const int rows = tall_slot_rows(slot.y);
#pragma unroll
            for (int h = 0; h < 4; ++h) {
              const int r = (h < 2 ? 64 * c : 128) + 16 * warp + (lane >> 2) + 8 * (h & 1);
              pw[h] = r < rows ? pair_weight[m0 + r] : 0.0f;
            }
          }
          mainloop<Tile192>(acc, cur, num_k, ring.full0, d, /*proxy_fence=*/false, release, [](int) {});

          // ---------------- epilogue: weighted bf16 into the staging buffer ----------------
          // The buffer takes the outputs in the order (item 0, wg 0), (0, 1), (1, 0), ...: warpgroup 1
          // stores item li's once the reducers have read warpgroup 0's (completion li of drained[0]),
          // warpgroup 0 stores item li's once they have read warpgroup 1's of item li - 1 (completion
          // li - 1 of drained[1]). Neither barrier can be two phases from the awaited one (each warpgroup
          // waited for the one before at its previous item, and the next one needs this output), so a
          // parity bit names the phase.
          if (c == 1) mbar_wait(drained0, lp);
          else if (w != int(blockIdx.x)) mbar_wait(drained0 + 8, lp ^ 1u);
          pack_store_half(stg, acc.d, 0, pw[0], pw[1], warp, lane);
          pack_store_half(stg + kStageHalfBytes, acc.d, 1, pw[0], pw[1], warp, lane);
          pack_store_half(stg + 2 * kStageHalfBytes, acc.x, 0, pw[2], pw[3], warp, lane);
          mbar_arrive(staged0 + 8 * c);
        }
        grid_launch_dependents();
      });
#else
  (void)padded_offsets, (void)pair_row, (void)pair_weight, (void)out, (void)experts, (void)hidden, (void)ffn,
      (void)split_ctas, (void)store_pairs;
#endif
}

void launch_down_tall_kernel(const ExpertProblem& p, int split_ctas, cudaStream_t s) {
  EPMOE_CHECK(split_ctas > 0, ErrorCode::internal, "launch_down_tall_kernel: split_ctas must be > 0");
  EPMOE_CHECK(fits_smem(tall_down_smem_bytes(p.experts), kTallStaticSmemReserve), ErrorCode::internal,
              "launch_down_tall_kernel: the 192-row DOWN's schedule of ", p.experts, " experts does not fit");
  const int nn = (p.hidden + kBN - 1) / kBN;
  // Items: at most ceil(P_e / 192) tiles per expert, sum <= capacity / 192 + E.
  const int64_t tiles = p.rows_capacity / kTallRows + p.experts + 1;
  const CUtensorMap tm_act = make_matrix_map(p.act, p.rows_capacity, p.ffn, kTallRows);
  const CUtensorMap tm_w2 = make_w2_map(p.w2, p.experts, p.hidden, p.ffn, kBN);
  sm90_launch(sm90_down_tall_kernel, /*cluster=*/false, /*pdl=*/true, tiles * nn, tall_down_smem_bytes(p.experts), s,
              "sm90_down_tall_kernel", tm_act, tm_w2, p.padded_offsets, p.pair_row, p.pair_weight,
              p.pair_out ? p.pair_out : p.out, p.experts, p.hidden, p.ffn, split_ctas, p.pair_out ? 1 : 0);
}

}  // namespace epmoe::kernels::sm90
