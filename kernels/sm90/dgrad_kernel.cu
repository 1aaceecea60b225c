// The data-gradient GEMMs (dgrad.cuh) on the sm_90a core.
//
// Work item: one 128 x 256 tile of c (rows [128 t, +128) of one expert's segment, columns
// [256 j, +256)), K in 64-wide stages. The items cover the rows' capacity; a tile at or past the
// device total is skipped by every role alike, and a tile's expert is found by binary search over the
// segment starts (segments are 128-row aligned, so a tile never straddles two). Persistent grid,
// row-tile-major so the CTAs running at once share one expert's b in L2. Warpgroup 0: thread 0 issues
// each stage's TMA boxes (a: one 128-row x 64 K box, K-major; b: four 64 K x 64 N boxes, MN-major).
// Warpgroups 1 and 2: the core's mainloop on Tile128Of<0, 1> (rows [64c, +64) of the tile), then bf16
// pairs stored per fragment row. The ring runs on across items.
#include "kernels/sm90/dgrad.cuh"

#include "kernels/cuda_check.cuh"
#include "kernels/sm90/core/kernel.cuh"
#include "kernels/sm90/core/mainloop.cuh"
#include "kernels/sm90/core/ring.cuh"
#include "kernels/sm90/experts.cuh"
#include "kernels/sm90/launch.cuh"
#include "kernels/sm90/tensor_maps.cuh"

namespace epmoe::kernels::sm90 {

inline constexpr uint32_t kDgradProducerRegs = 40, kDgradConsumerRegs = 232;

struct DgradItem {
  int e;        // -1: past the device total (skip)
  int64_t r0;   // first row of the tile
  int n0;
};
__device__ __forceinline__ DgradItem dgrad_item(int64_t w, int n_tiles, const int64_t* off, int experts) {
  DgradItem it;
  const int64_t t = w / n_tiles;
  it.r0 = t * kBM;
  it.n0 = int(w - t * n_tiles) * kBN;
  it.e = -1;
  if (it.r0 >= off[experts]) return it;
  int lo = 0, hi = experts - 1;  // the last e with off[e] <= r0 (its segment holds the tile)
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (off[mid] <= it.r0) lo = mid;
    else hi = mid - 1;
  }
  it.e = lo;
  return it;
}

__global__ void __launch_bounds__(kThreads, 1)
    sm90_dgrad_kernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b,
                      const int64_t* __restrict__ padded_offsets, int experts, int64_t rows, int k, int n,
                      __nv_bfloat16* __restrict__ c) {
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
  const int n_tiles = n / kBN, num_k = k / kBK;
  const int64_t items = rows / kBM * n_tiles;
  using Tile = Tile128Of<0, 1>;
  run_warp_roles<kDgradProducerRegs, kDgradConsumerRegs>(
      [&] {
        if (threadIdx.x != 0) return;
        tma_prefetch_desc(&tm_a);
        tma_prefetch_desc(&tm_b);
        grid_dependency_wait();  // a and the offsets come from the previous kernels (no-op unless PDL-launched)
        RingCursor<kStages> cur;
        for (int64_t w = blockIdx.x; w < items; w += gridDim.x) {
          const DgradItem it = dgrad_item(w, n_tiles, padded_offsets, experts);
          if (it.e < 0) continue;
          for (int kt = 0; kt < num_k; ++kt, cur.advance()) {
            const uint32_t s = cur.stage(), full = ring.full(s);
            ring.wait_empty(cur);
            mbar_arrive_expect_tx(full, kStageBytes);
            const int k0 = kt * kBK;
            const uint32_t a = sA + s * kATileBytes, b = sB + s * kBTileBytes;
            tma_load_2d(a, &tm_a, full, k0, int(it.r0));
#pragma unroll
            for (int j = 0; j < 4; ++j) tma_load_3d(b + j * kMnBlockBytes, &tm_b, full, it.n0 + 64 * j, k0, it.e);
          }
        }
      },
      [&](int cw) {
        const typename Tile::Descs d = Tile::descs(sA, sB, uint32_t(cw) * 8192u);
        const int warp = int(threadIdx.x / 32) & 3, lane = int(threadIdx.x & 31);
        RingCursor<kStages> cur;
        for (int64_t w = blockIdx.x; w < items; w += gridDim.x) {
          const DgradItem it = dgrad_item(w, n_tiles, padded_offsets, experts);
          if (it.e < 0) continue;
          typename Tile::Acc acc;
          Tile::zero(acc);
          ring.wait_full(cur);
          mainloop<Tile>(acc, cur, num_k, ring.full0, d, /*proxy_fence=*/false,
                         [&](uint32_t s, int) { mbar_arrive(ring.empty(s)); }, [](int) {});
          // Fragment: d[4g + 2h + b] = D[16 warp + lane / 4 + 8 h][8 g + 2 (lane % 4) + b].
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int64_t row = it.r0 + 64 * cw + 16 * warp + lane / 4 + 8 * h;
            __nv_bfloat16* out = c + row * n + it.n0 + 2 * (lane % 4);
#pragma unroll
            for (int g = 0; g < 32; ++g)
              *reinterpret_cast<__nv_bfloat162*>(out + 8 * g) =
                  __floats2bfloat162_rn(acc.d[4 * g + 2 * h], acc.d[4 * g + 2 * h + 1]);
          }
        }
      });
#else
  (void)padded_offsets, (void)experts, (void)rows, (void)k, (void)n, (void)c;
#endif
}

}  // namespace epmoe::kernels::sm90

namespace epmoe::kernels {

bool sm90_dgrad_supported(int k, int n) {
  return k > 0 && n > 0 && k % sm90::kBK == 0 && n % sm90::kBN == 0 && sm90_experts_supported_here();
}

void sm90_dgrad_launch(const DgradProblem& p, cudaStream_t stream) {
  using namespace sm90;
  EPMOE_CHECK(p.k > 0 && p.n > 0 && p.k % kBK == 0 && p.n % kBN == 0, ErrorCode::invalid_argument,
              "sm90_dgrad: k must be a multiple of ", kBK, " and n of ", kBN, ", got ", p.k, " x ", p.n);
  EPMOE_CHECK(p.experts > 0 && p.rows >= 0 && p.rows % kBM == 0 && p.rows < int64_t(INT32_MAX),
              ErrorCode::invalid_argument, "sm90_dgrad: rows must be a multiple of ", kBM, " below 2^31, got ",
              p.rows);
  EPMOE_CHECK(p.a && p.b && p.c && p.padded_offsets, ErrorCode::invalid_argument, "sm90_dgrad: null pointer");
  if (p.rows == 0) return;
  const CUtensorMap tm_a = make_matrix_map(p.a, p.rows, p.k, kBM);  // one 64 K x 128-row box
  const CUtensorMap tm_b = make_expert_matrix_map(p.b, p.experts, p.k, p.n, 64);  // 64 N x 64 K boxes
  const int64_t items = p.rows / kBM * (p.n / kBN);
  sm90_launch(sm90_dgrad_kernel, /*cluster=*/false, /*pdl=*/false, items, kRingSmemBytes, stream, "sm90_dgrad_kernel",
              tm_a, tm_b, p.padded_offsets, p.experts, p.rows, p.k, p.n, p.c);
}

}  // namespace epmoe::kernels
