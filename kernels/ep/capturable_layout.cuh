// The capturable forward's expert layout at world 1 (MoeLayer::forward_capturable): one launch, no
// host counts. From the first T = *num_tokens rows of topk_ids / topk_weights (T on the device, so
// one captured graph replays at any T from 0 to the capacity), the expert-sorted pairs the sm_90
// kernels read, each expert's segment padded to kExpertTile:
//
//   topk_ids i32[capacity, k], topk_weights f32[capacity, k], num_tokens i64 (device)
//     -> padded_offsets i64[E + 1]
//        pair_row i32[rows_capacity]     the pair's token (its row in x and in y); -1 for padding
//        pair_weight f32[rows_capacity]  its routing weight; 0 for padding
//        error i64[4]                    sticky: code, a, b, c of the first failure (0: none)
//
// At world 1 a token's row in x is its own row, so no dispatch is needed: UP gathers x[pair_row],
// DOWN reduces into y[pair_row]. Within an expert the pairs are in no fixed order (shared-memory
// atomics): a row's GEMM does not depend on its place in the tile, and the reduction over a token's
// experts is order-free within bf16 rounding on the sm_90 path anyway.
//
// Bad input cannot throw from a graph, and must not pass silently: a token with an id outside
// [-1, E) or a repeated id becomes ONE pair (t, expert 0, weight NaN), so its output row is NaN;
// T < 0 or T > capacity makes every one of the capacity rows such a pair. The first failure (lowest
// t * k + slot; or the bad T) is recorded in `error` unless an earlier one is there; the host reads
// and clears it with MoeLayer::check_capturable (a sync).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace epmoe::kernels {

struct CapturableLayoutArgs {
  const int32_t* topk_ids = nullptr;      // device [capacity, k]
  const float* topk_weights = nullptr;    // device [capacity, k]
  const int64_t* num_tokens = nullptr;    // device, read when the kernel runs
  int64_t capacity = 0;
  int top_k = 0;
  int experts = 0;
  int64_t* padded_offsets = nullptr;      // device [experts + 1]
  int32_t* pair_row = nullptr;            // device [rows_capacity]
  float* pair_weight = nullptr;           // device [rows_capacity]
  int64_t rows_capacity = 0;              // capturable_rows_capacity(capacity, top_k, experts)
  int64_t* error = nullptr;               // device [4], sticky
  // Received mode (the slots transport, capacity_slots.cuh), when recv_meta is set: the pairs come
  // from the received metadata of world slots of `capacity` rows each instead of from topk_ids /
  // topk_weights / num_tokens; slot p's real rows are its header's kHdrRows word (recv_headers
  // [world, header_words]). pair_row is then the received row (p * capacity + j). A local id outside
  // [-1, E) there is corruption: skipped and recorded as Error(internal).
  const int32_t* recv_meta = nullptr;     // device [world * capacity, 1 + 2k]
  const int64_t* recv_headers = nullptr;  // device [world, header_words]
  int header_words = 0;
  int world = 1;
};

// Experts the one-CTA layout holds in shared memory (its counts and offsets).
inline constexpr int kCapturableMaxExperts = 4096;

// Padded expert rows the layout can fill for `capacity` tokens (received mode: world * capacity): sum over experts of
// round_up(count, tile) <= min(capacity * min(k, E) + E * (tile - 1), E * round_up(capacity, tile)),
// rounded to the tile (the poisoned-input cases stay within it: at most one pair per token).
int64_t capturable_rows_capacity(int64_t capacity, int top_k, int experts);

// Queues the layout on `stream` (capturable: one kernel, nothing read on the host).
void capturable_layout_launch(const CapturableLayoutArgs& a, cudaStream_t stream);

}  // namespace epmoe::kernels
