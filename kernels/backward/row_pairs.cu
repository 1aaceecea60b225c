// Pairs back to received rows (see row_pairs.cuh).
#include "kernels/backward/row_pairs.cuh"

#include "kernels/cuda_check.cuh"

namespace epmoe::kernels {
namespace {

constexpr int kThreads = 256;

// One thread per pair: its expert by binary search over the segment starts, then its slot in the
// row's local ids.
__global__ void __launch_bounds__(kThreads)
    row_pair_map_kernel(const int64_t* __restrict__ padded_offsets, int experts, const int32_t* __restrict__ pair_row,
                        int64_t pairs, const int32_t* __restrict__ recv_meta, int meta_stride, int ids_offset,
                        int64_t recv_rows, int top_k, int32_t* __restrict__ row_pair) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= pairs || i >= padded_offsets[experts]) return;
  const int32_t r = pair_row[i];
  if (r < 0 || r >= recv_rows) return;
  int lo = 0, hi = experts - 1;  // the last e with padded_offsets[e] <= i
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (padded_offsets[mid] <= i) lo = mid;
    else hi = mid - 1;
  }
  const int32_t* ids = recv_meta + int64_t(r) * meta_stride + ids_offset;
  for (int j = 0; j < top_k; ++j)
    if (ids[j] == lo) {
      row_pair[int64_t(r) * top_k + j] = int32_t(i);
      return;
    }
}

// One warp per received row.
__global__ void __launch_bounds__(kThreads)
    reduce_row_pairs_kernel(const uint4* __restrict__ dxp, const float* __restrict__ ds_pair,
                            const int32_t* __restrict__ row_pair, int64_t recv_rows, int top_k, int vecs,
                            uint4* __restrict__ dx_rows, float* __restrict__ ds_rows) {
  const int64_t r = int64_t(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  const int lane = int(threadIdx.x & 31);
  if (r >= recv_rows) return;
  const int32_t* rp = row_pair + r * top_k;
  if (ds_rows != nullptr) {
    if (lane < top_k) ds_rows[r * top_k + lane] = rp[lane] >= 0 ? ds_pair[rp[lane]] : 0.f;
    for (int j = 32; j < top_k; ++j)  // (top_k > 32)
      if (lane == 0) ds_rows[r * top_k + j] = rp[j] >= 0 ? ds_pair[rp[j]] : 0.f;
  }
  for (int v = lane; v < vecs; v += 32) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int j = 0; j < top_k; ++j) {
      const int32_t i = rp[j];
      if (i < 0) continue;
      const uint4 d8 = dxp[int64_t(i) * vecs + v];
      const __nv_bfloat162* d = reinterpret_cast<const __nv_bfloat162*>(&d8);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 f = __bfloat1622float2(d[q]);
        acc[2 * q] += f.x;
        acc[2 * q + 1] += f.y;
      }
    }
    uint4 o;
    uint32_t* w = reinterpret_cast<uint32_t*>(&o);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const __nv_bfloat162 b = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
      w[q] = *reinterpret_cast<const uint32_t*>(&b);
    }
    dx_rows[r * vecs + v] = o;
  }
}

}  // namespace

namespace {
void row_pair_map_any(const int64_t* padded_offsets, int experts, const int32_t* pair_row, int64_t pairs,
                      const int32_t* meta, int meta_stride, int ids_offset, int64_t recv_rows, int top_k,
                      int32_t* row_pair, cudaStream_t stream) {
  EPMOE_CHECK(experts > 0 && top_k > 0, ErrorCode::internal, "row_pair_map: experts and top_k must be positive");
  if (recv_rows == 0) return;
  EPMOE_CUDA_CHECK(cudaMemsetAsync(row_pair, 0xff, size_t(recv_rows) * top_k * sizeof(int32_t), stream));
  if (pairs == 0) return;
  const int64_t blocks = (pairs + kThreads - 1) / kThreads;
  EPMOE_CHECK(blocks <= 0x7fffffff, ErrorCode::internal, "row_pair_map: too many pairs: ", pairs);
  row_pair_map_kernel<<<unsigned(blocks), kThreads, 0, stream>>>(padded_offsets, experts, pair_row, pairs, meta,
                                                                 meta_stride, ids_offset, recv_rows, top_k, row_pair);
  EPMOE_CUDA_CHECK_LAUNCH("row_pair_map_kernel");
}
}  // namespace

void row_pair_map_launch(const int64_t* padded_offsets, int experts, const int32_t* pair_row, int64_t pairs,
                         const int32_t* recv_meta, int64_t recv_rows, int top_k, int32_t* row_pair,
                         cudaStream_t stream) {
  row_pair_map_any(padded_offsets, experts, pair_row, pairs, recv_meta, 1 + 2 * top_k, 1, recv_rows, top_k, row_pair,
                   stream);
}

void row_pair_map_ids_launch(const int64_t* padded_offsets, int experts, const int32_t* pair_row, int64_t pairs,
                             const int32_t* topk_ids, int64_t rows, int top_k, int32_t* row_pair, cudaStream_t stream) {
  row_pair_map_any(padded_offsets, experts, pair_row, pairs, topk_ids, top_k, 0, rows, top_k, row_pair, stream);
}

void reduce_row_pairs_launch(const __nv_bfloat16* dxp, const float* ds_pair, const int32_t* row_pair,
                             int64_t recv_rows, int top_k, int hidden, __nv_bfloat16* dx_rows, float* ds_rows,
                             cudaStream_t stream) {
  EPMOE_CHECK(hidden > 0 && hidden % 8 == 0, ErrorCode::internal, "reduce_row_pairs: hidden must be a multiple of 8");
  if (recv_rows == 0) return;
  const int64_t blocks = (recv_rows + kThreads / 32 - 1) / (kThreads / 32);
  EPMOE_CHECK(blocks <= 0x7fffffff, ErrorCode::internal, "reduce_row_pairs: too many rows: ", recv_rows);
  reduce_row_pairs_kernel<<<unsigned(blocks), kThreads, 0, stream>>>(reinterpret_cast<const uint4*>(dxp), ds_pair,
                                                                     row_pair, recv_rows, top_k, hidden / 8,
                                                                     reinterpret_cast<uint4*>(dx_rows), ds_rows);
  EPMOE_CUDA_CHECK_LAUNCH("reduce_row_pairs_kernel");
}

}  // namespace epmoe::kernels
