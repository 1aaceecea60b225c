// wgmma of the sm_90a kernel core: the shared-memory matrix descriptors (128B swizzle, K-major or
// MN-major), the fence / commit / wait group, and wgmma.mma_async m64nNk16 bf16 -> fp32 for the N the
// kernels use (256: the 128-row tiles; 128: the 192-row tiles' extra rows), A and B each K-major or
// MN-major (the transpose immediates). One specialization per N because the instruction's
// accumulator list is fixed per shape. Fragment of an m64nN result: warp w of the warpgroup, lane l:
// d[4g + 2h + b] = D[16w + l/4 + 8h][8g + 2(l%4) + b].
#pragma once
#include <cstdint>

#include "kernels/sm90/core/ptx.cuh"

namespace epmoe::kernels::sm90 {
#if EPMOE_SM90A_DEVICE

// ---- descriptors ------------------------------------------------------------------------------
// Bits 0-13 start address >> 4; 16-29 leading byte offset >> 4; 32-45 stride byte offset >> 4; 49-51
// base offset (0: atoms 1024-aligned); 62-63 layout 1 = SWIZZLE_128B. Built from two words, so a k
// loop adds its stage and k16 offsets to the low word alone (32-bit adds): the start address field
// cannot carry into bit 16, as shared memory ends below 2^18 bytes.
//
// K-major (a TMA box of 64 K elements = 128 B per row, rows in 8-row atoms of 1024 B): leading offset
// unused (1 by convention), stride offset 1024 B between 8-row atoms. A k16 step inside the 64-wide
// tile advances the start address by 32 B (descriptor + 2).
__device__ __forceinline__ uint32_t smem_desc_sw128_lo(uint32_t saddr) { return ((saddr & 0x3FFFFu) >> 4) | (1u << 16); }
inline constexpr uint32_t kSmemDescSw128Hi = (1024u >> 4) | (1u << 30);
__device__ __forceinline__ uint64_t smem_desc_sw128_join(uint32_t lo) {
  return (uint64_t(kSmemDescSw128Hi) << 32) | lo;
}
__device__ __forceinline__ uint64_t smem_desc_sw128(uint32_t saddr) { return smem_desc_sw128_join(smem_desc_sw128_lo(saddr)); }
// MN-major (TMA boxes of 64 MN elements = 128 B per row, one row per k, 8 k rows per 1024-B atom;
// the MN extent in blocks of 64 elements `mn_block_bytes` apart): leading offset = mn_block_bytes
// (from one 64-element MN block to the next), stride offset 1024 B (from one 8-k atom to the next).
// A k16 step advances the start address by two atoms, 2048 B (descriptor + 128).
__device__ __forceinline__ uint64_t smem_desc_sw128_mn(uint32_t saddr, uint32_t mn_block_bytes) {
  const uint32_t lo = ((saddr & 0x3FFFFu) >> 4) | (((mn_block_bytes >> 4) & 0x3FFFu) << 16);
  return (uint64_t(kSmemDescSw128Hi) << 32) | lo;
}
// K-major, 64B swizzle (rows of 32 K elements = 64 B, 8-row atoms of 512 B, 512-aligned): the fused
// pipeline's DOWN operands, whose K is one item's 32 act columns. Leading offset unused (1), stride
// offset 512 B, layout 2 = SWIZZLE_64B; a k16 step advances the start address by 32 B, as above. In
// such a tile the 16-byte chunk c of row r sits at chunk c ^ ((r / 2) % 4) (TMA's SWIZZLE_64B).
__device__ __forceinline__ uint64_t smem_desc_sw64(uint32_t saddr) {
  const uint32_t lo = ((saddr & 0x3FFFFu) >> 4) | (1u << 16);
  return (uint64_t((512u >> 4) | (2u << 30)) << 32) | lo;
}
// K-major, 32B swizzle (rows of 32 bytes: one k32 block of E4M3, 8-row atoms of 256 B, 256-aligned):
// the fused MX pipeline's DOWN operands, whose K is one MX block of act columns. Leading offset unused
// (1), stride offset 256 B, layout 3 = SWIZZLE_32B. The 16-byte chunk c of row r sits at chunk
// c ^ ((r / 4) % 2) (TMA's SWIZZLE_32B).
__device__ __forceinline__ uint64_t smem_desc_sw32(uint32_t saddr) {
  const uint32_t lo = ((saddr & 0x3FFFFu) >> 4) | (1u << 16);
  return (uint64_t((256u >> 4) | (3u << 30)) << 32) | lo;
}
inline constexpr uint32_t kMnBlockBytes = 64 * kBK * 2;   // one TMA box of 64 MN x 64 K elements
inline constexpr uint32_t kMnMajorK16Step = 2048u >> 4;  // descriptor units per k16 step (MN-major)
inline constexpr uint32_t kKMajorK16Step = 32u >> 4;     // (K-major)

// ---- issue / wait ---------------------------------------------------------------------------------
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator reads/writes across wgmma issue/wait points.
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The 64 accumulators of an m64n128 fragment (or a half of m64n256's) as inline-asm operands
// d[o] .. d[o + 63], and their names %0 .. %63 in the instruction's accumulator list.
#define EPMOE_WGMMA_ACC64(d, o) \
  "+f"(d[(o) + 0]), "+f"(d[(o) + 1]), "+f"(d[(o) + 2]), "+f"(d[(o) + 3]), "+f"(d[(o) + 4]), \
  "+f"(d[(o) + 5]), "+f"(d[(o) + 6]), "+f"(d[(o) + 7]), "+f"(d[(o) + 8]), "+f"(d[(o) + 9]), \
  "+f"(d[(o) + 10]), "+f"(d[(o) + 11]), "+f"(d[(o) + 12]), "+f"(d[(o) + 13]), "+f"(d[(o) + 14]), \
  "+f"(d[(o) + 15]), "+f"(d[(o) + 16]), "+f"(d[(o) + 17]), "+f"(d[(o) + 18]), "+f"(d[(o) + 19]), \
  "+f"(d[(o) + 20]), "+f"(d[(o) + 21]), "+f"(d[(o) + 22]), "+f"(d[(o) + 23]), "+f"(d[(o) + 24]), \
  "+f"(d[(o) + 25]), "+f"(d[(o) + 26]), "+f"(d[(o) + 27]), "+f"(d[(o) + 28]), "+f"(d[(o) + 29]), \
  "+f"(d[(o) + 30]), "+f"(d[(o) + 31]), "+f"(d[(o) + 32]), "+f"(d[(o) + 33]), "+f"(d[(o) + 34]), \
  "+f"(d[(o) + 35]), "+f"(d[(o) + 36]), "+f"(d[(o) + 37]), "+f"(d[(o) + 38]), "+f"(d[(o) + 39]), \
  "+f"(d[(o) + 40]), "+f"(d[(o) + 41]), "+f"(d[(o) + 42]), "+f"(d[(o) + 43]), "+f"(d[(o) + 44]), \
  "+f"(d[(o) + 45]), "+f"(d[(o) + 46]), "+f"(d[(o) + 47]), "+f"(d[(o) + 48]), "+f"(d[(o) + 49]), \
  "+f"(d[(o) + 50]), "+f"(d[(o) + 51]), "+f"(d[(o) + 52]), "+f"(d[(o) + 53]), "+f"(d[(o) + 54]), \
  "+f"(d[(o) + 55]), "+f"(d[(o) + 56]), "+f"(d[(o) + 57]), "+f"(d[(o) + 58]), "+f"(d[(o) + 59]), \
  "+f"(d[(o) + 60]), "+f"(d[(o) + 61]), "+f"(d[(o) + 62]), "+f"(d[(o) + 63])
#define EPMOE_WGMMA_ACC64_NAMES                                                                          \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "      \
  "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "     \
  "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, "     \
  "%59, %60, %61, %62, %63"

// ---- D[64 x N] (+)= A[64 x 16] * B[N x 16]^T --------------------------------------------------
// kTransA / kTransB: 0 = K-major in shared memory, 1 = MN-major. scale_d 0 overwrites D.
template <int N, int kTransA = 0, int kTransB = 0>
struct Wgmma;
template <int kTransA, int kTransB>
struct Wgmma<256, kTransA, kTransB> {
  static constexpr int kAcc = 128;
  static __device__ __forceinline__ void mma(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int scale_d = 1) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
        "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "
        "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, "
        "%59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, "
        "%78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, "
        "%97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, "
        "%113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p, 1, 1, %131, %132;\n"
        "}\n"
        : EPMOE_WGMMA_ACC64(d, 0), EPMOE_WGMMA_ACC64(d, 64)
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB));
  }
};

template <int kTransA, int kTransB>
struct Wgmma<128, kTransA, kTransB> {
  static constexpr int kAcc = 64;
  static __device__ __forceinline__ void mma(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d = 1) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{" EPMOE_WGMMA_ACC64_NAMES
        "}, %64, %65, p, 1, 1, %67, %68;\n"
        "}\n"
        : EPMOE_WGMMA_ACC64(d, 0)
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB));
  }
};

#endif  // EPMOE_SM90A_DEVICE
}  // namespace epmoe::kernels::sm90
