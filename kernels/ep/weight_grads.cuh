// Source side of the backward: the routing-weight gradients from the ds the destinations returned.
//   ids[T, k] i32 (the forward's topk_ids), token_row[T, world] i32 (the forward's dispatch layout:
//   token t's row in the send order for rank r, -1 if none), returned[rows, k] f32 (one ds per
//   (row, local slot), slots in the row's local-id order) -> dw[T, k] f32:
//     dw[t, j] = returned[token_row[t, r] * k + n] for e = ids[t, j] >= 0, r = e / experts_per_rank,
//                n = the slots j' < j of token t that went to rank r; 0 for a dropped slot (-1).
// Bit-exact with protocol::scatter_weight_grads. device_num_tokens (optional, device): tokens at or
// past it get 0 (the capturable backward, whose ids past the count are not routing); an id past the
// experts (a corrupt forward, flagged there) gives NaN instead of a read out of bounds.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace epmoe::kernels {

void scatter_weight_grads_launch(const int32_t* ids, const int32_t* token_row, const float* returned,
                                 int64_t num_tokens, int top_k, int world, int experts_per_rank, float* dw,
                                 cudaStream_t stream, const int64_t* device_num_tokens = nullptr);

}  // namespace epmoe::kernels
