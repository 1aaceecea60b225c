// Gather: xs[i] = x[pair_row[i]] (zero where pair_row[i] == -1) for i < *padded_total.
//   x[x_rows, hidden] bf16, pair_row[rows_capacity] i32, *padded_total i64 (device) -> xs bf16
// One warp per row, 16-byte loads and stores (hidden % 8 == 0 is required; the pipeline
// guarantees hidden % 128 == 0), four independent loads in flight per lane. The grid is sized from
// rows_capacity; warps whose row is at or past *padded_total leave without touching xs.
// A pair_row outside [0, x_rows) is treated as padding (zero row) rather than read out of bounds.
#include "kernels/fallback/gather_rows.cuh"

#include "kernels/cuda_check.cuh"

namespace epmoe::kernels {
namespace {

constexpr int kGatherThreads = 256;
constexpr int kRowsPerBlock = kGatherThreads / 32;
constexpr int kUnroll = 4;

__global__ void __launch_bounds__(kGatherThreads)
    gather_rows_kernel(const __nv_bfloat16* __restrict__ x, int64_t x_rows, int hidden,
                       const int32_t* __restrict__ pair_row, const int64_t* __restrict__ padded_total,
                       int64_t rows_capacity, __nv_bfloat16* __restrict__ xs) {
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = int(threadIdx.x & 31);
  if (row >= rows_capacity || row >= *padded_total) return;
  const int32_t src = pair_row[row];
  const int chunks = hidden / 8;  // 16-byte chunks per row
  uint4* dst = reinterpret_cast<uint4*>(xs + row * int64_t(hidden));
  if (src < 0 || int64_t(src) >= x_rows) {
    const uint4 z = make_uint4(0, 0, 0, 0);
    for (int c = lane; c < chunks; c += 32) dst[c] = z;
    return;
  }
  const uint4* s = reinterpret_cast<const uint4*>(x + int64_t(src) * int64_t(hidden));
  for (int c0 = lane; c0 < chunks; c0 += 32 * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + 32 * u;
      if (c < chunks) v[u] = __ldg(s + c);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + 32 * u;
      if (c < chunks) dst[c] = v[u];
    }
  }
}

}  // namespace

void gather_rows_launch(const __nv_bfloat16* x, int64_t x_rows, int hidden, const int32_t* pair_row,
                        const int64_t* padded_total, int64_t rows_capacity, __nv_bfloat16* xs, cudaStream_t stream) {
  EPMOE_CHECK(hidden > 0 && hidden % 8 == 0, ErrorCode::invalid_argument,
              "gather_rows: hidden must be a positive multiple of 8, got ", hidden);
  EPMOE_CHECK(rows_capacity >= 0 && x_rows >= 0, ErrorCode::invalid_argument, "gather_rows: negative row count");
  if (rows_capacity == 0) return;
  EPMOE_CHECK(pair_row != nullptr && padded_total != nullptr && xs != nullptr, ErrorCode::invalid_argument,
              "gather_rows: null pointer");
  EPMOE_CHECK(reinterpret_cast<uintptr_t>(xs) % 16 == 0 && (x == nullptr || reinterpret_cast<uintptr_t>(x) % 16 == 0),
              ErrorCode::invalid_argument, "gather_rows: x and xs must be 16-byte aligned");
  const int64_t blocks = (rows_capacity + kRowsPerBlock - 1) / kRowsPerBlock;
  EPMOE_CHECK(blocks <= 0x7fffffff, ErrorCode::invalid_argument, "gather_rows: too many rows: ", rows_capacity);
  gather_rows_kernel<<<unsigned(blocks), kGatherThreads, 0, stream>>>(x, x_rows, hidden, pair_row, padded_total,
                                                                      rows_capacity, xs);
  EPMOE_CUDA_CHECK_LAUNCH("gather_rows_kernel");
}

}  // namespace epmoe::kernels
