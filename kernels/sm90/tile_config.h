// The sm_90a kernels' tile geometry and shared-memory budget, as plain C++ constants: the kernels
// (device code) and the heuristics tier (host C++, kernels/heuristics/) must agree on them, so they
// are defined once here and static_assert'ed where they meet. No CUDA headers.
#pragma once
#include <cstddef>
#include <cstdint>

namespace epmoe::kernels::sm90 {

#if defined(__CUDACC__)
#define EPMOE_TILE_HD __host__ __device__
#else
#define EPMOE_TILE_HD
#endif
// Tiles over a dimension that need not be a multiple of the tile (hidden, ffn: multiples of 16);
// host and device (the launchers and the work-item schedules both count tiles with it).
EPMOE_TILE_HD inline constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
inline constexpr int kDimMultiple = 16;  // hidden and ffn: TMA's 16-byte strides, the 16-byte row chunks
// The 192-row UP's interleaved W1 map tiles ffn in whole 128-row blocks (tensor_maps.cuh).
inline constexpr bool tall_up_dims(int ffn) { return ffn % 128 == 0; }

// ---- the 128-row tile (UP, pair UP, DOWN) -----------------------------------------------------
inline constexpr int kBM = 128;       // rows per tile: one expert-segment tile, two consumer warpgroups x 64
inline constexpr int kBK = 64;        // K per ring stage: 64 bf16 = one 128-byte swizzle row
inline constexpr int kBN = 256;       // wgmma N (UP: 128 gate + 128 up rows of W1; DOWN: output columns)
inline constexpr int kStages = 4;     // ring depth
inline constexpr int kThreads = 384;  // warpgroup 0 = producer, 1..2 = consumers
inline constexpr int kConsumerThreads = 256;
inline constexpr uint32_t kATileBytes = kBM * kBK * 2;  // 16 KB
inline constexpr uint32_t kBTileBytes = kBN * kBK * 2;  // 32 KB
inline constexpr uint32_t kStageBytes = kATileBytes + kBTileBytes;
// Dynamic shared memory: 1 KB of slack to align the ring to 1024 B (128B-swizzle atoms), the ring.
inline constexpr size_t kRingSmemBytes = 1024 + size_t(kStages) * kStageBytes;
// UP's staged epilogue: per consumer warpgroup its 64 rows x 128 act columns as two 64x64 TMA boxes.
inline constexpr uint32_t kUpStagingBytes = 2 * 2 * 64 * 128;  // 32 KB
// DOWN's staged epilogue: per consumer warpgroup a 64 x 128 bf16 half, the 2 x 64 out rows, 2 headers.
inline constexpr uint32_t kStageHalfBytes = 64 * 128 * 2;  // 16 KB
inline constexpr size_t kDownStagingBytes = 2 * size_t(kStageHalfBytes) + 2 * 64 * sizeof(int32_t) + 2 * 8;
inline constexpr int kReducerWarps = 3;  // DOWN: warps 1..3 of the producer warpgroup reduce into out

// ---- the 192-row tile (the split's tall halves) ------------------------------------------------
inline constexpr int kTallRows = 192;
inline constexpr uint32_t kTallATileBytes = kTallRows * kBK * 2;  // 24 KB
inline constexpr uint32_t kTallStageBytes = kTallATileBytes + kBTileBytes;
inline constexpr int kTallUpStages = 4;
inline constexpr int kTallDownStages = 3;  // leaves 48 KB for the 192-row DOWN's staging buffer
inline constexpr uint32_t kTallDownStagingBytes = 3 * kStageHalfBytes;

// ---- swap-AB (swap_ab_kernel.cu): weights in wgmma's M, a half tile's tokens in N ---------------
inline constexpr int kSwapWeightRows = 64;          // weight rows per item: one m64 warpgroup tile
inline constexpr int kSwapRows = 64;                // token rows per item: a half of a 128-row tile
inline constexpr int kSwapStages = 12;              // 96 KB of weights in flight per SM
inline constexpr int kSwapThreads = 288;            // warps 0-3 gather B, 4-7 consume, 8 loads weights
inline constexpr int kSwapGatherThreads = 128;
inline constexpr uint32_t kSwapATileBytes = kSwapWeightRows * kBK * 2;  // 8 KB of weights per stage
inline constexpr uint32_t kSwapBTileBytes = kSwapRows * kBK * 2;        // up to 64 token rows
inline constexpr uint32_t kSwapStageBytes = kSwapATileBytes + kSwapBTileBytes;
inline constexpr int kSwapUpStride = 32 + 8;    // UP staging row (elements): 32 act columns + pad
inline constexpr int kSwapDownStride = 64 + 8;  // DOWN staging row: 64 output columns + pad
inline constexpr uint32_t kSwapUpStagingBytes = 3 * kSwapRows * kSwapUpStride * 2;  // act, gate, up
inline constexpr uint32_t kSwapDownStagingBytes = kSwapRows * kSwapDownStride * 2;
inline constexpr size_t kSwapSmemBytes =
    1024 + size_t(kSwapStages) * kSwapStageBytes +
    (kSwapUpStagingBytes > kSwapDownStagingBytes ? kSwapUpStagingBytes : kSwapDownStagingBytes);
// The fused swap-AB pipeline (fused_swap_kernel.cu): the swap UP's ring and items; after UP, an
// item's act [64 tokens][32] stays in shared memory (64B-swizzled: DOWN's K is the item's 32 act
// columns) and DOWN runs over the whole hidden, 256 W2 rows (four m64 tiles: the whole 16 KB stage)
// per stage, staged in fp32 for 16-byte reductions one 64-column tile at a time (N >= 16; at N = 8
// each thread reduces its fragment directly).
inline constexpr int kFusedDownRows = 256;
inline constexpr uint32_t kFusedDownBoxBytes = kFusedDownRows * 32 * 2;  // 16 KB: a whole stage
inline constexpr uint32_t kFusedActBytes = kSwapRows * 32 * 2;           // 4 KB
inline constexpr int kFusedStagingStride = 64 + 4;                       // floats per staging row
inline constexpr uint32_t kFusedStagingBytes = kSwapRows * kFusedStagingStride * 4;
inline constexpr size_t kFusedSmemBytes = 1024 + size_t(kSwapStages) * kSwapStageBytes + kFusedActBytes +
                                          kFusedStagingBytes;
// The MX swap-AB kernels (swap_mx_kernel.cu): the swap-AB items and roles with E4M3 operands, a
// stage = 128 K elements (one 128-byte swizzle row per weight / token row, k32 blocks 0..3) plus its
// E8M0 scales, the weight rows' 64 x 4 and the tokens' 64 x 4 bytes, in a ring of their own (the
// tiles keep their 1024-byte alignment). UP stages its 64 x 32 act block in fp32 (the per-block amax
// of the requantization), DOWN its 64 x 64 output columns in bf16, in one staging buffer.
inline constexpr int kMxSwapStages = 12;  // 96 KB of E4M3 weights in flight per SM, as the bf16 ring
inline constexpr int kMxBK = 128;         // K per stage
inline constexpr uint32_t kMxSwapATileBytes = kSwapWeightRows * kMxBK;  // 8 KB
inline constexpr uint32_t kMxSwapBTileBytes = kSwapRows * kMxBK;        // 8 KB
inline constexpr uint32_t kMxSwapStageBytes = kMxSwapATileBytes + kMxSwapBTileBytes;
inline constexpr uint32_t kMxScaleStageBytes = (kSwapWeightRows + kSwapRows) * 4;  // 512 B
inline constexpr int kMxUpStride = 32 + 4;  // UP staging row (floats)
inline constexpr uint32_t kMxSwapStagingBytes =
    kSwapRows * kMxUpStride * 4 > kSwapDownStagingBytes ? kSwapRows * kMxUpStride * 4 : kSwapDownStagingBytes;
inline constexpr size_t kMxSwapSmemBytes = 1024 + size_t(kMxSwapStages) * (kMxSwapStageBytes + kMxScaleStageBytes) +
                                           kMxSwapStagingBytes;
// The fused MX pipeline (fused_mx_kernel.cu): the MX swap-AB ring, items and UP; after UP an item's
// act block [64 tokens][32] requantized to E4M3 (one MX block: 32 bytes per token, 32B-swizzled, DOWN's
// B operand with K = 32) and its 64 scales stay in shared memory, and DOWN runs over the whole hidden,
// 512 W2 rows x the item's 32 bytes per stage (two 256-row TMA boxes: the whole 16 KB stage) with the
// rows' E8M0 scales of the item's block (one byte each: the stage's 512-byte scale slot), one
// m64nNk32 wgmma per 64 rows, staged in fp32 for the reductions into out_acc (the bf16 fused's).
inline constexpr int kFusedMxDownRows = 512;
inline constexpr int kFusedMxBoxRows = 256;
inline constexpr uint32_t kFusedMxBoxBytes = kFusedMxBoxRows * 32;          // 8 KB
inline constexpr uint32_t kFusedMxActBytes = kSwapRows * 32;                // 2 KB
inline constexpr uint32_t kFusedMxActScaleBytes = kSwapRows * 4;            // fp32 scale per token
inline constexpr uint32_t kFusedMxStagingBytes =
    kMxSwapStagingBytes > kFusedStagingBytes ? kMxSwapStagingBytes : kFusedStagingBytes;
inline constexpr size_t kFusedMxSmemBytes = 1024 + size_t(kMxSwapStages) * (kMxSwapStageBytes + kMxScaleStageBytes) +
                                            kFusedMxActBytes + kFusedMxActScaleBytes + kFusedMxStagingBytes;
// The MX tile form (tile_mx_kernel.cu; the large-T MXFP8 path): an item is a whole 128-row layout
// tile against 128 weight rows (two m64 warpgroups, N = 128 tokens each). A stage: weights 128 x 128
// B, tokens 128 x 128 B, and beside them both row sets' 4 scale bytes. UP stages its 128 tokens x 64
// act columns in fp32, DOWN its 128 tokens x 128 output columns in bf16.
inline constexpr int kMxTileStages = 5;
inline constexpr int kMxTileWeightRows = 128;
inline constexpr uint32_t kMxTileATileBytes = kMxTileWeightRows * kMxBK;  // 16 KB of weights
inline constexpr uint32_t kMxTileBTileBytes = kBM * kMxBK;                // 16 KB of tokens
inline constexpr uint32_t kMxTileStageBytes = kMxTileATileBytes + kMxTileBTileBytes;
inline constexpr uint32_t kMxTileScaleStageBytes = (kMxTileWeightRows + kBM) * 4;  // 1 KB
inline constexpr int kMxTileUpStride = 64 + 4;     // UP staging row (floats)
inline constexpr int kMxTileDownStride = 128 + 8;  // DOWN staging row (bf16)
inline constexpr uint32_t kMxTileStagingBytes = kBM * kMxTileUpStride * 4 > kBM * kMxTileDownStride * 2
                                                    ? kBM * kMxTileUpStride * 4
                                                    : kBM * kMxTileDownStride * 2;
inline constexpr size_t kMxTileSmemBytes =
    1024 + size_t(kMxTileStages) * (kMxTileStageBytes + kMxTileScaleStageBytes) + kMxTileStagingBytes;
// The FP8 block-128 tile form (tile_fp8b_kernel.cu): the MX tile form's stages (128 weight rows and
// 128 tokens x 128 K bytes) with one fp32 scale per token row and the weight block's (UP: gate and up)
// per stage. An UP item is 128 act columns (one act scale block) in two halves of 64, staged in fp32
// [128 tokens][128 columns] until the second half lands; DOWN stages bf16 [128][128] in two buffers
// (the bulk reductions of one item read it while the next item's are written); 4 stages leave room.
inline constexpr int kFp8bTileStages = 4;
inline constexpr uint32_t kFp8bScaleStageBytes = (kBM + 4) * 4;  // token scales, then 2 weight scales (+ pad)
inline constexpr int kFp8bUpStride = 128 + 4;                    // UP staging row (floats)
inline constexpr uint32_t kFp8bDownStagingBytes = kBM * kMxTileDownStride * 2;  // one DOWN buffer (of two)
inline constexpr uint32_t kFp8bStagingBytes = kBM * kFp8bUpStride * 4 > 2 * kFp8bDownStagingBytes
                                                  ? kBM * kFp8bUpStride * 4
                                                  : 2 * kFp8bDownStagingBytes;
inline constexpr size_t kFp8bTileSmemBytes =
    1024 + size_t(kFp8bTileStages) * (kMxTileStageBytes + kFp8bScaleStageBytes) + kFp8bStagingBytes;
// N of a half tile with `rows` real rows: the narrowest wgmma N the kernel instantiates that holds them.
inline constexpr int swap_ab_n(int rows) { return rows <= 8 ? 8 : rows <= 16 ? 16 : rows <= 32 ? 32 : 64; }

// ---- limits ---------------------------------------------------------------------------------------
inline constexpr size_t kMaxDynSmemBytes = 227 * 1024;  // sm_90 opt-in limit per block
inline constexpr size_t kStaticSmemReserve = 256;       // barriers and item slots of the 128-row kernels
inline constexpr size_t kTallStaticSmemReserve = 1024;  // + the 192-row DOWN's row table

// ---- schedule tuning values (the reasons: docs/DECISIONS.md) --------------------------------------
inline constexpr int kGroupTiles = 16;  // row tiles per scheduling group (column-block-major inside)

// The by-expert schedule's offsets (item_off, tile_first or seg64: E + 1 each) after the ring.
inline constexpr size_t expert_schedule_smem_bytes(int experts) {
  return (size_t(2) * (size_t(experts) + 1) * sizeof(int32_t) + 15) / 16 * 16;
}
// Dynamic shared memory of a 128-row kernel: ring, `staging` bytes of its epilogue, the schedule.
inline constexpr size_t dyn_smem_bytes(bool by_expert, int experts, size_t staging) {
  return kRingSmemBytes + staging + (by_expert ? expert_schedule_smem_bytes(experts) : 0);
}
inline constexpr bool fits_smem(size_t bytes, size_t static_reserve = kStaticSmemReserve) {
  return bytes <= kMaxDynSmemBytes - static_reserve;
}
// The 192-row kernels: ring of `stages`, `extra` bytes (the 192-row DOWN's staging), the schedule.
inline constexpr size_t tall_smem_bytes(int experts, int stages, size_t extra) {
  return 1024 + size_t(stages) * kTallStageBytes + extra + expert_schedule_smem_bytes(experts);
}
inline constexpr size_t tall_up_smem_bytes(int experts) { return tall_smem_bytes(experts, kTallUpStages, 0); }
inline constexpr size_t tall_down_smem_bytes(int experts) {
  return tall_smem_bytes(experts, kTallDownStages, kTallDownStagingBytes);
}

static_assert(kSwapSmemBytes <= kMaxDynSmemBytes - kStaticSmemReserve, "the swap-AB ring exceeds shared memory");
static_assert(kFusedSmemBytes <= kMaxDynSmemBytes - kStaticSmemReserve, "the fused ring exceeds shared memory");
static_assert(kMxSwapSmemBytes <= kMaxDynSmemBytes - kStaticSmemReserve, "the MX swap-AB ring exceeds shared memory");
static_assert(kMxSwapStageBytes % 1024 == 0 && kMxSwapATileBytes % 1024 == 0, "MX tiles must keep 1024 B alignment");
static_assert(kFusedMxSmemBytes <= kMaxDynSmemBytes - kStaticSmemReserve, "the fused MX ring exceeds shared memory");
static_assert(kFusedMxDownRows * 32 == kMxSwapStageBytes && 2 * kFusedMxBoxRows == kFusedMxDownRows,
              "a fused MX DOWN stage is two W2 boxes filling the stage");
static_assert(kFusedMxDownRows == kMxScaleStageBytes, "a fused MX DOWN stage's row scales fill the scale slot");
static_assert(kFusedMxActBytes % 1024 == 0, "the fused MX act tile keeps the 32B-swizzle atoms aligned");
static_assert(kMxTileSmemBytes <= kMaxDynSmemBytes - kStaticSmemReserve, "the MX tile ring exceeds shared memory");
static_assert(kFp8bTileSmemBytes <= kMaxDynSmemBytes - kStaticSmemReserve, "the FP8 block-128 ring exceeds shared memory");
static_assert(kFp8bDownStagingBytes % 16 == 0 && (kMxTileDownStride * 2) % 16 == 0,
              "the block-128 DOWN's bulk reductions read 16-byte aligned staging rows");
static_assert(kMxTileStageBytes % 1024 == 0 && kMxTileATileBytes % 1024 == 0, "MX tiles must keep 1024 B alignment");
static_assert(kFusedDownBoxBytes <= kSwapStageBytes, "a fused DOWN stage's W2 box must fit a stage");
static_assert(kSwapStageBytes % 1024 == 0 && kSwapATileBytes % 1024 == 0, "swap-AB tiles must keep 1024 B alignment");
static_assert(kBM == 128, "the consumer split (2 warpgroups x 64 rows) assumes 128-row tiles");
static_assert(kRingSmemBytes <= kMaxDynSmemBytes, "the ring exceeds the sm_90 opt-in limit");
static_assert(kATileBytes % 1024 == 0 && kBTileBytes % 1024 == 0 && kTallATileBytes % 1024 == 0,
              "tiles must keep 1024 B alignment");
static_assert(kDownStagingBytes % 16 == 0, "the schedule after the staging buffers wants 16-byte alignment");
static_assert(kTallDownStagingBytes % 1024 == 0, "the staging buffer keeps the schedule after it aligned");

}  // namespace epmoe::kernels::sm90
