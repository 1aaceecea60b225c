// LayerOptions::device_allocator on one GPU (NCCL single-rank communicator): a counting allocator
// (cudaMallocAsync / cudaFreeAsync underneath, which meets epmoe/device_allocator.h's contract by
// itself: stream-ordered reuse) given to a 1-GPU layer, beside the same layer with the default
// memory (cudaMalloc + the engine's private pool). Checked:
//   - forward, and forward(save) + backward, give the default layer's outputs bit for bit (y, dx,
//     d_topk_weights, dw1, dw2), on both expert paths and both save policies, with the forward on
//     one stream and the backward on another (the saved buffers' last use is then not on the
//     stream they were allocated on);
//   - the allocator saw allocations, each on the layer's device, and got every one back with its
//     size once the layer and the contexts that outlive it are gone (live bytes back to 0);
//   - an allocator that returns null or throws is a clear epmoe::Error(cuda_error), at construction
//     and in a forward (token-sized buffers: a status, so the layer stays usable).
// Skips without a CUDA device.
//
// Why bit for bit holds for y: with top_k 2 a token's row receives at most two bf16 atomic adds onto
// zero (both paths' scatter), 0 + a is exact and a + b = b + a, so arrival order cannot change the
// bits (top_k >= 3 could). The backward's sums are in fixed order (DECISIONS: row -> pair map).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "backward_case.h"
#include "device_array.h"
#include "ep_case.h"
#include "epmoe/device_allocator.h"
#include "epmoe/error.h"
#include "epmoe/moe_layer.h"
#include "kernels/sm90/experts.cuh"
#include "single_comm.h"
#include "test_support.h"

namespace epmoe::test {
namespace {



// Counts what the layer takes and gives back; stream-ordered memory from the device's default pool.
class CountingAllocator final : public DeviceAllocator {
 public:
  enum class Mode { normal, null, throws };

  void* allocate(size_t bytes, int device, void* stream) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (mode_ == Mode::null) return nullptr;
    if (mode_ == Mode::throws) throw std::bad_alloc();
    int cur = -1;
    if (cudaGetDevice(&cur) != cudaSuccess || cur != device) ++wrong_device_;
    void* p = nullptr;
    if (cudaMallocAsync(&p, bytes, static_cast<cudaStream_t>(stream)) != cudaSuccess) return nullptr;
    if (!live_.emplace(p, bytes).second) ++errors_;  // handed out twice
    ++allocations_;
    live_bytes_ += bytes;
    return p;
  }
  void deallocate(void* p, size_t bytes, int device, void* stream) override {
    std::lock_guard<std::mutex> lock(mu_);
    int cur = -1;
    if (cudaGetDevice(&cur) != cudaSuccess || cur != device) ++wrong_device_;
    const auto it = live_.find(p);
    if (it == live_.end() || it->second != bytes) {
      ++errors_;  // not ours, freed twice, or another size than asked
      return;
    }
    live_bytes_ -= it->second;
    live_.erase(it);
    ++deallocations_;
    if (cudaFreeAsync(p, static_cast<cudaStream_t>(stream)) != cudaSuccess) ++errors_;
  }

  void set_mode(Mode m) {
    std::lock_guard<std::mutex> lock(mu_);
    mode_ = m;
  }
  struct Counts {
    int64_t allocations = 0, deallocations = 0, live = 0, errors = 0, wrong_device = 0;
    size_t live_bytes = 0;
  };
  Counts counts() {
    std::lock_guard<std::mutex> lock(mu_);
    return {allocations_, deallocations_, int64_t(live_.size()), errors_, wrong_device_, live_bytes_};
  }

 private:
  std::mutex mu_;
  Mode mode_ = Mode::normal;
  std::map<void*, size_t> live_;
  int64_t allocations_ = 0, deallocations_ = 0, errors_ = 0, wrong_device_ = 0;
  size_t live_bytes_ = 0;
};

// One layer (world 1) on the case's weights.
std::unique_ptr<MoeLayer> make_layer(const EpCase& c, const Dev<bf16>& w1, const Dev<bf16>& w2, ExpertPath path,
                                     SavePolicy policy, std::shared_ptr<DeviceAllocator> alloc) {
  const MoeConfig cfg{.num_experts = c.E, .top_k = c.k, .hidden = c.hidden, .ffn = c.ffn, .world_size = 1, .rank = 0};
  LayerOptions opt;
  opt.expert_path = path;
  opt.save_policy = policy;
  opt.device_allocator = std::move(alloc);
  return std::make_unique<MoeLayer>(
      cfg,
      ExpertWeights{dview(w1.get(), DType::bf16, {c.E, 2 * int64_t(c.ffn), c.hidden}),
                    dview(w2.get(), DType::bf16, {c.E, int64_t(c.hidden), c.ffn})},
      single_comm(), opt);
}

struct Inputs {
  int64_t T;
  Dev<bf16> x, dy;
  Dev<int32_t> ids;
  Dev<float> wts;
  explicit Inputs(const EpCase& c)
      : T(c.tokens_of(0)), x(make_x(c.seed, 0, c.tokens_of(0), c.hidden)), dy(dy_of(c, 0)), ids(routing_of(c, 0).ids),
        wts(routing_of(c, 0).weights) {}
};

// Everything one pass produced, as raw bytes (compared bit for bit).
struct Outputs {
  std::vector<bf16> y_plain, y_saved, dx;
  std::vector<float> dwts, dw1, dw2;
};
bool same_bits(const std::vector<bf16>& a, const std::vector<bf16>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(bf16)) == 0);
}
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// forward (no save) on `fs`; forward(save) on `fs` and backward on `bs` (f32 dW); the contexts saved
// go to `keep` (so the caller can destroy them after the layer).
Outputs run_pass(MoeLayer& L, const EpCase& c, const Inputs& in, cudaStream_t fs, cudaStream_t bs,
                 std::vector<std::unique_ptr<MoeForwardContext>>& keep) {
  const int64_t T = in.T, H = c.hidden, F = c.ffn, E = c.E, k = c.k;
  Dev<bf16> y(size_t(T) * H, 0xff), y2(size_t(T) * H, 0xff), dx(size_t(T) * H, 0xff);
  Dev<float> dwts(size_t(T) * k, 0xff), dw1(size_t(E) * 2 * F * H, 0xff), dw2(size_t(E) * H * F, 0xff);
  const TensorView xv = dview(in.x.get(), DType::bf16, {T, H}), iv = dview(in.ids.get(), DType::i32, {T, k}),
                   wv = dview(in.wts.get(), DType::f32, {T, k});
  L.forward(xv, iv, wv, dview(y.get(), DType::bf16, {T, H}), fs);
  keep.push_back(std::make_unique<MoeForwardContext>());
  MoeForwardContext& ctx = *keep.back();
  L.forward(xv, iv, wv, dview(y2.get(), DType::bf16, {T, H}), fs, &ctx);
  ck(cudaStreamSynchronize(fs), "forward stream");  // (the backward's stream is ordered by the layer itself)
  ExpertGradients g{dview(dw1.get(), DType::f32, {E, 2 * F, H}), dview(dw2.get(), DType::f32, {E, H, F}), false};
  L.backward(ctx, dview(in.dy.get(), DType::bf16, {T, H}), dview(dx.get(), DType::bf16, {T, H}),
             dview(dwts.get(), DType::f32, {T, k}), g, bs);
  ck(cudaStreamSynchronize(bs), "backward stream");
  return {y.host(), y2.host(), dx.host(), dwts.host(), dw1.host(), dw2.host()};
}

class DeviceAllocatorGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!cuda_available(why)) GTEST_SKIP() << why;
    ck(cudaStreamCreateWithFlags(&fs_, cudaStreamNonBlocking), "stream");
    ck(cudaStreamCreateWithFlags(&bs_, cudaStreamNonBlocking), "stream");
  }
  void TearDown() override {
    if (fs_) cudaStreamDestroy(fs_);
    if (bs_) cudaStreamDestroy(bs_);
  }
  static void TearDownTestSuite() { release_single_comm(); }
  std::vector<ExpertPath> paths() const {
    std::vector<ExpertPath> p{ExpertPath::cublas};
    if (kernels::sm90_experts_supported(current_device())) p.push_back(ExpertPath::sm90);
    return p;
  }
  cudaStream_t fs_ = nullptr, bs_ = nullptr;
};

TEST_F(DeviceAllocatorGpu, OutputsMatchTheDefaultMemoryBitForBit) {
  // Growing T on one layer: the workspaces grow (old blocks go back to the allocator mid-run). One
  // seed for all: the reference (reference_grads) draws the weights from the case's seed, and the
  // layers here hold one set of weights across the cases.
  const std::vector<EpCase> cases = {
      make_ep_case(1, 8, 2, 256, 256, 40, RoutingKind::uniform, 0, 4600),
      make_ep_case(1, 8, 2, 256, 256, 300, RoutingKind::zipf, 0, 4600),
      make_ep_case(1, 8, 2, 256, 256, 250, RoutingKind::with_drops, 0, 4600),
  };
  const ModelWeights mw = make_weights(8, 256, 256, 4600);
  const Dev<bf16> w1(mw.w1), w2(mw.w2);
  auto counting = std::make_shared<CountingAllocator>();
  {
    std::vector<std::unique_ptr<MoeForwardContext>> outliving;  // destroyed after the layers
    for (ExpertPath path : paths()) {
      for (SavePolicy policy : {SavePolicy::rows_and_preactivation, SavePolicy::rows_recompute}) {
        const std::string tag = std::string(path == ExpertPath::sm90 ? "sm90" : "cublas") +
                                (policy == SavePolicy::rows_recompute ? " recompute" : " preact");
        SCOPED_TRACE(tag);
        auto plain = make_layer(cases[0], w1, w2, path, policy, nullptr);
        auto hooked = make_layer(cases[0], w1, w2, path, policy, counting);
        for (const EpCase& c : cases) {
          SCOPED_TRACE(c.name());
          const Inputs in(c);
          std::vector<std::unique_ptr<MoeForwardContext>> mine;
          const Outputs a = run_pass(*plain, c, in, fs_, bs_, mine);
          const Outputs b = run_pass(*hooked, c, in, fs_, bs_, outliving);
          EXPECT_TRUE(same_bits(a.y_plain, b.y_plain)) << "forward y";
          EXPECT_TRUE(same_bits(a.y_saved, b.y_saved)) << "forward(save) y";
          EXPECT_TRUE(same_bits(a.dx, b.dx)) << "dx";
          EXPECT_TRUE(same_bits(a.dwts, b.dwts)) << "d_topk_weights";
          EXPECT_TRUE(same_bits(a.dw1, b.dw1)) << "dw1";
          EXPECT_TRUE(same_bits(a.dw2, b.dw2)) << "dw2";
          // And right, not merely equal: the fp64 reference.
          const ReferenceGrads ref = reference_grads(c, 0);
          EXPECT_TRUE(grad_close("dx", as_float(b.dx), ref.dx));
          EXPECT_TRUE(grad_close("dw1", b.dw1, ref.dw1));
        }
        const auto n = counting->counts();
        EXPECT_GT(n.allocations, 0) << "the layer never used its allocator";
        EXPECT_GT(n.live, 0) << "workspaces and the outliving contexts should hold memory now";
      }
    }
    ck(cudaDeviceSynchronize(), "sync");
    // The layers are gone; the contexts saved on them are not, and still hold their memory.
    EXPECT_GT(counting->counts().live_bytes, 0u);
  }
  ck(cudaDeviceSynchronize(), "sync");
  const auto n = counting->counts();
  EXPECT_EQ(n.live, 0) << "allocations never given back";
  EXPECT_EQ(n.live_bytes, 0u);
  EXPECT_EQ(n.allocations, n.deallocations);
  EXPECT_EQ(n.errors, 0) << "double, foreign or mis-sized deallocations";
  EXPECT_EQ(n.wrong_device, 0) << "calls without the layer's device current";
}

TEST_F(DeviceAllocatorGpu, FailingAllocatorIsAClearError) {
  const EpCase small = make_ep_case(1, 8, 2, 128, 128, 16, RoutingKind::uniform, 0, 4611);
  const EpCase big = make_ep_case(1, 8, 2, 128, 128, 4096, RoutingKind::uniform, 0, 4612);
  const ModelWeights mw = make_weights(8, 128, 128, 4610);
  const Dev<bf16> w1(mw.w1), w2(mw.w2);
  auto counting = std::make_shared<CountingAllocator>();
  auto expect_error = [](auto&& f, const char* text) {
    try {
      f();
      ADD_FAILURE() << "no error (expected one naming '" << text << "')";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::cuda_error) << e.what();
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  // At construction (its fixed-size words).
  counting->set_mode(CountingAllocator::Mode::null);
  expect_error([&] { make_layer(small, w1, w2, ExpertPath::cublas, SavePolicy::rows_recompute, counting); },
               "device_allocator returned null");
  counting->set_mode(CountingAllocator::Mode::throws);
  expect_error([&] { make_layer(small, w1, w2, ExpertPath::cublas, SavePolicy::rows_recompute, counting); },
               "bad_alloc");
  // In a forward whose token-sized buffers must grow: the error, then the layer goes on.
  counting->set_mode(CountingAllocator::Mode::normal);
  {
    auto L = make_layer(small, w1, w2, ExpertPath::cublas, SavePolicy::rows_recompute, counting);
    auto plain = make_layer(small, w1, w2, ExpertPath::cublas, SavePolicy::rows_recompute, nullptr);
    std::vector<std::unique_ptr<MoeForwardContext>> keep;
    const Inputs in_small(small), in_big(big);
    (void)run_pass(*L, small, in_small, fs_, bs_, keep);
    counting->set_mode(CountingAllocator::Mode::null);
    Dev<bf16> y(size_t(in_big.T) * big.hidden);
    expect_error(
        [&] {
          L->forward(dview(in_big.x.get(), DType::bf16, {in_big.T, big.hidden}),
                     dview(in_big.ids.get(), DType::i32, {in_big.T, big.k}),
                     dview(in_big.wts.get(), DType::f32, {in_big.T, big.k}),
                     dview(y.get(), DType::bf16, {in_big.T, big.hidden}), fs_);
        },
        "device_allocator returned null");
    counting->set_mode(CountingAllocator::Mode::normal);
    std::vector<std::unique_ptr<MoeForwardContext>> keep_plain;
    const Outputs a = run_pass(*plain, big, in_big, fs_, bs_, keep_plain);
    const Outputs b = run_pass(*L, big, in_big, fs_, bs_, keep);
    EXPECT_TRUE(same_bits(a.y_plain, b.y_plain)) << "y after the failed forward";
    EXPECT_TRUE(same_bits(a.dx, b.dx)) << "dx after the failed forward";
  }
  ck(cudaDeviceSynchronize(), "sync");
  const auto n = counting->counts();
  EXPECT_EQ(n.live, 0);
  EXPECT_EQ(n.errors, 0);
}

}  // namespace
}  // namespace epmoe::test
