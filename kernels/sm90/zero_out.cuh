// The UP kernels' in-kernel zeroing of out (ExpertProblem::zero_out), shared by the 128-row UP
// (up_kernel.cu), the pair UP (up_pair_kernel.cu) and the swap-AB and FP8 UPs, and the persistent
// swap-AB / FP8 tile kernels' start (a CTA without items only zeroes).
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/sm90/core/ring.cuh"
#include "kernels/sm90/work_items.cuh"

namespace epmoe::kernels::sm90 {
#if EPMOE_SM90A_DEVICE
// In-kernel zeroing of out (ExpertProblem::zero_out): CTA b owns 16-byte chunks [b*per, (b+1)*per) of
// the out_rows x hidden output, per = ceil(chunks / gridDim); each of its work items zeroes the next
// share of them with the producer threads' 16-byte stores (a few per thread and item, between TMA /
// cp.async issues), and what is left - all of it for a CTA without items - before the CTA leaves.
// DOWN reduces into out only after griddepcontrol.wait, i.e. after this whole grid has completed.
struct ZeroPlan {
  uint4* base = nullptr;   // null: nothing to zero
  int64_t next = 0, end = 0;
  int64_t per_item = 0;
};
template <bool kCluster>
__device__ __forceinline__ ZeroPlan make_zero_plan(__nv_bfloat16* out, int64_t chunks, int64_t items) {
  ZeroPlan z;
  if (out == nullptr || chunks <= 0) return z;
  z.base = reinterpret_cast<uint4*>(out);
  const int64_t per = (chunks + gridDim.x - 1) / gridDim.x;
  z.next = min(int64_t(blockIdx.x) * per, chunks);
  z.end = min(z.next + per, chunks);
  const int64_t first = work_first<kCluster>(), stride = work_stride<kCluster>();
  const int64_t mine = first < items ? (items - first + stride - 1) / stride : 0;
  z.per_item = mine > 0 ? (z.end - z.next + mine - 1) / mine : 0;
  return z;
}
// Zeroes up to n more chunks of the plan with threads t = 0..nthreads-1 (all must call).
__device__ __forceinline__ void zero_step(ZeroPlan& z, int64_t n, int t, int nthreads) {
  if (z.base == nullptr) return;
  const int64_t stop = n < z.end - z.next ? z.next + n : z.end;
  for (int64_t i = z.next + t; i < stop; i += nthreads) z.base[i] = make_uint4(0u, 0u, 0u, 0u);
  z.next = stop;
}

// A persistent kernel's start, all `threads` threads: a CTA without items zeroes its share of out and
// returns false; otherwise thread 0 makes the ring's barriers (producer / consumer arrivals per
// phase) and UP lets its PDL dependent (DOWN) start its prologue.
template <bool kUp, int S>
__device__ __forceinline__ bool start_persistent_kernel(const Ring<S>& ring, ZeroPlan& zero, int64_t items, int threads,
                                                        int producers, int consumers) {
  if (int64_t(blockIdx.x) >= items) {
    zero_step(zero, zero.end - zero.next, int(threadIdx.x), threads);
    return false;
  }
  if (threadIdx.x == 0) {
    ring.init(producers, consumers);
    mbar_fence_init();
  }
  __syncthreads();
  if constexpr (kUp) grid_launch_dependents();
  return true;
}
#endif
}  // namespace epmoe::kernels::sm90
