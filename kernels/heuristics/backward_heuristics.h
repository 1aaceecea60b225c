// The heuristics tier's rules for the backward's GEMMs (plain C++: the golden table in
// tests/test_sm90_heuristics.cpp runs without CUDA).
#pragma once
#include <cstdint>

#include "epmoe/moe_layer.h"

namespace epmoe::kernels {

// The data-gradient GEMMs (da = dy W2_e, dx = dh W1_e, cuBLAS NN bf16): one cublasGemmEx per expert
// once the experts' mean padded segment reaches this many rows, else one grouped launch. On Hopper
// cuBLAS's grouped kernel for these GEMMs is an sm_80 one (~260 TFLOP/s on the H200) while a single
// GEMM gets an sm_90 one; per expert costs a launch each and under-fills the device when segments
// are short. Measured on one H200 (train_ab.sh, same run, 2026-12-02), per expert / grouped fwd+bwd:
// 512 rows (E32 k4 T4k) 1.23 (preact) 1.05 (recompute); 1024 rows (E128 k8 T16k) 0.90 / 0.92, (E8 k2
// 4096/14336 T4k) 0.68 / 0.77; 2048 rows (E32 k4 T16k) 0.82 / 0.82, (E32 k8 7168/2048 T8k) 0.74 / 0.75.
inline constexpr int64_t kPerExpertDataGradRows = 1024;

inline bool data_grads_grouped(GemmGrouping g, int64_t padded_rows, int experts) {
  if (g != GemmGrouping::automatic) return g == GemmGrouping::grouped;
  return experts <= 0 || padded_rows < kPerExpertDataGradRows * int64_t(experts);
}

}  // namespace epmoe::kernels
