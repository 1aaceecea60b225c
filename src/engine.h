// Internal: the engine behind MoeLayer. One per backend (cpu_engine.cpp, gpu_engine.cu).
#pragma once
#include <memory>

#include "epmoe/build_config.h"
#include "ep_protocol.h"
#include "epmoe/moe_layer.h"

namespace epmoe {

// What an engine keeps of a forward for its backward (engine-specific subclasses).
struct MoeForwardContext::State {
  virtual ~State() = default;
  const void* engine = nullptr;  // the engine that saved it: a context belongs to one layer
  SavePolicy policy = SavePolicy::rows_and_preactivation;
  int64_t bytes = 0;             // everything kept
  int64_t activation_bytes = 0;  // the received rows and h
  int64_t pairs = 0;
};

class MoeLayer::Engine {
 public:
  virtual ~Engine() = default;
  // save: null, or a context to fill for backward.
  virtual void forward(const TensorView& x, const TensorView& topk_ids, const TensorView& topk_weights,
                       const TensorView& y, void* stream, MoeForwardContext* save) = 0;
  virtual void backward(const MoeForwardContext& ctx, const TensorView& dy, const TensorView& dx,
                        const TensorView& d_topk_weights, const ExpertGradients& grads, void* stream) = 0;
  // Checked (shapes, dtype, device) and bound for the next calls (MoeLayer::bind_weights).
  virtual void bind_weights(const ExpertWeights& w) = 0;
  // MoeLayer::forward_capturable / forward_capturable_mxfp8 (x_scale: x given in MXFP8) /
  // check_capturable (the GPU engine's; others have none).
  virtual void forward_capturable(const TensorView& x, const TensorView& topk_ids, const TensorView& topk_weights,
                                  const TensorView& y, const int64_t* num_tokens, void* stream, bool save,
                                  const TensorView* x_scale) {
    (void)x, (void)topk_ids, (void)topk_weights, (void)y, (void)num_tokens, (void)stream, (void)save, (void)x_scale;
    EPMOE_FAIL(ErrorCode::unsupported, "forward_capturable needs the GPU engine (cuda weights)");
  }
  virtual void backward_capturable(const TensorView& x, const TensorView& topk_ids, const TensorView& dy,
                                   const TensorView& dx, const TensorView& d_topk_weights,
                                   const ExpertGradients& grads, const int64_t* num_tokens, void* stream) {
    (void)x, (void)topk_ids, (void)dy, (void)dx, (void)d_topk_weights, (void)grads, (void)num_tokens, (void)stream;
    EPMOE_FAIL(ErrorCode::unsupported, "backward_capturable needs the GPU engine (cuda weights)");
  }
  virtual void check_capturable(void* stream) { (void)stream; }
  // MoeLayer::forward_mxfp8 (an MXFP8 layer's, on either engine).
  virtual void forward_mxfp8(const TensorView& x, const TensorView& x_scale, const TensorView& topk_ids,
                             const TensorView& topk_weights, const TensorView& y, void* stream) {
    (void)x, (void)x_scale, (void)topk_ids, (void)topk_weights, (void)y, (void)stream;
    EPMOE_FAIL(ErrorCode::unsupported, "forward_mxfp8 needs an MXFP8 layer");
  }
  MoeConfig cfg;
  ForwardStats stats;
  ExpertPath path = ExpertPath::automatic;
};

// Checks shapes, dtypes and devices of the forward arguments without throwing, so that a bad
// argument on one rank travels in the count exchange and fails every rank alike.
// With x_scale: x is MXFP8 (e4m3[T, hidden], x_scale e8m0[T, hidden / 32]).
protocol::Status validate_forward_args(const MoeConfig& cfg, const TensorView& x, const TensorView& topk_ids,
                                       const TensorView& topk_weights, const TensorView& y, DeviceType device,
                                       const TensorView* x_scale = nullptr);
// "bf16", "MXFP8" or "FP8 block-128": a layer's weight format in messages.
const char* layer_format_name(bool fp8, bool block128);
// x given in MXFP8 (`who`: forward_mxfp8, forward_capturable_mxfp8) needs an MXFP8 layer: ok, or
// unsupported naming this layer's format. Both engines' check.
protocol::Status check_given_mx_layer(const char* who, bool fp8, bool block128);
// Checks w1/w2 shapes for this rank (throws: construction is local and before any collective
// except the configuration agreement, which runs first).
void validate_weights(const MoeConfig& cfg, const ExpertWeights& w, DeviceType device);
// The same for backward's arguments against the saved forward (T = that forward's tokens): dy, dx
// bf16[T, hidden], d_topk_weights f32[T, k], dw1 / dw2 of ExpertWeights' shapes in bf16 or f32;
// ctx saved by `engine`.
protocol::Status validate_backward_tensors(const MoeConfig& cfg, int64_t T, const TensorView& dy, const TensorView& dx,
                                           const TensorView& d_topk_weights, const ExpertGradients& grads,
                                           DeviceType device);
protocol::Status validate_backward_args(const MoeConfig& cfg, const MoeForwardContext& ctx, const void* engine,
                                        int64_t T, const TensorView& dy, const TensorView& dx,
                                        const TensorView& d_topk_weights, const ExpertGradients& grads,
                                        DeviceType device);

std::unique_ptr<MoeLayer::Engine> make_cpu_engine(const MoeConfig& cfg, const ExpertWeights& w,
                                                  std::shared_ptr<Communicator> comm, const LayerOptions& opt);
#if EPMOE_WITH_CUDA
std::unique_ptr<MoeLayer::Engine> make_gpu_engine(const MoeConfig& cfg, const ExpertWeights& w,
                                                  std::shared_ptr<Communicator> comm, const LayerOptions& opt);
#endif

}  // namespace epmoe
