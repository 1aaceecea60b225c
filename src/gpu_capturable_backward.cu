// The GPU engine's capturable backward (MoeLayer::backward_capturable): the regular backward's data
// flow (gpu_backward.cu) on the last saving forward_capturable's fixed buffers, with every count on
// the device, so one captured graph of forward + backward replays at any token count up to the
// capacity. Every GEMM is an sm_90 kernel that reads the per-expert offsets on the device (the
// regular backward's cuBLAS grouped GEMMs need them on the host).
//
// local (world 1): x's rows are the received rows and dy's are the rows to send back, so:
//   gather      xs = x[pair_row], dys = dy[pair_row]   (the capturable layout's padded pairs)
//   (recompute) h = UP(x) under rows_recompute (the forward's UP, h stored, act discarded)
//   dgrad       da = dys W2_e                          (kernels/sm90/dgrad.cuh)
//   SwiGLU bwd  dh, act_s = s a, ds per pair           (rows past the device total untouched)
//   wgrad       dW2 = dys^T act_s, dW1 = dh^T xs        (kernels/sm90/wgrad.cuh)
//   dgrad       dxp = dh W1_e
//   pairs->rows dx[t] = fixed-order sum of its pairs' dxp, d_topk_weights[t, j] = ds of slot j
//               (row_pair_map_ids + reduce_row_pairs: rows past the count get 0)
// slots (any world size): dy packed along the forward's routes into its slots (slot_pack), one
// fixed-size all-to-all to the experts' ranks, the steps above on the received slots (rows: the
// forward's recv_x, kept in its slots), {dx rows, ds per (row, slot)} back in fixed-size slots, then
// dx = the source's fixed-order sum of its returned rows (combine_reduce_checked) and
// d_topk_weights from the returned ds (scatter_weight_grads, rows past the count 0).
// Bytes per rank and backward, whatever T is: W N 2 hidden out, W N (2 hidden + 4 k) back.
#include <cuda_runtime.h>

#include "gpu_capturable_buffers.cuh"
#include "gpu_engine_impl.cuh"
#include "kernels/backward/row_pairs.cuh"
#include "kernels/backward/swiglu_backward.cuh"
#include "kernels/ep/capacity_slots.cuh"
#include "kernels/ep/combine_reduce.cuh"
#include "kernels/ep/weight_grads.cuh"
#include "kernels/expert_problem.cuh"
#include "kernels/fallback/gather_rows.cuh"
#include "kernels/sm90/dgrad.cuh"
#include "kernels/sm90/experts.cuh"
#include "kernels/sm90/wgrad.cuh"

namespace epmoe::gpu {

using namespace capturable;

void GpuEngine::check_capturable_backward(const char* who) const {
  EPMOE_CHECK(opt_.max_tokens_per_rank > 0, ErrorCode::invalid_argument, who,
              ": the layer was built without LayerOptions::max_tokens_per_rank");
  EPMOE_CHECK(!fp8_, ErrorCode::unsupported, who, ": an FP8 layer is forward-only (no capturable backward)");
  EPMOE_CHECK(cap_bwd_supported_, ErrorCode::unsupported, who, ": the capturable backward's sm_90 dgrad / wgrad "
              "kernels need hidden (", cfg.hidden, ") and ffn (", cfg.ffn, ") multiples of 256 on an sm_90a device");
}

void GpuEngine::init_capturable_backward(cudaStream_t s) {
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  EPMOE_CUDA_CHECK(cudaStreamIsCapturing(s, &cs));
  EPMOE_CHECK(cs == cudaStreamCaptureStatusNone, ErrorCode::invalid_argument,
              "forward_capturable(save): the first saving call sizes the backward's buffers and cannot be captured; "
              "run it once before the capture (a warm-up step)");
  size_t bytes = 0;
  (void)carve_backward({}, cfg, cap_rows_, cap_input_rows(), cap_slots_on_, &bytes);
  cap_bwd_.ensure(bytes);
}

void GpuEngine::backward_capturable(const TensorView& x, const TensorView& ids, const TensorView& dy,
                                    const TensorView& dx, const TensorView& dwts, const ExpertGradients& grads,
                                    const int64_t* num_tokens, void* stream) {
  check_capturable_backward("backward_capturable");
  DeviceGuard guard(device_);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  // Host checks only (a capture fixes them; the same on every rank that passes the same buffers).
  EPMOE_CHECK(cap_saved_.on && cap_bwd_.fits(1), ErrorCode::invalid_argument,
              "backward_capturable: the last forward_capturable did not save (pass save = true)");
  EPMOE_CHECK(x.data == cap_saved_.x && ids.data == cap_saved_.ids && x.ndim == 2 && x.shape[0] == cap_saved_.N,
              ErrorCode::invalid_argument, "backward_capturable: x and topk_ids must be the saving forward's buffers "
              "(", cap_saved_.N, " rows)");
  const int64_t N = cap_saved_.N;
  protocol::Status st = validate_backward_tensors(cfg, N, dy, dx, dwts, grads, DeviceType::cuda);
  if (st.ok()) st = check_devices({{&dy, "dy"}, {&dx, "dx"}, {&dwts, "d_topk_weights"}, {&grads.dw1, "dw1"},
                                   {&grads.dw2, "dw2"}});
  if (!st.ok()) throw Error(st.code, "backward_capturable: " + st.text);
  EPMOE_CHECK(num_tokens != nullptr, ErrorCode::invalid_argument, "backward_capturable: num_tokens is null");
  NvtxRange range("backward_capturable");

  const int El = cfg.experts_per_rank(), W = cfg.world_size, k = cfg.top_k, H = cfg.hidden, F = cfg.ffn;
  const int64_t P = cap_rows_, R = cap_input_rows(), C = opt_.max_tokens_per_rank;
  const LayoutArrays lay = carve_layout({static_cast<char*>(cap_layout_.as<void>())}, El, P);
  const BackwardArrays b = carve_backward({static_cast<char*>(cap_bwd_.as<void>())}, cfg, P, R, cap_slots_on_);
  const int64_t* d_total = lay.offsets + El;
  auto bf = [](auto* p) { return reinterpret_cast<__nv_bfloat16*>(p); };
  auto cbf = [](const auto* p) { return reinterpret_cast<const __nv_bfloat16*>(p); };

  SlotArrays sl{};
  const __nv_bfloat16* rows = x.ptr<__nv_bfloat16>();  // the received rows (local: x itself)
  const __nv_bfloat16* dy_rows = dy.ptr<__nv_bfloat16>();
  const size_t row_bytes = size_t(H) * sizeof(bf16);
  CommStreamScope comm_stream(*comm_, s);
  if (cap_slots_on_) {
    NvtxRange r("dispatch dy");
    sl = carve_slots({static_cast<char*>(cap_slots_.as<void>())}, cfg, C, row_bytes);
    kernels::SlotPackArgs pk;  // the forward's routes (its token_row rewrite is the same again)
    pk.x = dy.ptr<__nv_bfloat16>();
    pk.row_bytes = int64_t(row_bytes);
    pk.send_token = sl.send_token;
    pk.send_offsets = sl.send_offsets;
    pk.world = W;
    pk.slot_rows = C;
    pk.max_rows = N * std::min(k, W);
    pk.send_x = sl.send_x;
    pk.token_row = sl.token_row;
    kernels::slot_pack_launch(pk, s);
    const AlltoallvPlane out[1] = {equal_plane(sl.send_x, b.recv_dy, W, size_t(C) * row_bytes)};
    comm_->alltoallv(out);
    rows = cbf(sl.recv_x);
    dy_rows = cbf(b.recv_dy);
  }

  {
    NvtxRange r("experts");
    const kernels::ExpertWeightsView w{w1_, w2_, El, H, F};
    const kernels::ExpertLayoutView layout{lay.offsets, lay.pair_row, lay.pair_weight, P};
    kernels::gather_rows_launch(rows, R, H, lay.pair_row, d_total, P, bf(b.xs), s);
    kernels::gather_rows_launch(dy_rows, R, H, lay.pair_row, d_total, P, bf(b.dys), s);
    if (opt_.save_policy == SavePolicy::rows_recompute) {
      // The forward's UP again (same plan rule, same h bits), act into da's buffer (rewritten below).
      kernels::ExpertProblem up = kernels::make_expert_problem(w, rows, R, layout, bf(b.da), bf(b.dxp), 0);
      up.pairs = R * std::min(k, El);
      up.preact = bf(b.h);
      const Sm90Plan plan = kernels::resolve_sm90_plan(kernels::sm90_shape(up), sm90_device_, opt_.sm90_plan);
      kernels::sm90_up_launch(up, plan, s);
    }
    kernels::DgradProblem da{cbf(b.dys), w2_, lay.offsets, P, El, H, F, bf(b.da)};
    kernels::sm90_dgrad_launch(da, s);
    kernels::swiglu_backward_launch(cbf(b.h), cbf(b.da), lay.pair_row, lay.pair_weight, P, F, bf(b.dh), bf(b.act_s),
                                    b.ds_pair, s, d_total);
    const bool f1 = grads.dw1.dtype == DType::f32, f2 = grads.dw2.dtype == DType::f32;
    kernels::WgradProblem w2g{cbf(b.dys), cbf(b.act_s), lay.offsets, P, El, H, F, grads.dw2.data, f2, grads.accumulate};
    kernels::WgradProblem w1g{cbf(b.dh), cbf(b.xs), lay.offsets, P, El, 2 * F, H, grads.dw1.data, f1, grads.accumulate};
    kernels::sm90_wgrad_launch(w2g, s);
    kernels::sm90_wgrad_launch(w1g, s);
    kernels::DgradProblem dxp{cbf(b.dh), w1_, lay.offsets, P, El, 2 * F, H, bf(b.dxp)};  // (dxp aliases dys)
    kernels::sm90_dgrad_launch(dxp, s);
  }

  if (!cap_slots_on_) {
    NvtxRange r("reduce");
    kernels::row_pair_map_ids_launch(lay.offsets, El, lay.pair_row, P, ids.ptr<int32_t>(), N, k, b.row_pair, s);
    kernels::reduce_row_pairs_launch(cbf(b.dxp), b.ds_pair, b.row_pair, N, k, H, dx.ptr<__nv_bfloat16>(),
                                     dwts.ptr<float>(), s);
    return;
  }
  {
    NvtxRange r("combine dx");
    kernels::row_pair_map_launch(lay.offsets, El, lay.pair_row, P, sl.recv_meta, R, k, b.row_pair, s);
    kernels::reduce_row_pairs_launch(cbf(b.dxp), b.ds_pair, b.row_pair, R, k, H, bf(sl.combine), b.ds_rows, s);
    const AlltoallvPlane back[2] = {equal_plane(sl.combine, sl.back, W, size_t(C) * row_bytes),
                                    equal_plane(b.ds_rows, b.ds_back, W, size_t(C) * k * sizeof(float))};
    comm_->alltoallv(back);
  }
  NvtxRange r("reduce");
  kernels::combine_reduce_checked_launch(cbf(sl.back), sl.token_row, N, W, H, sl.status, lay.error, num_tokens,
                                         dx.ptr<__nv_bfloat16>(), s);
  kernels::scatter_weight_grads_launch(ids.ptr<int32_t>(), sl.token_row, b.ds_back, N, k, W, El, dwts.ptr<float>(), s,
                                       num_tokens);
}

}  // namespace epmoe::gpu
