// The oracle: one process, all experts, written independently of the EP path (no layout, no
// exchange). Expert compute in fp32 on bf16 inputs with the activation rounded to bf16 between the
// two projections, as every backend does; y rounded to bf16.
#pragma once
#include <cstdint>

#include "epmoe/bf16.h"

namespace epmoe {

// x[T, hidden], ids/weights[T, k], w1[E, 2*ffn, hidden], w2[E, hidden, ffn] -> y[T, hidden] (fp32,
// not rounded, so tests can see the error before the final rounding). Slots with id -1 are skipped.
void reference_moe(const bf16* x, const int32_t* topk_ids, const float* topk_weights, int64_t num_tokens, int top_k,
                   const bf16* w1, const bf16* w2, int num_experts, int hidden, int ffn, float* y);

// The MXFP8 layer (epmoe/mxfp8.h): e4m3 weights with their e8m0 block scales (ExpertWeights'
// layouts), x taken through MXFP8 per token row, fp64 dot products on the dequantized values, the
// activation taken through MXFP8 per row (from fp64, where the engines quantize an fp32 one) -> y
// (fp32, not rounded). The exact-format check of every MXFP8 path.
void reference_moe_mxfp8(const bf16* x, const int32_t* topk_ids, const float* topk_weights, int64_t num_tokens,
                         int top_k, const uint8_t* w1, const uint8_t* w1_scale, const uint8_t* w2,
                         const uint8_t* w2_scale, int num_experts, int hidden, int ffn, float* y);

// The FP8 block-128 layer (epmoe/fp8_block.h): e4m3 weights with their fp32 128 x 128 block scales,
// x taken through the format per token row (1 x 128 blocks), fp64 dot products on the dequantized
// values, act taken through it per row (from fp64) -> y (fp32, not rounded).
void reference_moe_fp8_block(const bf16* x, const int32_t* topk_ids, const float* topk_weights, int64_t num_tokens,
                             int top_k, const uint8_t* w1, const float* w1_scale, const uint8_t* w2,
                             const float* w2_scale, int num_experts, int hidden, int ffn, float* y);

// The same layer in fp64 on fp64 inputs, with no rounding anywhere: the forward, and its exact
// gradients given dy (written, not accumulated). For a dropped slot (id -1) d_topk_weights is 0.
// Per (token t, slot j, expert e, weight s): [g, u] = W1_e x_t, a = silu(g) u, o = W2_e a,
// y_t += s o; ds = <dy_t, o>, da = s W2_e^T dy_t, dg = da u silu'(g), du = da silu(g),
// dx_t += W1_e^T [dg, du], dW2_e += s dy_t a^T, dW1_e += [dg, du] x_t^T.
// The backward is checked against finite differences of the forward (tests/test_backward_reference).
void reference_moe_f64(const double* x, const int32_t* topk_ids, const double* topk_weights, int64_t num_tokens,
                       int top_k, const double* w1, const double* w2, int num_experts, int hidden, int ffn, double* y);
void reference_moe_backward_f64(const double* x, const int32_t* topk_ids, const double* topk_weights,
                                int64_t num_tokens, int top_k, const double* w1, const double* w2, int num_experts,
                                int hidden, int ffn, const double* dy, double* dx, double* d_topk_weights, double* dw1,
                                double* dw2);

}  // namespace epmoe
