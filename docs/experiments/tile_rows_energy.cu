// Microbenchmark: does a taller CTA tile buy FLOP/s at the 700 W cap? The kernels' mainloop (a TMA
// producer warp feeding a 4-deep ring of stages, consumer warpgroups each issuing m64nNk16 wgmmas on
// 64 rows against a shared N-row B tile) run as 2 consumer warpgroups x N = 256 (the 128 x 256 tile of
// today's UP/DOWN: 48 KB per k step), 3 x 192 (a 192 x 192 tile: the same 48 KB per k step for 12.5%
// more MACs, -11% L2->shared bytes per MAC, but +7% shared->tensor bytes per MAC from the narrower
// instruction) or 2 x 192 (a control for the n192 instruction). 3 x 256 (192 x 256, -24% bytes per
// MAC) cannot be built: a 512-thread CTA gives ptxas 128 registers for every instruction whatever
// setmaxnreg says, and m64n256k16 needs >= 154 (C7602; NVIDIA/cutlass issue 2904 hits the same). With
// nothing else: no epilogue, random bf16 operands (L2-resident by default), A = each CTA's own rows,
// B = rows shared by 5 CTAs at a time, both kept for 32 k steps (an item at K = 2048). Why: at the cap
// the layer's time is its energy (docs/PERF.md, session 24), and a taller tile is the one way left to
// move fewer operand bytes per FLOP; with larger sources (ROWS_A, ROWS_B) the items' rows come from
// DRAM, which prices a DRAM-sourced byte at the cap (session 24, S24-11 and S24-12). Run each form for
// seconds beside `nvidia-smi --query-gpu=power.draw,clocks.sm -lms 100`; compare the steady TFLOP/s.
// Printed: MAC per cycle per SM (clock64, the schedule's efficiency) and TFLOP/s (events, median of
// the launches after the first second). Not built by CMake: a measurement tool.
// Session 25 added what prices the kernels' other cycles at the cap (docs/PERF.md, session 25): B
// multicast in 2-CTA clusters (2x256mc), split A / B rings (2x256a4b5 ...), an epilogue-like bubble
// per item (IDLE) and padding items whose A rows are zero (PAD), the B blocks' sharing (BSHARE), and
// wide k steps (64 rows x two B boxes: 2x256wide on two ring slots, 2x256wide3 on a ring of their
// own, 2x256mix every PAD-th item on a switching layout - run PAD 1000 as the mix path's control).
// Session 26: 2x256mixh (the mix with its wide flags advanced per item: the plain mix's per-step
// divisions by PAD cost ~10% of its k steps, S26-1) and 2x256wide3mc (64 x 512 tiles on the 3 x 72 KB
// ring with the two B boxes multicast in 2-CTA clusters: a 64-row tile design at 40 KB per k step);
// SKIP (9th argument; forms 2x256 and 2x256mc with PAD > 0): 1 = the padding items' upper warpgroup
// issues no wgmma (a skipped padding half; in 2x256mc only rank 1's item is padding, so the multicast
// pair holds it to its partner's pace), 2 = 2x256mc's control (rank 1's padding computed);
// 2x256wide3fw: the wide3mc tile with each CTA's B box forwarded to its peer by a DSMEM bulk copy
// instead of multicast (does the SM-to-SM path add ingress? S26-7: no).
// Session 27: the 192 x 256 tile on two warpgroups is docs/experiments/tall_tile_energy.cu.
//
// From the repository root:
//   nvcc -std=c++20 -O3 -I. -Isrc -gencode=arch=compute_90a,code=sm_90a docs/experiments/tile_rows_energy.cu \
//        kernels/sm90_tensor_maps.cu src/error.cpp -o tre -lcuda
//   ./tre FORM MS [ROWS_A ROWS_B [CTAS [BSHARE [IDLE [PAD [SKIP]]]]]]
//     FORM = 2x256 | 3x192 | 2x192 (consumer warpgroups x N), 2x256mc (B multicast pairs), 2x256a4b5 |
//            2x256a3b5 | 2x256a3b4 (A / B rings of their own, B loads run ahead), 2x256wide | 2x256wide3 |
//            2x256wide3mc | 2x256mix | 2x256mixh (wide k steps, above); MS = milliseconds of
//            launches; source rows (default 4096: 16 MB each, L2-resident; 262144 = 1 GB: each item's rows
//            come from DRAM, as the weights do in the kernels); CTAS (0: all that fit); BSHARE = CTAs reading
//            one B block (default 5, 6 for mc); IDLE = cycles slept after each item; PAD = every PAD-th item
//            half zero rows (< 0: all zero rows), or for 2x256mix every PAD-th item wide
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/cuda_check.cuh"
#include "kernels/sm90_common.cuh"
#include "kernels/sm90_tensor_maps.cuh"
#include "docs/experiments/random_bf16.cuh"
#include "docs/experiments/tool_timing.cuh"

using namespace epmoe::kernels::sm90;
using epmoe::experiments::fill_random;
using epmoe::experiments::consumer_cycles;
using epmoe::experiments::fence_acc;
using epmoe::experiments::hash3;
using epmoe::experiments::time_steady;

namespace {
constexpr int kK = 2048;  // A and B sources: ROWS x 2048 bf16 (default 4096 rows, 16 MB each: L2-resident)
constexpr int kRing = 4, kKSteps = kK / 64;  // 32 k steps per item
__host__ __device__ constexpr uint32_t abytes(int wgs) { return uint32_t(wgs) * 64 * 128; }
__host__ __device__ constexpr uint32_t bbytes(int n) { return uint32_t(n) * 128; }
__host__ __device__ constexpr uint32_t smem_bytes(int wgs, int n, int ra = kRing, int rb = kRing) {
  return 1024 + uint32_t(ra) * abytes(wgs) + uint32_t(rb) * bbytes(n);
}
static_assert(smem_bytes(2, 256, 4, 5) <= 227 * 1024, "the A4/B5 rings must fit the opt-in limit");
static_assert(smem_bytes(3, 192) <= 227 * 1024, "the 3-warpgroup ring must fit the opt-in limit");
// Register split (setmaxnreg): the producer warpgroup gives up what the consumers take.
constexpr uint32_t kProducerRegs = 40;
__host__ __device__ constexpr uint32_t consumer_regs(int wgs) { return wgs == 2 ? 232 : 152; }
static_assert(kProducerRegs * 128 + 2 * 128 * consumer_regs(2) <= 65536 / 384 / 8 * 8 * 384, "2-WG split");
static_assert(kProducerRegs * 128 + 3 * 128 * consumer_regs(3) <= 65536 / 512 / 8 * 8 * 512, "3-WG split");

// PAD (S25): item `item` of a CTA is a padding item - its A box is rows_a - 64 .. rows_a + 63, whose
// second half is zero, so warpgroup 2 runs its MMA on zero rows as a tile half of padding does -
// every pad-th item. Prices a padding row's MMA at the cap against a real row's.
// PAD < 0: every |pad|-th item is all padding (its box lies in the zero rows, at a hashed offset so
// that the CTAs do not all read the same lines), as an expert's last, nearly empty tile.
constexpr int kZeroRows = 1024;
__device__ __forceinline__ bool pad_item(uint32_t item, int pad) {
  const uint32_t p = uint32_t(pad < 0 ? -pad : pad);
  return pad != 0 && item % p == p - 1;
}
__device__ __forceinline__ int pad_row(uint32_t item, int pad, int rows_a) {
  return pad > 0 ? rows_a - 64 : rows_a + int(hash3(blockIdx.x, item, 3) % uint32_t(kZeroRows - 128 + 1));
}

// D[64 x 192] (+)= A[64 x 16] * B[192 x 16]^T (K-major smem descriptors), fp32 accumulate; scale_d 0
// starts a new accumulation. Same fragment layout as wgmma_m64n256k16_bf16, 96 registers.
__device__ __forceinline__ void wgmma_m64n192k16_bf16(float (&d)[96], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %98, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63,"
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79,"
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
        "}, %96, %97, p, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// B-multicast form (S25): the same 2 x 256 tile, but a 2-CTA cluster shares the B rows - each CTA
// loads one 128-row half of the B box and multicasts it into both CTAs' rings, so a CTA reads 32 KB
// per k step from L2 instead of 48 KB. A slot may be refilled only when the consumers of BOTH CTAs
// have released it (the peer's multicast writes into this CTA's ring), as in the kernels' clusters.
__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0,
                                                      int c1, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "h"(cta_mask)
      : "memory");
}

// Split rings (S25, forms 2x256a4b5 / a3b5 / a3b4): A and B in rings of their own, kRA and kRB deep,
// with their own full / empty barriers; the producer issues B(s) and then A(s - (kRB - kRA)), so the
// B loads run one or two k steps further ahead than the A loads - what a deeper weight ring would buy
// the kernels (whose B comes from DRAM) if their UP gave up its 32 KB epilogue staging for it.
// Wide k steps (S25): 64 rows against two 256-row B boxes (two column blocks), both warpgroups on the
// same A rows, each on its own B box - a 72 KB k step for the MACs of a 48 KB one, as a padding-free
// item for an expert's partial last tile would need. kWide 1 (form 2x256wide): each k step takes two
// slots of today's 4 x 48 KB ring (A + B of block j, then B of block j + 1), so the ring is 2 k steps
// deep; kWide 3 (2x256wide3): a ring of its own, three 72 KB stages (A 8 KB, B_j, B_j+1).
constexpr uint32_t kWideStage = 8 * 1024 + 2 * 32 * 1024;
static_assert(1024 + 3 * kWideStage <= 227 * 1024, "the 3 x 72 KB wide ring must fit the opt-in limit");
template <int kWG, int kN, bool kMc, int kRA = kRing, int kRB = kRing, int kWide = 0>
__global__ void __launch_bounds__(128 * (kWG + 1), 1)
    tile_mainloop(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                  const __grid_constant__ CUtensorMap map_a64, int steps, int rows_a, int rows_b, int bshare, int idle,
                  int pad, int skip, long long* cycles, float* sink) {
#if EPMOE_SM90A_DEVICE
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  constexpr bool kSplit = kRA != kRB;
  static_assert(!kSplit || (!kMc && kRB > kRA && kRA >= 2), "split rings: single CTAs, the B ring the deeper");
  static_assert(kWide == 0 || ((!kMc || kWide == 3 || kWide == 5) && (kWide != 5 || kMc) && !kSplit && kWG == 2 &&
                                 kN == 256 && kWide >= 1 && kWide <= 5),
                "wide k steps: the 2 x 256 form, on two ring slots (1), mixed (2, 4: flags per item) or a 3-deep ring"
                " (3; single CTAs or B-multicast pairs; 5: pairs forwarding their B box by DSMEM)");
  constexpr bool kMix = kWide == 2 || kWide == 4;
  __shared__ __align__(8) uint64_t full[kRing], empty[kRing], full_b[kRB], empty_b[kRB];  // *_b: split rings
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  constexpr uint32_t kA = abytes(kWG), kStage = abytes(kWG) + bbytes(kN);
  const int wg = int(threadIdx.x) / 128, t = int(threadIdx.x) % 128;
  const uint32_t rank = kMc ? cluster_ctarank() : 0u;
  if (threadIdx.x < kRing) {  // (split rings: full / empty are the A ring's, kRA <= kRing)
    mbar_init(smem_u32(&full[threadIdx.x]), 1);
    mbar_init(smem_u32(&empty[threadIdx.x]), 128 * kWG * (kMc ? 2 : 1));  // every consumer thread (of both CTAs)
  }
  if ((kSplit || kMix || kWide == 5) && threadIdx.x < kRB) {  // (5: full_b = this CTA's own loads)  // (mix: the wide layout's 3 slots)
    mbar_init(smem_u32(&full_b[threadIdx.x]), 1);
    mbar_init(smem_u32(&empty_b[threadIdx.x]), 128 * kWG);
  }
  mbar_fence_init();
  if constexpr (kMc) cluster_sync();  // no multicast or remote arrival before the peer's barriers exist
  else __syncthreads();
  if (wg == 0) {
    setmaxnreg_dec<kProducerRegs>();
    if (t == 0) {
      tma_prefetch_desc(&map_a);
      tma_prefetch_desc(&map_b);
      auto rows_of = [&](int s, int& ra, int& rb, int& k) {
        const uint32_t item = uint32_t(s / kKSteps);
        k = s % kKSteps;
        ra = pad_item(item, pad) ? pad_row(item, pad, rows_a) : int(hash3(blockIdx.x, item, 1) % uint32_t(rows_a - 64 * kWG + 1));
        rb = int(hash3(blockIdx.x / uint32_t(bshare), item, 2) % uint32_t(rows_b - kN + 1));
      };
      if constexpr (kSplit) {
        constexpr int kLead = kRB - kRA;  // B loads run kLead k steps ahead of A loads
        for (int s = 0; s < steps + kLead; ++s) {
          int ra, rb, k;
          if (s < steps) {
            const int slot = s % kRB;
            if (s >= kRB) mbar_wait(smem_u32(&empty_b[slot]), uint32_t((s / kRB - 1) & 1));
            rows_of(s, ra, rb, k);
            mbar_arrive_expect_tx(smem_u32(&full_b[slot]), bbytes(kN));
            tma_load_2d(base + kRA * kA + uint32_t(slot) * bbytes(kN), &map_b, smem_u32(&full_b[slot]), k * 64, rb);
          }
          const int a = s - kLead;
          if (a >= 0) {
            const int slot = a % kRA;
            if (a >= kRA) mbar_wait(smem_u32(&empty[slot]), uint32_t((a / kRA - 1) & 1));
            rows_of(a, ra, rb, k);
            mbar_arrive_expect_tx(smem_u32(&full[slot]), kA);
            tma_load_2d(base + uint32_t(slot) * kA, &map_a, smem_u32(&full[slot]), k * 64, ra);
          }
        }
      }
      if constexpr (kMix) {
        // Mix (S25, form 2x256mix): every pad-th item wide (staggered over the CTAs, so that about 1 / pad
        // of the SMs run a wide item at any time, as an expert's partial tiles would) on the 3 x 72 KB layout, the others whole on
        // the 4 x 48 KB layout of the same shared memory; at each switch the producer waits until every
        // use of the old layout is released (the consumers release an item's last stage at once when
        // the next item switches), so the layouts never overlap in flight.
        // kWide 4 (form 2x256mixh, S26): the same schedule with (item + CTA) % pad advanced per item
        // instead of divided at every k step, to tell the mix loop's own cost from the wide items'.
        uint32_t un = 0, uw = 0;  // uses issued on the whole / the wide layout
        bool prev_wide = false;
        int phase = int(blockIdx.x % uint32_t(pad));  // kWide 4: (item + CTA) % pad
        for (int s = 0; s < steps; ++s) {
          const uint32_t item = uint32_t(s / kKSteps);
          const int k = s % kKSteps;
          if (kWide == 4 && k == 0 && s > 0) phase = phase + 1 == pad ? 0 : phase + 1;
          const bool wide = kWide == 4 ? phase == pad - 1
                                       : (item + blockIdx.x) % uint32_t(pad) == uint32_t(pad - 1);  // staggered over the CTAs
          if (k == 0 && s > 0 && wide != prev_wide) {
            if (prev_wide)
              for (uint32_t v = uw > 3 ? uw - 3 : 0; v < uw; ++v) mbar_wait(smem_u32(&empty_b[v % 3]), (v / 3) & 1u);
            else
              for (uint32_t v = un > 4 ? un - 4 : 0; v < un; ++v) mbar_wait(smem_u32(&empty[v % 4]), (v / 4) & 1u);
          }
          prev_wide = wide;
          const int ra = int(hash3(blockIdx.x, item, 1) % uint32_t(rows_a - 128 + 1));
          const int rb = int(hash3(blockIdx.x / uint32_t(bshare), item, 2) % uint32_t(rows_b - 2 * kN + 1));
          if (wide) {
            const uint32_t slot = uw % 3, bar = smem_u32(&full_b[slot]), dst = base + slot * kWideStage;
            if (uw >= 3) mbar_wait(smem_u32(&empty_b[slot]), (uw / 3 - 1) & 1u);
            mbar_arrive_expect_tx(bar, kWideStage);
            tma_load_2d(dst, &map_a64, bar, k * 64, ra);
            tma_load_2d(dst + 8 * 1024, &map_b, bar, k * 64, rb);
            tma_load_2d(dst + 8 * 1024 + bbytes(kN), &map_b, bar, k * 64, rb + kN);
            ++uw;
          } else {
            const uint32_t slot = un % 4, bar = smem_u32(&full[slot]), dst = base + slot * kStage;
            if (un >= 4) mbar_wait(smem_u32(&empty[slot]), (un / 4 - 1) & 1u);
            mbar_arrive_expect_tx(bar, kStage);
            tma_load_2d(dst, &map_a, bar, k * 64, ra);
            tma_load_2d(dst + kA, &map_b, bar, k * 64, rb);
            ++un;
          }
        }
      }
      if constexpr (kWide == 3 || kWide == 5) {
        for (int s = 0; s < steps; ++s) {
          const int slot = s % 3;
          if (s >= 3) mbar_wait(smem_u32(&empty[slot]), uint32_t((s / 3 - 1) & 1));
          int ra, rb, k;
          rows_of(s, ra, rb, k);
          // kWide 5: this CTA's own loads complete on full_b (its forwarder waits for them there), the
          // peer's forwarded box on full; else everything on full.
          const uint32_t bar = smem_u32(kWide == 5 ? &full_b[slot] : &full[slot]);
          const uint32_t dst = base + uint32_t(slot) * kWideStage;
          mbar_arrive_expect_tx(bar, kWide == 5 ? 8 * 1024 + bbytes(kN) : kWideStage);
          tma_load_2d(dst, &map_a, bar, k * 64, ra);  // 64 rows
          if constexpr (kMc) {
            // 2x256wide3mc (S26): the pair's two CTAs compute different 64-row halves against the same
            // two B boxes; CTA rank r loads box j + r and multicasts it into both rings (40 KB per CTA
            // and k step from L2 instead of 72), as a 64-row tile design with B shared by two row halves.
            // 2x256wide3fw (kWide 5, S26): the same tile, but each CTA loads its box into its own ring
            // only and a forwarder thread copies it into the peer's ring by DSMEM (completing on the
            // peer's full): 40 KB per k step through the SM's L2 port, 32 KB over the SM-to-SM network.
            const uint32_t bgroup = cluster_id_x() / uint32_t(bshare / 2);
            const int rb0 = int(hash3(bgroup, uint32_t(s / kKSteps), 2) % uint32_t(rows_b - 2 * kN + 1));
            const uint32_t box = dst + 8 * 1024 + rank * bbytes(kN);
            if constexpr (kWide == 5) {
              tma_load_2d(box, &map_b, bar, k * 64, rb0 + int(rank) * kN);
              mbar_arrive_expect_tx(smem_u32(&full[slot]), bbytes(kN));  // the peer's box, by its forwarder
            } else {
              tma_load_2d_multicast(box, &map_b, bar, k * 64, rb0 + int(rank) * kN, uint16_t(0x3));
            }
          } else {
            const int rb0 = rb % (rows_b - 2 * kN + 1);
            tma_load_2d(dst + 8 * 1024, &map_b, bar, k * 64, rb0);
            tma_load_2d(dst + 8 * 1024 + bbytes(kN), &map_b, bar, k * 64, rb0 + kN);
          }
        }
      }
      if constexpr (kWide == 1) {
        for (int u = 0; u < 2 * steps; ++u) {  // ring use u: k step u / 2, part u % 2
          const int slot = u % kRing, s = u / 2;
          if (u >= kRing) mbar_wait(smem_u32(&empty[slot]), uint32_t((u / kRing - 1) & 1));
          int ra, rb, k;
          rows_of(s, ra, rb, k);
          const uint32_t bar = smem_u32(&full[slot]), dst = base + uint32_t(slot) * kStage;
          mbar_arrive_expect_tx(bar, (u % 2 == 0 ? kA / 2 : 0u) + bbytes(kN));
          if (u % 2 == 0) tma_load_2d(dst, &map_a, bar, k * 64, ra);  // 64 rows (the wide form's A map)
          // block j's rows, then block j + 1's (rows_b - 2 kN + 1 >= 1: rows_b >= 512 checked on the host)
          tma_load_2d(dst + kA, &map_b, bar, k * 64, (rb % (rows_b - 2 * kN + 1)) + (u % 2) * kN);
        }
      }
      for (int s = 0; s < (kSplit || kWide ? 0 : steps); ++s) {
        const int slot = s % kRing;
        if (s >= kRing) mbar_wait(smem_u32(&empty[slot]), uint32_t((s / kRing - 1) & 1));
        const uint32_t bar = smem_u32(&full[slot]);
        mbar_arrive_expect_tx(bar, kStage);
        const uint32_t item = uint32_t(s / kKSteps), k = uint32_t(s % kKSteps);
        // SKIP 1 or 2 with B multicast (S26): only rank 1's item is a padding item, so the pair runs it
        // coupled (2: computed, the control of 1)
        const bool padded = pad_item(item, pad) && (!kMc || skip == 0 || rank == 1u);
        const int ra =
            padded ? pad_row(item, pad, rows_a) : int(hash3(blockIdx.x, item, 1) % uint32_t(rows_a - 64 * kWG + 1));
        // B rows shared by `bshare` consecutive CTAs (in the multicast form bshare / 2 clusters)
        const uint32_t bgroup = kMc ? cluster_id_x() / uint32_t(bshare / 2) : blockIdx.x / uint32_t(bshare);
        const int rb = int(hash3(bgroup, item, 2) % uint32_t(rows_b - kN + 1));
        const uint32_t dst = base + uint32_t(slot) * kStage;
        tma_load_2d(dst, &map_a, bar, int(k) * 64, ra);
        if constexpr (kMc)
          tma_load_2d_multicast(dst + kA + rank * (bbytes(kN) / 2), &map_b, bar, int(k) * 64, rb + int(rank) * (kN / 2),
                                uint16_t(0x3));
        else
          tma_load_2d(dst + kA, &map_b, bar, int(k) * 64, rb);
      }
    }
    if (kWide == 5 && t == 32) {  // the forwarder: this CTA's B box of each stage -> the peer's ring
      const uint32_t peer_base = mapa_shared(base, rank ^ 1u), peer_full0 = mapa_shared(smem_u32(&full[0]), rank ^ 1u);
      for (int s = 0; s < steps; ++s) {
        const uint32_t slot = uint32_t(s % 3), off = slot * kWideStage + 8 * 1024 + rank * bbytes(kN);
        mbar_wait(smem_u32(&full_b[slot]), uint32_t((s / 3) & 1));
        bulk_copy_to_peer(peer_base + off, base + off, bbytes(kN), peer_full0 + 8 * slot);
      }
    }
  } else {
    setmaxnreg_inc<consumer_regs(kWG)>();
    float acc[kN / 2];
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) acc[i] = 0.0f;
    const uint32_t peer_empty0 = kMc ? mapa_shared(smem_u32(&empty[0]), rank ^ 1u) : 0u;
    const long long t0 = clock64();
    if constexpr (kMix) {
      uint32_t un = 0, uw = 0;
      int pend = -1;  // the previous step's stage not yet released: slot, + 4 on the wide layout
      int phase = int(blockIdx.x % uint32_t(pad));  // kWide 4: as the producer's
      bool wide4 = phase == pad - 1, next4 = (phase + 1 == pad ? 0 : phase + 1) == pad - 1;
      for (int s = 0; s < steps; ++s) {
        const uint32_t item = uint32_t(s / kKSteps);
        const int k = s % kKSteps;
        if (kWide == 4 && k == 0 && s > 0) {  // per item, not per step
          phase = phase + 1 == pad ? 0 : phase + 1;
          wide4 = next4;
          next4 = (phase + 1 == pad ? 0 : phase + 1) == pad - 1;
        }
        const bool wide = kWide == 4 ? wide4 : (item + blockIdx.x) % uint32_t(pad) == uint32_t(pad - 1);
        const bool next_wide =
            kWide == 4 ? next4 : ((item + 1 + blockIdx.x) % uint32_t(pad) == uint32_t(pad - 1));
        const bool switch_next = k == kKSteps - 1 && s + 1 < steps && next_wide != wide;
        uint32_t da, db;
        int cur;
        if (wide) {
          const uint32_t slot = uw % 3;
          mbar_wait(smem_u32(&full_b[slot]), (uw / 3) & 1u);
          da = smem_desc_sw128_lo(base + slot * kWideStage);
          db = smem_desc_sw128_lo(base + slot * kWideStage + 8 * 1024 + uint32_t(wg - 1) * bbytes(kN));
          cur = int(slot) + 4;
          ++uw;
        } else {
          const uint32_t slot = un % 4;
          mbar_wait(smem_u32(&full[slot]), (un / 4) & 1u);
          da = smem_desc_sw128_lo(base + slot * kStage + uint32_t(wg - 1) * 64 * 128);
          db = smem_desc_sw128_lo(base + slot * kStage + kA);
          cur = int(slot);
          ++un;
        }
        fence_acc(acc);
        wgmma_fence();
        const int first = k == 0 ? 0 : 1;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          wgmma_m64n256k16_bf16(acc, smem_desc_sw128_join(da + 2 * kk), smem_desc_sw128_join(db + 2 * kk),
                                kk == 0 ? first : 1);
        wgmma_commit();
        wgmma_wait<1>();
        fence_acc(acc);
        auto release = [&](int st) {
          mbar_arrive(smem_u32(st >= 4 ? &empty_b[st - 4] : &empty[st]));
        };
        if (pend >= 0) release(pend);
        pend = cur;
        if (switch_next) {  // the producer drains this layout before the next item: release now
          wgmma_wait<0>();
          fence_acc(acc);
          release(cur);
          pend = -1;
        }
      }
    } else
    for (int s = 0; s < steps; ++s) {
      uint32_t da, db;
      if constexpr (kWide == 3 || kWide == 5) {  // A: the stage's 64 rows for both warpgroups; B: box j (wg 1) or j + 1 (wg 2)
        const int slot = s % 3;
        if constexpr (kWide == 5) mbar_wait(smem_u32(&full_b[slot]), uint32_t((s / 3) & 1));  // own A + box
        mbar_wait(smem_u32(&full[slot]), uint32_t((s / 3) & 1));
        da = smem_desc_sw128_lo(base + uint32_t(slot) * kWideStage);
        db = smem_desc_sw128_lo(base + uint32_t(slot) * kWideStage + 8 * 1024 + uint32_t(wg - 1) * bbytes(kN));
      } else if constexpr (kWide == 1) {  // A: slot 2s's 64 rows for both warpgroups; B: slot 2s (wg 1) or 2s + 1 (wg 2)
        const int s0 = (2 * s) % kRing, s1 = (2 * s + 1) % kRing;
        mbar_wait(smem_u32(&full[s0]), uint32_t((2 * s / kRing) & 1));
        mbar_wait(smem_u32(&full[s1]), uint32_t(((2 * s + 1) / kRing) & 1));
        da = smem_desc_sw128_lo(base + uint32_t(s0) * kStage);
        db = smem_desc_sw128_lo(base + uint32_t(wg == 1 ? s0 : s1) * kStage + kA);
      } else if constexpr (kSplit) {
        mbar_wait(smem_u32(&full[s % kRA]), uint32_t((s / kRA) & 1));
        mbar_wait(smem_u32(&full_b[s % kRB]), uint32_t((s / kRB) & 1));
        da = smem_desc_sw128_lo(base + uint32_t(s % kRA) * kA + uint32_t(wg - 1) * 64 * 128);
        db = smem_desc_sw128_lo(base + kRA * kA + uint32_t(s % kRB) * bbytes(kN));
      } else {
        const int slot = s % kRing;
        mbar_wait(smem_u32(&full[slot]), uint32_t((s / kRing) & 1));
        const uint32_t st = base + uint32_t(slot) * kStage;
        da = smem_desc_sw128_lo(st + uint32_t(wg - 1) * 64 * 128);
        db = smem_desc_sw128_lo(st + kA);
      }
      // SKIP (S26, forms 2x256 / 2x256mc, PAD > 0): warpgroup 2 issues no wgmma on a padding item's
      // zero rows (a skipped padding half): unpaced on single CTAs (the CTA runs on to its next item),
      // coupled to its partner in a B-multicast pair (the pair's ring holds it to rank 0's pace).
      const bool skip_mma = kWide == 0 && !kSplit && skip == 1 && wg == 2 && pad > 0 &&
                            pad_item(uint32_t(s / kKSteps), pad) && (!kMc || rank == 1u);
      if (skip_mma) {
        wgmma_wait<0>();  // (the previous item's last group, if any: its stage is released below)
        fence_acc(acc);
      } else {
        fence_acc(acc);
        wgmma_fence();
        // An item's first k step starts a new accumulation, as the kernels' items do.
        const int first = (s % kKSteps) == 0 ? 0 : 1;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const uint64_t a = smem_desc_sw128_join(da + 2 * kk), b = smem_desc_sw128_join(db + 2 * kk);
          if constexpr (kN == 256)
            wgmma_m64n256k16_bf16(acc, a, b, kk == 0 ? first : 1);
          else
            wgmma_m64n192k16_bf16(acc, a, b, kk == 0 ? first : 1);
        }
        wgmma_commit();
        wgmma_wait<1>();
        fence_acc(acc);
      }
      if (s > 0 && (kWide == 3 || kWide == 5)) {  // step s-1's wgmmas are done
        mbar_arrive(smem_u32(&empty[(s - 1) % 3]));
        if constexpr (kMc) mbar_arrive_remote(peer_empty0 + 8u * uint32_t((s - 1) % 3));
      } else if (s > 0 && kWide == 1) {  // step s-1's wgmmas are done: both of its slots
        mbar_arrive(smem_u32(&empty[(2 * s - 2) % kRing]));
        mbar_arrive(smem_u32(&empty[(2 * s - 1) % kRing]));
      } else if (s > 0 && kSplit) {
        mbar_arrive(smem_u32(&empty[(s - 1) % kRA]));
        mbar_arrive(smem_u32(&empty_b[(s - 1) % kRB]));
      } else if (s > 0) {
        mbar_arrive(smem_u32(&empty[(s - 1) % kRing]));
        if constexpr (kMc) mbar_arrive_remote(peer_empty0 + 8u * uint32_t((s - 1) % kRing));
      }
      // IDLE (S25): an epilogue-like bubble after each item's last k step - the warpgroup drains its
      // wgmmas and then sleeps `idle` cycles while the producer refills the ring, so the tensor pipe
      // idles for about idle / (32 x 1024 + idle) of the time. Prices a bubble at the cap: free if the
      // clock rises to fill it, a full cycle of time if not.
      if (idle > 0 && s % kKSteps == kKSteps - 1) {
        wgmma_wait<0>();
        fence_acc(acc);
        const long long until = clock64() + idle;
        while (clock64() < until) __nanosleep(64);
      }
    }
    wgmma_wait<0>();
    fence_acc(acc);
    const long long t1 = clock64();
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) sum += acc[i];
    if (t == 0) cycles[blockIdx.x * 3 + (wg - 1)] = t1 - t0;
    sink[blockIdx.x * 384 + (wg - 1) * 128 + t] = sum;
  }
  if constexpr (kMc) cluster_sync();  // the peer's multicasts into and arrivals on this CTA are done
#else
  (void)map_a, (void)map_b, (void)steps, (void)rows_a, (void)rows_b, (void)bshare, (void)idle, (void)pad, (void)skip, (void)cycles, (void)sink;
#endif
}

template <int kWG, int kN, bool kMc, int kRA = kRing, int kRB = kRing, int kWide = 0>
int run(double run_ms, int rows_a, int rows_b, int ctas, int bshare, int idle, int pad, int skip = 0) {
  int sms = 0;
  EPMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  auto kernel = tile_mainloop<kWG, kN, kMc, kRA, kRB, kWide>;
  const uint32_t smem = kWide >= 2 ? 1024 + 3 * kWideStage : smem_bytes(kWG, kN, kRA, kRB);
  EPMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  cudaLaunchConfig_t cfg{};
  cudaLaunchAttribute attr{};
  cfg.blockDim = dim3(128 * (kWG + 1));
  cfg.dynamicSmemBytes = smem;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = kMc ? 2 : 1;
  attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int fit = sms;  // CTAs resident at once: every SM, or 2 x the clusters that fit
  if (kMc) {
    cfg.gridDim = dim3(2 * sms);
    int clusters = 0;
    EPMOE_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg));
    fit = 2 * clusters;
  }
  if (ctas <= 0 || ctas > fit) ctas = fit;
  if (kMc) ctas &= ~1;
  cfg.gridDim = dim3(ctas);
  __nv_bfloat16 *a = nullptr, *b = nullptr;
  // A has kZeroRows zero rows after its rows_a random ones (a half-padding item's box starts 64 rows
  // before them).
  EPMOE_CUDA_CHECK(cudaMalloc(&a, size_t(rows_a + kZeroRows) * kK * 2));
  EPMOE_CUDA_CHECK(cudaMemset(a + size_t(rows_a) * kK, 0, size_t(kZeroRows) * kK * 2));
  EPMOE_CUDA_CHECK(cudaMalloc(&b, size_t(rows_b) * kK * 2));
  fill_random<<<1024, 256>>>(reinterpret_cast<uint32_t*>(a), size_t(rows_a) * kK / 2, 12345u);
  fill_random<<<1024, 256>>>(reinterpret_cast<uint32_t*>(b), size_t(rows_b) * kK / 2, 777u);
  EPMOE_CUDA_CHECK(cudaGetLastError());
  const CUtensorMap map_a = make_matrix_map(a, rows_a + kZeroRows, kK, kWide == 1 || kWide == 3 || kWide == 5 ? 64 : 64 * kWG);
  const CUtensorMap map_a64 = make_matrix_map(a, rows_a + kZeroRows, kK, 64);  // the mix's wide items
  const CUtensorMap map_b = make_matrix_map(b, rows_b, kK, kMc && kWide == 0 ? kN / 2 : kN);
  long long* cyc = nullptr;
  float* sink = nullptr;
  EPMOE_CUDA_CHECK(cudaMalloc(&cyc, sizeof(long long) * 3 * size_t(ctas)));
  EPMOE_CUDA_CHECK(cudaMalloc(&sink, sizeof(float) * 384 * size_t(ctas)));
  // About 2 ms per launch for every form (~6.4e9 MACs per SM).
  const int steps = int(6.4e9 / (64.0 * kWG * kN * 64) / kKSteps) * kKSteps;
  const std::vector<float> late = time_steady(run_ms, [&] {
    EPMOE_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, map_a, map_b, map_a64, steps, rows_a, rows_b, bshare, idle, pad, skip, cyc, sink));
  });
  if (late.empty()) return 2;
  const std::vector<long long> v = consumer_cycles(cyc, ctas, kWG);
  const double med_ms = late[late.size() / 2];
  const double macs = double(ctas) * steps * 64.0 * kWG * kN * 64;
  const double cyc_med = double(v[v.size() / 2]);
  std::printf("consumer warpgroups %d x m64n%dk16%s, rings A%d / B%d (tile %d x %d, %u KB per k step from L2; %d CTAs; sources %d / %d rows, B shared by %d CTAs; idle %d cycles per item; pad %d, skip %d) | %.1f cycles per k step | MAC/cycle/SM %.0f "
              "(%.1f%% of 2048) | steady %.0f TFLOP/s (median of %zu launches, %.3f ms) | clock ~%.0f MHz\n",
              kWG, kN, kWide == 5 ? " wide k steps, 3 x 72 KB ring, pairs forwarding B by DSMEM" : kMc && kWide == 3 ? " wide k steps, 3 x 72 KB ring, B-multicast pairs" : kMc ? " B-multicast pairs" : kWide == 4 ? " mix, flags per item" : kWide == 1 ? " wide k steps on 2 ring slots" : kWide == 3 ? " wide k steps, 3 x 72 KB ring" : kWide == 2 ? " mix (every PAD-th item wide)" : "", kRA, kRB,
              kWide == 1 || kWide == 3 || kWide == 5 ? 64 : 64 * kWG, kWide == 1 || kWide == 3 || kWide == 5 ? 2 * kN : kN,
              (kWide == 1 || kWide == 3 || kWide == 5 ? abytes(kWG) / 2 + 2 * bbytes(kN) / (kMc ? 2 : 1) : abytes(kWG) + bbytes(kN) / (kMc ? 2 : 1)) / 1024, ctas,
              rows_a, rows_b, bshare, idle, pad, skip, cyc_med / steps, macs / ctas / cyc_med, 100.0 * macs / ctas / cyc_med / 2048.0, 2.0 * macs / (med_ms * 1e-3) / 1e12, late.size(), med_ms,
              cyc_med / (med_ms * 1e3));
  EPMOE_CUDA_CHECK(cudaFree(a));
  EPMOE_CUDA_CHECK(cudaFree(b));
  EPMOE_CUDA_CHECK(cudaFree(cyc));
  EPMOE_CUDA_CHECK(cudaFree(sink));
  return 0;
}
}  // namespace

int main(int argc, char** argv) {
  const std::string form = argc > 1 ? argv[1] : "";
  const double ms = argc > 2 ? std::atof(argv[2]) : 3000.0;
  const int rows_a = argc > 3 ? std::atoi(argv[3]) : 4096, rows_b = argc > 4 ? std::atoi(argv[4]) : 4096;
  const int ctas = argc > 5 ? std::atoi(argv[5]) : 0;
  const bool mc = form == "2x256mc" || form == "2x256wide3mc" || form == "2x256wide3fw";
  const int bshare = argc > 6 ? std::atoi(argv[6]) : (mc ? 6 : 5);
  const int idle = argc > 7 ? std::atoi(argv[7]) : 0;
  const int pad = argc > 8 ? std::atoi(argv[8]) : 0;
  const int skip = argc > 9 ? std::atoi(argv[9]) : 0;
  const bool ok = pad >= -64 && pad <= 1000000 && idle >= 0 && idle <= 1000000 && rows_a >= 256 && rows_b >= 256 && rows_a <= (1 << 20) && rows_b <= (1 << 20) && bshare >= 1 &&
                  bshare <= 64 && (!mc || bshare % 2 == 0);
  if (ok && form == "2x256") return run<2, 256, false>(ms, rows_a, rows_b, ctas, bshare, idle, pad, skip);
  if (ok && form == "2x256mc") return run<2, 256, true>(ms, rows_a, rows_b, ctas, bshare, idle, pad, skip);
  if (ok && form == "2x256wide3mc" && rows_b >= 512) return run<2, 256, true, kRing, kRing, 3>(ms, rows_a, rows_b, ctas, bshare, idle, pad);
  if (ok && form == "2x256wide3fw" && rows_b >= 512) return run<2, 256, true, kRing, kRing, 5>(ms, rows_a, rows_b, ctas, bshare, idle, pad);
  if (ok && form == "2x256mixh" && rows_b >= 512 && pad >= 1) return run<2, 256, false, kRing, kRing, 4>(ms, rows_a, rows_b, ctas, bshare, idle, pad);
  if (ok && form == "2x256a4b5") return run<2, 256, false, 4, 5>(ms, rows_a, rows_b, ctas, bshare, idle, pad);
  if (ok && form == "2x256a3b5") return run<2, 256, false, 3, 5>(ms, rows_a, rows_b, ctas, bshare, idle, pad);
  if (ok && form == "2x256wide" && rows_b >= 512) return run<2, 256, false, kRing, kRing, 1>(ms, rows_a, rows_b, ctas, bshare, idle, pad);
  if (ok && form == "2x256mix" && rows_b >= 512 && pad >= 1) return run<2, 256, false, kRing, kRing, 2>(ms, rows_a, rows_b, ctas, bshare, idle, pad);
  if (ok && form == "2x256wide3" && rows_b >= 512) return run<2, 256, false, kRing, kRing, 3>(ms, rows_a, rows_b, ctas, bshare, idle, pad);
  if (ok && form == "2x256a3b4") return run<2, 256, false, 3, 4>(ms, rows_a, rows_b, ctas, bshare, idle, pad);
  if (ok && form == "3x192") return run<3, 192, false>(ms, rows_a, rows_b, ctas, bshare, idle, pad);
  if (ok && form == "2x192") return run<2, 192, false>(ms, rows_a, rows_b, ctas, bshare, idle, pad);
  std::fprintf(stderr, "usage: tre 2x256|2x256mc|2x256a4b5|2x256a3b5|2x256a3b4|2x256wide|2x256wide3|2x256wide3mc|2x256wide3fw|2x256mix|2x256mixh|3x192|2x192 [MS [ROWS_A ROWS_B [CTAS [BSHARE [IDLE [PAD [SKIP]]]]]]]   (consumer warpgroups x"
               " N, mc: B multicast in 2-CTA clusters; milliseconds of launches, > 1000; source rows 256..1048576, default"
               " 4096 = 16 MB, L2-resident; CTAS: how many, 0 = all that fit at once; BSHARE: CTAs reading one B block,"
               " default 5, 6 for mc, even for mc; IDLE: cycles each consumer warpgroup sleeps after each 32-step item; PAD: every PAD-th item has zero rows in its second 64, as a tile half of padding rows; PAD < 0: every |PAD|-th item all zero rows; 0 = none)\n");
  return 2;
}
