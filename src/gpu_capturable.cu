// The GPU engine's capturable forward (MoeLayer::forward_capturable): everything on the caller's
// stream with nothing read or allocated on the host, so a CUDA graph captures it once and replays it
// at any token count up to the capacity N = LayerOptions::max_tokens_per_rank.
//
// local (world 1):
//   capturable_layout   one CTA: expert-sorted pairs of the first *num_tokens tokens, padded to the
//                       tile (kernels/ep/capturable_layout.cuh); bad routing -> NaN rows + a record
//   sm90 UP             gathers x[pair_row] itself and zeroes y (ExpertProblem::zero_out)
//   sm90 DOWN           PDL-chained; weighted reduction straight into y[pair_row]
//   A token's row in x is its received row and y is its combine row, so nothing moves.
//
// slots (any world size): the regular forward's phases with fixed-size transfers instead of the
// count exchange (kernels/ep/capacity_slots.cuh):
//   dispatch_layout     with the device token count; count_headers
//   slot_pack           send rows into W slots of N rows; token_row -> slot positions
//   alltoallv           {headers, rows, metadata}: one NCCL group, every block N rows (in-band counts)
//   capturable_layout   received mode: pairs from the real rows of each slot
//   sm90 UP / DOWN      into the combine slots (zeroed by UP)
//   alltoallv           the combine slots back
//   combine_reduce      y[t] = sum over ranks of its returned rows; NaN rows after a bad layout
//   Bytes per rank and forward, whatever T is: W N (2 hidden + 4 (1 + 2k)) + W 8 header_words out,
//   W N 2 hidden back.
//
// An FP8 layer (MXFP8 or block-128) quantizes x's first *num_tokens rows into packed rows of its
// format first (pack_rows_mx / pack_rows_fp8b, the device count bounding them); local mode gathers
// from those rows, the slots carry them (hidden + hidden / 32 or / 32 bytes of scales, padded to 16,
// instead of 2 hidden). The experts run in the form chosen once here for the capacity's pairs
// (choose_mx_form; block-128: its tile form), forward-only (no save, no capturable backward).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

#include "gpu_capturable_buffers.cuh"
#include "gpu_engine_impl.cuh"
#include "kernels/ep/capacity_slots.cuh"
#include "kernels/ep/capturable_layout.cuh"
#include "kernels/ep/combine_reduce.cuh"
#include "kernels/ep/dispatch_layout.cuh"
#include "kernels/ep/pack_rows_fp8b.cuh"
#include "kernels/ep/pack_rows_mx.cuh"
#include "kernels/expert_problem.cuh"
#include "kernels/sm90/dgrad.cuh"
#include "kernels/sm90/experts.cuh"
#include "kernels/sm90/swap_mx.cuh"
#include "kernels/sm90/wgrad.cuh"

namespace epmoe::gpu {

using namespace capturable;

void GpuEngine::init_capturable() {
  const int El = cfg.experts_per_rank(), W = cfg.world_size;
  const int64_t N = opt_.max_tokens_per_rank;
  EPMOE_CHECK(path == ExpertPath::sm90, ErrorCode::unsupported, "the capturable forward (max_tokens_per_rank) runs "
              "on the sm_90 path only (the cuBLAS fallback needs the counts on the host)");
  EPMOE_CHECK(El <= kernels::kCapturableMaxExperts, ErrorCode::unsupported, "the capturable forward holds at most ",
              kernels::kCapturableMaxExperts, " experts per rank; this layer has ", El);
  cap_slots_on_ = opt_.capturable_transport == CapturableTransport::slots ||
                  (opt_.capturable_transport == CapturableTransport::automatic && W > 1);
  EPMOE_CHECK(cap_slots_on_ || W == 1, ErrorCode::invalid_argument, "capturable_transport local needs world size 1");
  const int64_t rows = cap_slots_on_ ? int64_t(W) * N : N;  // the expert layout's input rows
  EPMOE_CHECK(rows * std::max(cfg.top_k, W) < int64_t(INT32_MAX), ErrorCode::unsupported, "max_tokens_per_rank ", N,
              " x world ", W, " x top_k ", cfg.top_k, " exceeds the 32-bit row and pair indices");
  cap_rows_ = kernels::capturable_rows_capacity(rows, cfg.top_k, El);
  // The capturable backward's kernels: dgrad (k, n) = (hidden, ffn) and (2 ffn, hidden), wgrad (m, n)
  // the same pairs (asked once: the config and the device are fixed).
  const int H = cfg.hidden, F = cfg.ffn;
  cap_bwd_supported_ = !fp8_ && kernels::sm90_dgrad_supported(H, F) && kernels::sm90_dgrad_supported(2 * F, H) &&
                       kernels::sm90_wgrad_supported(H, F) && kernels::sm90_wgrad_supported(2 * F, H);
  size_t bytes = 0;
  (void)carve_layout({}, El, cap_rows_, &bytes);
  cap_layout_.ensure(bytes);
  EPMOE_CUDA_CHECK(cudaMemset(cap_layout_.as<void>(), 0, cap_layout_.bytes()));  // the error record: none
  bool fused = false;
  if (fp8_) {
    // One form for every replay: the rule's for the capacity's pairs (as the bf16 plan below takes
    // its bound), the caller's swap= / fused= on top; block-128 has the tile form only.
    cap_mx_form_ = fp8_form(rows * std::min(cfg.top_k, El));
    fused = cap_mx_form_ == kernels::MxForm::fused;
    cap_act_.ensure(size_t(cap_rows_) * size_t(kernels::fp8_packed_row_bytes(fp8_scales_, F)));
    cap_xq_.ensure(size_t(N) * size_t(kernels::fp8_packed_row_bytes(fp8_scales_, H)));
    // (zeroed once: a bad num_tokens makes the layout read every row, the quantized ones or not)
    EPMOE_CUDA_CHECK(cudaMemset(cap_xq_.as<void>(), 0, cap_xq_.bytes()));
  } else {
    cap_act_.ensure(size_t(cap_rows_) * cfg.ffn * sizeof(bf16));
    // Where a call's plan can be fused (the rule picks it for the fewest pairs first, so the
    // smallest call decides).
    const kernels::Sm90Shape fewest{El, cfg.hidden, cfg.ffn, cap_rows_, std::min(cfg.top_k, El)};
    fused = kernels::resolve_sm90_plan(fewest, sm90_device_, opt_.sm90_plan).fused;
  }
  // The fused pipeline's accumulator: zeroed once, every replay leaves it zero.
  if (fused) {
    cap_fused_acc_.ensure(size_t(rows) * cfg.hidden * sizeof(float));
    EPMOE_CUDA_CHECK(cudaMemset(cap_fused_acc_.as<void>(), 0, cap_fused_acc_.bytes()));
  }
  if (cap_slots_on_) {
    (void)carve_slots({}, cfg, N, wire_row_bytes(), &bytes);
    cap_slots_.ensure(bytes);
    // (zeroed once: the all-to-alls move whole slots, their rows past a slot's real ones included)
    EPMOE_CUDA_CHECK(cudaMemset(cap_slots_.as<void>(), 0, cap_slots_.bytes()));
  }
}

void GpuEngine::forward_capturable(const TensorView& x, const TensorView& ids, const TensorView& wts,
                                   const TensorView& y, const int64_t* num_tokens, void* stream, bool save,
                                   const TensorView* x_scale) {
  EPMOE_CHECK(opt_.max_tokens_per_rank > 0, ErrorCode::invalid_argument,
              "forward_capturable: the layer was built without LayerOptions::max_tokens_per_rank");
  if (x_scale != nullptr) {
    const protocol::Status layer = check_given_mx_layer("forward_capturable_mxfp8", fp8_,
                                                        fp8_scales_ == kernels::Fp8Scales::block128);
    if (!layer.ok()) throw Error(layer.code, layer.text);
  }
  DeviceGuard guard(device_);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  // Host checks of shapes and pointers: the same on every rank that passes the same kind of buffers
  // (a capture fixes them), so a local throw here is a caller's bug, not a data-dependent failure.
  protocol::Status st = validate_forward_args(cfg, x, ids, wts, y, DeviceType::cuda, x_scale);
  if (st.ok()) st = check_devices({{&x, "x"}, {&ids, "topk_ids"}, {&wts, "topk_weights"}, {&y, "y"}});
  if (st.ok() && x_scale != nullptr) st = check_devices({{x_scale, "x_scale"}});
  if (!st.ok()) throw Error(st.code, "forward_capturable: " + st.text);
  const int64_t N = x.shape[0];
  EPMOE_CHECK(N <= opt_.max_tokens_per_rank, ErrorCode::invalid_argument, "forward_capturable: ", N,
              " rows exceed max_tokens_per_rank ", opt_.max_tokens_per_rank);
  EPMOE_CHECK(num_tokens != nullptr, ErrorCode::invalid_argument, "forward_capturable: num_tokens is null");
  cudaPointerAttributes attr{};
  EPMOE_CUDA_CHECK(cudaPointerGetAttributes(&attr, num_tokens));
  EPMOE_CHECK(attr.type == cudaMemoryTypeManaged || (attr.type == cudaMemoryTypeDevice && attr.device == device_),
              ErrorCode::invalid_argument, "forward_capturable: num_tokens must be device memory of cuda:", device_,
              " (it is read when the work runs, so a graph replays at any count)");
  EPMOE_CHECK(!(save && fp8_), ErrorCode::unsupported,
              "forward_capturable: an FP8 layer is forward-only: a forward that saves for backward is not supported");
  if (save) {
    check_capturable_backward("forward_capturable(save)");
    if (!cap_bwd_.fits(1)) init_capturable_backward(s);
  }
  NvtxRange range("forward_capturable");
  const int El = cfg.experts_per_rank(), W = cfg.world_size, k = cfg.top_k;
  const LayoutArrays lay = carve_layout({static_cast<char*>(cap_layout_.as<void>())}, El, cap_rows_);
  // Under rows_and_preactivation a saving forward's UP also stores h for the backward.
  __nv_bfloat16* keep_h = nullptr;
  if (save && opt_.save_policy == SavePolicy::rows_and_preactivation)
    keep_h = reinterpret_cast<__nv_bfloat16*>(
        carve_backward({static_cast<char*>(cap_bwd_.as<void>())}, cfg, cap_rows_, cap_input_rows(), cap_slots_on_).h);
  cap_saved_ = {save, x.data, ids.data, N};
  const kernels::ExpertWeightsView w{w1_, w2_, El, cfg.hidden, cfg.ffn};
  const kernels::ExpertLayoutView layout{lay.offsets, lay.pair_row, lay.pair_weight, cap_rows_};
  auto experts = [&](const bf16* xr, bf16* out, int64_t rows) {
    kernels::ExpertProblem prob = kernels::make_expert_problem(
        w, reinterpret_cast<const __nv_bfloat16*>(xr), rows, layout, cap_act_.as<__nv_bfloat16>(),
        reinterpret_cast<__nv_bfloat16*>(out), rows, /*zero_out=*/true);
    prob.pairs = rows * std::min(k, El);  // the bound at capacity (the plan is fixed for every replay)
    prob.out_acc = cap_fused_acc_.as<float>();  // (null unless sized for these rows at construction)
    prob.preact = keep_h;                       // (a saving forward: the split kernels, which store h)
    const Sm90Plan plan = kernels::resolve_sm90_plan(kernels::sm90_shape(prob), sm90_device_, opt_.sm90_plan);
    kernels::sm90_experts_launch(prob, plan, s);
  };
  // An FP8 layer's experts on packed rows of its format (xr: x's quantized rows, or the received ones).
  auto experts_fp8 = [&](const uint8_t* xr, bf16* out, int64_t rows) {
    kernels::MxExpertProblem m = fp8_problem(xr, rows, layout, cap_act_.as<uint8_t>(), out, cap_mx_form_);
    m.zero_out = m.form != kernels::MxForm::fused;  // (the fused write-out writes every row)
    if (m.form == kernels::MxForm::fused) m.out_acc = cap_fused_acc_.as<float>();
    kernels::sm90_mx_experts_launch(m, s);
  };
  // x's first *num_tokens rows as packed rows of the layer's format, in cap_xq_: quantized, or
  // copied as given (x_scale: x in MXFP8).
  auto quantize_x = [&]() {
    uint8_t* xq = cap_xq_.as<uint8_t>();
    if (x_scale != nullptr)
      kernels::pack_rows_mx_given_launch(x.ptr<uint8_t>(), x_scale->ptr<uint8_t>(), cfg.hidden, nullptr, N, xq, s,
                                         num_tokens);
    else if (fp8_scales_ == kernels::Fp8Scales::block128)
      kernels::pack_rows_fp8b_launch(x.ptr<__nv_bfloat16>(), cfg.hidden, nullptr, N, xq, s, num_tokens);
    else
      kernels::pack_rows_mx_launch(x.ptr<__nv_bfloat16>(), cfg.hidden, nullptr, N, xq, s, num_tokens);
    return static_cast<const uint8_t*>(xq);
  };
  kernels::CapturableLayoutArgs la;
  la.top_k = k;
  la.experts = El;
  la.padded_offsets = lay.offsets;
  la.pair_row = lay.pair_row;
  la.pair_weight = lay.pair_weight;
  la.rows_capacity = cap_rows_;
  la.error = lay.error;
  la.capacity = N;

  if (!cap_slots_on_) {
    la.topk_ids = ids.ptr<int32_t>();
    la.topk_weights = wts.ptr<float>();
    la.num_tokens = num_tokens;
    kernels::capturable_layout_launch(la, s);
    if (N > 0 && fp8_) experts_fp8(quantize_x(), y.ptr<bf16>(), N);
    else if (N > 0) experts(x.ptr<bf16>(), y.ptr<bf16>(), N);
    return;
  }

  // The slots transport. Every rank's slots are N rows, so N must agree across ranks (a mismatch
  // is the caller's: NCCL would see unequal sizes).
  const size_t wire = wire_row_bytes();  // a dispatched row: bf16, or a packed FP8 row
  const SlotArrays sl =
      carve_slots({static_cast<char*>(cap_slots_.as<void>())}, cfg, opt_.max_tokens_per_rank, wire);
  const int64_t C = opt_.max_tokens_per_rank;  // slot rows (the same on every rank, unlike N)
  const int mw = protocol::meta_words(k), hw = protocol::header_words(El);
  kernels::DispatchLayoutArgs d;
  d.topk_ids = ids.ptr<int32_t>();
  d.topk_weights = wts.ptr<float>();
  d.num_tokens = N;
  d.device_num_tokens = num_tokens;
  d.top_k = k;
  d.num_experts = cfg.num_experts;
  d.world = W;
  d.status = sl.status;
  d.send_rows = sl.send_rows;
  d.send_offsets = sl.send_offsets;
  d.token_row = sl.token_row;
  d.send_meta = sl.send_meta;
  d.send_token = sl.send_token;
  d.send_pairs = sl.send_pairs;
  d.workspace = sl.layout_ws;
  d.workspace_bytes = sl.layout_ws_bytes;
  kernels::dispatch_layout_launch(d, s);
  kernels::count_headers_launch(sl.status, sl.send_rows, sl.send_pairs, nullptr, W, El, sl.hdr_send, s);
  kernels::SlotPackArgs pk;
  pk.x = fp8_ ? static_cast<const void*>(quantize_x()) : x.data;
  pk.row_bytes = int64_t(wire);
  pk.send_token = sl.send_token;
  pk.send_meta = sl.send_meta;
  pk.meta_words = mw;
  pk.send_offsets = sl.send_offsets;
  pk.world = W;
  pk.slot_rows = C;
  pk.max_rows = N * std::min(k, W);
  pk.send_x = reinterpret_cast<__nv_bfloat16*>(sl.send_x);
  pk.send_meta_slots = sl.send_meta_slots;
  pk.token_row = sl.token_row;
  kernels::slot_pack_launch(pk, s);

  const size_t row_bytes = size_t(cfg.hidden) * sizeof(bf16);
  CommStreamScope comm_stream(*comm_, s);
  const AlltoallvPlane out[3] = {equal_plane(sl.hdr_send, sl.hdr_recv, W, size_t(hw) * sizeof(int64_t)),
                                 equal_plane(sl.send_x, sl.recv_x, W, size_t(C) * wire),
                                 equal_plane(sl.send_meta_slots, sl.recv_meta, W, size_t(C) * mw * sizeof(int32_t))};
  comm_->alltoallv(out);

  la.capacity = C;
  la.recv_meta = sl.recv_meta;
  la.recv_headers = sl.hdr_recv;
  la.header_words = hw;
  la.world = W;
  kernels::capturable_layout_launch(la, s);
  if (fp8_) experts_fp8(sl.recv_x, sl.combine, int64_t(W) * C);
  else experts(reinterpret_cast<const bf16*>(sl.recv_x), sl.combine, int64_t(W) * C);

  const AlltoallvPlane back[1] = {equal_plane(sl.combine, sl.back, W, size_t(C) * row_bytes)};
  comm_->alltoallv(back);
  kernels::combine_reduce_checked_launch(reinterpret_cast<const __nv_bfloat16*>(sl.back), sl.token_row, N, W,
                                         cfg.hidden, sl.status, lay.error, num_tokens, y.ptr<__nv_bfloat16>(), s);
}

void GpuEngine::check_capturable(void* stream) {
  if (opt_.max_tokens_per_rank <= 0) return;
  DeviceGuard guard(device_);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  int64_t* err = carve_layout({static_cast<char*>(cap_layout_.as<void>())}, cfg.experts_per_rank(), cap_rows_).error;
  int64_t h[4] = {0, 0, 0, 0};
  EPMOE_CUDA_CHECK(cudaMemcpyAsync(h, err, sizeof h, cudaMemcpyDeviceToHost, s));
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(s));
  if (h[0] == 0) return;
  EPMOE_CUDA_CHECK(cudaMemsetAsync(err, 0, sizeof h, s));
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(s));
  const auto code = static_cast<ErrorCode>(h[0]);
  if (code == ErrorCode::invalid_argument)
    EPMOE_FAIL(code, "forward_capturable: num_tokens ", h[1], " is outside [0, ", h[2],
               "] (the rows of x): every output row was NaN");
  if (code == ErrorCode::internal)
    EPMOE_FAIL(code, "forward_capturable: a received slot held a local expert id outside [0, ",
               cfg.experts_per_rank(), "): corrupt transfer");
  const bool slots = cap_slots_on_;
  EPMOE_FAIL(code, "forward_capturable: token ", h[1], " slot ", h[2], ": expert id ", h[3],
             code == ErrorCode::duplicate_expert_id ? " repeats an earlier slot's"
                                                    : " is outside [-1, " + std::to_string(cfg.num_experts) + ")",
             slots ? " (every output row of this rank was NaN)" : " (its output row was NaN)");
}

}  // namespace epmoe::gpu
