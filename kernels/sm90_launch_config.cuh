// Host-side launch heuristics and checks of the sm_90a split pipeline (the tier between the kernels
// and the engine, as DeepGEMM keeps its heuristics apart from its kernels): problem validation,
// persistent grid sizes, and the environment knobs declared in sm90_experts.cuh.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/expert_problem.cuh"

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

// Dynamic shared memory of both kernels: the ring, plus the by-expert schedule's offsets. The opt-in
// limit covers static shared memory too (kStaticSmemReserve, the barriers and item slots).
inline constexpr size_t kMaxDynSmemBytes = 227 * 1024;  // sm_90 opt-in limit per block
size_t sm90_dyn_smem_bytes(bool by_expert, int experts);
// DOWN's: the same plus the staged epilogue's buffers when `staged`; and whether DOWN runs by expert
// (EPMOE_SM90_ORDER=expert and the schedule fits next to those buffers, else the global order).
size_t sm90_down_dyn_smem_bytes(bool by_expert, int experts, bool staged);
bool sm90_down_order_by_expert(int experts, bool staged);

// Work items (cluster mode: cluster items) to size the grid from `tiles` = the capacity's row tiles:
// an upper bound of what the device schedule counts from padded_offsets.
int64_t sm90_work_items(int64_t tiles, int experts, int nn, bool cluster, bool by_expert);

// The launch attribute that makes a grid 2-CTA clusters along x.
cudaLaunchAttribute sm90_cluster_pair_attr();
}  // namespace epmoe::kernels::sm90
