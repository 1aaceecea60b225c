// The backward's weight gradients on the sm_90a core: expert-grouped GEMMs whose K is each expert's
// rows, read on the device (no host sync on the per-expert counts; graph-capturable).
//
//   c[e] (+)= a_e^T b_e      a[rows, m], b[rows, n] bf16, expert-sorted rows: expert e's are
//                            [padded_offsets[e], padded_offsets[e + 1]) (padding rows must be zero)
//   c[E, m, n] fp32 or bf16 (row-major; bf16 rounds once, after the sum); accumulate: adds to c.
//   dW2 = dy^T (s a): a = dy rows [rows, hidden], b = s a [rows, ffn]  -> [E, hidden, ffn]
//   dW1 = dh^T x:     a = dh [rows, 2 ffn],      b = x rows [rows, hidden] -> [E, 2 ffn, hidden]
// Both operands are MN-major for the MMAs (Tile128Of<1, 1>): TMA boxes of 64 columns x 64 rows. An
// expert without rows gets c = 0 (or keeps c, accumulating).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace epmoe::kernels {

struct WgradProblem {
  const __nv_bfloat16* a = nullptr;
  const __nv_bfloat16* b = nullptr;
  const int64_t* padded_offsets = nullptr;  // device [experts + 1]
  int64_t rows = 0;                         // rows allocated in a and b (>= padded_offsets[experts])
  int experts = 0, m = 0, n = 0;
  void* c = nullptr;
  bool c_f32 = false;
  bool accumulate = false;
};

// Whether the kernel takes this (m, n): m % 128 == 0 and n % 256 == 0 (the tile), on an sm_90a
// device of this build.
bool sm90_wgrad_supported(int m, int n);
void sm90_wgrad_launch(const WgradProblem& p, cudaStream_t stream);

}  // namespace epmoe::kernels
