// The FP8 inference ops (include/epmoe/torch.h): an MXFP8 or block-128 layer's forward on bf16 x or
// on x given in MXFP8, and the host quantizers that make such weights. E4M3 and E8M0 travel as uint8
// tensors: torch 1.13 (Debian's, CI's) has no float8 dtypes, and the bytes are the format either way;
// where torch has them, torch.float8_e4m3fn (2.1) and torch.float8_e8m0fnu (2.7) tensors pass too.
#include <torch/library.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <climits>
#include <vector>

#include "epmoe/error.h"
#include "epmoe/fp8_block.h"
#include "epmoe/mxfp8.h"
#include "epmoe/torch.h"
#include "registry.h"

namespace epmoe::torch_ext {

namespace {

// y bf16 [T, hidden of the layer], on x's device.
at::Tensor output_for(const at::Tensor& x, const MoeLayer& L) {
  EPMOE_CHECK(x.dim() == 2, ErrorCode::invalid_argument, "epmoe FP8 ops: x must be [T, hidden], got ", x.dim(),
              " dimensions");
  return at::empty({x.size(0), int64_t(L.config().hidden)}, x.options().dtype(at::kBFloat16));
}

at::Tensor moe_fp8_impl(int64_t layer, const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                        const at::Tensor& w1, const at::Tensor& w1_scale, const at::Tensor& w2,
                        const at::Tensor& w2_scale) {
  const std::shared_ptr<MoeLayer> L = layer_of(layer);
  const at::Tensor xc = x.contiguous(), ids = topk_ids.to(at::kInt).contiguous(),
                   wts = topk_weights.to(at::kFloat).contiguous();
  L->bind_weights(fp8_weights_of(w1, w1_scale, w2, w2_scale));
  at::Tensor y = output_for(xc, *L);
  L->forward(view_of(xc), view_of(ids), view_of(wts), view_of(y), stream_of(xc), nullptr);
  return y;
}

at::Tensor moe_mxfp8_x_impl(int64_t layer, const at::Tensor& x, const at::Tensor& x_scale, const at::Tensor& topk_ids,
                            const at::Tensor& topk_weights, const at::Tensor& w1, const at::Tensor& w1_scale,
                            const at::Tensor& w2, const at::Tensor& w2_scale) {
  const std::shared_ptr<MoeLayer> L = layer_of(layer);
  const at::Tensor xc = x.contiguous(), xs = x_scale.contiguous(), ids = topk_ids.to(at::kInt).contiguous(),
                   wts = topk_weights.to(at::kFloat).contiguous();
  L->bind_weights(fp8_weights_of(w1, w1_scale, w2, w2_scale));
  at::Tensor y = output_for(xc, *L);
  L->forward_mxfp8(view_as(xc, DType::e4m3), view_as(xs, DType::e8m0), view_of(ids), view_of(wts), view_of(y),
                   stream_of(xc));
  return y;
}

// Meta kernels: y bf16 [T, hidden] (x's own columns: hidden for both forms).
at::Tensor moe_fp8_meta(int64_t, const at::Tensor& x, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  return at::empty_like(x, x.options().dtype(at::kBFloat16));
}
at::Tensor moe_mxfp8_x_meta(int64_t, const at::Tensor& x, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  return at::empty_like(x, x.options().dtype(at::kBFloat16));
}

at::Tensor moe_fp8_autograd(int64_t layer, const at::Tensor& x, const at::Tensor& topk_ids,
                            const at::Tensor& topk_weights, const at::Tensor& w1, const at::Tensor& w1_scale,
                            const at::Tensor& w2, const at::Tensor& w2_scale) {
  refuse_recorded_call("epmoe FP8 layers are", {x, topk_weights});
  at::AutoDispatchBelowADInplaceOrView below;
  return moe_fp8(layer, x, topk_ids, topk_weights, w1, w1_scale, w2, w2_scale);
}
at::Tensor moe_mxfp8_x_autograd(int64_t layer, const at::Tensor& x, const at::Tensor& x_scale,
                                const at::Tensor& topk_ids, const at::Tensor& topk_weights, const at::Tensor& w1,
                                const at::Tensor& w1_scale, const at::Tensor& w2, const at::Tensor& w2_scale) {
  refuse_recorded_call("epmoe FP8 layers are", {x, topk_weights});
  at::AutoDispatchBelowADInplaceOrView below;
  return moe_mxfp8_x(layer, x, x_scale, topk_ids, topk_weights, w1, w1_scale, w2, w2_scale);
}

// torch's own dtype for E4M3 / E8M0 where this torch has it (2.1 / 2.7), else uint8 (bytes only).
at::ScalarType float8_type(DType d) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
  if (d == DType::e4m3) return c10::ScalarType::Float8_e4m3fn;
#endif
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 7)
  if (d == DType::e8m0) return c10::ScalarType::Float8_e8m0fnu;
#endif
  (void)d;
  return at::kByte;
}

// The input as fp32 rows on the host, and its last dimension.
at::Tensor host_f32(const at::Tensor& x, const char* what, int64_t* K) {
  EPMOE_CHECK(x.dim() >= 1 && c10::isFloatingType(x.scalar_type()), ErrorCode::invalid_argument, what,
              ": a floating-point tensor of at least one dimension, got ", x.scalar_type(), " with ", x.dim());
  *K = x.size(-1);
  EPMOE_CHECK(*K > 0 && *K <= INT_MAX, ErrorCode::invalid_argument, what, ": last dimension ", *K);
  return x.to(at::kCPU).to(at::kFloat).contiguous();  // (bf16 -> fp32 is exact)
}

}  // namespace

TensorView view_as(const at::Tensor& t, DType dtype) {
  const bool bytes = t.scalar_type() == at::kByte;
  EPMOE_CHECK(bytes || t.scalar_type() == float8_type(dtype), ErrorCode::invalid_argument, "epmoe FP8 ops: ",
              dtype_name(dtype), " data must be a uint8 tensor of its bytes (or, where this torch has it, ",
              dtype == DType::e4m3 ? "torch.float8_e4m3fn" : "torch.float8_e8m0fnu", "), got ", t.scalar_type());
  TensorView v = view_of(t);
  v.dtype = dtype;
  return v;
}

ExpertWeights fp8_weights_of(const at::Tensor& w1, const at::Tensor& w1_scale, const at::Tensor& w2,
                             const at::Tensor& w2_scale) {
  EPMOE_CHECK(w1.is_contiguous() && w2.is_contiguous() && w1_scale.is_contiguous() && w2_scale.is_contiguous(),
              ErrorCode::invalid_argument, "epmoe FP8 ops: w1, w2 and their scales must be contiguous");
  // f32 scales are the block-128 layout, uint8 ones MXFP8's E8M0; the layer checks that both agree
  // with the format it was built with.
  auto scale = [](const at::Tensor& s) { return s.scalar_type() == at::kFloat ? view_of(s) : view_as(s, DType::e8m0); };
  return {view_as(w1, DType::e4m3), view_as(w2, DType::e4m3), scale(w1_scale), scale(w2_scale)};
}

at::Tensor moe_fp8(int64_t layer, const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                   const at::Tensor& w1, const at::Tensor& w1_scale, const at::Tensor& w2, const at::Tensor& w2_scale) {
  static const auto m = op("epmoe::moe_fp8")
                            .typed<at::Tensor(int64_t, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                              const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                              const at::Tensor&)>();
  return m.call(layer, x, topk_ids, topk_weights, w1, w1_scale, w2, w2_scale);
}

at::Tensor moe_mxfp8_x(int64_t layer, const at::Tensor& x, const at::Tensor& x_scale, const at::Tensor& topk_ids,
                       const at::Tensor& topk_weights, const at::Tensor& w1, const at::Tensor& w1_scale,
                       const at::Tensor& w2, const at::Tensor& w2_scale) {
  static const auto m = op("epmoe::moe_mxfp8_x")
                            .typed<at::Tensor(int64_t, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                              const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                              const at::Tensor&, const at::Tensor&)>();
  return m.call(layer, x, x_scale, topk_ids, topk_weights, w1, w1_scale, w2, w2_scale);
}

std::tuple<at::Tensor, at::Tensor> quantize_mxfp8(const at::Tensor& x) {
  int64_t K = 0;
  const at::Tensor xf = host_f32(x, "quantize_mxfp8", &K);
  EPMOE_CHECK(K % mx::kBlock == 0, ErrorCode::invalid_argument, "quantize_mxfp8: the last dimension (", K,
              ") must be a multiple of ", mx::kBlock);
  std::vector<int64_t> sshape(x.sizes().begin(), x.sizes().end());
  sshape.back() = K / mx::kBlock;
  at::Tensor q = at::empty(x.sizes(), at::kByte), s = at::empty(sshape, at::kByte);
  mx::quantize_rows(xf.data_ptr<float>(), xf.numel() / K, int(K), q.data_ptr<uint8_t>(), s.data_ptr<uint8_t>());
  return {q.to(x.device()), s.to(x.device())};
}

std::tuple<at::Tensor, at::Tensor> quantize_fp8_block128(const at::Tensor& w) {
  int64_t K = 0;
  const at::Tensor wf = host_f32(w, "quantize_fp8_block128", &K);
  EPMOE_CHECK(w.dim() >= 2 && w.size(-2) % fp8b::kBlock == 0 && K % fp8b::kBlock == 0, ErrorCode::invalid_argument,
              "quantize_fp8_block128: a weight [..., N, K] with N and K multiples of ", fp8b::kBlock, ", got ",
              w.sizes());
  const int64_t N = w.size(-2), mats = N > 0 ? wf.numel() / (N * K) : 0;
  std::vector<int64_t> sshape(w.sizes().begin(), w.sizes().end());
  sshape[sshape.size() - 2] = N / fp8b::kBlock;
  sshape.back() = K / fp8b::kBlock;
  at::Tensor q = at::empty(w.sizes(), at::kByte), s = at::empty(sshape, at::kFloat);
  const int64_t sblocks = (N / fp8b::kBlock) * (K / fp8b::kBlock);
  for (int64_t i = 0; i < mats; ++i)
    fp8b::quantize_weight(wf.data_ptr<float>() + i * N * K, N, int(K), q.data_ptr<uint8_t>() + i * N * K,
                          s.data_ptr<float>() + i * sblocks);
  return {q.to(w.device()), s.to(w.device())};
}

void refuse_recorded_call(const char* who, at::TensorList inputs) {
  bool grad = false;
  for (const at::Tensor& t : inputs) grad = grad || t.requires_grad();
  EPMOE_CHECK(!(at::GradMode::is_enabled() && grad), ErrorCode::unsupported, who,
              " forward-only: run under torch.no_grad() / torch::NoGradGuard, or on inputs that do not require grad");
}

TORCH_LIBRARY_FRAGMENT(epmoe, m) {
  m.def("moe_fp8(int layer, Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w1, Tensor w1_scale, Tensor w2, "
        "Tensor w2_scale) -> Tensor");
  m.def("moe_mxfp8_x(int layer, Tensor x, Tensor x_scale, Tensor topk_ids, Tensor topk_weights, Tensor w1, "
        "Tensor w1_scale, Tensor w2, Tensor w2_scale) -> Tensor");
  // (catch-all kernels: host work for a tensor on any device)
  m.def("quantize_mxfp8(Tensor x) -> (Tensor, Tensor)", quantize_mxfp8);
  m.def("quantize_fp8_block128(Tensor w) -> (Tensor, Tensor)", quantize_fp8_block128);
}

TORCH_LIBRARY_IMPL(epmoe, CPU, m) {
  m.impl("moe_fp8", moe_fp8_impl);
  m.impl("moe_mxfp8_x", moe_mxfp8_x_impl);
}
#if EPMOE_TORCH_CUDA
TORCH_LIBRARY_IMPL(epmoe, CUDA, m) {
  m.impl("moe_fp8", moe_fp8_impl);
  m.impl("moe_mxfp8_x", moe_mxfp8_x_impl);
}
#endif
TORCH_LIBRARY_IMPL(epmoe, Meta, m) {
  m.impl("moe_fp8", moe_fp8_meta);
  m.impl("moe_mxfp8_x", moe_mxfp8_x_meta);
}
TORCH_LIBRARY_IMPL(epmoe, Autograd, m) {
  m.impl("moe_fp8", moe_fp8_autograd);
  m.impl("moe_mxfp8_x", moe_mxfp8_x_autograd);
}

}  // namespace epmoe::torch_ext
