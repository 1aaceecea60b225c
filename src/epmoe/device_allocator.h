// Where the GPU engine's device memory comes from: LayerOptions::device_allocator. Torch-free; the
// torch bindings (torch/) plug in torch's caching allocator through it, so the layer's workspaces
// and saved contexts are torch's blocks (torch.cuda.memory_allocated counts them, and memory the
// layer frees serves torch's next tensors instead of sitting in a private pool).
//
// Left empty (the default), the engine allocates as it always did: cudaMalloc for its grow-only
// workspaces and a private stream-ordered pool (cudaMallocFromPoolAsync / cudaFreeAsync) for what
// forward(..., save) keeps.
#pragma once
#include <cstddef>

namespace epmoe {

// The contract. `stream` is a cudaStream_t passed as void* (this header needs no CUDA); `device`
// is the CUDA device the layer runs on, and is the current device during both calls.
//
// allocate(bytes, device, stream): at least `bytes` (> 0) of device memory on `device`, aligned
//   to 256 bytes, for work queued on `stream` after the call (the memory's first use). Return null
//   or throw when it cannot: the layer turns either into an epmoe::Error(cuda_error) naming the
//   size (in a forward's token-sized buffers, a status every rank raises alike).
//
// deallocate(p, bytes, device, stream): `p` and `bytes` as allocate gave and was asked. No work
//   queued after this call uses p; work already queued on `stream` may still (the memory's last
//   use), and every other use has completed or is ordered before that work. So the allocator must
//   not hand p out again to work that could run before `stream`'s queued work completes. Reuse in
//   `stream`'s own order is safe; reuse on another stream needs that stream to wait (an event),
//   e.g. torch's caching allocator reuses a block in the order of the stream it was allocated
//   on, so when the last-use stream differs it must be told (recordStream), as torch/ does.
//   Must not throw (the layer calls it from destructors; an exception is swallowed and the block
//   is lost to the allocator).
//
// Which streams the layer passes:
//   - workspaces: allocated on the stream of the call that grows them; freed when they grow
//     (after a host wait drained every use) on that call's stream, and at the layer's
//     destruction (after it synchronized its work) on a stream of its own;
//   - what forward(..., save) keeps: allocated on the forward's stream, freed when its
//     MoeForwardContext is destroyed, on the stream of the last forward / backward that used it.
//     So with an allocator set, the streams a layer runs on must stay alive while contexts saved
//     on them live (torch's streams live as long as the process).
//
// Thread safety: calls come from the threads that call the layer and that destroy its contexts
// (a torch autograd thread, say), and several layers may share one allocator: it must be safe to
// call from several threads at once. The layer and every context it saved hold the allocator
// (shared_ptr), so a context outliving its layer still frees into a live allocator.
struct DeviceAllocator {
  virtual ~DeviceAllocator() = default;
  virtual void* allocate(size_t bytes, int device, void* stream) = 0;
  virtual void deallocate(void* p, size_t bytes, int device, void* stream) = 0;
};

}  // namespace epmoe
