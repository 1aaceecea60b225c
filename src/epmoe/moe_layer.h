// The expert-parallel MoE feed-forward layer (SwiGLU experts, routing given).
//
//   y[t] = sum_j w[t,j] * W2_e ( silu(W1gate_e x[t]) * W1up_e x[t] ),  e = ids[t,j] >= 0
//
// Weights in the seed's layout, bf16, this rank's experts only:
//   w1[E_local, 2*ffn, hidden]  rows 0..ffn-1 gate, ffn..2ffn-1 up (output-major)
//   w2[E_local, hidden, ffn]
// Rank r owns experts [r*E_local, (r+1)*E_local).
//
// The backend follows the weights' device: cpu weights run the CPU engine over any host
// communicator (mock, MPI); cuda weights run the GPU engine over NCCL.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "epmoe/communicator.h"
#include "epmoe/device_allocator.h"
#include "epmoe/moe_config.h"
#include "epmoe/sm90_plan.h"
#include "epmoe/tensor_view.h"

namespace epmoe {

// bf16, MXFP8 (epmoe/mxfp8.h: w1 and w2 e4m3 with their e8m0 block scales along K), or FP8
// block-128 (epmoe/fp8_block.h: e4m3 with fp32 scales per 128 x 128 block). An FP8 layer quantizes x
// on the fly and requantizes the activation before DOWN, in its format; it is forward-only (a saving
// forward or a backward raises Error(unsupported)). On cuda it runs the sm_90 FP8 kernels: MXFP8 in
// the fused, swap-AB or tile form by the heuristics tier, block-128 in its tile form (hidden and ffn
// multiples of 128; no deterministic mode; of an sm90_plan override only
// swap=on|off and fused=on|off, the form, and block-128 refuses swap=on and fused=on); forward_mxfp8
// takes x given in MXFP8 on either engine.
struct ExpertWeights {
  TensorView w1;        // bf16 or e4m3 [E_local, 2*ffn, hidden]
  TensorView w2;        // bf16 or e4m3 [E_local, hidden, ffn]
  TensorView w1_scale = {};  // FP8 only: MXFP8 e8m0 [E_local, 2*ffn, hidden / 32], or FP8 block-128
                             // (epmoe/fp8_block.h) f32 [E_local, 2*ffn / 128, hidden / 128]
  TensorView w2_scale = {};  // FP8 only: MXFP8 e8m0 [E_local, hidden, ffn / 32], or FP8 block-128
                             // f32 [E_local, hidden / 128, ffn / 128]

  bool fp8() const { return w1.dtype == DType::e4m3; }
  bool fp8_block() const { return fp8() && w1_scale.dtype == DType::f32; }
  bool mxfp8() const { return fp8() && !fp8_block(); }
};

// What a forward keeps for its backward (MoeForwardContext), per routed (row, expert) pair:
enum class SavePolicy : uint8_t {
  rows_and_preactivation,  // the received rows and h = [gate, up] (2 ffn bf16 per pair): no recompute
  rows_recompute,          // the received rows only; backward recomputes h (one more W1 GEMM)
};

enum class ExpertPath {
  automatic,  // sm_90 kernels on Hopper, else the cuBLAS fallback; CPU for cpu weights
  cpu,
  cublas,     // grouped GEMM fallback (any CUDA GPU)
  sm90,       // Hopper split pipeline (WGMMA + TMA)
};

// How the capturable forward (MoeLayer::forward_capturable) moves rows between ranks:
enum class CapturableTransport {
  automatic,  // local at world 1, slots otherwise
  local,      // world 1 only: no transfer (x's rows are the received rows, y the combine rows)
  slots,      // fixed-size slot all-to-alls with in-band counts (kernels/ep/capacity_slots.cuh), at
              // any world size (at world 1: a test of the transport and a measure of its cost)
};

// How a set of per-expert cuBLAS GEMMs runs: one cublasGemmGroupedBatchedEx launch, or one
// cublasGemmEx per expert.
enum class GemmGrouping { automatic, grouped, per_gemm };

struct LayerOptions {
  ExpertPath expert_path = ExpertPath::automatic;
  int cpu_threads = 1;  // threads the CPU engine's expert compute may use
  // GPU engine: record events around each phase and fill ForwardStats' *_ms after the forward
  // (costs a host sync at the end of forward; off for production runs).
  bool record_phase_times = false;
  // sm_90 path: fields to force on top of the heuristics' plan for each forward's shape (epmoe/
  // sm90_plan.h). Checked against the layer's shape at construction, on every rank alike.
  Sm90PlanOverride sm90_plan;
  // What forward(..., save) keeps for backward. Both policies give the same gradients: h is kept,
  // or recomputed, rounded to bf16.
  SavePolicy save_policy = SavePolicy::rows_and_preactivation;
  // GPU backward: the kernels of dW1 / dW2. automatic and cublas: cuBLAS (faster by 2-6% of fwd+bwd
  // on the H200, docs/DECISIONS.md); sm90: the sm_90 weight-gradient kernel, which needs no host
  // counts, where hidden and ffn are multiples of 256 (its tile), else cuBLAS.
  ExpertPath weight_grad_path = ExpertPath::automatic;
  // GPU backward: how cuBLAS runs the data-gradient GEMMs (da = dy W2_e, dx = dh W1_e). automatic:
  // one GEMM per expert where the experts average >= 1024 padded rows, else one grouped launch
  // (cuBLAS's grouped kernel for these NN bf16 GEMMs is an sm_80 one on Hopper; the rule and its
  // measurements: kernels/heuristics/backward_heuristics.h).
  GemmGrouping data_grad_grouping = GemmGrouping::automatic;
  // Inspection hook (tests, debugging): called after the dispatch with the received rows
  // x[rows, hidden], their metadata [rows, 1 + 2k] (source token, local ids, weight bits; see
  // src/ep_protocol.h) and the rows received from each rank, in host memory (an MXFP8 layer's rows
  // are packed MXFP8 rows, epmoe/mxfp8.h). The GPU engine copies them to the host for it (an extra
  // sync): leave it empty in production.
  std::function<void(const void* rows, const int32_t* meta, const std::vector<int64_t>& rows_per_rank)> on_receive;
  // GPU engine: where its device memory (workspaces and saved contexts) comes from (epmoe/
  // device_allocator.h states the contract). Empty: cudaMalloc and a private stream-ordered pool.
  // The torch bindings set torch's caching allocator here for CUDA layers.
  std::shared_ptr<DeviceAllocator> device_allocator;
  // > 0: MoeLayer::forward_capturable runs with up to this many tokens per rank; its buffers are
  // allocated at construction. Needs the GPU engine on the sm_90 path.
  int64_t max_tokens_per_rank = 0;
  CapturableTransport capturable_transport = CapturableTransport::automatic;
  // Bitwise-reproducible forward: the GPU engine's DOWN stores each (row, expert) pair's weighted
  // output, and a kernel sums a row's pairs in slot order (fp32, one rounding) instead of the
  // order-free bf16 reductions into the row (costs a [pairs, hidden] bf16 buffer and one pass over
  // it). The backward and the CPU engine are deterministic either way. Not with max_tokens_per_rank.
  bool deterministic = false;
};

// What the last forward did, for the programs and benchmarks.
struct ForwardStats {
  int64_t tokens = 0;
  std::vector<int64_t> send_rows;  // [world] rows (deduplicated tokens) sent to each rank
  std::vector<int64_t> recv_rows;  // [world] rows received from each rank
  int64_t dispatch_bytes = 0;      // bytes this rank sent in the dispatch (rows + metadata)
  int64_t combine_bytes = 0;       // bytes this rank sent back in the combine
  int64_t expert_pairs = 0;        // (row, local expert) pairs computed here
  // Phase times in ms (host wall clock on the CPU engine; GPU engine: events, when enabled).
  double layout_ms = 0, exchange_ms = 0, dispatch_ms = 0, experts_ms = 0, combine_ms = 0, reduce_ms = 0;
};

// The saved state of one forward for its backward: the dispatch layout and what the save policy
// keeps (caller-owned, so several micro-batches may be in flight). Filled by MoeLayer::forward with
// a non-null `save`; consumed by MoeLayer::backward (it stays valid: backward may run again, e.g.
// with another dy). Movable, not copyable.
class MoeForwardContext {
 public:
  MoeForwardContext();
  ~MoeForwardContext();
  MoeForwardContext(MoeForwardContext&&) noexcept;
  MoeForwardContext& operator=(MoeForwardContext&&) noexcept;
  MoeForwardContext(const MoeForwardContext&) = delete;
  MoeForwardContext& operator=(const MoeForwardContext&) = delete;

  bool saved() const;                   // a forward has filled it
  SavePolicy policy() const;
  int64_t saved_bytes() const;          // bytes kept on this rank (rows, h, layout)
  int64_t routed_pairs() const;         // (received row, local expert) pairs computed on this rank
  // The activation bytes kept per routed pair: the received rows' share plus h (2 ffn bf16) under
  // rows_and_preactivation, the rows' share alone under rows_recompute. 0 without pairs.
  double activation_bytes_per_pair() const;

  struct State;  // engine-specific
  std::unique_ptr<State> state;
};

// Expert weight gradients of this rank's experts, the shapes of ExpertWeights: dw1[E_local, 2*ffn,
// hidden], dw2[E_local, hidden, ffn], each bf16 or f32 (its own dtype). accumulate: += (micro-batch
// accumulation) instead of =.
struct ExpertGradients {
  TensorView dw1, dw2;
  bool accumulate = false;
};

class MoeLayer {
 public:
  MoeLayer(const MoeConfig& cfg, const ExpertWeights& weights, std::shared_ptr<Communicator> comm,
           const LayerOptions& options = {});
  ~MoeLayer();
  MoeLayer(const MoeLayer&) = delete;
  MoeLayer& operator=(const MoeLayer&) = delete;

  // x bf16[T, hidden], topk_ids i32[T, k], topk_weights f32[T, k] -> y bf16[T, hidden] (written).
  // T may differ between ranks and may be 0. Collective: every rank must call it. `stream` is a
  // cudaStream_t for the GPU engine (work is ordered on it; returns without synchronizing).
  // With `save`, also keeps what backward needs there (LayerOptions::save_policy).
  void forward(const TensorView& x, const TensorView& topk_ids, const TensorView& topk_weights, const TensorView& y,
               void* stream = nullptr, MoeForwardContext* save = nullptr);
  // An MXFP8 layer's forward on x given in the format: x e4m3[T, hidden] with its scales
  // e8m0[T, hidden / 32] (epmoe/mxfp8.h), as the caller's previous layer produced them; the rows are
  // dispatched as they are (no quantization here). The same y as forward() on the bf16 x they stand
  // for. Forward-only; a bf16 layer raises Error(unsupported) on every rank alike.
  void forward_mxfp8(const TensorView& x, const TensorView& x_scale, const TensorView& topk_ids,
                     const TensorView& topk_weights, const TensorView& y, void* stream = nullptr);

  // The gradients of the forward saved in `ctx`, given dy bf16[T, hidden] (T of that forward):
  // dx bf16[T, hidden] (written), d_topk_weights f32[T, k] (written; 0 for dropped slots) and the
  // expert weight gradients. Collective like forward: dy travels once to each rank that had the
  // token (combine's backward is a dispatch), each rank returns one dx row per received row and one
  // d(weight) per (row, local slot) (dispatch's backward is a combine), and the source sums them in
  // fixed order in fp32. A bad argument on any rank fails every rank alike.
  void backward(const MoeForwardContext& ctx, const TensorView& dy, const TensorView& dx,
                const TensorView& d_topk_weights, const ExpertGradients& grads, void* stream = nullptr);

  // The forward as work that a CUDA graph can capture: no host sync, no allocation, nothing read on
  // the host, so one capture replays at any token count (decode). x bf16[N, hidden], topk_ids
  // i32[N, k], topk_weights f32[N, k], y bf16[N, hidden] with N <= LayerOptions::max_tokens_per_rank
  // (fixed buffers); `num_tokens` is a device int64 read when the work runs: the first num_tokens
  // rows are the tokens, y's other rows are written as 0. Bad routing cannot throw from a graph and
  // must not pass silently: a token with an id outside [-1, E) or a repeated id gets a NaN output
  // row, num_tokens outside [0, N] makes every row NaN, and the first such failure is kept on the
  // device for check_capturable. Shapes, dtypes and devices are checked on the host (throws).
  // Collective like forward (every rank calls it, or replays its graph, the same number of times);
  // the transport between ranks moves fixed-size slots of N rows (LayerOptions::
  // capturable_transport). A rank's bad routing fails only that rank's rows.
  // An FP8 layer quantizes x's first num_tokens rows on the device and moves packed FP8 rows through
  // the slots; its kernel form is fixed at construction from the capacity's pairs (N min(k, E_local)
  // per rank; LayerOptions::sm90_plan's swap= / fused= override it); no save.
  // save: also keep what backward_capturable needs, in the layer's own buffers (the layout, the
  // received rows, h under rows_and_preactivation): one saved capturable forward per layer at a
  // time, the next forward_capturable replaces it. The first saving call sizes those buffers, so it
  // must not be under capture (warm up once, as before any capture).
  void forward_capturable(const TensorView& x, const TensorView& topk_ids, const TensorView& topk_weights,
                          const TensorView& y, const int64_t* num_tokens, void* stream = nullptr, bool save = false);
  // The capturable forward of an MXFP8 layer on x given in the format (as forward_mxfp8): x
  // e4m3[N, hidden] with its scales e8m0[N, hidden / 32] (both 16-byte aligned, as every argument); its
  // first num_tokens rows are dispatched as they are. The same y as forward_capturable on the bf16 x
  // they stand for. A bf16 or block-128 layer throws Error(unsupported).
  void forward_capturable_mxfp8(const TensorView& x, const TensorView& x_scale, const TensorView& topk_ids,
                                const TensorView& topk_weights, const TensorView& y, const int64_t* num_tokens,
                                void* stream = nullptr);
  // The gradients of the last forward_capturable(..., save = true), as capturable work like it (no
  // host sync, nothing read on the host): x and topk_ids are that forward's (the same buffers,
  // unchanged), num_tokens the same device count; dy, dx bf16[N, hidden], d_topk_weights f32[N, k]
  // (rows past the count written as 0) and the expert weight gradients (bf16 or f32; accumulate
  // adds). Collective like the forward: dy travels in the forward's slots, dx and the weight
  // gradients come back in them. Runs the sm_90 dgrad / wgrad kernels, which need hidden and ffn
  // multiples of 256 (Error(unsupported) otherwise, on every rank alike: the shapes are the
  // config's). After a forward that recorded a failure (check_capturable) the gradients are not
  // meaningful.
  void backward_capturable(const TensorView& x, const TensorView& topk_ids, const TensorView& dy, const TensorView& dx,
                           const TensorView& d_topk_weights, const ExpertGradients& grads, const int64_t* num_tokens,
                           void* stream = nullptr);
  // Waits for `stream`, then throws the first failure that the capturable forwards queued so far
  // recorded (Error with its code and the token, slot and id), clearing it; returns if none.
  void check_capturable(void* stream = nullptr);

  // Points the layer at other weights of the same shapes, dtype and device (a framework's
  // Parameters may be replaced between steps; torch/ binds them before every call). Local, not
  // collective; work already queued keeps the weights it was queued with. The caller keeps the
  // weights alive and unchanged while calls that use them run.
  void bind_weights(const ExpertWeights& weights);
  const MoeConfig& config() const;
  const ForwardStats& last_stats() const;
  ExpertPath expert_path() const;  // the path in use after `automatic` was resolved

  class Engine;  // CPU or GPU implementation

 private:
  std::unique_ptr<Engine> engine_;
};

}  // namespace epmoe
