// Host-side launch heuristics and checks of the sm_90a split pipeline (the tier between the kernels
// and the engine, as DeepGEMM keeps its heuristics apart from its kernels): problem validation,
// persistent grid sizes, and the environment knobs declared in sm90_experts.cuh.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda_check.cuh"
#include "kernels/expert_problem.cuh"
#include "kernels/sm90_common.cuh"

namespace epmoe::kernels::sm90 {
// Throws Error(invalid_argument) unless p meets sm90_experts.cuh's requirements.
void check_expert_problem(const ExpertProblem& p, const char* who);

// Grid for `items` work items of the sm_90a kernels (one CTA per SM, 1-D): persistent - one CTA per
// multiprocessor of the current device, each looping over items b, b + grid, ... - unless
// EPMOE_SM90_PERSISTENT=0, which launches one CTA per item (each loop then runs once).
unsigned sm90_grid(int64_t items, const char* who);

// Grid (in CTAs, a multiple of 2) for the cluster variant of `kernel` over `cluster_items` items:
// persistent - as many clusters as fit on the device at once (cudaOccupancyMaxActiveClusters with
// `dyn_smem`, cached per kernel and device; SMs / 2 while `stream` is capturing and nothing is cached)
// - unless EPMOE_SM90_PERSISTENT=0 (one cluster per item).
unsigned sm90_cluster_grid(int64_t cluster_items, const void* kernel, size_t dyn_smem, cudaStream_t stream,
                           const char* who);

// Dynamic shared memory of a kernel: the ring, then `staging` bytes of its epilogue's buffers, then
// (by expert) the schedule's offsets. The opt-in limit covers static shared memory too
// (kStaticSmemReserve, the barriers and item slots).
inline constexpr size_t kMaxDynSmemBytes = 227 * 1024;  // sm_90 opt-in limit per block
size_t sm90_dyn_smem_bytes(bool by_expert, int experts, size_t staging = 0);
// Whether a kernel with `staging` bytes of epilogue buffers runs by expert: EPMOE_SM90_ORDER=expert
// (sm90_order_by_expert) and the schedule fits next to the ring and those buffers; else the global
// order. UP and DOWN decide separately (DOWN's staging is larger: with many experts UP can run by
// expert while DOWN runs the global order; both orders are correct for either kernel).
bool sm90_kernel_order_by_expert(int experts, int hidden, size_t staging);

// Work items (cluster mode: cluster items) to size the grid from `tiles` = the capacity's row tiles:
// an upper bound of what the device schedule counts from padded_offsets.
int64_t sm90_work_items(int64_t tiles, int experts, int nn, bool cluster, bool by_expert);

// What a kernel's launch is sized from: its epilogue's `staging` bytes decide whether the by-expert
// schedule fits (sm90_kernel_order_by_expert), which decides the dynamic shared memory and the
// work-item bound over `tiles` row tiles and `blocks` column blocks.
struct Sm90LaunchPlan {
  bool by_expert;
  size_t smem;
  int64_t items;
};
Sm90LaunchPlan sm90_launch_plan(int64_t tiles, int experts, int hidden, int blocks, bool cluster, size_t staging);

// Padding halves (EPMOE_SM90_PAD_HALVES=auto|skip|compute, default auto): whether a kernel with K =
// `k_dim` over `tiles` capacity row tiles runs the all-padding upper half of an expert's last tile
// as nothing (a half item) or computes it. Skipping saves the tile's MMA but makes the item shorter
// than its partners on the same weight stream (same expert and column block), which then lead or
// trail it; that costs nothing while L2 holds what a wave of CTAs streams, and a DRAM re-read
// otherwise (docs/PERF.md sessions 8 and 9). auto: skip when the weight bytes one wave of `grid`
// CTAs streams - grid / partners distinct 256-row slices of K x 2 bytes, partners = the tiles per
// expert, at most the scheduling group - fit in a quarter of L2. Single CTAs only (clusters: never).
bool sm90_pad_halves_auto(int64_t tiles, int experts, int k_dim, int64_t grid, int group, int64_t l2_bytes);
// The launchers' decision: the knob, and auto on the current device (its SM count and L2 size).
bool sm90_skip_pad_halves(int64_t tiles, int experts, int k_dim, int64_t items, bool cluster);

// The launch attribute that makes a grid 2-CTA clusters along x.
cudaLaunchAttribute sm90_cluster_pair_attr();

// Launches an sm_90a UP or DOWN kernel over `items` work items (cluster items when `cluster`) on its
// grid (sm90_grid / sm90_cluster_grid) with `smem` bytes of dynamic shared memory, as 2-CTA clusters
// when `cluster` and as the programmatic dependent of the stream's previous kernel when `pdl`.
template <typename... Params, typename... Args>
void sm90_launch(void (*kernel)(Params...), bool cluster, bool pdl, int64_t items, size_t smem, cudaStream_t s,
                 const char* who, Args... args) {
  EPMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(cluster ? sm90_cluster_grid(items, reinterpret_cast<const void*>(kernel), smem, s, who)
                             : sm90_grid(items, who));
  cfg.blockDim = dim3(kThreads);
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
}  // namespace epmoe::kernels::sm90
