// epmoe from libtorch: the layer as torch ops with autograd, and a torch::nn::Module.
//
//   auto moe = epmoe::torch_ext::Moe(cfg, comm);         // w1, w2: Parameters of this rank's experts
//   at::Tensor y = moe->forward(x, topk_ids, topk_weights);  // x bf16 [T, hidden]
//   y.backward(dy);   // -> x.grad, topk_weights.grad (so the router's), w1.grad, w2.grad
//   auto fp8 = epmoe::torch_ext::MoeFp8(*moe, epmoe::torch_ext::Fp8Format::mxfp8);  // inference copy
//   at::Tensor y8 = fp8->forward(x, topk_ids, topk_weights);   // under torch::NoGradGuard
//
// The ops (TORCH_LIBRARY(epmoe), callable as torch.ops.epmoe.* once the library is loaded):
//   moe(int layer, Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w1, Tensor w2) -> Tensor
//       differentiable (autograd registered in C++ on the Autograd key) in x, topk_weights, w1, w2
//   moe_forward(int layer, ..., bool save) -> (Tensor y, int ctx)        ctx 0 unless save
//   moe_backward(int layer, int ctx, Tensor dy, Tensor w1, Tensor w2)
//       -> (Tensor dx, Tensor d_topk_weights, Tensor dw1, Tensor dw2)
//   moe_backward_accumulate(int layer, int ctx, Tensor dy, Tensor w1, Tensor w2, Tensor(a!) dw1,
//       Tensor(b!) dw2) -> (Tensor dx, Tensor d_topk_weights)    dW added into dw1 / dw2 (f32 or bf16)
//   release_context(int ctx) -> ()
// and, for FP8 layers (inference only; E4M3 / E8M0 bytes as uint8 tensors, see below):
//   moe_fp8(int layer, Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w1, Tensor w1_scale,
//       Tensor w2, Tensor w2_scale) -> Tensor            x bf16, quantized by the layer
//   moe_mxfp8_x(int layer, Tensor x, Tensor x_scale, Tensor topk_ids, ..., Tensor w2_scale) -> Tensor
//                                                        x given in MXFP8 (e4m3 + e8m0 bytes)
//   quantize_mxfp8(Tensor x) -> (Tensor q, Tensor scale)            [..., K] along K, per 32
//   quantize_fp8_block128(Tensor w) -> (Tensor q, Tensor scale)     [..., N, K] in 128 x 128 blocks
// and, for decode under a CUDA graph (a layer made with max_tokens_per_rank > 0; forward-only):
//   moe_capturable(int layer, Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor num_tokens,
//       Tensor[] weights) -> Tensor   x [N, hidden], num_tokens a device int64 read at replay
//   moe_capturable_mxfp8_x(int layer, Tensor x, Tensor x_scale, Tensor topk_ids, Tensor topk_weights,
//       Tensor num_tokens, Tensor[] weights) -> Tensor   an MXFP8 layer's, x given in MXFP8
//   check_capturable(int layer, Tensor on_device) -> ()   raises a bad id / count a replay met
// with CPU kernels (and CUDA ones where the torch build has CUDA) over the torch-free core, and Meta
// kernels (shapes only). `layer` is a handle from register_layer: a plain integer, the same in
// every torch version. Every op on a layer is collective, like MoeLayer's calls: each rank calls it.
// The weights are bound per call (MoeLayer::bind_weights), so replaced Parameters are picked up.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <tuple>

#include "epmoe/communicator.h"
#include "epmoe/moe_layer.h"

namespace epmoe::torch_ext {

// The layer registry behind the ops' integer handles (thread-safe; a handle is never reused).
int64_t register_layer(std::shared_ptr<MoeLayer> layer);
std::shared_ptr<MoeLayer> layer_of(int64_t handle);  // throws Error(invalid_argument) if unknown
void release_layer(int64_t handle) noexcept;

// at::Tensor <-> TensorView (no copy; the tensor must be contiguous).
TensorView view_of(const at::Tensor& t);
// A uint8 tensor's bytes as E4M3 or E8M0 (torch 1.13 has no float8 dtypes), or a torch.float8_e4m3fn
// (torch >= 2.1) / torch.float8_e8m0fnu (torch >= 2.7) tensor as itself.
TensorView view_as(const at::Tensor& t, DType dtype);

// FP8 expert weights (epmoe/mxfp8.h, epmoe/fp8_block.h): w1, w2 E4M3 (view_as) in ExpertWeights'
// shapes; the scales E8M0 per 32 along K (MXFP8) or f32 per 128 x 128 block (block-128).
ExpertWeights fp8_weights_of(const at::Tensor& w1, const at::Tensor& w1_scale, const at::Tensor& w2,
                             const at::Tensor& w2_scale);
// An FP8 layer's forward (torch.ops.epmoe.moe_fp8): x bf16 [T, hidden], quantized by the layer; y bf16.
// Forward-only: raises Error(unsupported) where autograd would record the call (grad mode on and x
// or topk_weights requiring grad) instead of returning a y that silently cuts the graph.
at::Tensor moe_fp8(int64_t layer, const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                   const at::Tensor& w1, const at::Tensor& w1_scale, const at::Tensor& w2, const at::Tensor& w2_scale);
// An MXFP8 layer's forward on x given in the format (MoeLayer::forward_mxfp8): x uint8 E4M3
// [T, hidden], x_scale uint8 E8M0 [T, hidden / 32]; y bf16 [T, hidden].
at::Tensor moe_mxfp8_x(int64_t layer, const at::Tensor& x, const at::Tensor& x_scale, const at::Tensor& topk_ids,
                       const at::Tensor& topk_weights, const at::Tensor& w1, const at::Tensor& w1_scale,
                       const at::Tensor& w2, const at::Tensor& w2_scale);
// The host quantizers, on any tensor of a float dtype (computed on the CPU, returned on its device):
// MXFP8 along the last dimension (K % 32 == 0) -> q uint8 [..., K], scale uint8 [..., K / 32];
// block-128 weights [..., N, K] (N, K multiples of 128) -> q uint8, scale f32 [..., N / 128, K / 128].
std::tuple<at::Tensor, at::Tensor> quantize_mxfp8(const at::Tensor& x);
std::tuple<at::Tensor, at::Tensor> quantize_fp8_block128(const at::Tensor& w);

// The differentiable call (torch.ops.epmoe.moe): topk_ids int32 or int64, topk_weights any float
// dtype (computed in f32; its gradient comes back in its dtype).
at::Tensor moe(int64_t layer, const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
               const at::Tensor& w1, const at::Tensor& w2);

// The capturable forward (torch.ops.epmoe.moe_capturable; capturable_ops.cpp says what it takes):
// x [N, hidden], topk_ids int32, topk_weights f32, num_tokens a one-element int64 tensor on the GPU,
// weights {w1, w2} or {w1, w1_scale, w2, w2_scale}; y's rows past num_tokens are 0. Forward-only.
at::Tensor moe_capturable(int64_t layer, const at::Tensor& x, const at::Tensor& topk_ids,
                          const at::Tensor& topk_weights, const at::Tensor& num_tokens, at::TensorList weights);
at::Tensor moe_capturable_mxfp8_x(int64_t layer, const at::Tensor& x, const at::Tensor& x_scale,
                                  const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                                  const at::Tensor& num_tokens, at::TensorList weights);

// What the modules below share: the config, communicator and options, and the MoeLayer behind their
// ops, which follows the module's weights' device (built there on the first call and again after a
// move, both collective; on CUDA its memory from torch's caching allocator unless the options name an
// allocator). check_capturable waits for the current stream and raises the first bad id / count the
// capturable forwards met (LayerOptions::max_tokens_per_rank > 0).
class LayerModule : public torch::nn::Module {
 public:
  ~LayerModule() override;
  const MoeConfig& config() const { return cfg_; }
  const std::shared_ptr<Communicator>& comm() const { return comm_; }
  const LayerOptions& options() const { return options_; }
  int64_t handle() const { return handle_; }  // 0 until the first forward
  void check_capturable();

 protected:
  LayerModule(const MoeConfig& cfg, std::shared_ptr<Communicator> comm, LayerOptions options, const char* name);
  // The layer on w1's device: make(options) where there is none yet or w1 has moved.
  void ensure_layer(const at::Tensor& w1, const std::function<std::shared_ptr<MoeLayer>(const LayerOptions&)>& make);

 private:
  MoeConfig cfg_;
  std::shared_ptr<Communicator> comm_;
  LayerOptions options_;
  int64_t handle_ = 0;
  c10::Device layer_device_{c10::kCPU};
};

// The layer as a module: w1 [E_local, 2 ffn, hidden] and w2 [E_local, hidden, ffn] bf16 Parameters,
// initialised U(-1/sqrt(hidden), +) and U(-1/sqrt(ffn), +) (the fan-in bound of nn::Linear). The
// MoeLayer is built on the first forward, on the Parameters' device (collective: every rank's first
// forward), and again if they move to another device. With options.max_tokens_per_rank > 0 (CUDA),
// forward_capturable is the forward for decode under a CUDA graph (make the layer, i.e. call it, once
// before capturing).
class MoeImpl : public LayerModule {
 public:
  MoeImpl(const MoeConfig& cfg, std::shared_ptr<Communicator> comm, LayerOptions options = {});
  at::Tensor forward(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights);
  at::Tensor forward_capturable(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                                const at::Tensor& num_tokens);

  at::Tensor w1, w2;

 private:
  void ensure_layer();
};
TORCH_MODULE(Moe);

enum class Fp8Format { mxfp8, block128 };

// An FP8 layer for inference: w1, w1_scale, w2, w2_scale are buffers (fp8_weights_of's tensors), made
// from a bf16 Moe's current Parameters (quantized on the host, kept on their device) or given in
// the format. Like Moe, the MoeLayer is built on the first forward, on the buffers' device, and
// again if they move. forward_mxfp8 takes x already in MXFP8 (an MXFP8 module only). A copy from a
// Moe keeps its LayerOptions (max_tokens_per_rank included).
class MoeFp8Impl : public LayerModule {
 public:
  MoeFp8Impl(const MoeImpl& source, Fp8Format format);
  MoeFp8Impl(const MoeConfig& cfg, std::shared_ptr<Communicator> comm, at::Tensor w1, at::Tensor w1_scale,
             at::Tensor w2, at::Tensor w2_scale, LayerOptions options = {});
  at::Tensor forward(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights);
  at::Tensor forward_mxfp8(const at::Tensor& x, const at::Tensor& x_scale, const at::Tensor& topk_ids,
                           const at::Tensor& topk_weights);
  // As Moe's (options.max_tokens_per_rank > 0; x bf16, quantized on the device), and with x given
  // in MXFP8 as forward_mxfp8's (an MXFP8 module only).
  at::Tensor forward_capturable(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                                const at::Tensor& num_tokens);
  at::Tensor forward_capturable_mxfp8(const at::Tensor& x, const at::Tensor& x_scale, const at::Tensor& topk_ids,
                                      const at::Tensor& topk_weights, const at::Tensor& num_tokens);
  Fp8Format format() const { return w1_scale.scalar_type() == at::kFloat ? Fp8Format::block128 : Fp8Format::mxfp8; }

  at::Tensor w1, w1_scale, w2, w2_scale;

 private:
  void ensure_layer();
};
TORCH_MODULE(MoeFp8);

}  // namespace epmoe::torch_ext
