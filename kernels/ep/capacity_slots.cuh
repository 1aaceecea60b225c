// The capturable forward's transport between ranks: fixed-size slots instead of counted blocks, so
// the all-to-alls need no host counts. Each destination p gets a slot of `slot_rows` rows (a rank
// sends a token at most once to each rank, so slot_rows = the token capacity N always suffices);
// its header (protocol count header: status, rows, pairs per expert) travels beside it and says
// how many of the slot's rows are real.
//
// slot_pack: the dispatch layout's send rows (destination-major, send_offsets on the device) into
// the slots, and token_row rewritten to slot positions for the source reduce:
//   x[N] rows of row_bytes (bf16 rows, or an FP8 layer's packed rows), send_token[rows] i32,
//   send_meta[rows, meta_words] i32, send_offsets[W + 1]
//     -> send_x[W * slot_rows] rows of row_bytes, send_meta_slots[W * slot_rows, meta_words],
//        token_row[t, p] = p * slot_rows + (row - send_offsets[p]) for each sent (t, p)
// `max_rows` bounds the rows the layout can produce (N * min(k, W)); the real count is read on the
// device (send_offsets[W]). row_bytes % 16 == 0, 16-byte aligned rows.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace epmoe::kernels {

struct SlotPackArgs {
  const void* x = nullptr;
  int64_t row_bytes = 0;
  const int32_t* send_token = nullptr;
  const int32_t* send_meta = nullptr;
  int meta_words = 0;
  const int64_t* send_offsets = nullptr;  // device [world + 1]
  int world = 1;
  int64_t slot_rows = 0;
  int64_t max_rows = 0;
  void* send_x = nullptr;                 // [world * slot_rows] rows of row_bytes
  int32_t* send_meta_slots = nullptr;     // [world * slot_rows, meta_words]
  int32_t* token_row = nullptr;           // [N, world], as dispatch_layout wrote it (rows -> slots)
};

void slot_pack_launch(const SlotPackArgs& a, cudaStream_t stream);

}  // namespace epmoe::kernels
