// Source-side layout on the device: which rows go to which rank, in the protocol's order, plus the
// count-exchange headers. Bit-exact with protocol::dispatch_layout / encode_count_headers
// (src/ep_protocol.h), checked by tests/gpu/test_layout_gpu.
//
//   topk_ids i32[T, k], topk_weights f32[T, k]
//     -> status i64[4]                    code, a = token, b = slot, c = value of the FIRST bad slot
//                                         in row-major order (ok: all zero)
//        send_rows i64[world], send_offsets i64[world + 1]
//        token_row i32[T, world]          send row of (token, dest rank), -1 if not sent
//        send_meta i32[rows, 1 + 2k]      source token, local ids (slot order, -1 after), weight bits
//        send_token i32[rows]
//        send_pairs i64[world, E_local]   (row, expert) pairs per destination expert
//   rows <= T * min(k, world): the caller sizes send_meta / send_token for that bound (the real row
//   count is known on the host only after the count exchange).
//
// When the status is not ok, send_rows / send_offsets / send_pairs are zero (as on the CPU) and the
// other outputs are unspecified but were written in bounds only.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace epmoe::kernels {

struct DispatchLayoutArgs {
  // inputs (device)
  const int32_t* topk_ids = nullptr;
  const float* topk_weights = nullptr;
  int64_t num_tokens = 0;
  // Optional (the capturable forward): a device token count read when the kernels run; rows
  // [*device_num_tokens, num_tokens) are not tokens (no destination, token_row -1). A count outside
  // [0, num_tokens] is the status invalid_argument (a = the count, b = num_tokens).
  const int64_t* device_num_tokens = nullptr;
  int top_k = 0, num_experts = 0, world = 1;  // experts_per_rank = num_experts / world
  // outputs (device)
  int64_t* status = nullptr;        // [4]
  int64_t* send_rows = nullptr;     // [world]
  int64_t* send_offsets = nullptr;  // [world + 1]
  int32_t* token_row = nullptr;     // [T, world]
  int32_t* send_meta = nullptr;     // [T * min(k, world), 1 + 2k]
  int32_t* send_token = nullptr;    // [T * min(k, world)]
  int64_t* send_pairs = nullptr;    // [world, E_local]
  // scratch (device), at least dispatch_layout_workspace_bytes(num_tokens, world)
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// Scratch for the per-(rank, token) flags, their scan and the token masks. Host only, no launch.
size_t dispatch_layout_workspace_bytes(int64_t num_tokens, int world);

// Queues the layout on `stream` (no host sync). T == 0 is fine (only the zero outputs are written).
void dispatch_layout_launch(const DispatchLayoutArgs& a, cudaStream_t stream);

// headers i64[world, header_words(E_local)] for the count exchange, from the layout's status,
// send_rows and send_pairs (as protocol::encode_count_headers with an empty message).
// `sticky_error` (device i32, may be null): when nonzero and the status is ok, the headers carry
// Error(internal) with a = its value instead, so an earlier device-detected inconsistency (see
// expert_layout.cuh) fails every rank at this exchange.
void count_headers_launch(const int64_t* status, const int64_t* send_rows, const int64_t* send_pairs,
                          const int32_t* sticky_error, int world, int experts_per_rank, int64_t* headers,
                          cudaStream_t stream);

}  // namespace epmoe::kernels
