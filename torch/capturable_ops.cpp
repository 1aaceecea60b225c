// The capturable forward as torch ops (MoeLayer::forward_capturable on torch's current stream), so a
// torch.cuda.graph / at::cuda::CUDAGraph captures the layer once and replays it at any token count:
//   moe_capturable(int layer, Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor num_tokens,
//                  Tensor[] weights) -> Tensor y
//       x bf16 [N, hidden] (N <= the layer's max_tokens_per_rank), topk_ids int32 [N, k], topk_weights
//       f32 [N, k], num_tokens a one-element int64 tensor on the layer's GPU, read when the work runs:
//       the first num_tokens rows are the tokens, y's other rows come back 0. weights: [w1, w2] of a
//       bf16 layer or [w1, w1_scale, w2, w2_scale] of an FP8 one, bound as every op binds them (a
//       replay runs on the pointers its capture saw, as any CUDA graph does).
//   moe_capturable_mxfp8_x(int layer, Tensor x, Tensor x_scale, Tensor topk_ids, Tensor topk_weights,
//                          Tensor num_tokens, Tensor[] weights) -> Tensor y
//       an MXFP8 layer's, x given in the format (as moe_mxfp8_x): x E4M3 [N, hidden], x_scale E8M0
//       [N, hidden / 32] (uint8 bytes or torch's float8 dtypes); y bf16 [N, hidden].
//   check_capturable(int layer, Tensor on_device) -> ()
//       waits for the current stream of on_device's GPU and raises the first bad id / count the
//       replays met (their rows were NaN).
// Forward-only (no autograd node: a call autograd would record raises). The layer is made with
// create_layer / create_layer_fp8's max_tokens_per_rank > 0 (its buffers sized then: warm up, i.e.
// make the layer, before capturing). No type conversions here: a dtype cast inside a capture would
// be a hidden copy, so the inputs must already be int32 / f32 / int64.
#include <torch/library.h>
#include <torch/torch.h>

#include "epmoe/error.h"
#include "epmoe/torch.h"
#include "registry.h"

namespace epmoe::torch_ext {
namespace {

ExpertWeights bound_weights(const std::vector<at::Tensor>& w) {
  EPMOE_CHECK(w.size() == 2 || w.size() == 4, ErrorCode::invalid_argument,
              "moe_capturable: weights must be [w1, w2] (bf16) or [w1, w1_scale, w2, w2_scale] (FP8), got ", w.size(),
              " tensors");
  if (w.size() == 4) return fp8_weights_of(w[0], w[1], w[2], w[3]);
  EPMOE_CHECK(w[0].is_contiguous() && w[1].is_contiguous(), ErrorCode::invalid_argument,
              "moe_capturable: w1 and w2 must be contiguous");
  return {view_of(w[0]), view_of(w[1])};
}

// The routing and count dtypes (no casts are made: one inside a capture would be a hidden copy).
void check_capturable_inputs(const char* who, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                             const at::Tensor& num_tokens) {
  EPMOE_CHECK(topk_ids.scalar_type() == at::kInt && topk_weights.scalar_type() == at::kFloat &&
                  num_tokens.scalar_type() == at::kLong && num_tokens.numel() == 1,
              ErrorCode::invalid_argument, who,
              ": topk_ids must be int32, topk_weights float32 and num_tokens a one-element int64 "
              "tensor (no casts are made: one inside a capture would be a hidden copy), got ",
              topk_ids.scalar_type(), ", ", topk_weights.scalar_type(), ", ", num_tokens.scalar_type(), " of ",
              num_tokens.numel(), " elements");
}

at::Tensor moe_capturable_impl(int64_t layer, const at::Tensor& x, const at::Tensor& topk_ids,
                               const at::Tensor& topk_weights, const at::Tensor& num_tokens,
                               at::TensorList weights) {
  const std::shared_ptr<MoeLayer> L = layer_of(layer);
  check_capturable_inputs("moe_capturable", topk_ids, topk_weights, num_tokens);
  EPMOE_CHECK(x.is_contiguous() && topk_ids.is_contiguous() && topk_weights.is_contiguous(),
              ErrorCode::invalid_argument, "moe_capturable: x, topk_ids and topk_weights must be contiguous");
  L->bind_weights(bound_weights(weights.vec()));
  at::Tensor y = at::empty_like(x);
  L->forward_capturable(view_of(x), view_of(topk_ids), view_of(topk_weights), view_of(y),
                        static_cast<const int64_t*>(num_tokens.data_ptr()), stream_of(x));
  return y;
}

at::Tensor moe_capturable_mxfp8_x_impl(int64_t layer, const at::Tensor& x, const at::Tensor& x_scale,
                                       const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                                       const at::Tensor& num_tokens, at::TensorList weights) {
  const std::shared_ptr<MoeLayer> L = layer_of(layer);
  check_capturable_inputs("moe_capturable_mxfp8_x", topk_ids, topk_weights, num_tokens);
  EPMOE_CHECK(x.is_contiguous() && x_scale.is_contiguous() && topk_ids.is_contiguous() &&
                  topk_weights.is_contiguous(),
              ErrorCode::invalid_argument,
              "moe_capturable_mxfp8_x: x, x_scale, topk_ids and topk_weights must be contiguous");
  L->bind_weights(bound_weights(weights.vec()));
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
  L->forward_capturable_mxfp8(view_as(x, DType::e4m3), view_as(x_scale, DType::e8m0), view_of(topk_ids),
                              view_of(topk_weights), view_of(y), static_cast<const int64_t*>(num_tokens.data_ptr()),
                              stream_of(x));
  return y;
}

at::Tensor moe_capturable_meta(int64_t, const at::Tensor& x, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               at::TensorList) {
  return at::empty_like(x);
}

at::Tensor moe_capturable_mxfp8_x_meta(int64_t, const at::Tensor& x, const at::Tensor&, const at::Tensor&,
                                       const at::Tensor&, const at::Tensor&, at::TensorList) {
  return at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
}

// No backward through a graph here (refuse_recorded_call).
at::Tensor moe_capturable_autograd(int64_t layer, const at::Tensor& x, const at::Tensor& topk_ids,
                                   const at::Tensor& topk_weights, const at::Tensor& num_tokens,
                                   at::TensorList weights) {
  std::vector<at::Tensor> inputs{x, topk_weights};
  inputs.insert(inputs.end(), weights.begin(), weights.end());
  refuse_recorded_call("moe_capturable (decode under a CUDA graph) is", inputs);
  at::AutoDispatchBelowADInplaceOrView below;
  return moe_capturable(layer, x, topk_ids, topk_weights, num_tokens, weights);
}

at::Tensor moe_capturable_mxfp8_x_autograd(int64_t layer, const at::Tensor& x, const at::Tensor& x_scale,
                                           const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                                           const at::Tensor& num_tokens, at::TensorList weights) {
  std::vector<at::Tensor> inputs{x, x_scale, topk_weights};
  inputs.insert(inputs.end(), weights.begin(), weights.end());
  refuse_recorded_call("moe_capturable_mxfp8_x (decode under a CUDA graph) is", inputs);
  at::AutoDispatchBelowADInplaceOrView below;
  return moe_capturable_mxfp8_x(layer, x, x_scale, topk_ids, topk_weights, num_tokens, weights);
}

void check_capturable_op(int64_t layer, const at::Tensor& on_device) {
  layer_of(layer)->check_capturable(stream_of(on_device));
}

}  // namespace

at::Tensor moe_capturable(int64_t layer, const at::Tensor& x, const at::Tensor& topk_ids,
                          const at::Tensor& topk_weights, const at::Tensor& num_tokens, at::TensorList weights) {
  static const auto m = op("epmoe::moe_capturable")
                            .typed<at::Tensor(int64_t, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                              const at::Tensor&, at::TensorList)>();
  return m.call(layer, x, topk_ids, topk_weights, num_tokens, weights);
}

at::Tensor moe_capturable_mxfp8_x(int64_t layer, const at::Tensor& x, const at::Tensor& x_scale,
                                  const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                                  const at::Tensor& num_tokens, at::TensorList weights) {
  static const auto m = op("epmoe::moe_capturable_mxfp8_x")
                            .typed<at::Tensor(int64_t, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                              const at::Tensor&, const at::Tensor&, at::TensorList)>();
  return m.call(layer, x, x_scale, topk_ids, topk_weights, num_tokens, weights);
}

TORCH_LIBRARY_FRAGMENT(epmoe, m) {
  m.def("moe_capturable(int layer, Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor num_tokens, "
        "Tensor[] weights) -> Tensor");
  m.def("moe_capturable_mxfp8_x(int layer, Tensor x, Tensor x_scale, Tensor topk_ids, Tensor topk_weights, "
        "Tensor num_tokens, Tensor[] weights) -> Tensor");
  m.def("check_capturable(int layer, Tensor on_device) -> ()", check_capturable_op);
}
TORCH_LIBRARY_IMPL(epmoe, CPU, m) {
  m.impl("moe_capturable", moe_capturable_impl);
  m.impl("moe_capturable_mxfp8_x", moe_capturable_mxfp8_x_impl);
}
TORCH_LIBRARY_IMPL(epmoe, CUDA, m) {
  m.impl("moe_capturable", moe_capturable_impl);
  m.impl("moe_capturable_mxfp8_x", moe_capturable_mxfp8_x_impl);
}
TORCH_LIBRARY_IMPL(epmoe, Meta, m) {
  m.impl("moe_capturable", moe_capturable_meta);
  m.impl("moe_capturable_mxfp8_x", moe_capturable_mxfp8_x_meta);
}
TORCH_LIBRARY_IMPL(epmoe, Autograd, m) {
  m.impl("moe_capturable", moe_capturable_autograd);
  m.impl("moe_capturable_mxfp8_x", moe_capturable_mxfp8_x_autograd);
}

}  // namespace epmoe::torch_ext
