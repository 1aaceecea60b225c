// Pack kernel (see pack_rows.cuh). A pure gather of whole rows: one warp per row, 16-byte vectors,
// 64-bit row offsets (rows * hidden exceeds 2^31 elements at production sizes).
#include "kernels/cuda_check.cuh"
#include "kernels/ep/pack_rows.cuh"

namespace epmoe::kernels {

namespace {

constexpr int kWarpsPerBlock = 8;

__global__ void pack_rows_kernel(const uint4* __restrict__ x, int vecs_per_row, const int32_t* __restrict__ send_token,
                                 int64_t rows, uint4* __restrict__ send_x) {
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const uint4* src = x + int64_t(send_token[row]) * vecs_per_row;
  uint4* dst = send_x + row * vecs_per_row;
  for (int v = threadIdx.x % 32; v < vecs_per_row; v += 32) dst[v] = __ldg(src + v);
}

}  // namespace

void pack_rows_launch(const __nv_bfloat16* x, int hidden, const int32_t* send_token, int64_t rows,
                      __nv_bfloat16* send_x, cudaStream_t stream) {
  if (rows <= 0) return;
  EPMOE_CHECK(hidden % 8 == 0, ErrorCode::internal, "pack_rows: hidden ", hidden, " is not a multiple of 8");
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  pack_rows_kernel<<<unsigned(blocks), kWarpsPerBlock * 32, 0, stream>>>(
      reinterpret_cast<const uint4*>(x), hidden / 8, send_token, rows, reinterpret_cast<uint4*>(send_x));
  EPMOE_CUDA_CHECK_LAUNCH("pack_rows_kernel");
}

}  // namespace epmoe::kernels
