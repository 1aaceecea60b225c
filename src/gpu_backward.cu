// The GPU engine's backward half: what forward(..., save) keeps, and the backward on it. The
// protocol is the forward's in reverse, on the saved layout (src/cpu_engine.cpp runs the same on
// the host):
//
//   status exchange  the forward's count headers again, each rank's argument status in them: a bad
//                    argument anywhere fails every rank alike; the one host sync of the backward
//   dispatch dy      pack along the forward's routes + alltoallv (combine's backward is a dispatch)
//   experts          dy rows expert-sorted -> (recompute h) -> da = dy.W2 -> SwiGLU backward (dh,
//                    ds, s.a) -> dx per pair = dh.W1, dW2 = dy^T (s.a), dW1 = dh^T xs
//                    (kernels/fallback/cublas_backward.cuh), then one dx row and k ds per received
//                    row in slot order (kernels/backward/row_pairs.cuh)
//   combine          alltoallv {dx rows, ds} back to the sources (dispatch's backward is a combine)
//   source           dx = fixed-order fp32 sum of each token's returned rows; d_topk_weights from ds
//
// Saved state (GpuSaved, gpu_engine_impl.cuh): the layout on both sides, the received rows, and
// under rows_and_preactivation h. That policy runs the forward's W1 GEMM through cuBLAS straight
// into the saved h, on expert-sorted rows it keeps as its saved rows, SwiGLU as its own pass, then
// the path's DOWN; rows_recompute runs the forward unchanged, keeps the received rows and
// recomputes h in backward.
#include <cstring>

#include "gpu_engine_impl.cuh"
#include "kernels/heuristics/backward_heuristics.h"
#include "kernels/backward/row_pairs.cuh"
#include "kernels/ep/combine_reduce.cuh"
#include "kernels/ep/pack_rows.cuh"
#include "kernels/ep/weight_grads.cuh"
#include "kernels/fallback/cublas_backward.cuh"
#include "kernels/fallback/cublas_experts.cuh"
#include "kernels/fallback/gather_rows.cuh"
#include "kernels/sm90/experts.cuh"
#include "kernels/sm90/wgrad.cuh"

namespace epmoe::gpu {

GpuSaved::~GpuSaved() {
  int prev = -1;
  if (cudaGetDevice(&prev) == cudaSuccess && prev != device) cudaSetDevice(device);
  // Freed in stream order after the last forward or backward that used the buffers; no host wait.
  // The private pool frees on this thread's stream once it waited for last_use; a DeviceAllocator
  // is given that call's own stream, as its contract asks (epmoe/device_allocator.h).
  const bool external = pool != nullptr && pool->external();
  const cudaStream_t fs = external ? last_stream : cudaStreamPerThread;
  if (last_use && !external) cudaStreamWaitEvent(fs, last_use, 0);
  for (PoolBuffer* b : {&ids, &token_row, &send_token, &recv_meta, &expert, &pair_row, &pair_weight, &rows, &h})
    b->free_async(fs);
  if (last_use) cudaEventDestroy(last_use);
  if (prev >= 0 && prev != device) cudaSetDevice(prev);
}

void GpuEngine::begin_save(Forward& f, GpuSaved& st, cudaStream_t s) {
  const int W = cfg.world_size, El = cfg.experts_per_rank(), hw = protocol::header_words(El);
  const int64_t H = cfg.hidden, F = cfg.ffn, k = cfg.top_k, mw = protocol::meta_words(cfg.top_k);
  st.engine = this;
  st.pool = pool_;
  st.policy = opt_.save_policy;
  st.T = f.T, st.S = f.S, st.R = f.R, st.P = f.P;
  st.pairs = f.plan.total_pairs();
  st.send_rows = f.send_rows;
  st.recv_rows = f.plan.recv_rows;
  st.send_hdr.assign(h_hdr_, h_hdr_ + size_t(W) * hw);
  st.host_expert.assign(h_expert_, h_expert_ + 2 * size_t(El) + 1);
  const bool keep_h = st.policy == SavePolicy::rows_and_preactivation;
  st.ids.alloc(*pool_, size_t(f.T * k) * 4, s);
  st.token_row.alloc(*pool_, size_t(f.T) * W * 4, s);
  st.send_token.alloc(*pool_, size_t(f.S) * 4, s);
  st.recv_meta.alloc(*pool_, size_t(f.R * mw) * 4, s);
  st.expert.alloc(*pool_, (2 * size_t(El) + 1) * 8, s);
  st.pair_row.alloc(*pool_, size_t(f.P) * 4, s);
  st.pair_weight.alloc(*pool_, size_t(f.P) * 4, s);
  const size_t rows_bytes = size_t(keep_h ? f.P : f.R) * H * sizeof(bf16), h_bytes = keep_h ? size_t(f.P) * 2 * F * 2 : 0;
  st.rows.alloc(*pool_, rows_bytes, s);
  if (keep_h) st.h.alloc(*pool_, h_bytes, s);
  st.activation_bytes = int64_t(rows_bytes + h_bytes);
  st.bytes = st.activation_bytes + int64_t(size_t(f.T) * (k + W) * 4 + size_t(f.S) * 4 + size_t(f.R * mw) * 4 +
                                           (2 * size_t(El) + 1) * 8 + size_t(f.P) * 8);
}

void GpuEngine::finish_save(const Forward& f, const TensorView& ids, GpuSaved& st, cudaStream_t s) {
  const int W = cfg.world_size, El = cfg.experts_per_rank();
  const int64_t k = cfg.top_k, mw = protocol::meta_words(cfg.top_k);
  auto copy = [&](const PoolBuffer& dst, const void* src, size_t bytes) {
    if (bytes > 0) EPMOE_CUDA_CHECK(cudaMemcpyAsync(dst.as<void>(), src, bytes, cudaMemcpyDefault, s));
  };
  copy(st.ids, ids.data, size_t(f.T * k) * 4);
  copy(st.token_row, token_row_.as<void>(), size_t(f.T) * W * 4);
  copy(st.send_token, send_token_.as<void>(), size_t(f.S) * 4);
  copy(st.recv_meta, recv_meta_.as<void>(), size_t(f.R * mw) * 4);
  // The host's layout (pinned: the next forward rewrites it only after its host wait drained this).
  copy(st.expert, h_expert_, (2 * size_t(El) + 1) * 8);
  copy(st.pair_row, pair_row_.as<void>(), size_t(f.P) * 4);
  copy(st.pair_weight, pair_weight_.as<void>(), size_t(f.P) * 4);
  if (st.policy == SavePolicy::rows_recompute) copy(st.rows, recv_x_.as<void>(), size_t(f.R) * cfg.hidden * 2);
}

void GpuEngine::run_experts_saving_h(const Forward& f, kernels::ExpertProblem prob, cudaStream_t s) {
  GpuSaved& st = *f.save;
  const int El = cfg.experts_per_rank();
  const int64_t* off = h_expert_;
  const int64_t* cnt = h_expert_ + El + 1;
  __nv_bfloat16* xs = st.rows.as<__nv_bfloat16>();
  __nv_bfloat16* h = st.h.as<__nv_bfloat16>();
  // The expert-sorted rows: dW1's operand in backward (and the cuBLAS UP's here).
  kernels::gather_rows_launch(recv_x_.as<__nv_bfloat16>(), f.R, cfg.hidden, pair_row_.as<int32_t>(), d_expert_off_ + El,
                              f.P, xs, s);
  if (path == ExpertPath::sm90) {
    // The forward's own UP also stores h (no split: the 192-row UP keeps none); the rows it covers
    // are exactly P (the host knows the layout here), which is all st.h holds.
    prob.preact = h;
    prob.rows_capacity = f.P;
    const Sm90Plan plan = kernels::resolve_sm90_plan(kernels::sm90_shape(prob), sm90_device_, opt_.sm90_plan);
    kernels::sm90_experts_launch(prob, plan, s);
    return;
  }
  prob.xs = xs;
  kernels::cublas_up_launch(prob, off, cnt, h, cublas_, cublas_ptrs_, s);
  kernels::swiglu_launch(h, pair_row_.as<int32_t>(), f.P, cfg.ffn, act_.as<__nv_bfloat16>(), s);
  kernels::cublas_down_launch(prob, off, cnt, cublas_ws_.as<__nv_bfloat16>(), cublas_, cublas_ptrs_, s);
}

void GpuEngine::backward(const MoeForwardContext& ctx, const TensorView& dy, const TensorView& dx,
                         const TensorView& dwts, const ExpertGradients& grads, void* stream) {
  DeviceGuard guard(device_);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  EPMOE_CUDA_CHECK(cudaStreamWaitEvent(s, ev_done_, 0));  // after the previous forward or backward
  CommStreamScope comm_stream(*comm_, s);
  buffer_source_.stream = s;  // buffers this call sizes are for `s`
  const auto* st = dynamic_cast<const GpuSaved*>(ctx.state.get());
  if (st != nullptr && st->engine == this) st->last_stream = s;  // every path below records last_use on `s`
  try {
    run_backward(ctx, dy, dx, dwts, grads, s);
  } catch (...) {
    cudaEventRecord(ev_done_, s);
    if (st != nullptr && st->engine == this) cudaEventRecord(st->last_use, s);
    throw;
  }
}

void GpuEngine::run_backward(const MoeForwardContext& ctx, const TensorView& dy, const TensorView& dx,
                             const TensorView& dwts, const ExpertGradients& grads, cudaStream_t s) {
  NvtxRange range("backward");
  const int W = cfg.world_size, El = cfg.experts_per_rank(), hw = protocol::header_words(El), k = cfg.top_k;
  const int H = cfg.hidden, F = cfg.ffn;
  const auto* st = dynamic_cast<const GpuSaved*>(ctx.state.get());
  protocol::Status status =
      validate_backward_args(cfg, ctx, this, st != nullptr ? st->T : 0, dy, dx, dwts, grads, DeviceType::cuda);
  if (status.ok())
    status = check_devices({{&dy, "dy"}, {&dx, "dx"}, {&dwts, "d_topk_weights"}, {&grads.dw1, "dw1"}, {&grads.dw2, "dw2"}});

  // Status exchange: the saved forward's headers (its counts), or an erring rank's zero rows.
  {
    NvtxRange r("exchange");
    std::vector<int64_t> hdr;
    if (status.ok()) hdr = st->send_hdr;
    else protocol::encode_count_headers(protocol::empty_dispatch_layout(cfg), status, hdr);
    std::memcpy(h_hdr_up_, hdr.data(), hdr.size() * sizeof(int64_t));
    EPMOE_CUDA_CHECK(cudaMemcpyAsync(d_hdr_send_, h_hdr_up_, hdr.size() * sizeof(int64_t), cudaMemcpyHostToDevice, s));
    comm_->alltoall_i64(d_hdr_send_, d_hdr_recv_, size_t(hw));
    EPMOE_CUDA_CHECK(cudaMemcpyAsync(h_hdr_ + size_t(W) * hw, d_hdr_recv_, size_t(W) * hw * sizeof(int64_t),
                                     cudaMemcpyDeviceToHost, s));
    comm_->host_wait(s, "backward status exchange");
    recv_hdr_.assign(h_hdr_ + size_t(W) * hw, h_hdr_ + 2 * size_t(W) * hw);
    const protocol::ReceivePlan plan = protocol::decode_count_headers(recv_hdr_, W, El);  // throws on every rank
    EPMOE_CHECK(plan.recv_rows == st->recv_rows, ErrorCode::internal, "backward: the peers' saved forwards differ "
                "from this rank's (a context of another forward?)");
  }
  cublas_ptrs_.used = 0;
  const int64_t T = st->T, S = st->S, R = st->R, P = st->P;
  const size_t row_bytes = size_t(H) * sizeof(bf16);
  const bool recompute = st->policy == SavePolicy::rows_recompute;
  // Safe to grow: the host wait drained `s`, which waited for the previous call.
  send_x_.ensure(size_t(S) * row_bytes);
  recv_x_.ensure(size_t(R) * row_bytes);
  combine_.ensure(size_t(R) * row_bytes);
  b_ds_rows_.ensure(size_t(R) * k * 4);
  b_ds_back_.ensure(size_t(S) * k * 4);
  b_row_pair_.ensure(size_t(R) * k * 4);
  b_dys_.ensure(size_t(P) * row_bytes);
  b_da_.ensure(size_t(P) * F * 2);
  b_dh_.ensure(size_t(P) * 2 * F * 2);
  b_act_s_.ensure(size_t(P) * F * 2);
  b_dxp_.ensure(size_t(P) * row_bytes);
  b_ds_pair_.ensure(size_t(P) * 4);
  if (recompute) {
    xs_.ensure(size_t(P) * row_bytes);
    b_h_.ensure(size_t(P) * 2 * F * 2);
  }

  {  // dy along the forward's routes
    NvtxRange r("dispatch");
    kernels::pack_rows_launch(dy.ptr<__nv_bfloat16>(), H, st->send_token.as<int32_t>(), S, send_x_.as<__nv_bfloat16>(), s);
    const AlltoallvPlane fwd[1] = {
        protocol::make_plane(send_x_.as<void>(), recv_x_.as<void>(), st->send_rows, st->recv_rows, row_bytes)};
    comm_->alltoallv(fwd);
  }
  {
    NvtxRange r("experts");
    const int64_t* off = st->host_expert.data();
    const int64_t* cnt = off + El + 1;
    const int64_t* d_total = st->expert.as<int64_t>() + El;
    const int32_t* pair_row = st->pair_row.as<int32_t>();
    kernels::ExpertBackwardProblem b;
    b.padded_offsets = st->expert.as<int64_t>();
    b.pair_row = pair_row;
    b.pair_weight = st->pair_weight.as<float>();
    b.rows = P;
    b.w1 = w1_, b.w2 = w2_, b.experts = El, b.hidden = H, b.ffn = F;
    b.xs = st->rows.as<__nv_bfloat16>();
    b.h = st->h.as<__nv_bfloat16>();
    if (P > 0) {
      kernels::gather_rows_launch(recv_x_.as<__nv_bfloat16>(), R, H, pair_row, d_total, P, b_dys_.as<__nv_bfloat16>(), s);
      if (recompute) {
        kernels::gather_rows_launch(st->rows.as<__nv_bfloat16>(), R, H, pair_row, d_total, P, xs_.as<__nv_bfloat16>(), s);
        kernels::ExpertProblem up;
        up.w1 = w1_, up.w2 = w2_, up.experts = El, up.hidden = H, up.ffn = F, up.xs = xs_.as<__nv_bfloat16>();
        if (path == ExpertPath::sm90) {
          // The saving forward's UP again (same kernel, same plan: the same h bits as the other
          // policy keeps), gathering from the kept rows; act goes to da's buffer, which da rewrites.
          up.x = st->rows.as<__nv_bfloat16>(), up.x_rows = R;
          up.padded_offsets = b.padded_offsets, up.pair_row = pair_row, up.pair_weight = b.pair_weight;
          up.rows_capacity = P;
          up.act = b_da_.as<__nv_bfloat16>(), up.preact = b_h_.as<__nv_bfloat16>();
          up.out = b_dxp_.as<__nv_bfloat16>(), up.out_rows = 0;  // (DOWN does not run: no out)
          const Sm90Plan plan = kernels::resolve_sm90_plan(kernels::sm90_shape(up), sm90_device_, opt_.sm90_plan);
          kernels::sm90_up_launch(up, plan, s);
        } else {
          kernels::cublas_up_launch(up, off, cnt, b_h_.as<__nv_bfloat16>(), cublas_, cublas_ptrs_, s);
        }
        b.xs = xs_.as<__nv_bfloat16>();
        b.h = b_h_.as<__nv_bfloat16>();
      }
    }
    b.dys = b_dys_.as<__nv_bfloat16>();
    b.da = b_da_.as<__nv_bfloat16>();
    b.dh = b_dh_.as<__nv_bfloat16>();
    b.act_s = b_act_s_.as<__nv_bfloat16>();
    b.ds = b_ds_pair_.as<float>();
    b.dxp = b_dxp_.as<__nv_bfloat16>();
    b.dw1 = grads.dw1.data;
    b.dw2 = grads.dw2.data;
    b.dw1_f32 = grads.dw1.dtype == DType::f32;
    b.dw2_f32 = grads.dw2.dtype == DType::f32;
    b.accumulate = grads.accumulate;
    // dW: cuBLAS by default (it beat the sm_90 kernel by 2-6% of fwd+bwd, same run, 2026-12-02), the
    // sm_90 kernel (no host counts: what a graph-captured backward needs) when asked for and the
    // shapes allow.
    const bool wgrad90 = opt_.weight_grad_path == ExpertPath::sm90 && P > 0 && kernels::sm90_wgrad_supported(H, F) &&
                         kernels::sm90_wgrad_supported(2 * F, H);
    b.weight_grads = !wgrad90;
    b.data_grads_grouped = kernels::data_grads_grouped(opt_.data_grad_grouping, P, El);
    kernels::cublas_expert_backward_launch(b, off, cnt, cublas_, cublas_ptrs_, s);
    if (wgrad90) {
      kernels::WgradProblem w2{b.dys, b.act_s, b.padded_offsets, P, El, H, F, grads.dw2.data, b.dw2_f32, b.accumulate};
      kernels::WgradProblem w1{b.dh, b.xs, b.padded_offsets, P, El, 2 * F, H, grads.dw1.data, b.dw1_f32, b.accumulate};
      kernels::sm90_wgrad_launch(w2, s);
      kernels::sm90_wgrad_launch(w1, s);
    }
    kernels::row_pair_map_launch(st->expert.as<int64_t>(), El, pair_row, P, st->recv_meta.as<int32_t>(), R, k,
                                 b_row_pair_.as<int32_t>(), s);
    kernels::reduce_row_pairs_launch(b_dxp_.as<__nv_bfloat16>(), b_ds_pair_.as<float>(), b_row_pair_.as<int32_t>(), R,
                                     k, H, combine_.as<__nv_bfloat16>(), b_ds_rows_.as<float>(), s);
  }
  {  // {dx rows, ds} back to the sources
    NvtxRange r("combine");
    const AlltoallvPlane back[2] = {
        protocol::make_plane(combine_.as<void>(), send_x_.as<void>(), st->recv_rows, st->send_rows, row_bytes),
        protocol::make_plane(b_ds_rows_.as<void>(), b_ds_back_.as<void>(), st->recv_rows, st->send_rows,
                             size_t(k) * sizeof(float))};
    comm_->alltoallv(back);
  }
  {
    NvtxRange r("reduce");
    kernels::combine_reduce_launch(send_x_.as<__nv_bfloat16>(), st->token_row.as<int32_t>(), T, W, H,
                                   dx.ptr<__nv_bfloat16>(), s);
    kernels::scatter_weight_grads_launch(st->ids.as<int32_t>(), st->token_row.as<int32_t>(), b_ds_back_.as<float>(), T,
                                         k, W, El, dwts.ptr<float>(), s);
  }
  EPMOE_CUDA_CHECK(cudaEventRecord(st->last_use, s));
  EPMOE_CUDA_CHECK(cudaEventRecord(ev_done_, s));
}

}  // namespace epmoe::gpu
