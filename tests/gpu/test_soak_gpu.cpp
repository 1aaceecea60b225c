// The 10,000-iteration soak on one GPU (issue 49 item 2): forward + backward at varying T (0 to 300
// tokens, skewed and with drops) on one layer; every 1000th iteration a fixed input set is checked
// against the fp64-accumulated reference and against iteration 0's bits (y, dx, dW1 and dW2: the
// deterministic forward and the backward must not drift); device memory in use (cudaMemGetInfo) and host resident
// memory are sampled after warm-up - once every T has grown the layer's buffers - and at the end,
// and must stay flat. (ctest runs it alone: RUN_SERIAL, as the device's memory in use is global.)
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "device_array.h"
#include "epmoe/moe_layer.h"
#include "epmoe/reference.h"
#include "single_comm.h"
#include "test_support.h"

namespace epmoe::test {
namespace {

// Tolerance of the GPU paths against the fp64 reference (test_forward_gpu.cpp states the roundings).
constexpr Tolerance kGpuTolerance{1.0 / 32, 1.0 / 32, 1e-2};

int64_t device_used_bytes() {
  size_t free_b = 0, total_b = 0;
  ck(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  return int64_t(total_b - free_b);
}

class SoakGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!cuda_available(why)) GTEST_SKIP() << why;
  }
  static void TearDownTestSuite() { release_single_comm(); }
};

TEST_F(SoakGpu, TenThousandForwardBackwardStayRightAndFlat) {
  constexpr int E = 16, k = 4, H = 256, F = 256, kIters = 10000, kEvery = 1000, kWarmup = 500;
  constexpr int64_t kMaxT = 300;
  const ModelWeights M = make_weights(E, H, F, 961);
  const MoeConfig cfg{.num_experts = E, .top_k = k, .hidden = H, .ffn = F, .world_size = 1, .rank = 0};
  Dev<bf16> w1(M.w1), w2(M.w2);
  LayerOptions opt;
  opt.deterministic = true;  // the fixed set's y must repeat bit for bit
  MoeLayer layer(cfg, {dview(w1.get(), DType::bf16, {E, 2 * F, H}), dview(w2.get(), DType::bf16, {E, H, F})},
                 single_comm(), opt);
  // Device buffers for the largest T, reused (the inputs are uploaded per iteration).
  Dev<bf16> x(size_t(kMaxT) * H), y(size_t(kMaxT) * H), dx(size_t(kMaxT) * H), dy(size_t(kMaxT) * H);
  Dev<int32_t> ids(size_t(kMaxT) * k);
  Dev<float> wts(size_t(kMaxT) * k), dwts(size_t(kMaxT) * k), dw1(M.w1.size()), dw2(M.w2.size());
  ck(cudaMemcpy(dy.get(), std::vector<bf16>(size_t(kMaxT) * H, bf16(0.5f)).data(), size_t(kMaxT) * H * 2,
                cudaMemcpyHostToDevice),
     "dy");
  std::vector<bf16> y0, dx0;
  std::vector<float> dw10, dw20;  // the fixed set's weight gradients: bitwise too
  int64_t dev_warm = -1, rss_warm = -1;
  for (int it = 0; it < kIters; ++it) {
    const bool fixed = it % kEvery == 0;
    const uint64_t seed = fixed ? 1 : uint64_t(it);
    const int64_t T = fixed ? 77 : int64_t(mix(seed, 5) % (kMaxT + 1));  // 0..300; T = 0 about once in 300
    const RoutingKind kind = fixed ? RoutingKind::zipf : it % 3 == 0 ? RoutingKind::with_drops : RoutingKind::uniform;
    const std::vector<bf16> hx = make_x(mix(962, seed), 0, T, H);
    const Routing R = make_routing(T, E, k, kind, mix(963, seed), 0, 1);
    if (T > 0) {
      ck(cudaMemcpy(x.get(), hx.data(), hx.size() * 2, cudaMemcpyHostToDevice), "x");
      ck(cudaMemcpy(ids.get(), R.ids.data(), R.ids.size() * 4, cudaMemcpyHostToDevice), "ids");
      ck(cudaMemcpy(wts.get(), R.weights.data(), R.weights.size() * 4, cudaMemcpyHostToDevice), "wts");
    }
    MoeForwardContext ctx;
    layer.forward(dview(x.get(), DType::bf16, {T, H}), dview(ids.get(), DType::i32, {T, k}),
                  dview(wts.get(), DType::f32, {T, k}), dview(y.get(), DType::bf16, {T, H}), nullptr, &ctx);
    layer.backward(ctx, dview(dy.get(), DType::bf16, {T, H}), dview(dx.get(), DType::bf16, {T, H}),
                   dview(dwts.get(), DType::f32, {T, k}),
                   {dview(dw1.get(), DType::f32, {E, 2 * F, H}), dview(dw2.get(), DType::f32, {E, H, F}), false},
                   nullptr);
    if (fixed) {
      ck(cudaDeviceSynchronize(), "sync");
      const std::vector<bf16> yh = y.host(size_t(T) * H), dxh = dx.host(size_t(T) * H);
      std::vector<float> ref(size_t(T) * H);
      reference_moe(hx.data(), R.ids.data(), R.weights.data(), T, k, M.w1.data(), M.w2.data(), E, H, F, ref.data());
      ASSERT_TRUE(close_to_reference(yh.data(), ref.data(), T, H, kGpuTolerance)) << "iteration " << it;
      const std::vector<float> dw1h = dw1.host(), dw2h = dw2.host();
      if (it == 0) {
        y0 = yh;
        dx0 = dxh;
        dw10 = dw1h;
        dw20 = dw2h;
      } else {
        ASSERT_EQ(std::memcmp(yh.data(), y0.data(), yh.size() * 2), 0) << "y drifted at iteration " << it;
        ASSERT_EQ(std::memcmp(dxh.data(), dx0.data(), dxh.size() * 2), 0) << "dx drifted at iteration " << it;
        ASSERT_EQ(std::memcmp(dw1h.data(), dw10.data(), dw1h.size() * 4), 0) << "dW1 drifted at iteration " << it;
        ASSERT_EQ(std::memcmp(dw2h.data(), dw20.data(), dw2h.size() * 4), 0) << "dW2 drifted at iteration " << it;
      }
      std::printf("[soak] iteration %d: device %.1f MB in use, host %.1f MB resident\n", it,
                  device_used_bytes() / 1e6, resident_bytes() / 1e6);
    }
    if (it == kWarmup) {
      ck(cudaDeviceSynchronize(), "sync");
      dev_warm = device_used_bytes();
      rss_warm = resident_bytes();
    }
  }
  ck(cudaDeviceSynchronize(), "sync");
  const int64_t dev_end = device_used_bytes(), rss_end = resident_bytes();
  std::printf("[soak] %d iterations: device %.1f -> %.1f MB, host %.1f -> %.1f MB (after %d -> end)\n", kIters,
              dev_warm / 1e6, dev_end / 1e6, rss_warm / 1e6, rss_end / 1e6, kWarmup);
  // Flat: the pool may round a late, larger request up (a few MB), no growth per iteration.
  EXPECT_LT(dev_end - dev_warm, int64_t(64) << 20) << "device memory grew";
  EXPECT_LT(rss_end - rss_warm, int64_t(32) << 20) << "host memory grew";
  const std::string seen = strprintf(
      "10 checks vs reference and bitwise (y, dx, dW1, dW2) passed; device %.1f -> %.1f MB (%+.1f), host %.1f -> "
      "%.1f MB (%+.1f) from iteration %d to the end",
      dev_warm / 1e6, dev_end / 1e6, (dev_end - dev_warm) / 1e6, rss_warm / 1e6, rss_end / 1e6,
      (rss_end - rss_warm) / 1e6, kWarmup);
  matrix_row("10,000 forward+backward on 1 GPU (T 0..300, deterministic)",
             "reference and iteration 0's bits (y, dx, dW) every 1000; device growth < 64 MB, host < 32 MB", seen);
}

}  // namespace
}  // namespace epmoe::test
