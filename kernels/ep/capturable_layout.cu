// The capturable forward's layout (see capturable_layout.cuh for shapes and the contract).
//
// One CTA of 1024 threads, three passes over the tokens with the counts in shared memory: count the
// pairs per expert, scan the tile-padded counts into the segment offsets (cub::BlockScan, in chunks
// of 1024 experts), place each pair with a shared atomic cursor, then pad each segment's tail. At
// decode sizes the launch is the cost; a 4096-token capacity is ~4 k-slot loops per thread.
#include <cub/block/block_scan.cuh>

#include <algorithm>

#include "ep_protocol.h"
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

// Calls f(row, expert, weight) for every pair of the layout's input, each row's pairs from one thread
// (rows strided over the CTA). Source mode: the first T rows of topk_ids; a bad row (or every row
// under a bad count) is one pair (t, 0, NaN) and lowers *bad_slot. Received mode: the real rows of
// each slot, from their metadata.
template <class F>
__device__ __forceinline__ void for_each_pair(const CapturableLayoutArgs& a, int64_t T, bool bad_T,
                                             unsigned long long* bad_slot, int* corrupt, F&& f) {
  const int E = a.experts, k = a.top_k;
  const float nan = __int_as_float(0x7fc00000);
  if (a.recv_meta != nullptr) {
    const int mw = 1 + 2 * k;
    const int64_t rows = int64_t(a.world) * a.capacity;
    for (int64_t i = threadIdx.x; i < rows; i += kThreads) {
      const int64_t p = i / a.capacity, j = i - p * a.capacity;
      if (j >= a.recv_headers[p * a.header_words + protocol::kHdrRows]) continue;
      const int32_t* m = a.recv_meta + i * mw;
      for (int s = 0; s < k; ++s) {
        const int32_t l = m[1 + s];
        if (l == -1) break;  // compacted: -1 ends the row's list
        if (l < -1 || l >= E) {
          atomicExch(corrupt, 1);
          continue;
        }
        f(i, l, __int_as_float(m[1 + k + s]));
      }
    }
    return;
  }
  for (int64_t t = threadIdx.x; t < T; t += kThreads) {
    const int32_t* row = a.topk_ids + t * k;
    const int bad = bad_T ? 0 : first_bad_slot(row, k, E);
    if (bad_T || bad >= 0) {
      if (!bad_T) atomicMin(bad_slot, static_cast<unsigned long long>(t * k + bad));
      f(t, 0, nan);
      continue;
    }
    for (int j = 0; j < k; ++j) {
      const int32_t e = __ldg(row + j);
      if (e >= 0) f(t, e, __ldg(a.topk_weights + t * k + j));
    }
  }
}

__global__ void __launch_bounds__(kThreads) capturable_layout_kernel(CapturableLayoutArgs a) {
  extern __shared__ int smem[];
  const int E = a.experts, k = a.top_k;
  int* cnt = smem;          // [E] pairs per expert (pass 1), then the placing cursor (pass 2)
  int* off = smem + E;      // [E + 1] padded segment starts
  __shared__ unsigned long long s_bad;
  __shared__ int s_carry, s_corrupt;
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;

  const bool received = a.recv_meta != nullptr;
  const int64_t T_in = received ? 0 : *a.num_tokens;
  const bool bad_T = !received && (T_in < 0 || T_in > a.capacity);
  const int64_t T = bad_T ? a.capacity : T_in;
  for (int e = threadIdx.x; e < E; e += kThreads) cnt[e] = 0;
  if (threadIdx.x == 0) {
    s_bad = kNone;
    s_carry = 0;
    s_corrupt = 0;
  }
  __syncthreads();

  // Pass 1: count.
  for_each_pair(a, T, bad_T, &s_bad, &s_corrupt, [&](int64_t, int e, float) { atomicAdd(&cnt[e], 1); });
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

  // Pass 2: place each pair at its segment's cursor (the same pairs as pass 1: the inputs are
  // unchanged in between; the failure flags it lowers again keep their values).
  for_each_pair(a, T, bad_T, &s_bad, &s_corrupt, [&](int64_t row, int e, float w) {
    const int p = off[e] + atomicAdd(&cnt[e], 1);
    a.pair_row[p] = int32_t(row);
    a.pair_weight[p] = w;
  });
  __syncthreads();

  // Each segment's tail: padding rows. One warp per expert.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int e = warp; e < E; e += kThreads / 32)
    for (int p = off[e] + cnt[e] + lane; p < off[e + 1]; p += 32) {
      a.pair_row[p] = -1;
      a.pair_weight[p] = 0.f;
    }

  // The first failure, unless one is already recorded (sticky until the host clears it).
  if (threadIdx.x == 0 && a.error[0] == 0 && (bad_T || s_bad != kNone || s_corrupt)) {
    if (s_corrupt) {
      a.error[0] = int64_t(ErrorCode::internal);
      a.error[1] = a.error[2] = a.error[3] = 0;
    } else if (bad_T) {
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
  const int64_t rows = a.recv_meta != nullptr ? int64_t(a.world) * a.capacity : a.capacity;
  EPMOE_CHECK(a.recv_meta == nullptr || (a.recv_headers != nullptr && a.header_words > 0 && a.world >= 1),
              ErrorCode::internal, "capturable_layout: received mode without headers");
  EPMOE_CHECK(a.capacity >= 0 && rows * a.top_k < int64_t(INT32_MAX) && a.rows_capacity < int64_t(INT32_MAX) &&
                  a.rows_capacity >= capturable_rows_capacity(rows, a.top_k, a.experts),
              ErrorCode::internal, "capturable_layout: capacity ", a.capacity, " rows_capacity ", a.rows_capacity);
  const size_t smem = (2 * size_t(a.experts) + 1) * sizeof(int);
  capturable_layout_kernel<<<1, kThreads, smem, stream>>>(a);
  EPMOE_CUDA_CHECK_LAUNCH("capturable_layout_kernel");
}

}  // namespace epmoe::kernels
