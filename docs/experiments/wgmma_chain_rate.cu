// Microbenchmark: the tensor rate one SM reaches with 1 or 2 consumer warpgroups, each running one
// accumulator chain (m64n256k16, the UP/DOWN kernels' form) or two independent chains (two m64n128k16
// on the two column halves of the same 256-column B tile, same registers). Why: at 7168/T=2k a DOWN item
// whose upper 64 rows are all padding, run by one warpgroup, took as long as a whole item (session 24,
// S24-1: the DOWN kernel 0.7298 -> 0.7284 ms under ncu with 6.5% of its MMA skipped), so a lone
// warpgroup seems to reach only about half of the SM's tensor rate. This measures that directly.
//
// Every SM runs one CTA of W warpgroups over operands in shared memory (random bf16, 128B-swizzled
// K-major tiles: A 64 x 64 per warpgroup, B 256 x 64 shared), issuing the kernels' k-step pattern:
// fence, 4 k16 wgmmas (per chain), commit, wait<1>. No loads: only the tensor pipe and the smem reads it
// makes. Printed: cycles per k step (every warpgroup one 64 x 256 x 64 step), MACs per cycle per SM
// against the dense bf16 peak of 2048 (989 TFLOP/s / 132 SMs / 1.83 GHz), from clock64 over STEPS k
// steps, and the TFLOP/s from events.
// Not built by CMake: a measurement tool.
//
// From the repository root:
//   nvcc -std=c++20 -O3 -I. -Isrc -gencode=arch=compute_90a,code=sm_90a docs/experiments/wgmma_chain_rate.cu \
//        src/error.cpp -o wcr
//   ./wcr [STEPS]   (prints every configuration)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/cuda_check.cuh"
#include "kernels/sm90_common.cuh"
#include "kernels/sm90_wgmma_n.cuh"

using namespace epmoe::kernels::sm90;

namespace {
constexpr uint32_t kATile = 64 * 64 * 2;    // 8 KB per warpgroup
constexpr uint32_t kBTile = 256 * 64 * 2;   // 32 KB
constexpr uint32_t kSmem = 1024 + 2 * kATile + kBTile;

__device__ __forceinline__ void fence64(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// chains = 1: acc[128] by m64n256k16; chains = 2: two acc[64] by m64n128k16 on B rows 0..127 / 128..255.
template <int kChains>
__global__ void __launch_bounds__(256, 1) chain_rate_kernel(int steps, long long* cycles, float* sink) {
#if EPMOE_SM90A_DEVICE
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  uint8_t* gbase = smem_raw + (base - smem_u32(smem_raw));
  // Random bf16 in [-1, 1): the MMA's energy depends on the data, its cycle count should not.
  for (uint32_t i = threadIdx.x; i < (2 * kATile + kBTile) / 4; i += blockDim.x) {
    uint32_t h = (i + 1) * 2654435761u ^ (blockIdx.x * 40503u);
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    const float lo = float(int(h & 0xffffu) - 32768) / 32768.0f, hi = float(int(h >> 16) - 32768) / 32768.0f;
    reinterpret_cast<uint32_t*>(gbase)[i] = pack_bf16x2(lo, hi);
  }
  fence_proxy_async_shared();
  __syncthreads();
  const int wg = int(threadIdx.x) / 128;
  const uint32_t da = smem_desc_sw128_lo(base + uint32_t(wg) * kATile);
  const uint32_t db = smem_desc_sw128_lo(base + 2 * kATile);
  constexpr uint32_t kBHalf = (128u * 128u) >> 4;  // 128 rows of 128 B, in descriptor units
  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
  long long t0 = 0;
  for (int it = -8; it < steps; ++it) {
    if (it == 0) t0 = clock64();
    if constexpr (kChains == 1) {
      fence_regs(acc);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma_m64n256k16_bf16(acc, smem_desc_sw128_join(da + 2 * kk), smem_desc_sw128_join(db + 2 * kk), 1);
      wgmma_commit();
      wgmma_wait<1>();
      fence_regs(acc);
    } else {
      float(&lo)[64] = *reinterpret_cast<float(*)[64]>(&acc[0]);
      float(&hi)[64] = *reinterpret_cast<float(*)[64]>(&acc[64]);
      fence64(lo);
      fence64(hi);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        WgmmaN<128>::run(lo, smem_desc_sw128_join(da + 2 * kk), smem_desc_sw128_join(db + 2 * kk));
        WgmmaN<128>::run(hi, smem_desc_sw128_join(da + 2 * kk), smem_desc_sw128_join(db + kBHalf + 2 * kk));
      }
      wgmma_commit();
      wgmma_wait<1>();
      fence64(lo);
      fence64(hi);
    }
  }
  wgmma_wait<0>();
  fence_regs(acc);
  const long long t1 = clock64();
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < 128; ++i) s += acc[i];
  if (threadIdx.x % 128 == 0) cycles[blockIdx.x * 2 + wg] = t1 - t0;
  sink[blockIdx.x * blockDim.x + threadIdx.x] = s;
#else
  (void)steps, (void)cycles, (void)sink;
#endif
}

template <int kChains>
void run(int warpgroups, int steps, int sms) {
  auto kernel = chain_rate_kernel<kChains>;
  EPMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem)));
  long long* d_cycles = nullptr;
  float* d_sink = nullptr;
  EPMOE_CUDA_CHECK(cudaMalloc(&d_cycles, sizeof(long long) * 2 * size_t(sms)));
  EPMOE_CUDA_CHECK(cudaMalloc(&d_sink, sizeof(float) * 256 * size_t(sms)));
  EPMOE_CUDA_CHECK(cudaMemset(d_cycles, 0, sizeof(long long) * 2 * size_t(sms)));
  cudaEvent_t e0, e1;
  EPMOE_CUDA_CHECK(cudaEventCreate(&e0));
  EPMOE_CUDA_CHECK(cudaEventCreate(&e1));
  kernel<<<sms, 128 * warpgroups, kSmem>>>(steps, d_cycles, d_sink);  // warm-up
  EPMOE_CUDA_CHECK(cudaGetLastError());
  EPMOE_CUDA_CHECK(cudaEventRecord(e0));
  kernel<<<sms, 128 * warpgroups, kSmem>>>(steps, d_cycles, d_sink);
  EPMOE_CUDA_CHECK(cudaGetLastError());
  EPMOE_CUDA_CHECK(cudaEventRecord(e1));
  EPMOE_CUDA_CHECK(cudaEventSynchronize(e1));
  float ms = 0.0f;
  EPMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
  std::vector<long long> cyc(2 * size_t(sms));
  EPMOE_CUDA_CHECK(cudaMemcpy(cyc.data(), d_cycles, cyc.size() * sizeof(long long), cudaMemcpyDeviceToHost));
  std::vector<long long> v;
  for (int b = 0; b < sms; ++b)
    for (int w = 0; w < warpgroups; ++w) v.push_back(cyc[2 * size_t(b) + size_t(w)]);
  std::sort(v.begin(), v.end());
  const double med = double(v[v.size() / 2]);
  const double per_step = med / steps;                          // one k step of every warpgroup
  const double macs_per_cycle = 64.0 * 256 * 64 * warpgroups / per_step;
  const double tflops = 2.0 * 64 * 256 * 64 * warpgroups * double(steps) * sms / (ms * 1e-3) / 1e12;
  std::printf("warpgroups %d  chains %d (%s)  cycles/k-step %7.1f  MAC/cycle/SM %6.0f  (%5.1f%% of 2048)  %.0f TFLOP/s  %.3f ms\n",
              warpgroups, kChains, kChains == 1 ? "m64n256k16" : "2 x m64n128k16", per_step, macs_per_cycle,
              100.0 * macs_per_cycle / 2048.0, tflops, double(ms));
  EPMOE_CUDA_CHECK(cudaFree(d_cycles));
  EPMOE_CUDA_CHECK(cudaFree(d_sink));
  EPMOE_CUDA_CHECK(cudaEventDestroy(e0));
  EPMOE_CUDA_CHECK(cudaEventDestroy(e1));
}
}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 20000;
  int sms = 0;
  EPMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  for (int rep = 0; rep < 2; ++rep) {
    run<1>(1, steps, sms);
    run<2>(1, steps, sms);
    run<1>(2, steps, sms);
    run<2>(2, steps, sms);
  }
  return 0;
}
