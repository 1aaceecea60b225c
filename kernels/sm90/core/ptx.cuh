// PTX wrappers of the sm_90a kernel core: mbarrier, clusters, TMA (tile loads, multicast, stores),
// bulk copies, cp.async, setmaxnreg, griddepcontrol (PDL), warp-uniform values, vector bf16
// reductions, stmatrix and the quad transpose of the wgmma fragment. The wgmma instructions and
// their shared-memory descriptors are in core/wgmma.cuh.
//
// Everything device-side is compiled only for sm_90a (EPMOE_SM90A_DEVICE); the library's other
// targets (sm_80) see only the constants, and the kernels compile to an empty body there.
#pragma once
#include <cuda.h>  // CUtensorMap
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/sm90/tile_config.h"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define EPMOE_SM90A_DEVICE 1
#else
#define EPMOE_SM90A_DEVICE 0
#endif

namespace epmoe::kernels::sm90 {

// setmaxnreg moves registers between the warpgroups of a CTA: the consumers' .inc can only take what
// the producer's .dec released, else it blocks forever (measured: a 64/224 split hung the DOWN kernel).
// The launch gives every thread 65536 / kThreads registers rounded down to a multiple of 8 (168).
inline constexpr uint32_t kLaunchRegsPerThread = (65536u / uint32_t(kThreads)) / 8u * 8u;
__host__ __device__ inline constexpr bool setmaxnreg_split_fits(uint32_t producer_regs, uint32_t consumer_regs) {
  return producer_regs * 128u + consumer_regs * 2u * 128u <= kLaunchRegsPerThread * uint32_t(kThreads);
}

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

__device__ __forceinline__ void tma_load_5d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                            int c2, int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6, %7}], [%2];"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
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

// ---- warp-uniform values ------------------------------------------------------------------
// Warp-uniform values. HGMMA takes its descriptors from uniform registers; ptxas computes them in the
// uniform datapath (one UIADD3 per warp) only where it can prove the control flow warp-uniform, and
// otherwise builds them in vector registers and copies each with R2UR at every HGMMA (measured:
// ~4.4 R2UR and ~15 vector integer instructions per HGMMA). A value loaded from memory, or derived from
// threadIdx.x, is not provably uniform; redux.sync writes a uniform register, so passing such a value
// through it makes the branches, loop bounds and descriptors built on it uniform (a __shfl_sync
// broadcast does not, by the SASS). Every lane of the warp must call these, holding the same value.
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

// ---- cp.async (16 bytes, L2 only) for the UP kernel's fused row gather ---------------------------
// Copies 16 bytes, or writes 16 zero bytes when src_bytes == 0 (the source is then not read).
__device__ __forceinline__ void cp_async_16_zfill(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// 4-byte copy (the MX kernels' per-stage scale bytes of a row), zero-filled when src_bytes is 0.
__device__ __forceinline__ void cp_async_4_zfill(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ uint32_t ld_shared_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ void st_shared_f32(uint32_t addr, float v) {
  asm volatile("st.shared.f32 [%0], %1;" ::"r"(addr), "f"(v) : "memory");
}
// Byte-wide shared accesses (the fused MX pipeline's one-byte W2 scales per row).
__device__ __forceinline__ uint32_t ld_shared_u8(uint32_t addr) {
  uint16_t v;
  asm volatile("ld.shared.u8 %0, [%1];" : "=h"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ void st_shared_u8(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u8 [%0], %1;" ::"r"(addr), "h"(uint16_t(v)) : "memory");
}
__device__ __forceinline__ void st_shared_16(uint32_t addr, const uint32_t (&w)[4]) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3])
               : "memory");
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

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low 16 bits, lower address) = lo
  return *reinterpret_cast<uint32_t*>(&v);
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
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];"
               ::"l"(reinterpret_cast<uint64_t>(map)), "r"(src), "r"(c0), "r"(c1), "r"(c2)
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
// At most one committed bulk group (the latest) may still be reading its shared-memory source.
__device__ __forceinline__ void bulk_wait_read_one() { asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory"); }
// Bulk reduction out[0, bytes) += src[0, bytes) as bf16 (element by element, as red.global.add.bf16;
// subnormals kept): src a 16-byte aligned shared::cta address, bytes a multiple of 16, out 16-byte
// aligned; completes in the thread's current bulk group.
__device__ __forceinline__ void bulk_reduce_add_bf16(void* out, uint32_t src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.noftz.bf16 [%0], [%1], %2;"
               ::"l"(reinterpret_cast<uint64_t>(out)), "r"(src), "r"(bytes)
               : "memory");
}
// All committed bulk stores have completed (their global writes done).
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// Barrier among `threads` threads of the CTA on named barrier `id` (1..15; 0 is __syncthreads).
// bar.sync is the .aligned form: every participating warp executes this same instruction, converged
// (the __syncwarp makes sure of the latter after lane-predicated code).
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  __syncwarp();
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// The same barrier for warps that reach it from different instructions (barrier.sync without
// .aligned): consume_item's half-item barrier, which the idle warpgroup meets on its early path and
// the working one after its k loop (compute-sanitizer synccheck reports the .aligned form there as
// "divergent thread(s) in block").
__device__ __forceinline__ void named_barrier_sync_any_pc(uint32_t id, uint32_t threads) {
  __syncwarp();
  asm volatile("barrier.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
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

#endif  // EPMOE_SM90A_DEVICE

}  // namespace epmoe::kernels::sm90
