// The C++ modules over the ops (include/epmoe/torch.h): Moe (bf16, autograd) and MoeFp8 (inference).
#include <cmath>
#include <functional>
#include <tuple>

#include "epmoe/error.h"
#include "epmoe/torch.h"
#include "registry.h"

namespace epmoe::torch_ext {

LayerModule::LayerModule(const MoeConfig& cfg, std::shared_ptr<Communicator> comm, LayerOptions options,
                         const char* name)
    : cfg_(cfg), comm_(std::move(comm)), options_(std::move(options)) {
  cfg_.validate();
  EPMOE_CHECK(comm_ != nullptr, ErrorCode::invalid_argument, "epmoe::torch_ext::", name, " needs a communicator");
}

LayerModule::~LayerModule() {
  if (handle_ != 0) release_layer(handle_);
}

void LayerModule::ensure_layer(const at::Tensor& w1,
                               const std::function<std::shared_ptr<MoeLayer>(const LayerOptions&)>& make) {
  if (handle_ != 0 && w1.device() == layer_device_) return;
  if (handle_ != 0) release_layer(handle_);
  handle_ = 0;
  LayerOptions opt = options_;
  if (w1.is_cuda() && !opt.device_allocator) opt.device_allocator = torch_device_allocator();
  handle_ = register_layer(make(opt));
  layer_device_ = w1.device();
}

void LayerModule::check_capturable() {
  if (handle_ != 0) layer_of(handle_)->check_capturable(stream_of(layer_device_));
}

MoeImpl::MoeImpl(const MoeConfig& cfg, std::shared_ptr<Communicator> comm, LayerOptions options)
    : LayerModule(cfg, std::move(comm), std::move(options), "Moe") {
  const int64_t El = config().experts_per_rank(), H = config().hidden, F = config().ffn;
  torch::NoGradGuard no_grad;
  const double b1 = 1.0 / std::sqrt(double(H)), b2 = 1.0 / std::sqrt(double(F));
  w1 = register_parameter("w1", torch::empty({El, 2 * F, H}).uniform_(-b1, b1).to(torch::kBFloat16));
  w2 = register_parameter("w2", torch::empty({El, H, F}).uniform_(-b2, b2).to(torch::kBFloat16));
}

void MoeImpl::ensure_layer() {
  LayerModule::ensure_layer(w1, [&](const LayerOptions& opt) {
    EPMOE_CHECK(w1.is_contiguous() && w2.is_contiguous(), ErrorCode::invalid_argument,
                "epmoe::torch_ext::Moe: w1 and w2 must be contiguous");
    return std::make_shared<MoeLayer>(config(), ExpertWeights{view_of(w1), view_of(w2)}, comm(), opt);
  });
}

at::Tensor MoeImpl::forward(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights) {
  ensure_layer();
  return moe(handle(), x, topk_ids, topk_weights, w1, w2);
}

at::Tensor MoeImpl::forward_capturable(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                                       const at::Tensor& num_tokens) {
  ensure_layer();
  return moe_capturable(handle(), x, topk_ids, topk_weights, num_tokens, {w1.detach(), w2.detach()});
}

// The FP8 module: buffers, not Parameters (forward-only).
MoeFp8Impl::MoeFp8Impl(const MoeImpl& source, Fp8Format format)
    : LayerModule(source.config(), source.comm(), source.options(), "MoeFp8") {
  torch::NoGradGuard no_grad;
  at::Tensor q1, s1, q2, s2;
  if (format == Fp8Format::mxfp8) {
    std::tie(q1, s1) = quantize_mxfp8(source.w1);
    std::tie(q2, s2) = quantize_mxfp8(source.w2);
  } else {
    std::tie(q1, s1) = quantize_fp8_block128(source.w1);
    std::tie(q2, s2) = quantize_fp8_block128(source.w2);
  }
  w1 = register_buffer("w1", q1), w1_scale = register_buffer("w1_scale", s1);
  w2 = register_buffer("w2", q2), w2_scale = register_buffer("w2_scale", s2);
}

MoeFp8Impl::MoeFp8Impl(const MoeConfig& cfg, std::shared_ptr<Communicator> comm, at::Tensor q1, at::Tensor s1,
                       at::Tensor q2, at::Tensor s2, LayerOptions options)
    : LayerModule(cfg, std::move(comm), std::move(options), "MoeFp8") {
  w1 = register_buffer("w1", q1), w1_scale = register_buffer("w1_scale", s1);
  w2 = register_buffer("w2", q2), w2_scale = register_buffer("w2_scale", s2);
}

void MoeFp8Impl::ensure_layer() {
  LayerModule::ensure_layer(w1, [&](const LayerOptions& opt) {
    return std::make_shared<MoeLayer>(config(), fp8_weights_of(w1, w1_scale, w2, w2_scale), comm(), opt);
  });
}

at::Tensor MoeFp8Impl::forward(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights) {
  ensure_layer();
  return moe_fp8(handle(), x, topk_ids, topk_weights, w1, w1_scale, w2, w2_scale);
}

at::Tensor MoeFp8Impl::forward_capturable(const at::Tensor& x, const at::Tensor& topk_ids,
                                          const at::Tensor& topk_weights, const at::Tensor& num_tokens) {
  ensure_layer();
  return moe_capturable(handle(), x, topk_ids, topk_weights, num_tokens, {w1, w1_scale, w2, w2_scale});
}

at::Tensor MoeFp8Impl::forward_capturable_mxfp8(const at::Tensor& x, const at::Tensor& x_scale,
                                                const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                                                const at::Tensor& num_tokens) {
  ensure_layer();
  return moe_capturable_mxfp8_x(handle(), x, x_scale, topk_ids, topk_weights, num_tokens,
                                {w1, w1_scale, w2, w2_scale});
}

at::Tensor MoeFp8Impl::forward_mxfp8(const at::Tensor& x, const at::Tensor& x_scale, const at::Tensor& topk_ids,
                                     const at::Tensor& topk_weights) {
  ensure_layer();
  return moe_mxfp8_x(handle(), x, x_scale, topk_ids, topk_weights, w1, w1_scale, w2, w2_scale);
}

}  // namespace epmoe::torch_ext
