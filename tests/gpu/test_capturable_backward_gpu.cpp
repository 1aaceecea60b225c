// MoeLayer::forward_capturable(..., save) + backward_capturable on one GPU (sm_90 path): one CUDA
// graph holding the forward and the backward, captured once and replayed at T in {0, 1, 2, 8, 33, 65,
// N} with fresh inputs, routings cycling through uniform, zipf, one expert and dropped slots, for
// both transports (local; slots over the single-rank NCCL communicator) and both save policies:
// y against the dense reference, dx / d_topk_weights / dW1 / dW2 against the fp64 reference
// gradients (tests/backward_case.h), the rows of dx and d_topk_weights past T exactly 0, and the
// routing rows past T (filled with bad ids, and dy / x rows with values) never read. Then bf16
// gradients with accumulate, world 2 on device mock ranks (slots, a different T per rank, each
// rank's dW of its own experts against the reference summed over both ranks' tokens), and the host
// errors (no saving forward, other buffers, the first saving call under capture, dims the dgrad /
// wgrad kernels do not take). Skips without an sm_90a device.
//
// Tolerances: the forward's as in test_capturable_gpu (kTolerance); the gradients' kGradElem /
// kGradL2 of backward_case.h, which cover the regular GPU backward's roundings - this backward
// rounds the same intermediates (da, dh, act_s, dx per pair as bf16; fp32 accumulation in the
// GEMMs; the per-row sum in fp32 in slot order).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "backward_case.h"
#include "comm/mock_comm.h"
#include "capturable_support.h"
#include "device_array.h"
#include "ep_case.h"
#include "epmoe/error.h"
#include "epmoe/moe_layer.h"
#include "epmoe/reference.h"
#include "kernels/sm90/experts.cuh"
#include "single_comm.h"
#include "test_support.h"

namespace epmoe::test {
namespace {

constexpr Tolerance kTolerance{1.0 / 32, 1.0 / 32, 1e-2};
// hidden 512 / ffn 256: the smallest shape with two dgrad column tiles (dx) and several K stages in
// both dgrads (4 and 8) that the 256-multiple kernels take; small enough for the fp64 references.
constexpr int kE = 8, kK = 4, kHidden = 512, kFfn = 256;
constexpr int64_t kN = 80;  // max_tokens_per_rank: the graph's rows
constexpr uint64_t kSeed = 7301;

// The seed's weights, made once (bf16 for the layers and the forward reference, fp64 for the
// backward reference).
const ModelWeights& weights_bf16() {
  static const ModelWeights M = make_weights(kE, kHidden, kFfn, kSeed);
  return M;
}
std::vector<double> to_f64(const std::vector<bf16>& v) {
  std::vector<double> d(v.size());
  for (size_t i = 0; i < v.size(); ++i) d[i] = v[i].f();
  return d;
}
const std::vector<double>& weights_f64(int which) {
  static const std::vector<double> w1 = to_f64(weights_bf16().w1), w2 = to_f64(weights_bf16().w2);
  return which == 0 ? w1 : w2;
}
// reference_grads(c, 0) of a world-1 case on the cached weights.
ReferenceGrads reference_local(const EpCase& c) {
  const int64_t T = c.tokens_of(0);
  const std::vector<bf16> x = make_x(c.seed, 0, T, kHidden), dy = dy_of(c, 0);
  const Routing R = routing_of(c, 0);
  const std::vector<double> xd = to_f64(x), dyd = to_f64(dy), wd(R.weights.begin(), R.weights.end());
  ReferenceGrads g;
  g.dx.resize(xd.size());
  g.dwts.resize(wd.size());
  g.dw1.resize(weights_f64(0).size());
  g.dw2.resize(weights_f64(1).size());
  reference_moe_backward_f64(xd.data(), R.ids.data(), wd.data(), T, kK, weights_f64(0).data(), weights_f64(1).data(),
                             kE, kHidden, kFfn, dyd.data(), g.dx.data(), g.dwts.data(), g.dw1.data(), g.dw2.data());
  return g;
}

class CapturableBackwardGpu : public CapturableSuite {};

// One rank's layer and its N-row buffers (rank r of W: experts [r El, (r + 1) El) of the seed's).
struct Rank {
  int W, r, El;
  MoeConfig cfg;
  Dev<bf16> w1, w2;
  Dev<bf16> x{size_t(kN) * kHidden}, y{size_t(kN) * kHidden}, dy{size_t(kN) * kHidden}, dx{size_t(kN) * kHidden};
  Dev<int32_t> ids{size_t(kN) * kK};
  Dev<float> wts{size_t(kN) * kK}, dwts{size_t(kN) * kK};
  DType gd;
  Dev<uint8_t> dw1, dw2;
  Dev<int64_t> num_tokens{1};
  cudaStream_t stream = nullptr;
  std::unique_ptr<MoeLayer> layer;

  static std::vector<bf16> shard(const std::vector<bf16>& all, int r, int El, size_t per_expert) {
    return std::vector<bf16>(all.begin() + r * El * per_expert, all.begin() + (r + 1) * El * per_expert);
  }
  Rank(int world, int rank, std::shared_ptr<Communicator> comm, CapturableTransport transport, SavePolicy policy,
       DType grad_dtype = DType::f32)
      : W(world), r(rank), El(kE / world),
        cfg{.num_experts = kE, .top_k = kK, .hidden = kHidden, .ffn = kFfn, .world_size = world, .rank = rank},
        w1(shard(weights_bf16().w1, rank, kE / world, size_t(2) * kFfn * kHidden)),
        w2(shard(weights_bf16().w2, rank, kE / world, size_t(kHidden) * kFfn)),
        gd(grad_dtype),
        dw1(size_t(kE / world) * 2 * kFfn * kHidden * (grad_dtype == DType::f32 ? 4 : 2)),
        dw2(size_t(kE / world) * kHidden * kFfn * (grad_dtype == DType::f32 ? 4 : 2)) {
    ck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    LayerOptions opt;
    opt.expert_path = ExpertPath::sm90;
    opt.max_tokens_per_rank = kN;
    opt.capturable_transport = transport;
    opt.save_policy = policy;
    layer = std::make_unique<MoeLayer>(
        cfg,
        ExpertWeights{dview(w1.get(), DType::bf16, {El, 2 * kFfn, kHidden}),
                      dview(w2.get(), DType::bf16, {El, kHidden, kFfn})},
        std::move(comm), opt);
  }
  ~Rank() { cudaStreamDestroy(stream); }
  ExpertGradients grads(bool accumulate = false) const {
    ExpertGradients g;
    g.dw1 = dview(dw1.get(), gd, {El, 2 * kFfn, kHidden});
    g.dw2 = dview(dw2.get(), gd, {El, kHidden, kFfn});
    g.accumulate = accumulate;
    return g;
  }
  void forward(bool save = true) {
    layer->forward_capturable(dview(x.get(), DType::bf16, {kN, kHidden}), dview(ids.get(), DType::i32, {kN, kK}),
                              dview(wts.get(), DType::f32, {kN, kK}), dview(y.get(), DType::bf16, {kN, kHidden}),
                              num_tokens.get(), stream, save);
  }
  void backward(bool accumulate = false) {
    layer->backward_capturable(dview(x.get(), DType::bf16, {kN, kHidden}), dview(ids.get(), DType::i32, {kN, kK}),
                               dview(dy.get(), DType::bf16, {kN, kHidden}), dview(dx.get(), DType::bf16, {kN, kHidden}),
                               dview(dwts.get(), DType::f32, {kN, kK}), grads(accumulate), num_tokens.get(), stream);
  }
  // The case's T tokens of this rank in the first rows; the other rows hold values that would show
  // if read (finite x and dy, ids past E); outputs poisoned (NaN bits).
  void upload(const EpCase& c) {
    const int64_t T = c.tokens_of(r);
    std::vector<bf16> xa = make_x(91, r, kN, kHidden), dya = make_x(93, r, kN, kHidden);
    const std::vector<bf16> hx = make_x(c.seed, r, T, kHidden), hdy = dy_of(c, r);
    std::copy(hx.begin(), hx.end(), xa.begin());
    std::copy(hdy.begin(), hdy.end(), dya.begin());
    const Routing R = routing_of(c, r);
    std::vector<int32_t> ia(size_t(kN) * kK, kE + 1000);
    std::vector<float> wa(size_t(kN) * kK, 1.f);
    std::copy(R.ids.begin(), R.ids.end(), ia.begin());
    std::copy(R.weights.begin(), R.weights.end(), wa.begin());
    ck(cudaMemcpyAsync(x.get(), xa.data(), xa.size() * 2, cudaMemcpyHostToDevice, stream), "x");
    ck(cudaMemcpyAsync(dy.get(), dya.data(), dya.size() * 2, cudaMemcpyHostToDevice, stream), "dy");
    ck(cudaMemcpyAsync(ids.get(), ia.data(), ia.size() * 4, cudaMemcpyHostToDevice, stream), "ids");
    ck(cudaMemcpyAsync(wts.get(), wa.data(), wa.size() * 4, cudaMemcpyHostToDevice, stream), "w");
    ck(cudaMemcpyAsync(num_tokens.get(), &T, 8, cudaMemcpyHostToDevice, stream), "T");
    for (void* p : {static_cast<void*>(y.get()), static_cast<void*>(dx.get())})
      ck(cudaMemsetAsync(p, 0xff, size_t(kN) * kHidden * 2, stream), "poison");
    ck(cudaMemsetAsync(dwts.get(), 0xff, size_t(kN) * kK * 4, stream), "poison");
    ck(cudaMemsetAsync(dw1.get(), 0xff, dw1.size(), stream), "poison");
    ck(cudaMemsetAsync(dw2.get(), 0xff, dw2.size(), stream), "poison");
    ck(cudaStreamSynchronize(stream), "sync");
  }
  std::vector<float> widen(const Dev<uint8_t>& d) const {
    const std::vector<uint8_t> raw = d.host();
    std::vector<float> f(raw.size() / (gd == DType::f32 ? 4 : 2));
    if (gd == DType::f32) {
      std::memcpy(f.data(), raw.data(), raw.size());
    } else {
      for (size_t i = 0; i < f.size(); ++i) {
        uint16_t b;
        std::memcpy(&b, &raw[2 * i], 2);
        f[i] = bf16::to_float(b);
      }
    }
    return f;
  }
  // Every output of this rank against the references: "" when all agree, else what differs.
  std::string check(const EpCase& c, const ReferenceGrads& ref) const {
    const int64_t T = c.tokens_of(r);
    std::string why;
    auto add = [&](const char* what, const ::testing::AssertionResult& ok) {
      if (!ok) why += std::string(what) + ": " + ok.message() + "; ";
    };
    const std::vector<bf16> hy = y.host(), hdx = dx.host();
    const std::vector<float> hdw = dwts.host();
    const Routing R = routing_of(c, r);
    std::vector<float> yref(size_t(T) * kHidden);
    const ModelWeights& M = weights_bf16();
    const std::vector<bf16> hx = make_x(c.seed, r, T, kHidden);
    reference_moe(hx.data(), R.ids.data(), R.weights.data(), T, kK, M.w1.data(), M.w2.data(), kE, kHidden, kFfn,
                  yref.data());
    add("y", close_to_reference(hy.data(), yref.data(), T, kHidden, kTolerance));
    const std::vector<float> fdx = as_float(hdx);
    add("dx", grad_close("dx", std::vector<float>(fdx.begin(), fdx.begin() + T * kHidden), ref.dx));
    add("d_topk_weights", grad_close("d_topk_weights", std::vector<float>(hdw.begin(), hdw.begin() + T * kK), ref.dwts));
    add("dw1", grad_close("dw1", widen(dw1), ref.dw1));
    add("dw2", grad_close("dw2", widen(dw2), ref.dw2));
    for (size_t i = 0; i < R.ids.size(); ++i)
      if (R.ids[i] < 0 && hdw[i] != 0.f) {
        why += "a dropped slot's d_topk_weights is not 0; ";
        break;
      }
    for (int64_t i = T * kHidden; i < kN * kHidden; ++i)
      if ((hdx[size_t(i)].bits & 0x7fff) != 0) {
        why += "dx row " + std::to_string(i / kHidden) + " past T is not 0; ";
        break;
      }
    for (int64_t i = T * kK; i < kN * kK; ++i)
      if (hdw[size_t(i)] != 0.f) {
        why += "d_topk_weights row " + std::to_string(i / kK) + " past T is not 0; ";
        break;
      }
    return why;
  }
};

EpCase make_case(int world, std::vector<int64_t> tokens, RoutingKind kind, int round) {
  EpCase c = make_ep_case(world, kE, kK, kHidden, kFfn, tokens[0], kind, /*focus=*/(3 * round) % kE, kSeed);
  c.tokens = std::move(tokens);
  return c;
}

void graph_replays(CapturableTransport transport, SavePolicy policy) {
  const std::string tag = std::string(transport_name(transport)) +
                          (policy == SavePolicy::rows_recompute ? ", rows_recompute" : ", rows_and_preactivation");
  SCOPED_TRACE(tag);
  Rank rk(1, 0, single_comm(), transport, policy);
  // The first saving forward sizes the backward's buffers: once outside the capture (a warm-up).
  rk.upload(make_case(1, {4}, RoutingKind::uniform, 0));
  rk.forward();
  rk.backward();
  ck(cudaStreamSynchronize(rk.stream), "warm-up");
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ck(cudaStreamBeginCapture(rk.stream, cudaStreamCaptureModeThreadLocal), "begin capture");
  rk.forward();
  rk.backward();
  ck(cudaStreamEndCapture(rk.stream, &graph), "end capture");
  ck(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  const RoutingKind kinds[] = {RoutingKind::uniform, RoutingKind::zipf, RoutingKind::one_expert,
                               RoutingKind::with_drops};
  int round = 0, right = 0;
  for (int64_t T : {int64_t(0), int64_t(1), int64_t(2), int64_t(8), int64_t(33), int64_t(65), kN}) {
    const EpCase c = make_case(1, {T}, kinds[round % 4], round);
    ++round;
    SCOPED_TRACE(c.name());
    rk.upload(c);
    ck(cudaGraphLaunch(exec, rk.stream), "replay");
    ck(cudaStreamSynchronize(rk.stream), "sync");
    const std::string why = rk.check(c, reference_local(c));
    EXPECT_EQ(why, "");
    EXPECT_NO_THROW(rk.layer->check_capturable(rk.stream));
    right += why.empty();
  }
  matrix_row("one graph of forward(save) + backward replayed at T 0.." + std::to_string(kN) + " (1 GPU, " + tag + ")",
             "y, dx, d_topk_weights, dW1, dW2 match the references; rows past T zero",
             std::to_string(right) + " of " + std::to_string(round) + " replays right");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST_F(CapturableBackwardGpu, LocalGraphReplaysAtEveryTokenCount) {
  graph_replays(CapturableTransport::local, SavePolicy::rows_and_preactivation);
  graph_replays(CapturableTransport::local, SavePolicy::rows_recompute);
}

TEST_F(CapturableBackwardGpu, SlotsGraphReplaysAtEveryTokenCount) {
  graph_replays(CapturableTransport::slots, SavePolicy::rows_and_preactivation);
  graph_replays(CapturableTransport::slots, SavePolicy::rows_recompute);
}

// bf16 gradients, and accumulate: the second backward adds the same gradient onto the first's.
TEST_F(CapturableBackwardGpu, Bf16GradientsAndAccumulate) {
  Rank rk(1, 0, single_comm(), CapturableTransport::local, SavePolicy::rows_and_preactivation, DType::bf16);
  const EpCase c = make_case(1, {57}, RoutingKind::zipf, 5);
  rk.upload(c);
  rk.forward();
  rk.backward();
  ck(cudaStreamSynchronize(rk.stream), "sync");
  EXPECT_EQ(rk.check(c, reference_local(c)), "");
  const std::vector<float> once1 = rk.widen(rk.dw1), once2 = rk.widen(rk.dw2);
  rk.backward(/*accumulate=*/true);
  ck(cudaStreamSynchronize(rk.stream), "sync");
  const std::vector<float> twice1 = rk.widen(rk.dw1), twice2 = rk.widen(rk.dw2);
  // bf16(a + a) = 2a exactly when the accumulating epilogue adds the fp32 sum to the bf16 value a.
  size_t off = 0;
  for (size_t i = 0; i < once1.size(); ++i) off += twice1[i] != 2 * once1[i];
  for (size_t i = 0; i < once2.size(); ++i) off += twice2[i] != 2 * once2[i];
  EXPECT_EQ(off, 0u) << "accumulate: dW after two backwards must be twice one backward's";
}

// World 2 on device mock ranks (threads on one GPU, the slots transport), different T per rank.
TEST_F(CapturableBackwardGpu, SlotsAcrossDeviceMockRanks) {
  const int W = 2, dev = current_device();
  const EpCase c = make_case(W, {33, 80}, RoutingKind::zipf, 2);
  run_device_mock_ranks(W, dev, [&](int r, std::shared_ptr<Communicator> comm) {
    Rank rk(W, r, std::move(comm), CapturableTransport::automatic, SavePolicy::rows_recompute);
    rk.upload(c);
    rk.forward();
    rk.backward();
    ck(cudaStreamSynchronize(rk.stream), "sync");
    std::string why = rk.check(c, reference_grads(c, r));
    rk.layer->check_capturable(rk.stream);
    return why;
  });
}

template <class F>
void expect_error(ErrorCode code, const std::string& part, F&& f) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing '" << part << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST_F(CapturableBackwardGpu, HostErrors) {
  Rank rk(1, 0, single_comm(), CapturableTransport::local, SavePolicy::rows_and_preactivation);
  rk.upload(make_case(1, {9}, RoutingKind::uniform, 1));
  // No saving forward yet, then a non-saving one after a saving one.
  expect_error(ErrorCode::invalid_argument, "did not save", [&] { rk.backward(); });
  rk.forward(true);
  rk.forward(false);
  expect_error(ErrorCode::invalid_argument, "did not save", [&] { rk.backward(); });
  // Other x or ids buffers than the saving forward's.
  rk.forward(true);
  Dev<bf16> other(size_t(kN) * kHidden);
  expect_error(ErrorCode::invalid_argument, "saving forward's buffers", [&] {
    rk.layer->backward_capturable(dview(other.get(), DType::bf16, {kN, kHidden}), dview(rk.ids.get(), DType::i32, {kN, kK}),
                                  dview(rk.dy.get(), DType::bf16, {kN, kHidden}),
                                  dview(rk.dx.get(), DType::bf16, {kN, kHidden}), dview(rk.dwts.get(), DType::f32, {kN, kK}),
                                  rk.grads(), rk.num_tokens.get(), rk.stream);
  });
  // A bad dy shape.
  expect_error(ErrorCode::invalid_argument, "dy", [&] {
    rk.layer->backward_capturable(dview(rk.x.get(), DType::bf16, {kN, kHidden}), dview(rk.ids.get(), DType::i32, {kN, kK}),
                                  dview(rk.dy.get(), DType::bf16, {kN - 1, kHidden}),
                                  dview(rk.dx.get(), DType::bf16, {kN, kHidden}), dview(rk.dwts.get(), DType::f32, {kN, kK}),
                                  rk.grads(), rk.num_tokens.get(), rk.stream);
  });
  rk.backward();  // still works after the refusals
  ck(cudaStreamSynchronize(rk.stream), "sync");
  const EpCase c9 = make_case(1, {9}, RoutingKind::uniform, 1);
  EXPECT_EQ(rk.check(c9, reference_local(c9)), "");

  // The first saving forward of a layer under capture: refused (it sizes buffers).
  Rank fresh(1, 0, single_comm(), CapturableTransport::local, SavePolicy::rows_recompute);
  ck(cudaStreamBeginCapture(fresh.stream, cudaStreamCaptureModeThreadLocal), "begin capture");
  expect_error(ErrorCode::invalid_argument, "cannot be captured", [&] { fresh.forward(true); });
  cudaGraph_t g = nullptr;
  cudaStreamEndCapture(fresh.stream, &g);
  if (g) cudaGraphDestroy(g);
  (void)cudaGetLastError();

  // Dims the dgrad / wgrad tiles do not take (ffn 384 = 1.5 x 256): the forward still runs, saving refused.
  const MoeConfig cfg{.num_experts = 4, .top_k = 2, .hidden = 256, .ffn = 384, .world_size = 1, .rank = 0};
  Dev<bf16> w1(size_t(4) * 2 * 384 * 256), w2(size_t(4) * 256 * 384);
  LayerOptions opt;
  opt.expert_path = ExpertPath::sm90;
  opt.max_tokens_per_rank = 8;
  MoeLayer odd(cfg, {dview(w1.get(), DType::bf16, {4, 768, 256}), dview(w2.get(), DType::bf16, {4, 256, 384})},
               single_comm(), opt);
  Dev<bf16> x(size_t(8) * 256), y(size_t(8) * 256);
  Dev<int32_t> ids(std::vector<int32_t>(16, 0));
  Dev<float> wts(std::vector<float>(16, 0.5f));
  expect_error(ErrorCode::unsupported, "multiples of 256", [&] {
    odd.forward_capturable(dview(x.get(), DType::bf16, {8, 256}), dview(ids.get(), DType::i32, {8, 2}),
                           dview(wts.get(), DType::f32, {8, 2}), dview(y.get(), DType::bf16, {8, 256}),
                           rk.num_tokens.get(), rk.stream, /*save=*/true);
  });
}

}  // namespace
}  // namespace epmoe::test
