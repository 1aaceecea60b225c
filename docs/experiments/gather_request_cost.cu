// Microbenchmark: what a gathered row costs the SM when it is brought into shared memory by
// (a) cp.async 16-byte copies from 128 producer threads (the gathering UP's way today),
// (b) one 1D bulk copy per row (cp.async.bulk, TMA engine, no tensor map), or
// (c) one 2D tensor-map box per row ({64, 1}, 128B swizzle: session 19's in-kernel variant), or
// (d) a whole stage forwarded to a 2-CTA cluster peer by one DSMEM bulk copy (the pairs' forwarding);
// controls: one contiguous 1D bulk copy per stage, and one {64, R} tensor box of R consecutive rows.
// Every SM runs one CTA that streams random rows of x (the 7168/T=2k case: x is 2048 x 7168 random bf16,
// L2-resident) into a ring of shared-memory stages, R rows of C bytes per stage, waiting on each
// stage's mbarrier before refilling it. Printed: time per stage, cycles per row request, bytes per
// cycle and SM. Each mode runs back-to-back launches for MS milliseconds, long enough for
// `nvidia-smi --query-gpu=power.draw,clocks.sm -lms 100` beside it to give the energy per byte
// (docs/PERF.md, session 23, has the runs and the figures). Not built by CMake: a measurement tool.
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a gather_request_cost.cu -o grc -lcuda
//   ./grc MODE C R MS     MODE = cpasync | bulk | box | tile | dsmem ; C = bytes per row per stage ;
//                         R = rows per stage (tile: one {64, R} box of R consecutive rows, C = 128, the
//                         from-xs A load; dsmem: R = 1, C = the stage's bytes, forwarded to the cluster peer)
#include <cuda.h>
#include <cuda_runtime.h>

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CK(x)                                                                                  \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

namespace {
constexpr int kRows = 2048, kHidden = 7168;  // x: 29 MB, fits the 60 MB L2
constexpr int kSmem = 192 * 1024;
enum Mode { kCpAsync = 0, kBulk = 1, kBox = 2, kDsmem = 3, kTile = 4 };

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return uint32_t(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ uint32_t hash3(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t h = a * 0x9E3779B1u ^ (b + 0x7F4A7C15u) * 0x85EBCA77u ^ (c + 0x165667B1u) * 0xC2B2AE3Du;
  h ^= h >> 15;
  h *= 0x2C1B3C6Du;
  h ^= h >> 12;
  return h;
}
// Fresh pseudo-random bf16 in [-1, 1) (the energy of moving bytes depends on how their bits toggle).
__global__ void fill_random(uint32_t* p, size_t words, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < words; i += size_t(gridDim.x) * blockDim.x) {
    const uint32_t h = hash3(uint32_t(i), uint32_t(i >> 32), seed);
    const __nv_bfloat16 lo = __float2bfloat16(float(h & 0xffff) / 32768.f - 1.f);
    const __nv_bfloat16 hi = __float2bfloat16(float(h >> 16) / 32768.f - 1.f);
    p[i] = uint32_t(__bfloat16_as_ushort(lo)) | uint32_t(__bfloat16_as_ushort(hi)) << 16;
  }
}
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred p;\n W%=: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W%=;\n}" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// One CTA per SM; warps 0-3 are producers (cp.async mode uses all 128 threads, the TMA modes warp 0).
__global__ void __launch_bounds__(128, 1)
    gather_stream(const __nv_bfloat16* __restrict__ x, const __grid_constant__ CUtensorMap map, int mode,
                  int bytes_per_row, int rows_per_stage, int stages, unsigned long long* cycles_out,
                  unsigned* checksum) {
  extern __shared__ __align__(1024) uint8_t smem[];
  __shared__ __align__(8) uint64_t bars[16];
  const int stage_bytes = bytes_per_row * rows_per_stage;
  const int nbuf = min(16, kSmem / stage_bytes);
  const int t = int(threadIdx.x);
  if (t < nbuf) mbar_init(smem_u32(&bars[t]), mode == kCpAsync ? 128u : 1u);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncthreads();
  const int col_steps = max(1, kHidden * 2 / bytes_per_row);  // a row's segments, walked like k steps
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
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst + size_t(i) * 16)), "l"(src)
                     : "memory");
      }
      asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
    } else if (mode == kTile) {  // one {64, R} box of R consecutive rows: the from-xs A load
      if (t == 0) {
        mbar_expect_tx(bar, uint32_t(stage_bytes));
        const int r0 = int(hash3(blockIdx.x, s, 0) % uint32_t(kRows - rows_per_stage + 1));
        asm volatile(
            "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
            "[%4];" ::"r"(smem_u32(dst)),
            "l"(&map), "r"(seg * 64), "r"(r0), "r"(bar)
            : "memory");
      }
    } else if (t < 32) {
      if (t == 0) mbar_expect_tx(bar, uint32_t(stage_bytes));
      __syncwarp();
      for (int r = t; r < rows_per_stage; r += 32) {
        const uint32_t row = hash3(blockIdx.x, s, r) % kRows;
        const uint32_t d = smem_u32(dst + size_t(r) * bytes_per_row);
        if (mode == kBulk) {
          // Rows longer than x's (the contiguous control: one big request per stage) index x as flat.
          const size_t off = bytes_per_row > kHidden * 2
                                 ? size_t(hash3(blockIdx.x, s, r) % uint32_t(size_t(kRows) * kHidden * 2 / bytes_per_row)) * bytes_per_row
                                 : size_t(row) * kHidden * 2 + size_t(seg) * bytes_per_row;
          const uint8_t* src = reinterpret_cast<const uint8_t*>(x) + off;
          asm volatile(
              "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(d),
              "l"(src), "r"(bytes_per_row), "r"(bar)
              : "memory");
        } else {  // box {bytes_per_row / 2, 1}
          const int c0 = seg * (bytes_per_row / 2);
          asm volatile(
              "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
              "[%4];" ::"r"(d),
              "l"(&map), "r"(c0), "r"(int(row)), "r"(bar)
              : "memory");
        }
      }
    }
  };
  const long long t0 = clock64();
  for (int s = 0; s < min(nbuf, stages); ++s) issue(s);
  unsigned sum = 0;
  for (int s = 0; s < stages; ++s) {
    const int b = s % nbuf;
    mbar_wait(smem_u32(&bars[b]), uint32_t((s / nbuf) & 1));
    sum += smem[size_t(b) * stage_bytes + (t * 16) % stage_bytes];  // touch the data
    __syncthreads();  // every thread past the wait before the buffer is refilled
    if (s + nbuf < stages) issue(s + nbuf);
  }
  const long long t1 = clock64();
  if (t == 0) cycles_out[blockIdx.x] = (unsigned long long)(t1 - t0);
  if (sum == 0xFFFFFFFFu) atomicAdd(checksum, sum);
}

// DSMEM forwarding as the A-sharing pairs do it: each CTA of a 2-CTA cluster bulk-copies a constant
// stage of `stage_bytes` from its shared memory into its peer's ring (shared::cta -> shared::cluster,
// completing on the peer's full barrier); the peer's warp 0 waits, touches, re-arms and returns the
// slot through a remote arrive on the sender's empty barrier. Thread 32 sends, warp 0 receives.
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(128, 1)
    dsmem_stream(int stage_bytes, int stages, unsigned long long* cycles_out, unsigned* checksum) {
  extern __shared__ __align__(1024) uint8_t smem[];  // [source stage][ring of nbuf stages]
  __shared__ __align__(8) uint64_t full[16], empty[16];
  const int nbuf = min(16, (kSmem - stage_bytes) / stage_bytes);
  const int t = int(threadIdx.x);
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  auto mapa = [](uint32_t a, uint32_t r) {
    uint32_t o;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(o) : "r"(a), "r"(r));
    return o;
  };
  for (int i = t; i < stage_bytes / 4; i += 128) {  // a random source stage, as the gathered rows are
    const uint32_t h = hash3(blockIdx.x, uint32_t(i), 7u);
    reinterpret_cast<uint32_t*>(smem)[i] = h;
  }
  if (t < nbuf) {
    mbar_init(smem_u32(&full[t]), 1u);
    mbar_init(smem_u32(&empty[t]), 1u);
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  if (t == 0)
    for (int b = 0; b < min(nbuf, stages); ++b) mbar_expect_tx(smem_u32(&full[b]), uint32_t(stage_bytes));
  asm volatile("barrier.cluster.arrive.release;\n barrier.cluster.wait.acquire;" ::: "memory");
  const uint32_t peer = rank ^ 1u;
  const long long t0 = clock64();
  unsigned sum = 0;
  if (t == 32) {
    for (int s = 0; s < stages; ++s) {
      const int b = s % nbuf;
      if (s >= nbuf) mbar_wait(smem_u32(&empty[b]), uint32_t(((s / nbuf) - 1) & 1));
      const uint32_t dst = mapa(smem_u32(smem + size_t(1 + b) * stage_bytes), peer);
      const uint32_t bar = mapa(smem_u32(&full[b]), peer);
      asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                       dst),
                   "r"(smem_u32(smem)), "r"(stage_bytes), "r"(bar)
                   : "memory");
    }
  } else if (t < 32) {
    for (int s = 0; s < stages; ++s) {
      const int b = s % nbuf;
      mbar_wait(smem_u32(&full[b]), uint32_t((s / nbuf) & 1));
      sum += smem[size_t(1 + b) * stage_bytes + (t * 16) % stage_bytes];
      __syncwarp();
      if (t == 0) {
        if (s + nbuf < stages) mbar_expect_tx(smem_u32(&full[b]), uint32_t(stage_bytes));
        asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(mapa(smem_u32(&empty[b]), peer)) : "memory");
      }
    }
  }
  const long long t1 = clock64();
  if (t == 0) cycles_out[blockIdx.x] = (unsigned long long)(t1 - t0);
  if (sum == 0xFFFFFFFFu) atomicAdd(checksum, sum);
  asm volatile("barrier.cluster.arrive.release;\n barrier.cluster.wait.acquire;" ::: "memory");  // peers stay alive
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s cpasync|bulk|box BYTES_PER_ROW ROWS_PER_STAGE MS\n", argv[0]);
    return 2;
  }
  const int mode = std::strcmp(argv[1], "cpasync") == 0 ? kCpAsync
                   : std::strcmp(argv[1], "bulk") == 0  ? kBulk
                   : std::strcmp(argv[1], "dsmem") == 0 ? kDsmem
                   : std::strcmp(argv[1], "tile") == 0  ? kTile
                                                        : kBox;
  const int bpr = std::atoi(argv[2]), rps = std::atoi(argv[3]);
  const double run_ms = std::atof(argv[4]);
  if (bpr % 16 != 0 || bpr <= 0 || ((mode == kCpAsync || mode == kBox) && bpr > 128) || (mode == kDsmem && rps != 1) || (mode == kTile && (bpr != 128 || rps > 256)) || bpr * rps > kSmem / 2 || rps <= 0) {
    std::fprintf(stderr, "bad sizes (cpasync/box: <= 128 B per row; a stage <= 96 KB)\n");
    return 2;
  }
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  __nv_bfloat16* x = nullptr;
  CK(cudaMalloc(&x, size_t(kRows) * kHidden * 2));
  fill_random<<<1024, 256>>>(reinterpret_cast<uint32_t*>(x), size_t(kRows) * kHidden / 2, 12345u);
  CK(cudaGetLastError());
  unsigned long long* cyc = nullptr;
  unsigned* chk = nullptr;
  CK(cudaMalloc(&cyc, sms * sizeof(unsigned long long)));
  CK(cudaMalloc(&chk, sizeof(unsigned)));
  CUtensorMap map{};
  {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
    using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
    const cuuint64_t dims[2] = {kHidden, kRows};
    const cuuint64_t strides[1] = {cuuint64_t(kHidden) * 2};
    const cuuint32_t box[2] = {cuuint32_t(std::max(bpr / 2, 8)), mode == kTile ? cuuint32_t(rps) : 1u};
    const cuuint32_t estr[2] = {1, 1};
    const CUresult r = reinterpret_cast<Encode>(fn)(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, x, dims, strides, box,
                                                    estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                                    bpr == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
                                                    CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS && (mode == kBox || mode == kTile)) {
      std::fprintf(stderr, "cuTensorMapEncodeTiled failed: %d\n", int(r));
      return 1;
    }
  }
  CK(cudaFuncSetAttribute(gather_stream, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  CK(cudaFuncSetAttribute(dsmem_stream, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  auto launch = [&](int n) {
    if (mode == kDsmem)
      dsmem_stream<<<sms / 2 * 2, 128, kSmem>>>(bpr, n, cyc, chk);
    else
      gather_stream<<<sms, 128, kSmem>>>(x, map, mode, bpr, rps, n, cyc, chk);
  };
  const int stages = 2000;
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  launch(50);  // warm-up
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  std::vector<float> times;
  double elapsed = 0;
  while (elapsed < run_ms || times.size() < 5) {
    CK(cudaEventRecord(a));
    launch(stages);
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    times.push_back(ms);
    elapsed += ms;
  }
  CK(cudaGetLastError());
  std::vector<unsigned long long> c(sms);
  CK(cudaMemcpy(c.data(), cyc, sms * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
  std::sort(times.begin(), times.end());
  const double med = times[times.size() / 2];
  double cyc_mean = 0;
  for (auto v : c) cyc_mean += double(v) / sms;
  const double stage_bytes = double(bpr) * rps;
  const double per_stage_cyc = cyc_mean / stages;
  std::printf(
      "mode=%s bytes_per_row=%d rows_per_stage=%d stages=%d launches=%zu | median %.3f ms | %.1f ns/stage | "
      "%.0f cycles/stage | %.1f cycles/row | %.1f B/cycle/SM | %.1f GB/s all SMs | SM clock %.0f MHz\n",
      argv[1], bpr, rps, stages, times.size(), med, med * 1e6 / stages, per_stage_cyc, per_stage_cyc / rps,
      stage_bytes / per_stage_cyc, stage_bytes * stages * sms / (med * 1e-3) / 1e9, per_stage_cyc * stages / (med * 1e3));
  return 0;
}
