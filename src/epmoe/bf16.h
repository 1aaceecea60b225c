// bf16 on the host without CUDA headers: storage type + round-to-nearest-even conversion.
// Layout-compatible with __nv_bfloat16 (2 bytes, same bit pattern), so buffers pass between
// the CPU path and device kernels without conversion.
#pragma once
#include <cstdint>
#include <cstring>

namespace epmoe {

struct bf16 {
  uint16_t bits = 0;
  bf16() = default;
  explicit bf16(float f) : bits(from_float(f)) {}
  explicit operator float() const { return to_float(bits); }
  float f() const { return to_float(bits); }

  static uint16_t from_float(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return uint16_t(u >> 16);
  }
  static float to_float(uint16_t b) {
    uint32_t u = uint32_t(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
static_assert(sizeof(bf16) == 2);

inline float round_bf16(float f) { return bf16::to_float(bf16::from_float(f)); }

}  // namespace epmoe
