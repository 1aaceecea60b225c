// The sm_90a expert pipeline (seed 000's split path carried to Hopper), the entry points the engine,
// the benchmarks and the tests call:
//   UP   (up_kernel.cu / up_pair_kernel.cu, + up_tall_kernel.cu when split):
//        act[r, :] = bf16(silu(x[pair_row[r]] @ W1g_e^T) * (x[pair_row[r]] @ W1u_e^T))
//   DOWN (down_kernel.cu, + down_tall_kernel.cu when split):
//        out[pair_row[r], :] += pair_weight[r] * (act[r] @ W2_e^T)   (bf16 reductions)
// for every row r below padded_offsets[E], e the expert whose segment holds r. Which kernels run is
// the plan's choice (epmoe/sm90_plan.h; resolve_sm90_plan in kernels/heuristics/ picks the default):
// the 128-row forms above, swap-AB (swap_ab_kernel.cu), or the fused swap-AB pipeline
// (fused_swap_kernel.cu: both in one grid, act never stored; through sm90_experts_launch only).
//
// Requirements (checked, Error(invalid_argument) otherwise): hidden % 16 == 0, ffn % 16 == 0 (tiles past
// them read zeros and store nothing; the 192-row UP of a split needs ffn % 128 == 0, the plan's rule),
// 0 < rows_capacity < 2^31, every pointer 16-byte aligned, x given (UP gathers its rows), out zeroed
// (or holding what the sum should add to) before DOWN runs unless zero_out, the plan valid for the
// shape (check_sm90_plan). padded_offsets, pair_row and pair_weight must be complete before UP starts
// (DOWN reads them before its PDL wait). No host synchronization: the grids are sized from
// rows_capacity (persistent: min(#SMs, work items)) and each CTA finds its experts on the device, so
// the launches can be captured in a CUDA graph. Tensor maps are encoded on the host at each launch.
#pragma once
#include <cuda_runtime.h>

#include "epmoe/sm90_plan.h"
#include "kernels/expert_problem.cuh"
#include "kernels/heuristics/sm90_heuristics.h"

namespace epmoe::kernels {

// True when `device` is compute capability 9.0 and this build carries sm_90a code for the kernels.
bool sm90_experts_supported(int device);
// The same for the current device (false when there is none).
bool sm90_experts_supported_here();
// The device facts the heuristics read (SMs, L2 bytes).
Sm90Device sm90_device(int device);
// The shape the heuristics read from a problem.
inline Sm90Shape sm90_shape(const ExpertProblem& p) { return {p.experts, p.hidden, p.ffn, p.rows_capacity, p.pairs}; }
// The default plan for p on the current device, with `o` on top (checked).
Sm90Plan sm90_plan_for(const ExpertProblem& p, const Sm90PlanOverride& o = {});

// xs gathered through pair_row from x, w1 -> act.
void sm90_up_launch(const ExpertProblem& p, const Sm90Plan& plan, cudaStream_t s);
// act, w2 -> out (+=). With pdl, launched as the programmatic dependent of the previous kernel in `s`
// (the UP kernel): its prologue and first W2 loads overlap the UP grid's tail.
void sm90_down_launch(const ExpertProblem& p, const Sm90Plan& plan, cudaStream_t s, bool pdl);
// UP then DOWN (PDL-chained); with plan.fused, p.out_acc given and neither p.preact nor p.pair_out,
// the fused pipeline instead (out written whole: no zeroing needed).
void sm90_experts_launch(const ExpertProblem& p, const Sm90Plan& plan, cudaStream_t s);

}  // namespace epmoe::kernels
