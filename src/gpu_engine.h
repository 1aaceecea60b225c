// Internal: the GPU engine's inspection hooks for tests (the engine itself is made by
// make_gpu_engine in engine.h and lives in gpu_engine.cu). No CUDA headers here.
#pragma once
#include <cstdint>
#include <vector>

#include "engine.h"

namespace epmoe {

// What the last forward received in the dispatch, on the device. Valid until the next forward on
// the same engine; the caller orders its reads after the forward's stream (e.g. synchronizes it).
struct GpuDispatchView {
  const void* recv_x = nullptr;         // bf16 [recv_rows, hidden], grouped by source rank ascending
  const int32_t* recv_meta = nullptr;   // i32 [recv_rows, meta_words(k)] (source token, local ids, weight bits)
  int64_t recv_rows = 0;
  std::vector<int64_t> rows_per_rank;   // [world] rows from each source rank
  int hidden = 0;
  int meta_words = 0;
};

// Throws Error(invalid_argument) if `engine` is not a GPU engine.
GpuDispatchView gpu_dispatch_view(const MoeLayer::Engine& engine);

}  // namespace epmoe
