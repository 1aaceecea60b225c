// The capturable forward's layout (see capturable_layout.cuh for shapes and the contract).
//
// One CTA of 1024 threads, three passes over the tokens with the counts in shared memory: count the
// pairs per expert, scan the tile-padded counts into the segment offsets (cub::BlockScan, in chunks
// of 1024 experts), place each pair with a shared atomic cursor, then pad each segment's tail. At
// decode sizes the launch is the cost; a 4096-token capacity is ~4 k-slot loops per thread.
#include <cub/block/block_scan.cuh>

#include <algorithm>

#include "epmoe/error.h"
#include "kernels/cuda_check.cuh"
#include "kernels/ep/capturable_layout.cuh"
#include "kernels/expert_problem.cuh"

namespace epmoe::kernels {

namespace {

constexpr int kThreads = 1024;
constexpr unsigned long long kNone = ~0ull;

// A token's first bad slot (an id outside [-1, E), or one repeated), or -1.
__device__ __forceinline__ int first_bad_slot(const int32_t* row, int k, int E) {
  for (int j = 0; j < k; ++j) {
    const int32_t e = __ldg(row + j);
    if (e == -1) continue;
    if (e < -1 || e >= E) return j;
    for (int i = 0; i < j; ++i)
      if (__ldg(row + i) == e) return j;
  }
  return -1;
}

__global__ void __launch_bounds__(kThreads) capturable_layout_kernel(CapturableLayoutArgs a) {
  extern __shared__ int smem[];
  const int E = a.experts, k = a.top_k;
  int* cnt = smem;          // [E] pairs per expert (pass 1), then the placing cursor (pass 2)
  int* off = smem + E;      // [E + 1] padded segment starts
  __shared__ unsigned long long s_bad;
  __shared__ int s_carry;
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;

  const int64_t T_in = *a.num_tokens;
  const bool bad_T = T_in < 0 || T_in > a.capacity;
  const int64_t T = bad_T ? a.capacity : T_in;
  for (int e = threadIdx.x; e < E; e += kThreads) cnt[e] = 0;
  if (threadIdx.x == 0) {
    s_bad = kNone;
    s_carry = 0;
  }
  __syncthreads();

  // Pass 1: count. A bad token (or every token under a bad T) is one pair of expert 0.
  for (int64_t t = threadIdx.x; t < T; t += kThreads) {
    const int32_t* row = a.topk_ids + t * k;
    const int bad = bad_T ? 0 : first_bad_slot(row, k, E);
    if (bad_T || bad >= 0) {
      if (!bad_T) atomicMin(&s_bad, static_cast<unsigned long long>(t * k + bad));
      atomicAdd(&cnt[0], 1);
      continue;
    }
    for (int j = 0; j < k; ++j) {
      const int32_t e = __ldg(row + j);
      if (e >= 0) atomicAdd(&cnt[e], 1);
    }
  }
  __syncthreads();

  // Segment offsets: an exclusive scan of round_up(count, tile), 1024 experts at a time.
  for (int base = 0; base < E; base += kThreads) {
    const int e = base + int(threadIdx.x);
    const int padded = e < E ? (cnt[e] + kExpertTile - 1) / kExpertTile * kExpertTile : 0;
    int excl = 0, total = 0;
    Scan(scan_tmp).ExclusiveSum(padded, excl, total);
    if (e < E) off[e] = s_carry + excl;
    __syncthreads();
    if (threadIdx.x == 0) s_carry += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) off[E] = s_carry;
  for (int e = threadIdx.x; e <= E; e += kThreads) a.padded_offsets[e] = e < E ? off[e] : s_carry;
  for (int e = threadIdx.x; e < E; e += kThreads) cnt[e] = 0;
  __syncthreads();

  // Pass 2: place each pair at its segment's cursor.
  const float nan = __int_as_float(0x7fc00000);
  for (int64_t t = threadIdx.x; t < T; t += kThreads) {
    const int32_t* row = a.topk_ids + t * k;
    const int bad = bad_T ? 0 : first_bad_slot(row, k, E);
    if (bad_T || bad >= 0) {
      const int p = off[0] + atomicAdd(&cnt[0], 1);
      a.pair_row[p] = int32_t(t);
      a.pair_weight[p] = nan;
      continue;
    }
    for (int j = 0; j < k; ++j) {
      const int32_t e = __ldg(row + j);
      if (e < 0) continue;
      const int p = off[e] + atomicAdd(&cnt[e], 1);
      a.pair_row[p] = int32_t(t);
      a.pair_weight[p] = __ldg(a.topk_weights + t * k + j);
    }
  }
  __syncthreads();

  // Each segment's tail: padding rows. One warp per expert.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int e = warp; e < E; e += kThreads / 32)
    for (int p = off[e] + cnt[e] + lane; p < off[e + 1]; p += 32) {
      a.pair_row[p] = -1;
      a.pair_weight[p] = 0.f;
    }

  // The first failure, unless one is already recorded (sticky until the host clears it).
  if (threadIdx.x == 0 && a.error[0] == 0 && (bad_T || s_bad != kNone)) {
    if (bad_T) {
      a.error[0] = int64_t(ErrorCode::invalid_argument);
      a.error[1] = T_in;
      a.error[2] = a.capacity;
      a.error[3] = 0;
    } else {
      const int64_t t = int64_t(s_bad / k), j = int64_t(s_bad % k);
      const int32_t v = a.topk_ids[t * k + j];
      a.error[0] = int64_t(v < -1 || v >= E ? ErrorCode::expert_id_out_of_range : ErrorCode::duplicate_expert_id);
      a.error[1] = t;
      a.error[2] = j;
      a.error[3] = v;
    }
  }
}

}  // namespace

int64_t capturable_rows_capacity(int64_t capacity, int top_k, int experts) {
  const int64_t tile = kExpertTile;
  const int64_t by_pairs = capacity * std::min(top_k, experts) + int64_t(experts) * (tile - 1);
  const int64_t by_experts = int64_t(experts) * ((capacity + tile - 1) / tile * tile);
  return std::max<int64_t>(tile, (std::min(by_pairs, by_experts) + tile - 1) / tile * tile);
}

void capturable_layout_launch(const CapturableLayoutArgs& a, cudaStream_t stream) {
  EPMOE_CHECK(a.experts >= 1 && a.experts <= kCapturableMaxExperts && a.top_k >= 1, ErrorCode::internal,
              "capturable_layout: E=", a.experts, " k=", a.top_k);
  EPMOE_CHECK(a.capacity >= 0 && a.capacity * a.top_k < int64_t(INT32_MAX) && a.rows_capacity < int64_t(INT32_MAX) &&
                  a.rows_capacity >= capturable_rows_capacity(a.capacity, a.top_k, a.experts),
              ErrorCode::internal, "capturable_layout: capacity ", a.capacity, " rows_capacity ", a.rows_capacity);
  const size_t smem = (2 * size_t(a.experts) + 1) * sizeof(int);
  capturable_layout_kernel<<<1, kThreads, smem, stream>>>(a);
  EPMOE_CUDA_CHECK_LAUNCH("capturable_layout_kernel");
}

}  // namespace epmoe::kernels
