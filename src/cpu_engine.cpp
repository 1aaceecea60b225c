// The CPU engine: the whole EP forward and backward on the host, over any host communicator (mock,
// MPI). The backward runs the forward's protocol in reverse on the saved layout:
//   status exchange -> dispatch dy along the forward's routes -> expert backward (dx rows, ds, dW)
//   -> combine {dx rows, ds} back -> source: dx = fixed-order fp32 sum, d_topk_weights from ds
#include <chrono>
#include <cstring>

#include "cpu_experts.h"
#include "engine.h"
#include "epmoe/fp8_block.h"
#include "epmoe/mxfp8.h"

namespace epmoe {

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// What a CPU forward keeps for its backward.
struct CpuSaved final : MoeForwardContext::State {
  protocol::DispatchLayout L;  // source side: routes, token_row, send_meta
  protocol::ReceivePlan P;     // rows from / to each peer
  std::vector<int32_t> ids;    // [T, k] the forward's topk_ids (d_topk_weights' slots)
  std::vector<bf16> recv_x;    // [R, hidden] received rows
  std::vector<int32_t> recv_meta;
  std::vector<bf16> h;         // [pairs, 2 ffn] (rows_and_preactivation), else empty
};

class CpuEngine final : public MoeLayer::Engine {
 public:
  CpuEngine(const MoeConfig& c, const ExpertWeights& w, std::shared_ptr<Communicator> comm, const LayerOptions& opt)
      : comm_(std::move(comm)),
        experts_(c, w.fp8() ? nullptr : w.w1.ptr<bf16>(), w.fp8() ? nullptr : w.w2.ptr<bf16>(), opt.cpu_threads),
        on_receive_(opt.on_receive),
        save_policy_(opt.save_policy),
        fp8_(w.fp8()),
        block_(w.fp8_block()) {
    cfg = c;
    path = ExpertPath::cpu;
    if (fp8_) set_fp8(w);
  }

  void bind_weights(const ExpertWeights& w) override {
    validate_weights(cfg, w, DeviceType::cpu);
    EPMOE_CHECK(w.fp8() == fp8_ && w.fp8_block() == block_, ErrorCode::invalid_argument,
                "bind_weights: the layer was built with ", layer_format_name(fp8_, block_), " weights; these are ",
                layer_format_name(w.fp8(), w.fp8_block()));
    if (fp8_) set_fp8(w);
    else experts_.set_weights(w.w1.ptr<bf16>(), w.w2.ptr<bf16>());
  }

  void forward(const TensorView& x, const TensorView& ids, const TensorView& wts, const TensorView& y, void*,
               MoeForwardContext* save) override {
    run_forward(x, nullptr, ids, wts, y, save);
  }
  void forward_mxfp8(const TensorView& x, const TensorView& x_scale, const TensorView& ids, const TensorView& wts,
                     const TensorView& y, void*) override {
    run_forward(x, &x_scale, ids, wts, y, nullptr);
  }

  // x bf16, or MXFP8 with x_scale (forward_mxfp8).
  void run_forward(const TensorView& x, const TensorView* x_scale, const TensorView& ids, const TensorView& wts,
                   const TensorView& y, MoeForwardContext* save) {
    const int W = cfg.world_size, El = cfg.experts_per_rank(), H = cfg.hidden, k = cfg.top_k;
    const size_t row_bytes = size_t(H) * sizeof(bf16), meta_bytes = size_t(protocol::meta_words(k)) * 4;
    stats = {};

    // layout (+ local validation: bad arguments, then bad ids); the statuses travel with the counts,
    // so a bad rank fails every rank alike
    auto t0 = Clock::now();
    protocol::Status status = validate_forward_args(cfg, x, ids, wts, y, DeviceType::cpu, x_scale);
    if (status.ok() && save != nullptr && fp8_) {
      status.code = ErrorCode::unsupported;
      status.text = std::string("an ") + layer_format_name(fp8_, block_) +
                    " layer is forward-only: a forward that saves for backward is not supported";
    }
    if (status.ok() && x_scale != nullptr) status = check_given_mx_layer("forward_mxfp8", fp8_, block_);
    protocol::DispatchLayout L = protocol::empty_dispatch_layout(cfg);
    if (status.ok()) {
      L = protocol::dispatch_layout(ids.ptr<int32_t>(), wts.ptr<float>(), x.shape[0], cfg);
      status = L.status;
      if (!status.ok()) L = protocol::empty_dispatch_layout(cfg);
    }
    stats.layout_ms = ms_since(t0);

    // count exchange: statuses travel with the counts, so a bad rank fails every rank alike
    t0 = Clock::now();
    protocol::encode_count_headers(L, status, send_hdr_);
    recv_hdr_.resize(send_hdr_.size());
    comm_->alltoall_i64(send_hdr_.data(), recv_hdr_.data(), size_t(protocol::header_words(El)));
    const protocol::ReceivePlan P = protocol::decode_count_headers(recv_hdr_, W, El);
    stats.exchange_ms = ms_since(t0);

    // dispatch: each token once per destination rank, with its (local expert, weight) pairs. An FP8
    // layer sends its rows in its format (packed rows, epmoe/mxfp8.h or epmoe/fp8_block.h: 0.52 of the
    // bytes): the experts would quantize them on arrival anyway, to the same values.
    t0 = Clock::now();
    const int64_t T = x.shape[0], sent = L.total_rows(), recvd = P.total_rows();
    const size_t wire_row_bytes = !fp8_ ? row_bytes
                                  : block_ ? size_t(fp8b::packed_row_bytes(H))
                                           : size_t(mx::packed_row_bytes(H));
    if (fp8_) {
      send_mx_.resize(size_t(sent) * wire_row_bytes);
      const int blocks = H / mx::kBlock;
      for (int64_t r = 0; r < sent; ++r) {
        const int64_t t = L.send_token[r];
        uint8_t* dst = &send_mx_[size_t(r) * wire_row_bytes];
        if (block_) {
          fp8b::quantize_packed_row(x.ptr<bf16>() + t * H, H, dst);
        } else if (x_scale == nullptr) {
          mx::quantize_packed_row(x.ptr<bf16>() + t * H, H, dst);
        } else {  // already in the format: its bytes, as they are
          mx::pack_row(x.ptr<uint8_t>() + t * H, x_scale->ptr<uint8_t>() + t * blocks, H, dst);
        }
      }
      recv_mx_.resize(size_t(recvd) * wire_row_bytes);
    } else {
      send_x_.resize(size_t(sent) * H);
      for (int64_t r = 0; r < sent; ++r)
        std::memcpy(&send_x_[size_t(r) * H], x.ptr<bf16>() + int64_t(L.send_token[r]) * H, row_bytes);
      recv_x_.resize(size_t(recvd) * H);
    }
    recv_meta_.resize(size_t(recvd) * protocol::meta_words(k));
    const AlltoallvPlane planes[2] = {
        fp8_ ? protocol::make_plane(send_mx_.data(), recv_mx_.data(), L.send_rows, P.recv_rows, wire_row_bytes)
               : protocol::make_plane(send_x_.data(), recv_x_.data(), L.send_rows, P.recv_rows, row_bytes),
        protocol::make_plane(L.send_meta.data(), recv_meta_.data(), L.send_rows, P.recv_rows, meta_bytes)};
    comm_->alltoallv(planes);
    stats.dispatch_ms = ms_since(t0);
    if (on_receive_)
      on_receive_(fp8_ ? static_cast<const void*>(recv_mx_.data()) : recv_x_.data(), recv_meta_.data(), P.recv_rows);

    // local experts: one weighted sum per received row
    t0 = Clock::now();
    expert_out_.resize(size_t(recvd) * H);
    const bool keep_h = save != nullptr && save_policy_ == SavePolicy::rows_and_preactivation;
    std::vector<bf16> h(keep_h ? size_t(P.total_pairs()) * 2 * cfg.ffn : 0);
    if (fp8_) experts_.run_packed_mx(recv_mx_.data(), recv_meta_.data(), recvd, expert_out_.data());
    else experts_.run(recv_x_.data(), recv_meta_.data(), recvd, expert_out_.data(), keep_h ? h.data() : nullptr);
    stats.experts_ms = ms_since(t0);

    // combine: rows go back the way they came
    t0 = Clock::now();
    returned_.resize(size_t(sent) * H);
    const AlltoallvPlane back[1] = {
        protocol::make_plane(expert_out_.data(), returned_.data(), P.recv_rows, L.send_rows, row_bytes)};
    comm_->alltoallv(back);
    stats.combine_ms = ms_since(t0);

    t0 = Clock::now();
    protocol::combine_reduce(L, returned_.data(), H, y.ptr<bf16>());
    stats.reduce_ms = ms_since(t0);

    stats.tokens = T;
    stats.send_rows = L.send_rows;
    stats.recv_rows = P.recv_rows;
    stats.dispatch_bytes = int64_t(sent * (wire_row_bytes + meta_bytes));
    stats.combine_bytes = int64_t(recvd * row_bytes);
    stats.expert_pairs = P.total_pairs();

    if (save != nullptr) {
      auto st = std::make_unique<CpuSaved>();
      st->engine = this;
      st->policy = save_policy_;
      st->pairs = P.total_pairs();
      st->ids.assign(ids.ptr<int32_t>(), ids.ptr<int32_t>() + T * k);
      st->recv_x = recv_x_;
      st->recv_meta = recv_meta_;
      st->h = std::move(h);
      st->activation_bytes = int64_t((st->recv_x.size() + st->h.size()) * sizeof(bf16));
      st->L = std::move(L);
      st->P = P;
      st->bytes = st->activation_bytes + int64_t(st->recv_meta.size() * 4 + st->ids.size() * 4 +
                                                 st->L.send_meta.size() * 4 + st->L.token_row.size() * 4 +
                                                 st->L.send_token.size() * 4);
      save->state = std::move(st);
    }
  }

  void backward(const MoeForwardContext& ctx, const TensorView& dy, const TensorView& dx, const TensorView& dwts,
                const ExpertGradients& grads, void*) override {
    const int W = cfg.world_size, El = cfg.experts_per_rank(), H = cfg.hidden, F = cfg.ffn, k = cfg.top_k;
    const auto* st = dynamic_cast<const CpuSaved*>(ctx.state.get());
    const int64_t T = st != nullptr ? st->L.num_tokens : 0;
    const protocol::Status status = validate_backward_args(cfg, ctx, this, T, dy, dx, dwts, grads, DeviceType::cpu);
    // Status exchange: a bad argument on any rank fails every rank alike (the counts are the saved
    // forward's; an erring rank announces zero rows).
    protocol::encode_count_headers(status.ok() ? st->L : protocol::empty_dispatch_layout(cfg), status, send_hdr_);
    recv_hdr_.resize(send_hdr_.size());
    comm_->alltoall_i64(send_hdr_.data(), recv_hdr_.data(), size_t(protocol::header_words(El)));
    const protocol::ReceivePlan P = protocol::decode_count_headers(recv_hdr_, W, El);  // throws on every rank
    EPMOE_CHECK(P.recv_rows == st->P.recv_rows, ErrorCode::internal, "backward: the peers' saved forwards differ "
                "from this rank's (a context of another forward?)");
    const protocol::DispatchLayout& L = st->L;
    const size_t row_bytes = size_t(H) * sizeof(bf16);
    const int64_t sent = L.total_rows(), recvd = P.total_rows();

    // dy along the forward's routes: once to each rank that had the token.
    send_x_.resize(size_t(sent) * H);
    protocol::pack_send_rows(L, dy.ptr<bf16>(), H, send_x_.data());
    recv_x_.resize(size_t(recvd) * H);
    const AlltoallvPlane fwd[1] = {protocol::make_plane(send_x_.data(), recv_x_.data(), L.send_rows, P.recv_rows, row_bytes)};
    comm_->alltoallv(fwd);

    // The experts' backward: dx rows, ds per (row, local slot), dW in fp32.
    expert_out_.resize(size_t(recvd) * H);
    std::vector<float> ds(size_t(recvd) * k), dw1(size_t(El) * 2 * F * H, 0.f), dw2(size_t(El) * H * F, 0.f);
    experts_.backward(st->recv_x.data(), st->recv_meta.data(), recvd, recv_x_.data(),
                      st->h.empty() ? nullptr : st->h.data(), expert_out_.data(), ds.data(), dw1.data(), dw2.data());

    // Back to the sources: dx rows and the ds of each row's slots.
    returned_.resize(size_t(sent) * H);
    std::vector<float> ds_back(size_t(sent) * k);
    const AlltoallvPlane back[2] = {
        protocol::make_plane(expert_out_.data(), returned_.data(), P.recv_rows, L.send_rows, row_bytes),
        protocol::make_plane(ds.data(), ds_back.data(), P.recv_rows, L.send_rows, size_t(k) * sizeof(float))};
    comm_->alltoallv(back);
    protocol::combine_reduce(L, returned_.data(), H, dx.ptr<bf16>());
    protocol::scatter_weight_grads(L, st->ids.data(), ds_back.data(), dwts.ptr<float>());
    write_grad(grads.dw1, dw1, grads.accumulate);
    write_grad(grads.dw2, dw2, grads.accumulate);
  }

 private:
  std::shared_ptr<Communicator> comm_;
  void set_fp8(const ExpertWeights& w) {
    if (w.fp8_block())
      experts_.set_fp8_block_weights(w.w1.ptr<uint8_t>(), w.w1_scale.ptr<float>(), w.w2.ptr<uint8_t>(),
                                     w.w2_scale.ptr<float>());
    else
      experts_.set_mxfp8_weights(w.w1.ptr<uint8_t>(), w.w1_scale.ptr<uint8_t>(), w.w2.ptr<uint8_t>(),
                                 w.w2_scale.ptr<uint8_t>());
  }
  CpuExperts experts_;
  std::vector<int64_t> send_hdr_, recv_hdr_;
  std::vector<bf16> send_x_, recv_x_, expert_out_, returned_;
  std::vector<uint8_t> send_mx_, recv_mx_;  // an FP8 layer's dispatched rows (packed, in its format)
  std::vector<int32_t> recv_meta_;
  std::function<void(const void*, const int32_t*, const std::vector<int64_t>&)> on_receive_;
  SavePolicy save_policy_;
  bool fp8_;    // the weights are FP8 (forward-only): MXFP8, or
  bool block_;  // FP8 block-128

  // g = v (or += v) in g's dtype (bf16 rounds once, after the sum).
  static void write_grad(const TensorView& g, const std::vector<float>& v, bool accumulate) {
    if (g.dtype == DType::f32) {
      float* d = g.ptr<float>();
      for (size_t i = 0; i < v.size(); ++i) d[i] = accumulate ? d[i] + v[i] : v[i];
    } else {
      bf16* d = g.ptr<bf16>();
      for (size_t i = 0; i < v.size(); ++i) d[i] = bf16(accumulate ? d[i].f() + v[i] : v[i]);
    }
  }
};

}  // namespace

std::unique_ptr<MoeLayer::Engine> make_cpu_engine(const MoeConfig& cfg, const ExpertWeights& w,
                                                  std::shared_ptr<Communicator> comm, const LayerOptions& opt) {
  EPMOE_CHECK(comm->memory_space() == MemorySpace::host, ErrorCode::invalid_argument,
              "the CPU engine (cpu weights) needs a host communicator, got '", comm->name(), "'");
  return std::make_unique<CpuEngine>(cfg, w, std::move(comm), opt);
}

}  // namespace epmoe
