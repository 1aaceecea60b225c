// PTX wrappers for the sm_90a split pipeline (kernels/sm90_up_kernel.cu, sm90_down_kernel.cu):
// mbarrier, TMA tile loads, wgmma (descriptors, fence/commit/wait, m64n256k16 bf16), setmaxnreg,
// griddepcontrol (PDL), vector bf16 reductions, and the quad transpose used by both epilogues.
// The kernels' work items, item hand-off and k loop are in kernels/sm90_work_items.cuh.
//
// Everything device-side is compiled only for sm_90a (EPMOE_SM90A_DEVICE); the library's other
// targets (sm_80) see only the constants, and the kernels compile to an empty body there.
#pragma once
#include <cuda.h>  // CUtensorMap
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/expert_problem.cuh"
#include "kernels/sm90_schedule.cuh"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define EPMOE_SM90A_DEVICE 1
#else
#define EPMOE_SM90A_DEVICE 0
#endif

namespace epmoe::kernels::sm90 {

// ---- tiling shared by both kernels ------------------------------------------------------------
inline constexpr int kBM = kExpertTile;          // rows per CTA tile (one expert segment tile)
inline constexpr int kBK = 64;                   // K per stage: 64 bf16 = one 128-byte swizzle row
inline constexpr int kBN = 256;                  // wgmma N (UP: 128 gate + 128 up rows of W1; DOWN: output cols)
inline constexpr int kStages = 4;                // smem ring depth
inline constexpr int kThreads = 384;             // warpgroup 0 = producer, 1..2 = consumers
inline constexpr int kConsumerThreads = 256;     // arrivals on an empty barrier per phase (release_stage)
inline constexpr uint32_t kATileBytes = kBM * kBK * 2;  // 16 KB
inline constexpr uint32_t kBTileBytes = kBN * kBK * 2;  // 32 KB
inline constexpr uint32_t kStageBytes = kATileBytes + kBTileBytes;
// Dynamic smem: 1 KB slack to align the ring to 1024 B (128B-swizzle atoms), then the ring.
// The 2*kStages mbarriers live in static shared memory (their presence in the sm_90a image is
// what sm90_experts_supported() checks).
inline constexpr size_t kDynSmemBytes = 1024 + size_t(kStages) * kStageBytes;
// setmaxnreg moves registers between the warpgroups of a CTA: the consumers' .inc can only take what
// the producer's .dec released, else it blocks forever (measured: a 64/224 split hung the DOWN kernel).
// The launch gives every thread 65536 / kThreads registers rounded down to a multiple of 8 (168).
inline constexpr uint32_t kLaunchRegsPerThread = (65536u / uint32_t(kThreads)) / 8u * 8u;
inline constexpr bool setmaxnreg_split_fits(uint32_t producer_regs, uint32_t consumer_regs) {
  return producer_regs * 128u + consumer_regs * 2u * 128u <= kLaunchRegsPerThread * uint32_t(kThreads);
}
// DOWN's staged epilogue (sm90_down_kernel.cu): per consumer warpgroup a 64-row x 128-column bf16
// buffer (one half of an item's 256 columns), then the 2 x 64 output rows and the 2 item headers,
// after the ring; reduced into out by warps 1..3 of the producer warpgroup.
inline constexpr int kReducerWarps = 3;
inline constexpr uint32_t kStageHalfBytes = 64 * 128 * 2;  // 16 KB
inline constexpr size_t kDownStagingBytes = 2 * size_t(kStageHalfBytes) + 2 * 64 * sizeof(int32_t) + 2 * 8;
// UP's staged epilogue: per consumer warpgroup its 64 rows x 128 activation columns as two TMA boxes
// of 64 rows x 64 columns (128B-swizzled, 8 KB each), after the ring.
inline constexpr uint32_t kUpStagingBytes = 2 * 2 * 64 * 128;  // 32 KB
// Static shared memory of a kernel (barriers, item slots), which the opt-in limit also covers.
inline constexpr size_t kStaticSmemReserve = 256;
static_assert(kBM == 128, "the consumer split (2 warpgroups x 64 rows) assumes 128-row tiles");
static_assert(kDownStagingBytes % 16 == 0, "the schedule after the staging buffers wants 16-byte alignment");
static_assert(kDynSmemBytes <= 227 * 1024, "smem ring exceeds the sm_90 opt-in limit");
static_assert(kATileBytes % 1024 == 0 && kBTileBytes % 1024 == 0, "tiles must keep 1024 B alignment");

#if EPMOE_SM90A_DEVICE

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarrier ---------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// Makes the inits visible to the async proxy (TMA complete_tx) and to the other threads.
__device__ __forceinline__ void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// `count` arrivals at once (a warp releasing a stage for itself and an idle partner warp).
__device__ __forceinline__ void mbar_arrive(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// Blocks until the phase with the given parity has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// ---- 2-CTA thread-block clusters (both kernels' B-multicast variant) ----------------------------
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// Linear id of this CTA's cluster and the number of clusters (1-D clusters in a 1-D grid).
__device__ __forceinline__ uint32_t cluster_id_x() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t nclusters_x() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(r));
  return r;
}
// shared::cluster address of the object at shared::cta address `addr` in cluster CTA `rank` (every
// CTA of a kernel has the same smem layout, so this is the peer's copy of the same barrier).
__device__ __forceinline__ uint32_t mapa_shared(uint32_t addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
// Arrive (count 1) on a peer CTA's mbarrier with the default semantics (release at CTA scope), as
// CUTLASS's ClusterBarrier::arrive(cta_id). Enough for the empty barriers: an arrival only says that
// this CTA's wgmma reads of a slot have completed (wgmma.wait_group), it publishes no data. The
// .release.cluster form costs a MEMBAR per arrive in the wgmma issue path (measured 35-40% slower).
__device__ __forceinline__ void mbar_arrive_remote(uint32_t cluster_bar, uint32_t count = 1) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0], %1;" ::"r"(cluster_bar), "r"(count) : "memory");
}
// Every thread of every CTA of the cluster; release/acquire at cluster scope (also a CTA barrier).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire;" ::: "memory");
}

// ---- TMA (tile mode, completes on an mbarrier) --------------------------------------------------
__device__ __forceinline__ void tma_prefetch_desc(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                            int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                            int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// Multicast form: the box lands at the same CTA-relative smem offset `dst` in every CTA of the
// cluster whose bit is set in cta_mask, and each of them gets the complete_tx (the box's bytes) on
// its own mbarrier at the CTA-relative offset `bar`.
__device__ __forceinline__ void tma_load_3d_multicast(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0,
                                                      int c1, int c2, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4, %5}], [%2], %6;"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "h"(cta_mask)
      : "memory");
}

// ---- wgmma --------------------------------------------------------------------------------------
// Shared-memory matrix descriptor for a K-major bf16 tile written by TMA with 128B swizzle: rows of
// 64 elements (128 B), 8-row atoms of 1024 B. Bits 0-13 start address >> 4; 16-29 leading byte
// offset >> 4 (unused for swizzled K-major, 1 by convention); 32-45 stride byte offset >> 4 (1024 B
// between 8-row atoms); 49-51 base offset (0: atoms 1024-aligned); 62-63 layout 1 = SWIZZLE_128B.
// A k16 step inside the 64-wide tile advances the start address by 32 B (descriptor + 2).
// Built from two words, so a k loop can add its stage and k16 offsets to the low word alone (32-bit
// adds): the start address field cannot carry into bit 16, as shared memory ends below 2^18 bytes.
__device__ __forceinline__ uint32_t smem_desc_sw128_lo(uint32_t saddr) { return ((saddr & 0x3FFFFu) >> 4) | (1u << 16); }
inline constexpr uint32_t kSmemDescSw128Hi = (1024u >> 4) | (1u << 30);
__device__ __forceinline__ uint64_t smem_desc_sw128_join(uint32_t lo) {
  return (uint64_t(kSmemDescSw128Hi) << 32) | lo;
}
__device__ __forceinline__ uint64_t smem_desc_sw128(uint32_t saddr) { return smem_desc_sw128_join(smem_desc_sw128_lo(saddr)); }
// Warp-uniform values. HGMMA takes its descriptors from uniform registers; ptxas computes them in the
// uniform datapath (one UIADD3 per warp) only where it can prove the control flow warp-uniform, and
// otherwise builds them in vector registers and copies each with R2UR at every HGMMA (ncu S36-5:
// ~4.4 R2UR and ~15 vector integer instructions per HGMMA). A value loaded from memory, or derived from
// threadIdx.x, is not provably uniform; redux.sync writes a uniform register, so passing such a value
// through it makes the branches, loop bounds and descriptors built on it uniform (a __shfl_sync
// broadcast does not: SASS, session 37). Every lane of the warp must call these, holding the same value.
__device__ __forceinline__ uint32_t warp_uniform_u32(uint32_t v) { return __reduce_max_sync(0xffffffffu, v); }
__device__ __forceinline__ int32_t warp_uniform_i32(int32_t v) { return int32_t(warp_uniform_u32(uint32_t(v))); }
__device__ __forceinline__ int64_t warp_uniform_i64(int64_t v) {
  const uint64_t u = uint64_t(v);
  return int64_t((uint64_t(warp_uniform_u32(uint32_t(u >> 32))) << 32) | warp_uniform_u32(uint32_t(u)));
}
// This thread's warpgroup (0 = producer), provably warp-uniform. All lanes active.
__device__ __forceinline__ int warpgroup_index() { return int(warp_uniform_u32(threadIdx.x / 128)); }
// An opaque copy: the compiler cannot recompute the result from the shared-memory symbol it came
// from, so a value hoisted out of a loop stays in one register instead of being rematerialized
// (several integer instructions per k step in the consumers' issue path).
__device__ __forceinline__ uint32_t pin_u32(uint32_t v) {
  uint32_t r;
  asm volatile("mov.b32 %0, %1;" : "=r"(r) : "r"(v));
  return r;
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator reads/writes across wgmma issue/wait points.
__device__ __forceinline__ void fence_regs(float (&d)[128]) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D[64 x 256] (+)= A[64 x 16] * B[256 x 16]^T, both K-major in smem, fp32 accumulate.
// Fragment: warp w of the warpgroup, lane l: d[4g + 2h + b] = D[16w + l/4 + 8h][8g + 2(l%4) + b].
__device__ __forceinline__ void wgmma_m64n256k16_bf16(float (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                                      int scale_d) {
  asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63,"
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79,"
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95,"
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111,"
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// ---- cp.async (16 bytes, L2 only) for the UP kernel's fused row gather ---------------------------
// Copies 16 bytes, or writes 16 zero bytes when src_bytes == 0 (the source is then not read).
__device__ __forceinline__ void cp_async_16_zfill(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits for all of this thread's cp.async copies, committed or not.
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
// Arrive (without incrementing the pending count) on an mbarrier once all of this thread's prior
// cp.async copies have completed: the copy engine signals, the thread goes on.
__device__ __forceinline__ void cp_async_mbar_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
// Orders this thread's completed generic-proxy shared-memory writes (cp.async, st.shared) before
// later async-proxy accesses (wgmma operand reads) that synchronize with it.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// ---- misc -------------------------------------------------------------------------------------
template <uint32_t N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}
template <uint32_t N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}
// PDL: wait until the preceding grid (if launched as its programmatic dependent) has completed and
// its writes are visible; a no-op when this grid was launched normally.
__device__ __forceinline__ void grid_dependency_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void grid_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// 1/x to ~1 ulp (rcp.approx); 1/inf = 0, so silu(-large) below comes out as -0, not NaN.
__device__ __forceinline__ float fast_rcp(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
// silu(x) = x * sigmoid(x). The IEEE division it replaces cost ~10 instructions per element in
// the UP epilogue, where the tensor cores idle (64 per thread per item). Two MUFU ops (ex2, rcp).
__device__ __forceinline__ float silu(float x) { return x * fast_rcp(1.0f + __expf(-x)); }
// The same with ONE MUFU op and three FP32 ops: sigmoid(x) = (1 + tanh(x/2)) / 2, so silu(x) =
// h + h tanh(h), h = x/2. UP's SwiGLU (64 elements per thread per item, both warpgroups in the
// epilogue at once) runs with the tensor cores idle; this form made the layer 0.8-2.6% faster than
// ex2 + rcp (PERF session 11), while ex2 with a Newton reciprocal (one MUFU op but ten FP32/INT
// ops) was 0.3-2% slower: MUFU ops (a quarter of the FP32 rate) and issue slots both count.
// Accuracy: absolute, |x| 2^-18 at worst on the H200 (the PTX ISA's 2^-11 for tanh.approx would
// allow |x| 2^-12; Sm90Experts.SiluFormsAccuracy asserts |x| 2^-14); the suite's errors did not move.
__device__ __forceinline__ float tanh_approx(float x) {
  float r;
  asm("tanh.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ float silu_tanh(float x) {
  const float h = 0.5f * x;
  return fmaf(h, tanh_approx(h), h);
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low 16 bits, lower address) = lo
  return *reinterpret_cast<uint32_t*>(&v);
}
// UP's SwiGLU of one consumer thread's item: word j = bf16x2(silu(gate[2j]) * up[2j], silu(gate[2j+1])
// * up[2j+1]), the gate value and its up partner at the same fragment position. The 128-row kernel
// passes its folded accumulator (gate columns in acc[0, 64), their up partners in acc[64, 128)),
// the granular kernel its two accumulators. The branch on the form is taken once per item, outside
// the elements.
template <int W, typename Silu>
__device__ __forceinline__ void swiglu_words_with(uint32_t (&w)[W], const float* gate, const float* up, Silu silu_fn) {
#pragma unroll
  for (int j = 0; j < W; ++j)
    w[j] = pack_bf16x2(silu_fn(gate[2 * j]) * up[2 * j], silu_fn(gate[2 * j + 1]) * up[2 * j + 1]);
}
template <int W>
__device__ __forceinline__ void swiglu_words(uint32_t (&w)[W], const float* gate, const float* up, bool tanh_form) {
  if (tanh_form) swiglu_words_with(w, gate, up, [](float x) { return silu_tanh(x); });
  else swiglu_words_with(w, gate, up, [](float x) { return silu(x); });
}
// 16-byte store (address 16-byte aligned).
__device__ __forceinline__ void st_global_16(void* dst, const uint32_t (&w)[4]) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3])
               : "memory");
}
// out[0..7] += 8 bf16 (4 packed words), in the memory system; 16-byte aligned address.
__device__ __forceinline__ void red_add_bf16x8(__nv_bfloat16* dst, const uint32_t (&w)[4]) {
  asm volatile("red.global.add.noftz.v4.bf16x2 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(w[0]), "r"(w[1]),
               "r"(w[2]), "r"(w[3])
               : "memory");
}

// Four 8x8 b16 matrices to shared memory: lanes 8i..8i+7 give the row addresses (16 B each) of matrix
// i; each lane's w[i] holds its two elements of matrix i (row lane/4, columns 2(lane%4), +1) - the
// mma accumulator fragment, so a wgmma result stores without shuffles.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&w)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(w[0]), "r"(w[1]),
               "r"(w[2]), "r"(w[3])
               : "memory");
}
// The same with .trans: lane l's register i holds row l/4, columns 2(l%4) and +1 of matrix i (the
// mma fragment); each 8x8 matrix is stored transposed - row j of the stored matrix (its 16 bytes at
// the address lane 8i + j gives) is column j of the fragment.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, const uint32_t (&w)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(w[0]),
               "r"(w[1]), "r"(w[2]), "r"(w[3])
               : "memory");
}
__device__ __forceinline__ void ld_shared_16(uint32_t addr, uint32_t (&w)[4]) {
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
               : "r"(addr)
               : "memory");
}

// TMA tile store shared -> global (bulk-group completion) and its waits.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, uint32_t src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];"
               ::"l"(reinterpret_cast<uint64_t>(map)), "r"(src), "r"(c0), "r"(c1)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Bulk copy of `bytes` (a multiple of 16) from this CTA's shared memory to a cluster peer's: dst and
// bar are shared::cluster addresses (mapa_shared); the peer's mbarrier `bar` gets complete_tx(bytes)
// once they have landed. src is read through the async proxy (fence generic writes to it first).
__device__ __forceinline__ void bulk_copy_to_peer(uint32_t dst, uint32_t src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "r"(src), "r"(bytes), "r"(bar)
               : "memory");
}
// The source shared memory of all committed bulk stores may be rewritten.
__device__ __forceinline__ void bulk_wait_read_all() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// All committed bulk stores have completed (their global writes done).
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// Barrier among `threads` threads of the CTA on named barrier `id` (1..15; 0 is __syncthreads).
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// 4x4 transpose of 32-bit words across the 4 lanes of a quad (lanes 4i..4i+3), q = lane % 4:
// before, lane q holds w[g] = M[q][g]; after, lane q holds w[j] = M[j][q]. In the wgmma fragment
// lane q of a quad holds columns 8g + 2q, 8g + 2q + 1 of 4 consecutive 8-column groups g; after
// the transpose it holds all 8 columns of group q, i.e. 16 contiguous bytes. All 32 lanes must
// call it (shuffles); register indices are compile-time constants.
__device__ __forceinline__ void quad_transpose(uint32_t (&w)[4], int q) {
  // Stage 1: swap the off-diagonal 2x2 blocks between lanes q and q^2.
  const bool hi2 = (q & 2) != 0;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const uint32_t send = hi2 ? w[r] : w[r + 2];
    const uint32_t recv = __shfl_xor_sync(0xffffffffu, send, 2);
    if (hi2) w[r] = recv; else w[r + 2] = recv;
  }
  // Stage 2: transpose each 2x2 block between lanes q and q^1.
  const bool hi1 = (q & 1) != 0;
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const uint32_t send = hi1 ? w[2 * s] : w[2 * s + 1];
    const uint32_t recv = __shfl_xor_sync(0xffffffffu, send, 1);
    if (hi1) w[2 * s] = recv; else w[2 * s + 1] = recv;
  }
}

// Expert owning the 128-row tile at m0 (< padded_offsets[experts]): the largest e with
// padded_offsets[e] <= m0, i.e. (count of e in [0, E) with padded_offsets[e] <= m0) - 1, since the
// offsets are non-decreasing (empty experts repeat a value). Whole warp; every lane gets the result.
__device__ __forceinline__ int expert_of_tile(const int64_t* __restrict__ padded_offsets, int experts, int64_t m0) {
  const int lane = threadIdx.x & 31;
  int count = 0;
  for (int base = 0; base < experts; base += 32) {
    const int e = base + lane;
    const bool le = e < experts && padded_offsets[e] <= m0;
    count += __popc(__ballot_sync(0xffffffffu, le));
  }
  return count - 1;
}

#endif  // EPMOE_SM90A_DEVICE

}  // namespace epmoe::kernels::sm90
