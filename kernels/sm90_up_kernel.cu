// UP projection + SwiGLU of the sm_90a split pipeline.
//   xs[rows_capacity, hidden] bf16, w1[E, 2*ffn, hidden] bf16 -> act[rows_capacity, ffn] bf16
//   act[r, c] = bf16(silu(g) * u), g = xs[r] . w1[e, c], u = xs[r] . w1[e, ffn + c] (fp32)
//
// Work item: xs rows [128*tile, +128), which lie in one expert's segment (segments are multiples of
// 128), and activation columns [128j, 128j + 128), j < ffn/128. The grid is persistent (one CTA per
// SM, or one 2-CTA cluster per SM pair) and walks the items in groups of row tiles, column-block-
// major inside a group (WorkGrid / WorkItem in sm90_work_items.cuh); the smem ring runs on across
// items, so the producer fills the next item's stages during the epilogue. kCluster: the two CTAs
// of a cluster take consecutive tiles and, when both are in one expert, each multicasts one W1 half
// (gate / up box of the plain map) into both rings.
// Its B operand is 256 rows of W1 - gate rows [128j, +128) then up rows [ffn + 128j, +128) -
// fetched with ONE folded rank-4 TMA box per K step (seed 000, Trick 1), so each gate column and
// its up partner land in the same thread's accumulator registers and SwiGLU happens in registers.
// The item count comes from padded_offsets[E] on the device (no host sync).
//
// Warp specialization, 384 threads: warpgroup 0 is the producer (one thread issues TMA into a
// 4-stage ring of {A 128x64, B 256x64} bf16, 128B-swizzled, with a full and an empty mbarrier per
// stage); warpgroups 1 and 2 each own 64 rows and run wgmma m64n256k16 from smem descriptors, 128
// fp32 accumulators per thread. SwiGLU in registers, by default with one tanh.approx per element
// (silu_tanh; EPMOE_SM90_SILU=exp: ex2 + rcp). Epilogue (default, "staged"): each consumer
// warpgroup writes its 64 x 128 SwiGLU result with stmatrix into two 128B-swizzled 64x64 boxes
// after the ring and one thread stores them with a TMA bulk tensor store, which runs on while the
// warpgroup starts the next item (the boxes are rewritten only after cp.async.bulk.wait_group.read;
// measured -0.2..-2.3% of the layer). "direct" (EPMOE_SM90_UP_EPILOGUE): a quad transpose gives each
// thread 16 contiguous bytes of act to store. PDL dependents (the DOWN kernel) are released as soon
// as the CTA starts.
//
// Gather mode (ExpertProblem::x set): the A tile is not TMA-loaded from xs but gathered by all 128
// producer threads with cp.async from the token-ordered x (produce_gathered), which removes the
// gather kernel's write and re-read of the whole xs (rows x hidden x 2 B each way) from the layer.
// Registers: producer 96, consumers 200 (96*128 + 200*256 <= 168*384, the launch allocation); the
// gather producer holds 16 row pointers and two decoded items (this one and the next): it spilled
// at 56, at 72-80 once it carried the by-expert decode, and at 88 with the padding-half flag rows.
// The consumers do not decode items (the producer hands them over per stage, publish_item), so 200
// leave them spill-free.
#include <cstdlib>
#include <cstring>

#include "kernels/cuda_check.cuh"
#include "kernels/sm90_common.cuh"
#include "kernels/sm90_zero_out.cuh"
#include "kernels/sm90_work_items.cuh"
#include "kernels/sm90_experts.cuh"
#include "kernels/sm90_launch_config.cuh"
#include "kernels/sm90_tensor_maps.cuh"

namespace epmoe::kernels {
namespace sm90 {

// Registers per thread after setmaxnreg (see the header comment): the gathering producer spilled at
// 56-88 (and at 96 with EPMOE_SM90_EARLY_DECODE's path: both items' row pointers live across the
// k loop), the consumers need 200.
inline constexpr uint32_t kUpProducerRegs = 104, kUpConsumerRegs = 200;
static_assert(setmaxnreg_split_fits(kUpProducerRegs, kUpConsumerRegs), "the consumers would wait forever in setmaxnreg.inc");

#if EPMOE_SM90A_DEVICE
inline constexpr int kProducerThreads = 128;
// "wait" signalling (EPMOE_SM90_GATHER_ARRIVE=wait; the default "async" lets cp.async.mbarrier.arrive
// signal each stage when its copies land, and the consumers take the proxy fence).
// Stages a producer thread keeps in flight before it signals the oldest one full: the signal needs
// the copies complete (cp.async.wait_group) and fenced for the async proxy that wgmma reads through.
// At most kStages - 2: before filling use u the producer waits for the release of use u - kStages,
// which the consumers give only after their wgmma of use u - kStages + 1 is issued, i.e. after that
// use was signalled full - at iteration u - kStages + 1 + lag, which must not be later than u - 1.
// (Lag 3 with 4 stages deadlocks; measured: the bench hung.)
inline constexpr int kGatherLag = 2;
static_assert(kGatherLag >= 1 && kGatherLag <= kStages - 2, "gather lag must be in [1, kStages - 2]");

// Thread 0's W1 loads of one stage (kBTileBytes into dst, completing on `full`): the folded rank-4
// box, or the plain map's gate and up boxes; in a multicasting cluster pair only this CTA's half
// (rank 0 gate, rank 1 up), which also lands in the peer.
__device__ __forceinline__ void load_w1_stage(const CUtensorMap* tm_w1, uint32_t full, uint32_t dst, int k0, int e, int j,
                                              int ffn, int w1_folded, bool multicast, uint32_t rank) {
  if (multicast) {
    tma_load_3d_multicast(dst + rank * (kBTileBytes / 2), tm_w1, full, k0, rank != 0 ? ffn + 128 * j : 128 * j, e,
                          uint16_t(0x3));
  } else if (w1_folded) {
    tma_load_4d(dst, tm_w1, full, k0, 0, 2 * e, j);
  } else {
    tma_load_3d(dst, tm_w1, full, k0, 128 * j, e);
    tma_load_3d(dst + kBTileBytes / 2, tm_w1, full, k0, ffn + 128 * j, e);
  }
}

// The staged epilogue's store of consumer warpgroup c's 64 x 128 SwiGLU words: stmatrix into its two
// 64x64 staging boxes at stg (the TMA's 128B-swizzled layout), then one thread stores them with TMA to
// act rows [m0 + 64c, +64), columns [128 nb, +128) and the warpgroup goes on; the boxes are rewritten
// only after that store has read them (checked an item later, so no wait in practice).
__device__ __forceinline__ void store_act_staged(const CUtensorMap* tm_act, uint32_t stg, const uint32_t (&words)[32],
                                                 int c, int warp, int lane, int64_t m0, int nb) {
  if ((threadIdx.x & 127) == 0) bulk_wait_read_all();
  named_barrier_sync(1 + c, 128);
  const int mi = lane >> 3, rr = lane & 7;
  const uint32_t row_off = uint32_t(16 * warp + rr + 8 * (mi & 1)) * 128u;
#pragma unroll
  for (int gp = 0; gp < 8; ++gp) {  // gate-group pairs (2gp, 2gp + 1): words 4gp .. 4gp + 3
    const uint32_t v[4] = {words[4 * gp], words[4 * gp + 1], words[4 * gp + 2], words[4 * gp + 3]};
    const int chunk = 2 * gp + (mi >> 1);  // 8-column group of the 128: box chunk / 8, column chunk % 8
    stmatrix_x4(stg + uint32_t(chunk >> 3) * 8192u + row_off + (uint32_t((chunk & 7) ^ rr) << 4), v);
  }
  fence_proxy_async_shared();  // the stmatrix writes, before the TMA (async proxy) reads them
  named_barrier_sync(1 + c, 128);
  if ((threadIdx.x & 127) == 0) {
    const int row = int(m0) + 64 * c;
    tma_store_2d(tm_act, stg, 128 * nb, row);
    tma_store_2d(tm_act, stg + 8192u, 128 * nb + 64, row);
    bulk_commit();
  }
}

// Producer warpgroup in gather mode (all 128 threads): the A tile is gathered straight from the
// token-ordered x by cp.async (row pair_row[r], zero rows for padding), written in the same 128B-
// swizzled layout the TMA would produce; thread 0 also issues the W1 TMA. Thread t copies 16-byte
// chunk t % 8 of rows t / 8 + 16 i (i < 8) of the 128 x 64 tile, so a warp covers 4 whole 128-byte
// row slices per instruction and every row of a thread has the same swizzle phase (row % 8).
// A cluster CTA without a tile (WorkItem::compute false) gathers zeros (its m0 is past the total).
template <bool kCluster>
__device__ __forceinline__ void produce_gathered(const CUtensorMap& tm_w1, const int64_t* __restrict__ padded_offsets,
                                                 int experts, int hidden, int ffn, int w1_folded,
                                                 const __nv_bfloat16* __restrict__ x, int64_t x_rows,
                                                 const int32_t* __restrict__ pair_row, uint32_t sA, uint32_t sB,
                                                 uint32_t full0, uint32_t empty0, const WorkGrid& grid,
                                                 bool async_arrive, int2* item_slots, ZeroPlan& zero,
                                                 const int32_t* pad_pair_row, bool early) {
  const int t = int(threadIdx.x);  // 0..127
  const int chunk = t & 7, rg = t >> 3;
  const uint32_t a_dst = sA + uint32_t(rg) * 128 + (uint32_t(chunk ^ (rg & 7)) << 4);
  const __nv_bfloat16* xc = x + chunk * 8;
  const int num_k = hidden / kBK;
  if (t == 0) tma_prefetch_desc(&tm_w1);
  grid_dependency_wait();  // x comes from the previous kernel (no-op unless PDL-launched)

  // Source rows of an item's tile for this thread; bit i of the mask: row i is real (else zeros).
  auto load_rows = [&](const WorkItem& wi, const __nv_bfloat16* (&src)[8], uint32_t& valid) {
    valid = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      int32_t r = -1;
      if (wi.m0 < grid.total) r = pair_row[wi.m0 + rg + 16 * i];  // >= total: no rows (idle rank, or past the end)
      // (a half item gathers only its own 64 rows; the other warpgroup's read zeros and are not used)
      const bool mine = half_has_rows(wi.half, i < 4 ? 0 : 1);
      const bool ok = mine && r >= 0 && int64_t(r) < x_rows;
      src[i] = xc + (ok ? int64_t(r) * hidden : 0);
      valid |= ok ? (1u << i) : 0u;
    }
  };

  // Each item is decoded once, an item ahead, so its rows' pair_row loads are in flight early (and its
  // padding-half flag row: every thread reads it, so all keep the same WorkItem).
  ItemWalk<kCluster> walk(grid, pad_pair_row);
  const __nv_bfloat16* src[8];
  uint32_t valid;
  load_rows(walk.cur, src, valid);
  uint32_t it = 0;
  // early (EPMOE_SM90_EARLY_DECODE bit 1, opt-in): the next item's decode, expert, row loads and
  // zeroing share run after this item's first stage is issued, in the producer's slack, instead of
  // between an item's last stage and the next one's first.
  bool mc_next = false;
  int e_next = early ? work_expert<kCluster>(padded_offsets, experts, walk.cur, grid, mc_next) : 0;  // whole warp
  for (; walk.cur.valid; walk.advance()) {
    const WorkItem& wi = walk.cur;
    bool multicast = mc_next;
    int e = e_next;
    const __nv_bfloat16* nsrc[8];
    uint32_t nvalid = 0;
    if (!early) {
      e = work_expert<kCluster>(padded_offsets, experts, wi, grid, multicast);  // whole warp
      walk.fetch_next();
      load_rows(walk.next, nsrc, nvalid);
      zero_step(zero, zero.per_item, t, kProducerThreads);
    }
    for (int kt = 0; kt < num_k; ++kt, ++it) {
      const uint32_t s = it % kStages;
      if (it >= uint32_t(kStages)) mbar_wait(empty0 + 8 * s, ((it / kStages) - 1) & 1u);
      const uint32_t full = full0 + 8 * s;
      if (t == 0) {
        if (kt == 0) publish_item(item_slots, s, wi);
        mbar_arrive_expect_tx(full, kBTileBytes);
        load_w1_stage(&tm_w1, full, sB + s * kBTileBytes, kt * kBK, e, wi.nb, ffn, w1_folded, multicast, grid.rank);
      }
      const uint32_t dst = a_dst + s * kATileBytes;
#pragma unroll
      for (int i = 0; i < 8; ++i)
        cp_async_16_zfill(dst + uint32_t(i) * 16 * 128, src[i] + kt * kBK,
                          (valid >> i) & 1u ? 16u : 0u);
      if (async_arrive) {
        cp_async_mbar_arrive_noinc(full);  // full[s] hears of these copies when they land
      } else {
        cp_async_commit();
        if (it >= uint32_t(kGatherLag)) {
          cp_async_wait<kGatherLag>();  // the group of use it - kGatherLag has landed
          fence_proxy_async_shared();
          mbar_arrive(full0 + 8 * ((it - kGatherLag) % kStages));
        }
      }
      if (early && kt == 0) {
        walk.fetch_next();
        load_rows(walk.next, nsrc, nvalid);
        e_next = work_expert<kCluster>(padded_offsets, experts, walk.next, grid, mc_next);  // whole warp
        zero_step(zero, zero.per_item, t, kProducerThreads);
      }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) src[i] = nsrc[i];
    valid = nvalid;
  }
  zero_step(zero, zero.end - zero.next, t, kProducerThreads);  // (the share's rounding remainder)
  if (!async_arrive) {
    cp_async_wait<0>();
    fence_proxy_async_shared();
    for (uint32_t u = it > uint32_t(kGatherLag) ? it - kGatherLag : 0; u < it; ++u)
      mbar_arrive(full0 + 8 * (u % kStages));
  } else {
    // Do not leave with copies in flight: the thread's last stages are signalled by the copy engine,
    // but its own outstanding cp.async should complete before it exits (it idles here anyway).
    cp_async_wait_all();
  }
}
#endif

template <bool kCluster>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_up_kernel(const __grid_constant__ CUtensorMap tm_xs, const __grid_constant__ CUtensorMap tm_w1,
                   const __grid_constant__ CUtensorMap tm_act,
                   const int64_t* __restrict__ padded_offsets, __nv_bfloat16* __restrict__ act, int experts,
                   int hidden, int ffn, int w1_folded, const __nv_bfloat16* __restrict__ x, int64_t x_rows,
                   const int32_t* __restrict__ pair_row, int group_tiles, int gather_async_arrive, int by_expert,
                   int staged_epi, int tail_split, __nv_bfloat16* __restrict__ zero_out, int64_t zero_chunks,
                   int pad_halves, int silu_tanh_form, int early_decode, int split_ctas) {
#if EPMOE_SM90A_DEVICE
  __shared__ __align__(8) uint64_t bars[2 * kStages];  // full[0..S), empty[0..S)
  __shared__ int2 item_slots[kStages];                 // the producer's item hand-off (publish_item)
  extern __shared__ uint8_t dyn_smem[];

  uint8_t* ring = align_1024(dyn_smem);
  // Work items (see WorkItem in sm90_work_items.cuh): nj = ffn/128 activation column blocks per tile.
  // By expert, the schedule's offsets live in shared memory after the ring.
  // After the ring: (staged epilogue) the act staging boxes, then (by expert) the schedule's offsets.
  uint8_t* staging = ring + kStages * kStageBytes;
  int32_t* sched = by_expert ? reinterpret_cast<int32_t*>(staging + (staged_epi ? kUpStagingBytes : 0)) : nullptr;
  const WorkGrid grid = make_work_grid<kCluster>(ffn / 128, padded_offsets, experts, group_tiles, sched,
                                                 tail_split != 0 ? work_stride<kCluster>() : 0,
                                                 split_rule(pair_row, ffn, split_ctas));  // (by expert only)
  ZeroPlan zero = make_zero_plan<kCluster>(zero_out, zero_chunks, grid.items);
  // No work: the whole CTA zeroes its share of out and leaves (in a cluster both CTAs alike, before
  // any cross-CTA traffic).
  if (work_first<kCluster>() >= grid.items) {
    zero_step(zero, zero.end - zero.next, int(threadIdx.x), kThreads);
    return;
  }
  // Let the DOWN grid (PDL) launch once every UP CTA has started: its CTAs can then take SMs that
  // the UP tail leaves idle and run their prologue there. This orders nothing: DOWN reads act only
  // after griddepcontrol.wait, which waits for this whole grid to complete and flush.
  grid_launch_dependents();

  const uint32_t sA = smem_u32(ring);                  // kStages x [128 rows][64] bf16, swizzled
  const uint32_t sB = sA + kStages * kATileBytes;      // kStages x [256 rows][64] bf16, swizzled
  const uint32_t full0 = smem_u32(&bars[0]);           // full[s]  = full0 + 8 s
  const uint32_t empty0 = smem_u32(&bars[kStages]);    // empty[s] = empty0 + 8 s

  // full[s]: TMA mode, the producer's arrive.expect_tx (+ TMA bytes); gather mode, that plus one
  // arrival per producer thread once its cp.async rows of the stage have landed. In a cluster the
  // stage's bytes may come partly from the peer's multicast; its complete_tx can land before the
  // local expect_tx (the pending arrival keeps the phase open) but never a round early: the peer
  // refills slot s only after this CTA's consumers released it (empty[s] counts both CTAs).
  init_ring_barriers<kCluster>(full0, empty0, x != nullptr ? 1 + kProducerThreads : 1);

  const int wg = warpgroup_index();
  const int num_k = hidden / kBK;
  const int64_t stride = work_stride<kCluster>();
  // The ring runs on across items: use number `it` (counted over all items of this CTA) takes stage
  // it % kStages in round it / kStages; full[s] completes once per round (parity round & 1), and
  // empty[s] completes once per round when the consumers release it.

  if (wg == 0) {
    // ---------------- producer ----------------
    setmaxnreg_dec<kUpProducerRegs>();
    // Padding halves: each item's flag row (pair_row of its row 64) is read an item ahead (ItemWalk).
    const int32_t* pad_pair_row = pad_halves != 0 ? pair_row : nullptr;
    if (x != nullptr) {
      produce_gathered<kCluster>(tm_w1, padded_offsets, experts, hidden, ffn, w1_folded, x, x_rows, pair_row, sA, sB,
                                 full0, empty0, grid, gather_async_arrive != 0, item_slots, zero, pad_pair_row,
                                 (early_decode & 2) != 0);
    } else if (threadIdx.x < 32) {
      if (threadIdx.x == 0) {
        tma_prefetch_desc(&tm_xs);
        tma_prefetch_desc(&tm_w1);
        grid_dependency_wait();  // xs comes from the previous kernel (no-op unless PDL-launched)
      }
      uint32_t it = 0;
      ItemWalk<kCluster> walk(grid, pad_pair_row);
      for (; walk.cur.valid; walk.advance()) {
        const WorkItem& wi = walk.cur;
        walk.fetch_next();  // an item ahead: its flag row loads early
        bool multicast;
        const int e = work_expert<kCluster>(padded_offsets, experts, wi, grid, multicast);  // whole warp
        zero_step(zero, zero.per_item, int(threadIdx.x), 32);
        if (threadIdx.x == 0) {
          for (int kt = 0; kt < num_k; ++kt, ++it) {
            uint32_t full;
            const uint32_t s = arm_stage(it, kt, wi, full0, empty0, item_slots, kStageBytes, full);
            tma_load_2d(sA + s * kATileBytes, &tm_xs, full, kt * kBK, int(wi.load_m0));
            load_w1_stage(&tm_w1, full, sB + s * kBTileBytes, kt * kBK, e, wi.nb, ffn, w1_folded, multicast,
                          grid.rank);
          }
        }
      }
      zero_step(zero, zero.end - zero.next, int(threadIdx.x), 32);
    }
  } else {
    // ---------------- consumers ----------------
    setmaxnreg_inc<kUpConsumerRegs>();
    const int c = wg - 1;  // rows [64c, 64c + 64) of each tile
    const int warp = int(threadIdx.x / 32) & 3;
    const int lane = int(threadIdx.x & 31);
    const int q = lane & 3;
    const uint32_t a_off = uint32_t(c) * 64 * 128;  // 64 rows x 128 B: a multiple of the 1024 B atom
    const uint32_t peer_empty0 = kCluster ? mapa_shared(empty0, grid.rank ^ 1u) : 0u;
    const bool cp_fence = x != nullptr && gather_async_arrive != 0;
    // Slot release: this CTA's producer, and in a cluster the peer's too (its multicast writes here).
    auto release = [&](uint32_t s, uint32_t n) { release_stage<kCluster>(empty0, peer_empty0, s, n); };

    uint32_t it = 0;
    for (int64_t w = work_first<kCluster>(); w < grid.items; w += stride) {
      float acc[128];
      const ItemView iv = consume_item(acc, it, num_k, full0, sA, sB, a_off, cp_fence, c, item_slots, release,
                                       [](const ItemView&) {}, [](int) {});
      // cluster rank 1 without a tile, or the other warpgroup's half item: nothing to write (an
      // all-padding half writes its act rows as zeros: acc stayed zero, and silu(0) * 0 = 0)
      if (!iv.compute || (iv.idle(c) && iv.half != kHalfPadUpper)) continue;
      const int j = iv.nb;

      if (staged_epi) {  // SwiGLU, then the staged TMA store (store_act_staged)
        const uint32_t stg = smem_u32(staging) + uint32_t(c) * (kUpStagingBytes / 2);
        uint32_t words[32];
        swiglu_words(words, acc, acc + 64, silu_tanh_form != 0);
        store_act_staged(&tm_act, stg, words, c, warp, lane, iv.m0, j);
        continue;
      }

      // ---------------- epilogue: SwiGLU, 16-byte stores of act ----------------
      // (the producer is already filling the ring with the next item's first stages)
      const int64_t row0 = iv.m0 + c * 64 + warp * 16 + (lane >> 2);
      uint32_t words[32];
      swiglu_words(words, acc, acc + 64, silu_tanh_form != 0);
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // rows row0 and row0 + 8
        __nv_bfloat16* dst = act + (row0 + 8 * h) * int64_t(ffn) + int64_t(j) * 128 + 8 * q;
#pragma unroll
        for (int gi = 0; gi < 4; ++gi) {  // 8-column groups 4gi .. 4gi+3 of the 16 gate groups
          uint32_t wd[4];
#pragma unroll
          for (int t = 0; t < 4; ++t) wd[t] = words[2 * (4 * gi + t) + h];
          quad_transpose(wd, q);  // lane q: all 8 columns of group 4gi + q
          st_global_16(dst + 32 * gi, wd);
        }
      }
    }
    if (staged_epi && (threadIdx.x & 127) == 0) bulk_wait_all();  // act written before the CTA retires
  }
  // No CTA of a cluster exits while its peer may still multicast into it or arrive on its barriers.
  if constexpr (kCluster) cluster_sync();
#else
  // Built for a target without sm_90a features: sm90_experts_supported() is false there.
  (void)padded_offsets, (void)act, (void)experts, (void)hidden, (void)ffn, (void)w1_folded, (void)x, (void)x_rows,
      (void)pair_row, (void)group_tiles, (void)gather_async_arrive, (void)by_expert, (void)staged_epi, (void)tail_split,
      (void)zero_out, (void)zero_chunks, (void)pad_halves, (void)silu_tanh_form, (void)early_decode, (void)split_ctas;
#endif
}

#if EPMOE_SM90A_DEVICE
// ---- pairs sharing the gathered A tile (EPMOE_SM90_UP_SHARE_A, default auto) ---------------------
// The gathering UP with 2-CTA clusters whose CTAs take the SAME row tile and the two column blocks
// 2jp and 2jp + 1: each CTA gathers only its 64 rows of the A tile with cp.async (warps 0-1 of the
// producer warpgroup, 8 rows per thread) and a forwarder thread copies that half into the peer's ring
// (one 8 KB shared::cta -> shared::cluster bulk copy per stage, completing on the peer's full barrier);
// W1 is loaded by each CTA for its own column block. Why: per CTA this halves the cp.async copies and
// the gather's global reads; timing-only builds showed the gathering UP's cost over UP from xs is in
// those (half the copies: as fast as UP from xs), not in the shared-memory bytes written (PERF.md,
// session 18: the layer 2.3-3.8% faster at hidden 2048). The 128-row kernel's order (global, or by
// expert) over (row tile, column pair) units; in the global order the last wave's items are halved
// (TailSplit: rows [0, 64) and [64, 128) of the tile on two clusters; each CTA then gathers and
// forwards 32 rows and one consumer warpgroup idles); no padding halves; needs ffn % 256 == 0 and
// the staged epilogue (the launcher checks).
// Barriers per stage: full (2 arrivals: the W1 thread's arrive.expect_tx of W1 + the peer's half, and
// the forwarder's arrive once this CTA's half landed), half_full (64 cp.async arrivals: this CTA's
// half landed; the forwarder waits on it), empty (both CTAs' consumers, as for the W1-multicast pairs).
inline constexpr int kPairGatherThreads = 64;
inline constexpr uint32_t kPairHalfBytes = kATileBytes / 2;  // 64 rows x 128 B, one CTA's half

struct PairItem {
  bool valid;
  int64_t m0;  // the pair's row tile
  int nb;      // this CTA's column block
  int half;    // kHalfWhole, or kHalfLower / kHalfUpper: the tile's rows [0, 64) / [64, 128) only
};
// Item w of the pair grid: the single-CTA schedule over row tiles x column pairs (WorkGrid built by
// make_work_grid<false> with nn = ffn / 256, its last wave halved over the clusters) decoded by
// work_item; CTA rank r computes column block 2 pair + r.
__device__ __forceinline__ PairItem pair_item(const WorkItem& t, uint32_t rank) {
  return {t.valid, t.m0, 2 * t.nb + int(rank), t.half};
}
// The rows of an item this CTA gathers and forwards: the first (as a byte offset in the A tile) and
// the bytes - 64 rows of a whole item, 32 of a half item's 64.
__device__ __forceinline__ uint32_t pair_fwd_offset(const PairItem& p, uint32_t rank) {
  return p.half == kHalfWhole ? rank * kPairHalfBytes : uint32_t(64 * (p.half - 1) + 32 * int(rank)) * 128u;
}
__device__ __forceinline__ uint32_t pair_fwd_bytes(const PairItem& p) {
  return p.half == kHalfWhole ? kPairHalfBytes : kPairHalfBytes / 2;
}
#endif

__global__ void __launch_bounds__(kThreads, 1)
    sm90_up_pair_kernel(const __grid_constant__ CUtensorMap tm_w1, const __grid_constant__ CUtensorMap tm_act,
                        const int64_t* __restrict__ padded_offsets, int experts, int hidden, int ffn, int w1_folded,
                        const __nv_bfloat16* __restrict__ x, int64_t x_rows, const int32_t* __restrict__ pair_row,
                        int group_tiles, __nv_bfloat16* __restrict__ zero_out, int64_t zero_chunks,
                        int silu_tanh_form, int by_expert, int tail_split_on, int split_ctas) {
#if EPMOE_SM90A_DEVICE
  __shared__ __align__(8) uint64_t bars[3 * kStages];  // full, empty, half_full
  __shared__ int2 item_slots[kStages];
  extern __shared__ uint8_t dyn_smem[];
  uint8_t* ring = align_1024(dyn_smem);
  uint8_t* staging = ring + kStages * kStageBytes;

  // By expert: the schedule's offsets after the staging boxes (make_work_grid builds it; CTA barrier).
  int32_t* sched = by_expert ? reinterpret_cast<int32_t*>(staging + kUpStagingBytes) : nullptr;
  // Single-CTA row units x column pairs, the last wave halved over the clusters (not the CTAs).
  const WorkGrid g = make_work_grid<false>(ffn / 256, padded_offsets, experts, group_tiles, sched,
                                           tail_split_on != 0 ? work_stride<true>() : 0,
                                           split_rule(pair_row, ffn, split_ctas));  // (by expert only)
  const int64_t items = g.items;
  const uint32_t rank = cluster_ctarank();
  ZeroPlan zero = make_zero_plan<true>(zero_out, zero_chunks, items);
  if (work_first<true>() >= items) {  // both CTAs of the cluster alike
    zero_step(zero, zero.end - zero.next, int(threadIdx.x), kThreads);
    return;
  }
  grid_launch_dependents();  // as in sm90_up_kernel

  const uint32_t sA = smem_u32(ring), sB = sA + kStages * kATileBytes;
  const uint32_t full0 = smem_u32(&bars[0]), empty0 = smem_u32(&bars[kStages]);
  const uint32_t half0 = smem_u32(&bars[2 * kStages]);
  if (threadIdx.x == 0)
    for (int st = 0; st < kStages; ++st) mbar_init(half0 + 8 * st, kPairGatherThreads);
  init_ring_barriers<true>(full0, empty0, 2);  // (its fence and cluster barrier cover half_full too)

  const int wg = warpgroup_index();
  const int num_k = hidden / kBK;
  const int64_t first = work_first<true>(), stride = work_stride<true>();

  if (wg == 0) {
    setmaxnreg_dec<kUpProducerRegs>();
    const int t = int(threadIdx.x), warp = t / 32;
    if (warp < 2) {
      // ---- gatherers: this CTA's rows of the tile (pair_fwd_offset: 64 from row 64 rank, or a half
      // item's 32), rows first + rg + 8 i, 16-byte chunk t % 8 ----
      const int chunk = t & 7, rg = t >> 3;  // rg 0..7 = the rows' swizzle phase (first is a multiple of 8)
      const uint32_t t_dst = sA + uint32_t(rg) * 128 + (uint32_t(chunk ^ rg) << 4);
      const __nv_bfloat16* xc = x + chunk * 8;
      grid_dependency_wait();
      // Source rows of an item (bit i of valid: row i is real, else zeros; a half item has 4 rows).
      auto load_rows = [&](const PairItem& pi, const __nv_bfloat16* (&src)[8], uint32_t& valid) {
        valid = 0;
        const int64_t r0 = pi.m0 + int64_t(pair_fwd_offset(pi, rank) / 128u) + rg;
        const int n = pi.half == kHalfWhole ? 8 : 4;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int32_t r = pi.valid && i < n ? pair_row[r0 + 8 * i] : -1;
          const bool ok = r >= 0 && int64_t(r) < x_rows;
          src[i] = xc + (ok ? int64_t(r) * hidden : 0);
          valid |= ok ? (1u << i) : 0u;
        }
      };
      PairItem cur = pair_item(work_item<false>(first, g), rank);
      const __nv_bfloat16* src[8];
      uint32_t valid;
      load_rows(cur, src, valid);
      uint32_t it = 0;
      for (int64_t w = first; cur.valid; w += stride) {
        const PairItem nxt = pair_item(work_item<false>(w + stride, g), rank);
        const __nv_bfloat16* nsrc[8];
        uint32_t nvalid;
        load_rows(nxt, nsrc, nvalid);  // an item ahead
        zero_step(zero, zero.per_item, t, kPairGatherThreads);
        const uint32_t a_dst = t_dst + pair_fwd_offset(cur, rank);
        const bool whole = cur.half == kHalfWhole;
        for (int kt = 0; kt < num_k; ++kt, ++it) {
          const uint32_t st = it % kStages;
          if (it >= uint32_t(kStages)) mbar_wait(empty0 + 8 * st, ((it / kStages) - 1) & 1u);
          const uint32_t dst = a_dst + st * kATileBytes;
          if (whole) {
#pragma unroll
            for (int i = 0; i < 8; ++i)
              cp_async_16_zfill(dst + uint32_t(i) * 8 * 128, src[i] + kt * kBK, (valid >> i) & 1u ? 16u : 0u);
          } else {
#pragma unroll
            for (int i = 0; i < 4; ++i)
              cp_async_16_zfill(dst + uint32_t(i) * 8 * 128, src[i] + kt * kBK, (valid >> i) & 1u ? 16u : 0u);
          }
          cp_async_mbar_arrive_noinc(half0 + 8 * st);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) src[i] = nsrc[i];
        valid = nvalid;
        cur = nxt;
      }
      zero_step(zero, zero.end - zero.next, t, kPairGatherThreads);
      cp_async_wait_all();
    } else if (t == 64) {
      // ---- forwarder: this CTA's rows of each stage -> the peer's ring, once they have landed ----
      const uint32_t peer_a = mapa_shared(sA, rank ^ 1u), peer_full0 = mapa_shared(full0, rank ^ 1u);
      uint32_t it = 0;
      for (int64_t w = first; w < items; w += stride) {
        const PairItem pi = pair_item(work_item<false>(w, g), rank);
        const uint32_t off = pair_fwd_offset(pi, rank), bytes = pair_fwd_bytes(pi);
        for (int kt = 0; kt < num_k; ++kt, ++it) {
          const uint32_t st = it % kStages;
          mbar_wait(half0 + 8 * st, (it / kStages) & 1u);
          fence_proxy_async_shared();  // the gatherers' cp.async writes, before the bulk copy reads them
          bulk_copy_to_peer(peer_a + st * kATileBytes + off, sA + st * kATileBytes + off, bytes, peer_full0 + 8 * st);
          mbar_arrive(full0 + 8 * st);  // this CTA's rows are here
        }
      }
    } else if (warp == 3) {
      // ---- W1: the whole warp finds the expert, lane 0 arms the stages and loads ----
      if (t == 96) tma_prefetch_desc(&tm_w1);
      uint32_t it = 0;
      for (int64_t w = first; w < items; w += stride) {
        const WorkItem wt = work_item<false>(w, g);
        const PairItem pi = pair_item(wt, rank);
        bool multicast;  // (always false for single-CTA units)
        const int e = work_expert<false>(padded_offsets, experts, wt, g, multicast);  // whole warp
        if (t == 96) {
          WorkItem wi{};
          wi.valid = true;
          wi.m0 = wi.base = wi.load_m0 = pi.m0;
          wi.nb = pi.nb;
          wi.compute = true;
          wi.half = pi.half;  // (a half item: consume_item idles the other warpgroup)
          const uint32_t bytes = kBTileBytes + pair_fwd_bytes(pi);  // W1 and the peer's rows
          for (int kt = 0; kt < num_k; ++kt, ++it) {
            uint32_t full;
            const uint32_t st = arm_stage(it, kt, wi, full0, empty0, item_slots, bytes, full);
            load_w1_stage(&tm_w1, full, sB + st * kBTileBytes, kt * kBK, e, pi.nb, ffn, w1_folded, false, rank);
          }
        }
        __syncwarp();
      }
    }
    __syncwarp();  // (warp 2's idle lanes reconverge with the forwarder before the cluster barrier)
  } else {
    // ---- consumers: as in sm90_up_kernel (staged epilogue), releasing to both CTAs ----
    setmaxnreg_inc<kUpConsumerRegs>();
    const int c = wg - 1;
    const int warp = int(threadIdx.x / 32) & 3;
    const int lane = int(threadIdx.x & 31);
    const uint32_t a_off = uint32_t(c) * 64 * 128;
    const uint32_t peer_empty0 = mapa_shared(empty0, rank ^ 1u);
    auto release = [&](uint32_t st, uint32_t n) { release_stage<true>(empty0, peer_empty0, st, n); };
    const uint32_t stg = smem_u32(staging) + uint32_t(c) * (kUpStagingBytes / 2);
    uint32_t it = 0;
    for (int64_t w = first; w < items; w += stride) {
      float acc[128];
      const ItemView iv = consume_item(acc, it, num_k, full0, sA, sB, a_off, /*proxy_fence=*/true, c, item_slots,
                                       release, [](const ItemView&) {}, [](int) {});
      if (iv.idle(c)) continue;  // the other warpgroup's half item
      uint32_t words[32];
      swiglu_words(words, acc, acc + 64, silu_tanh_form != 0);
      store_act_staged(&tm_act, stg, words, c, warp, lane, iv.m0, iv.nb);
    }
    if ((threadIdx.x & 127) == 0) bulk_wait_all();
  }
  cluster_sync();  // no CTA leaves while its peer may still copy into it or arrive on its barriers
#else
  (void)padded_offsets, (void)experts, (void)hidden, (void)ffn, (void)w1_folded, (void)x, (void)x_rows,
      (void)pair_row, (void)group_tiles, (void)zero_out, (void)zero_chunks, (void)silu_tanh_form, (void)by_expert,
      (void)tail_split_on, (void)split_ctas;
#endif
}

}  // namespace sm90

bool sm90_experts_supported(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  if (major != 9 || minor != 0) return false;
  int prev = 0;
  if (cudaGetDevice(&prev) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  if (prev != device && cudaSetDevice(device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  cudaFuncAttributes attr{};
  const cudaError_t err = cudaFuncGetAttributes(&attr, sm90::sm90_up_kernel<false>);
  if (prev != device) (void)cudaSetDevice(prev);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  // The mbarriers are static shared memory that exists only in the sm_90a body of the kernel: the
  // image the runtime picked for this device has the real kernel iff they are there.
  return attr.sharedSizeBytes >= 2 * sm90::kStages * sizeof(uint64_t);
}

bool sm90_fused_gather_enabled() {
  const char* env = std::getenv("EPMOE_SM90_GATHER");
  return env == nullptr || std::strcmp(env, "separate") != 0;
}

void sm90_up_launch(const ExpertProblem& p, cudaStream_t s) {
  using namespace sm90;
  check_expert_problem(p, "sm90_up_launch");
  if (sm90_up_tall_launch(p, s)) return;
  if (sm90_up_granular() && sm90_up_granular_launch(p, s)) return;
  // Gather mode (p.x set): A rows come from x through cp.async and xs is not read; the xs map is
  // then never used (a zero map is passed).
  const bool gather = p.x != nullptr;
  CUtensorMap tm_xs{};
  if (!gather) tm_xs = make_matrix_map(p.xs, p.rows_capacity, p.hidden, kBM);
  const bool staged = sm90_up_staged_epilogue();
  // Gathering: single CTAs, weight-multicast clusters or the A-sharing pairs (sm90_up_gather_form).
  const UpGatherForm form =
      gather ? sm90_up_gather_form(p.hidden, p.ffn, p.rows_capacity, p.experts, staged) : UpGatherForm::single;
  const bool cluster = gather ? form == UpGatherForm::cluster
                              : sm90_up_uses_cluster(false, p.hidden, p.rows_capacity, p.experts);
  // The folded rank-4 map (one box per stage) unless the driver rejects it or
  // EPMOE_SM90_W1_PLAIN=1 asks for the plain rank-3 map (two boxes per stage, same smem layout).
  // The cluster variant always uses the plain map: each CTA of a pair multicasts one of its boxes.
  const char* plain_env = std::getenv("EPMOE_SM90_W1_PLAIN");
  const bool force_plain = cluster || (plain_env != nullptr && plain_env[0] == '1');
  CUtensorMap tm_w1;
  const bool folded = !force_plain && try_make_w1_folded_map(p.w1, p.experts, p.hidden, p.ffn, &tm_w1);
  if (!folded) tm_w1 = make_w1_plain_map(p.w1, p.experts, p.hidden, p.ffn);
  const int64_t tiles = (p.rows_capacity + kBM - 1) / kBM;
  const int nj = p.ffn / 128;
  // Split UP (sm90_up_split): this kernel skips the experts the split rule sends to the 192-row
  // UP, queued next. By expert only (the global order has no per-expert item counts to zero).
  const int split_ctas = sm90_up_split() ? sm90_up_split_ctas() : 0;  // (one read for both halves)
  auto split_here = [&](bool by_expert) { return split_ctas > 0 && by_expert && sm90_up_tall_split_ready(p); };
  if (form == UpGatherForm::pairs) {
    // Pairs sharing the gathered A tile (sm90_up_pair_kernel), in the order the 128-row kernel would run.
    // Its units are single row tiles with nj / 2 column pairs each: the single-CTA plan over those.
    CUtensorMap tm_act = make_matrix_map(p.act, p.rows_capacity, p.ffn, 64);
    const Sm90LaunchPlan pair_plan = sm90_launch_plan(tiles, p.experts, p.hidden, nj / 2, false, kUpStagingBytes);
    const bool split = split_here(pair_plan.by_expert);
    sm90_launch(sm90_up_pair_kernel, /*cluster=*/true, /*pdl=*/false, pair_plan.items, pair_plan.smem, s,
                "sm90_up_launch", tm_w1, tm_act, p.padded_offsets, p.experts, p.hidden, p.ffn, folded ? 1 : 0, p.x,
                p.x_rows, p.pair_row, sm90_group_tiles(), p.zero_out ? p.out : nullptr,
                p.zero_out ? p.out_rows * int64_t(p.hidden) / 8 : int64_t(0), sm90_up_silu_tanh() ? 1 : 0,
                pair_plan.by_expert ? 1 : 0, sm90_tail_split_in(pair_plan.by_expert, sm90_up_pair_tail_split()) ? 1 : 0,
                split ? split_ctas : 0);
    if (split) sm90_up_tall_split_launch(p, s, split_ctas);
    return;
  }
  const Sm90LaunchPlan plan = sm90_launch_plan(tiles, p.experts, p.hidden, nj, cluster, staged ? kUpStagingBytes : 0);
  const bool split = split_here(plan.by_expert);
  const bool pad_halves = sm90_skip_pad_halves(tiles, p.experts, p.hidden, plan.items, cluster);
  CUtensorMap tm_act{};  // the staged epilogue's store map: 64x64 boxes
  if (staged) tm_act = make_matrix_map(p.act, p.rows_capacity, p.ffn, 64);
  sm90_launch(cluster ? sm90_up_kernel<true> : sm90_up_kernel<false>, cluster, /*pdl=*/false, plan.items, plan.smem, s,
              "sm90_up_launch", tm_xs, tm_w1, tm_act, p.padded_offsets, p.act, p.experts, p.hidden, p.ffn,
              folded ? 1 : 0, p.x, p.x_rows, p.pair_row, sm90_group_tiles(), sm90_gather_async_arrive() ? 1 : 0,
              plan.by_expert ? 1 : 0, staged ? 1 : 0, sm90_tail_split_in(plan.by_expert, sm90_tail_split()) ? 1 : 0,
              p.zero_out ? p.out : nullptr,
              p.zero_out ? p.out_rows * int64_t(p.hidden) / 8 : int64_t(0), pad_halves ? 1 : 0,
              sm90_up_silu_tanh() ? 1 : 0, sm90_early_decode(), split ? split_ctas : 0);
  if (split) sm90_up_tall_split_launch(p, s, split_ctas);
}

}  // namespace epmoe::kernels
