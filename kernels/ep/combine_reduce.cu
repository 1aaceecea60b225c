// Source reduce kernel (see combine_reduce.cuh). One warp per token: the token's (at most 64) send
// rows sit in two registers per lane and are broadcast with shuffles; each lane sums 8 columns at a
// time over the ranks in ascending order (the order fixes the fp32 result bit for bit).
#include "kernels/ep/combine_reduce.cuh"
#include "kernels/cuda_check.cuh"

namespace epmoe::kernels {

namespace {

constexpr int kWarpsPerBlock = 8;

__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const uint4& v) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    acc[2 * i] += f.x;
    acc[2 * i + 1] += f.y;
  }
}

__global__ void combine_reduce_kernel(const uint4* __restrict__ returned, const int32_t* __restrict__ token_row,
                                      int64_t T, int world, int vecs_per_row, uint4* __restrict__ y,
                                      const int64_t* __restrict__ status, int64_t* __restrict__ error,
                                      const int64_t* __restrict__ device_count) {
  const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (t >= T) return;  // warp-uniform
  const int lane = threadIdx.x % 32;
  if (status != nullptr && status[0] != 0) {  // (checked form) a failed layout: NaN rows, recorded once
    if (t == 0 && lane == 0 && error[0] == 0)
      for (int i = 0; i < 4; ++i) error[i] = status[i];
    const int64_t n = *device_count;
    const uint32_t bits = n < 0 || n > T || t < n ? 0x7fc07fc0u : 0u;  // rows past a valid count stay zero
    const uint4 fill = make_uint4(bits, bits, bits, bits);
    for (int v = lane; v < vecs_per_row; v += 32) y[t * vecs_per_row + v] = fill;
    return;
  }
  const int32_t* tr = token_row + t * world;
  const int32_t row_lo = lane < world ? tr[lane] : -1;
  const int32_t row_hi = lane + 32 < world ? tr[lane + 32] : -1;
  for (int v = lane; v - lane < vecs_per_row; v += 32) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int r = 0; r < world; ++r) {
      // every lane of the warp runs the shuffle (v - lane is warp-uniform), then lanes past the row end idle
      const int32_t row = __shfl_sync(0xffffffffu, r < 32 ? row_lo : row_hi, r & 31);
      if (row >= 0 && v < vecs_per_row) add_bf16x8(acc, __ldg(returned + int64_t(row) * vecs_per_row + v));
    }
    if (v < vecs_per_row) {
      uint4 out;
      __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
      for (int i = 0; i < 4; ++i) o[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
      y[t * vecs_per_row + v] = out;
    }
  }
}

}  // namespace

void combine_reduce_launch(const __nv_bfloat16* returned, const int32_t* token_row, int64_t T, int world, int hidden,
                           __nv_bfloat16* y, cudaStream_t stream) {
  if (T <= 0) return;
  EPMOE_CHECK(hidden % 8 == 0 && world >= 1 && world <= 64, ErrorCode::internal, "combine_reduce: hidden ", hidden,
              " world ", world);
  const int64_t blocks = (T + kWarpsPerBlock - 1) / kWarpsPerBlock;
  combine_reduce_kernel<<<unsigned(blocks), kWarpsPerBlock * 32, 0, stream>>>(
      reinterpret_cast<const uint4*>(returned), token_row, T, world, hidden / 8, reinterpret_cast<uint4*>(y), nullptr,
      nullptr, nullptr);
  EPMOE_CUDA_CHECK_LAUNCH("combine_reduce_kernel");
}

void combine_reduce_checked_launch(const __nv_bfloat16* returned, const int32_t* token_row, int64_t T, int world,
                                   int hidden, const int64_t* status, int64_t* error, const int64_t* device_count,
                                   __nv_bfloat16* y, cudaStream_t stream) {
  if (T <= 0) return;
  EPMOE_CHECK(hidden % 8 == 0 && world >= 1 && world <= 64 && status != nullptr && error != nullptr &&
                  device_count != nullptr,
              ErrorCode::internal, "combine_reduce_checked: hidden ", hidden, " world ", world);
  const int64_t blocks = (T + kWarpsPerBlock - 1) / kWarpsPerBlock;
  combine_reduce_kernel<<<unsigned(blocks), kWarpsPerBlock * 32, 0, stream>>>(
      reinterpret_cast<const uint4*>(returned), token_row, T, world, hidden / 8, reinterpret_cast<uint4*>(y), status,
      error, device_count);
  EPMOE_CUDA_CHECK_LAUNCH("combine_reduce_kernel");
}

}  // namespace epmoe::kernels
