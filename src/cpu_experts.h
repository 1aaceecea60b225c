// CPU expert compute: the destination side of the EP forward and backward on the host.
//   x[rows, hidden] bf16 received rows, meta[rows, meta_words] ->
//   out[rows, hidden] bf16 = bf16( sum over the row's local experts e of w * W2_e act_e(x) )
//   act_e(x) = bf16( silu(g) * u ), [g, u] = W1_e x       fp32 accumulation throughout
// FP8 weights (set_mxfp8_weights, set_fp8_block_weights; forward only): the weights dequantized, x
// rows and act rows each taken through the format (MXFP8, epmoe/mxfp8.h, or FP8 block-128,
// epmoe/fp8_block.h) before their GEMM instead of bf16 - what the format means.
// Backward, per (row, local expert e, weight s), given the row's dy (gradients with [g, u] rounded to
// bf16, as saved, whichever the save policy):
//   da' = W2_e^T dy, ds = <da', act>, da = s da', dg = da u silu'(g), du = da silu(g)
//   dx_row += W1_e^T [dg, du], dW2_e += s dy act^T, dW1_e += [dg, du] x^T
#pragma once
#include <cstdint>

#include "ep_protocol.h"

namespace epmoe {

class CpuExperts {
 public:
  // w1[E_local, 2*ffn, hidden], w2[E_local, hidden, ffn] (bf16, host). Not copied: must outlive this.
  CpuExperts(const MoeConfig& cfg, const bf16* w1, const bf16* w2, int threads);
  // h (optional, [pairs, 2 ffn] bf16 in expert-layout order, tile 1): the rows' [g, u], for backward.
  void set_weights(const bf16* w1, const bf16* w2) { w1_ = w1, w2_ = w2, mx_ = {}; }
  // MXFP8: e4m3 w1 / w2 with their e8m0 scales (layouts: epmoe/moe_layer.h ExpertWeights).
  void set_mxfp8_weights(const uint8_t* w1, const uint8_t* w1_scale, const uint8_t* w2, const uint8_t* w2_scale) {
    mx_ = {w1, w1_scale, w2, w2_scale, nullptr, nullptr};
    w1_ = w2_ = nullptr;
  }
  // FP8 block-128: e4m3 w1 / w2 with their fp32 128 x 128 block scales (epmoe/fp8_block.h).
  void set_fp8_block_weights(const uint8_t* w1, const float* w1_scale, const uint8_t* w2, const float* w2_scale) {
    mx_ = {w1, nullptr, w2, nullptr, w1_scale, w2_scale};
    w1_ = w2_ = nullptr;
  }
  void run(const bf16* x, const int32_t* meta, int64_t rows, bf16* out, bf16* h = nullptr) const;
  // FP8 weights, the rows already in the format (packed rows of the layer's format: what an FP8 layer
  // dispatches): the same result as run() on the rows they were quantized from.
  void run_packed_mx(const uint8_t* x, const int32_t* meta, int64_t rows, bf16* out) const;
  // dy[rows, hidden] bf16 (the rows' gradients, in received order); h: the forward's, or null to
  // recompute it. Writes dx[rows, hidden] bf16 and ds[rows, top_k] f32 (the n-th local slot of the
  // row in meta order; 0 past its last), and adds into dw1[E_local, 2 ffn, hidden] and
  // dw2[E_local, hidden, ffn] (fp32).
  void backward(const bf16* x, const int32_t* meta, int64_t rows, const bf16* dy, const bf16* h, bf16* dx, float* ds,
                float* dw1, float* dw2) const;

 private:
  struct Rows {  // received rows: bf16, or packed MXFP8 (epmoe/mxfp8.h)
    const bf16* bf16_rows = nullptr;
    const uint8_t* mx_rows = nullptr;
  };
  void run_rows(const Rows& x, const int32_t* meta, int64_t rows, bf16* out, bf16* h) const;
  void run_expert(int e, const Rows& x, const protocol::ExpertLayout& L, float* acc, bf16* h) const;
  void backward_expert(int e, const bf16* x, const int32_t* meta, const protocol::ExpertLayout& L, const bf16* dy,
                       const bf16* h, float* dx_acc, float* ds, float* dw1, float* dw2) const;
  // Expert e's weights as fp32, transposed: w1t [H, 2F], w2t [F, H] (bf16 or dequantized MXFP8).
  void expert_weights_t(int e, float* w1t, float* w2t) const;
  struct Mx {  // FP8 weights: e8m0 scales (MXFP8), or fp32 block scales (FP8 block-128)
    const uint8_t *w1 = nullptr, *w1_scale = nullptr, *w2 = nullptr, *w2_scale = nullptr;
    const float *w1_block_scale = nullptr, *w2_block_scale = nullptr;
    bool block() const { return w1_block_scale != nullptr; }
  };
  // A row through the layer's FP8 format and back; a packed row's bytes and its values.
  void round_trip(float* v, int K) const;
  int64_t packed_row_bytes(int K) const;
  void dequantize_packed(const uint8_t* packed, int K, float* out) const;
  MoeConfig cfg_;
  const bf16* w1_;
  const bf16* w2_;
  Mx mx_;  // (w1 non-null: the weights are MXFP8)
  int threads_;
};

}  // namespace epmoe
