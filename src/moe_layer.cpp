#include "epmoe/moe_layer.h"

#include <optional>

#include "engine.h"
#include "kernels/heuristics/sm90_heuristics.h"

namespace epmoe {

MoeLayer::MoeLayer(const MoeConfig& cfg, const ExpertWeights& weights, std::shared_ptr<Communicator> comm,
                   const LayerOptions& options) {
  EPMOE_CHECK(comm != nullptr, ErrorCode::invalid_argument, "MoeLayer needs a communicator");
  // Local checks are collected, not thrown, so the agreement below still runs on every rank and a
  // rank with a bad configuration or bad weights fails all ranks instead of leaving them waiting.
  const DeviceType dev = weights.w1.device;
  std::optional<Error> local;
  try {
    cfg.validate();
    validate_weights(cfg, weights, dev);
    if (!options.sm90_plan.empty()) {
      // The override must hold for every forward's shape; only the row count varies, and no rule of
      // check_sm90_plan depends on it.
      const kernels::Sm90Shape shape{cfg.experts_per_rank(), cfg.hidden, cfg.ffn, kernels::kExpertRowsForChecks};
      (void)kernels::resolve_sm90_plan(shape, {1, 1}, options.sm90_plan);
    }
    if (options.max_tokens_per_rank != 0) {
      EPMOE_CHECK(options.max_tokens_per_rank > 0, ErrorCode::invalid_argument, "max_tokens_per_rank ",
                  options.max_tokens_per_rank, " < 0");
      EPMOE_CHECK(dev == DeviceType::cuda, ErrorCode::unsupported,
                  "max_tokens_per_rank (the capturable forward) needs cuda weights");
      EPMOE_CHECK(cfg.world_size == 1 || options.capturable_transport != CapturableTransport::local,
                  ErrorCode::invalid_argument, "capturable_transport local needs world size 1; world size ",
                  cfg.world_size);
      EPMOE_CHECK(!options.deterministic, ErrorCode::unsupported,
                  "deterministic with max_tokens_per_rank: the capturable forward reduces its pairs in any order");
    }
  } catch (const Error& e) {
    local = e;
  }
  protocol::check_config_agreement(*comm, cfg, local ? &*local : nullptr);
  if (dev == DeviceType::cpu) {
    EPMOE_CHECK(options.expert_path == ExpertPath::automatic || options.expert_path == ExpertPath::cpu,
                ErrorCode::invalid_argument, "cpu weights run only the cpu expert path");
    engine_ = make_cpu_engine(cfg, weights, std::move(comm), options);
  } else {
#if EPMOE_WITH_CUDA
    engine_ = make_gpu_engine(cfg, weights, std::move(comm), options);
#else
    EPMOE_FAIL(ErrorCode::unsupported, "weights are on cuda but this build of epmoe has no CUDA support");
#endif
  }
}

MoeLayer::~MoeLayer() = default;

void MoeLayer::forward(const TensorView& x, const TensorView& ids, const TensorView& w, const TensorView& y,
                       void* stream, MoeForwardContext* save) {
  engine_->forward(x, ids, w, y, stream, save);
}

void MoeLayer::forward_mxfp8(const TensorView& x, const TensorView& x_scale, const TensorView& ids,
                             const TensorView& w, const TensorView& y, void* stream) {
  engine_->forward_mxfp8(x, x_scale, ids, w, y, stream);
}

void MoeLayer::backward(const MoeForwardContext& ctx, const TensorView& dy, const TensorView& dx,
                        const TensorView& d_topk_weights, const ExpertGradients& grads, void* stream) {
  engine_->backward(ctx, dy, dx, d_topk_weights, grads, stream);
}

void MoeLayer::forward_capturable(const TensorView& x, const TensorView& ids, const TensorView& w,
                                  const TensorView& y, const int64_t* num_tokens, void* stream, bool save) {
  engine_->forward_capturable(x, ids, w, y, num_tokens, stream, save, nullptr);
}

void MoeLayer::forward_capturable_mxfp8(const TensorView& x, const TensorView& x_scale, const TensorView& ids,
                                        const TensorView& w, const TensorView& y, const int64_t* num_tokens,
                                        void* stream) {
  engine_->forward_capturable(x, ids, w, y, num_tokens, stream, /*save=*/false, &x_scale);
}

void MoeLayer::backward_capturable(const TensorView& x, const TensorView& ids, const TensorView& dy,
                                   const TensorView& dx, const TensorView& d_topk_weights,
                                   const ExpertGradients& grads, const int64_t* num_tokens, void* stream) {
  engine_->backward_capturable(x, ids, dy, dx, d_topk_weights, grads, num_tokens, stream);
}

void MoeLayer::check_capturable(void* stream) { engine_->check_capturable(stream); }

void MoeLayer::bind_weights(const ExpertWeights& weights) { engine_->bind_weights(weights); }

MoeForwardContext::MoeForwardContext() = default;
MoeForwardContext::~MoeForwardContext() = default;
MoeForwardContext::MoeForwardContext(MoeForwardContext&&) noexcept = default;
MoeForwardContext& MoeForwardContext::operator=(MoeForwardContext&&) noexcept = default;
bool MoeForwardContext::saved() const { return state != nullptr; }
SavePolicy MoeForwardContext::policy() const { return state ? state->policy : SavePolicy::rows_and_preactivation; }
int64_t MoeForwardContext::saved_bytes() const { return state ? state->bytes : 0; }
int64_t MoeForwardContext::routed_pairs() const { return state ? state->pairs : 0; }
double MoeForwardContext::activation_bytes_per_pair() const {
  return state && state->pairs > 0 ? double(state->activation_bytes) / double(state->pairs) : 0.0;
}

const MoeConfig& MoeLayer::config() const { return engine_->cfg; }
const ForwardStats& MoeLayer::last_stats() const { return engine_->stats; }
ExpertPath MoeLayer::expert_path() const { return engine_->path; }

}  // namespace epmoe
