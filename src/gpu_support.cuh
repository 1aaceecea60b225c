// Internal: the GPU engine's host-side helpers (device and stream scopes, NVTX ranges, device
// buffers). Included by the engine's .cu files only.
#pragma once
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>

#include "epmoe/communicator.h"
#include "epmoe/device_allocator.h"
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

// Checked calls into a LayerOptions::device_allocator (epmoe/device_allocator.h states the
// contract). Null, misaligned memory and anything thrown become epmoe::Error(cuda_error): the
// forward turns an Error while sizing its token-sized buffers into a status that fails every rank
// alike, where any other exception would leave the peers waiting in the count exchange.
inline void allocator_free(DeviceAllocator& a, void* p, size_t bytes, int device, cudaStream_t s) noexcept {
  try {
    a.deallocate(p, bytes, device, s);
  } catch (...) {  // (the contract says it does not throw; from a destructor the block is lost)
  }
}
inline void* allocator_alloc(DeviceAllocator& a, size_t bytes, int device, cudaStream_t s) {
  void* p = nullptr;
  try {
    p = a.allocate(bytes, device, s);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    EPMOE_FAIL(ErrorCode::cuda_error, "device_allocator: allocating ", bytes, " bytes on cuda:", device,
               " failed: ", e.what());
  } catch (...) {
    EPMOE_FAIL(ErrorCode::cuda_error, "device_allocator: allocating ", bytes, " bytes on cuda:", device,
               " failed (a non-standard exception)");
  }
  EPMOE_CHECK(p != nullptr, ErrorCode::cuda_error, "device_allocator returned null for ", bytes, " bytes on cuda:",
              device);
  if (reinterpret_cast<uintptr_t>(p) % 256 != 0) {
    allocator_free(a, p, bytes, device, s);
    EPMOE_FAIL(ErrorCode::cuda_error, "device_allocator returned ", p, " for ", bytes, " bytes on cuda:", device,
               ": not 256-byte aligned");
  }
  return p;
}

// Where the engine's DeviceBuffers come from: the layer's DeviceAllocator, else cudaMalloc. The
// engine owns one, binds every buffer to it at construction and sets `stream` to each call's stream
// before the call sizes buffers: a buffer is allocated for that stream, and an old one freed there
// when it grows (every use drained by then); at destruction, after its work is synchronized, the
// engine points `stream` at a stream of its own.
struct BufferSource {
  std::shared_ptr<DeviceAllocator> allocator;  // empty: cudaMalloc / cudaFree
  int device = 0;
  cudaStream_t stream = nullptr;
};

// Grow-only device allocation; never null once sized (256 bytes at least), so empty buffers can
// still be passed where a pointer is required. The caller guarantees that no queued work still
// uses the old memory when it grows. Bound to its engine's BufferSource before first use (an
// unbound buffer is an error, so one added to the engine but not to its binding list cannot
// silently bypass the layer's allocator).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { release(); }

  void bind(const BufferSource* src) { src_ = src; }
  bool fits(size_t bytes) const { return ptr_ != nullptr && std::max<size_t>(bytes, 256) <= bytes_; }
  void ensure(size_t bytes) {
    if (fits(bytes)) return;
    EPMOE_CHECK(src_ != nullptr, ErrorCode::internal, "an engine DeviceBuffer was never bound to its BufferSource");
    // 25% headroom so slowly growing counts do not reallocate every call.
    size_t grown = std::max<size_t>(std::max<size_t>(bytes, 256), bytes_ + bytes_ / 4);
    grown = (grown + 4095) / 4096 * 4096;
    release();
    if (src_->allocator) ptr_ = allocator_alloc(*src_->allocator, grown, src_->device, src_->stream);
    else EPMOE_CUDA_CHECK(cudaMalloc(&ptr_, grown));
    bytes_ = grown;
  }
  void release() noexcept {
    if (ptr_) {
      if (src_->allocator) allocator_free(*src_->allocator, ptr_, bytes_, src_->device, src_->stream);
      else cudaFree(ptr_);
    }
    ptr_ = nullptr;
    bytes_ = 0;
  }
  template <class T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
  const BufferSource* src_ = nullptr;  // the engine's (declared before its buffers: it outlives them)
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

template <class T>
T* pinned_alloc(size_t count) {
  void* p = nullptr;
  EPMOE_CUDA_CHECK(cudaMallocHost(&p, std::max<size_t>(count, 1) * sizeof(T)));
  return static_cast<T*>(p);
}

// The saved contexts' memory, destroyed when its last holder lets go: the engine and every saved
// context hold it, so a context that outlives its layer frees into a live pool. A private
// stream-ordered cudaMemPool, or, when the layer has one, its DeviceAllocator (held here, so it
// lives as long as the contexts do).
class MemoryPool {
 public:
  explicit MemoryPool(int device, std::shared_ptr<DeviceAllocator> allocator = nullptr)
      : device_(device), allocator_(std::move(allocator)) {
    if (allocator_) return;  // the allocator's memory: no pool of our own
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
  ~MemoryPool() {
    if (pool_) cudaMemPoolDestroy(pool_);  // (frees still queued complete first)
  }
  MemoryPool(const MemoryPool&) = delete;
  MemoryPool& operator=(const MemoryPool&) = delete;
  bool external() const { return allocator_ != nullptr; }  // the layer's DeviceAllocator

  // Stream-ordered: for work queued on `s` after the call; freed once the work queued on `s` (the
  // last use's stream, or one ordered after it) completes.
  void* alloc(size_t bytes, cudaStream_t s) {
    if (allocator_) return allocator_alloc(*allocator_, bytes, device_, s);
    void* p = nullptr;
    EPMOE_CUDA_CHECK(cudaMallocFromPoolAsync(&p, bytes, pool_, s));
    return p;
  }
  void free(void* p, size_t bytes, cudaStream_t s) noexcept {
    if (allocator_) allocator_free(*allocator_, p, bytes, device_, s);
    else cudaFreeAsync(p, s);
  }

 private:
  int device_ = 0;
  std::shared_ptr<DeviceAllocator> allocator_;
  cudaMemPool_t pool_ = nullptr;
};

// A stream-ordered allocation from a memory pool (what a saved forward keeps): taken on the
// forward's stream, given back with free_async on a stream ordered after its last use. Its owner
// keeps the pool alive while the buffer is (GpuSaved::pool).
class PoolBuffer {
 public:
  PoolBuffer() = default;
  PoolBuffer(const PoolBuffer&) = delete;
  PoolBuffer& operator=(const PoolBuffer&) = delete;
  void alloc(MemoryPool& pool, size_t bytes, cudaStream_t s) {
    bytes_ = std::max<size_t>(bytes, 256);
    ptr_ = pool.alloc(bytes_, s);
    pool_ = &pool;
  }
  void free_async(cudaStream_t s) noexcept {
    if (ptr_) pool_->free(ptr_, bytes_, s);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  template <class T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return ptr_ ? bytes_ : 0; }

 private:
  MemoryPool* pool_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace epmoe::gpu
