// Shared by the mainloop measurement tools (tile_rows_energy.cu, tall_tile_energy.cu): steady-state
// launch timing at the power cap and the consumers' cycle counts, and the accumulator fence.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "kernels/cuda_check.cuh"

namespace epmoe::experiments {
// Keeps the compiler from moving accumulator reads/writes across wgmma issue/wait points.
template <int N>
__device__ __forceinline__ void fence_acc(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Launches until run_ms have passed and returns the times of the launches after the first second
// (the power-capped steady state), sorted; empty (with a message) if the run was too short.
template <class Launch>
std::vector<float> time_steady(double run_ms, Launch launch) {
  cudaEvent_t e0, e1;
  EPMOE_CUDA_CHECK(cudaEventCreate(&e0));
  EPMOE_CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<float> late;
  double elapsed = 0;
  while (elapsed < run_ms) {
    EPMOE_CUDA_CHECK(cudaEventRecord(e0));
    launch();
    EPMOE_CUDA_CHECK(cudaGetLastError());
    EPMOE_CUDA_CHECK(cudaEventRecord(e1));
    EPMOE_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    EPMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (elapsed > 1000.0) late.push_back(ms);
    elapsed += ms;
  }
  EPMOE_CUDA_CHECK(cudaEventDestroy(e0));
  EPMOE_CUDA_CHECK(cudaEventDestroy(e1));
  if (late.empty()) std::fprintf(stderr, "tre: run for more than 1000 ms to reach the steady state\n");
  std::sort(late.begin(), late.end());
  return late;
}
// Every consumer warpgroup's mainloop cycles (slot 3 i + w of `cyc`), sorted.
inline std::vector<long long> consumer_cycles(const long long* cyc, int ctas, int wgs) {
  std::vector<long long> c(3 * size_t(ctas)), v;
  EPMOE_CUDA_CHECK(cudaMemcpy(c.data(), cyc, c.size() * sizeof(long long), cudaMemcpyDeviceToHost));
  for (int i = 0; i < ctas; ++i)
    for (int w = 0; w < wgs; ++w) v.push_back(c[3 * size_t(i) + size_t(w)]);
  std::sort(v.begin(), v.end());
  return v;
}
}  // namespace epmoe::experiments
