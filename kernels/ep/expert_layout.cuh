// Destination-side layout on the device: the received rows' (row, local expert) pairs grouped by
// expert, in the protocol's order, each segment padded to the tile. Bit-exact with
// protocol::expert_layout (src/ep_protocol.h), checked by tests/gpu/test_layout_gpu.
//
//   recv_meta i32[recv_rows, 1 + 2k]   (source token, local ids compacted in slot order, -1 after,
//                                       weight bits in the same order)
//   padded_offsets i64[E_local + 1], expert_counts i64[E_local]   computed on the HOST from the
//                                       count headers (decode_count_headers), uploaded by the caller
//     -> pair_row i32[padded_total]     recv row of each pair, per expert in recv row order; -1 pad
//        pair_weight f32[padded_total]  routing weight; 0 for padding
//
// The kernels recount the pairs per expert from the metadata and compare with expert_counts: on a
// mismatch (or a local id outside [0, E_local)) they set *error_flag = 1 and never write outside an
// expert's segment. The flag is sticky; the engine folds it into the next count exchange so every
// rank fails with Error(internal) instead of computing on a corrupt layout.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace epmoe::kernels {

struct ExpertLayoutArgs {
  const int32_t* recv_meta = nullptr;       // device [recv_rows, 1 + 2k]
  int64_t recv_rows = 0;
  int top_k = 0;
  int experts = 0;                          // E_local
  const int64_t* padded_offsets = nullptr;  // device [E_local + 1]
  const int64_t* expert_counts = nullptr;   // device [E_local]
  int32_t* pair_row = nullptr;              // device [padded_offsets[E_local]]
  float* pair_weight = nullptr;             // device [padded_offsets[E_local]]
  int32_t* error_flag = nullptr;            // device, sticky
  void* workspace = nullptr;                // device, >= expert_layout_workspace_bytes(...)
  size_t workspace_bytes = 0;
};

size_t expert_layout_workspace_bytes(int64_t recv_rows, int experts);

// Queues the layout on `stream`. With recv_rows == 0 only the padding/check pass runs (every
// count must then be 0; the engine skips the call when padded_total is 0).
void expert_layout_launch(const ExpertLayoutArgs& a, cudaStream_t stream);

}  // namespace epmoe::kernels
