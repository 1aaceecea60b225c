// The destination's way back from expert-sorted pairs to received rows (the backward's combine side).
//
//   row_pair_map: row_pair[r, j] = the expert-sorted row i of (received row r, its j-th local slot),
//     -1 where row r has fewer than j + 1 local experts. A row's local slots are its metadata's local
//     ids in order (recv_meta [R, 1 + 2k]: source token, local ids compacted, -1 after, weight bits);
//     pair i belongs to the expert whose segment [padded_offsets[e], padded_offsets[e + 1]) holds it.
//     The slot order is the order the source reads the row's ds back in (protocol::scatter_weight_grads).
//   row_pair_map_ids: the same at world 1, where a token's row is its received row and its slots are
//     its topk_ids row [rows, k] as given (not compacted): row_pair[t, j] is the pair of slot j, so
//     reduce_row_pairs' ds_rows are d_topk_weights directly.
//   reduce_row_pairs: dx_rows[r] = bf16( sum over j ascending of float(dxp[row_pair[r, j]]) ) and
//     ds_rows[r, j] = ds_pair[row_pair[r, j]] (0 where row_pair is -1): one dx row and k ds per row,
//     in a fixed order (no atomics: the same bits every run). ds_rows null: no ds (the deterministic
//     forward sums its pairs' expert outputs with it).
// Pointers are device pointers; hidden % 8 == 0 and 16-byte aligned rows.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace epmoe::kernels {

void row_pair_map_launch(const int64_t* padded_offsets, int experts, const int32_t* pair_row, int64_t pairs,
                         const int32_t* recv_meta, int64_t recv_rows, int top_k, int32_t* row_pair,
                         cudaStream_t stream);

void row_pair_map_ids_launch(const int64_t* padded_offsets, int experts, const int32_t* pair_row, int64_t pairs,
                             const int32_t* topk_ids, int64_t rows, int top_k, int32_t* row_pair, cudaStream_t stream);

void reduce_row_pairs_launch(const __nv_bfloat16* dxp, const float* ds_pair, const int32_t* row_pair,
                             int64_t recv_rows, int top_k, int hidden, __nv_bfloat16* dx_rows, float* ds_rows,
                             cudaStream_t stream);

}  // namespace epmoe::kernels
