// The backward's data-gradient GEMMs on the sm_90a core: expert-grouped GEMMs over expert-sorted
// rows whose per-expert counts stay on the device (graph-capturable: the cuBLAS grouped GEMMs of the
// regular backward need them on the host).
//
//   c[i, :] = a[i, :] b_e    for the rows i of expert e: [padded_offsets[e], padded_offsets[e + 1])
//   a[rows, k] bf16 row-major (expert-sorted, tile-padded), b[E, k, n] bf16 row-major, c[rows, n] bf16
//   da = dy W2_e:  a = dy rows [rows, hidden], b = W2 [E, hidden, ffn]   -> [rows, ffn]
//   dx = dh W1_e:  a = dh [rows, 2 ffn],       b = W1 [E, 2 ffn, hidden] -> [rows, hidden]
// A is K-major and B MN-major for the MMAs (Tile128Of<0, 1>). Rows at or past padded_offsets[E] are
// not touched (the total is read on the device); padding rows inside a segment give whatever a holds
// there times b (zero rows in, zero rows out).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace epmoe::kernels {

struct DgradProblem {
  const __nv_bfloat16* a = nullptr;
  const __nv_bfloat16* b = nullptr;
  const int64_t* padded_offsets = nullptr;  // device [experts + 1], multiples of 128
  int64_t rows = 0;                         // rows allocated in a and c (>= padded_offsets[experts]), % 128
  int experts = 0, k = 0, n = 0;
  __nv_bfloat16* c = nullptr;
};

// Whether the kernel takes this (k, n): k % 64 == 0 and n % 256 == 0 (the tile), on an sm_90a
// device of this build.
bool sm90_dgrad_supported(int k, int n);
// Queues the GEMM on `stream` (capturable: nothing read on the host).
void sm90_dgrad_launch(const DgradProblem& p, cudaStream_t stream);

}  // namespace epmoe::kernels
