// CUDA / cuBLAS error checks that throw epmoe::Error with the error string and the call site.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "epmoe/error.h"

#define EPMOE_CUDA_CHECK(call)                                                                 \
  do {                                                                                         \
    cudaError_t err_ = (call);                                                                 \
    if (err_ != cudaSuccess)                                                                   \
      EPMOE_FAIL(::epmoe::ErrorCode::cuda_error, #call, " failed: ", cudaGetErrorName(err_), ": ", \
                 cudaGetErrorString(err_));                                                    \
  } while (0)

// After a kernel launch: launch-configuration errors surface here, not at the next sync.
#define EPMOE_CUDA_CHECK_LAUNCH(what) EPMOE_CUDA_CHECK(cudaGetLastError())

#define EPMOE_CUBLAS_CHECK(call)                                                                   \
  do {                                                                                             \
    cublasStatus_t st_ = (call);                                                                   \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                              \
      EPMOE_FAIL(::epmoe::ErrorCode::cuda_error, #call, " failed: ", cublasGetStatusName(st_), ": ", \
                 cublasGetStatusString(st_));                                                      \
  } while (0)
