// The contract between the GPU engine and every local-expert path (sm_90 kernels, cuBLAS fallback):
// what the experts read and where they reduce. All pointers are device pointers.
//
//   x[x_rows, hidden] bf16             the received rows in their own order; the sm_90 UP gathers
//                                      row pair_row[i] for each expert-sorted row i itself
//   xs[rows_capacity, hidden] bf16     cuBLAS path only: the rows expert-sorted, each expert's segment
//                                      padded to kExpertTile rows, padding rows zero (gather_rows)
//   padded_offsets[E_local + 1] i64    segment starts (device; the host may not know them)
//   pair_row[rows_capacity] i32        for each expert-sorted row: its row in x and in `out`, -1 for
//                                      padding; padding rows are each segment's tail (as expert_layout
//                                      writes them; the sm_90 kernels' padding halves rely on it)
//   pair_weight[rows_capacity] f32     routing weight of that (row, expert) pair, 0 for padding
//   w1[E_local, 2*ffn, hidden] bf16    rows 0..ffn-1 gate, ffn..2ffn-1 up
//   w2[E_local, hidden, ffn] bf16
//   act[rows_capacity, ffn] bf16       workspace: bf16(silu(gate) * up)
//   preact[rows_capacity, 2*ffn] bf16  optional (sm_90 path; null: not kept): h = [gate | up] in bf16,
//                                      what a saving forward keeps for backward
//   out[out_rows, hidden] bf16         accumulator, zeroed before the experts run (by the caller, or
//                                      with zero_out by the sm_90 UP kernel itself):
//                                      out[pair_row[i]] += pair_weight[i] * (act[i] @ w2_e^T)
//   pair_out[rows_capacity, hidden]    optional (deterministic mode): DOWN stores each real pair's
//                                      bf16(pair_weight[i] * (act[i] @ w2_e^T)) in row i instead, out
//                                      untouched; the caller sums a row's pairs in a fixed order
//   out_acc[out_rows, hidden] f32      optional (the fused swap-AB pipeline, Sm90Plan::fused): its
//                                      split-K accumulator, ALL ZERO on entry; the pipeline writes
//                                      out = bf16(out_acc) over all out_rows (out need not be zeroed)
//                                      and leaves out_acc all zero again. Null: the split kernels run
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace epmoe::kernels {

// Rows per expert segment: the sm_90 kernels' M tile. ExpertLayout.tile must equal this.
inline constexpr int kExpertTile = 128;

struct ExpertProblem {
  const __nv_bfloat16* x = nullptr;
  int64_t x_rows = 0;
  const __nv_bfloat16* xs = nullptr;  // (cuBLAS path)
  const int64_t* padded_offsets = nullptr;
  const int32_t* pair_row = nullptr;
  const float* pair_weight = nullptr;
  const __nv_bfloat16* w1 = nullptr;
  const __nv_bfloat16* w2 = nullptr;
  __nv_bfloat16* act = nullptr;
  __nv_bfloat16* preact = nullptr;  // (sm_90 UP: h kept for backward)
  __nv_bfloat16* out = nullptr;
  __nv_bfloat16* pair_out = nullptr;  // (deterministic mode; see above)
  float* out_acc = nullptr;           // (the fused pipeline; see above)
  int64_t rows_capacity = 0;  // rows allocated in act/pair_* (and xs): >= padded_offsets[E_local]
  int64_t out_rows = 0;
  int experts = 0;            // E_local
  int hidden = 0;
  int ffn = 0;
  // The real (row, expert) pairs below padded_offsets[E], or a bound of them; 0 = unknown. Only the
  // heuristics read it (Sm90Shape::pairs: swap-AB for sparse tiles).
  int64_t pairs = 0;
  // sm_90 path only: the UP kernel zeroes out[0, out_rows) itself, spread over its work items, so the
  // zeroing overlaps its GEMM instead of running as a memset before it (DOWN reduces only after the
  // UP grid completed). Must be false for the cuBLAS path and for a DOWN launched without its UP.
  bool zero_out = false;
};

// The expert layout's device arrays (expert_layout, or a host-built layout uploaded).
struct ExpertLayoutView {
  const int64_t* padded_offsets = nullptr;
  const int32_t* pair_row = nullptr;
  const float* pair_weight = nullptr;
  int64_t rows_capacity = 0;
};
// The weights of this rank's experts.
struct ExpertWeightsView {
  const __nv_bfloat16* w1 = nullptr;
  const __nv_bfloat16* w2 = nullptr;
  int experts = 0, hidden = 0, ffn = 0;
};

// One problem from its parts, as the engine, the benchmark and the tests build it.
inline ExpertProblem make_expert_problem(const ExpertWeightsView& w, const __nv_bfloat16* x, int64_t x_rows,
                                         const ExpertLayoutView& layout, __nv_bfloat16* act, __nv_bfloat16* out,
                                         int64_t out_rows, bool zero_out = false) {
  ExpertProblem p;
  p.x = x;
  p.x_rows = x_rows;
  p.padded_offsets = layout.padded_offsets;
  p.pair_row = layout.pair_row;
  p.pair_weight = layout.pair_weight;
  p.rows_capacity = layout.rows_capacity;
  p.w1 = w.w1;
  p.w2 = w.w2;
  p.experts = w.experts;
  p.hidden = w.hidden;
  p.ffn = w.ffn;
  p.act = act;
  p.out = out;
  p.out_rows = out_rows;
  p.zero_out = zero_out;
  return p;
}

}  // namespace epmoe::kernels
