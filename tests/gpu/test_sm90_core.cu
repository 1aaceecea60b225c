// The sm_90a kernel core on its own: a dense GEMM built from its pieces (warp roles, the TMA ring,
// the mainloop on Tile128Of) with each operand K-major or MN-major, against an fp64 host product.
// The expert kernels use K-major A and B only; MN-major operands are what the backward's weight
// gradients need (dW2 = dY^T act: both operands MN-major in memory), so the core proves them here.
//
//   C[M, N] fp32 = A[M, K] . B[N, K]^T, A stored [M, K] (K-major) or [K, M] (MN-major), B stored
//   [N, K] (K-major) or [K, N] (MN-major); one 128 x 256 tile per CTA.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "epmoe/bf16.h"
#include "kernels/cuda_check.cuh"
#include "kernels/hash_fill.cuh"
#include "kernels/sm90/core/kernel.cuh"
#include "kernels/sm90/core/mainloop.cuh"
#include "kernels/sm90/core/ring.cuh"
#include "kernels/sm90/experts.cuh"
#include "kernels/sm90/tensor_maps.cuh"

namespace {

using epmoe::bf16;
namespace k90 = epmoe::kernels::sm90;

template <int kTA, int kTB>
__global__ void __launch_bounds__(k90::kThreads, 1)
    core_gemm_kernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b, float* c_out,
                     int n_total, int k_total) {
#if EPMOE_SM90A_DEVICE
  using namespace epmoe::kernels::sm90;
  using Tile = Tile128Of<kTA, kTB>;
  __shared__ __align__(8) uint64_t bars[2 * kStages];
  extern __shared__ uint8_t dyn_smem[];
  uint8_t* ring_mem = align_1024(dyn_smem);
  const uint32_t sA = smem_u32(ring_mem), sB = sA + kStages * kATileBytes;
  const Ring<kStages> ring{smem_u32(&bars[0]), smem_u32(&bars[kStages])};
  if (threadIdx.x == 0) {
    ring.init(1, kConsumerThreads);
    mbar_fence_init();
  }
  __syncthreads();
  const int m0 = int(blockIdx.x) * kBM, n0 = int(blockIdx.y) * kBN, num_k = k_total / kBK;
  run_warp_roles<40, 232>(
      [&] {
        if (threadIdx.x != 0) return;
        RingCursor<kStages> cur;
        for (int kt = 0; kt < num_k; ++kt, cur.advance()) {
          const uint32_t s = cur.stage(), full = ring.full(s);
          ring.wait_empty(cur);
          mbar_arrive_expect_tx(full, kStageBytes);
          const int k0 = kt * kBK;
          const uint32_t a = sA + s * kATileBytes, b = sB + s * kBTileBytes;
          if (kTA) {  // [64 k][64 m] boxes of A^T, one per warpgroup's rows
            for (int j = 0; j < 2; ++j) tma_load_2d(a + j * kMnBlockBytes, &tm_a, full, m0 + 64 * j, k0);
          } else {
            tma_load_2d(a, &tm_a, full, k0, m0);
          }
          if (kTB) {  // [64 k][64 n] boxes of B^T, four for the 256 columns
            for (int j = 0; j < 4; ++j) tma_load_2d(b + j * kMnBlockBytes, &tm_b, full, n0 + 64 * j, k0);
          } else {
            tma_load_2d(b, &tm_b, full, k0, n0);
          }
        }
      },
      [&](int c) {
        typename Tile::Acc acc;
        Tile::zero(acc);
        const typename Tile::Descs d = Tile::descs(sA, sB, uint32_t(c) * 8192u);
        RingCursor<kStages> cur;
        ring.wait_full(cur);
        mainloop<Tile>(acc, cur, num_k, ring.full0, d, /*proxy_fence=*/false,
                       [&](uint32_t s, int) { mbar_arrive(ring.empty(s)); }, [](int) {});
        // Fragment: d[4g + 2h + b] = D[16 w + l / 4 + 8 h][8 g + 2 (l % 4) + b].
        const int warp = int(threadIdx.x / 32) & 3, lane = int(threadIdx.x & 31);
#pragma unroll
        for (int g = 0; g < 32; ++g)
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int b = 0; b < 2; ++b) {
              const int row = m0 + 64 * c + 16 * warp + lane / 4 + 8 * h, col = n0 + 8 * g + 2 * (lane % 4) + b;
              c_out[int64_t(row) * n_total + col] = acc.d[4 * g + 2 * h + b];
            }
      });
#else
  (void)c_out, (void)n_total, (void)k_total;
#endif
}

template <int kTA, int kTB>
void run_gemm(int M, int N, int K) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || !epmoe::kernels::sm90_experts_supported(dev)) {
    (void)cudaGetLastError();
    GTEST_SKIP() << "needs a compute capability 9.0 device and an sm_90a build";
  }
  ASSERT_TRUE(M % 128 == 0 && N % 256 == 0 && K % 64 == 0);
  // A[m][k] and B[n][k], values in [-1, 1] from the counter hash; stored as the variant needs.
  std::vector<bf16> a(size_t(M) * K), b(size_t(N) * K);
  for (size_t i = 0; i < a.size(); ++i) a[i].bits = epmoe::kernels::hash_fill::hash_bf16(101, i, 1.0f);
  for (size_t i = 0; i < b.size(); ++i) b[i].bits = epmoe::kernels::hash_fill::hash_bf16(202, i, 1.0f);
  std::vector<bf16> a_st(a.size()), b_st(b.size());
  for (int m = 0; m < M; ++m)
    for (int k = 0; k < K; ++k) a_st[kTA ? size_t(k) * M + m : size_t(m) * K + k] = a[size_t(m) * K + k];
  for (int n = 0; n < N; ++n)
    for (int k = 0; k < K; ++k) b_st[kTB ? size_t(k) * N + n : size_t(n) * K + k] = b[size_t(n) * K + k];
  __nv_bfloat16 *da = nullptr, *db = nullptr;
  float* dc = nullptr;
  EPMOE_CUDA_CHECK(cudaMalloc(&da, a.size() * 2));
  EPMOE_CUDA_CHECK(cudaMalloc(&db, b.size() * 2));
  EPMOE_CUDA_CHECK(cudaMalloc(&dc, size_t(M) * N * 4));
  EPMOE_CUDA_CHECK(cudaMemcpy(da, a_st.data(), a.size() * 2, cudaMemcpyHostToDevice));
  EPMOE_CUDA_CHECK(cudaMemcpy(db, b_st.data(), b.size() * 2, cudaMemcpyHostToDevice));
  EPMOE_CUDA_CHECK(cudaMemset(dc, 0xFF, size_t(M) * N * 4));  // NaN poison: every element must be written
  // K-major: boxes of 64 K x the tile's rows; MN-major: boxes of 64 MN x 64 K.
  const CUtensorMap tm_a = kTA ? k90::make_matrix_map(da, K, M, 64) : k90::make_matrix_map(da, M, K, 128);
  const CUtensorMap tm_b = kTB ? k90::make_matrix_map(db, K, N, 64) : k90::make_matrix_map(db, N, K, 256);
  const size_t smem = k90::kRingSmemBytes;
  EPMOE_CUDA_CHECK(cudaFuncSetAttribute(core_gemm_kernel<kTA, kTB>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  core_gemm_kernel<kTA, kTB><<<dim3(M / 128, N / 256), k90::kThreads, smem>>>(tm_a, tm_b, dc, N, K);
  EPMOE_CUDA_CHECK(cudaGetLastError());
  EPMOE_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> c(size_t(M) * N);
  EPMOE_CUDA_CHECK(cudaMemcpy(c.data(), dc, c.size() * 4, cudaMemcpyDeviceToHost));
  cudaFree(da);
  cudaFree(db);
  cudaFree(dc);
  // Tolerance: fp32 accumulation of K bf16 products (exact in fp32) in an order the tensor cores
  // choose: |err| <= K 2^-24 sum |a b| in the worst case; 2^-16 sum |a b| leaves a wide margin and is
  // far below what any indexing or layout error gives (an O(1) fraction of sum |a b|).
  int64_t bad = 0;
  double worst = 0;
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double ref = 0, mag = 0;
      for (int k = 0; k < K; ++k) {
        const double p = double(a[size_t(m) * K + k].f()) * double(b[size_t(n) * K + k].f());
        ref += p;
        mag += std::fabs(p);
      }
      const double got = c[size_t(m) * N + n], err = std::fabs(got - ref);
      worst = std::max(worst, mag > 0 ? err / mag : err);
      if (!(err <= std::ldexp(mag, -16) + 1e-6) && bad++ < 5)
        ADD_FAILURE() << "C[" << m << "][" << n << "] = " << got << ", want " << ref;
    }
  EXPECT_EQ(bad, 0);
  std::printf("[sm90 core] A %s, B %s, %dx%dx%d: worst |err| / sum|ab| = %.3g\n", kTA ? "MN-major" : "K-major",
              kTB ? "MN-major" : "K-major", M, N, K, worst);
}

TEST(Sm90Core, GemmKMajorAKMajorB) { run_gemm<0, 0>(256, 512, 512); }
TEST(Sm90Core, GemmKMajorAMnMajorB) { run_gemm<0, 1>(256, 512, 512); }
TEST(Sm90Core, GemmMnMajorAMnMajorB) { run_gemm<1, 1>(256, 512, 512); }
TEST(Sm90Core, GemmMnMajorAKMajorB) { run_gemm<1, 0>(128, 256, 1024); }

}  // namespace
