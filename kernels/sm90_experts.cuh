// The sm_90a split expert pipeline (seed 000's split path carried to Hopper):
//   gather_rows (kernels/gather_rows.cuh): x -> xs, expert-sorted and tile-padded -- or, with
//                                ExpertProblem::x set, UP gathers xs[r] = x[pair_row[r]] itself
//   UP   (sm90_up_kernel.cu):   act[r, :] = bf16(silu(xs[r] @ W1g_e^T) * (xs[r] @ W1u_e^T))
//   DOWN (sm90_down_kernel.cu): out[pair_row[r], :] += pair_weight[r] * (act[r] @ W2_e^T)   (bf16 red)
// for every row r of xs below padded_offsets[E], e the expert whose segment holds r.
//
// Requirements (checked, Error(invalid_argument) otherwise): hidden % 128 == 0, ffn % 128 == 0,
// 0 < rows_capacity < 2^31, every pointer 16-byte aligned, out zeroed (or holding what the sum
// should add to) before DOWN runs. p.padded_offsets, pair_row and pair_weight must be complete
// before UP starts (DOWN reads them before its PDL wait). No host synchronization: the grids are
// sized from rows_capacity (persistent: min(#SMs, work items)) and each CTA finds its experts on
// the device, so the launches can be captured in a CUDA graph. Tensor maps are encoded on the host
// at each launch (no cache; a few microseconds of host time).
//
// Environment knobs (read at each launch; for A/B runs and as fallbacks):
//   EPMOE_SM90_PERSISTENT=0  one CTA per work item instead of one per SM
//   EPMOE_SM90_W1_PLAIN=1    UP loads W1 with two rank-3 boxes per stage instead of the folded
//                            rank-4 box (also used automatically if the driver rejects the fold)
//   EPMOE_SM90_CLUSTER=auto|0|1|2 single CTAs / 2-CTA clusters multicasting the weight tile; auto
//                            (default): pairs at hidden >= 4096 with >= 1024 rows per expert (sm90_cluster_mode),
//                            except the gathering UP, which then runs the A-sharing pairs (sm90_up_gather_form)
//   EPMOE_SM90_GROUP=G       row tiles per scheduling group, column-block-major inside (1: tile-major)
//   EPMOE_SM90_ORDER=auto|global|expert  groups cut from the global tile sequence or inside each
//                            expert; auto (default): by expert at hidden >= 4096 (sm90_order_by_expert)
//   EPMOE_SM90_GATHER_ARRIVE=async|wait  how the gathering producer signals its rows (see below)
//   EPMOE_SM90_UP_EPILOGUE=staged|direct, EPMOE_SM90_DOWN_EPILOGUE=staged|direct  (see below)
//   EPMOE_SM90_SILU=tanh|exp  UP's SwiGLU form (see below)
//   EPMOE_SM90_UP_SHARE_A=auto|on|off  the gathering UP as pairs sharing the A tile (see below)
//   EPMOE_SM90_UP_TILES=whole|granular, EPMOE_SM90_DOWN_TILES=whole|granular  128-row tiles (the
//                            default), or swap-AB on token-granular tiles (below)
//   EPMOE_SM90_UP_ROWS=split|128|192  UP's tile height: split (the default) = per expert, 192 where
//                            it covers fewer rows (below); 192 = sm90_up_tall_kernel.cu for every expert
//   EPMOE_SM90_DOWN_ROWS=split|128|192  DOWN's: split (the default) as UP's (below); 192 =
//                            sm90_down_tall_kernel.cu for every expert
//   EPMOE_SM90_GRAN_CLAIM=end|first  when the granular kernels claim their next item (below)
//   EPMOE_SM90_DOWN_FLUSH_STEP=<k>  the k step at which DOWN stores its held half (see below)
//   EPMOE_SM90_TAIL_SPLIT=half|off  the last wave's items run as row halves on twice the CTAs
//   EPMOE_SM90_PAD_HALVES=auto|skip|compute  an all-padding upper tile half: no tensor work when
//                            L2 holds a wave's weight streams (auto), always, or never
//   EPMOE_SM90_GATHER=separate  the engine runs gather_rows into xs before UP instead of letting UP
//                            gather from x (sm90_fused_gather_enabled)
#pragma once
#include <cuda_runtime.h>

#include "kernels/expert_problem.cuh"

namespace epmoe::kernels {

// True when `device` is compute capability 9.0 and this build carries sm_90a code for the kernels.
bool sm90_experts_supported(int device);

// Whether the UP kernel should gather its rows itself (ExpertProblem::x) instead of reading xs
// written by gather_rows: true unless EPMOE_SM90_GATHER=separate (read at each call).
bool sm90_fused_gather_enabled();

// 2-CTA thread-block clusters that multicast the weight tile into two row tiles of one expert
// (kernels/sm90_work_items.cuh, WorkItem). EPMOE_SM90_CLUSTER: 0 never; 1 both kernels; 2 DOWN, and UP
// only when it reads xs by TMA (not when it gathers from x); unset or auto: 1 when hidden >=
// kClusterMinHidden and the capacity holds at least kClusterMinRowsPerExpert rows per expert on
// average (a fixed worst-case capacity overstates it: both choices are correct), else 0
// (sm90_launch_config.cu says why). Read at each call. sm90_cluster_knob: -1 for auto, else the
// value asked for (the granular kernels give way to the 128-row ones only when clusters are asked
// for explicitly).
inline constexpr int kClusterMinHidden = 4096;
inline constexpr int64_t kClusterMinRowsPerExpert = 1024;
int sm90_cluster_knob();
int sm90_cluster_mode(int hidden, int64_t rows_capacity, int experts);
bool sm90_up_uses_cluster(bool gather, int hidden, int64_t rows_capacity, int experts);
bool sm90_down_uses_cluster(int hidden, int64_t rows_capacity, int experts);
// The gathering UP's form (sm90_up_launch): the 128-row kernel on single CTAs, its weight-multicast
// clusters (sm90_up_uses_cluster), or the A-sharing pairs (EPMOE_SM90_UP_SHARE_A, which need the
// staged epilogue and ffn % 256 == 0). With EPMOE_SM90_CLUSTER unset or auto the pairs take the
// clusters' place wherever they would run (sm90_launch_config.cu says why); an explicit cluster
// value keeps its meaning.
enum class UpGatherForm { single, cluster, pairs };
UpGatherForm sm90_up_gather_form(int hidden, int ffn, int64_t rows_capacity, int experts, bool staged_epilogue);
// Row tiles per scheduling group (WorkGrid in sm90_work_items.cuh; 1 = tile-major order):
// EPMOE_SM90_GROUP, else the built-in default. Read at each call.
int sm90_group_tiles();
// Work order (kernels/sm90_schedule.cuh): by expert - scheduling groups never straddle two experts'
// weights - when EPMOE_SM90_ORDER=expert, or unset / auto and hidden >= kOrderByExpertMinHidden, and
// the schedule's offsets fit in shared memory (experts up to ~4300); else the global order (global
// is faster at hidden 2048, by expert at 7168: sm90_launch_config.cu says by how much). Read at each
// call. sm90_order_forced_by_expert: EPMOE_SM90_ORDER=expert exactly (the granular kernels, which
// claim items in their own order, then give way to the 128-row kernels; under auto they run).
inline constexpr int kOrderByExpertMinHidden = 4096;
bool sm90_order_by_expert(int experts, int hidden);
bool sm90_order_forced_by_expert();
// Gathering UP: each producer thread's cp.async copies signal the stage's full barrier themselves
// (cp.async.mbarrier.arrive.noinc; consumers fence for the async proxy; the default, "async") instead
// of the thread waiting for them two stages later (cp.async.wait_group, "wait"): the producer then
// runs kStages - 1 stages ahead as in TMA mode. EPMOE_SM90_GATHER_ARRIVE=async|wait.
bool sm90_gather_async_arrive();
// DOWN's epilogue: "staged" (the default) - the consumer warpgroups store each half of an item's
// weighted result to shared memory (stmatrix) and go on, while the producer warpgroup's idle warps
// reduce it into out; "direct" - the consumers reduce from registers (quad transpose + red).
// EPMOE_SM90_DOWN_EPILOGUE=staged|direct.
bool sm90_down_staged_epilogue();
// DOWN's staged epilogue: the k step of the next item at which a consumer warpgroup stores the
// held half 1 of its previous item (a step >= num_k: after the main loop). Default num_k / 2 (the
// reducers get half an item per half); EPMOE_SM90_DOWN_FLUSH_STEP=<step> overrides it.
int sm90_down_flush_step(int num_k);
// EPMOE_SM90_EARLY_DECODE (default 1; 0..3): bit 0 DOWN's producer, bit 1 the gathering UP producer
// decode the next item (and UP: load its rows, run its zeroing share) right after the current item's
// first stage is issued, in the slack of the empty waits, instead of between two items.
int sm90_early_decode();
// UP's epilogue: "staged" (the default) - SwiGLU to shared memory with stmatrix and a TMA store of
// act that runs on under the next item; "direct" - quad transpose and 16-byte stores from registers.
// EPMOE_SM90_UP_EPILOGUE=staged|direct.
bool sm90_up_staged_epilogue();
// The gathering UP as 2-CTA clusters that share each gathered A tile (sm90_up_pair_kernel: each CTA
// gathers 64 of its 128 rows and copies them into the peer): EPMOE_SM90_UP_SHARE_A=off|on|auto -> 0,
// 1, 2 (the default). Pairs need the staged epilogue and ffn % 256 == 0 (they run the order the
// 128-row kernel would: global, or by expert); "on" then always uses them, "auto" only with the
// default gather signalling (async), no early decoding of the gathering producer and padding halves
// not forced to skip. Where the weight-multicast clusters would run, the pairs replace them only
// with EPMOE_SM90_CLUSTER unset or auto (sm90_up_gather_form).
int sm90_up_share_a_mode();
// UP's SwiGLU: "tanh" (the default) - silu(x) = h + h tanh(h), h = x/2, one tanh.approx per element -
// or "exp" - x * rcp(1 + exp(-x)), ex2 and rcp. EPMOE_SM90_SILU=tanh|exp.
bool sm90_up_silu_tanh();
// The last wave's items halved (TailSplit in sm90_schedule.cuh; global order, single CTAs): "half"
// (the default) or "off". EPMOE_SM90_TAIL_SPLIT=half|off.
bool sm90_tail_split();
// The same for the A-sharing pairs only: EPMOE_SM90_UP_PAIR_TAIL=half|off (default: as sm90_tail_split).
bool sm90_up_pair_tail_split();
// The last-wave halving also in the by-expert order (until session 21 it ran in the global order
// only): EPMOE_SM90_TAIL_BY_EXPERT=on|off (default on).
bool sm90_tail_by_expert();
// What a launcher passes its kernel: `knob` (sm90_tail_split or sm90_up_pair_tail_split), and in the
// by-expert order only with sm90_tail_by_expert().
inline bool sm90_tail_split_in(bool by_expert, bool knob) { return knob && (!by_expert || sm90_tail_by_expert()); }
// Tiles whose upper 64 rows are all padding run as half items (sm90_pad_halves_auto in
// sm90_launch_config.cuh says when): 0 "compute", 1 "skip", 2 "auto" (the default), from
// EPMOE_SM90_PAD_HALVES=compute|skip|auto.
int sm90_pad_halves_mode();

// UP / DOWN on token-granular tiles (sm90_{up,down}_granular_kernel.cu): EPMOE_SM90_UP_TILES /
// EPMOE_SM90_DOWN_TILES = whole (the default; sm90_launch_config.cu has the measurements) | granular.
// Read at each call.
bool sm90_up_granular();
bool sm90_down_granular();
// The k step of an item at which both granular kernels claim their next item:
// EPMOE_SM90_GRAN_CLAIM=end (default: num_k - 3 when num_k > 3) | first (0). Read at each call.
int sm90_granular_claim_kt(int num_k);
// Launches the granular UP kernel and returns true, or returns false (nothing queued) when it does
// not apply: no x (UP from xs), no expert_counts / work_counters, clusters asked for
// (EPMOE_SM90_CLUSTER=1), or no folded W1 map. Items run in the 128-row kernels' order (by expert where
// sm90_kernel_order_by_expert says so).
bool sm90_up_granular_launch(const ExpertProblem& p, cudaStream_t s);

// xs (or x gathered through pair_row), w1 -> act. The granular kernel where sm90_up_granular() and it
// applies.
void sm90_up_launch(const ExpertProblem& p, cudaStream_t s);
// Launches the granular DOWN kernel (as sm90_down_launch would, PDL included) and returns true, or
// returns false (nothing queued): no expert_counts / work_counters, or clusters asked for
// (EPMOE_SM90_CLUSTER=1 or 2). Items run in the 128-row kernels' order, as the granular UP's.
bool sm90_down_granular_launch(const ExpertProblem& p, cudaStream_t s, bool pdl);
// UP's tile height: EPMOE_SM90_UP_ROWS = 128 | 192 (sm90_up_tall_kernel.cu: the 192 x 256
// tile, W1 through the interleaved map, act stored from registers; A rows gathered from x or read
// from xs; by expert, single CTAs - the 128-row UP's cluster, pair, order and padding-half knobs do
// not apply to it) | split (sm90_up_split; the default). sm90_up_rows() is 192 for "192" only. Read at
// each call.
int sm90_up_rows();
// EPMOE_SM90_UP_ROWS=split (the default): experts on 192-row tiles where they cover fewer rows
// (expert_prefers_tall in sm90_schedule.cuh) and their items fill the 192-row UP's waves well enough
// (split_tall_cut; sm90_up_split_ctas), decided on the device from the counts: the 128-row UP (any of its
// forms, by expert only) skips the experts the 192-row UP then takes, PDL-launched after it. Where
// the 128-row UP would run the global order or the 192-row UP cannot run, every expert stays on 128.
bool sm90_up_split();
// The split rule's CTA count (split_cut_score in sm90_schedule.cuh; the kernels' split_ctas):
// EPMOE_SM90_UP_SPLIT_WAVES = on (the default: the device's SM count, so that the 192-row half is
// sent only experts whose items fill its waves well enough to pay) | off (1: every expert
// expert_prefers_tall picks). Read at each call.
int sm90_up_split_ctas();
// The 192-row UP (split or not) zeroes the 64 padding rows of act that follow an expert's last tall
// tile (no tile covers them; the 128-row UP writes every padding row as zeros): EPMOE_SM90_UP_ZERO_GAP
// = on (the default) | off (left unwritten: DOWN multiplies whatever an earlier call left there and
// masks the result; the test harness reads the split's choice from their poison). Read at each call.
bool sm90_up_zero_gap();
// Launches the 192-row UP kernel and returns true, or returns false (nothing queued) when
// sm90_up_rows() is 128, the driver rejects the interleaved W1 map,
// or the schedule does not fit beside the 4 x 56 KB ring.
bool sm90_up_tall_launch(const ExpertProblem& p, cudaStream_t s);
// The split UP's 192-row half: whether it can run for p (checked before the 128-row half is queued,
// which then leaves the tall experts to it), and its launch (PDL; no zeroing: the 128-row half zeroes).
bool sm90_up_tall_split_ready(const ExpertProblem& p);
void sm90_up_tall_split_launch(const ExpertProblem& p, cudaStream_t s, int split_ctas);  // (as the 128-row half's)
// DOWN's tile height: EPMOE_SM90_DOWN_ROWS = 128 | 192 (sm90_down_tall_kernel.cu: a 192 x 256 tile on the
// same two consumer warpgroups, a 3-deep ring and a staging buffer, single CTAs by expert) | split (the
// default since session 31; sm90_down_split). sm90_down_rows() is 192 for "192" only. Read at each call.
int sm90_down_rows();
// EPMOE_SM90_DOWN_ROWS=split (the default): as the split UP, over DOWN's column blocks (hidden / 256) with
// sm90_up_split_ctas' CTA count - the 128-row DOWN skips the experts the rule picks and releases the
// 192-row DOWN (PDL) once it has seen the UP grid complete; by expert only, else every expert on 128.
bool sm90_down_split();
// The split DOWN's 192-row half: whether it can run for p (checked before the 128-row half is queued)
// and its launch (PDL after the 128-row half, which must have been queued with the same split_ctas).
bool sm90_down_tall_split_ready(const ExpertProblem& p);
void sm90_down_tall_split_launch(const ExpertProblem& p, cudaStream_t s, int split_ctas);
// Launches the 192-row DOWN kernel (as sm90_down_launch would, PDL included) and returns true, or
// returns false (nothing queued) when sm90_down_rows() is 128 or its schedule does not fit in shared
// memory beside the 3 x 56 KB ring and the 48 KB staging buffer (E above 1151).
bool sm90_down_tall_launch(const ExpertProblem& p, cudaStream_t s, bool pdl);
// act, w2 -> out (+=). With pdl, launched as the programmatic dependent of the previous kernel in
// `s` (the UP kernel): its prologue and first W2 loads overlap the UP grid's tail.
void sm90_down_launch(const ExpertProblem& p, cudaStream_t s, bool pdl);
// UP then DOWN (PDL-chained).
void sm90_experts_launch(const ExpertProblem& p, cudaStream_t s);

}  // namespace epmoe::kernels
