// Internal: the GPU engine's class, shared by its two halves - gpu_engine.cu (construction and the
// forward's phases) and gpu_backward.cu (what a forward saves, and the backward). Included by those
// files only.
#pragma once
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "engine.h"
#include "gpu_engine.h"
#include "gpu_support.cuh"
#include "kernels/expert_problem.cuh"
#include "kernels/fallback/cublas_grouped.cuh"
#include "kernels/heuristics/sm90_heuristics.h"
#include "kernels/sm90/swap_mx.cuh"

namespace epmoe::gpu {

enum Phase { kStart, kLayoutEnd, kExchangeEnd, kDispatchStart, kDispatchEnd, kExpertsEnd, kCombineEnd, kReduceEnd, kPhases };

// What a GPU forward keeps for its backward (gpu_backward.cu), in buffers of the engine's pool that
// the context owns, so several forwards may be saved before their backwards and a context may
// outlive its layer. The destructor frees them in stream order after `last_use` (recorded at the
// end of the forward and of every backward on the context).
struct GpuSaved final : MoeForwardContext::State {
  int device = 0;
  int64_t T = 0, S = 0, R = 0, P = 0;         // tokens, rows sent, rows received, padded expert rows
  std::vector<int64_t> send_rows, recv_rows;  // [world]
  std::vector<int64_t> send_hdr;              // [world, header_words] this rank's count headers
  std::vector<int64_t> host_expert;           // [2 E_local + 1] padded offsets, then counts
  PoolBuffer ids;         // i32 [T, k]      the forward's topk_ids
  PoolBuffer token_row;   // i32 [T, world]  source layout
  PoolBuffer send_token;  // i32 [S]
  PoolBuffer recv_meta;   // i32 [R, meta_words]
  PoolBuffer expert;      // i64 [2 E_local + 1] device copy of host_expert
  PoolBuffer pair_row;    // i32 [P]
  PoolBuffer pair_weight; // f32 [P]
  PoolBuffer rows;        // bf16: xs [P, hidden] expert-sorted (rows_and_preactivation) or recv_x [R, hidden]
  PoolBuffer h;           // bf16 [P, 2 ffn] (rows_and_preactivation)
  cudaEvent_t last_use = nullptr;
  // The stream last_use was recorded on (the last forward / backward on this context): where a
  // DeviceAllocator is given the buffers back (set by that call, hence mutable).
  mutable cudaStream_t last_stream = nullptr;
  std::shared_ptr<MemoryPool> pool;  // the buffers' pool, alive while they are
  ~GpuSaved() override;
};

class GpuEngine final : public MoeLayer::Engine {
 public:
  GpuEngine(const MoeConfig& c, const ExpertWeights& w, std::shared_ptr<Communicator> comm, const LayerOptions& opt);
  ~GpuEngine() override { destroy(); }

  void forward(const TensorView& x, const TensorView& ids, const TensorView& wts, const TensorView& y,
               void* stream, MoeForwardContext* save) override;
  // An MXFP8 layer's forward on x given in the format (e4m3 with its e8m0 scales): the rows are
  // packed as they are (pack_rows_mx_given) instead of quantized at the source.
  void forward_mxfp8(const TensorView& x, const TensorView& x_scale, const TensorView& ids, const TensorView& wts,
                     const TensorView& y, void* stream) override;
  void backward(const MoeForwardContext& ctx, const TensorView& dy, const TensorView& dx, const TensorView& dwts,
                const ExpertGradients& grads, void* stream) override;

  void bind_weights(const ExpertWeights& w) override;
  // gpu_capturable.cu: the capturable forward (local: layout, UP, DOWN straight into y; slots: the
  // dispatch and combine as fixed-size slot all-to-alls around them).
  void forward_capturable(const TensorView& x, const TensorView& ids, const TensorView& wts, const TensorView& y,
                          const int64_t* num_tokens, void* stream, bool save, const TensorView* x_scale) override;
  void check_capturable(void* stream) override;
  // gpu_capturable_backward.cu: the capturable backward on the saved capturable forward.
  void backward_capturable(const TensorView& x, const TensorView& ids, const TensorView& dy, const TensorView& dx,
                           const TensorView& dwts, const ExpertGradients& grads, const int64_t* num_tokens,
                           void* stream) override;
  GpuDispatchView dispatch_view() const;

 private:
  void destroy() noexcept;
  // gpu_capturable.cu: the capturable forward's buffers for LayerOptions::max_tokens_per_rank.
  void init_capturable();
  // The capturable backward's requirements (throws) and its buffers (cap_bwd_, at the first saving
  // forward_capturable; refused under capture).
  void check_capturable_backward(const char* who) const;
  void init_capturable_backward(cudaStream_t s);
  // The rows the capturable layout reads: N (local) or W slots of N (slots transport).
  int64_t cap_input_rows() const {
    return cap_slots_on_ ? int64_t(cfg.world_size) * opt_.max_tokens_per_rank : opt_.max_tokens_per_rank;
  }
  // Arguments on another device than the weights fail like any bad argument (in the exchange).
  protocol::Status check_devices(std::initializer_list<std::pair<const TensorView*, const char*>> args) const;

  // What one forward's phases hand each other.
  struct Forward {
    int64_t T = 0;                  // tokens of this rank (0 after a bad argument)
    protocol::ReceivePlan plan;     // rows and pairs received from each rank (the count exchange)
    std::vector<int64_t> send_rows; // [world] rows sent to each rank
    int64_t S = 0, R = 0, P = 0;    // rows sent, rows received, padded expert rows
    GpuSaved* save = nullptr;       // forward(..., save): what is being kept
    const TensorView* x_scale = nullptr;  // forward_mxfp8: x is e4m3 with these e8m0 scales
  };
  // The forward's phases on `s` (gpu_engine.cu's header lists them); forward() wraps them for the
  // ordering with other forwards and backwards.
  void forward_impl(const TensorView& x, const TensorView* x_scale, const TensorView& ids, const TensorView& wts,
                    const TensorView& y, void* stream, MoeForwardContext* save);
  void run(const TensorView& x, const TensorView& ids, const TensorView& wts, const TensorView& y, cudaStream_t s,
           GpuSaved* save, const TensorView* x_scale);
  int64_t route_tokens(const TensorView& x, const TensorView& ids, const TensorView& wts, const TensorView& y,
                       cudaStream_t s, bool saving, const TensorView* x_scale);
  void exchange_counts(Forward& f, cudaStream_t s);
  void dispatch(const TensorView& x, const Forward& f, cudaStream_t s);
  void run_experts(const Forward& f, cudaStream_t s);
  // forward(..., save) under rows_and_preactivation: h goes through cuBLAS into the saved state,
  // SwiGLU makes act, then the path's DOWN (gpu_backward.cu).
  void run_experts_saving_h(const Forward& f, kernels::ExpertProblem prob, cudaStream_t s);
  // fused_acc_ for `rows` output rows, all zero (a grown buffer is zeroed on s).
  float* fused_accumulator(int64_t rows, cudaStream_t s);
  void combine(const Forward& f, cudaStream_t s);
  void source_reduce(const Forward& f, const TensorView& y, cudaStream_t s);
  // gpu_backward.cu: the saved state's buffers (after the count exchange) and the copies that fill
  // them (at the forward's end).
  void begin_save(Forward& f, GpuSaved& st, cudaStream_t s);
  void finish_save(const Forward& f, const TensorView& ids, GpuSaved& st, cudaStream_t s);
  void run_backward(const MoeForwardContext& ctx, const TensorView& dy, const TensorView& dx, const TensorView& dwts,
                    const ExpertGradients& grads, cudaStream_t s);

  void record(Phase ph, cudaStream_t s) {
    if (opt_.record_phase_times) EPMOE_CUDA_CHECK(cudaEventRecord(ev_phase_[ph], s));
  }
  double elapsed(Phase a, Phase b) const {
    float ms = 0;
    EPMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, ev_phase_[a], ev_phase_[b]));
    return ms;
  }

  std::shared_ptr<Communicator> comm_;
  LayerOptions opt_;
  int device_ = 0;
  const __nv_bfloat16* w1_ = nullptr;
  const __nv_bfloat16* w2_ = nullptr;
  // An FP8 layer (ExpertWeights::fp8): its E4M3 weights and their scales (w1_ / w2_ stay null) in
  // fp8_scales_'s format (MXFP8's E8M0 bytes or block-128's fp32 words), run by the FP8 kernels
  // (kernels/sm90/swap_mx.cuh); forward-only (the capturable forward too).
  bool fp8_ = false;
  kernels::Fp8Scales fp8_scales_ = kernels::Fp8Scales::mx32;
  const uint8_t *w1q_ = nullptr, *w1s_ = nullptr, *w2q_ = nullptr, *w2s_ = nullptr;
  void set_weights(const ExpertWeights& w);
  size_t wire_row_bytes() const;  // a dispatched row: bf16, or a packed FP8 row
  // The FP8 experts' problem: x and out `rows` packed / bf16 rows on `layout`, act the packed act
  // rows, in `form` (zero_out and out_acc are the caller's). fp8_form: the form for `pairs` pairs
  // (block-128: its tile form; MXFP8: choose_mx_form with sm90_plan's swap= / fused= on top).
  kernels::MxExpertProblem fp8_problem(const uint8_t* x, int64_t rows, const kernels::ExpertLayoutView& layout,
                                       uint8_t* act, bf16* out, kernels::MxForm form) const;
  kernels::MxForm fp8_form(int64_t pairs) const;

  cudaStream_t side_ = nullptr;
  cudaEvent_t ev_done_ = nullptr, ev_fork_ = nullptr, ev_zeroed_ = nullptr;
  std::array<cudaEvent_t, kPhases> ev_phase_{};
  cublasHandle_t cublas_ = nullptr;  // (created on first use by the cuBLAS path or a backward)
  kernels::CublasPointerArrays cublas_ptrs_;
  std::shared_ptr<MemoryPool> pool_;  // the saved contexts' memory
  BufferSource buffer_source_;        // the DeviceBuffers' memory (declared before them: outlives them)

  DeviceBuffer fixed_;
  int64_t *d_status_ = nullptr, *d_send_rows_ = nullptr, *d_send_offsets_ = nullptr, *d_send_pairs_ = nullptr;
  int64_t *d_hdr_send_ = nullptr, *d_hdr_recv_ = nullptr, *d_expert_off_ = nullptr, *d_expert_cnt_ = nullptr;
  kernels::Sm90Device sm90_device_;  // (sm90 path) what the plan heuristics read of the device
  int32_t* d_error_ = nullptr;  // sticky expert-layout inconsistency flag, folded into the headers
  int64_t* h_hdr_ = nullptr;     // pinned [2, W, hw]: my send headers, then the received ones
  int64_t* h_hdr_up_ = nullptr;  // pinned [W, hw]: host-built headers (bad arguments, the backward's status)
  int64_t* h_expert_ = nullptr;  // pinned [2*El + 1]: padded offsets, then counts

  // token-sized
  DeviceBuffer token_row_, send_meta_, send_token_, layout_ws_;
  // count-sized (send_x_ also receives the combine: the dispatch is done with it by then)
  DeviceBuffer send_x_, recv_x_, recv_meta_, combine_, xs_, act_, pair_row_, pair_weight_, expert_ws_, cublas_ws_;
  // the deterministic forward's (LayerOptions::deterministic): each pair's expert output, the row ->
  // pair map its fixed-order sum reads
  DeviceBuffer det_pair_out_, det_row_pair_;
  // the fused pipeline's fp32 accumulator (Sm90Plan::fused; ExpertProblem::out_acc): all zero between
  // calls (zeroed when it grows, left zero by the pipeline)
  DeviceBuffer fused_acc_;
  // the backward's scratch (count-sized): dy rows expert-sorted, da, dh, act_s, dx per pair, ds per
  // pair, the row -> pair map, ds per (row, slot) on both sides
  DeviceBuffer b_dys_, b_da_, b_dh_, b_act_s_, b_dxp_, b_ds_pair_, b_row_pair_, b_ds_rows_, b_ds_back_, b_h_;
  // Every DeviceBuffer above: bound to buffer_source_ at construction, released by destroy(). (A
  // buffer missing here fails its first ensure(), so it cannot bypass the layer's allocator.)
  auto device_buffers() {
    return std::array{&fixed_,     &token_row_, &send_meta_, &send_token_, &layout_ws_, &send_x_,   &recv_x_,
                      &recv_meta_, &combine_,   &xs_,        &act_,        &pair_row_,  &pair_weight_,
                      &expert_ws_, &cublas_ws_, &b_dys_,     &b_da_,       &b_dh_,      &b_act_s_,  &b_dxp_,
                      &b_ds_pair_, &b_row_pair_, &b_ds_rows_, &b_ds_back_, &b_h_, &cap_layout_, &cap_act_,
                      &cap_slots_, &det_pair_out_, &det_row_pair_, &fused_acc_, &cap_fused_acc_, &cap_bwd_,
                      &cap_xq_};
  }

  // the capturable forward's (sized once, for max_tokens_per_rank; gpu_capturable.cu carves them):
  // the expert layout and error record, act [cap_rows_, ffn] (bf16, or packed FP8 rows), and the slots
  // transport's buffers
  DeviceBuffer cap_layout_, cap_act_, cap_slots_;
  DeviceBuffer cap_fused_acc_;  // (sized at construction where a capturable plan can be fused; else null)
  // An FP8 layer's: x's rows quantized to its format [N] (packed rows), act as packed rows, and the
  // experts' form, fixed at construction for every replay
  DeviceBuffer cap_xq_;
  kernels::MxForm cap_mx_form_ = kernels::MxForm::swap;
  int64_t cap_rows_ = 0;
  bool cap_slots_on_ = false;  // the slots transport (else local)
  // the capturable backward's scratch (gpu_capturable_buffers.cuh: carve_backward), and what the
  // last capturable forward queued (host order = the order a graph replays them in)
  DeviceBuffer cap_bwd_;
  bool cap_bwd_supported_ = false;  // the dgrad / wgrad kernels take this config here (init_capturable)
  struct CapturableSaved {
    bool on = false;  // the last forward_capturable saved
    const void* x = nullptr;
    const void* ids = nullptr;
    int64_t N = 0;
  } cap_saved_;

  std::vector<int64_t> recv_hdr_;
  int64_t last_recv_rows_ = 0;
  std::vector<int64_t> last_rows_per_rank_;
};

}  // namespace epmoe::gpu
