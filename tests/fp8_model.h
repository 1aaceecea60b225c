// FP8 expert weights for the tests: a ModelWeights quantized on the host (epmoe/mxfp8.h or
// epmoe/fp8_block.h), all experts in ExpertWeights' layouts, with a rank's shard as ExpertWeights
// and the format's exact reference over all experts (epmoe/reference.h).
#pragma once
#include <cstdint>
#include <vector>

#include "epmoe/moe_layer.h"
#include "test_support.h"

namespace epmoe::test {

enum class Fp8Layout { mxfp8, block128 };

struct Fp8Model {
  Fp8Layout layout = Fp8Layout::mxfp8;
  int E = 0, hidden = 0, ffn = 0;
  std::vector<uint8_t> w1, w2;              // E4M3 [E, 2 ffn, hidden], [E, hidden, ffn]
  std::vector<uint8_t> w1s_e8m0, w2s_e8m0;  // MXFP8: [E, 2 ffn, hidden / 32], [E, hidden, ffn / 32]
  std::vector<float> w1s_f32, w2s_f32;      // block-128: [E, 2 ffn / 128, hidden / 128], [E, hidden / 128, ffn / 128]

  // Rank r's experts (E / world of them, from r E / world) as views of this model.
  ExpertWeights shard(int world, int rank) const;
  // y (fp32, not rounded) of every token: reference_moe_mxfp8 or reference_moe_fp8_block.
  void reference(const bf16* x, const int32_t* topk_ids, const float* topk_weights, int64_t T, int top_k,
                 float* y) const;
};

Fp8Model quantize_model(const ModelWeights& M, Fp8Layout layout);

// One FP8 layer (MoeLayer on the quantized model, x bf16) forward on CPU mock ranks.
struct Fp8LayerRun {
  int W, E, k, H, F;
  int64_t T;
  RoutingKind kind;
};
// Checks on every rank: y against the format's reference within kCpuTolerance (the bf16 path's fp32-vs-
// fp64 sums and final rounding, plus act elements that fp32 and fp64 put on either side of an E4M3
// rounding boundary), the received rows byte for byte (each the packed quantization of its source
// token's row: half the bytes of a bf16 dispatch, nearly) and the dispatch's byte count. Weights, x and
// routing come from seed, seed + 100 and seed + 200. Returns the relative L2 distance of all ranks' y
// from the bf16 layer's reference on the unquantized weights (the format's own end-to-end error).
double fp8_layer_case(Fp8Layout layout, const Fp8LayerRun& c, uint64_t seed);

}  // namespace epmoe::test
