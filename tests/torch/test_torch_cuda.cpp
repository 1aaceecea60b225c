// The C++ module (epmoe::torch_ext::Moe) on CUDA, world 1 (a single-rank NCCL communicator; the
// layer's memory from torch's caching allocator, the module's default there), against the same
// module on CPU, world 1 (a mock rank), with the same weights and inputs: y and the gradients of x,
// topk_weights, w1 and w2 after y.backward(dy); and the CUDA gradients against the fp64 reference
// (tests/backward_case.h). Skips without a GPU. Built where the torch build has CUDA.
//
// Tolerance, CUDA against CPU: both engines take bf16 inputs and accumulate in fp32, in different
// orders, and round [g, u], the activation, expert outputs, y, dx rows and dW to bf16; the GPU also
// rounds da, dx per pair and dh (tests/gpu/test_backward_gpu.cpp). Each side is within a few 2^-9
// relative roundings of the exact value (kGradElem / kGradL2 against the fp64 reference, measured
// ~3e-3 relative L2), so their difference is judged by the same measures: |cuda - cpu| <= 2^-5
// max|cpu| per element (4x the 2 * 4 * 2^-9 of both sides' roundings) and relative L2 <= 1.5e-2.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backward_case.h"
#include "ep_case.h"
#include "epmoe/nccl_communicator.h"
#include "epmoe/torch.h"

namespace epmoe::test {
namespace {

at::Tensor from_bf16(const std::vector<bf16>& v, std::vector<int64_t> shape) {
  at::Tensor t = at::empty(shape, at::kBFloat16);
  std::memcpy(t.data_ptr(), v.data(), v.size() * sizeof(bf16));
  return t;
}
std::vector<float> to_float(const at::Tensor& t) {
  const at::Tensor f = t.to(at::kCPU).to(at::kFloat).contiguous();
  return std::vector<float>(f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
}

::testing::AssertionResult near(const char* what, const at::Tensor& got, const at::Tensor& want) {
  const at::Tensor g = got.to(at::kCPU).to(at::kDouble), w = want.to(at::kCPU).to(at::kDouble);
  if (g.sizes() != w.sizes()) return ::testing::AssertionFailure() << what << ": shape " << g.sizes() << " vs " << w.sizes();
  if (!at::isfinite(g).all().item<bool>()) return ::testing::AssertionFailure() << what << ": non-finite values";
  const double scale = w.abs().max().item<double>(), worst = (g - w).abs().max().item<double>();
  const double norm = w.norm().item<double>(), l2 = norm > 0 ? (g - w).norm().item<double>() / norm : worst;
  if (worst > kGradElem * scale + 1e-30 || l2 > kGradL2)
    return ::testing::AssertionFailure() << what << ": worst |cuda - cpu| " << worst << " (max |cpu| " << scale
                                         << "), relative L2 " << l2;
  return ::testing::AssertionSuccess();
}

struct Result {
  at::Tensor y, dx, dwts, dw1, dw2;
};

// The module on `comm` (its Parameters on `dev`), the case's weights and inputs, forward + backward.
Result run_module(const EpCase& c, std::shared_ptr<Communicator> comm, c10::Device dev) {
  const int E = c.E, k = c.k, H = c.hidden, F = c.ffn;
  const int64_t T = c.tokens_of(0);
  const MoeConfig cfg{.num_experts = E, .top_k = k, .hidden = H, .ffn = F, .world_size = 1, .rank = 0};
  torch_ext::Moe moe(cfg, std::move(comm));
  moe->to(dev);
  const ModelWeights mw = make_weights(E, H, F, c.seed);
  {
    torch::NoGradGuard no_grad;
    moe->w1.copy_(from_bf16(mw.w1, {E, 2 * F, H}));
    moe->w2.copy_(from_bf16(mw.w2, {E, H, F}));
  }
  const Routing R = routing_of(c, 0);
  at::Tensor ids = at::empty({T, k}, at::kInt), wts = at::empty({T, k}, at::kFloat);
  std::memcpy(ids.data_ptr(), R.ids.data(), R.ids.size() * 4);
  std::memcpy(wts.data_ptr(), R.weights.data(), R.weights.size() * 4);
  at::Tensor x = from_bf16(make_x(c.seed, 0, T, H), {T, H}).to(dev).requires_grad_();
  wts = wts.to(dev).requires_grad_();
  ids = ids.to(at::kLong).to(dev);  // as torch.topk gives them
  const at::Tensor dy = from_bf16(dy_of(c, 0), {T, H}).to(dev);
  at::Tensor y = moe->forward(x, ids, wts);
  EXPECT_EQ(y.device(), dev);
  y.backward(dy);
  return {y.detach().cpu(), x.grad().cpu(), wts.grad().cpu(), moe->w1.grad().cpu(), moe->w2.grad().cpu()};
}

class TorchCuda : public ::testing::TestWithParam<EpCase> {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device (torch::cuda::is_available() is false)";
  }
  static void TearDownTestSuite() { nccl_.reset(); }  // before exit, not after the CUDA runtime is gone
  static std::shared_ptr<Communicator> nccl() {
    if (!nccl_) nccl_ = make_nccl_communicator_single();
    return nccl_;
  }
  static inline std::shared_ptr<Communicator> nccl_;
};

TEST_P(TorchCuda, ModuleOnCudaMatchesModuleOnCpu) {
  const EpCase c = GetParam();
  const Result cpu = run_module(c, make_mock_world(1)[0], c10::Device(c10::kCPU));
  const Result gpu = run_module(c, nccl(), c10::Device(c10::kCUDA, 0));
  EXPECT_TRUE(near("y", gpu.y, cpu.y));
  EXPECT_TRUE(near("x.grad", gpu.dx, cpu.dx));
  EXPECT_TRUE(near("topk_weights.grad", gpu.dwts, cpu.dwts));
  EXPECT_TRUE(near("w1.grad", gpu.dw1, cpu.dw1));
  EXPECT_TRUE(near("w2.grad", gpu.dw2, cpu.dw2));
  // Right, not only alike: the fp64 reference.
  const ReferenceGrads ref = reference_grads(c, 0);
  EXPECT_TRUE(grad_close("cuda x.grad", to_float(gpu.dx), ref.dx));
  EXPECT_TRUE(grad_close("cuda topk_weights.grad", to_float(gpu.dwts), ref.dwts));
  EXPECT_TRUE(grad_close("cuda w1.grad", to_float(gpu.dw1), ref.dw1));
  EXPECT_TRUE(grad_close("cuda w2.grad", to_float(gpu.dw2), ref.dw2));
  const Routing R = routing_of(c, 0);
  const std::vector<float> dwts = to_float(gpu.dwts);
  for (size_t i = 0; i < R.ids.size(); ++i)
    if (R.ids[i] < 0) EXPECT_EQ(dwts[i], 0.0f) << "dropped slot " << i << " needs d = 0";
}

INSTANTIATE_TEST_SUITE_P(World1, TorchCuda,
                         ::testing::Values(make_ep_case(1, 8, 2, 256, 256, 200, RoutingKind::uniform, 0, 4701),
                                           make_ep_case(1, 16, 4, 256, 128, 120, RoutingKind::zipf, 0, 4702),
                                           make_ep_case(1, 8, 2, 128, 128, 90, RoutingKind::with_drops, 0, 4703),
                                           make_ep_case(1, 8, 4, 256, 256, 64, RoutingKind::one_expert, 3, 4704),
                                           make_ep_case(1, 8, 2, 128, 128, 1, RoutingKind::uniform, 0, 4705)),
                         [](const auto& info) { return info.param.name(); });

}  // namespace
}  // namespace epmoe::test
