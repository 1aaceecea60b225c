// The contract between the GPU engine and every local-expert path (cuBLAS fallback, sm_90 split
// pipeline): what the experts read and where they reduce. All pointers are device pointers.
//
//   xs[rows_capacity, hidden] bf16     gathered rows, expert-sorted, each expert's segment padded to
//                                      kExpertTile rows; padding rows are zero
//   x[x_rows, hidden] bf16             optional (sm_90 path): the rows in their own (token) order.
//                                      When set, the UP kernel gathers xs[i] = x[pair_row[i]] itself
//                                      (zero for padding or pair_row outside [0, x_rows)) and xs is
//                                      neither read nor needed; the cuBLAS path always reads xs.
//   padded_offsets[E_local + 1] i64    segment starts in xs (device; the host may not know them)
//   pair_row[rows_capacity] i32        for each xs row: destination row in `out`, -1 for padding;
//                                      padding rows are each segment's tail (as expert_layout
//                                      writes them; the sm_90 kernels' padding halves rely on it)
//   pair_weight[rows_capacity] f32     routing weight of that (row, expert) pair, 0 for padding
//   w1[E_local, 2*ffn, hidden] bf16    rows 0..ffn-1 gate, ffn..2ffn-1 up
//   w2[E_local, hidden, ffn] bf16
//   act[rows_capacity, ffn] bf16       workspace: bf16(silu(gate) * up)
//   out[out_rows, hidden] bf16         accumulator, zeroed before the experts run (by the caller, or
//                                      with zero_out by the sm_90 UP kernel itself):
//                                      out[pair_row[i]] += pair_weight[i] * (act[i] @ w2_e^T)
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace epmoe::kernels {

// Rows per expert segment: the sm_90 kernels' M tile. ExpertLayout.tile must equal this.
inline constexpr int kExpertTile = 128;

struct ExpertProblem {
  const __nv_bfloat16* xs = nullptr;
  const __nv_bfloat16* x = nullptr;  // see above: fused gather on the sm_90 path when non-null
  int64_t x_rows = 0;
  const int64_t* padded_offsets = nullptr;
  const int32_t* pair_row = nullptr;
  const float* pair_weight = nullptr;
  const __nv_bfloat16* w1 = nullptr;
  const __nv_bfloat16* w2 = nullptr;
  __nv_bfloat16* act = nullptr;
  __nv_bfloat16* out = nullptr;
  int64_t rows_capacity = 0;  // rows allocated in xs/act/pair_*: >= padded_offsets[E_local]
  int64_t out_rows = 0;
  int experts = 0;            // E_local
  int hidden = 0;
  int ffn = 0;
  // sm_90 path only: the UP kernel zeroes out[0, out_rows) itself, spread over its work items, so the
  // zeroing overlaps its GEMM instead of running as a memset before it (DOWN reduces only after the
  // UP grid completed). Must be false for the cuBLAS path and for a DOWN launched without its UP.
  bool zero_out = false;
  // sm_90 granular kernels only (EPMOE_SM90_UP_TILES / EPMOE_SM90_DOWN_TILES=granular,
  // sm90_*_granular_kernel.cu); without them the 128-row kernels run:
  //   expert_counts i64[E_local]  real rows of each segment (device)
  //   work_counters i32[4]        item claim counters, [0..1] UP's, [2..3] DOWN's (the two kernels
  //                               overlap under PDL): zero before the first launch, and each kernel
  //                               leaves its pair zero (its last CTA resets it), so graph replays
  //                               need no memset; one set per stream that runs the kernels
  const int64_t* expert_counts = nullptr;
  int32_t* work_counters = nullptr;
};

}  // namespace epmoe::kernels
