// The C++ modules over the ops (include/epmoe/torch.h): Moe (bf16, autograd) and MoeFp8 (inference).
#include <cmath>
#include <functional>
#include <tuple>

#include "epmoe/error.h"
#include "epmoe/torch.h"
#include "registry.h"

namespace epmoe::torch_ext {

namespace {

// A module's MoeLayer follows its weights' device: built there on the first call and again after a
// move (both collective, as every rank's forward is), by make(options). On CUDA the layer's memory
// comes from torch's caching allocator, unless the options name an allocator of their own.
void keep_layer_on_weights(const at::Tensor& w1, LayerOptions options, int64_t& handle, c10::Device& device,
                           const std::function<std::shared_ptr<MoeLayer>(const LayerOptions&)>& make) {
  if (handle != 0 && w1.device() == device) return;
  if (handle != 0) release_layer(handle);
  handle = 0;
  if (w1.is_cuda() && !options.device_allocator) options.device_allocator = torch_device_allocator();
  handle = register_layer(make(options));
  device = w1.device();
}

}  // namespace

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

void MoeImpl::ensure_layer() {
  keep_layer_on_weights(w1, options_, handle_, layer_device_, [&](const LayerOptions& opt) {
    EPMOE_CHECK(w1.is_contiguous() && w2.is_contiguous(), ErrorCode::invalid_argument,
                "epmoe::torch_ext::Moe: w1 and w2 must be contiguous");
    return std::make_shared<MoeLayer>(cfg_, ExpertWeights{view_of(w1), view_of(w2)}, comm_, opt);
  });
}

at::Tensor MoeImpl::forward(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights) {
  ensure_layer();
  return moe(handle_, x, topk_ids, topk_weights, w1, w2);
}

at::Tensor MoeImpl::forward_capturable(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                                       const at::Tensor& num_tokens) {
  ensure_layer();
  return moe_capturable(handle_, x, topk_ids, topk_weights, num_tokens, {w1.detach(), w2.detach()});
}

void MoeImpl::check_capturable() {
  if (handle_ != 0) layer_of(handle_)->check_capturable(stream_of(w1));
}

// The FP8 module: buffers, not Parameters (forward-only).
MoeFp8Impl::MoeFp8Impl(const MoeImpl& source, Fp8Format format)
    : cfg_(source.config()), comm_(source.comm()), options_(source.options()) {
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
    : cfg_(cfg), comm_(std::move(comm)), options_(std::move(options)) {
  cfg_.validate();
  EPMOE_CHECK(comm_ != nullptr, ErrorCode::invalid_argument, "epmoe::torch_ext::MoeFp8 needs a communicator");
  w1 = register_buffer("w1", q1), w1_scale = register_buffer("w1_scale", s1);
  w2 = register_buffer("w2", q2), w2_scale = register_buffer("w2_scale", s2);
}

MoeFp8Impl::~MoeFp8Impl() {
  if (handle_ != 0) release_layer(handle_);
}

void MoeFp8Impl::ensure_layer() {
  keep_layer_on_weights(w1, options_, handle_, layer_device_, [&](const LayerOptions& opt) {
    return std::make_shared<MoeLayer>(cfg_, fp8_weights_of(w1, w1_scale, w2, w2_scale), comm_, opt);
  });
}

at::Tensor MoeFp8Impl::forward(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights) {
  ensure_layer();
  return moe_fp8(handle_, x, topk_ids, topk_weights, w1, w1_scale, w2, w2_scale);
}

at::Tensor MoeFp8Impl::forward_capturable(const at::Tensor& x, const at::Tensor& topk_ids,
                                          const at::Tensor& topk_weights, const at::Tensor& num_tokens) {
  ensure_layer();
  return moe_capturable(handle_, x, topk_ids, topk_weights, num_tokens, {w1, w1_scale, w2, w2_scale});
}

void MoeFp8Impl::check_capturable() {
  if (handle_ != 0) layer_of(handle_)->check_capturable(stream_of(w1));
}

at::Tensor MoeFp8Impl::forward_mxfp8(const at::Tensor& x, const at::Tensor& x_scale, const at::Tensor& topk_ids,
                                     const at::Tensor& topk_weights) {
  ensure_layer();
  return moe_mxfp8_x(handle_, x, x_scale, topk_ids, topk_weights, w1, w1_scale, w2, w2_scale);
}

}  // namespace epmoe::torch_ext
