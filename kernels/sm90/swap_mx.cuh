// The MXFP8 expert pipeline on sm_90a (issue 50), swap-AB form (the small-batch path), its fused
// pipeline (MxForm::fused, decode: fused_mx_kernel.cu, act requantized in shared memory, never in
// HBM) and tile form (MxForm::tile, the large-T path; the same math on 128-row tiles x 128 weight rows):
// E4M3 weights and tokens with E8M0 scales per 32 along K (epmoe/mxfp8.h), the k32 FP8 wgmma of the
// kernel core with each block's partial promoted by its two scales, act requantized to MXFP8 in UP's
// epilogue (so DOWN streams E4M3 act as well):
//   UP:   v[r, c] = silu(g) * u, g = x[pair_row[r]] . w1[e, c], u = x[pair_row[r]] . w1[e, ffn + c]
//         (the dot products over the dequantized operands), act[r] = MX(v[r]) as a packed row
//   DOWN: out[pair_row[r], :] += bf16(pair_weight[r] * (act[r] . w2[e, :]))   (bf16 reductions)
// Rows, items and roles as the bf16 swap-AB kernels (swap_ab_kernel.cu): one 64-row half of a
// 128-row layout tile x 64 weight rows per item, N = 8 ... 64 from the half's real rows.
//
// Layouts (all device pointers, 16-byte aligned):
//   x[x_rows]       packed MX rows of hidden (mx::packed_row_bytes(hidden) bytes each: the dispatch's)
//   w1[E, 2 ffn, hidden] E4M3, w1_scale[E, 2 ffn, hidden / 32] E8M0
//   w2[E, hidden, ffn] E4M3,   w2_scale[E, hidden, ffn / 32] E8M0
//   act[rows_capacity] packed MX rows of ffn (workspace; rows past a half's real rows not written;
//                   not written at all by the fused form)
//   out[out_rows, hidden] bf16: zeroed before DOWN (by the caller, or by UP with zero_out); the fused
//                   form writes every row (out = bf16(out_acc))
// Requirements (Error(invalid_argument) otherwise): hidden % 128 == 0, ffn % 128 == 0, block128 scales
// with the tile form only, the layout
// as for the bf16 kernels (padded_offsets, pair_row with each segment's real rows first).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "epmoe/fp8_block.h"
#include "epmoe/mxfp8.h"
#include "kernels/heuristics/mx_heuristics.h"

namespace epmoe::kernels {

// The kernels' form (MxForm: swap-AB, fused, tile): kernels/heuristics/mx_heuristics.h.

// The scale format of the operands (the element type is E4M3 in both):
//   mx32: MXFP8 (epmoe/mxfp8.h), E8M0 scales per 32 along K: x / act packed MX rows,
//         w1_scale [E, 2 ffn, hidden / 32], w2_scale [E, hidden, ffn / 32] (bytes);
//   block128: FP8 block-128 (epmoe/fp8_block.h), fp32 scales: x / act packed block-128 rows (1 x 128
//         blocks), w1_scale [E, 2 ffn / 128, hidden / 128], w2_scale [E, hidden / 128, ffn / 128]
//         (floats, passed as their bytes). Tile form only (tile_fp8b_kernel.cu).
enum class Fp8Scales : uint8_t { mx32, block128 };

// Bytes of one packed row of K elements (x as dispatched, act) in format f.
inline int64_t fp8_packed_row_bytes(Fp8Scales f, int K) {
  return f == Fp8Scales::block128 ? fp8b::packed_row_bytes(K) : mx::packed_row_bytes(K);
}

struct MxExpertProblem {
  const uint8_t* x = nullptr;
  int64_t x_rows = 0;
  const int64_t* padded_offsets = nullptr;
  const int32_t* pair_row = nullptr;
  const float* pair_weight = nullptr;
  const uint8_t* w1 = nullptr;
  const uint8_t* w1_scale = nullptr;
  const uint8_t* w2 = nullptr;
  const uint8_t* w2_scale = nullptr;
  uint8_t* act = nullptr;
  __nv_bfloat16* out = nullptr;
  int64_t out_rows = 0;
  int64_t rows_capacity = 0;
  int experts = 0, hidden = 0, ffn = 0;
  bool zero_out = false;  // UP zeroes out[0, out_rows) itself (as ExpertProblem::zero_out)
  // The fused form's fp32 accumulator [out_rows, hidden], all zero on entry and left all zero (its
  // write-out re-zeroes it); it writes every row of out itself, so zero_out is not needed there.
  float* out_acc = nullptr;
  MxForm form = MxForm::swap;
  Fp8Scales scales = Fp8Scales::mx32;
};

// Throws Error(invalid_argument) unless p meets the requirements above (and, in the fused form, MX
// scales and a 16-byte aligned out_acc).
void check_mx_expert_problem(const MxExpertProblem& p, const char* who);
// The split forms' kernels alone (the fused form has no separate UP or DOWN: Error(invalid_argument)).
void sm90_mx_up_launch(const MxExpertProblem& p, cudaStream_t s);
// With pdl, the programmatic dependent of the stream's previous kernel (UP): its W2 loads start early.
void sm90_mx_down_launch(const MxExpertProblem& p, cudaStream_t s, bool pdl);
// The layer's experts in p.form: UP, then DOWN PDL-chained to it; or the fused grid and its write-out.
void sm90_mx_experts_launch(const MxExpertProblem& p, cudaStream_t s);

}  // namespace epmoe::kernels
