// Host side of the sm_90a kernels: the TMA tensor maps they read and write through.
// All maps are 128-byte swizzle with a 128-byte inner box row (64 bf16 or 128 e4m3), zero fill out of
// bounds; bf16 unless named e4m3.
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

namespace epmoe::kernels::sm90 {

// Dims need only be multiples of 8 (16-byte strides): boxes past a dimension's end read zeros and
// stores past it are dropped, which is how the kernels take hidden and ffn that are not multiples of
// their tiles (the interleaved map excepted).

// Row-major [rows, cols] bf16 matrix, box {64 cols, box_rows rows}. Coordinates {col, row}.
CUtensorMap make_matrix_map(const __nv_bfloat16* base, int64_t rows, int64_t cols, int box_rows);
// E row-major [rows, cols] bf16 matrices back to back ([E, rows, cols]) as rank 3 {cols, rows, E},
// box {64 cols, box_rows rows, 1}; coordinate {col, row, e}: a box past `rows` reads zeros, never the
// next expert's rows. The backward's dgrad B operands (W2 as [E, hidden, ffn], W1 as [E, 2 ffn, hidden]);
// make_w2_map is this map of W2.
CUtensorMap make_expert_matrix_map(const __nv_bfloat16* base, int experts, int64_t rows, int64_t cols, int box_rows);
// h = [g | u] [rows, 2 ffn] as rank 3 {ffn, 2, rows}, box {64, 1, 64}; coordinate {col, half, row}: a
// gate box past ffn is dropped instead of landing in the up half.
CUtensorMap make_preact_map(const __nv_bfloat16* h, int64_t rows, int ffn);

// W1 [E, 2*ffn, hidden] folded so that one box brings gate rows [128j, 128j+128) followed by up rows
// [ffn+128j, ...) of expert e (seed 000, Trick 1): rank 4, dims {hidden, ffn, 2, E}, byte strides
// {hidden*2, ffn*hidden*2, 2*ffn*hidden*2}, box {64, 128, 2, 1}; coordinate {k0, 128j, 0, e}.
// It lands in smem as [parity][row][64]: a 256 x 64 K-major tile, gate first.
CUtensorMap make_w1_folded_map(const __nv_bfloat16* w1, int experts, int hidden, int ffn);
// Same, but returns false instead of throwing when the driver rejects the folded strides.
bool try_make_w1_folded_map(const __nv_bfloat16* w1, int experts, int hidden, int ffn, CUtensorMap* map);

// W1 folded and interleaved for the 192-row UP (up_tall_kernel.cu): rank 4, dims {hidden, 64, 2E,
// ffn/64}, byte strides {hidden*2, ffn*hidden*2, 64*hidden*2}, box {64, 64, 2, 2}; coordinate
// {k0, 0, 2e, 2j}. It lands in smem as gate rows [128j, +64), their up partners, gate rows
// [128j + 64, +64), theirs: any 128-row half of the tile holds 64 gate rows with their up partners.
// Returns false when ffn % 128 != 0 or the driver rejects the folded strides.
bool try_make_w1_interleaved_map(const __nv_bfloat16* w1, int experts, int hidden, int ffn, CUtensorMap* map);

// W1 for the swap-AB UP (swap_ab_kernel.cu): rank 5, dims {hidden, 8, 2, ffn/8, E}, byte strides
// {hidden*2, ffn*hidden*2, 8*hidden*2, 2*ffn*hidden*2}, box {64, 8, 2, 4, 1}; coordinate
// {k0, 0, 0, 4j, e}. It lands as 4 x (gate rows [32j + 8b, +8), their up partners): 64 rows, gate
// row r's partner 8 rows later.
CUtensorMap make_w1_swap_map(const __nv_bfloat16* w1, int experts, int hidden, int ffn);

// Fallback for W1 when the folded map is not available: rank 3 {hidden, 2*ffn, E}, box {64, 128, 1};
// the gate half comes from coordinate {k0, 128j, e} and the up half from {k0, ffn + 128j, e} (two
// loads per stage, same smem layout as the folded box).
CUtensorMap make_w1_plain_map(const __nv_bfloat16* w1, int experts, int hidden, int ffn);

// The 128-row UP's W1 map: the folded one when `allow_folded` and the driver accepts it (*folded =
// true), else the plain one (the multicast clusters always load the plain map's boxes).
CUtensorMap make_w1_box_map(const __nv_bfloat16* w1, int experts, int hidden, int ffn, bool allow_folded, bool* folded);

// W2 [E, hidden, ffn] as rank 3 {ffn, hidden, E}, box {64, box_rows, 1}; coordinate {k0, n0, e}.
// Rows past `hidden` within an expert read as zero (never the next expert's rows).
CUtensorMap make_w2_map(const __nv_bfloat16* w2, int experts, int hidden, int ffn, int box_rows);
// W2 the same way with box {32, 256, 1}, SWIZZLE_64B, no L2 promotion: the fused pipeline's DOWN
// stage, 256 rows of one item's 32 act columns (coordinate {32 j, n0, e}; rows past hidden read as 0).
CUtensorMap make_w2_slice_map(const __nv_bfloat16* w2, int experts, int hidden, int ffn);

// The MX swap-AB kernels' E4M3 weights (swap_mx_kernel.cu): the same boxes with 128 one-byte
// elements per row. W1 [E, 2 ffn, hidden]: dims {hidden, 8, 2E, ffn/8}, box {128, 8, 2, 4}, as
// make_w1_swap_map; W2 [E, hidden, ffn]: dims {ffn, hidden, E}, box {128, box_rows, 1}.
CUtensorMap make_w1_swap_map_e4m3(const uint8_t* w1, int experts, int hidden, int ffn);
CUtensorMap make_w2_map_e4m3(const uint8_t* w2, int experts, int hidden, int ffn, int box_rows);
// The fused MX pipeline's DOWN stage (fused_mx_kernel.cu): W2 E4M3 [E, hidden, ffn] as rank 3 {ffn,
// hidden, E}, box {32, 256, 1} (one MX block of 256 rows), SWIZZLE_32B; coordinate {32 j, n0, e}, rows
// past hidden read as 0.
CUtensorMap make_w2_slice_map_e4m3(const uint8_t* w2, int experts, int hidden, int ffn);

}  // namespace epmoe::kernels::sm90
