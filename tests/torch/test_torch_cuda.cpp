// The C++ module (epmoe::torch_ext::Moe) on CUDA, world 1 (a single-rank NCCL communicator; the
// layer's memory from torch's caching allocator, the module's default there), against the same
// module on CPU, world 1 (a mock rank), with the same weights and inputs: y and the gradients of x,
// topk_weights, w1 and w2 after y.backward(dy); and the CUDA gradients against the fp64 reference
// (tests/backward_case.h). Skips without a GPU. Built where the torch build has CUDA. Then the
// modules' capturable forward (bf16 Moe and its MXFP8 copy, the latter also on x given in MXFP8:
// forward_capturable_mxfp8; max_tokens_per_rank N) captured in an
// at::cuda::CUDAGraph and replayed at T = 0, 1, 7, N against the same module's regular forward on the
// T tokens (the same tolerance: both are the GPU path, in kernel forms the plan picks for the capacity
// and for T), rows past T exactly 0.
//
// Tolerance, CUDA against CPU: both engines take bf16 inputs and accumulate in fp32, in different
// orders, and round [g, u], the activation, expert outputs, y, dx rows and dW to bf16; the GPU also
// rounds da, dx per pair and dh (tests/gpu/test_backward_gpu.cpp). Each side is within a few 2^-9
// relative roundings of the exact value (kGradElem / kGradL2 against the fp64 reference, measured
// ~3e-3 relative L2), so their difference is judged by the same measures: |cuda - cpu| <= 2^-5
// max|cpu| per element (4x the 2 * 4 * 2^-9 of both sides' roundings) and relative L2 <= 1.5e-2.
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
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

TEST(TorchCudaGraph, CapturedModulesReplayAtEveryTokenCount) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device (torch::cuda::is_available() is false)";
  constexpr int E = 8, k = 2, H = 256, F = 256;
  constexpr int64_t N = 24;
  const MoeConfig cfg{.num_experts = E, .top_k = k, .hidden = H, .ffn = F, .world_size = 1, .rank = 0};
  const c10::Device dev(c10::kCUDA, 0);
  LayerOptions opt;
  opt.max_tokens_per_rank = N;
  torch_ext::Moe moe(cfg, make_nccl_communicator_single(), opt);
  moe->to(dev);
  const ModelWeights mw = make_weights(E, H, F, 4801);
  torch::NoGradGuard no_grad;
  moe->w1.copy_(from_bf16(mw.w1, {E, 2 * F, H}));
  moe->w2.copy_(from_bf16(mw.w2, {E, H, F}));
  torch_ext::MoeFp8 fp8(*moe, torch_ext::Fp8Format::mxfp8);
  fp8->to(dev);
  const auto bf = at::TensorOptions().device(dev);
  const char* names[3] = {"bf16 module", "MXFP8 module", "MXFP8 module, x given in MXFP8"};
  for (int which = 0; which < 3; ++which) {
    SCOPED_TRACE(names[which]);
    at::Tensor x = at::zeros({N, H}, bf.dtype(at::kBFloat16)), ids = at::zeros({N, k}, bf.dtype(at::kInt)),
               wts = at::zeros({N, k}, bf.dtype(at::kFloat)), T = at::zeros({1}, bf.dtype(at::kLong));
    // which == 2: x's MXFP8 bytes (torch_ext::quantize_mxfp8, outside the graph) in static buffers
    at::Tensor xq = at::zeros({N, H}, bf.dtype(at::kByte)), xsc = at::zeros({N, H / 32}, bf.dtype(at::kByte));
    auto run = [&](const at::Tensor& x, const at::Tensor& ids, const at::Tensor& wts, const at::Tensor& T) {
      if (which == 2) return fp8->forward_capturable_mxfp8(xq, xsc, ids, wts, T);
      return which ? fp8->forward_capturable(x, ids, wts, T) : moe->forward_capturable(x, ids, wts, T);
    };
    run(x, ids, wts, T);  // warm-up: makes the layer
    torch::cuda::synchronize();
    at::cuda::CUDAGraph graph;
    at::Tensor y;
    {
      const c10::cuda::CUDAStreamGuard on(c10::cuda::getStreamFromPool(false, 0));  // (capture needs a side stream)
      graph.capture_begin();
      y = run(x, ids, wts, T);
      graph.capture_end();
    }
    for (int64_t t : {int64_t(0), int64_t(1), int64_t(7), N}) {
      SCOPED_TRACE("T=" + std::to_string(t));
      const EpCase c = make_ep_case(1, E, k, H, F, std::max<int64_t>(t, 1), RoutingKind::zipf, 0, 4900 + t);
      const Routing R = routing_of(c, 0);
      ids.fill_(E + 100);  // rows past T: ids that would fail if read
      if (t > 0) {
        x.narrow(0, 0, t).copy_(from_bf16(make_x(c.seed, 0, t, H), {t, H}));
        at::Tensor hi = at::empty({t, k}, at::kInt), hw = at::empty({t, k}, at::kFloat);
        std::memcpy(hi.data_ptr(), R.ids.data(), R.ids.size() * 4);
        std::memcpy(hw.data_ptr(), R.weights.data(), R.weights.size() * 4);
        ids.narrow(0, 0, t).copy_(hi);
        wts.narrow(0, 0, t).copy_(hw);
      }
      if (which == 2) {
        const auto [q, s] = torch_ext::quantize_mxfp8(x);
        xq.copy_(q);
        xsc.copy_(s);
      }
      T.fill_(t);
      graph.replay();
      torch::cuda::synchronize();
      EXPECT_NO_THROW(which ? fp8->check_capturable() : moe->check_capturable());
      const at::Tensor got = y.cpu();
      EXPECT_TRUE(got.narrow(0, t, N - t).eq(0).all().item<bool>()) << "rows past T must be 0";
      if (t == 0) continue;
      const at::Tensor xs = x.narrow(0, 0, t), is = ids.narrow(0, 0, t), ws = wts.narrow(0, 0, t);
      const at::Tensor regular = which ? fp8->forward(xs, is, ws) : moe->forward(xs, is, ws);
      EXPECT_TRUE(near("graph y vs the regular forward's", got.narrow(0, 0, t), regular));
    }
  }
}

}  // namespace
}  // namespace epmoe::test
