// DOWN projection on 192-row tiles: the contract of sm90_down_kernel.cu (act, w2 -> out += weighted
// rows, red.global.add bf16x2), with taller items. By default the split DOWN's second half (the
// experts the split rule picks, EPMOE_SM90_DOWN_ROWS=split); every expert with "192" (opt-in).
//
// Why: a 192 x 256 tile moves 56 KB per k step for 1.5x the MACs of the 128 x 256 tile's 48 KB, and on
// the mainloop tool it runs 6-7% (L2-resident) to 10-12% (weights from DRAM) faster per MAC at the
// 700 W cap (docs/PERF.md, session 27; docs/experiments/tall_tile_energy.cu). Three consumer
// warpgroups of m64n256 cannot be built (ptxas compiles a 512-thread CTA within 128 registers), so
// the same two do it: warpgroup c runs rows [64c, 64c + 64) against the whole 256-row W2 box
// (m64n256, 128 accumulators) and the tile's rows [128, 192) against its own half of the box, columns
// [128c, 128c + 128) (m64n128, 64 more). 192 accumulators need the consumers at 232 registers, so
// the producer warpgroup keeps 40, and no packed output fits beside them (the 128-row kernel holds
// half of its output in registers into the next item).
// Epilogue (session 31): a 3-deep ring of 56 KB stages leaves 48 KB for a staging buffer of its
// own. A warpgroup stores its weighted bf16 output (48 KB: three 64 x 128 halves, stmatrix) there
// and goes on to the next item; warps 1..3 of the producer warpgroup reduce it into out with
// 16-byte reds. The buffer takes one warpgroup's output at a time (warpgroup 0's, then 1's), so
// warpgroup 1 waits for warpgroup 0's drain while warpgroup 0 runs the next item's first k steps
// alone (one warpgroup's m64n256 chain fills the tensor pipe, S24-2); the ring's slots never wait
// for the reducers. Measured (S31-1): DOWN alone ~1% slower than the 128-row kernel at 7168/T=2k -
// the drain takes ~5 us per item when every SM ends its item at about the same time, and even plain
// stores of the whole output, with no reductions, are only 3.3% faster than the 128-row kernel
// (S31-2). So it pays only where its tiles save padding rows: the split DOWN (PERF session 31).
// Earlier forms (docs/PERF.md, session 27): the reds from registers ("direct") cost ~11% at
// 7168/T=2k against no epilogue; staged in the ring slots of an item's last two k steps (drained by
// the reducers, a 4-deep ring) the loads stalled at the next item's start: DOWN alone +3.7% /
// +7.5% / +9.9% over the 128-row kernel at 7168/T=2k / T=8k / 2048/T=16k.
//
// Tiles: the layout is unchanged (segments padded to 128 rows). Expert e's segment [seg, seg + P)
// holds n real rows, then padding; it runs as t = ceil(n / 192) tiles at seg + 192 j. The schedule
// finds t from P alone: t is ceil(P / 192) unless that tile's first row is already padding
// (pair_row -1: padding is each segment's tail). A last tile may reach past P into the next segment
// (P a multiple of 128, the tile 192 rows): those rows are loaded and computed but never reduced (the
// item carries its rows inside the segment). Work order by expert (sm90_schedule.cuh's expert_item
// over the tall tiles, groups of sm90_group_tiles()), single CTAs, persistent grid, static stride; no
// tail split or padding halves. PDL as in the 128-row kernel: the prologue (schedule, barriers, the
// first stages' W2 loads) runs before griddepcontrol.wait, the act loads after it.
#include "kernels/cuda_check.cuh"
#include "kernels/sm90_common.cuh"
#include "kernels/sm90_down_staging.cuh"
#include "kernels/sm90_experts.cuh"
#include "kernels/sm90_launch_config.cuh"
#include "kernels/sm90_tall_schedule.cuh"
#include "kernels/sm90_tensor_maps.cuh"
#include "kernels/sm90_wgmma_n.cuh"

namespace epmoe::kernels {
namespace sm90 {

// Static shared memory (barriers, item slots, the reducers' row table) the opt-in limit also covers.
inline constexpr size_t kTallStaticSmemReserve = 1024;
// A 3-deep ring of 56 KB stages leaves room for a 48 KB staging buffer: one consumer warpgroup's
// output of an item (its 64 rows' two 128-column halves and its 64 x 128 extra rows, three 16 KB
// halves in the stmatrix layout of sm90_down_staging.cuh). A tall k step is 1.5x a 128-row one, so
// 1.5 stages of lookahead here cover about the 128-row kernel's 2.5 (session 27's tool: a 3-deep
// tall ring equal to the 4-deep one with L2-resident operands, -3% with the weights from DRAM).
inline constexpr int kTallDownStages = 3;
inline constexpr uint32_t kTallStagingBytes = 3 * kStageHalfBytes;
inline constexpr uint32_t kTallReduceBarrier = 2;  // named barrier of the reducer warps
static_assert(kTallStagingBytes % 1024 == 0, "the staging buffer keeps the schedule after it aligned");

inline size_t tall_down_smem_bytes(int experts) { return tall_smem_bytes(experts, kTallDownStages, kTallStagingBytes); }

__global__ void __launch_bounds__(kThreads, 1)
    sm90_down_tall_kernel(const __grid_constant__ CUtensorMap tm_act, const __grid_constant__ CUtensorMap tm_w2,
                          const int64_t* __restrict__ padded_offsets, const int32_t* __restrict__ pair_row,
                          const float* __restrict__ pair_weight, __nv_bfloat16* __restrict__ out, int experts,
                          int hidden, int ffn, int group_tiles, int split_ctas) {
#if EPMOE_SM90A_DEVICE
  constexpr int S = kTallDownStages;
  __shared__ __align__(8) uint64_t bars[2 * S];  // full[0..S), empty[0..S)
  __shared__ __align__(8) uint64_t staged[2];    // consumer warpgroup c's output is in the buffer
  __shared__ __align__(8) uint64_t drained[2];   // the reducers have read warpgroup c's output
  __shared__ int2 item_slots[S];
  __shared__ int32_t tile_rows[kTallRows];       // the reducers' out row of each tile row (-1: none)
  extern __shared__ uint8_t dyn_smem[];
  // (align_1024 computes the same, but ptxas then spills 4 bytes in this kernel under 232 / 40 registers)
  uint8_t* ring = dyn_smem + ((1024u - (smem_u32(dyn_smem) & 1023u)) & 1023u);
  int32_t* item_off = reinterpret_cast<int32_t*>(ring + size_t(S) * kTallStageBytes + kTallStagingBytes);
  int32_t* seg64 = item_off + experts + 1;
  const int nn = (hidden + kBN - 1) / kBN, num_k = ffn / kBK;
  const int group = group_tiles < 1 ? 1 : group_tiles;
  const uint32_t sA = smem_u32(ring), sB = sA + S * kTallATileBytes;
  const uint32_t stg = sA + S * kTallStageBytes;  // the staging buffer
  const uint32_t full0 = smem_u32(&bars[0]), empty0 = smem_u32(&bars[S]);
  const uint32_t staged0 = smem_u32(&staged[0]), drained0 = smem_u32(&drained[0]);
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(full0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, kConsumerThreads);
    }
    for (int c = 0; c < 2; ++c) {
      mbar_init(staged0 + 8 * c, 128);
      mbar_init(drained0 + 8 * c, 32 * kReducerWarps);
    }
    mbar_fence_init();
  }
  // Split DOWN (split_ctas > 0): only the experts the rule sends here (SplitRule over nn column
  // blocks, as the 128-row half counts them). This grid is PDL-launched once every CTA of the
  // 128-row half has seen the UP grid complete (griddepcontrol.wait there), so act and the zeroing
  // of out are complete: no wait up front. Thread 0 of every CTA waits for the 128-row half before
  // leaving, so this grid completes after it and whatever waits on this grid sees all of out.
  const bool split = split_ctas > 0;
  build_tall_schedule(padded_offsets, pair_row, experts, nn, item_off, seg64, split_ctas);  // (ends in a CTA barrier)
  const int64_t items = item_off[experts];
  if (int64_t(blockIdx.x) >= items) {
    if (split && threadIdx.x == 0) grid_dependency_wait();
    return;
  }
  const int wg = warpgroup_index();

  if (wg == 0) {
    // ---------------- producer: thread 0 decodes and issues ----------------
    setmaxnreg_dec<kTallProducerRegs>();
    if (threadIdx.x >= 32) {
      // ---------------- reducers (warps 1..3): the staging buffer -> out ----------------
      // Per item, warpgroup 0's output, then warpgroup 1's (the consumers' waits keep that order).
      if (!split) grid_dependency_wait();  // out is written only after the UP grid (and the zeroing before it)
      const int rw = int(threadIdx.x / 32) - 1, lane = int(threadIdx.x & 31), j = lane & 15;
      uint32_t lp = 0;  // the parity of this CTA's items so far
      for (int64_t w = blockIdx.x; w < items; w += gridDim.x, lp ^= 1u) {
        // The item (decoded as the producer does) and its rows' out rows, loaded into tile_rows while
        // the consumers still run its main loop, so the drain reads them from shared memory.
        const TallItem t = tall_item(w, item_off, seg64, experts, nn, group);
        named_barrier_sync(kTallReduceBarrier, 32 * kReducerWarps);  // the previous item's reads are done
        for (int r = int(threadIdx.x) - 32; r < kTallRows; r += 32 * kReducerWarps)
          tile_rows[r] = r < t.rows ? pair_row[t.m0 + r] : -1;
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
              if (orow >= 0) red_add_bf16x8(out + int64_t(orow) * hidden + col0 + 8 * j, v);
            }
          }
          mbar_arrive(drained0 + 8 * c);  // every reducer lane releases its own reads
        }
      }
      return;
    }
    if (threadIdx.x != 0) return;
    tma_prefetch_desc(&tm_act);
    tma_prefetch_desc(&tm_w2);
    auto publish = [&](uint32_t s, const TallItem& t) { item_slots[s] = tall_slot(t); };
    int64_t w = blockIdx.x;
    TallItem cur = tall_item(w, item_off, seg64, experts, nn, group);
    const int npre = num_k < S ? num_k : S;
    // The first item's first stages: W2 (independent of the UP grid) before the PDL wait, act after.
    publish(0, cur);
    for (int p = 0; p < npre; ++p) {
      mbar_arrive_expect_tx(full0 + 8 * p, kTallStageBytes);
      tma_load_3d(sB + p * kBTileBytes, &tm_w2, full0 + 8 * p, p * kBK, cur.nb * kBN, cur.e);
    }
    if (!split) grid_dependency_wait();  // act is complete and visible from here on
    for (int p = 0; p < npre; ++p) tma_load_2d(sA + p * kTallATileBytes, &tm_act, full0 + 8 * p, p * kBK, int(cur.m0));
    // Ring position of the next use: stage s, and the parity of the round before it (a 3-deep ring:
    // kept as a counter pair, not divisions by 3). The first round needs no empty waits.
    uint32_t s = uint32_t(npre) % S, ph = 0;
    bool armed = npre == S;  // the ring has gone round once: later uses wait for the consumers
    int kt = npre;
    while (cur.valid) {
      // The next item is decoded right after this item's first issued stage, in the slack of the
      // empty waits (as the 128-row kernel's early decode).
      TallItem nxt{};
      bool decoded = false;
      for (; kt < num_k; ++kt) {
        const uint32_t full = full0 + 8 * s;
        if (armed) mbar_wait(empty0 + 8 * s, ph);
        if (kt == 0) publish(s, cur);
        mbar_arrive_expect_tx(full, kTallStageBytes);
        tma_load_2d(sA + s * kTallATileBytes, &tm_act, full, kt * kBK, int(cur.m0));
        tma_load_3d(sB + s * kBTileBytes, &tm_w2, full, kt * kBK, cur.nb * kBN, cur.e);
        if (++s == S) {
          s = 0;
          if (armed) ph ^= 1u;
          armed = true;
        }
        if (!decoded) {
          nxt = tall_item(w + gridDim.x, item_off, seg64, experts, nn, group);
          decoded = true;
        }
      }
      if (!decoded) nxt = tall_item(w + gridDim.x, item_off, seg64, experts, nn, group);
      cur = nxt;
      w += gridDim.x;
      kt = 0;
    }
    if (split) grid_dependency_wait();  // (see the schedule: complete after the 128-row half)
  } else {
    // ---------------- consumers ----------------
    setmaxnreg_inc<kTallConsumerRegs>();
    const int c = wg - 1;
    const int warp = int(threadIdx.x / 32) & 3, lane = int(threadIdx.x & 31);
    // Loop invariants: the descriptor low words (uniform registers) and the barrier base (pinned).
    const TallDescs d = tall_descs(sA, sB, c);
    const uint32_t fb = pin_u32(full0);
    uint32_t s = 0, ph = 0;  // ring position (stage, round parity) as the producer's, no divisions by 3
    uint32_t lp = 0;  // the parity of this CTA's items so far
    const int n_items = int(items);  // < 2^31 (the launcher's bound); 32-bit keeps a register free
    for (int w = int(blockIdx.x); w < n_items; w += int(gridDim.x), lp ^= 1u) {
      float acc[128], acc2[64];
#pragma unroll
      for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
#pragma unroll
      for (int i = 0; i < 64; ++i) acc2[i] = 0.0f;
      // This thread's rows' weights: 64c + 16 warp + lane / 4 (+ 8) against all 256 columns (h = 0,
      // 1), and 128 + 16 warp + lane / 4 (+ 8) against columns [128c, +128) (h = 2, 3). Rows outside
      // the expert's segment weigh 0 (and the reducers skip them).
      float pw[4];
      uint32_t prev = 0;  // the previous use's stage
      for (int kt = 0; kt < num_k; ++kt) {
        mbar_wait(fb + 8 * s, ph);
        if (kt == 0) {
          const int2 slot_v = item_slots[s];
          const int64_t m0 = int64_t(slot_v.x) * 64;
          const int rows = tall_slot_rows(slot_v.y);
#pragma unroll
          for (int h = 0; h < 4; ++h) {
            const int r = (h < 2 ? 64 * c : 128) + 16 * warp + (lane >> 2) + 8 * (h & 1);
            pw[h] = r < rows ? pair_weight[m0 + r] : 0.0f;
          }
        }
        tall_k_step(acc, acc2, d, s);
        if (kt > 0) {
          wgmma_wait<1>();  // the previous stage's group is done: release it
          mbar_arrive(empty0 + 8 * prev);
        }
        prev = s;
        if (++s == S) {
          s = 0;
          ph ^= 1u;
        }
      }
      wgmma_wait<0>();
      mbar_arrive(empty0 + 8 * prev);  // the item's last stage: the producer refills it now
      fence_regs(acc);
#pragma unroll
      for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(acc2[i])::"memory");

      // ---------------- epilogue: weighted bf16 into the staging buffer ----------------
      // The buffer takes the outputs in the order (item 0, wg 0), (0, 1), (1, 0), ...: warpgroup 1
      // stores item li's once the reducers have read warpgroup 0's (completion li of drained[0]),
      // warpgroup 0 stores item li's once they have read warpgroup 1's of item li - 1 (completion
      // li - 1 of drained[1]). Neither barrier can be two phases from the awaited one (each warpgroup
      // waited for the one before at its previous item, and the next one needs this output), so a
      // parity bit names the phase. Meanwhile the other warpgroup runs the next item's k steps
      // alone, at the SM's full tensor rate.
      if (c == 1) mbar_wait(drained0, lp);
      else if (w != int(blockIdx.x)) mbar_wait(drained0 + 8, lp ^ 1u);
      pack_store_half(stg, acc, 0, pw[0], pw[1], warp, lane);
      pack_store_half(stg + kStageHalfBytes, acc, 1, pw[0], pw[1], warp, lane);
      pack_store_half(stg + 2 * kStageHalfBytes, acc2, 0, pw[2], pw[3], warp, lane);
      mbar_arrive(staged0 + 8 * c);
    }
    grid_launch_dependents();
  }
#else
  (void)padded_offsets, (void)pair_row, (void)pair_weight, (void)out, (void)experts, (void)hidden, (void)ffn,
      (void)group_tiles, (void)split_ctas;
#endif
}

}  // namespace sm90

namespace {
// Whether the 192-row DOWN can run for p: its schedule must fit in shared memory beside the ring and
// the staging buffer.
bool down_tall_fits(const ExpertProblem& p) {
  using namespace sm90;
  return tall_down_smem_bytes(p.experts) <= kMaxDynSmemBytes - kTallStaticSmemReserve;
}
void launch_down_tall(const ExpertProblem& p, cudaStream_t s, bool pdl, int split_ctas) {
  using namespace sm90;
  const size_t smem = tall_down_smem_bytes(p.experts);
  const int nn = (p.hidden + kBN - 1) / kBN;
  // Items: at most ceil(P_e / 192) tiles per expert, sum <= capacity / 192 + E.
  const int64_t tiles = p.rows_capacity / kTallRows + p.experts + 1;
  const CUtensorMap tm_act = make_matrix_map(p.act, p.rows_capacity, p.ffn, kTallRows);
  const CUtensorMap tm_w2 = make_w2_map(p.w2, p.experts, p.hidden, p.ffn, kBN);
  sm90_launch(sm90_down_tall_kernel, /*cluster=*/false, pdl, tiles * nn, smem, s, "sm90_down_tall_launch", tm_act,
              tm_w2, p.padded_offsets, p.pair_row, p.pair_weight, p.out, p.experts, p.hidden, p.ffn,
              sm90_group_tiles(), split_ctas);
}
}  // namespace

bool sm90_down_tall_launch(const ExpertProblem& p, cudaStream_t s, bool pdl) {
  if (sm90_down_rows() != sm90::kTallRows || !down_tall_fits(p)) return false;
  launch_down_tall(p, s, pdl, /*split_ctas=*/0);
  return true;
}

bool sm90_down_tall_split_ready(const ExpertProblem& p) { return down_tall_fits(p); }

void sm90_down_tall_split_launch(const ExpertProblem& p, cudaStream_t s, int split_ctas) {
  EPMOE_CHECK(down_tall_fits(p), ErrorCode::internal, "sm90_down_tall_split_launch: the 192-row DOWN cannot run "
              "here (check sm90_down_tall_split_ready before the 128-row half)");
  EPMOE_CHECK(split_ctas > 0, ErrorCode::internal, "sm90_down_tall_split_launch: split_ctas must be > 0");
  launch_down_tall(p, s, /*pdl=*/true, split_ctas);
}

}  // namespace epmoe::kernels
