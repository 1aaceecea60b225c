// The whole layer on one GPU (NCCL single-rank communicator): MoeLayer::forward against the dense
// reference (epmoe::reference_moe) for every routing shape, both expert paths (cuBLAS always, sm90
// where supported), hidden 2048 and 7168, T = 0, repeated calls on reused buffers, bad ids, the
// inspection hook, phase times, and one case past 2^31 elements (64-bit offsets).
// Skips without a CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "epmoe/error.h"
#include "epmoe/moe_layer.h"
#include "epmoe/nccl_communicator.h"
#include "epmoe/reference.h"
#include "epmoe/sm90_plan.h"
#include "kernels/sm90/experts.cuh"
#include "test_support.h"

#include "device_array.h"
#include "single_comm.h"

namespace epmoe::test {
namespace {

// Tolerance of the GPU paths against the fp64 reference. On top of the CPU path's roundings
// (activation to bf16, the final bf16 output; see kCpuTolerance) the device rounds more often:
//  * cuBLAS path: gate/up and down GEMM outputs are stored as bf16 (cublasGemmGroupedBatchedEx is
//    bf16 -> bf16), <= 2^-9 relative each, before silu*up and before the weighting;
//  * both paths reduce a token's experts into its combine row with bf16 atomics: each of the <= k
//    additions rounds the partial sum (<= 2^-9 of it; a partial can exceed the final value when
//    terms cancel, so this is relative to the output's scale, not to the element); the sm90 path's
//    split-K adds a few more such roundings per expert.
// Hence elementwise 2^-5 relative plus 2^-5 of the output RMS, and 1e-2 relative L2, which is
// ~2-3x the noise these roundings produce for k <= 8 (they are independent across elements).
constexpr Tolerance kGpuTolerance{1.0 / 32, 1.0 / 32, 1e-2};


class ForwardGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!cuda_available(why)) GTEST_SKIP() << why;
  }
  static void TearDownTestSuite() { release_single_comm(); }
};

std::vector<ExpertPath> paths_here() {
  std::vector<ExpertPath> p = {ExpertPath::cublas};
  int dev = 0;
  ck(cudaGetDevice(&dev), "cudaGetDevice");
  if (kernels::sm90_experts_supported(dev)) p.push_back(ExpertPath::sm90);
  return p;
}

const char* path_str(ExpertPath p) { return p == ExpertPath::sm90 ? "sm90" : p == ExpertPath::cublas ? "cublas" : "?"; }

// One model (all experts on this rank) on the device.
struct Model {
  MoeConfig cfg;
  ModelWeights M;
  std::unique_ptr<Dev<bf16>> w1, w2;
  Model(int E, int k, int hidden, int ffn, uint64_t seed)
      : cfg{.num_experts = E, .top_k = k, .hidden = hidden, .ffn = ffn, .world_size = 1, .rank = 0},
        M(make_weights(E, hidden, ffn, seed)) {
    w1 = std::make_unique<Dev<bf16>>(M.w1);
    w2 = std::make_unique<Dev<bf16>>(M.w2);
  }
  ExpertWeights weights() const {
    int dev = 0;
    ck(cudaGetDevice(&dev), "cudaGetDevice");
    return {TensorView::contiguous(w1->get(), DType::bf16, {cfg.num_experts, 2 * int64_t(cfg.ffn), cfg.hidden},
                                   DeviceType::cuda, dev),
            TensorView::contiguous(w2->get(), DType::bf16, {cfg.num_experts, int64_t(cfg.hidden), cfg.ffn},
                                   DeviceType::cuda, dev)};
  }
};

struct Inputs {
  int64_t T = 0;
  std::vector<bf16> x;
  Routing R;
};

// Runs forward on the device with y poisoned (NaN bits), returns y on the host.
std::vector<bf16> run_forward(MoeLayer& layer, const Inputs& in, cudaStream_t stream) {
  const MoeConfig& cfg = layer.config();
  int dev = 0;
  ck(cudaGetDevice(&dev), "cudaGetDevice");
  Dev<bf16> x(in.x);
  Dev<int32_t> ids(in.R.ids);
  Dev<float> w(in.R.weights);
  Dev<bf16> y(size_t(in.T) * cfg.hidden, 0xff);  // 0xffff: NaN, so an unwritten element fails
  layer.forward(TensorView::contiguous(x.get(), DType::bf16, {in.T, cfg.hidden}, DeviceType::cuda, dev),
                TensorView::contiguous(ids.get(), DType::i32, {in.T, cfg.top_k}, DeviceType::cuda, dev),
                TensorView::contiguous(w.get(), DType::f32, {in.T, cfg.top_k}, DeviceType::cuda, dev),
                TensorView::contiguous(y.get(), DType::bf16, {in.T, cfg.hidden}, DeviceType::cuda, dev), stream);
  ck(cudaStreamSynchronize(stream), "sync");
  return y.host();
}

std::vector<float> reference(const Model& m, const Inputs& in) {
  std::vector<float> ref(size_t(in.T) * m.cfg.hidden);
  reference_moe(in.x.data(), in.R.ids.data(), in.R.weights.data(), in.T, m.cfg.top_k, m.M.w1.data(), m.M.w2.data(),
                m.cfg.num_experts, m.cfg.hidden, m.cfg.ffn, ref.data());
  return ref;
}

int64_t dedup_rows(const Routing& R, int64_t T, int k) {  // world 1: tokens with >= 1 expert
  int64_t n = 0;
  for (int64_t t = 0; t < T; ++t)
    n += std::any_of(R.ids.begin() + t * k, R.ids.begin() + (t + 1) * k, [](int32_t e) { return e >= 0; });
  return n;
}

struct Case {
  int E, k, hidden, ffn;
  int64_t T;
  RoutingKind kind;
  int focus = 0;
};

void run_case(const Case& c) {
  Model m(c.E, c.k, c.hidden, c.ffn, mix(c.E, c.hidden, c.ffn));
  Inputs in;
  in.T = c.T;
  in.x = make_x(mix(3, c.T), 0, c.T, c.hidden);
  in.R = make_routing(c.T, c.E, c.k, c.kind, mix(5, c.T, c.E), c.focus, 1);
  const std::vector<float> ref = reference(m, in);
  cudaStream_t stream;
  ck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  for (ExpertPath path : paths_here()) {
    std::ostringstream tag;
    tag << "E=" << c.E << " k=" << c.k << " hidden=" << c.hidden << " ffn=" << c.ffn << " T=" << c.T << " "
        << routing_name(c.kind) << " path=" << path_str(path);
    SCOPED_TRACE(tag.str());
    LayerOptions opt;
    opt.expert_path = path;
    MoeLayer layer(m.cfg, m.weights(), single_comm(), opt);
    ASSERT_EQ(layer.expert_path(), path);
    const std::vector<bf16> y = run_forward(layer, in, stream);
    EXPECT_TRUE(close_to_reference(y.data(), ref.data(), c.T, c.hidden, kGpuTolerance));
    const ForwardStats& s = layer.last_stats();
    const int64_t rows = dedup_rows(in.R, c.T, c.k);
    ASSERT_EQ(s.send_rows.size(), 1u);
    EXPECT_EQ(s.tokens, c.T);
    EXPECT_EQ(s.send_rows[0], rows) << "one row per token with at least one expert";
    EXPECT_EQ(s.recv_rows[0], rows);
    EXPECT_EQ(s.dispatch_bytes, rows * (c.hidden * 2 + 4 * (1 + 2 * c.k)));
    EXPECT_EQ(s.combine_bytes, rows * c.hidden * 2);
    int64_t pairs = 0;
    for (int32_t e : in.R.ids) pairs += e >= 0;
    EXPECT_EQ(s.expert_pairs, pairs);
  }
  ck(cudaStreamDestroy(stream), "stream destroy");
}

TEST_F(ForwardGpu, Hidden2048AllRoutings) {
  for (RoutingKind kind : {RoutingKind::uniform, RoutingKind::zipf, RoutingKind::one_expert, RoutingKind::with_drops,
                           RoutingKind::all_dropped})
    run_case({16, 4, 2048, 256, 300, kind, 5});
}

TEST_F(ForwardGpu, Hidden7168) {
  run_case({8, 4, 7168, 256, 96, RoutingKind::zipf});
  run_case({8, 2, 7168, 128, 64, RoutingKind::with_drops});
}

// The smallest hidden the GPU engine takes (one 128-column block: half of DOWN's 256-column tile)
// and an ffn much wider than hidden, at a few hundred tokens, on every path.
TEST_F(ForwardGpu, SmallestHiddenAndWideFfn) {
  run_case({8, 8, 128, 7168, 300, RoutingKind::uniform});
  run_case({8, 2, 128, 256, 200, RoutingKind::zipf});
  run_case({8, 8, 256, 7168, 300, RoutingKind::uniform});
  run_case({8, 8, 7168, 128, 300, RoutingKind::uniform});
}

TEST_F(ForwardGpu, SmallAndEmpty) {
  run_case({16, 4, 2048, 256, 0, RoutingKind::uniform});
  run_case({16, 4, 2048, 256, 1, RoutingKind::uniform});
  run_case({16, 4, 2048, 256, 1, RoutingKind::all_dropped});
  run_case({32, 8, 2048, 128, 3, RoutingKind::uniform});  // every expert segment mostly padding
}

// The sm_90 path on non-default plans, forced through LayerOptions::sm90_plan (each spec sets every
// field its forms need, so it is valid whatever the default for the forward's rows): single CTAs by
// expert with both splits (split_ctas=1: every expert the split rule picks goes to the 192-row
// kernels) and padding halves, and the cluster forms in the global order without the tail split.
// An override the layer's shape cannot run fails at construction, as invalid_argument.
TEST_F(ForwardGpu, Sm90PlanThroughLayerOptions) {
  int dev = 0;
  ck(cudaGetDevice(&dev), "cudaGetDevice");
  if (!kernels::sm90_experts_supported(dev)) GTEST_SKIP() << "no sm_90a device";
  Model m(16, 4, 2048, 256, 103);
  Inputs in;
  in.T = 300;
  in.x = make_x(105, 0, in.T, m.cfg.hidden);
  in.R = make_routing(in.T, m.cfg.num_experts, m.cfg.top_k, RoutingKind::zipf, 107, 0, 1);
  const std::vector<float> ref = reference(m, in);
  cudaStream_t stream;
  ck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  for (const char* spec : {"up=single,down=single,order=expert,split=up+down,split_ctas=1,pad=up+down,swap=off",
                           "up=cluster,down=cluster,order=global,split=none,pad=none,tail=off,swap=off", "swap=on",
                           "fused=on"}) {
    SCOPED_TRACE(spec);
    LayerOptions opt;
    opt.expert_path = ExpertPath::sm90;
    opt.sm90_plan = parse_sm90_plan_override(spec);
    MoeLayer layer(m.cfg, m.weights(), single_comm(), opt);
    ASSERT_EQ(layer.expert_path(), ExpertPath::sm90);
    const std::vector<bf16> y = run_forward(layer, in, stream);
    EXPECT_TRUE(close_to_reference(y.data(), ref.data(), in.T, m.cfg.hidden, kGpuTolerance));
  }
  ck(cudaStreamDestroy(stream), "stream destroy");
  for (const char* bad : {"order=global,split=up", "up=single,pad=none,down=cluster,pad=down"}) {
    LayerOptions opt;
    opt.expert_path = ExpertPath::sm90;
    opt.sm90_plan = parse_sm90_plan_override(bad);
    try {
      MoeLayer layer(m.cfg, m.weights(), single_comm(), opt);
      ADD_FAILURE() << "'" << bad << "' accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << bad << ": " << e.what();
    }
  }
}

// LayerOptions::deterministic: 20 forwards give the same bits, on each path and each sm_90 plan
// (the 128-row kernels, swap-AB, the 192-row split; fused=on, which deterministic mode runs as the
// split swap-AB kernels), and the sm_90 plans give the same bits as each other: each pair's output is one GEMM's k loop in the same order whatever the tile, and the pairs
// of a row are summed in slot order. Skewed routing with k = 4 (rows with up to 4 local experts, so
// the default mode's reductions would race) and a decode size; the output also matches the reference.
TEST_F(ForwardGpu, DeterministicModeIsBitwiseReproducible) {
  Model m(16, 4, 2048, 256, 113);
  cudaStream_t stream;
  ck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  for (const auto& [T, kind] : {std::pair{int64_t(300), RoutingKind::zipf}, std::pair{int64_t(9), RoutingKind::uniform}}) {
    Inputs in;
    in.T = T;
    in.x = make_x(115, 0, T, m.cfg.hidden);
    in.R = make_routing(T, m.cfg.num_experts, m.cfg.top_k, kind, 117, 0, 1);
    const std::vector<float> ref = reference(m, in);
    for (ExpertPath path : paths_here()) {
      std::vector<bf16> first_sm90;
      const std::vector<const char*> specs =
          path == ExpertPath::sm90
              ? std::vector<const char*>{"swap=off", "swap=on",
                                         "swap=off,up=single,down=single,order=expert,split=up+down,split_ctas=1",
                                         "fused=on"}
              : std::vector<const char*>{""};
      for (const char* spec : specs) {
        SCOPED_TRACE(std::string("T=") + std::to_string(T) + " " + path_str(path) + " '" + spec + "'");
        LayerOptions opt;
        opt.expert_path = path;
        opt.deterministic = true;
        opt.sm90_plan = parse_sm90_plan_override(spec);
        MoeLayer layer(m.cfg, m.weights(), single_comm(), opt);
        const std::vector<bf16> y0 = run_forward(layer, in, stream);
        EXPECT_TRUE(close_to_reference(y0.data(), ref.data(), T, m.cfg.hidden, kGpuTolerance));
        int differing = 0;
        for (int run = 1; run < 20; ++run) {
          const std::vector<bf16> y = run_forward(layer, in, stream);
          differing += std::memcmp(y.data(), y0.data(), y.size() * sizeof(bf16)) != 0;
        }
        EXPECT_EQ(differing, 0) << "of 19 repeated forwards";
        size_t diff = 0;
        if (path == ExpertPath::sm90) {
          if (first_sm90.empty()) first_sm90 = y0;
          for (size_t i = 0; i < y0.size(); ++i) diff += y0[i].bits != first_sm90[i].bits;
          EXPECT_EQ(diff, 0u) << "elements differing from the first sm_90 plan's output";
        }
        matrix_row("deterministic forward, T " + std::to_string(T) + " (1 GPU, " + path_str(path) + " '" + spec + "')",
                   "20 runs bit-identical" + std::string(path == ExpertPath::sm90 ? ", and to the first sm_90 plan" : ""),
                   std::to_string(differing) + " of 19 repeats differ" +
                       (path == ExpertPath::sm90 ? "; " + std::to_string(diff) + " elements differ from the first plan"
                                                 : std::string()));
      }
    }
  }
  ck(cudaStreamDestroy(stream), "stream destroy");
  LayerOptions opt;
  opt.deterministic = true;
  opt.max_tokens_per_rank = 8;
  try {
    MoeLayer layer(m.cfg, m.weights(), single_comm(), opt);
    ADD_FAILURE() << "deterministic with max_tokens_per_rank accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::unsupported) << e.what();
  }
}

// hidden / ffn multiples of 16 but not of 128 (issue 48): the sm_90 kernels take them (zero-filled
// boxes past hidden and ffn, predicated stores), so the automatic path is sm90 on an sm_90a device;
// every form - the default plan, swap-AB, the fused pipeline, the 128-row kernels forced, cuBLAS -
// and the capturable forward (T below its capacity, rows past T zero) against the reference.
TEST_F(ForwardGpu, DimsMultipleOf16RunOnEveryPath) {
  cudaStream_t stream;
  ck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  int dev = 0;
  ck(cudaGetDevice(&dev), "cudaGetDevice");
  const bool sm90 = kernels::sm90_experts_supported(dev);
  for (const Case& c : {Case{8, 2, 144, 80, 200, RoutingKind::zipf}, Case{16, 4, 272, 48, 300, RoutingKind::with_drops},
                        Case{8, 4, 16, 16, 64, RoutingKind::uniform}, Case{8, 2, 1040, 2064, 96, RoutingKind::uniform},
                        Case{32, 4, 2064, 1040, 5, RoutingKind::uniform}}) {
    SCOPED_TRACE("hidden " + std::to_string(c.hidden) + " ffn " + std::to_string(c.ffn));
    Model m(c.E, c.k, c.hidden, c.ffn, mix(c.E, c.hidden, c.ffn));
    Inputs in;
    in.T = c.T;
    in.x = make_x(mix(3, c.T), 0, c.T, c.hidden);
    in.R = make_routing(c.T, c.E, c.k, c.kind, mix(5, c.T, c.E), 0, 1);
    const std::vector<float> ref = reference(m, in);
    struct Run {
      ExpertPath path;
      const char* plan;
    };
    std::vector<Run> runs = {{ExpertPath::automatic, ""}, {ExpertPath::cublas, ""}};
    if (sm90)
      runs.insert(runs.end(), {{ExpertPath::sm90, "swap=on"},
                               {ExpertPath::sm90, "fused=on"},
                               {ExpertPath::sm90, "swap=off,up=single,down=single,order=global,split=none,pad=none"}});
    for (const Run& r : runs) {
      SCOPED_TRACE(std::string(path_str(r.path)) + " plan '" + r.plan + "'");
      LayerOptions opt;
      opt.expert_path = r.path;
      opt.sm90_plan = parse_sm90_plan_override(r.plan);
      MoeLayer layer(m.cfg, m.weights(), single_comm(), opt);
      if (r.path == ExpertPath::automatic) EXPECT_EQ(layer.expert_path(), sm90 ? ExpertPath::sm90 : ExpertPath::cublas);
      const std::vector<bf16> y = run_forward(layer, in, stream);
      EXPECT_TRUE(close_to_reference(y.data(), ref.data(), c.T, c.hidden, kGpuTolerance));
    }
    if (!sm90) continue;
    // The capturable forward: capacity T + 7, T real rows.
    const int64_t N = c.T + 7;
    LayerOptions opt;
    opt.max_tokens_per_rank = N;
    MoeLayer layer(m.cfg, m.weights(), single_comm(), opt);
    std::vector<bf16> xa = make_x(77, 0, N, c.hidden);
    std::copy(in.x.begin(), in.x.end(), xa.begin());
    std::vector<int32_t> ia(size_t(N) * c.k, c.E + 1000);  // rows past T: ids that would fail if read
    std::vector<float> wa(size_t(N) * c.k, 1.f);
    std::copy(in.R.ids.begin(), in.R.ids.end(), ia.begin());
    std::copy(in.R.weights.begin(), in.R.weights.end(), wa.begin());
    Dev<bf16> x(xa), y(size_t(N) * c.hidden, 0xff);
    Dev<int32_t> ids(ia);
    Dev<float> w(wa);
    Dev<int64_t> nt(std::vector<int64_t>{c.T});
    auto view = [&](void* p, DType t, int64_t cols) {
      return TensorView::contiguous(p, t, {N, cols}, DeviceType::cuda, dev);
    };
    layer.forward_capturable(view(x.get(), DType::bf16, c.hidden), view(ids.get(), DType::i32, c.k),
                             view(w.get(), DType::f32, c.k), view(y.get(), DType::bf16, c.hidden), nt.get(), stream);
    ck(cudaStreamSynchronize(stream), "sync");
    EXPECT_NO_THROW(layer.check_capturable(stream));
    const std::vector<bf16> yh = y.host();
    EXPECT_TRUE(close_to_reference(yh.data(), ref.data(), c.T, c.hidden, kGpuTolerance)) << "capturable";
    for (int64_t i = c.T * c.hidden; i < N * c.hidden; ++i)
      if (float(yh[size_t(i)]) != 0.0f) {
        ADD_FAILURE() << "capturable: y[" << i / c.hidden << ", " << i % c.hidden << "] past T is not 0";
        break;
      }
  }
  ck(cudaStreamDestroy(stream), "stream destroy");
}

// One layer, many calls: buffers grow and shrink in use; outputs stay right. (Not bitwise
// deterministic: the bf16 atomics that reduce a token's experts add in arrival order.)
TEST_F(ForwardGpu, RepeatedCallsReuseBuffers) {
  Model m(16, 4, 2048, 256, 71);
  cudaStream_t stream;
  ck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  for (ExpertPath path : paths_here()) {
    SCOPED_TRACE(path_str(path));
    LayerOptions opt;
    opt.expert_path = path;
    MoeLayer layer(m.cfg, m.weights(), single_comm(), opt);
    for (int64_t T : {int64_t(200), int64_t(7), int64_t(0), int64_t(640), int64_t(200)}) {
      SCOPED_TRACE("T=" + std::to_string(T));
      Inputs in;
      in.T = T;
      in.x = make_x(77, 0, T, m.cfg.hidden);
      in.R = make_routing(T, m.cfg.num_experts, m.cfg.top_k, RoutingKind::zipf, 79, 0, 1);
      const std::vector<bf16> y = run_forward(layer, in, stream);
      const std::vector<float> ref = reference(m, in);
      EXPECT_TRUE(close_to_reference(y.data(), ref.data(), T, m.cfg.hidden, kGpuTolerance));
    }
  }
  ck(cudaStreamDestroy(stream), "stream destroy");
}

// A bad id fails with the CPU's error (code and text), and the layer keeps working afterwards.
TEST_F(ForwardGpu, BadIdsRaiseTheProtocolError) {
  Model m(16, 4, 2048, 128, 81);
  MoeLayer layer(m.cfg, m.weights(), single_comm());
  cudaStream_t stream;
  ck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  Inputs in;
  in.T = 64;
  in.x = make_x(83, 0, in.T, m.cfg.hidden);
  in.R = make_routing(in.T, 16, 4, RoutingKind::uniform, 85, 0, 1);
  for (int bad : {0, 1}) {
    Inputs b = in;
    if (bad == 0) b.R.ids[41 * 4 + 2] = 16;
    else b.R.ids[13 * 4 + 3] = b.R.ids[13 * 4 + 1];
    struct Seen {
      ErrorCode code;
      std::string text;
    };
    const Seen want = [&] {
      const MoeConfig& c = m.cfg;
      try {
        MoeLayer cpu(c,
                     {TensorView::contiguous(m.M.w1.data(), DType::bf16, {16, 2 * int64_t(c.ffn), c.hidden}),
                      TensorView::contiguous(m.M.w2.data(), DType::bf16, {16, int64_t(c.hidden), c.ffn})},
                     make_mock_world(1)[0]);
        std::vector<bf16> y(size_t(b.T) * c.hidden);
        cpu.forward(TensorView::contiguous(b.x.data(), DType::bf16, {b.T, c.hidden}),
                    TensorView::contiguous(b.R.ids.data(), DType::i32, {b.T, c.top_k}),
                    TensorView::contiguous(b.R.weights.data(), DType::f32, {b.T, c.top_k}),
                    TensorView::contiguous(y.data(), DType::bf16, {b.T, c.hidden}));
      } catch (const Error& e) {
        return Seen{e.code(), e.what()};
      }
      return Seen{ErrorCode::ok, ""};
    }();
    ASSERT_NE(want.code, ErrorCode::ok);
    try {
      run_forward(layer, b, stream);
      ADD_FAILURE() << "bad ids must throw";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), want.code);
      EXPECT_EQ(std::string(e.what()), want.text) << "same text as the CPU engine";
    }
  }
  const std::vector<bf16> y = run_forward(layer, in, stream);  // still usable
  const std::vector<float> ref = reference(m, in);
  EXPECT_TRUE(close_to_reference(y.data(), ref.data(), in.T, m.cfg.hidden, kGpuTolerance));
  ck(cudaStreamDestroy(stream), "stream destroy");
}

// Shape errors travel as a status too (no launch with bad pointers), with the host's text.
TEST_F(ForwardGpu, BadArgumentsRaiseInvalidArgument) {
  Model m(8, 2, 2048, 128, 87);
  MoeLayer layer(m.cfg, m.weights(), single_comm());
  int dev = 0;
  ck(cudaGetDevice(&dev), "cudaGetDevice");
  Dev<bf16> x(size_t(4) * 2048), y(size_t(4) * 2048);
  Dev<int32_t> ids(4 * 2);
  Dev<float> w(4 * 2);
  try {
    layer.forward(TensorView::contiguous(x.get(), DType::bf16, {4, 2048}, DeviceType::cuda, dev),
                  TensorView::contiguous(ids.get(), DType::i32, {4, 3}, DeviceType::cuda, dev),  // k is 2
                  TensorView::contiguous(w.get(), DType::f32, {4, 2}, DeviceType::cuda, dev),
                  TensorView::contiguous(y.get(), DType::bf16, {4, 2048}, DeviceType::cuda, dev));
    ADD_FAILURE() << "a wrong topk_ids shape must throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("topk_ids"), std::string::npos) << e.what();
  }
}

// The inspection hook sees each received row = x[source token], and phase times are filled.
TEST_F(ForwardGpu, OnReceiveHookAndPhaseTimes) {
  Model m(16, 4, 2048, 128, 91);
  Inputs in;
  in.T = 100;
  in.x = make_x(93, 0, in.T, m.cfg.hidden);
  in.R = make_routing(in.T, 16, 4, RoutingKind::with_drops, 95, 0, 1);
  LayerOptions opt;
  opt.record_phase_times = true;
  int64_t seen = -1;
  opt.on_receive = [&](const void* rows, const int32_t* meta, const std::vector<int64_t>& per_rank) {
    ASSERT_EQ(per_rank.size(), 1u);
    seen = per_rank[0];
    const int mw = 1 + 2 * 4;
    const bf16* r = static_cast<const bf16*>(rows);
    for (int64_t i = 0; i < per_rank[0]; ++i) {
      const int32_t t = meta[i * mw];
      ASSERT_TRUE(t >= 0 && t < in.T);
      ASSERT_EQ(0, std::memcmp(r + i * 2048, in.x.data() + size_t(t) * 2048, 2048 * sizeof(bf16))) << "row " << i;
    }
  };
  MoeLayer layer(m.cfg, m.weights(), single_comm(), opt);
  cudaStream_t stream;
  ck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  run_forward(layer, in, stream);
  EXPECT_EQ(seen, dedup_rows(in.R, in.T, 4));
  const ForwardStats& s = layer.last_stats();
  for (double v : {s.layout_ms, s.exchange_ms, s.dispatch_ms, s.experts_ms, s.combine_ms, s.reduce_ms})
    EXPECT_GE(v, 0.0);
  EXPECT_GT(s.layout_ms + s.exchange_ms + s.dispatch_ms + s.experts_ms + s.combine_ms + s.reduce_ms, 0.0);
  ck(cudaStreamDestroy(stream), "stream destroy");
}

// T * k * hidden > 2^31 (and the expert-sorted rows * hidden too): every offset must be 64-bit.
// Checked on a sample of tokens against the reference computed for those tokens only.
// Past 2^31 elements in the two index products the kernels form: T * k * hidden (the dispatched rows,
// 7168 wide) and rows * ffn (act, 7168 wide); each case on every path against sampled tokens.
TEST_F(ForwardGpu, Past32BitOffsets) {
  struct Shape {
    int E, k, H, F;
    const char* what;
  };
  const int64_t T = 40000;
  for (const Shape& sh : {Shape{8, 8, 7168, 128, "T*k*hidden"}, Shape{8, 8, 128, 7168, "rows*ffn"}}) {
    const int E = sh.E, k = sh.k, H = sh.H, F = sh.F;
    SCOPED_TRACE(sh.what);
    EXPECT_GT(T * k * int64_t(std::max(H, F)), int64_t(1) << 31);
    size_t free_b = 0, total_b = 0;
    ck(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
    // x, y, send/recv/combine rows (~0.6 GB each), xs and the cuBLAS scratch (~4.6 GB each); or act
    if (free_b < (size_t(16) << 30)) GTEST_SKIP() << "needs ~16 GB of free device memory, have " << (free_b >> 20) << " MB";
    Model m(E, k, H, F, 97);
    Inputs in;
    in.T = T;
    in.x.resize(size_t(T) * H);
    for (size_t i = 0; i < in.x.size(); ++i)  // cheap deterministic values in [-1, 1)
      in.x[i] = bf16(float(int32_t((mix(99, i) >> 40) & 0xffff) - 32768) / 32768.0f);
    in.R = make_routing(T, E, k, RoutingKind::uniform, 101, 0, 1);
    // sample: first, last, and a stride through the middle
    std::vector<int64_t> sample = {0, 1, T / 2, T - 2, T - 1};
    for (int64_t t = 997; t < T; t += 2503) sample.push_back(t);
    std::sort(sample.begin(), sample.end());
    sample.erase(std::unique(sample.begin(), sample.end()), sample.end());
    Inputs sub;
    sub.T = int64_t(sample.size());
    for (int64_t t : sample) {
      sub.x.insert(sub.x.end(), in.x.begin() + t * H, in.x.begin() + (t + 1) * H);
      sub.R.ids.insert(sub.R.ids.end(), in.R.ids.begin() + t * k, in.R.ids.begin() + (t + 1) * k);
      sub.R.weights.insert(sub.R.weights.end(), in.R.weights.begin() + t * k, in.R.weights.begin() + (t + 1) * k);
    }
    const std::vector<float> ref = reference(m, sub);
    cudaStream_t stream;
    ck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    for (ExpertPath path : paths_here()) {
      SCOPED_TRACE(path_str(path));
      LayerOptions opt;
      opt.expert_path = path;
      std::vector<bf16> y_sub;
      int64_t pairs = 0;
      {
        MoeLayer layer(m.cfg, m.weights(), single_comm(), opt);
        const std::vector<bf16> y = run_forward(layer, in, stream);
        pairs = layer.last_stats().expert_pairs;
        EXPECT_EQ(pairs, T * k);
        for (int64_t t : sample) y_sub.insert(y_sub.end(), y.begin() + t * H, y.begin() + (t + 1) * H);
      }  // the layer's buffers go before the next path allocates its own
      const ::testing::AssertionResult close = close_to_reference(y_sub.data(), ref.data(), sub.T, H, kGpuTolerance);
      EXPECT_TRUE(close);
      matrix_row(std::string(sh.what) + " past 2^31 (T 40000, k 8, hidden " + std::to_string(H) + ", ffn " +
                     std::to_string(F) + ", 1 GPU, " + path_str(path) + ")",
                 "every pair routed; sampled tokens within the GPU tolerance",
                 std::to_string(pairs) + " pairs; " + std::to_string(sub.T) + " tokens " +
                     (close ? "within tolerance: " : "OUT of tolerance: ") + close.message());
    }
    ck(cudaStreamDestroy(stream), "stream destroy");
  }
}

}  // namespace
}  // namespace epmoe::test
