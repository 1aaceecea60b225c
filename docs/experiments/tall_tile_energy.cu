// Microbenchmark (session 27): the 192 x 256 tile's mainloop at the 700 W cap, beside
// tile_rows_energy.cu's 2x256 (today's 128 x 256). Two consumer warpgroups each run their 64 rows on
// the whole 256-row B box (m64n256) and the tile's last 64 rows on their own 128-row half of it
// (m64n128): 192 accumulators per thread, which ptxas builds without spills at 224-232 registers
// under setmaxnreg in a 384-thread CTA (216 spills). Everything else as tile_rows_energy.cu's forms:
// a TMA producer thread, a ring of stages, consumers at wait<1> releasing the previous stage, random
// bf16 operands (L2-resident by default), A = each CTA's own rows, B shared by BSHARE CTAs, 32 k steps
// per item, no epilogue. Why: 192-row tiles pad 7168/T=2k's rows 11.1% (per-expert 128/192 heights:
// 6.9%) instead of 12.9%, if the tall tile costs no more per MAC than today's at the cap. Measured
// (docs/PERF.md, session 27): 6-7% less with L2-resident operands, 10-12% less with B from DRAM; the
// MIX branch alone costs 1-2% (ptxas injects warpgroup.arrive where the two paths join, C7519).
// Not built by CMake: a measurement tool.
//
// From the repository root:
//   nvcc -std=c++20 -O3 -I. -Isrc -gencode=arch=compute_90a,code=sm_90a docs/experiments/tall_tile_energy.cu \
//        kernels/sm90_tensor_maps.cu src/error.cpp -o tte -lcuda
//   ./tte FORM MS [ROWS_A ROWS_B [CTAS [BSHARE [MIX]]]]
//     FORM = tall (4 x 56 KB ring) | tall3 (3 x 56 KB: what UP keeps beside its epilogue staging);
//     MS = milliseconds of launches (> 1000); source rows (default 4096, L2-resident; 262144: B from
//     DRAM); CTAS (0: one per SM); BSHARE = CTAs reading one B block (default 5); MIX > 0: every
//     MIX-th item of a CTA is a 128-row one (A 16 KB, m64n256 only) on the same ring.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

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
using epmoe::experiments::consumer_cycles;
using epmoe::experiments::fence_acc;
using epmoe::experiments::fill_random;
using epmoe::experiments::hash3;
using epmoe::experiments::time_steady;

namespace {
constexpr int kK = 2048, kKSteps = kK / 64;  // sources ROWS x 2048 bf16; 32 k steps per item
constexpr uint32_t kProducerRegs = 40;

// D[64 x 128] (+)= A[64 x 16] * B[128 x 16]^T, scale_d 0 starting a new accumulation: the tall form's
// extra 64 rows, each warpgroup on its own 128-row half of the B box. Same fragment layout, 64 registers.
__device__ __forceinline__ void wgmma_m64n128k16_bf16(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// The tall form (forms tall / tall3): a 192 x 256 tile on the same two consumer warpgroups. Each
// warpgroup runs its 64 rows against the whole B box (m64n256, 128 accumulators) and the tile's last
// 64 rows against its own 128-row half of the box (m64n128, 64 more): 56 KB per k step (A 24 KB,
// B 32 KB) for 1.5x the MACs of today's 48 KB one, -26% L2->shared bytes per MAC (the 3-warpgroup
// 192 x 256 tile cannot be built: tile_rows_energy.cu says why). kTallStages 4 (form tall, 225 KB)
// or 3 (tall3: what UP could keep beside its epilogue staging).
#ifndef TTE_CONSUMER_REGS
#define TTE_CONSUMER_REGS 232  // consumers; the producer keeps 40 (40 x 128 + 232 x 256 = 64512)
#endif
constexpr uint32_t kTallA = 192 * 128, kTallStage = kTallA + 256 * 128;
// MIX > 0: every MIX-th item of a CTA (staggered over the CTAs) is a 128-row item on the same ring (A
// 16 KB, m64n256 only), as a kernel with per-expert heights runs both; 0: every item tall.
__device__ __forceinline__ bool short_item(uint32_t item, int mix) {
  return mix > 0 && (item + blockIdx.x) % uint32_t(mix) == uint32_t(mix - 1);
}
static_assert(1024 + 4 * kTallStage <= 227 * 1024, "the 4 x 56 KB tall ring must fit the opt-in limit");
static_assert(kProducerRegs * 128 + 2 * 128 * TTE_CONSUMER_REGS <= 65536 / 384 / 8 * 8 * 384, "tall split");
template <int kTallStages>
__global__ void __launch_bounds__(384, 1)
    tall_mainloop(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                  const __grid_constant__ CUtensorMap map_a128, int steps, int rows_a, int rows_b, int bshare, int mix,
                  long long* cycles, float* sink) {
#if EPMOE_SM90A_DEVICE
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full[kTallStages], empty[kTallStages];
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const int wg = int(threadIdx.x) / 128, t = int(threadIdx.x) % 128;
  if (threadIdx.x < kTallStages) {
    mbar_init(smem_u32(&full[threadIdx.x]), 1);
    mbar_init(smem_u32(&empty[threadIdx.x]), 256);  // every consumer thread
  }
  mbar_fence_init();
  __syncthreads();
  if (wg == 0) {
    setmaxnreg_dec<kProducerRegs>();
    if (t == 0) {
      tma_prefetch_desc(&map_a);
      tma_prefetch_desc(&map_b);
      for (int s = 0; s < steps; ++s) {
        const int slot = s % kTallStages;
        if (s >= kTallStages) mbar_wait(smem_u32(&empty[slot]), uint32_t((s / kTallStages - 1) & 1));
        const uint32_t item = uint32_t(s / kKSteps), bar = smem_u32(&full[slot]), dst = base + uint32_t(slot) * kTallStage;
        const int k = s % kKSteps;
        const int ra = int(hash3(blockIdx.x, item, 1) % uint32_t(rows_a - 192 + 1));
        const int rb = int(hash3(blockIdx.x / uint32_t(bshare), item, 2) % uint32_t(rows_b - 256 + 1));
        const bool tall = !short_item(item, mix);
        mbar_arrive_expect_tx(bar, tall ? kTallStage : kTallStage - 64 * 128);
        tma_load_2d(dst, tall ? &map_a : &map_a128, bar, k * 64, ra);  // 192 (or 128) rows
        tma_load_2d(dst + kTallA, &map_b, bar, k * 64, rb);
      }
    }
  } else {
    setmaxnreg_inc<TTE_CONSUMER_REGS>();
    float acc[128], acc2[64];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
#pragma unroll
    for (int i = 0; i < 64; ++i) acc2[i] = 0.0f;
    const long long t0 = clock64();
    for (int s = 0; s < steps; ++s) {
      const int slot = s % kTallStages;
      mbar_wait(smem_u32(&full[slot]), uint32_t((s / kTallStages) & 1));
      const uint32_t st = base + uint32_t(slot) * kTallStage;
      const uint32_t da = smem_desc_sw128_lo(st + uint32_t(wg - 1) * 64 * 128);  // this warpgroup's 64 rows
      const uint32_t dx = smem_desc_sw128_lo(st + 128 * 128);                   // the tile's rows 128..191
      const uint32_t db = smem_desc_sw128_lo(st + kTallA);
      const uint32_t dbx = smem_desc_sw128_lo(st + kTallA + uint32_t(wg - 1) * 128 * 128);  // its B half
      fence_acc(acc);
      fence_acc(acc2);
      wgmma_fence();
      const int first = (s % kKSteps) == 0 ? 0 : 1;
      if (short_item(uint32_t(s / kKSteps), mix)) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          wgmma_m64n256k16_bf16(acc, smem_desc_sw128_join(da + 2 * kk), smem_desc_sw128_join(db + 2 * kk),
                                kk == 0 ? first : 1);
      } else {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          wgmma_m64n256k16_bf16(acc, smem_desc_sw128_join(da + 2 * kk), smem_desc_sw128_join(db + 2 * kk),
                                kk == 0 ? first : 1);
          wgmma_m64n128k16_bf16(acc2, smem_desc_sw128_join(dx + 2 * kk), smem_desc_sw128_join(dbx + 2 * kk),
                                kk == 0 ? first : 1);
        }
      }
      wgmma_commit();
      wgmma_wait<1>();
      fence_acc(acc);
      fence_acc(acc2);
      if (s > 0) mbar_arrive(smem_u32(&empty[(s - 1) % kTallStages]));
    }
    wgmma_wait<0>();
    fence_acc(acc);
    fence_acc(acc2);
    const long long t1 = clock64();
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < 128; ++i) sum += acc[i];
#pragma unroll
    for (int i = 0; i < 64; ++i) sum += acc2[i];
    if (t == 0) cycles[blockIdx.x * 3 + (wg - 1)] = t1 - t0;
    sink[blockIdx.x * 384 + (wg - 1) * 128 + t] = sum;
  }
#else
  (void)map_a, (void)map_b, (void)steps, (void)rows_a, (void)rows_b, (void)bshare, (void)cycles, (void)sink;
#endif
}

// The tall form's driver: the same sources, sharing and timing as run(); 192 x 256 MACs per k step.
template <int kTallStages>
int run_tall(double run_ms, int rows_a, int rows_b, int ctas, int bshare, int mix) {
  int sms = 0;
  EPMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  auto kernel = tall_mainloop<kTallStages>;
  const uint32_t smem = 1024 + kTallStages * kTallStage;
  EPMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  if (ctas <= 0 || ctas > sms) ctas = sms;
  __nv_bfloat16 *a = nullptr, *b = nullptr;
  EPMOE_CUDA_CHECK(cudaMalloc(&a, size_t(rows_a) * kK * 2));
  EPMOE_CUDA_CHECK(cudaMalloc(&b, size_t(rows_b) * kK * 2));
  fill_random<<<1024, 256>>>(reinterpret_cast<uint32_t*>(a), size_t(rows_a) * kK / 2, 12345u);
  fill_random<<<1024, 256>>>(reinterpret_cast<uint32_t*>(b), size_t(rows_b) * kK / 2, 777u);
  EPMOE_CUDA_CHECK(cudaGetLastError());
  const CUtensorMap map_a = make_matrix_map(a, rows_a, kK, 192), map_b = make_matrix_map(b, rows_b, kK, 256);
  const CUtensorMap map_a128 = make_matrix_map(a, rows_a, kK, 128);
  long long* cyc = nullptr;
  float* sink = nullptr;
  EPMOE_CUDA_CHECK(cudaMalloc(&cyc, sizeof(long long) * 3 * size_t(ctas)));
  EPMOE_CUDA_CHECK(cudaMalloc(&sink, sizeof(float) * 384 * size_t(ctas)));
  const int steps = int(6.4e9 / (192.0 * 256 * 64) / kKSteps) * kKSteps;  // ~2 ms per launch, as run()'s
  const std::vector<float> late = time_steady(run_ms, [&] {
    kernel<<<ctas, 384, smem>>>(map_a, map_b, map_a128, steps, rows_a, rows_b, bshare, mix, cyc, sink);
  });
  if (late.empty()) return 2;
  const std::vector<long long> v = consumer_cycles(cyc, ctas, 2);
  const double med_ms = late[late.size() / 2], cyc_med = double(v[v.size() / 2]);
  // MACs: with MIX, 1 / MIX of each CTA's items (to within one) are 128-row ones.
  double macs = 0;
  for (int c = 0; c < ctas; ++c)
    for (int i = 0; i < steps / kKSteps; ++i)
      macs += (mix > 0 && (i + c) % mix == mix - 1 ? 128.0 : 192.0) * 256 * 64 * kKSteps;
  std::printf("tall: consumer warpgroups 2 x (m64n256k16 + m64n128k16), %d x 56 KB ring, %d registers (tile 192 x 256; %d CTAs;"
              " sources %d / %d rows, B shared by %d CTAs; mix %d) | %.1f cycles per k step | MAC/cycle/SM %.0f (%.1f%% of 2048) |"
              " steady %.0f TFLOP/s (median of %zu launches, %.3f ms) | clock ~%.0f MHz\n",
              kTallStages, TTE_CONSUMER_REGS, ctas, rows_a, rows_b, bshare, mix, cyc_med / steps, macs / ctas / cyc_med,
              100.0 * macs / ctas / cyc_med / 2048.0, 2.0 * macs / (med_ms * 1e-3) / 1e12, late.size(), med_ms,
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
  const int bshare = argc > 6 ? std::atoi(argv[6]) : 5;
  const int mix = argc > 7 ? std::atoi(argv[7]) : 0;
  const bool ok = rows_a >= 256 && rows_b >= 256 && rows_a <= (1 << 20) && rows_b <= (1 << 20) && bshare >= 1 &&
                  bshare <= 64 && mix >= 0 && mix <= 1000;
  if (ok && form == "tall") return run_tall<4>(ms, rows_a, rows_b, ctas, bshare, mix);
  if (ok && form == "tall3") return run_tall<3>(ms, rows_a, rows_b, ctas, bshare, mix);
  std::fprintf(stderr, "usage: tte tall|tall3 [MS [ROWS_A ROWS_B [CTAS [BSHARE [MIX]]]]]   (milliseconds of launches,"
               " > 1000; source rows 256..1048576, default 4096 = 16 MB, L2-resident; CTAS: 0 = one per SM; BSHARE:"
               " CTAs reading one B block, default 5; MIX: every MIX-th item a 128-row one, 0 = none)\n");
  return 2;
}
