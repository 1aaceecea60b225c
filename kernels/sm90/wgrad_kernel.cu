// The weight-gradient GEMMs (wgrad.cuh) on the sm_90a core.
//
// Work item: one 128 x 256 tile of one expert's c[e] (m rows [128 i, +128), n columns [256 j, +256)),
// its K = the expert's padded rows in 64-row stages. Persistent grid, items in expert-major order so
// the CTAs running at once share a few experts' a and b slices in L2. Warpgroup 0: thread 0 issues
// each stage's TMA boxes (two 64 x 64 of a, four of b, MN-major). Warpgroups 1 and 2: the core's
// mainloop on Tile128Of<1, 1> (rows [64c, +64) of the tile), then the epilogue from registers: fp32
// pairs (or bf16 pairs) stored per fragment row, added to what c holds when accumulating. The ring
// runs on across items, so the producer fills the next item's stages during the epilogue.
#include "kernels/sm90/wgrad.cuh"

#include "kernels/cuda_check.cuh"
#include "kernels/sm90/core/kernel.cuh"
#include "kernels/sm90/core/mainloop.cuh"
#include "kernels/sm90/core/ring.cuh"
#include "kernels/sm90/experts.cuh"
#include "kernels/sm90/launch.cuh"
#include "kernels/sm90/tensor_maps.cuh"

namespace epmoe::kernels::sm90 {

inline constexpr uint32_t kWgradProducerRegs = 40, kWgradConsumerRegs = 232;

struct WgradItem {
  int e, m0, n0;
  int64_t k_row0;
  int num_k;
};
__device__ __forceinline__ WgradItem wgrad_item(int64_t w, int m_tiles, int n_tiles, const int64_t* off) {
  const int64_t per_expert = int64_t(m_tiles) * n_tiles;
  WgradItem it;
  it.e = int(w / per_expert);
  const int r = int(w - int64_t(it.e) * per_expert);
  it.m0 = (r / n_tiles) * kBM;
  it.n0 = (r % n_tiles) * kBN;
  it.k_row0 = off[it.e];
  it.num_k = int((off[it.e + 1] - it.k_row0) / kBK);
  return it;
}

template <bool kF32, bool kAccumulate>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_wgrad_kernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b,
                      const int64_t* __restrict__ padded_offsets, int experts, int m, int n, void* __restrict__ c) {
#if EPMOE_SM90A_DEVICE
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
  const int m_tiles = m / kBM, n_tiles = n / kBN;
  const int64_t items = int64_t(experts) * m_tiles * n_tiles;
  using Tile = Tile128Of<1, 1>;
  run_warp_roles<kWgradProducerRegs, kWgradConsumerRegs>(
      [&] {
        if (threadIdx.x != 0) return;
        tma_prefetch_desc(&tm_a);
        tma_prefetch_desc(&tm_b);
        grid_dependency_wait();  // a and b come from the previous kernels (no-op unless PDL-launched)
        RingCursor<kStages> cur;
        for (int64_t w = blockIdx.x; w < items; w += gridDim.x) {
          const WgradItem it = wgrad_item(w, m_tiles, n_tiles, padded_offsets);
          for (int kt = 0; kt < it.num_k; ++kt, cur.advance()) {
            const uint32_t s = cur.stage(), full = ring.full(s);
            ring.wait_empty(cur);
            mbar_arrive_expect_tx(full, kStageBytes);
            const int k0 = int(it.k_row0) + kt * kBK;
            const uint32_t a = sA + s * kATileBytes, b = sB + s * kBTileBytes;
#pragma unroll
            for (int j = 0; j < 2; ++j) tma_load_2d(a + j * kMnBlockBytes, &tm_a, full, it.m0 + 64 * j, k0);
#pragma unroll
            for (int j = 0; j < 4; ++j) tma_load_2d(b + j * kMnBlockBytes, &tm_b, full, it.n0 + 64 * j, k0);
          }
        }
      },
      [&](int cw) {
        const typename Tile::Descs d = Tile::descs(sA, sB, uint32_t(cw) * 8192u);
        const int warp = int(threadIdx.x / 32) & 3, lane = int(threadIdx.x & 31);
        RingCursor<kStages> cur;
        for (int64_t w = blockIdx.x; w < items; w += gridDim.x) {
          const WgradItem it = wgrad_item(w, m_tiles, n_tiles, padded_offsets);
          typename Tile::Acc acc;
          Tile::zero(acc);
          if (it.num_k > 0) {
            ring.wait_full(cur);
            mainloop<Tile>(acc, cur, it.num_k, ring.full0, d, /*proxy_fence=*/false,
                           [&](uint32_t s, int) { mbar_arrive(ring.empty(s)); }, [](int) {});
          }
          // Fragment: d[4g + 2h + b] = D[16 warp + lane / 4 + 8 h][8 g + 2 (lane % 4) + b].
          const int64_t base = int64_t(it.e) * m * n;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int64_t row = it.m0 + 64 * cw + 16 * warp + lane / 4 + 8 * h;
            const int64_t at = base + row * n + it.n0 + 2 * (lane % 4);
#pragma unroll
            for (int g = 0; g < 32; ++g) {
              float x = acc.d[4 * g + 2 * h], y = acc.d[4 * g + 2 * h + 1];
              if constexpr (kF32) {
                float2* p = reinterpret_cast<float2*>(static_cast<float*>(c) + at + 8 * g);
                if constexpr (kAccumulate) {
                  const float2 o = *p;
                  x += o.x, y += o.y;
                }
                *p = make_float2(x, y);
              } else {
                __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(c) + at + 8 * g);
                if constexpr (kAccumulate) {
                  const float2 o = __bfloat1622float2(*p);
                  x += o.x, y += o.y;
                }
                *p = __floats2bfloat162_rn(x, y);
              }
            }
          }
        }
      });
#else
  (void)padded_offsets, (void)experts, (void)m, (void)n, (void)c;
#endif
}

}  // namespace epmoe::kernels::sm90

namespace epmoe::kernels {

bool sm90_wgrad_supported(int m, int n) {
  return m > 0 && n > 0 && m % sm90::kBM == 0 && n % sm90::kBN == 0 && sm90_experts_supported_here();
}

void sm90_wgrad_launch(const WgradProblem& p, cudaStream_t stream) {
  using namespace sm90;
  EPMOE_CHECK(p.m % kBM == 0 && p.n % kBN == 0 && p.m > 0 && p.n > 0, ErrorCode::invalid_argument,
              "sm90_wgrad: m must be a multiple of ", kBM, " and n of ", kBN, ", got ", p.m, " x ", p.n);
  EPMOE_CHECK(p.experts > 0 && p.rows > 0 && p.rows < int64_t(INT32_MAX), ErrorCode::invalid_argument,
              "sm90_wgrad: rows out of range: ", p.rows);
  EPMOE_CHECK(p.a && p.b && p.c && p.padded_offsets, ErrorCode::invalid_argument, "sm90_wgrad: null pointer");
  const CUtensorMap tm_a = make_matrix_map(p.a, p.rows, p.m, 64);  // boxes: 64 columns x 64 rows
  const CUtensorMap tm_b = make_matrix_map(p.b, p.rows, p.n, 64);
  const int64_t items = int64_t(p.experts) * (p.m / kBM) * (p.n / kBN);
  auto kernel = p.c_f32 ? (p.accumulate ? sm90_wgrad_kernel<true, true> : sm90_wgrad_kernel<true, false>)
                        : (p.accumulate ? sm90_wgrad_kernel<false, true> : sm90_wgrad_kernel<false, false>);
  sm90_launch(kernel, /*cluster=*/false, /*pdl=*/false, items, kRingSmemBytes, stream, "sm90_wgrad_kernel", tm_a, tm_b,
              p.padded_offsets, p.experts, p.m, p.n, p.c);
}

}  // namespace epmoe::kernels
