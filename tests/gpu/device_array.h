// Test helpers for the GPU suites: checked CUDA calls, a device probe, and a poisoned device array.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "epmoe/tensor_view.h"

namespace epmoe::test {

inline void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

inline int current_device() {
  int dev = 0;
  ck(cudaGetDevice(&dev), "cudaGetDevice");
  return dev;
}
// A contiguous view of device memory on the current device.
inline TensorView dview(const void* p, DType t, std::initializer_list<int64_t> shape) {
  return TensorView::contiguous(const_cast<void*>(p), t, shape, DeviceType::cuda, current_device());
}

// False (with the reason) when no CUDA device can be used: the suites then skip, saying why.
inline bool cuda_available(std::string& why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    why = std::string("no usable CUDA device (cudaGetDeviceCount: ") + cudaGetErrorString(e) + ")";
    return false;
  }
  if (n == 0) {
    why = "no CUDA device";
    return false;
  }
  return true;
}

// A device array of T, filled with `poison` bytes so unwritten outputs show up in comparisons.
// Every fill and upload is waited for: cudaMemset, and cudaMemcpy from pageable memory, return
// before the device has the bytes, on the legacy stream, which the tests' non-blocking streams do
// not wait for (a forward could read the poison instead of the upload; seen under load).
template <class T>
class Dev {
 public:
  explicit Dev(size_t n, int poison = 0x7b) : n_(n) {
    ck(cudaMalloc(&p_, std::max<size_t>(n, 1) * sizeof(T)), "cudaMalloc");
    ck(cudaMemset(p_, poison, std::max<size_t>(n, 1) * sizeof(T)), "cudaMemset");
    ck(cudaDeviceSynchronize(), "poison sync");
  }
  Dev(const std::vector<T>& v) : Dev(v.size()) {
    if (!v.empty()) ck(cudaMemcpy(p_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
    ck(cudaDeviceSynchronize(), "upload sync");
  }
  ~Dev() { cudaFree(p_); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  T* get() const { return static_cast<T*>(p_); }
  size_t size() const { return n_; }
  void poison(int byte) {
    ck(cudaMemset(p_, byte, std::max<size_t>(n_, 1) * sizeof(T)), "poison");
    ck(cudaDeviceSynchronize(), "poison sync");
  }
  std::vector<T> host(size_t count) const {
    std::vector<T> v(count);
    if (count) ck(cudaMemcpy(v.data(), p_, count * sizeof(T), cudaMemcpyDeviceToHost), "download");
    return v;
  }
  std::vector<T> host() const { return host(n_); }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

}  // namespace epmoe::test
