// The CPU engine: the whole EP forward on the host, over any host communicator (mock, MPI).
#include <chrono>
#include <cstring>

#include "cpu_experts.h"
#include "engine.h"

namespace epmoe {

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

class CpuEngine final : public MoeLayer::Engine {
 public:
  CpuEngine(const MoeConfig& c, const ExpertWeights& w, std::shared_ptr<Communicator> comm, const LayerOptions& opt)
      : comm_(std::move(comm)),
        experts_(c, w.w1.ptr<bf16>(), w.w2.ptr<bf16>(), opt.cpu_threads),
        on_receive_(opt.on_receive) {
    cfg = c;
    path = ExpertPath::cpu;
  }

  void forward(const TensorView& x, const TensorView& ids, const TensorView& wts, const TensorView& y,
               void*) override {
    const int W = cfg.world_size, El = cfg.experts_per_rank(), H = cfg.hidden, k = cfg.top_k;
    const size_t row_bytes = size_t(H) * sizeof(bf16), meta_bytes = size_t(protocol::meta_words(k)) * 4;
    stats = {};

    // layout (+ local validation: bad arguments, then bad ids)
    auto t0 = Clock::now();
    protocol::Status status = validate_forward_args(cfg, x, ids, wts, y, DeviceType::cpu);
    protocol::DispatchLayout L;
    L.world = W;
    L.top_k = k;
    L.experts_per_rank = El;
    if (status.ok()) {
      L = protocol::dispatch_layout(ids.ptr<int32_t>(), wts.ptr<float>(), x.shape[0], cfg);
      status = L.status;
    }
    if (!status.ok()) L.send_rows.assign(W, 0);
    stats.layout_ms = ms_since(t0);

    // count exchange: statuses travel with the counts, so a bad rank fails every rank alike
    t0 = Clock::now();
    protocol::encode_count_headers(L, status, send_hdr_);
    recv_hdr_.resize(send_hdr_.size());
    comm_->alltoall_i64(send_hdr_.data(), recv_hdr_.data(), size_t(protocol::header_words(El)));
    const protocol::ReceivePlan P = protocol::decode_count_headers(recv_hdr_, W, El);
    stats.exchange_ms = ms_since(t0);

    // dispatch: each token once per destination rank, with its (local expert, weight) pairs
    t0 = Clock::now();
    const int64_t T = x.shape[0], sent = L.total_rows(), recvd = P.total_rows();
    send_x_.resize(size_t(sent) * H);
    for (int64_t r = 0; r < sent; ++r)
      std::memcpy(&send_x_[size_t(r) * H], x.ptr<bf16>() + int64_t(L.send_token[r]) * H, row_bytes);
    recv_x_.resize(size_t(recvd) * H);
    recv_meta_.resize(size_t(recvd) * protocol::meta_words(k));
    const AlltoallvPlane planes[2] = {
        protocol::make_plane(send_x_.data(), recv_x_.data(), L.send_rows, P.recv_rows, row_bytes),
        protocol::make_plane(L.send_meta.data(), recv_meta_.data(), L.send_rows, P.recv_rows, meta_bytes)};
    comm_->alltoallv(planes);
    stats.dispatch_ms = ms_since(t0);
    if (on_receive_) on_receive_(recv_x_.data(), recv_meta_.data(), P.recv_rows);

    // local experts: one weighted sum per received row
    t0 = Clock::now();
    expert_out_.resize(size_t(recvd) * H);
    experts_.run(recv_x_.data(), recv_meta_.data(), recvd, expert_out_.data());
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
    stats.dispatch_bytes = int64_t(sent * (row_bytes + meta_bytes));
    stats.combine_bytes = int64_t(recvd * row_bytes);
    stats.expert_pairs = P.total_pairs();
  }

 private:
  std::shared_ptr<Communicator> comm_;
  CpuExperts experts_;
  std::vector<int64_t> send_hdr_, recv_hdr_;
  std::vector<bf16> send_x_, recv_x_, expert_out_, returned_;
  std::vector<int32_t> recv_meta_;
  std::function<void(const void*, const int32_t*, const std::vector<int64_t>&)> on_receive_;
};

}  // namespace

std::unique_ptr<MoeLayer::Engine> make_cpu_engine(const MoeConfig& cfg, const ExpertWeights& w,
                                                  std::shared_ptr<Communicator> comm, const LayerOptions& opt) {
  EPMOE_CHECK(comm->memory_space() == MemorySpace::host, ErrorCode::invalid_argument,
              "the CPU engine (cpu weights) needs a host communicator, got '", comm->name(), "'");
  return std::make_unique<CpuEngine>(cfg, w, std::move(comm), opt);
}

}  // namespace epmoe
