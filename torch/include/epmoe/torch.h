// epmoe from libtorch: the layer as torch ops with autograd, and a torch::nn::Module.
//
//   auto moe = epmoe::torch_ext::Moe(cfg, comm);         // w1, w2: Parameters of this rank's experts
//   at::Tensor y = moe->forward(x, topk_ids, topk_weights);  // x bf16 [T, hidden]
//   y.backward(dy);   // -> x.grad, topk_weights.grad (so the router's), w1.grad, w2.grad
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
// with CPU kernels (and CUDA ones where the torch build has CUDA) over the torch-free core, and Meta
// kernels (shapes only). `layer` is a handle from register_layer: a plain integer, the same in
// every torch version. Every op on a layer is collective, like MoeLayer's calls: each rank calls it.
// The weights are bound per call (MoeLayer::bind_weights), so replaced Parameters are picked up.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <memory>

#include "epmoe/communicator.h"
#include "epmoe/moe_layer.h"

namespace epmoe::torch_ext {

// The layer registry behind the ops' integer handles (thread-safe; a handle is never reused).
int64_t register_layer(std::shared_ptr<MoeLayer> layer);
std::shared_ptr<MoeLayer> layer_of(int64_t handle);  // throws Error(invalid_argument) if unknown
void release_layer(int64_t handle) noexcept;

// at::Tensor <-> TensorView (no copy; the tensor must be contiguous).
TensorView view_of(const at::Tensor& t);

// The differentiable call (torch.ops.epmoe.moe): topk_ids int32 or int64, topk_weights any float
// dtype (computed in f32; its gradient comes back in its dtype).
at::Tensor moe(int64_t layer, const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
               const at::Tensor& w1, const at::Tensor& w2);

// The layer as a module: w1 [E_local, 2 ffn, hidden] and w2 [E_local, hidden, ffn] bf16 Parameters,
// initialised U(-1/sqrt(hidden), +) and U(-1/sqrt(ffn), +) (the fan-in bound of nn::Linear). The
// MoeLayer is built on the first forward, on the Parameters' device (collective: every rank's first
// forward), and again if they move to another device.
class MoeImpl : public torch::nn::Module {
 public:
  MoeImpl(const MoeConfig& cfg, std::shared_ptr<Communicator> comm, LayerOptions options = {});
  ~MoeImpl() override;
  at::Tensor forward(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights);
  const MoeConfig& config() const { return cfg_; }
  int64_t handle() const { return handle_; }  // 0 until the first forward

  at::Tensor w1, w2;

 private:
  MoeConfig cfg_;
  std::shared_ptr<Communicator> comm_;
  LayerOptions options_;
  int64_t handle_ = 0;
  c10::Device layer_device_{c10::kCPU};
};
TORCH_MODULE(Moe);

}  // namespace epmoe::torch_ext
