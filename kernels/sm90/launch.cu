// Host side of launching the sm_90a kernels (launch.cuh): problem checks and persistent grids.
#include "kernels/sm90/launch.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

#include "kernels/cuda_check.cuh"

namespace epmoe::kernels::sm90 {

void check_expert_problem(const ExpertProblem& p, const char* who) {
  auto aligned = [](const void* q) { return q != nullptr && reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  EPMOE_CHECK(p.experts > 0, ErrorCode::invalid_argument, who, ": experts must be > 0, got ", p.experts);
  EPMOE_CHECK(p.hidden > 0 && p.hidden % sm90::kDimMultiple == 0, ErrorCode::invalid_argument, who,
              ": hidden must be a positive multiple of ", sm90::kDimMultiple, ", got ", p.hidden);
  EPMOE_CHECK(p.ffn > 0 && p.ffn % sm90::kDimMultiple == 0, ErrorCode::invalid_argument, who,
              ": ffn must be a positive multiple of ", sm90::kDimMultiple, ", got ", p.ffn);
  EPMOE_CHECK(p.rows_capacity > 0 && p.rows_capacity < (int64_t(1) << 31), ErrorCode::invalid_argument, who,
              ": rows_capacity must be in (0, 2^31), got ", p.rows_capacity);
  EPMOE_CHECK(p.padded_offsets != nullptr && p.pair_row != nullptr && p.pair_weight != nullptr,
              ErrorCode::invalid_argument, who, ": null layout pointer");
  EPMOE_CHECK(aligned(p.x) && aligned(p.w1) && aligned(p.w2) && aligned(p.act) && aligned(p.out),
              ErrorCode::invalid_argument, who,
              ": x, w1, w2, act and out must be non-null and 16-byte aligned (the sm_90 UP gathers from x)");
  EPMOE_CHECK(p.x_rows > 0, ErrorCode::invalid_argument, who, ": x given with x_rows = ", p.x_rows);
  EPMOE_CHECK(p.preact == nullptr || aligned(p.preact), ErrorCode::invalid_argument, who,
              ": preact must be 16-byte aligned");
}

int device_sm_count() {
  int dev = 0, sms = 0;
  EPMOE_CUDA_CHECK(cudaGetDevice(&dev));
  EPMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return std::max(sms, 1);
}

unsigned sm90_grid(int64_t items, const char* who) {
  EPMOE_CHECK(items > 0 && items <= 0x7fffffff, ErrorCode::invalid_argument, who, ": work items out of range: ", items);
  return unsigned(std::min<int64_t>(items, device_sm_count()));
}

cudaLaunchAttribute sm90_cluster_pair_attr() {
  cudaLaunchAttribute a{};
  a.id = cudaLaunchAttributeClusterDimension;
  a.val.clusterDim.x = 2;
  a.val.clusterDim.y = 1;
  a.val.clusterDim.z = 1;
  return a;
}

unsigned sm90_cluster_grid(int64_t cluster_items, const void* kernel, size_t dyn_smem, cudaStream_t stream,
                           const char* who) {
  EPMOE_CHECK(cluster_items > 0 && cluster_items <= 0x3fffffff, ErrorCode::invalid_argument, who,
              ": cluster work items out of range: ", cluster_items);
  int dev = 0;
  EPMOE_CUDA_CHECK(cudaGetDevice(&dev));
  const int sms = device_sm_count();
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int> cache;  // (kernel, device) -> active clusters
  // Under stream capture the occupancy query is not made (it is not a stream operation, but keep
  // captures free of anything that could invalidate them): one cluster per SM pair until a launch
  // outside capture has asked. Too many clusters would only cost an extra wave, never correctness:
  // no CTA waits on a cluster that is not yet resident.
  int clusters = std::max(1, sms / 2);
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  EPMOE_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
  {
    std::lock_guard<std::mutex> lock(mu);
    auto found = cache.find({kernel, dev});
    if (found != cache.end()) {
      clusters = found->second;
    } else if (capturing == cudaStreamCaptureStatusNone) {
      cudaLaunchConfig_t cfg{};
      cfg.gridDim = dim3(2);
      cfg.blockDim = dim3(unsigned(kThreads));
      cfg.dynamicSmemBytes = dyn_smem;
      cudaLaunchAttribute attr[1] = {sm90_cluster_pair_attr()};
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      EPMOE_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg));
      EPMOE_CHECK(clusters > 0, ErrorCode::unsupported, who, ": no 2-CTA cluster of this kernel fits on device ", dev);
      cache[{kernel, dev}] = clusters;
    }
  }
  return unsigned(2 * std::min<int64_t>(cluster_items, clusters));
}

}  // namespace epmoe::kernels::sm90
