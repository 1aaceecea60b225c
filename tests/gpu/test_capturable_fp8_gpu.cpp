// The FP8 layers' capturable forward on one GPU: MoeLayer::forward_capturable with MXFP8 weights (the
// heuristics' form for the capacity, and the fused and tile forms forced) and with FP8 block-128
// weights (its tile form), both transports (local, and the slots all-to-alls over the single-rank
// NCCL communicator). One CUDA graph per layer, captured once and replayed at T in {0, 1, 2, 8, 33,
// 65, N} with fresh inputs each time (x quantized on the device from its first num_tokens rows),
// against the format's exact fp64 reference (tests/fp8_model.h), for uniform, skewed and dropped
// routing; rows past T must come back exactly 0 and routing rows past T (bad ids) must be ignored.
// A bad id: its token's row NaN (local) or the rank's rows (slots), check_capturable throwing it; a
// num_tokens outside [0, N]: every row NaN. x given in MXFP8 (forward_capturable_mxfp8): bitwise the
// quantizing graph's y, its rows past T (NaN bytes) never read.
// Refused: a saving forward, the capturable backward, deterministic, x given in MXFP8 to a block-128
// layer or misaligned. Then world 2 on device mock
// ranks (threads on one GPU): the slots carry packed FP8 rows between ranks with different T.
// Skips without an sm_90a device.
//
// Tolerance: test_mxfp8_gpu's kMxGpuTolerance and its reasoning (the act requantization on the GPU
// can cross an E4M3 rounding boundary that the fp64 reference does not, moving a row by one E4M3
// step of one act element times w2; measured worst element 2^-4.1 of the RMS, bound 2^-2).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "comm/mock_comm.h"
#include "epmoe/error.h"
#include "epmoe/moe_layer.h"
#include "epmoe/mxfp8.h"
#include "fp8_model.h"
#include "kernels/sm90/experts.cuh"
#include "test_support.h"

#include "capturable_support.h"
#include "device_array.h"
#include "single_comm.h"

namespace epmoe::test {
namespace {

constexpr Tolerance kMxGpuTolerance{1.0 / 32, 1.0 / 4, 1e-2};

constexpr int kE = 16, kK = 4, kHidden = 1024, kFfn = 256;
constexpr int64_t kN = 80;  // the capture's rows (= max_tokens_per_rank)

class CapturableFp8Gpu : public CapturableSuite {};

const char* layout_name(Fp8Layout l) { return l == Fp8Layout::mxfp8 ? "MXFP8" : "block-128"; }

// A host-quantized model (Fp8Model) with its E4M3 weights and scale bytes on the device.
struct DeviceFp8Model {
  Fp8Model q;
  Dev<uint8_t> w1, w2, s1, s2;
  static std::vector<uint8_t> bytes(const std::vector<float>& f) {
    std::vector<uint8_t> b(f.size() * 4);
    std::memcpy(b.data(), f.data(), b.size());
    return b;
  }
  DeviceFp8Model(Fp8Layout layout, uint64_t seed)
      : q(quantize_model(make_weights(kE, kHidden, kFfn, seed), layout)),
        w1(q.w1),
        w2(q.w2),
        s1(layout == Fp8Layout::mxfp8 ? q.w1s_e8m0 : bytes(q.w1s_f32)),
        s2(layout == Fp8Layout::mxfp8 ? q.w2s_e8m0 : bytes(q.w2s_f32)) {}
  // Rank r's experts of a world of W, as device views (Fp8Model::shard's shapes, device pointers).
  ExpertWeights shard(int W, int r) const {
    const ExpertWeights h = q.shard(W, r);
    auto at = [](const Dev<uint8_t>& d, const std::vector<uint8_t>& base, const TensorView& v) {
      return d.get() + (static_cast<const uint8_t*>(v.data) - base.data());
    };
    const int64_t El = kE / W, H = kHidden, F = kFfn;
    ExpertWeights w{dview(at(w1, q.w1, h.w1), DType::e4m3, {El, 2 * F, H}),
                    dview(at(w2, q.w2, h.w2), DType::e4m3, {El, H, F})};
    if (q.layout == Fp8Layout::mxfp8) {
      w.w1_scale = dview(s1.get() + (static_cast<const uint8_t*>(h.w1_scale.data) - q.w1s_e8m0.data()), DType::e8m0,
                         {El, 2 * F, H / 32});
      w.w2_scale = dview(s2.get() + (static_cast<const uint8_t*>(h.w2_scale.data) - q.w2s_e8m0.data()), DType::e8m0,
                         {El, H, F / 32});
    } else {
      const size_t o1 = size_t(static_cast<const float*>(h.w1_scale.data) - q.w1s_f32.data()) * 4;
      const size_t o2 = size_t(static_cast<const float*>(h.w2_scale.data) - q.w2s_f32.data()) * 4;
      w.w1_scale = dview(s1.get() + o1, DType::f32, {El, 2 * F / 128, H / 128});
      w.w2_scale = dview(s2.get() + o2, DType::f32, {El, H / 128, F / 128});
    }
    return w;
  }
  std::vector<float> reference(const std::vector<bf16>& x, const Routing& R, int64_t T) const {
    std::vector<float> ref(size_t(T) * kHidden);
    q.reference(x.data(), R.ids.data(), R.weights.data(), T, kK, ref.data());
    return ref;
  }
};

// One rank's capturable layer and its N-row device inputs.
struct CapLayer {
  MoeConfig cfg;
  Dev<bf16> x{size_t(kN) * kHidden};
  Dev<int32_t> ids{size_t(kN) * kK};
  Dev<float> wts{size_t(kN) * kK};
  Dev<bf16> y{size_t(kN) * kHidden};
  Dev<int64_t> num_tokens{1};
  Dev<uint8_t> xq{size_t(kN) * kHidden}, xs{size_t(kN) * kHidden / 32};  // x given in MXFP8
  cudaStream_t stream = nullptr;
  std::unique_ptr<MoeLayer> layer;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;

  CapLayer(const DeviceFp8Model& m, CapturableTransport transport, const char* plan, int W = 1, int r = 0,
           std::shared_ptr<Communicator> comm = nullptr)
      : cfg{.num_experts = kE, .top_k = kK, .hidden = kHidden, .ffn = kFfn, .world_size = W, .rank = r} {
    ck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    LayerOptions opt;
    opt.sm90_plan = parse_sm90_plan_override(plan);
    opt.max_tokens_per_rank = kN;
    opt.capturable_transport = transport;
    layer = std::make_unique<MoeLayer>(cfg, m.shard(W, r), comm ? comm : single_comm(), opt);
  }
  ~CapLayer() {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
  }
  void forward(bool save = false) {
    layer->forward_capturable(dview(x.get(), DType::bf16, {kN, kHidden}), dview(ids.get(), DType::i32, {kN, kK}),
                              dview(wts.get(), DType::f32, {kN, kK}), dview(y.get(), DType::bf16, {kN, kHidden}),
                              num_tokens.get(), stream, save);
  }
  // forward_capturable_mxfp8 on xq / xs (byte offset `misalign` into xs: the refusal test's).
  void forward_given(size_t misalign = 0) {
    layer->forward_capturable_mxfp8(dview(xq.get(), DType::e4m3, {kN, kHidden}),
                                    dview(xs.get() + misalign, DType::e8m0, {kN, kHidden / 32}),
                                    dview(ids.get(), DType::i32, {kN, kK}), dview(wts.get(), DType::f32, {kN, kK}),
                                    dview(y.get(), DType::bf16, {kN, kHidden}), num_tokens.get(), stream);
  }
  void capture(bool given = false) {
    ck(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
    if (given) forward_given();
    else forward();
    ck(cudaStreamEndCapture(stream, &graph), "end capture");
    ck(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  }
  // Fresh inputs: T real tokens; the rest of the N rows finite x and ids that would fail if read. y poisoned (NaN).
  void upload(int64_t T, const std::vector<bf16>& hx, const Routing& R) {
    std::vector<bf16> xa = make_x(77, 0, kN, kHidden);
    std::copy(hx.begin(), hx.end(), xa.begin());
    std::vector<int32_t> ia(size_t(kN) * kK, kE + 1000);
    std::vector<float> wa(size_t(kN) * kK, 1.f);
    std::copy(R.ids.begin(), R.ids.end(), ia.begin());
    std::copy(R.weights.begin(), R.weights.end(), wa.begin());
    ck(cudaMemcpyAsync(x.get(), xa.data(), xa.size() * 2, cudaMemcpyHostToDevice, stream), "x");
    ck(cudaMemcpyAsync(ids.get(), ia.data(), ia.size() * 4, cudaMemcpyHostToDevice, stream), "ids");
    ck(cudaMemcpyAsync(wts.get(), wa.data(), wa.size() * 4, cudaMemcpyHostToDevice, stream), "w");
    ck(cudaMemcpyAsync(num_tokens.get(), &T, 8, cudaMemcpyHostToDevice, stream), "T");
    ck(cudaMemsetAsync(y.get(), 0xff, size_t(kN) * kHidden * 2, stream), "poison y");
    ck(cudaStreamSynchronize(stream), "sync");
  }
  std::vector<bf16> replay() {
    ck(cudaGraphLaunch(exec, stream), "replay");
    ck(cudaStreamSynchronize(stream), "sync");
    return y.host();
  }
};

// Rows [from, kN) of y are exactly 0.
::testing::AssertionResult rows_zero(const std::vector<bf16>& y, int64_t from) {
  return epmoe::test::rows_zero(y, from, kN, kHidden);
}

// Every (transport, form) layer of one format captured once, then each (routing, T) input replayed
// through all of them against one reference.
void graph_replays(Fp8Layout layout) {
  SCOPED_TRACE(layout_name(layout));
  const DeviceFp8Model m(layout, 2026);
  const std::vector<const char*> plans =
      layout == Fp8Layout::mxfp8 ? std::vector<const char*>{"", "fused=on", "swap=off"} : std::vector<const char*>{""};
  std::vector<std::unique_ptr<CapLayer>> layers;
  std::vector<std::string> names;
  for (CapturableTransport t : kTransports)
    for (const char* plan : plans) {
      layers.push_back(std::make_unique<CapLayer>(m, t, plan));
      layers.back()->capture();
      names.push_back(std::string(transport_name(t)) + " '" + plan + "'");
    }
  int round = 0, replays = 0, bad = 0;
  for (RoutingKind kind : {RoutingKind::uniform, RoutingKind::zipf, RoutingKind::with_drops})
    for (int64_t T : {int64_t(0), int64_t(1), int64_t(2), int64_t(8), int64_t(33), int64_t(65), kN}) {
      const std::vector<bf16> hx = make_x(mix(11, T, ++round), 0, T, kHidden);
      const Routing R = make_routing(T, kE, kK, kind, mix(13, T, round), 0, 1);
      const std::vector<float> ref = m.reference(hx, R, T);
      for (size_t i = 0; i < layers.size(); ++i) {
        SCOPED_TRACE(names[i] + " " + routing_name(kind) + " T=" + std::to_string(T));
        layers[i]->upload(T, hx, R);
        const std::vector<bf16> y = layers[i]->replay();
        const auto close = close_to_reference(y.data(), ref.data(), T, kHidden, kMxGpuTolerance);
        const auto zero = rows_zero(y, T);
        EXPECT_TRUE(close);
        EXPECT_TRUE(zero);
        EXPECT_NO_THROW(layers[i]->layer->check_capturable(layers[i]->stream));
        ++replays;
        bad += !(close && zero);
      }
    }
  matrix_row(std::string("FP8 capturable forward, ") + layout_name(layout) + ": " + std::to_string(layers.size()) +
                 " graphs (local / slots x forms) replayed at T 0.." + std::to_string(kN) + ", 3 routings (1 GPU)",
             "every replay within kMxGpuTolerance of the format's reference, rows past T zero",
             std::to_string(replays - bad) + " of " + std::to_string(replays) + " replays right");
}

TEST_F(CapturableFp8Gpu, MxGraphReplaysAtEveryTokenCount) { graph_replays(Fp8Layout::mxfp8); }
TEST_F(CapturableFp8Gpu, BlockGraphReplaysAtEveryTokenCount) { graph_replays(Fp8Layout::block128); }

// x given in MXFP8: two layers of the same weights and form, one graph on bf16 x (quantized on the
// device), one on x as E4M3 + E8M0 rows (the host quantizer's, mx::quantize_rows, bit-exact with
// the device's), replayed on each input; xq / xs rows past T hold 0xFF (NaN in both formats) and
// must not be read. Both graphs then feed UP the same bytes, so y differs only by the order of the
// DOWN's bf16 atomic adds of a token's k = 4 expert rows: k - 1 roundings of 2^-9 of a partial sum,
// bounded here by 2^-5 of the row's largest |y| (partials can exceed the sum where terms cancel); a
// wrong or NaN-read row is off by O(1). Also each y within kMxGpuTolerance of the format's reference.
TEST_F(CapturableFp8Gpu, GivenMxfp8XMatchesTheQuantizingGraph) {
  const DeviceFp8Model m(Fp8Layout::mxfp8, 2030);
  int replays = 0, same = 0, bitwise_same = 0;
  for (CapturableTransport t : kTransports)
    for (const char* plan : {"", "fused=on", "swap=off"}) {
      SCOPED_TRACE(std::string(transport_name(t)) + " '" + plan + "'");
      CapLayer quantizing(m, t, plan);
      quantizing.capture();
      CapLayer given(m, t, plan);  // (its own layer: a graph per layer, as in graph_replays)
      given.capture(/*given=*/true);
      for (RoutingKind kind : {RoutingKind::uniform, RoutingKind::with_drops})
        for (int64_t T : {int64_t(0), int64_t(1), int64_t(5), int64_t(33), kN}) {
          SCOPED_TRACE(std::string(routing_name(kind)) + " T=" + std::to_string(T));
          const std::vector<bf16> hx = make_x(mix(61, T, int(kind)), 0, T, kHidden);
          const Routing R = make_routing(T, kE, kK, kind, mix(67, T, int(kind)), 0, 1);
          std::vector<uint8_t> q(size_t(kN) * kHidden, 0xFF), s(size_t(kN) * kHidden / 32, 0xFF);
          mx::quantize_rows(hx.data(), T, kHidden, q.data(), s.data());
          quantizing.upload(T, hx, R);
          given.upload(T, hx, R);
          ck(cudaMemcpy(given.xq.get(), q.data(), q.size(), cudaMemcpyHostToDevice), "xq");
          ck(cudaMemcpy(given.xs.get(), s.data(), s.size(), cudaMemcpyHostToDevice), "xs");
          const std::vector<bf16> ya = quantizing.replay(), yb = given.replay();
          int64_t off = 0;
          for (int64_t r = 0; r < T; ++r) {
            const bf16* a = &ya[size_t(r) * kHidden];
            const bf16* b = &yb[size_t(r) * kHidden];
            float row_max = 0.f;
            for (int c = 0; c < kHidden; ++c) row_max = std::max(row_max, std::fabs(a[c].f()));
            for (int c = 0; c < kHidden; ++c) off += !(std::fabs(a[c].f() - b[c].f()) <= row_max / 32);  // (NaN: off)
          }
          EXPECT_EQ(off, 0) << "elements of y off the quantizing graph's by more than 2^-5 of their row's max";
          const auto close = close_to_reference(yb.data(), m.reference(hx, R, T).data(), T, kHidden, kMxGpuTolerance);
          EXPECT_TRUE(close);
          EXPECT_TRUE(rows_zero(yb, T));
          EXPECT_NO_THROW(given.layer->check_capturable(given.stream));
          ++replays;
          same += off == 0 && bool(close);
          bitwise_same += std::memcmp(ya.data(), yb.data(), ya.size() * sizeof(bf16)) == 0;
        }
    }
  matrix_row("FP8 capturable forward, x given in MXFP8: 6 graphs (local / slots x forms) at T 0.." +
                 std::to_string(kN) + ", 2 routings (1 GPU)",
             "y within 2^-5 of its row's max of the quantizing graph's (atomic order) and kMxGpuTolerance of "
             "the reference; rows past T (NaN bytes) not read",
             std::to_string(same) + " of " + std::to_string(replays) + " replays right (" + std::to_string(bitwise_same) +
                 " bitwise equal)");
}

// A bad id: local, its token's row NaN and the others right; slots, every row of the rank NaN (its
// layout fails whole). check_capturable throws it once. A bad num_tokens: every row NaN.
TEST_F(CapturableFp8Gpu, BadIdsPoisonTheirRowsAndAreReported) {
  const DeviceFp8Model m(Fp8Layout::mxfp8, 2027);
  for (CapturableTransport t : kTransports) {
    SCOPED_TRACE(transport_name(t));
    CapLayer f(m, t, "");
    const int64_t T = 12, bad_t = 5;
    const std::vector<bf16> hx = make_x(29, 0, T, kHidden);
    Routing R = make_routing(T, kE, kK, RoutingKind::uniform, 31, 0, 1);
    R.ids[size_t(bad_t) * kK + 1] = kE + 5;
    Routing Rref = R;
    for (int j = 0; j < kK; ++j) Rref.ids[size_t(bad_t) * kK + j] = -1;
    f.upload(T, hx, R);
    f.forward();
    ck(cudaStreamSynchronize(f.stream), "sync");
    const std::vector<bf16> y = f.y.host();
    const std::vector<float> ref = m.reference(hx, Rref, T);
    for (int64_t tok = 0; tok < T; ++tok) {
      if (t == CapturableTransport::slots || tok == bad_t) {
        for (int c = 0; c < kHidden; ++c)
          ASSERT_TRUE(is_nan(y[size_t(tok) * kHidden + c])) << "row " << tok << " col " << c;
      } else {
        EXPECT_TRUE(close_to_reference(y.data() + tok * kHidden, ref.data() + tok * kHidden, 1, kHidden,
                                       kMxGpuTolerance))
            << "row " << tok;
      }
    }
    EXPECT_TRUE(rows_zero(y, T));
    try {
      f.layer->check_capturable(f.stream);
      ADD_FAILURE() << "check_capturable did not throw";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::expert_id_out_of_range) << e.what();
      EXPECT_NE(std::string(e.what()).find("token 5 slot 1"), std::string::npos) << e.what();
    }
    EXPECT_NO_THROW(f.layer->check_capturable(f.stream)) << "the record is cleared once thrown";
    // num_tokens outside [0, N]: every row NaN, and invalid_argument.
    for (int64_t bad_T : {kN + 1, int64_t(-3)}) {
      SCOPED_TRACE("num_tokens " + std::to_string(bad_T));
      f.upload(kN, make_x(47, 0, kN, kHidden), make_routing(kN, kE, kK, RoutingKind::uniform, 43, 0, 1));
      ck(cudaMemcpy(f.num_tokens.get(), &bad_T, 8, cudaMemcpyHostToDevice), "T");
      ck(cudaDeviceSynchronize(), "T sync");
      f.forward();
      ck(cudaStreamSynchronize(f.stream), "sync");
      const std::vector<bf16> yb = f.y.host();
      for (size_t i = 0; i < yb.size(); ++i) ASSERT_TRUE(is_nan(yb[i])) << "element " << i;
      try {
        f.layer->check_capturable(f.stream);
        ADD_FAILURE() << "check_capturable did not throw";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
      }
    }
  }
}

// Forward-only: a saving capturable forward and the capturable backward are refused (unsupported,
// saying so) before any work is queued; deterministic is refused at construction.
TEST_F(CapturableFp8Gpu, RefusesWhatAnFp8LayerDoesNotRun) {
  for (Fp8Layout layout : {Fp8Layout::mxfp8, Fp8Layout::block128}) {
    SCOPED_TRACE(layout_name(layout));
    const DeviceFp8Model m(layout, 2028);
    CapLayer f(m, CapturableTransport::local, "");
    f.upload(3, make_x(5, 0, 3, kHidden), make_routing(3, kE, kK, RoutingKind::uniform, 6, 0, 1));
    try {
      f.forward(/*save=*/true);
      ADD_FAILURE() << "a saving capturable forward was taken";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::unsupported) << e.what();
      EXPECT_NE(std::string(e.what()).find("forward-only"), std::string::npos) << e.what();
    }
    Dev<bf16> dy(size_t(kN) * kHidden), dx(size_t(kN) * kHidden);
    Dev<float> dw(size_t(kN) * kK);
    try {
      f.layer->backward_capturable(dview(f.x.get(), DType::bf16, {kN, kHidden}),
                                   dview(f.ids.get(), DType::i32, {kN, kK}), dview(dy.get(), DType::bf16, {kN, kHidden}),
                                   dview(dx.get(), DType::bf16, {kN, kHidden}), dview(dw.get(), DType::f32, {kN, kK}),
                                   ExpertGradients{}, f.num_tokens.get(), f.stream);
      ADD_FAILURE() << "the capturable backward was taken";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::unsupported) << e.what();
      EXPECT_NE(std::string(e.what()).find("forward-only"), std::string::npos) << e.what();
    }
    // x given in MXFP8: a block-128 layer refuses it; an MXFP8 one refuses misaligned scales.
    try {
      f.forward_given(layout == Fp8Layout::mxfp8 ? 1 : 0);
      ADD_FAILURE() << "forward_capturable_mxfp8 was taken";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), layout == Fp8Layout::mxfp8 ? ErrorCode::invalid_argument : ErrorCode::unsupported)
          << e.what();
      EXPECT_NE(std::string(e.what()).find(layout == Fp8Layout::mxfp8 ? "aligned" : "needs an MXFP8 layer"),
                std::string::npos)
          << e.what();
    }
    // The layer still runs after the refusals.
    f.forward();
    ck(cudaStreamSynchronize(f.stream), "sync");
    EXPECT_NO_THROW(f.layer->check_capturable(f.stream));
    LayerOptions det;
    det.max_tokens_per_rank = kN;
    det.deterministic = true;
    EXPECT_THROW(MoeLayer(f.cfg, m.shard(1, 0), single_comm(), det), Error);
  }
}

// World 2 on device mock ranks: each rank its thread, stream, expert shard and T; the slots carry
// its packed FP8 rows to the other rank and the combine brings the rows back. Each rank's y against
// the whole model's reference for its tokens.
TEST_F(CapturableFp8Gpu, SlotsAcrossDeviceMockRanks) {
  const int dev = current_device();
  constexpr int W = 2;
  for (Fp8Layout layout : {Fp8Layout::mxfp8, Fp8Layout::block128}) {
    SCOPED_TRACE(layout_name(layout));
    const DeviceFp8Model m(layout, 2029);
    const int64_t Ts[W] = {33, 1};
    run_device_mock_ranks(W, dev, [&](int r, std::shared_ptr<Communicator> comm) {
      CapLayer f(m, CapturableTransport::slots, "", W, r, std::move(comm));
      std::string why;
      for (int round = 0; round < 2; ++round) {  // (the second on the buffers the first used)
        const int64_t T = round == 0 ? Ts[r] : Ts[W - 1 - r];
        const std::vector<bf16> hx = make_x(mix(51, r, round), 0, T, kHidden);
        const Routing R =
            make_routing(T, kE, kK, round ? RoutingKind::uniform : RoutingKind::zipf, mix(53, r, round), 0, 1);
        f.upload(T, hx, R);
        f.forward();
        ck(cudaStreamSynchronize(f.stream), "sync");
        const std::vector<bf16> y = f.y.host();
        const std::vector<float> ref = m.reference(hx, R, T);
        if (auto ok = close_to_reference(y.data(), ref.data(), T, kHidden, kMxGpuTolerance); !ok)
          why += "round " + std::to_string(round) + ": " + ok.message() + "; ";
        if (auto z = rows_zero(y, T); !z) why += "round " + std::to_string(round) + ": " + z.message() + "; ";
        f.layer->check_capturable(f.stream);
      }
      return why;
    });
  }
}

}  // namespace
}  // namespace epmoe::test
