// The GPU engine: the EP forward on the device, over a device communicator (NCCL). One method per
// phase, in the order the data flows:
//
//   route_tokens    dispatch_layout + count_headers (bad arguments travel as a status)
//   exchange_counts alltoall_i64 of the headers, the ONE host sync of the forward
//   dispatch        pack + alltoallv {rows, meta}   [side stream: zero the combine buffer]
//   run_experts     expert layout -> sm90 kernels (UP gathers its rows itself) or gather + cuBLAS
//   combine         alltoallv of the expert outputs back to their source ranks
//   source_reduce   each token's rows summed in fixed order into y
//
// Streams and ordering: all work goes on the caller's stream `s`, except the zeroing of the combine
// buffer, which runs on a side stream between a fork event (after the buffers are sized) and a join
// event that `s` waits on before the experts reduce into that buffer, so it overlaps the dispatch.
// Each forward starts by waiting for the previous forward's end event (ev_done_), so forwards on
// different streams never overlap on the shared buffers.
//
// Buffers: grow-only, reused across calls. The token-sized ones are sized at the start of the
// forward (growing them first waits for the previous forward on the host, rare); the count-sized
// ones right after the count exchange's host wait, when this stream (and, through ev_done_, the
// previous forward) has drained, so freeing the old memory is safe.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "epmoe/mxfp8.h"
#include "gpu_engine_impl.cuh"
#include "kernels/backward/row_pairs.cuh"
#include "kernels/ep/combine_reduce.cuh"
#include "kernels/ep/dispatch_layout.cuh"
#include "kernels/ep/expert_layout.cuh"
#include "kernels/ep/pack_rows.cuh"
#include "kernels/ep/pack_rows_fp8b.cuh"
#include "kernels/ep/pack_rows_mx.cuh"
#include "kernels/expert_problem.cuh"
#include "kernels/fallback/cublas_experts.cuh"
#include "kernels/fallback/gather_rows.cuh"
#include "kernels/sm90/experts.cuh"
#include "kernels/heuristics/mx_heuristics.h"
#include "kernels/sm90/swap_mx.cuh"

namespace epmoe::gpu {

static_assert(sizeof(bf16) == sizeof(__nv_bfloat16));

GpuEngine::GpuEngine(const MoeConfig& c, const ExpertWeights& w, std::shared_ptr<Communicator> comm,
                     const LayerOptions& opt)
    : comm_(std::move(comm)), opt_(opt) {
  cfg = c;
  EPMOE_CHECK(comm_ != nullptr, ErrorCode::invalid_argument, "the GPU engine needs a communicator");
  EPMOE_CHECK(comm_->memory_space() == MemorySpace::device, ErrorCode::invalid_argument,
              "the GPU engine (cuda weights) needs a device communicator (NCCL), got '", comm_->name(), "'");
  cfg.validate();
  validate_weights(cfg, w, DeviceType::cuda);
  EPMOE_CHECK(w.w1.device_index == w.w2.device_index, ErrorCode::invalid_argument, "w1 is on cuda:",
              w.w1.device_index, " but w2 on cuda:", w.w2.device_index);
  device_ = w.w1.device_index;
  fp8_ = w.fp8();
  fp8_scales_ = w.fp8_block() ? kernels::Fp8Scales::block128 : kernels::Fp8Scales::mx32;
  set_weights(w);
  DeviceGuard guard(device_);
  if (fp8_) {
    // What the MX kernels take today; refused here, alike on every rank (same config and options).
    EPMOE_CHECK(kernels::sm90_experts_supported(device_), ErrorCode::unsupported,
                "FP8 weights on cuda need a compute capability 9.0 GPU and a build with sm_90a code (device ",
                device_, ")");
    EPMOE_CHECK(cfg.hidden % mx::kGpuDimAlignment == 0 && cfg.ffn % mx::kGpuDimAlignment == 0, ErrorCode::unsupported,
                "FP8 weights on cuda need hidden and ffn multiples of ", mx::kGpuDimAlignment, " (got hidden ",
                cfg.hidden, ", ffn ", cfg.ffn, ")");
    EPMOE_CHECK(opt.expert_path == ExpertPath::automatic || opt.expert_path == ExpertPath::sm90,
                ErrorCode::unsupported, "an FP8 layer runs the sm_90 FP8 kernels: expert_path must be automatic or sm90");
    EPMOE_CHECK(!(w.fp8_block() && (opt.sm90_plan.swap_ab.value_or(false) || opt.sm90_plan.fused.value_or(false))),
                ErrorCode::unsupported,
                "an FP8 block-128 layer runs the tile form only: sm90_plan swap=on / fused=on have no block-128 kernel");
    Sm90PlanOverride rest = opt.sm90_plan;  // an FP8 layer reads only the form (swap=, fused=) of a plan
    rest.swap_ab.reset();
    rest.fused.reset();
    EPMOE_CHECK(!opt.deterministic && rest.empty(), ErrorCode::unsupported,
                "an FP8 layer on cuda has no deterministic mode and takes of an sm90_plan override only swap=on|off "
                "and fused=on|off (its swap-AB, tile or fused form)");
  }

  switch (fp8_ ? ExpertPath::sm90 : opt.expert_path) {
    case ExpertPath::automatic:
      path = kernels::sm90_experts_supported(device_) ? ExpertPath::sm90 : ExpertPath::cublas;
      break;
    case ExpertPath::sm90:
      EPMOE_CHECK(kernels::sm90_experts_supported(device_), ErrorCode::unsupported,
                  "expert_path sm90 needs a compute capability 9.0 GPU and a build with sm_90a code (device ",
                  device_, ")");
      path = ExpertPath::sm90;
      break;
    case ExpertPath::cublas: path = ExpertPath::cublas; break;
    case ExpertPath::cpu:
      EPMOE_FAIL(ErrorCode::invalid_argument, "expert_path cpu needs cpu weights; these are on cuda:", device_);
  }
  if (path == ExpertPath::sm90) sm90_device_ = kernels::sm90_device(device_);

  const int W = cfg.world_size, El = cfg.experts_per_rank(), hw = protocol::header_words(El);
  // The DeviceBuffers' memory: the layer's allocator, else cudaMalloc. (Stream null until the first
  // call: the constructor's own allocation is used by its cudaMemset on the legacy stream.)
  buffer_source_ = BufferSource{opt.device_allocator, device_, nullptr};
  for (DeviceBuffer* b : device_buffers()) b->bind(&buffer_source_);
  try {
    EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
    EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&ev_done_, cudaEventDisableTiming));
    EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&ev_fork_, cudaEventDisableTiming));
    EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&ev_zeroed_, cudaEventDisableTiming));
    for (cudaEvent_t& e : ev_phase_) EPMOE_CUDA_CHECK(cudaEventCreate(&e));
    // cuBLAS: the fallback path's GEMMs and the backward's; 3 pointers per expert for each of the
    // five grouped GEMMs one call runs at most (the backward's recompute, da, dx, dW2, dW1).
    EPMOE_CUBLAS_CHECK(cublasCreate(&cublas_));
    kernels::cublas_pointer_arrays_create(cublas_ptrs_, 15 * int64_t(El));
    pool_ = std::make_shared<MemoryPool>(device_, opt.device_allocator);  // the saved contexts' memory
    // Fixed-size device words, one allocation, each array 256-byte aligned:
    //   status[4] send_rows[W] send_offsets[W+1] send_pairs[W*El]
    //   hdr_send[W*hw] + hdr_recv[W*hw] (adjacent: one copy brings both to the host)
    //   expert_off[El+1] + expert_cnt[El] (adjacent: one upload)   error[1] (int32, sticky)
    const size_t sizes[] = {4, size_t(W), size_t(W) + 1, size_t(W) * El, 2 * size_t(W) * hw, 2 * size_t(El) + 1, 1};
    auto padded = [](size_t words) { return (words + 31) / 32 * 32; };
    size_t words = 0;
    for (size_t n : sizes) words += padded(n);
    fixed_.ensure(words * sizeof(int64_t));
    EPMOE_CUDA_CHECK(cudaMemset(fixed_.as<void>(), 0, fixed_.bytes()));
    int64_t* p = fixed_.as<int64_t>();
    auto take = [&](size_t n) {
      int64_t* q = p;
      p += padded(n);
      return q;
    };
    d_status_ = take(sizes[0]);
    d_send_rows_ = take(sizes[1]);
    d_send_offsets_ = take(sizes[2]);
    d_send_pairs_ = take(sizes[3]);
    d_hdr_send_ = take(sizes[4]);
    d_hdr_recv_ = d_hdr_send_ + size_t(W) * hw;
    d_expert_off_ = take(sizes[5]);
    d_expert_cnt_ = d_expert_off_ + El + 1;
    d_error_ = reinterpret_cast<int32_t*>(take(sizes[6]));
    h_hdr_ = pinned_alloc<int64_t>(2 * size_t(W) * hw);
    h_hdr_up_ = pinned_alloc<int64_t>(size_t(W) * hw);
    h_expert_ = pinned_alloc<int64_t>(2 * size_t(El) + 1);
    if (opt.max_tokens_per_rank > 0) init_capturable();
    // cudaMemset of device memory returns before it is done, on the legacy stream, which the
    // caller's non-blocking streams do not wait for: the zeros must be in place before a first call.
    EPMOE_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  } catch (...) {
    destroy();
    throw;
  }
}

void GpuEngine::destroy() noexcept {
  int prev = -1;
  if (cudaGetDevice(&prev) == cudaSuccess && prev != device_) cudaSetDevice(device_);
  // Nothing of ours may still run when the memory goes.
  if (ev_done_) cudaEventSynchronize(ev_done_);
  if (side_) cudaStreamSynchronize(side_);
  buffer_source_.stream = side_;  // (their uses are synchronized: a DeviceAllocator frees them on a stream of ours)
  for (DeviceBuffer* b : device_buffers()) b->release();
  kernels::cublas_pointer_arrays_destroy(cublas_ptrs_);
  if (cublas_) cublasDestroy(cublas_);
  pool_.reset();  // (contexts still saved hold it on)
  for (int64_t* h : {h_hdr_, h_hdr_up_, h_expert_})
    if (h) cudaFreeHost(h);
  for (cudaEvent_t e : {ev_done_, ev_fork_, ev_zeroed_})
    if (e) cudaEventDestroy(e);
  for (cudaEvent_t e : ev_phase_)
    if (e) cudaEventDestroy(e);
  if (side_) cudaStreamDestroy(side_);
  cublas_ = nullptr;
  h_hdr_ = h_hdr_up_ = h_expert_ = nullptr;
  ev_done_ = ev_fork_ = ev_zeroed_ = nullptr;
  ev_phase_ = {};
  side_ = nullptr;
  if (prev >= 0 && prev != device_) cudaSetDevice(prev);
}


protocol::Status GpuEngine::check_devices(
    std::initializer_list<std::pair<const TensorView*, const char*>> args) const {
  protocol::Status s;
  for (const auto& [t, name] : args) {
    if (t->numel() > 0 && t->device_index != device_) {
      s.code = ErrorCode::invalid_argument;
      s.text = detail::concat(name, " is on cuda:", t->device_index, " but the layer's weights are on cuda:", device_);
      return s;
    }
  }
  return s;
}

void GpuEngine::bind_weights(const ExpertWeights& w) {
  validate_weights(cfg, w, DeviceType::cuda);
  EPMOE_CHECK(w.w1.device_index == device_ && w.w2.device_index == device_, ErrorCode::invalid_argument,
              "bind_weights: w1 / w2 on cuda:", w.w1.device_index, " / cuda:", w.w2.device_index,
              " but the layer runs on cuda:", device_);
  auto format = [](bool fp8, bool block) { return !fp8 ? "bf16" : block ? "FP8 block-128" : "MXFP8"; };
  const bool block = fp8_scales_ == kernels::Fp8Scales::block128;
  EPMOE_CHECK(w.fp8() == fp8_ && w.fp8_block() == (fp8_ && block), ErrorCode::invalid_argument,
              "bind_weights: the layer was built with ", format(fp8_, block), " weights; these are ",
              format(w.fp8(), w.fp8_block()));
  set_weights(w);
}

void GpuEngine::set_weights(const ExpertWeights& w) {
  auto aligned = [](const TensorView& t) { return reinterpret_cast<uintptr_t>(t.data) % 16 == 0; };
  EPMOE_CHECK(aligned(w.w1) && aligned(w.w2) && (!w.fp8() || (aligned(w.w1_scale) && aligned(w.w2_scale))),
              ErrorCode::invalid_argument, "w1 and w2 (and their scales) must be 16-byte aligned");
  if (w.fp8()) {
    EPMOE_CHECK(w.w1_scale.device_index == device_ && w.w2_scale.device_index == device_,
                ErrorCode::invalid_argument, "w1_scale / w2_scale must be on cuda:", device_, " with the weights");
    w1q_ = w.w1.ptr<uint8_t>(), w1s_ = w.w1_scale.ptr<uint8_t>();
    w2q_ = w.w2.ptr<uint8_t>(), w2s_ = w.w2_scale.ptr<uint8_t>();
  } else {
    w1_ = w.w1.ptr<__nv_bfloat16>();
    w2_ = w.w2.ptr<__nv_bfloat16>();
  }
}

size_t GpuEngine::wire_row_bytes() const {
  return fp8_ ? size_t(kernels::fp8_packed_row_bytes(fp8_scales_, cfg.hidden)) : size_t(cfg.hidden) * sizeof(bf16);
}

kernels::MxExpertProblem GpuEngine::fp8_problem(const uint8_t* x, int64_t rows, const kernels::ExpertLayoutView& layout,
                                                uint8_t* act, bf16* out, kernels::MxForm form) const {
  kernels::MxExpertProblem m;
  m.x = x, m.x_rows = rows;
  m.padded_offsets = layout.padded_offsets, m.pair_row = layout.pair_row, m.pair_weight = layout.pair_weight;
  m.w1 = w1q_, m.w1_scale = w1s_, m.w2 = w2q_, m.w2_scale = w2s_;
  m.act = act;
  m.out = reinterpret_cast<__nv_bfloat16*>(out), m.out_rows = rows;
  m.rows_capacity = layout.rows_capacity, m.experts = cfg.experts_per_rank(), m.hidden = cfg.hidden, m.ffn = cfg.ffn;
  m.scales = fp8_scales_;
  m.form = form;
  return m;
}

kernels::MxForm GpuEngine::fp8_form(int64_t pairs) const {
  if (fp8_scales_ == kernels::Fp8Scales::block128) return kernels::MxForm::tile;  // (its one form)
  return kernels::choose_mx_form(pairs, cfg.experts_per_rank(), opt_.sm90_plan.swap_ab, opt_.sm90_plan.fused);
}

GpuDispatchView GpuEngine::dispatch_view() const {
  GpuDispatchView v;
  v.recv_x = recv_x_.as<void>();
  v.recv_meta = recv_meta_.as<int32_t>();
  v.recv_rows = last_recv_rows_;
  v.rows_per_rank = last_rows_per_rank_;
  v.hidden = cfg.hidden;
  v.meta_words = protocol::meta_words(cfg.top_k);
  return v;
}

void GpuEngine::forward(const TensorView& x, const TensorView& ids, const TensorView& wts, const TensorView& y,
                        void* stream, MoeForwardContext* save) {
  forward_impl(x, nullptr, ids, wts, y, stream, save);
}

void GpuEngine::forward_mxfp8(const TensorView& x, const TensorView& x_scale, const TensorView& ids,
                              const TensorView& wts, const TensorView& y, void* stream) {
  forward_impl(x, &x_scale, ids, wts, y, stream, nullptr);
}

void GpuEngine::forward_impl(const TensorView& x, const TensorView* x_scale, const TensorView& ids,
                             const TensorView& wts, const TensorView& y, void* stream, MoeForwardContext* save) {
  DeviceGuard guard(device_);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  // After the previous forward or backward (whatever stream it ran on): the buffers are shared.
  EPMOE_CUDA_CHECK(cudaStreamWaitEvent(s, ev_done_, 0));
  CommStreamScope comm_stream(*comm_, s);  // the collectives of run() order themselves on `s`
  buffer_source_.stream = s;               // buffers this call sizes are for `s`
  std::unique_ptr<GpuSaved> saved;
  if (save != nullptr) {
    saved = std::make_unique<GpuSaved>();
    saved->device = device_;
    saved->last_stream = s;
    EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&saved->last_use, cudaEventDisableTiming));
  }
  try {
    run(x, ids, wts, y, s, saved.get(), x_scale);
  } catch (...) {
    // Work of this forward may still be queued (on `s`, and the zeroing on the side stream): the
    // end event must cover it, or the next forward could free memory it still uses (and so must
    // the half-saved state's, which frees its buffers after it).
    cudaStreamWaitEvent(s, ev_zeroed_, 0);
    cudaEventRecord(ev_done_, s);
    if (saved) cudaEventRecord(saved->last_use, s);
    throw;
  }
  if (saved) {
    EPMOE_CUDA_CHECK(cudaEventRecord(saved->last_use, s));
    save->state = std::move(saved);
  }
}

void GpuEngine::run(const TensorView& x, const TensorView& ids, const TensorView& wts, const TensorView& y,
                    cudaStream_t s, GpuSaved* save, const TensorView* x_scale) {
  stats = ForwardStats{};
  last_recv_rows_ = 0;
  last_rows_per_rank_.assign(cfg.world_size, 0);
  Forward f;
  f.save = save;
  f.x_scale = x_scale;
  f.T = route_tokens(x, ids, wts, y, s, save != nullptr, x_scale);
  exchange_counts(f, s);
  if (save) begin_save(f, *save, s);
  dispatch(x, f, s);
  run_experts(f, s);
  combine(f, s);
  source_reduce(f, y, s);
  if (save) finish_save(f, ids, *save, s);
  EPMOE_CUDA_CHECK(cudaEventRecord(ev_done_, s));

  if (opt_.record_phase_times) {
    comm_->host_wait(s, "phase times");
    stats.layout_ms = elapsed(kStart, kLayoutEnd);
    stats.exchange_ms = elapsed(kLayoutEnd, kExchangeEnd);
    stats.dispatch_ms = elapsed(kDispatchStart, kDispatchEnd);
    stats.experts_ms = elapsed(kDispatchEnd, kExpertsEnd);
    stats.combine_ms = elapsed(kExpertsEnd, kCombineEnd);
    stats.reduce_ms = elapsed(kCombineEnd, kReduceEnd);
  }
}

// Validates the arguments, routes each token to its destination ranks and writes this rank's count
// headers. A bad argument becomes this rank's status with zero rows, so the count exchange fails
// every rank alike. Returns T (0 after a bad argument).
int64_t GpuEngine::route_tokens(const TensorView& x, const TensorView& ids, const TensorView& wts,
                                const TensorView& y, cudaStream_t s, bool saving, const TensorView* x_scale) {
  NvtxRange range("layout");
  const int W = cfg.world_size, El = cfg.experts_per_rank(), k = cfg.top_k;
  const size_t meta_bytes = size_t(protocol::meta_words(k)) * sizeof(int32_t);
  protocol::Status status = validate_forward_args(cfg, x, ids, wts, y, DeviceType::cuda, x_scale);
  if (status.ok() && fp8_ && saving) {
    status.code = ErrorCode::unsupported;
    status.text = "an FP8 layer is forward-only: a forward that saves for backward is not supported";
  }
  if (status.ok() && x_scale != nullptr)
    status = check_given_mx_layer("forward_mxfp8", fp8_, fp8_scales_ == kernels::Fp8Scales::block128);
  if (status.ok()) status = check_devices({{&x, "x"}, {&ids, "topk_ids"}, {&wts, "topk_weights"}, {&y, "y"}});
  if (status.ok() && x_scale != nullptr) status = check_devices({{x_scale, "x_scale"}});
  if (status.ok() && x.shape[0] * std::max(k, W) >= int64_t(INT32_MAX)) {
    status.code = ErrorCode::unsupported;
    status.text = detail::concat("T = ", x.shape[0], " tokens x max(top_k, world) = ", std::max(k, W),
                                 " exceeds the device layout's 32-bit index");
  }
  int64_t T = status.ok() ? x.shape[0] : 0;

  // Token-sized buffers; a row per (token, destination) at most. Failing to get them is a status
  // like a bad argument, so that every rank fails alike instead of the others waiting.
  if (status.ok()) {
    try {
      const int64_t max_rows = T * std::min(k, W);
      const size_t need_token_row = size_t(T) * W * sizeof(int32_t), need_meta = size_t(max_rows) * meta_bytes,
                   need_token = size_t(max_rows) * sizeof(int32_t),
                   need_ws = kernels::dispatch_layout_workspace_bytes(T, W);
      if (!token_row_.fits(need_token_row) || !send_meta_.fits(need_meta) || !send_token_.fits(need_token) ||
          !layout_ws_.fits(need_ws)) {
        EPMOE_CUDA_CHECK(cudaEventSynchronize(ev_done_));  // the previous forward may still use them
        token_row_.ensure(need_token_row);
        send_meta_.ensure(need_meta);
        send_token_.ensure(need_token);
        layout_ws_.ensure(need_ws);
      }
    } catch (const Error& e) {
      status.code = e.code();
      status.text = e.what();
      T = 0;
    }
  }

  record(kStart, s);
  if (status.ok()) {
    kernels::DispatchLayoutArgs a;
    a.topk_ids = ids.ptr<int32_t>();
    a.topk_weights = wts.ptr<float>();
    a.num_tokens = T;
    a.top_k = k;
    a.num_experts = cfg.num_experts;
    a.world = W;
    a.status = d_status_;
    a.send_rows = d_send_rows_;
    a.send_offsets = d_send_offsets_;
    a.token_row = token_row_.as<int32_t>();
    a.send_meta = send_meta_.as<int32_t>();
    a.send_token = send_token_.as<int32_t>();
    a.send_pairs = d_send_pairs_;
    a.workspace = layout_ws_.as<void>();
    a.workspace_bytes = layout_ws_.bytes();
    kernels::dispatch_layout_launch(a, s);
    kernels::count_headers_launch(d_status_, d_send_rows_, d_send_pairs_, d_error_, W, El, d_hdr_send_, s);
  } else {
    // A bad argument travels as this rank's status with zero rows (the message text included).
    std::vector<int64_t> h;
    protocol::encode_count_headers(protocol::empty_dispatch_layout(cfg), status, h);
    std::memcpy(h_hdr_up_, h.data(), h.size() * sizeof(int64_t));
    EPMOE_CUDA_CHECK(cudaMemcpyAsync(d_hdr_send_, h_hdr_up_, h.size() * sizeof(int64_t), cudaMemcpyHostToDevice, s));
  }
  record(kLayoutEnd, s);
  return T;
}

// The count exchange and the forward's one host wait: every rank learns what it receives (and every
// rank's status: a failure anywhere throws the same error everywhere, here). Sizes the expert
// segments on the host from the pair counts, padded to the tile.
void GpuEngine::exchange_counts(Forward& f, cudaStream_t s) {
  NvtxRange range("exchange");
  const int W = cfg.world_size, El = cfg.experts_per_rank(), hw = protocol::header_words(El);
  comm_->alltoall_i64(d_hdr_send_, d_hdr_recv_, size_t(hw));
  EPMOE_CUDA_CHECK(cudaMemcpyAsync(h_hdr_, d_hdr_send_, 2 * size_t(W) * hw * sizeof(int64_t), cudaMemcpyDeviceToHost, s));
  record(kExchangeEnd, s);
  comm_->host_wait(s, "count exchange");
  cublas_ptrs_.used = 0;  // the previous call's pointer uploads have run (the wait drained them)
  recv_hdr_.assign(h_hdr_ + size_t(W) * hw, h_hdr_ + 2 * size_t(W) * hw);
  f.plan = protocol::decode_count_headers(recv_hdr_, W, El);  // throws the same error on every rank
  f.send_rows.assign(W, 0);
  for (int p = 0; p < W; ++p) f.send_rows[p] = h_hdr_[size_t(p) * hw + protocol::kHdrRows];
  for (int64_t v : f.send_rows) f.S += v;
  f.R = f.plan.total_rows();
  // Uploaded for the device layout, which checks them against the received metadata.
  int64_t* h_off = h_expert_;
  int64_t* h_cnt = h_expert_ + El + 1;
  h_off[0] = 0;
  for (int e = 0; e < El; ++e) {
    h_cnt[e] = f.plan.expert_pairs[e];
    h_off[e + 1] = h_off[e] + protocol::round_up(h_cnt[e], kernels::kExpertTile);
  }
  f.P = h_off[El];
  EPMOE_CHECK(f.P < int64_t(INT32_MAX) && f.R < int64_t(INT32_MAX), ErrorCode::unsupported, "this rank receives ",
              f.R, " rows / ", f.P, " padded expert rows: beyond the 32-bit row index");

  const size_t row_bytes = size_t(cfg.hidden) * sizeof(bf16);
  const size_t meta_bytes = size_t(protocol::meta_words(cfg.top_k)) * sizeof(int32_t);
  stats.tokens = f.T;
  stats.send_rows = f.send_rows;
  stats.recv_rows = f.plan.recv_rows;
  stats.dispatch_bytes = f.S * int64_t(wire_row_bytes() + meta_bytes);
  stats.combine_bytes = f.R * int64_t(row_bytes);
  stats.expert_pairs = f.plan.total_pairs();
}

// Packs the rows each destination needs and exchanges them with their metadata; the combine buffer
// is zeroed on the side stream meanwhile.
void GpuEngine::dispatch(const TensorView& x, const Forward& f, cudaStream_t s) {
  NvtxRange range("dispatch");
  const int H = cfg.hidden, F = cfg.ffn, El = cfg.experts_per_rank();
  const size_t row_bytes = size_t(H) * sizeof(bf16), wire_bytes = wire_row_bytes();
  const size_t meta_bytes = size_t(protocol::meta_words(cfg.top_k)) * sizeof(int32_t);
  const int64_t S = f.S, R = f.R, P = f.P;
  // Safe to reallocate: the host wait of the exchange drained `s`, which waited for the previous forward.
  send_x_.ensure(size_t(S) * std::max(row_bytes, wire_bytes));  // (it receives the combine's bf16 rows too)
  recv_x_.ensure(size_t(R) * wire_bytes);
  recv_meta_.ensure(size_t(R) * meta_bytes);
  combine_.ensure(size_t(R) * row_bytes);
  if (path == ExpertPath::cublas) xs_.ensure(size_t(P) * row_bytes);  // the sm90 UP gathers from recv_x_ itself
  // act: bf16 rows, or packed FP8 rows of ffn (the FP8 UP requantizes it for DOWN).
  act_.ensure(size_t(P) * (fp8_ ? size_t(kernels::fp8_packed_row_bytes(fp8_scales_, F)) : F * sizeof(bf16)));
  pair_row_.ensure(size_t(P) * sizeof(int32_t));
  pair_weight_.ensure(size_t(P) * sizeof(float));
  expert_ws_.ensure(kernels::expert_layout_workspace_bytes(R, El));
  if (path == ExpertPath::cublas) cublas_ws_.ensure(kernels::cublas_experts_workspace_bytes(P, H, F));
  record(kDispatchStart, s);

  // Zero the combine buffer on the side stream while the rows travel.
  EPMOE_CUDA_CHECK(cudaEventRecord(ev_fork_, s));
  EPMOE_CUDA_CHECK(cudaStreamWaitEvent(side_, ev_fork_, 0));
  if (R > 0) EPMOE_CUDA_CHECK(cudaMemsetAsync(combine_.as<void>(), 0, size_t(R) * row_bytes, side_));
  EPMOE_CUDA_CHECK(cudaEventRecord(ev_zeroed_, side_));

  // An FP8 layer sends packed FP8 rows of its format, quantized here at the source (0.52 of the bytes).
  if (f.x_scale != nullptr)  // (forward_mxfp8: already in the format, its bytes as they are)
    kernels::pack_rows_mx_given_launch(x.ptr<uint8_t>(), f.x_scale->ptr<uint8_t>(), H, send_token_.as<int32_t>(), S,
                                       send_x_.as<uint8_t>(), s);
  else if (fp8_ && fp8_scales_ == kernels::Fp8Scales::block128)
    kernels::pack_rows_fp8b_launch(x.ptr<__nv_bfloat16>(), H, send_token_.as<int32_t>(), S, send_x_.as<uint8_t>(), s);
  else if (fp8_)
    kernels::pack_rows_mx_launch(x.ptr<__nv_bfloat16>(), H, send_token_.as<int32_t>(), S, send_x_.as<uint8_t>(), s);
  else kernels::pack_rows_launch(x.ptr<__nv_bfloat16>(), H, send_token_.as<int32_t>(), S, send_x_.as<__nv_bfloat16>(), s);
  const AlltoallvPlane planes[2] = {
      protocol::make_plane(send_x_.as<void>(), recv_x_.as<void>(), f.send_rows, f.plan.recv_rows, wire_bytes),
      protocol::make_plane(send_meta_.as<void>(), recv_meta_.as<void>(), f.send_rows, f.plan.recv_rows, meta_bytes)};
  comm_->alltoallv(planes);
  record(kDispatchEnd, s);
  last_recv_rows_ = R;
  last_rows_per_rank_ = f.plan.recv_rows;

  if (opt_.on_receive) {  // inspection hook: a second host sync, only when asked for
    const int mw = protocol::meta_words(cfg.top_k);
    comm_->host_wait(s, "on_receive");
    std::vector<uint8_t> rows(size_t(R) * wire_bytes);  // bf16 rows, or packed MXFP8 rows
    std::vector<int32_t> meta(size_t(R) * mw);
    if (R > 0) {
      EPMOE_CUDA_CHECK(cudaMemcpy(rows.data(), recv_x_.as<void>(), rows.size(), cudaMemcpyDeviceToHost));
      EPMOE_CUDA_CHECK(cudaMemcpy(meta.data(), recv_meta_.as<void>(), meta.size() * 4, cudaMemcpyDeviceToHost));
    }
    opt_.on_receive(rows.data(), meta.data(), f.plan.recv_rows);
  }
}

// The expert layout of the received rows (expert-sorted, tile-padded), then the local experts,
// reducing into the combine buffer once the side stream has zeroed it.
void GpuEngine::run_experts(const Forward& f, cudaStream_t s) {
  NvtxRange range("experts");
  const int El = cfg.experts_per_rank();
  const int64_t R = f.R, P = f.P;
  const kernels::ExpertLayoutView layout{d_expert_off_, pair_row_.as<int32_t>(), pair_weight_.as<float>(), P};
  const bool saving_h = f.save != nullptr && f.save->policy == SavePolicy::rows_and_preactivation;
  if (P > 0) {
    EPMOE_CUDA_CHECK(
        cudaMemcpyAsync(d_expert_off_, h_expert_, (2 * size_t(El) + 1) * sizeof(int64_t), cudaMemcpyHostToDevice, s));
    kernels::ExpertLayoutArgs a;
    a.recv_meta = recv_meta_.as<int32_t>();
    a.recv_rows = R;
    a.top_k = cfg.top_k;
    a.experts = El;
    a.padded_offsets = d_expert_off_;
    a.expert_counts = d_expert_cnt_;
    a.pair_row = pair_row_.as<int32_t>();
    a.pair_weight = pair_weight_.as<float>();
    a.error_flag = d_error_;
    a.workspace = expert_ws_.as<void>();
    a.workspace_bytes = expert_ws_.bytes();
    kernels::expert_layout_launch(a, s);
    if (path == ExpertPath::cublas && !saving_h)  // (saving h, they go where the state keeps them)
      kernels::gather_rows_launch(recv_x_.as<__nv_bfloat16>(), R, cfg.hidden, pair_row_.as<int32_t>(),
                                  d_expert_off_ + El, P, xs_.as<__nv_bfloat16>(), s);
  }
  EPMOE_CUDA_CHECK(cudaStreamWaitEvent(s, ev_zeroed_, 0));  // the experts reduce into the combine buffer
  if (P > 0) {
    const kernels::ExpertWeightsView w{w1_, w2_, El, cfg.hidden, cfg.ffn};
    kernels::ExpertProblem prob = kernels::make_expert_problem(w, recv_x_.as<__nv_bfloat16>(), R, layout,
                                                               act_.as<__nv_bfloat16>(), combine_.as<__nv_bfloat16>(), R);
    if (opt_.deterministic) {  // each pair's output to its own row; summed below in slot order
      det_pair_out_.ensure(size_t(P) * cfg.hidden * sizeof(bf16));
      prob.pair_out = det_pair_out_.as<__nv_bfloat16>();
    }
    if (fp8_) {
      kernels::MxExpertProblem m = fp8_problem(recv_x_.as<uint8_t>(), R, layout, act_.as<uint8_t>(),
                                               combine_.as<bf16>(), fp8_form(f.plan.total_pairs()));
      if (m.form == kernels::MxForm::fused) m.out_acc = fused_accumulator(R, s);
      kernels::sm90_mx_experts_launch(m, s);
    } else if (saving_h) {
      run_experts_saving_h(f, prob, s);
    } else if (path == ExpertPath::sm90) {
      // The override was checked against this shape at construction, so resolving cannot fail here
      // on one rank alone.
      // The pairs let the heuristics pick swap-AB; a forward that saves for backward leaves them
      // unknown, so every save policy runs the same kernels (the same y and h bits; Sm90Shape::pairs).
      if (f.save == nullptr) prob.pairs = f.plan.total_pairs();
      const Sm90Plan plan = kernels::resolve_sm90_plan(kernels::sm90_shape(prob), sm90_device_, opt_.sm90_plan);
      if (plan.fused && !opt_.deterministic) prob.out_acc = fused_accumulator(R, s);
      kernels::sm90_experts_launch(prob, plan, s);
    } else {
      prob.xs = xs_.as<__nv_bfloat16>();
      kernels::cublas_experts_launch(prob, h_expert_, h_expert_ + El + 1, cublas_, cublas_ptrs_, cublas_ws_.as<void>(),
                                     cublas_ws_.bytes(), s);
    }
    if (opt_.deterministic) {  // combine row r = bf16(sum over its slots j ascending of pair_out[row_pair[r, j]])
      det_row_pair_.ensure(size_t(R) * cfg.top_k * sizeof(int32_t));
      kernels::row_pair_map_launch(d_expert_off_, El, pair_row_.as<int32_t>(), P, recv_meta_.as<int32_t>(), R,
                                   cfg.top_k, det_row_pair_.as<int32_t>(), s);
      kernels::reduce_row_pairs_launch(det_pair_out_.as<__nv_bfloat16>(), nullptr, det_row_pair_.as<int32_t>(), R,
                                       cfg.top_k, cfg.hidden, combine_.as<__nv_bfloat16>(), nullptr, s);
    }
  }
  record(kExpertsEnd, s);
}

float* GpuEngine::fused_accumulator(int64_t rows, cudaStream_t s) {
  const size_t bytes = size_t(rows) * cfg.hidden * sizeof(float);
  if (!fused_acc_.fits(bytes)) {
    fused_acc_.ensure(bytes);
    EPMOE_CUDA_CHECK(cudaMemsetAsync(fused_acc_.as<void>(), 0, fused_acc_.bytes(), s));
  }
  return fused_acc_.as<float>();
}

// The rows go back the way they came (into send_x_, which the dispatch is done with).
void GpuEngine::combine(const Forward& f, cudaStream_t s) {
  NvtxRange range("combine");
  const size_t row_bytes = size_t(cfg.hidden) * sizeof(bf16);
  const AlltoallvPlane back[1] = {
      protocol::make_plane(combine_.as<void>(), send_x_.as<void>(), f.plan.recv_rows, f.send_rows, row_bytes)};
  comm_->alltoallv(back);
  record(kCombineEnd, s);
}

// Each token's returned rows, summed in fixed order (fp32) into y.
void GpuEngine::source_reduce(const Forward& f, const TensorView& y, cudaStream_t s) {
  NvtxRange range("reduce");
  kernels::combine_reduce_launch(send_x_.as<__nv_bfloat16>(), token_row_.as<int32_t>(), f.T, cfg.world_size,
                                 cfg.hidden, y.ptr<__nv_bfloat16>(), s);
  record(kReduceEnd, s);
}

}  // namespace epmoe::gpu

namespace epmoe {

std::unique_ptr<MoeLayer::Engine> make_gpu_engine(const MoeConfig& cfg, const ExpertWeights& w,
                                                  std::shared_ptr<Communicator> comm, const LayerOptions& opt) {
  return std::make_unique<gpu::GpuEngine>(cfg, w, std::move(comm), opt);
}

GpuDispatchView gpu_dispatch_view(const MoeLayer::Engine& engine) {
  const auto* g = dynamic_cast<const gpu::GpuEngine*>(&engine);
  EPMOE_CHECK(g != nullptr, ErrorCode::invalid_argument, "gpu_dispatch_view: not a GPU engine");
  return g->dispatch_view();
}

}  // namespace epmoe
