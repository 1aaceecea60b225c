// The HBM read rate the decode benchmarks divide weight bytes by (their weight-streaming floor):
// streaming reads of the given buffers, timed together between events, median of 10 after one
// untimed pass. One definition for epmoe_bench_experts and epmoe_bench_capturable.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <utility>
#include <vector>

#include "kernels/cuda_check.cuh"

namespace epmoe::bench {

// A streaming read of n 16-byte words (xor-folded so it cannot be dropped).
__global__ void hbm_read_kernel(const uint4* __restrict__ p, int64_t n, unsigned* __restrict__ sink) {
  unsigned acc = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

// TB/s of reading every (pointer, bytes) buffer once (16-byte aligned, bytes a multiple of 16).
inline double hbm_read_tbs(cudaStream_t s, std::initializer_list<std::pair<const void*, size_t>> buffers) {
  unsigned* sink = nullptr;
  cudaEvent_t e0, e1;
  EPMOE_CUDA_CHECK(cudaMalloc(&sink, sizeof(unsigned)));
  EPMOE_CUDA_CHECK(cudaEventCreate(&e0));
  EPMOE_CUDA_CHECK(cudaEventCreate(&e1));
  size_t bytes = 0;
  for (const auto& b : buffers) bytes += b.second;
  std::vector<float> ms;
  for (int r = 0; r < 11; ++r) {
    EPMOE_CUDA_CHECK(cudaEventRecord(e0, s));
    for (const auto& [p, n] : buffers)
      hbm_read_kernel<<<132 * 8, 512, 0, s>>>(static_cast<const uint4*>(p), int64_t(n / 16), sink);
    EPMOE_CUDA_CHECK(cudaGetLastError());
    EPMOE_CUDA_CHECK(cudaEventRecord(e1, s));
    EPMOE_CUDA_CHECK(cudaEventSynchronize(e1));
    float t = 0;
    EPMOE_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
    if (r > 0) ms.push_back(t);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(sink);
  std::sort(ms.begin(), ms.end());
  return double(bytes) / (double(ms[ms.size() / 2]) * 1e-3) / 1e12;
}

}  // namespace epmoe::bench
