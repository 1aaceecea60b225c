// Internal: the torch bindings' handle registries (thread-safe; a handle is never reused), and the
// device allocator their CUDA layers use.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "epmoe/device_allocator.h"
#include "epmoe/error.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace epmoe::torch_ext {

// A registered epmoe op by its name ("epmoe::moe"), for typed calls through the dispatcher (ops.cpp).
c10::OperatorHandle op(const char* name);

// The current CUDA stream of a CUDA tensor's device (the stream the ops order their work on);
// nullptr for a CPU tensor (ops.cpp).
void* stream_of(const at::Tensor& t);
void* stream_of(const c10::Device& device);

// LayerOptions::device_allocator for layers on CUDA tensors: torch's caching allocator (ops.cpp),
// shared by every layer; null in a build whose torch has no CUDA.
std::shared_ptr<DeviceAllocator> torch_device_allocator();

// On the Autograd key of a forward-only op (the FP8 layers, the capturable forward): raises
// Error(unsupported) "<who> forward-only" where autograd would record the call (grad mode on and one of
// `inputs` requiring grad), rather than returning a y without a grad_fn that silently cuts
// the graph (fp8_ops.cpp). (Local: a rank whose inputs require grad while others' do not fails
// alone, and the others meet the communicator's deadline.)
void refuse_recorded_call(const char* who, at::TensorList inputs);

template <class T>
class Registry {
 public:
  int64_t add(std::shared_ptr<T> v) {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t id = ++next_;
    items_[id] = std::move(v);
    return id;
  }
  std::shared_ptr<T> get(int64_t id, const char* what) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = items_.find(id);
    EPMOE_CHECK(it != items_.end(), ErrorCode::invalid_argument, "epmoe torch ops: no ", what, " with handle ", id,
                " (released, or never made)");
    return it->second;
  }
  void remove(int64_t id) noexcept {
    std::shared_ptr<T> keep;  // destroyed outside the lock
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = items_.find(id);
    if (it == items_.end()) return;
    keep = std::move(it->second);
    items_.erase(it);
  }

 private:
  std::mutex mu_;
  int64_t next_ = 0;
  std::unordered_map<int64_t, std::shared_ptr<T>> items_;
};

}  // namespace epmoe::torch_ext
