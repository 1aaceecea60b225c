// Internal: the GPU engine's host-side helpers (device and stream scopes, NVTX ranges, device
// buffers). Included by the engine's .cu files only.
#pragma once
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "epmoe/communicator.h"
#include "kernels/cuda_check.cuh"

namespace epmoe::gpu {

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    EPMOE_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ == device) prev_ = -1;
    else EPMOE_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() {
    if (prev_ >= 0) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

// Sets the communicator's stream for the scope and puts the previous one back after (also when the
// forward throws): the caller's stream is only known to be alive during the forward, and the
// communicator outlives it (a shared one is used by other layers, and by MoeLayer's constructor,
// whose agreement collective orders itself after the communicator's stream). Left set, a stream the
// caller destroys after the forward would dangle there, and the next collective fail on it
// (cudaErrorContextIsDestroyed).
class CommStreamScope {
 public:
  CommStreamScope(Communicator& comm, cudaStream_t s) : comm_(comm), prev_(comm.stream()) { comm_.set_stream(s); }
  ~CommStreamScope() { comm_.set_stream(prev_); }
  CommStreamScope(const CommStreamScope&) = delete;
  CommStreamScope& operator=(const CommStreamScope&) = delete;

 private:
  Communicator& comm_;
  void* prev_;
};

class NvtxRange {
 public:
  explicit NvtxRange(const char* name) { nvtxRangePushA(name); }
  ~NvtxRange() { nvtxRangePop(); }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

// Grow-only device allocation; never null once sized (256 bytes at least), so empty buffers can
// still be passed where a pointer is required. The caller guarantees that no queued work still
// uses the old memory when it grows.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { release(); }

  bool fits(size_t bytes) const { return ptr_ != nullptr && std::max<size_t>(bytes, 256) <= bytes_; }
  void ensure(size_t bytes) {
    if (fits(bytes)) return;
    // 25% headroom so slowly growing counts do not reallocate every call.
    size_t grown = std::max<size_t>(std::max<size_t>(bytes, 256), bytes_ + bytes_ / 4);
    grown = (grown + 4095) / 4096 * 4096;
    release();
    EPMOE_CUDA_CHECK(cudaMalloc(&ptr_, grown));
    bytes_ = grown;
  }
  void release() noexcept {
    if (ptr_) cudaFree(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  template <class T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

template <class T>
T* pinned_alloc(size_t count) {
  void* p = nullptr;
  EPMOE_CUDA_CHECK(cudaMallocHost(&p, std::max<size_t>(count, 1) * sizeof(T)));
  return static_cast<T*>(p);
}

// A device memory pool, destroyed when its last holder lets go: the engine and every saved context
// hold it, so a context that outlives its layer frees into a live pool.
class MemoryPool {
 public:
  explicit MemoryPool(int device) {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    EPMOE_CUDA_CHECK(cudaMemPoolCreate(&pool_, &props));
    uint64_t keep = UINT64_MAX;  // freed memory stays for the next step's contexts (no release at syncs)
    const cudaError_t e = cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &keep);
    if (e != cudaSuccess) {
      cudaMemPoolDestroy(pool_);
      EPMOE_CUDA_CHECK(e);
    }
  }
  ~MemoryPool() { cudaMemPoolDestroy(pool_); }  // (frees still queued complete first)
  MemoryPool(const MemoryPool&) = delete;
  MemoryPool& operator=(const MemoryPool&) = delete;
  cudaMemPool_t get() const { return pool_; }

 private:
  cudaMemPool_t pool_ = nullptr;
};

// A stream-ordered allocation from a memory pool (what a saved forward keeps): taken on the
// forward's stream, given back with free_async on a stream ordered after its last use.
class PoolBuffer {
 public:
  PoolBuffer() = default;
  PoolBuffer(const PoolBuffer&) = delete;
  PoolBuffer& operator=(const PoolBuffer&) = delete;
  void alloc(cudaMemPool_t pool, size_t bytes, cudaStream_t s) {
    bytes_ = std::max<size_t>(bytes, 256);
    EPMOE_CUDA_CHECK(cudaMallocFromPoolAsync(&ptr_, bytes_, pool, s));
  }
  void free_async(cudaStream_t s) noexcept {
    if (ptr_) cudaFreeAsync(ptr_, s);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  template <class T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return ptr_ ? bytes_ : 0; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace epmoe::gpu
