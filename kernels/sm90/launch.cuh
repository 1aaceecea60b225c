// Host side of launching the sm_90a kernels: problem checks, persistent grids (one CTA per SM, or one
// 2-CTA cluster per resident pair), the cluster and PDL launch attributes, and the declarations of
// each kernel file's launcher (the plan -> kernel dispatch that calls them is experts.cu).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "epmoe/sm90_plan.h"
#include "kernels/cuda_check.cuh"
#include "kernels/expert_problem.cuh"
#include "kernels/heuristics/sm90_heuristics.h"
#include "kernels/sm90/tile_config.h"

namespace epmoe::kernels::sm90 {

// Throws Error(invalid_argument) unless p meets the sm_90 path's requirements (experts.cuh).
void check_expert_problem(const ExpertProblem& p, const char* who);
// SMs of the current device.
int device_sm_count();

// Grid for `items` work items of a single-CTA kernel: min(items, SMs); each CTA loops over items
// b, b + grid, ...
unsigned sm90_grid(int64_t items, const char* who);
// Grid (in CTAs, a multiple of 2) for a 2-CTA cluster kernel over `cluster_items` items: as many
// clusters as fit on the device at once (cudaOccupancyMaxActiveClusters with `dyn_smem`, cached per
// kernel and device; SMs / 2 while `stream` is capturing and nothing is cached yet).
unsigned sm90_cluster_grid(int64_t cluster_items, const void* kernel, size_t dyn_smem, cudaStream_t stream,
                           const char* who);
// The launch attribute that makes a grid 2-CTA clusters along x.
cudaLaunchAttribute sm90_cluster_pair_attr();

// Launches `kernel` over `items` work items (cluster items when `cluster`) on its persistent grid
// with `smem` bytes of dynamic shared memory, as 2-CTA clusters when `cluster` and as the programmatic
// dependent of the stream's previous kernel when `pdl`.
// sm90_launch_threads: the same with `threads` per CTA (the swap-AB kernels' 288).
template <typename... Params, typename... Args>
void sm90_launch_threads(void (*kernel)(Params...), unsigned threads, bool cluster, bool pdl, int64_t items,
                         size_t smem, cudaStream_t s, const char* who, Args... args) {
  EPMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(cluster ? sm90_cluster_grid(items, reinterpret_cast<const void*>(kernel), smem, s, who)
                             : sm90_grid(items, who));
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[2];
  unsigned n_attr = 0;
  if (pdl) {
    attr[n_attr].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n_attr].val.programmaticStreamSerializationAllowed = 1;
    ++n_attr;
  }
  if (cluster) attr[n_attr++] = sm90_cluster_pair_attr();
  cfg.attrs = attr;
  cfg.numAttrs = n_attr;
  EPMOE_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}
template <typename... Params, typename... Args>
void sm90_launch(void (*kernel)(Params...), bool cluster, bool pdl, int64_t items, size_t smem, cudaStream_t s,
                 const char* who, Args... args) {
  sm90_launch_threads(kernel, unsigned(kThreads), cluster, pdl, items, smem, s, who, args...);
}

// The UP kernels' in-kernel zeroing of out (ExpertProblem::zero_out): the pointer (null: none) and
// its 16-byte chunks.
inline __nv_bfloat16* zero_out_ptr(const ExpertProblem& p) { return p.zero_out ? p.out : nullptr; }
inline int64_t zero_out_chunks(const ExpertProblem& p) { return p.zero_out ? p.out_rows * int64_t(p.hidden) / 8 : 0; }

// The 128-row UP kernel's attributes (experts.cu's image check: the sm_90a body has static barriers).
cudaError_t up_kernel_attributes(cudaFuncAttributes* attr);

// ---- each kernel file's launcher -------------------------------------------------------------------
// split_ctas > 0: the split's 128-row half (skips the experts the split rule sends to the 192-row
// kernel, which the caller queues next with the same split_ctas); 0: every expert.
void launch_up_kernel(const ExpertProblem& p, const Sm90Plan& plan, int split_ctas, cudaStream_t s);       // up_kernel.cu
void launch_up_pair_kernel(const ExpertProblem& p, const Sm90Plan& plan, int split_ctas, cudaStream_t s);  // up_pair_kernel.cu
// up_tall_kernel.cu: whether the 192-row UP can run for p (the driver accepts its interleaved W1 map;
// checked before the 128-row half is queued), and its launch as the split's second half (PDL).
bool up_tall_kernel_ready(const ExpertProblem& p);
void launch_up_tall_kernel(const ExpertProblem& p, int split_ctas, cudaStream_t s);
void launch_down_kernel(const ExpertProblem& p, const Sm90Plan& plan, int split_ctas, bool pdl,
                        cudaStream_t s);                                         // down_kernel.cu
void launch_down_tall_kernel(const ExpertProblem& p, int split_ctas, cudaStream_t s);  // down_tall_kernel.cu
// swap_ab_kernel.cu: UP (up = true; act, and h when p.preact) or DOWN (PDL-chained when pdl) with
// the weights in wgmma's M and each tile's real rows in N.
void launch_swap_ab_kernel(const ExpertProblem& p, bool up, bool pdl, cudaStream_t s);
// fused_swap_kernel.cu: the fused pipeline (UP + DOWN in one grid, then out = bf16(out_acc) as its
// PDL dependent). Needs p.out_acc (all zero; left all zero), no p.preact, no p.pair_out.
void launch_fused_swap_kernel(const ExpertProblem& p, cudaStream_t s);

}  // namespace epmoe::kernels::sm90
