// The C++ module over the ops (include/epmoe/torch.h).
#include <cmath>

#include "epmoe/error.h"
#include "epmoe/torch.h"
#include "registry.h"

namespace epmoe::torch_ext {

MoeImpl::MoeImpl(const MoeConfig& cfg, std::shared_ptr<Communicator> comm, LayerOptions options)
    : cfg_(cfg), comm_(std::move(comm)), options_(std::move(options)) {
  cfg_.validate();
  EPMOE_CHECK(comm_ != nullptr, ErrorCode::invalid_argument, "epmoe::torch_ext::Moe needs a communicator");
  const int64_t El = cfg_.experts_per_rank(), H = cfg_.hidden, F = cfg_.ffn;
  torch::NoGradGuard no_grad;
  const double b1 = 1.0 / std::sqrt(double(H)), b2 = 1.0 / std::sqrt(double(F));
  w1 = register_parameter("w1", torch::empty({El, 2 * F, H}).uniform_(-b1, b1).to(torch::kBFloat16));
  w2 = register_parameter("w2", torch::empty({El, H, F}).uniform_(-b2, b2).to(torch::kBFloat16));
}

MoeImpl::~MoeImpl() {
  if (handle_ != 0) release_layer(handle_);
}

at::Tensor MoeImpl::forward(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights) {
  // The MoeLayer follows the Parameters' device (built there on the first call, and again after a
  // move; both collective, as every rank's forward is).
  if (handle_ == 0 || w1.device() != layer_device_) {
    if (handle_ != 0) release_layer(handle_);
    handle_ = 0;
    EPMOE_CHECK(w1.is_contiguous() && w2.is_contiguous(), ErrorCode::invalid_argument,
                "epmoe::torch_ext::Moe: w1 and w2 must be contiguous");
    // On CUDA the layer's memory comes from torch's caching allocator, unless the options name an
    // allocator of their own.
    LayerOptions opt = options_;
    if (w1.is_cuda() && !opt.device_allocator) opt.device_allocator = torch_device_allocator();
    auto layer = std::make_shared<MoeLayer>(cfg_, ExpertWeights{view_of(w1), view_of(w2)}, comm_, opt);
    handle_ = register_layer(std::move(layer));
    layer_device_ = w1.device();
  }
  return moe(handle_, x, topk_ids, topk_weights, w1, w2);
}

}  // namespace epmoe::torch_ext
