// Microbenchmark: what a gathered row costs the SM when it is brought into shared memory by
// (a) cp.async 16-byte copies from 128 producer threads (the gathering UP's way today),
// (b) one 1D bulk copy per row (cp.async.bulk, TMA engine, no tensor map), or
// (c) one 2D tensor-map box per row ({64, 1}, 128B swizzle: session 19's in-kernel variant), or
// (d) a whole stage forwarded to a 2-CTA cluster peer by one DSMEM bulk copy (the pairs' forwarding);
// controls: one contiguous 1D bulk copy per stage, and one {64, R} tensor box of R consecutive rows;
// (e) `stage`: a DOWN k step's feed with nothing else - one {64, 128} box of the CTA's own rows (A) and
// one {64, 256} box of rows shared by 5 CTAs at a time (B, the W2 block an expert's ~5 row tiles
// stream together), both kept for 32 steps (one item at ffn 2048), in a 4-deep ring of 48 KB stages.
// Every SM runs one CTA that streams random rows of x (the 7168/T=2k case: x is 2048 x 7168 random bf16,
// L2-resident) into a ring of shared-memory stages, R rows of C bytes per stage, waiting on each
// stage's mbarrier before refilling it. Printed: time per stage, cycles per row request, bytes per
// cycle and SM. Each mode runs back-to-back launches for MS milliseconds, long enough for
// `nvidia-smi --query-gpu=power.draw,clocks.sm -lms 100` beside it to give the energy per byte
// (docs/PERF.md, session 23, has the runs and the figures). Not built by CMake: a measurement tool.
//
// Read its stage rates as lower bounds: the harness loop itself costs ~850-900 cycles per stage
// (thread 0's issue path ~450 of them, of which the TMA instructions ~65-70 each; the rest is the
// wait, the touch and the __syncthreads), whatever the stage's size, and its consumers' WORK adds to
// that instead of overlapping the loads (docs/PERF.md, session 24). So stages of 16-48 KB by tensor
// boxes all sit at that floor; per-request costs far above it (1-row boxes, cp.async) stand.
// Build flags: -DGRC_WAIT=0|1|2 (how consumers wait: the kernels' try_wait / a test_wait spin /
// try_wait with a 10 ms hint), -DGRC_PREFETCH_DESC (prefetch.tensormap at the start, as the kernels
// do), -DGRC_ISSUE_PROBE (CTA 0 prints the stage mode's cycles in expect_tx and in each box issue).
//
// From the repository root (the PTX wrappers, tensor maps and error checks are the kernels' own):
//   nvcc -std=c++20 -O3 -I. -Isrc -gencode=arch=compute_90a,code=sm_90a docs/experiments/gather_request_cost.cu \
//        kernels/sm90_tensor_maps.cu src/error.cpp -o grc -lcuda
//   ./grc MODE C R MS [WORK]   WORK = cycles the consumers hold each stage after its wait (default 0)
//                         MODE = cpasync | bulk | box | tile | dsmem | stage ; C = bytes per row per stage ;
//                         R = rows per stage (tile: one {64, R} box of R consecutive rows, C = 128, the
//                         from-xs A load; dsmem: R = 1, C = the stage's bytes, forwarded to the cluster peer;
//                         stage: C = 128, R = 384)
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cuda_check.cuh"
#include "kernels/sm90_common.cuh"
#include "kernels/sm90_tensor_maps.cuh"
#include "docs/experiments/random_bf16.cuh"

using namespace epmoe::kernels::sm90;
using epmoe::experiments::fill_random;
using epmoe::experiments::hash3;

namespace {
constexpr int kRows = 2048, kHidden = 7168;  // x: 29 MB, fits the 60 MB L2
constexpr int kSmem = 192 * 1024;
enum Mode { kCpAsync = 0, kBulk = 1, kBox = 2, kDsmem = 3, kTile = 4, kStage = 5 };


// How a stage's consumers wait (build flag -DGRC_WAIT): 0 = the kernels' mbar_wait (try_wait without a
// suspend-time hint), 1 = a test_wait spin (never suspends), 2 = try_wait with a 10 ms hint (CUTLASS's form).
#ifndef GRC_WAIT
#define GRC_WAIT 0
#endif
__device__ __forceinline__ void grc_wait(uint32_t bar, uint32_t parity) {
#if !EPMOE_SM90A_DEVICE
  (void)bar, (void)parity;
#elif GRC_WAIT == 0
  mbar_wait(bar, parity);
#else
  uint32_t done = 0;
  do {
#if GRC_WAIT == 1
    asm volatile("{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
#else
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(bar), "r"(parity), "r"(10000000u) : "memory");
#endif
  } while (!done);
#endif
}

// One CTA per SM; warps 0-3 are producers (cp.async mode uses all 128 threads, the TMA modes warp 0).
__global__ void __launch_bounds__(128, 1)
    gather_stream(const __nv_bfloat16* __restrict__ x, const __grid_constant__ CUtensorMap map,
                  const __grid_constant__ CUtensorMap map_b, int mode,
                  int bytes_per_row, int rows_per_stage, int stages, int work, unsigned long long* cycles_out,
                  unsigned* checksum) {
#if EPMOE_SM90A_DEVICE  // the wrappers of sm90_common.cuh exist only in the sm_90a device pass
  extern __shared__ __align__(1024) uint8_t smem[];
  __shared__ __align__(8) uint64_t bars[16];
  const int stage_bytes = bytes_per_row * rows_per_stage;
  const int nbuf = min(16, kSmem / stage_bytes);
  const int t = int(threadIdx.x);
  if (t < nbuf) mbar_init(smem_u32(&bars[t]), mode == kCpAsync ? 128u : 1u);
#ifdef GRC_PREFETCH_DESC
  if (t == 0) {  // as the kernels do once at their start
    tma_prefetch_desc(&map);
    tma_prefetch_desc(&map_b);
  }
#endif
  mbar_fence_init();
  __syncthreads();
  const int col_steps = max(1, kHidden * 2 / bytes_per_row);  // a row's segments, walked like k steps
#ifdef GRC_ISSUE_PROBE
  long long probe[3] = {0, 0, 0};
#endif
  auto issue = [&](int s) {
    const int b = s % nbuf;
    const uint32_t bar = smem_u32(&bars[b]);
    uint8_t* dst = smem + size_t(b) * stage_bytes;
    const int seg = s % col_steps;
    if (mode == kCpAsync) {
      const int chunks = stage_bytes / 16;  // 16-byte copies of this stage, spread over 128 threads
      const int per_row = bytes_per_row / 16;
      for (int i = t; i < chunks; i += 128) {
        const int r = i / per_row, c = i % per_row;
        const uint32_t row = hash3(blockIdx.x, s, r) % kRows;
        const uint8_t* src = reinterpret_cast<const uint8_t*>(x) + (size_t(row) * kHidden * 2 + size_t(seg) * bytes_per_row + c * 16);
        cp_async_16_zfill(smem_u32(dst + size_t(i) * 16), src, 16);
      }
      cp_async_mbar_arrive_noinc(bar);
    } else if (mode == kStage) {  // DOWN's stage: A {64, 128} own rows + B {64, 256} rows shared by 5 CTAs
      if (t == 0) {
        const uint32_t item = uint32_t(s / 32), k = uint32_t(s % 32);
        const int ra = int(hash3(blockIdx.x, item, 1) % uint32_t(kRows - 128 + 1));
        const int rb = int(hash3(blockIdx.x / 5, item, 2) % uint32_t(kRows - 256 + 1));
#ifdef GRC_ISSUE_PROBE  // where thread 0's issue time goes: expect_tx / A box / B box
        long long p0 = clock64();
        mbar_arrive_expect_tx(bar, uint32_t(stage_bytes));
        long long p1 = clock64();
        tma_load_2d(smem_u32(dst), &map, bar, int(k) * 64, ra);
        long long p2 = clock64();
        tma_load_2d(smem_u32(dst + 128 * 128), &map_b, bar, int(k) * 64, rb);
        long long p3 = clock64();
        probe[0] += p1 - p0, probe[1] += p2 - p1, probe[2] += p3 - p2;
#else
        mbar_arrive_expect_tx(bar, uint32_t(stage_bytes));
        tma_load_2d(smem_u32(dst), &map, bar, int(k) * 64, ra);
        tma_load_2d(smem_u32(dst + 128 * 128), &map_b, bar, int(k) * 64, rb);
#endif
      }
    } else if (mode == kTile) {  // one {64, R} box of R consecutive rows: the from-xs A load
      if (t == 0) {
        mbar_arrive_expect_tx(bar, uint32_t(stage_bytes));
        const int r0 = int(hash3(blockIdx.x, s, 0) % uint32_t(kRows - rows_per_stage + 1));
        tma_load_2d(smem_u32(dst), &map, bar, seg * 64, r0);
      }
    } else if (t < 32) {
      if (t == 0) mbar_arrive_expect_tx(bar, uint32_t(stage_bytes));
      __syncwarp();
      for (int r = t; r < rows_per_stage; r += 32) {
        const uint32_t h = hash3(blockIdx.x, s, r), row = h % kRows;
        const uint32_t d = smem_u32(dst + size_t(r) * bytes_per_row);
        if (mode == kBulk) {
          // Rows longer than x's (the contiguous control: one big request per stage) index x as flat.
          const size_t off = bytes_per_row > kHidden * 2
                                 ? size_t(h % uint32_t(size_t(kRows) * kHidden * 2 / bytes_per_row)) * bytes_per_row
                                 : size_t(row) * kHidden * 2 + size_t(seg) * bytes_per_row;
          const uint8_t* src = reinterpret_cast<const uint8_t*>(x) + off;
          asm volatile(
              "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(d),
              "l"(src), "r"(bytes_per_row), "r"(bar)
              : "memory");
        } else {  // box {64, 1}
          tma_load_2d(d, &map, bar, seg * 64, int(row));
        }
      }
    }
  };
  const long long t0 = clock64();
  for (int s = 0; s < min(nbuf, stages); ++s) issue(s);
  unsigned sum = 0;
  long long issue_cycles = 0;
  for (int s = 0; s < stages; ++s) {
    const int b = s % nbuf;
    grc_wait(smem_u32(&bars[b]), uint32_t((s / nbuf) & 1));
    sum += smem[size_t(b) * stage_bytes + (t * 16) % stage_bytes];  // touch the data
    if (work > 0) {  // the consumers' tensor work on the stage (a DOWN k step: ~1024 cycles) before its release
      const long long tw = clock64();
      while (clock64() - tw < work) {
      }
    }
    __syncthreads();  // every thread past the wait before the buffer is refilled
    if (s + nbuf < stages) {
      const long long ti = clock64();
      issue(s + nbuf);
      issue_cycles += clock64() - ti;
    }
  }
  const long long t1 = clock64();
  if (t == 0) {
    cycles_out[blockIdx.x] = (unsigned long long)(t1 - t0);
    cycles_out[gridDim.x + blockIdx.x] = (unsigned long long)issue_cycles;  // thread 0: the TMA modes' issuer
#ifdef GRC_ISSUE_PROBE
    if (blockIdx.x == 0)
      printf("probe (CTA 0, cycles per stage): expect_tx %.0f, A box %.0f, B box %.0f\n", double(probe[0]) / stages,
             double(probe[1]) / stages, double(probe[2]) / stages);
#endif
  }
  if (sum == 0xFFFFFFFFu) atomicAdd(checksum, sum);
#endif
}

// DSMEM forwarding as the A-sharing pairs do it: each CTA of a 2-CTA cluster bulk-copies a constant
// stage of `stage_bytes` from its shared memory into its peer's ring (shared::cta -> shared::cluster,
// completing on the peer's full barrier); the peer's warp 0 waits, touches, re-arms and returns the
// slot through a remote arrive on the sender's empty barrier. Thread 32 sends, warp 0 receives.
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(128, 1)
    dsmem_stream(int stage_bytes, int stages, unsigned long long* cycles_out, unsigned* checksum) {
#if EPMOE_SM90A_DEVICE  // the wrappers of sm90_common.cuh exist only in the sm_90a device pass
  extern __shared__ __align__(1024) uint8_t smem[];  // [source stage][ring of nbuf stages]
  __shared__ __align__(8) uint64_t full[16], empty[16];
  const int nbuf = min(16, (kSmem - stage_bytes) / stage_bytes);
  const int t = int(threadIdx.x);
  for (int i = t; i < stage_bytes / 4; i += 128) {  // a random source stage, as the gathered rows are
    const uint32_t h = hash3(blockIdx.x, uint32_t(i), 7u);
    reinterpret_cast<uint32_t*>(smem)[i] = h;
  }
  if (t < nbuf) {
    mbar_init(smem_u32(&full[t]), 1u);
    mbar_init(smem_u32(&empty[t]), 1u);
  }
  mbar_fence_init();  // also orders the source stage's generic writes before the bulk copies read it
  __syncthreads();
  if (t == 0)
    for (int b = 0; b < min(nbuf, stages); ++b) mbar_arrive_expect_tx(smem_u32(&full[b]), uint32_t(stage_bytes));
  cluster_sync();
  const uint32_t peer = cluster_ctarank() ^ 1u;
  const long long t0 = clock64();
  unsigned sum = 0;
  if (t == 32) {
    for (int s = 0; s < stages; ++s) {
      const int b = s % nbuf;
      if (s >= nbuf) mbar_wait(smem_u32(&empty[b]), uint32_t(((s / nbuf) - 1) & 1));
      bulk_copy_to_peer(mapa_shared(smem_u32(smem + size_t(1 + b) * stage_bytes), peer), smem_u32(smem),
                        uint32_t(stage_bytes), mapa_shared(smem_u32(&full[b]), peer));
    }
  } else if (t < 32) {
    for (int s = 0; s < stages; ++s) {
      const int b = s % nbuf;
      mbar_wait(smem_u32(&full[b]), uint32_t((s / nbuf) & 1));
      sum += smem[size_t(1 + b) * stage_bytes + (t * 16) % stage_bytes];
      __syncwarp();
      if (t == 0) {
        if (s + nbuf < stages) mbar_arrive_expect_tx(smem_u32(&full[b]), uint32_t(stage_bytes));
        mbar_arrive_remote(mapa_shared(smem_u32(&empty[b]), peer));
      }
    }
  }
  const long long t1 = clock64();
  if (t == 0) cycles_out[blockIdx.x] = (unsigned long long)(t1 - t0);
  if (sum == 0xFFFFFFFFu) atomicAdd(checksum, sum);
  cluster_sync();  // no CTA leaves while its peer may still write into its shared memory
#endif
}
}  // namespace

int main(int argc, char** argv) {
  const char* usage = "usage: grc cpasync|bulk|box|tile|dsmem|stage BYTES_PER_ROW ROWS_PER_STAGE MS [WORK]\n";
  if (argc < 5) {
    std::fprintf(stderr, "%s", usage);
    return 2;
  }
  const std::string name = argv[1];
  const int mode = name == "cpasync" ? kCpAsync
                   : name == "bulk"  ? kBulk
                   : name == "box"   ? kBox
                   : name == "dsmem" ? kDsmem
                   : name == "tile"  ? kTile
                   : name == "stage" ? kStage
                                     : -1;
  const int bpr = std::atoi(argv[2]), rps = std::atoi(argv[3]);
  const double run_ms = std::atof(argv[4]);
  const int work = argc > 5 ? std::atoi(argv[5]) : 0;  // cycles each stage is held after its wait
  const bool sizes_ok = bpr > 0 && bpr % 16 == 0 && rps > 0 && bpr * rps <= kSmem / 2 &&
                        (mode != kCpAsync || bpr <= 128) && (mode != kBox || bpr == 128) &&
                        (mode != kTile || (bpr == 128 && rps <= 256)) && (mode != kDsmem || rps == 1) &&
                        (mode != kStage || (bpr == 128 && rps == 384));
  if (mode < 0 || !sizes_ok) {
    std::fprintf(stderr, "%sunknown mode or bad sizes (cpasync: <= 128 B per row; box, tile: 128 B; tile: <= 256 rows;"
                 " dsmem: 1 row; stage: 128 B x 384 rows; a stage <= 96 KB)\n", usage);
    return 2;
  }
  int sms = 0;
  EPMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  __nv_bfloat16* x = nullptr;
  EPMOE_CUDA_CHECK(cudaMalloc(&x, size_t(kRows) * kHidden * 2));
  fill_random<<<1024, 256>>>(reinterpret_cast<uint32_t*>(x), size_t(kRows) * kHidden / 2, 12345u);
  EPMOE_CUDA_CHECK(cudaGetLastError());
  unsigned long long* cyc = nullptr;
  unsigned* chk = nullptr;
  EPMOE_CUDA_CHECK(cudaMalloc(&cyc, 2 * sms * sizeof(unsigned long long)));
  EPMOE_CUDA_CHECK(cudaMemset(cyc, 0, 2 * sms * sizeof(unsigned long long)));
  EPMOE_CUDA_CHECK(cudaMalloc(&chk, sizeof(unsigned)));
  // The kernels' own matrix map (128B swizzle, box {64, rows}): {64, 1} per row, or {64, R} for a tile.
  const CUtensorMap map = make_matrix_map(x, kRows, kHidden, mode == kTile ? rps : mode == kStage ? 128 : 1);
  const CUtensorMap map_b = make_matrix_map(x, kRows, kHidden, 256);
  EPMOE_CUDA_CHECK(cudaFuncSetAttribute(gather_stream, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  EPMOE_CUDA_CHECK(cudaFuncSetAttribute(dsmem_stream, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  auto launch = [&](int n) {
    if (mode == kDsmem)
      dsmem_stream<<<sms / 2 * 2, 128, kSmem>>>(bpr, n, cyc, chk);
    else
      gather_stream<<<sms, 128, kSmem>>>(x, map, map_b, mode, bpr, rps, n, work, cyc, chk);
  };
  const int stages = 2000;
  cudaEvent_t a, b;
  EPMOE_CUDA_CHECK(cudaEventCreate(&a));
  EPMOE_CUDA_CHECK(cudaEventCreate(&b));
  launch(50);  // warm-up
  EPMOE_CUDA_CHECK(cudaGetLastError());
  EPMOE_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> times;
  double elapsed = 0;
  while (elapsed < run_ms || times.size() < 5) {
    EPMOE_CUDA_CHECK(cudaEventRecord(a));
    launch(stages);
    EPMOE_CUDA_CHECK(cudaEventRecord(b));
    EPMOE_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    EPMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    times.push_back(ms);
    elapsed += ms;
  }
  EPMOE_CUDA_CHECK(cudaGetLastError());
  std::vector<unsigned long long> c(2 * size_t(sms));
  EPMOE_CUDA_CHECK(cudaMemcpy(c.data(), cyc, 2 * sms * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
  std::sort(times.begin(), times.end());
  const double med = times[times.size() / 2];
  double cyc_mean = 0;
  double issue_mean = 0;
  for (int i = 0; i < sms; ++i) {
    cyc_mean += double(c[size_t(i)]) / sms;
    issue_mean += double(c[size_t(sms + i)]) / sms;
  }
  const double stage_bytes = double(bpr) * rps;
  const double per_stage_cyc = cyc_mean / stages;
  std::printf(
      "mode=%s bytes_per_row=%d rows_per_stage=%d work=%d stages=%d launches=%zu | median %.3f ms | %.1f ns/stage | "
      "%.0f cycles/stage (thread 0 issuing: %.0f) | %.1f cycles/row | %.1f B/cycle/SM | %.1f GB/s all SMs | SM clock %.0f MHz\n",
      argv[1], bpr, rps, work, stages, times.size(), med, med * 1e6 / stages, per_stage_cyc, issue_mean / stages, per_stage_cyc / rps,
      stage_bytes / per_stage_cyc, stage_bytes * stages * sms / (med * 1e-3) / 1e9, per_stage_cyc * stages / (med * 1e3));
  return 0;
}
