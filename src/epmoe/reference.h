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

}  // namespace epmoe
