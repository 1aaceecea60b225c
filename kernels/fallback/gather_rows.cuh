// Gather: rows of x in expert-sorted, tile-padded order (the split pipeline's first kernel).
//   x[x_rows, hidden] bf16, pair_row[rows_capacity] i32 -> xs[rows_capacity, hidden] bf16
//   xs[i] = x[pair_row[i]] for i < *padded_total, zero where pair_row[i] == -1; rows at or past
//   *padded_total are not touched (the total lives on the device: no host sync, graph capturable).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace epmoe::kernels {

void gather_rows_launch(const __nv_bfloat16* x, int64_t x_rows, int hidden, const int32_t* pair_row,
                        const int64_t* padded_total, int64_t rows_capacity, __nv_bfloat16* xs, cudaStream_t stream);

}  // namespace epmoe::kernels
