// Device expert layout (see expert_layout.cuh for shapes and the contract).
//
// Design: the position of (recv row i, local expert l) inside expert l's segment is the number of
// rows before i that also carry l: an exclusive scan of flags[l, i] = "row i carries l", laid out
// expert-major, minus the scan's value at the segment start. One CUB scan over E_local * rows
// integers orders every pair deterministically; the segment starts come from the host (padded).
#include <cub/device/device_scan.cuh>

#include "kernels/cuda_check.cuh"
#include "kernels/ep/expert_layout.cuh"

namespace epmoe::kernels {

namespace {

constexpr int kThreads = 256;

size_t align_up(size_t n) { return (n + 255) / 256 * 256; }

size_t scan_tmp_bytes(int64_t items) {
  size_t bytes = 0;
  EPMOE_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, bytes, static_cast<const int32_t*>(nullptr),
                                                 static_cast<int32_t*>(nullptr), int(items)));
  return bytes;
}

// One thread per received row: flags[l, i] = 1 for each local expert l in the row's metadata.
// recv_meta[R, 1 + 2k] -> flags[El, R] (zeroed before).
__global__ void mark_experts_kernel(const int32_t* __restrict__ meta, int64_t R, int k, int El,
                                    int32_t* __restrict__ flags, int32_t* __restrict__ error_flag) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= R) return;
  const int32_t* m = meta + i * (1 + 2 * k) + 1;
  for (int s = 0; s < k; ++s) {
    const int32_t l = m[s];
    if (l < 0) break;  // compacted: -1 ends the row's list
    if (l >= El) {
      atomicOr(error_flag, 1);
      continue;
    }
    flags[int64_t(l) * R + i] = 1;
  }
}

// One thread per received row: each (row, expert) pair goes to offsets[l] + its rank in expert l.
// meta, pos[El, R] (scan), offsets/counts -> pair_row, pair_weight.
__global__ void scatter_pairs_kernel(const int32_t* __restrict__ meta, int64_t R, int k, int El,
                                     const int32_t* __restrict__ pos, const int64_t* __restrict__ offsets,
                                     const int64_t* __restrict__ counts, int32_t* __restrict__ pair_row,
                                     float* __restrict__ pair_weight) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= R) return;
  const int32_t* m = meta + i * (1 + 2 * k) + 1;
  for (int s = 0; s < k; ++s) {
    const int32_t l = m[s];
    if (l < 0) break;
    if (l >= El) continue;
    const int64_t seg = int64_t(l) * R;
    const int64_t rank = int64_t(pos[seg + i]) - pos[seg];
    if (rank >= counts[l]) continue;  // inconsistent counts: flagged by pad_segments_kernel
    const int64_t p = offsets[l] + rank;
    pair_row[p] = int32_t(i);
    pair_weight[p] = __int_as_float(m[k + s]);
  }
}

// One block per local expert: compare the recounted pairs with the host's count, and fill the
// segment's tail (padding, and anything a mismatch left unwritten) with -1 / 0.
__global__ void pad_segments_kernel(int64_t R, int El, const int32_t* __restrict__ flags,
                                    const int32_t* __restrict__ pos, const int64_t* __restrict__ offsets,
                                    const int64_t* __restrict__ counts, int32_t* __restrict__ pair_row,
                                    float* __restrict__ pair_weight, int32_t* __restrict__ error_flag) {
  const int l = blockIdx.x;
  int64_t found = 0;
  if (R > 0) {
    const int64_t start = pos[int64_t(l) * R];
    const int64_t last = int64_t(El) * R - 1;
    const int64_t end = l + 1 < El ? int64_t(pos[int64_t(l + 1) * R]) : int64_t(pos[last]) + flags[last];
    found = end - start;
  }
  const int64_t want = counts[l];
  if (threadIdx.x == 0 && found != want) atomicOr(error_flag, 1);
  const int64_t begin = offsets[l] + (found < want ? found : want), stop = offsets[l + 1];
  for (int64_t p = begin + threadIdx.x; p < stop; p += blockDim.x) {
    pair_row[p] = -1;
    pair_weight[p] = 0.f;
  }
}

}  // namespace

size_t expert_layout_workspace_bytes(int64_t R, int El) {
  size_t n = 2 * align_up(size_t(R) * El * sizeof(int32_t));
  if (R > 0) n += align_up(scan_tmp_bytes(R * El));
  return n;
}

void expert_layout_launch(const ExpertLayoutArgs& a, cudaStream_t stream) {
  const int64_t R = a.recv_rows;
  const int El = a.experts, k = a.top_k;
  if (El <= 0) return;
  EPMOE_CHECK(R * El < int64_t(INT32_MAX), ErrorCode::unsupported, "expert_layout: ", R, " rows x ", El,
              " experts exceed the 32-bit scan");
  EPMOE_CHECK(a.workspace_bytes >= expert_layout_workspace_bytes(R, El), ErrorCode::internal,
              "expert_layout: workspace too small");
  char* p = static_cast<char*>(a.workspace);
  int32_t* flags = reinterpret_cast<int32_t*>(p);
  p += align_up(size_t(R) * El * sizeof(int32_t));
  int32_t* pos = reinterpret_cast<int32_t*>(p);
  p += align_up(size_t(R) * El * sizeof(int32_t));
  if (R > 0) {
    const unsigned blocks = unsigned((R + kThreads - 1) / kThreads);
    EPMOE_CUDA_CHECK(cudaMemsetAsync(flags, 0, size_t(R) * El * sizeof(int32_t), stream));
    mark_experts_kernel<<<blocks, kThreads, 0, stream>>>(a.recv_meta, R, k, El, flags, a.error_flag);
    EPMOE_CUDA_CHECK_LAUNCH("mark_experts_kernel");
    size_t tmp = scan_tmp_bytes(R * El);
    EPMOE_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(p, tmp, flags, pos, int(R * El), stream));
    scatter_pairs_kernel<<<blocks, kThreads, 0, stream>>>(a.recv_meta, R, k, El, pos, a.padded_offsets,
                                                          a.expert_counts, a.pair_row, a.pair_weight);
    EPMOE_CUDA_CHECK_LAUNCH("scatter_pairs_kernel");
  }
  pad_segments_kernel<<<El, 128, 0, stream>>>(R, El, flags, pos, a.padded_offsets, a.expert_counts, a.pair_row,
                                              a.pair_weight, a.error_flag);
  EPMOE_CUDA_CHECK_LAUNCH("pad_segments_kernel");
}

}  // namespace epmoe::kernels
