// TMA tensor maps of the sm_90a kernels (tensor_maps.cuh). The driver's encoder is
// reached through the runtime's entry-point query, so this file needs no direct libcuda link.
#include "kernels/sm90/tensor_maps.cuh"

#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <mutex>

#include "kernels/cuda_check.cuh"

namespace epmoe::kernels::sm90 {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q);
    if (err == cudaSuccess && q == cudaDriverEntryPointSuccess) fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  });
  EPMOE_CHECK(fn != nullptr, ErrorCode::cuda_error, "cuTensorMapEncodeTiled is not available from the driver");
  return fn;
}

CUresult encode_raw(CUtensorMap* map, const void* base, cuuint32_t rank, const cuuint64_t* dims,
                    const cuuint64_t* strides_bytes, const cuuint32_t* box, const char* what,
                    CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B,
                    CUtensorMapL2promotion promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                    CUtensorMapDataType dtype = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16) {
  EPMOE_CHECK(base != nullptr, ErrorCode::invalid_argument, what, ": null base pointer");
  EPMOE_CHECK(reinterpret_cast<uintptr_t>(base) % 16 == 0, ErrorCode::invalid_argument, what,
              ": base pointer must be 16-byte aligned");
  *map = CUtensorMap{};
  const cuuint32_t elem_strides[5] = {1, 1, 1, 1, 1};
  return encode_fn()(map, dtype, rank, const_cast<void*>(base), dims, strides_bytes, box,
                     elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                     promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

CUtensorMap encode(const void* base, cuuint32_t rank, const cuuint64_t* dims, const cuuint64_t* strides_bytes,
                   const cuuint32_t* box, const char* what, CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B,
                   CUtensorMapL2promotion promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                   CUtensorMapDataType dtype = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16) {
  CUtensorMap map;
  const CUresult r = encode_raw(&map, base, rank, dims, strides_bytes, box, what, swizzle, promotion, dtype);
  EPMOE_CHECK(r == CUDA_SUCCESS, ErrorCode::cuda_error, what, ": cuTensorMapEncodeTiled failed with CUresult ",
              int(r));
  return map;
}

}  // namespace

CUtensorMap make_matrix_map(const __nv_bfloat16* base, int64_t rows, int64_t cols, int box_rows) {
  EPMOE_CHECK(rows > 0 && cols > 0 && cols % 8 == 0, ErrorCode::invalid_argument, "matrix map: bad shape ", rows,
              " x ", cols);
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(cols) * 2};
  const cuuint32_t box[2] = {64, cuuint32_t(box_rows)};
  return encode(base, 2, dims, strides, box, "matrix map");
}

namespace {
// [E, rows, cols] bf16 as rank 3 {cols, rows, E}, box {64, box_rows, 1} (make_expert_matrix_map, make_w2_map).
CUtensorMap expert_matrix_map(const __nv_bfloat16* base, int experts, int64_t rows, int64_t cols, int box_rows,
                              const char* what) {
  EPMOE_CHECK(experts > 0 && rows > 0 && cols > 0 && cols % 8 == 0, ErrorCode::invalid_argument, what,
              ": bad shape E=", experts, " rows=", rows, " cols=", cols);
  const cuuint64_t dims[3] = {cuuint64_t(cols), cuuint64_t(rows), cuuint64_t(experts)};
  const cuuint64_t strides[2] = {cuuint64_t(cols) * 2, cuuint64_t(rows) * cuuint64_t(cols) * 2};
  const cuuint32_t box[3] = {64, cuuint32_t(box_rows), 1};
  return encode(base, 3, dims, strides, box, what);
}
}  // namespace

CUtensorMap make_expert_matrix_map(const __nv_bfloat16* base, int experts, int64_t rows, int64_t cols, int box_rows) {
  return expert_matrix_map(base, experts, rows, cols, box_rows, "expert matrix map");
}

CUtensorMap make_preact_map(const __nv_bfloat16* h, int64_t rows, int ffn) {
  EPMOE_CHECK(rows > 0 && ffn > 0 && ffn % 8 == 0, ErrorCode::invalid_argument, "preact map: bad shape ", rows,
              " x 2*", ffn);
  const cuuint64_t F = cuuint64_t(ffn);
  const cuuint64_t dims[3] = {F, 2, cuuint64_t(rows)};
  const cuuint64_t strides[2] = {F * 2, 2 * F * 2};  // half, row
  const cuuint32_t box[3] = {64, 1, 64};
  return encode(h, 3, dims, strides, box, "preact map");
}

namespace {
void check_w1_shape(int experts, int hidden, int ffn, int ffn_multiple, const char* what) {
  EPMOE_CHECK(experts > 0 && hidden > 0 && hidden % 8 == 0 && ffn > 0 && ffn % ffn_multiple == 0,
              ErrorCode::invalid_argument, what, ": bad shape E=", experts, " hidden=", hidden, " ffn=", ffn);
}
}  // namespace

// The 192-row UP's interleaved view: element (k, r, 2e + p, b) = w1[e][p*ffn + 64*b + r][k]. The
// expert stride (2*ffn rows) is twice the gate/up stride (ffn rows), so (e, p) fold into one dimension
// of extent 2E, stride ffn rows. The box {64, 64, 2, 2} walks r, then p, then b. Row blocks must tile
// ffn exactly (a partial block would read the next parity's rows), hence ffn % 128.
bool try_make_w1_interleaved_map(const __nv_bfloat16* w1, int experts, int hidden, int ffn, CUtensorMap* map) {
  if (ffn % 128 != 0) return false;
  check_w1_shape(experts, hidden, ffn, 128, "w1 interleaved map");
  const cuuint64_t H = cuuint64_t(hidden), F = cuuint64_t(ffn);
  const cuuint64_t dims[4] = {H, 64, 2 * cuuint64_t(experts), F / 64};
  const cuuint64_t strides[3] = {H * 2, F * H * 2, 64 * H * 2};  // row, parity/expert, row block
  const cuuint32_t box[4] = {64, 64, 2, 2};
  return encode_raw(map, w1, 4, dims, strides, box, "w1 interleaved map") == CUDA_SUCCESS;
}

// Folded: element (k, r, p, e) = w1[e][p*ffn + r][k], dims {hidden, ffn, 2, E}: gate and up rows are
// each bounded by ffn, so a box past ffn reads zeros, never the other half's rows.
bool try_make_w1_folded_map(const __nv_bfloat16* w1, int experts, int hidden, int ffn, CUtensorMap* map) {
  check_w1_shape(experts, hidden, ffn, 8, "w1 folded map");
  const cuuint64_t H = cuuint64_t(hidden), F = cuuint64_t(ffn);
  const cuuint64_t dims[4] = {H, F, 2, cuuint64_t(experts)};
  const cuuint64_t strides[3] = {H * 2, F * H * 2, 2 * F * H * 2};  // row, parity, expert
  const cuuint32_t box[4] = {64, 128, 2, 1};
  return encode_raw(map, w1, 4, dims, strides, box, "w1 folded map") == CUDA_SUCCESS;
}

// Swap-AB: element (k, r, p, b, e) = w1[e][p*ffn + 8b + r][k], dims {hidden, 8, 2, ffn/8, E}; the box
// {64, 8, 2, 4, 1} walks 8 gate rows, their 8 up partners, four times (64 rows: 32 act columns per
// box), so each gate row and its partner land 8 rows apart, in one thread's accumulators of the m64
// fragment. Blocks past ffn/8 read zeros.
CUtensorMap make_w1_swap_map(const __nv_bfloat16* w1, int experts, int hidden, int ffn) {
  check_w1_shape(experts, hidden, ffn, 8, "w1 swap map");
  const cuuint64_t H = cuuint64_t(hidden), F = cuuint64_t(ffn);
  const cuuint64_t dims[5] = {H, 8, 2, F / 8, cuuint64_t(experts)};
  const cuuint64_t strides[4] = {H * 2, F * H * 2, 8 * H * 2, 2 * F * H * 2};  // row, parity, block, expert
  const cuuint32_t box[5] = {64, 8, 2, 4, 1};
  return encode(w1, 5, dims, strides, box, "w1 swap map");
}

CUtensorMap make_w1_folded_map(const __nv_bfloat16* w1, int experts, int hidden, int ffn) {
  CUtensorMap map;
  EPMOE_CHECK(try_make_w1_folded_map(w1, experts, hidden, ffn, &map), ErrorCode::cuda_error,
              "w1 folded map: cuTensorMapEncodeTiled rejected the folded strides");
  return map;
}

CUtensorMap make_w1_plain_map(const __nv_bfloat16* w1, int experts, int hidden, int ffn) {
  check_w1_shape(experts, hidden, ffn, 8, "w1 plain map");
  const cuuint64_t H = cuuint64_t(hidden), F = cuuint64_t(ffn);
  const cuuint64_t dims[3] = {H, 2 * F, cuuint64_t(experts)};
  const cuuint64_t strides[2] = {H * 2, 2 * F * H * 2};
  const cuuint32_t box[3] = {64, 128, 1};
  return encode(w1, 3, dims, strides, box, "w1 plain map");
}

CUtensorMap make_w1_box_map(const __nv_bfloat16* w1, int experts, int hidden, int ffn, bool allow_folded, bool* folded) {
  CUtensorMap map;
  *folded = allow_folded && try_make_w1_folded_map(w1, experts, hidden, ffn, &map);
  return *folded ? map : make_w1_plain_map(w1, experts, hidden, ffn);
}

CUtensorMap make_w2_map(const __nv_bfloat16* w2, int experts, int hidden, int ffn, int box_rows) {
  return expert_matrix_map(w2, experts, hidden, ffn, box_rows, "w2 map");
}

CUtensorMap make_w2_slice_map(const __nv_bfloat16* w2, int experts, int hidden, int ffn) {
  EPMOE_CHECK(experts > 0 && hidden > 0 && ffn > 0 && ffn % 8 == 0, ErrorCode::invalid_argument,
              "w2 slice map: bad shape E=", experts, " hidden=", hidden, " ffn=", ffn);
  const cuuint64_t H = cuuint64_t(hidden), F = cuuint64_t(ffn);
  const cuuint64_t dims[3] = {F, H, cuuint64_t(experts)};
  const cuuint64_t strides[2] = {F * 2, H * F * 2};
  const cuuint32_t box[3] = {32, 256, 1};
  // 64 B per row: a 256-byte L2 promotion would fetch each row's next three item blocks too (the
  // other CTAs' slices, not necessarily read while still in L2), so no promotion.
  return encode(w2, 3, dims, strides, box, "w2 slice map", CU_TENSOR_MAP_SWIZZLE_64B,
                CU_TENSOR_MAP_L2_PROMOTION_NONE);
}

// E4M3 weights (one byte per element: a 128-element box row is one 128-byte swizzle row).
CUtensorMap make_w1_swap_map_e4m3(const uint8_t* w1, int experts, int hidden, int ffn) {
  EPMOE_CHECK(experts > 0 && hidden % 128 == 0 && ffn % 32 == 0, ErrorCode::invalid_argument,
              "e4m3 w1 swap map: bad shape E=", experts, " hidden=", hidden, " ffn=", ffn);
  const cuuint64_t H = cuuint64_t(hidden), F = cuuint64_t(ffn);
  const cuuint64_t dims[4] = {H, 8, 2 * cuuint64_t(experts), F / 8};
  const cuuint64_t strides[3] = {H, F * H, 8 * H};  // row, parity/expert, 8-row block
  const cuuint32_t box[4] = {128, 8, 2, 4};
  return encode(w1, 4, dims, strides, box, "e4m3 w1 swap map", CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_DATA_TYPE_UINT8);
}

CUtensorMap make_w2_map_e4m3(const uint8_t* w2, int experts, int hidden, int ffn, int box_rows) {
  EPMOE_CHECK(experts > 0 && hidden % box_rows == 0 && ffn % 128 == 0, ErrorCode::invalid_argument,
              "e4m3 w2 map: bad shape E=", experts, " hidden=", hidden, " ffn=", ffn);
  const cuuint64_t H = cuuint64_t(hidden), F = cuuint64_t(ffn);
  const cuuint64_t dims[3] = {F, H, cuuint64_t(experts)};
  const cuuint64_t strides[2] = {F, H * F};
  const cuuint32_t box[3] = {128, cuuint32_t(box_rows), 1};
  return encode(w2, 3, dims, strides, box, "e4m3 w2 map", CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_DATA_TYPE_UINT8);
}

CUtensorMap make_w2_slice_map_e4m3(const uint8_t* w2, int experts, int hidden, int ffn) {
  EPMOE_CHECK(experts > 0 && hidden > 0 && hidden % 8 == 0 && ffn % 32 == 0, ErrorCode::invalid_argument,
              "e4m3 w2 slice map: bad shape E=", experts, " hidden=", hidden, " ffn=", ffn);
  const cuuint64_t H = cuuint64_t(hidden), F = cuuint64_t(ffn);
  const cuuint64_t dims[3] = {F, H, cuuint64_t(experts)};
  const cuuint64_t strides[2] = {F, H * F};
  const cuuint32_t box[3] = {32, 256, 1};
  // 32 B per row: no L2 promotion, as the bf16 slice map (a promotion that fetched the rows' other
  // item blocks measured 1.19x slower there: docs/DECISIONS.md).
  return encode(w2, 3, dims, strides, box, "e4m3 w2 slice map", CU_TENSOR_MAP_SWIZZLE_32B,
                CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_DATA_TYPE_UINT8);
}

}  // namespace epmoe::kernels::sm90
