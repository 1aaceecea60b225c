// The epmoe torch ops (include/epmoe/torch.h): registries, the CPU / CUDA / Meta kernels over the
// torch-free core, autograd on the Autograd key, and the device allocator CUDA layers get their
// memory from (torch's caching allocator).
#include <torch/library.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <mutex>
#include <unordered_map>

#include "epmoe/error.h"
#include "epmoe/torch.h"
#include "registry.h"

#if EPMOE_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace epmoe::torch_ext {

namespace {

#if EPMOE_TORCH_CUDA
// LayerOptions::device_allocator over torch's caching allocator (the contract: epmoe/
// device_allocator.h). The layer's workspaces and saved contexts become torch blocks: counted by
// torch.cuda.memory_allocated / max_memory_allocated, and once freed reused for torch's own
// tensors instead of sitting in a pool of the layer's.
//
// A torch block belongs to the stream it was allocated on; freed, it is reused in that stream's
// order. The layer may give a block back on another stream (a context saved on the forward's
// stream, last used by a backward on another). Then recordStream marks the block as used there:
// torch records an event on that stream when the block is freed and hands it out again only once
// the event has completed (torch's own rule for a tensor used on several streams). (An event that
// the allocation stream waits on before the free would be correct too, but would hold that
// stream's later work behind the other stream, and needs the allocation stream still alive.)
class TorchCachingAllocator final : public DeviceAllocator {
 public:
  void* allocate(size_t bytes, int device, void* stream) override {
    const auto dev = static_cast<c10::DeviceIndex>(device);
    // torch allocates for the current stream: make it `stream` (and the device current) meanwhile.
    const c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream), dev));
    c10::DataPtr block = c10::cuda::CUDACachingAllocator::get()->allocate(bytes);  // (throws when out of memory)
    void* p = block.get();
    if (p == nullptr) return nullptr;
    std::lock_guard<std::mutex> lock(mu_);
    blocks_.emplace(p, Block{std::move(block), stream});
    return p;
  }
  void deallocate(void* p, size_t, int device, void* stream) override {
    Block b;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const auto it = blocks_.find(p);
      if (it == blocks_.end()) return;  // not one of ours (the layer never does this)
      b = std::move(it->second);
      blocks_.erase(it);
    }
    if (stream != b.stream)
      c10::cuda::CUDACachingAllocator::recordStream(
          b.data, c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream), static_cast<c10::DeviceIndex>(device)));
  }  // b.data frees the block here, outside the lock

 private:
  struct Block {
    c10::DataPtr data;
    void* stream = nullptr;  // the stream it was allocated on
  };
  std::mutex mu_;
  std::unordered_map<void*, Block> blocks_;
};
#endif

Registry<MoeLayer>& layers() {
  static Registry<MoeLayer> r;
  return r;
}
Registry<MoeForwardContext>& contexts() {
  static Registry<MoeForwardContext> r;
  return r;
}

// What the autograd node keeps of its forward: the saved context, released with the node.
struct ContextRef : torch::CustomClassHolder {
  explicit ContextRef(int64_t id) : id(id) {}
  ~ContextRef() override { contexts().remove(id); }
  int64_t id;
};

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return DType::bf16;
    case at::kFloat: return DType::f32;
    case at::kInt: return DType::i32;
    case at::kByte: return DType::u8;  // E4M3 / E8M0 bytes: view_as names which
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
    case c10::ScalarType::Float8_e4m3fn: return DType::e4m3;  // (torch >= 2.1)
#endif
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 7)
    case c10::ScalarType::Float8_e8m0fnu: return DType::e8m0;  // (torch >= 2.7)
#endif
    default: EPMOE_FAIL(ErrorCode::invalid_argument, "epmoe torch ops: unsupported dtype ", t.scalar_type());
  }
}

ExpertWeights weights_of(const at::Tensor& w1, const at::Tensor& w2) {
  EPMOE_CHECK(w1.is_contiguous() && w2.is_contiguous(), ErrorCode::invalid_argument,
              "epmoe torch ops: w1 and w2 must be contiguous");
  return {view_of(w1), view_of(w2)};
}

std::tuple<at::Tensor, int64_t> forward_impl(int64_t layer, const at::Tensor& x, const at::Tensor& topk_ids,
                                             const at::Tensor& topk_weights, const at::Tensor& w1,
                                             const at::Tensor& w2, bool save) {
  const std::shared_ptr<MoeLayer> L = layer_of(layer);
  const at::Tensor xc = x.contiguous(), ids = topk_ids.to(at::kInt).contiguous(),
                   wts = topk_weights.to(at::kFloat).contiguous();
  L->bind_weights(weights_of(w1, w2));
  at::Tensor y = at::empty_like(xc);
  auto ctx = save ? std::make_shared<MoeForwardContext>() : nullptr;
  L->forward(view_of(xc), view_of(ids), view_of(wts), view_of(y), stream_of(xc), ctx.get());
  return {y, save ? contexts().add(std::move(ctx)) : int64_t(0)};
}

// backward on the saved forward `ctx_id`; the weight gradients go to dw1 / dw2 (accumulate: added).
std::tuple<at::Tensor, at::Tensor> run_backward(int64_t layer, int64_t ctx_id, const at::Tensor& dy,
                                                const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& dw1,
                                                const at::Tensor& dw2, bool accumulate) {
  const std::shared_ptr<MoeLayer> L = layer_of(layer);
  const std::shared_ptr<MoeForwardContext> ctx = contexts().get(ctx_id, "saved forward");
  const at::Tensor dyc = dy.to(at::kBFloat16).contiguous();
  EPMOE_CHECK(dw1.is_contiguous() && dw2.is_contiguous(), ErrorCode::invalid_argument,
              "epmoe torch ops: dw1 and dw2 must be contiguous");
  L->bind_weights(weights_of(w1, w2));
  at::Tensor dx = at::empty_like(dyc);
  at::Tensor dtw = at::empty({dyc.size(0), L->config().top_k}, dyc.options().dtype(at::kFloat));
  L->backward(*ctx, view_of(dyc), view_of(dx), view_of(dtw), ExpertGradients{view_of(dw1), view_of(dw2), accumulate},
              stream_of(dyc));
  return {dx, dtw};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_impl(int64_t layer, int64_t ctx_id,
                                                                         const at::Tensor& dy, const at::Tensor& w1,
                                                                         const at::Tensor& w2) {
  at::Tensor dw1 = at::empty_like(w1), dw2 = at::empty_like(w2);
  auto [dx, dtw] = run_backward(layer, ctx_id, dy, w1, w2, dw1, dw2, /*accumulate=*/false);
  return {dx, dtw, dw1, dw2};
}

// dw1 / dw2 += the weight gradients (f32 or bf16 tensors of w1's / w2's shapes, e.g. fp32 main
// grads); returns dx and d_topk_weights.
std::tuple<at::Tensor, at::Tensor> backward_accumulate_impl(int64_t layer, int64_t ctx_id, const at::Tensor& dy,
                                                            const at::Tensor& w1, const at::Tensor& w2,
                                                            at::Tensor& dw1, at::Tensor& dw2) {
  return run_backward(layer, ctx_id, dy, w1, w2, dw1, dw2, /*accumulate=*/true);
}
// Meta kernels: shapes and dtypes only (no collective runs). Sizes are SymInts, so they also trace
// under torch.compile's dynamic shapes. d_topk_weights is [T, top_k] of the layer (a backward's
// layer exists, also while torch.compile traces it).
at::Tensor dtw_meta(int64_t layer, const at::Tensor& dy) {
  return at::empty_symint({dy.sym_size(0), c10::SymInt(layer_of(layer)->config().top_k)},
                          dy.options().dtype(at::kFloat));
}
std::tuple<at::Tensor, at::Tensor> backward_accumulate_meta(int64_t layer, int64_t, const at::Tensor& dy,
                                                            const at::Tensor&, const at::Tensor&, at::Tensor&,
                                                            at::Tensor&) {
  return {at::empty_like(dy), dtw_meta(layer, dy)};
}

at::Tensor moe_plain(int64_t layer, const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                     const at::Tensor& w1, const at::Tensor& w2) {
  return std::get<0>(forward_impl(layer, x, topk_ids, topk_weights, w1, w2, false));
}

std::tuple<at::Tensor, int64_t> forward_meta(int64_t, const at::Tensor& x, const at::Tensor&, const at::Tensor&,
                                             const at::Tensor&, const at::Tensor&, bool) {
  return {at::empty_like(x), int64_t(0)};
}
at::Tensor moe_meta(int64_t, const at::Tensor& x, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    const at::Tensor&) {
  return at::empty_like(x);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_meta(int64_t layer, int64_t, const at::Tensor& dy,
                                                                         const at::Tensor& w1, const at::Tensor& w2) {
  return {at::empty_like(dy), dtw_meta(layer, dy), at::empty_like(w1), at::empty_like(w2)};
}

class MoeFunction : public torch::autograd::Function<MoeFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, int64_t layer, const at::Tensor& x,
                            const at::Tensor& topk_ids, const at::Tensor& topk_weights, const at::Tensor& w1,
                            const at::Tensor& w2, bool save) {
    at::AutoDispatchBelowADInplaceOrView below;
    static const auto fwd =
        op("epmoe::moe_forward").typed<std::tuple<at::Tensor, int64_t>(int64_t, const at::Tensor&, const at::Tensor&,
                                                                       const at::Tensor&, const at::Tensor&,
                                                                       const at::Tensor&, bool)>();
    auto [y, id] = fwd.call(layer, x, topk_ids, topk_weights, w1, w2, save);
    if (!save) return y;  // autograd records no node for this call: no backward will come
    ctx->saved_data["layer"] = layer;
    ctx->saved_data["ctx"] = c10::make_intrusive<ContextRef>(id);
    ctx->saved_data["wts_dtype"] = int64_t(topk_weights.scalar_type());
    ctx->saved_data["T"] = x.sym_size(0);  // (a SymInt: symbolic while torch.compile traces)
    ctx->save_for_backward({w1, w2});
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static const auto bwd =
        op("epmoe::moe_backward")
            .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(int64_t, int64_t, const at::Tensor&,
                                                                               const at::Tensor&, const at::Tensor&)>();
    const auto saved = ctx->get_saved_variables();
    const int64_t layer = ctx->saved_data["layer"].toInt();
    const int64_t id = ctx->saved_data["ctx"].toCustomClass<ContextRef>()->id;
    // No gradient from above: dy = 0 (the collective must still run on every rank).
    const at::Tensor dy =
        grads[0].defined()
            ? grads[0]
            : at::zeros_symint({ctx->saved_data["T"].toSymInt(), saved[0].sym_size(2)}, saved[0].options());
    auto [dx, dtw, dw1, dw2] = bwd.call(layer, id, dy, saved[0], saved[1]);
    const auto wts_dtype = static_cast<at::ScalarType>(ctx->saved_data["wts_dtype"].toInt());
    return {at::Tensor(), dx, at::Tensor(), dtw.to(wts_dtype), dw1, dw2, at::Tensor()};
  }
};

at::Tensor moe_autograd(int64_t layer, const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                        const at::Tensor& w1, const at::Tensor& w2) {
  // Save for backward only where autograd records the call (Function::apply's own test): an
  // inference forward then keeps nothing (no copies of rows and h, no context to release), and
  // torch.compile traces it as a forward without state.
  const bool save = at::GradMode::is_enabled() &&
                    (x.requires_grad() || topk_weights.requires_grad() || w1.requires_grad() || w2.requires_grad());
  return MoeFunction::apply(layer, x, topk_ids, topk_weights, w1, w2, save);
}

void release_context_op(int64_t id) { contexts().remove(id); }

}  // namespace

c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

void* stream_of(const at::Tensor& t) { return stream_of(t.device()); }

void* stream_of(const c10::Device& device) {
  if (!device.is_cuda()) return nullptr;
#if EPMOE_TORCH_CUDA
  return c10::cuda::getCurrentCUDAStream(device.index()).stream();
#else
  EPMOE_FAIL(ErrorCode::unsupported, "epmoe torch ops: a CUDA tensor, but these bindings were built against a "
             "torch without CUDA");
#endif
}

int64_t register_layer(std::shared_ptr<MoeLayer> layer) {
  EPMOE_CHECK(layer != nullptr, ErrorCode::invalid_argument, "register_layer: null layer");
  return layers().add(std::move(layer));
}
std::shared_ptr<MoeLayer> layer_of(int64_t handle) { return layers().get(handle, "layer"); }
void release_layer(int64_t handle) noexcept { layers().remove(handle); }

std::shared_ptr<DeviceAllocator> torch_device_allocator() {
#if EPMOE_TORCH_CUDA
  // One for every layer (it holds no state beyond the blocks it lent); the layers and contexts
  // holding it keep it alive past this static's own destruction at exit.
  static const std::shared_ptr<DeviceAllocator> a = std::make_shared<TorchCachingAllocator>();
  return a;
#else
  return nullptr;
#endif
}

TensorView view_of(const at::Tensor& t) {
  EPMOE_CHECK(t.is_contiguous(), ErrorCode::invalid_argument, "epmoe torch ops: a non-contiguous tensor");
  std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
  TensorView v;
  v.data = t.data_ptr();
  v.dtype = dtype_of(t);
  v.ndim = int(shape.size());
  EPMOE_CHECK(v.ndim <= TensorView::kMaxDims, ErrorCode::invalid_argument, "epmoe torch ops: rank ", v.ndim);
  for (int i = 0; i < v.ndim; ++i) {
    v.shape[size_t(i)] = shape[size_t(i)];
    v.stride[size_t(i)] = t.stride(i);
  }
  v.device = t.is_cuda() ? DeviceType::cuda : DeviceType::cpu;
  v.device_index = t.is_cuda() ? t.device().index() : 0;
  EPMOE_CHECK(t.is_cpu() || t.is_cuda(), ErrorCode::invalid_argument, "epmoe torch ops: a tensor on ", t.device());
  return v;
}

at::Tensor moe(int64_t layer, const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
               const at::Tensor& w1, const at::Tensor& w2) {
  static const auto m = op("epmoe::moe").typed<at::Tensor(int64_t, const at::Tensor&, const at::Tensor&,
                                                          const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  return m.call(layer, x, topk_ids, topk_weights, w1, w2);
}

TORCH_LIBRARY(epmoe, m) {
  m.class_<ContextRef>("ContextRef");
  m.def("moe(int layer, Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w1, Tensor w2) -> Tensor");
  m.def("moe_forward(int layer, Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w1, Tensor w2, bool save) "
        "-> (Tensor, int)");
  m.def("moe_backward(int layer, int ctx, Tensor dy, Tensor w1, Tensor w2) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("moe_backward_accumulate(int layer, int ctx, Tensor dy, Tensor w1, Tensor w2, Tensor(a!) dw1, "
        "Tensor(b!) dw2) -> (Tensor, Tensor)");
  m.def("release_context(int ctx) -> ()", release_context_op);
}

TORCH_LIBRARY_IMPL(epmoe, CPU, m) {
  m.impl("moe", moe_plain);
  m.impl("moe_forward", forward_impl);
  m.impl("moe_backward", backward_impl);
  m.impl("moe_backward_accumulate", backward_accumulate_impl);
}
#if EPMOE_TORCH_CUDA
TORCH_LIBRARY_IMPL(epmoe, CUDA, m) {
  m.impl("moe", moe_plain);
  m.impl("moe_forward", forward_impl);
  m.impl("moe_backward", backward_impl);
  m.impl("moe_backward_accumulate", backward_accumulate_impl);
}
#endif
TORCH_LIBRARY_IMPL(epmoe, Meta, m) {
  m.impl("moe", moe_meta);
  m.impl("moe_forward", forward_meta);
  m.impl("moe_backward", backward_meta);
  m.impl("moe_backward_accumulate", backward_accumulate_meta);
}
TORCH_LIBRARY_IMPL(epmoe, Autograd, m) { m.impl("moe", moe_autograd); }

}  // namespace epmoe::torch_ext
