// The shared-memory ring of the sm_90a kernel core: kS stages, each with a `full` mbarrier (the
// producer's expect_tx plus the bytes of its loads, and any cp.async arrivals) and an `empty`
// mbarrier (one arrival per consumer thread, of both CTAs in a cluster). The ring runs on across
// work items: use u (counted over all items of a CTA) takes stage u % kS in round u / kS; full[s]
// completes once per round (parity round & 1), empty[s] once per round when the consumers release it.
//
// RingCursor walks the uses without divisions: power-of-two rings keep one counter (stage and parity
// are its bits), others a (stage, parity) pair.
#pragma once
#include <cstdint>

#include "kernels/sm90/core/ptx.cuh"

namespace epmoe::kernels::sm90 {
#if EPMOE_SM90A_DEVICE

template <int kS>
struct RingCursor {
  static constexpr bool kPow2 = (kS & (kS - 1)) == 0;
  uint32_t u = 0;                  // power-of-two rings: uses so far
  uint32_t s = 0, ph = 0, n = 0;   // others: stage, parity of its round, uses so far
  __device__ __forceinline__ uint32_t stage() const { return kPow2 ? u % uint32_t(kS) : s; }
  __device__ __forceinline__ uint32_t parity() const { return kPow2 ? (u / uint32_t(kS)) & 1u : ph; }
  __device__ __forceinline__ uint32_t uses() const { return kPow2 ? u : n; }
  // The stage of the use before this one.
  __device__ __forceinline__ uint32_t prev_stage() const {
    return kPow2 ? (u - 1u) % uint32_t(kS) : (s == 0 ? uint32_t(kS) - 1u : s - 1u);
  }
  // The parity of the round before this use's: what an empty wait waits for (valid once uses() >= kS).
  __device__ __forceinline__ uint32_t prev_parity() const { return parity() ^ 1u; }
  __device__ __forceinline__ void advance() {
    if constexpr (kPow2) {
      ++u;
    } else {
      ++n;
      if (++s == uint32_t(kS)) s = 0, ph ^= 1u;
    }
  }
  __device__ __forceinline__ void advance(uint32_t count) {
    if constexpr (kPow2) u += count;
    else for (uint32_t i = 0; i < count; ++i) advance();
  }
};

template <int kS>
struct Ring {
  static constexpr int kStagesN = kS;
  uint32_t full0, empty0;  // shared addresses of full[0] and empty[0]; stage s's are 8 s further
  __device__ __forceinline__ uint32_t full(uint32_t s) const { return full0 + 8 * s; }
  __device__ __forceinline__ uint32_t empty(uint32_t s) const { return empty0 + 8 * s; }

  // Thread 0 (before any use): full[s] expects `full_count` arrivals (plus its bytes), empty[s]
  // `empty_count` (kConsumerThreads, doubled in a cluster: the peer's multicast writes here too).
  // The caller fences (mbar_fence_init) and synchronizes after its own inits.
  __device__ __forceinline__ void init(uint32_t full_count, uint32_t empty_count) const {
#pragma unroll
    for (int s = 0; s < kS; ++s) {
      mbar_init(full(uint32_t(s)), full_count);
      mbar_init(empty(uint32_t(s)), empty_count);
    }
  }
  // The producer before refilling the cursor's stage: waits for the consumers' release of its previous
  // round (the first round needs none).
  __device__ __forceinline__ void wait_empty(const RingCursor<kS>& c) const {
    if (c.uses() >= uint32_t(kS)) mbar_wait(empty(c.stage()), c.prev_parity());
  }
  __device__ __forceinline__ void wait_full(const RingCursor<kS>& c) const { mbar_wait(full(c.stage()), c.parity()); }
};

// A consumer thread's release of stage s: n arrivals (2 when it also stands in for the thread of an
// idle warpgroup) on this CTA's empty barrier and, in a cluster, on the peer's (its multicast writes
// into this ring). Every consumer thread arrives, not one lane per warp: an arrival releases only the
// arriving thread's own earlier accesses, and every lane has read the stage's item slot, which the
// producer rewrites after its empty wait (compute-sanitizer racecheck reports exactly that once a CTA
// runs several items; a __syncwarp before lane 0's arrival does not satisfy it).
template <bool kCluster>
__device__ __forceinline__ void release_stage(uint32_t empty0, uint32_t peer_empty0, uint32_t s, uint32_t n) {
  mbar_arrive(empty0 + 8 * s, n);
  if constexpr (kCluster) mbar_arrive_remote(peer_empty0 + 8 * s, n);
}

// First 1024-aligned shared-memory byte at or after p (alignment judged on the shared address): the
// ring's base, so that every stage's tiles start on a 128B-swizzle atom.
__device__ __forceinline__ uint8_t* align_1024(uint8_t* p) {
  const uint32_t pad = (1024u - (smem_u32(p) & 1023u)) & 1023u;
  return p + pad;
}

#endif  // EPMOE_SM90A_DEVICE
}  // namespace epmoe::kernels::sm90
