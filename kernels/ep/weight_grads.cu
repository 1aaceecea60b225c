// Routing-weight gradients on the source (see weight_grads.cuh). One thread per (token, slot); the
// slot's position among the token's slots on the same rank is counted from the ids (k is small).
#include "kernels/ep/weight_grads.cuh"

#include "kernels/cuda_check.cuh"

namespace epmoe::kernels {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    scatter_weight_grads_kernel(const int32_t* __restrict__ ids, const int32_t* __restrict__ token_row,
                                const float* __restrict__ returned, int64_t num_tokens, int top_k, int world,
                                int experts_per_rank, float* __restrict__ dw, const int64_t* __restrict__ device_num_tokens) {
  const int64_t idx = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= num_tokens * top_k) return;
  const int64_t t = idx / top_k;
  const int j = int(idx - t * top_k);
  if (device_num_tokens != nullptr && t >= *device_num_tokens) {
    dw[idx] = 0.f;
    return;
  }
  const int32_t* id = ids + t * top_k;
  const int32_t e = id[j];
  float v = 0.f;
  if (e >= world * experts_per_rank) {
    v = __int_as_float(0x7fc00000);
  } else if (e >= 0) {
    const int r = e / experts_per_rank;
    int n = 0;
    for (int jj = 0; jj < j; ++jj) n += id[jj] >= 0 && id[jj] / experts_per_rank == r;
    v = returned[int64_t(token_row[t * world + r]) * top_k + n];
  }
  dw[idx] = v;
}

}  // namespace

void scatter_weight_grads_launch(const int32_t* ids, const int32_t* token_row, const float* returned,
                                 int64_t num_tokens, int top_k, int world, int experts_per_rank, float* dw,
                                 cudaStream_t stream, const int64_t* device_num_tokens) {
  EPMOE_CHECK(top_k > 0 && world > 0 && experts_per_rank > 0, ErrorCode::internal,
              "scatter_weight_grads: bad sizes");
  const int64_t total = num_tokens * top_k;
  if (total == 0) return;
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  EPMOE_CHECK(blocks <= 0x7fffffff, ErrorCode::internal, "scatter_weight_grads: too many tokens: ", num_tokens);
  scatter_weight_grads_kernel<<<unsigned(blocks), kThreads, 0, stream>>>(ids, token_row, returned, num_tokens, top_k,
                                                                         world, experts_per_rank, dw, device_num_tokens);
  EPMOE_CUDA_CHECK_LAUNCH("scatter_weight_grads_kernel");
}

}  // namespace epmoe::kernels
