// Internal: the engine behind MoeLayer. One per backend (cpu_engine.cpp, gpu_engine.cu).
#pragma once
#include <memory>

#include "epmoe/build_config.h"
#include "ep_protocol.h"
#include "epmoe/moe_layer.h"

namespace epmoe {

class MoeLayer::Engine {
 public:
  virtual ~Engine() = default;
  virtual void forward(const TensorView& x, const TensorView& topk_ids, const TensorView& topk_weights,
                       const TensorView& y, void* stream) = 0;
  MoeConfig cfg;
  ForwardStats stats;
  ExpertPath path = ExpertPath::automatic;
};

// Checks shapes, dtypes and devices of the forward arguments without throwing, so that a bad
// argument on one rank travels in the count exchange and fails every rank alike.
protocol::Status validate_forward_args(const MoeConfig& cfg, const TensorView& x, const TensorView& topk_ids,
                                       const TensorView& topk_weights, const TensorView& y, DeviceType device);
// Checks w1/w2 shapes for this rank (throws: construction is local and before any collective
// except the configuration agreement, which runs first).
void validate_weights(const MoeConfig& cfg, const ExpertWeights& w, DeviceType device);

std::unique_ptr<MoeLayer::Engine> make_cpu_engine(const MoeConfig& cfg, const ExpertWeights& w,
                                                  std::shared_ptr<Communicator> comm, const LayerOptions& opt);
#if EPMOE_WITH_CUDA
std::unique_ptr<MoeLayer::Engine> make_gpu_engine(const MoeConfig& cfg, const ExpertWeights& w,
                                                  std::shared_ptr<Communicator> comm, const LayerOptions& opt);
#endif

}  // namespace epmoe
