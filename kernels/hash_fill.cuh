// Deterministic bf16 data for the benchmarks and the GPU tests, identical on host and device: a
// host check can recompute any element a kernel wrote (the sm90 suite and epmoe_bench_experts
// both rely on that). Header-only: each program gets its own copy of the fill kernel.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

namespace epmoe::kernels::hash_fill {

__host__ __device__ inline uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
// bf16 bits of scale * U(-1, 1) at (seed, idx); float ops are exact except the one multiply (RN on
// both sides) and the RNE conversion written out bitwise.
__host__ __device__ inline uint16_t hash_bf16(uint64_t seed, uint64_t idx, float scale) {
  const uint64_t h = mix64(seed * 0x632be59bd9b4e019ull ^ mix64(idx));
  const float u = float(uint32_t(h >> 40)) * (1.0f / 16777216.0f);  // [0, 1), exact
  const float v = (u * 2.0f - 1.0f) * scale;
  uint32_t b;
  memcpy(&b, &v, 4);
  b += 0x7fffu + ((b >> 16) & 1u);
  return uint16_t(b >> 16);
}

namespace {
// p[i] = hash_bf16(seed, i, scale), grid-stride.
__global__ void fill_hash_kernel(uint16_t* p, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = hash_bf16(seed, uint64_t(i), scale);
}
}  // namespace

}  // namespace epmoe::kernels::hash_fill
