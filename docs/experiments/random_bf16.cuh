// The measurement tools' shared pseudo-random source (gather_request_cost.cu, tile_rows_energy.cu):
// a 3-input integer hash (row picks, per-stage choices) and a fill of fresh bf16 in [-1, 1) — random
// data, because the energy of moving and multiplying bytes depends on how their bits toggle.
#pragma once
#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>

namespace epmoe::experiments {
__device__ __forceinline__ uint32_t hash3(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t h = a * 0x9E3779B1u ^ (b + 0x7F4A7C15u) * 0x85EBCA77u ^ (c + 0x165667B1u) * 0xC2B2AE3Du;
  h ^= h >> 15;
  h *= 0x2C1B3C6Du;
  h ^= h >> 12;
  return h;
}
__global__ void fill_random(uint32_t* p, size_t words, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < words; i += size_t(gridDim.x) * blockDim.x) {
    const uint32_t h = hash3(uint32_t(i), uint32_t(i >> 32), seed);
    const __nv_bfloat16 lo = __float2bfloat16(float(h & 0xffff) / 32768.f - 1.f);
    const __nv_bfloat16 hi = __float2bfloat16(float(h >> 16) / 32768.f - 1.f);
    p[i] = uint32_t(__bfloat16_as_ushort(lo)) | uint32_t(__bfloat16_as_ushort(hi)) << 16;
  }
}
}  // namespace epmoe::experiments
