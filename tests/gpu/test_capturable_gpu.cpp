// MoeLayer::forward_capturable on one GPU (sm_90 path, world 1), both transports (local, and the
// slots all-to-alls that other world sizes use, here over the single-rank NCCL communicator): one
// CUDA graph captured once and replayed at T in {0, 1, 2, 8, 33, 64, 65, N} with fresh inputs each
// time, against the dense reference (epmoe::reference_moe), for uniform, skewed (zipf), one-expert
// and dropped routing; the rows past T must come back exactly 0 and the routing rows past T (filled
// with bad ids) must be ignored. Bad routing: an out-of-range id, a repeated id, a bad num_tokens ->
// NaN rows where the contract says (local: the token's row; slots: every row of the rank), the
// others still right, and check_capturable throwing once with the failure. Construction and
// argument errors. Then world 2 and 4 on device mock ranks (threads on one GPU): the slots
// transport and the regular forward for different T per rank, and one rank's bad id failing only
// that rank. Skips without an sm_90a device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "comm/mock_comm.h"
#include "epmoe/error.h"
#include "epmoe/moe_layer.h"
#include "epmoe/reference.h"
#include "kernels/sm90/experts.cuh"
#include "test_support.h"

#include "capturable_support.h"
#include "device_array.h"
#include "single_comm.h"

namespace epmoe::test {
namespace {

// The sm_90 path's roundings against the fp64 reference, as in test_forward_gpu (kGpuTolerance
// there says why): bf16 activation, bf16 atomics over a token's <= k experts and the split-K
// partials. The capturable forward has one bf16 rounding fewer (no source reduce at world 1).
constexpr Tolerance kTolerance{1.0 / 32, 1.0 / 32, 1e-2};

constexpr int kE = 16, kK = 4, kHidden = 2048, kFfn = 256;
constexpr int64_t kN = 80;  // the capture's rows (= max_tokens_per_rank)

class CapturableGpu : public CapturableSuite {};

struct Fixture {
  MoeConfig cfg{.num_experts = kE, .top_k = kK, .hidden = kHidden, .ffn = kFfn, .world_size = 1, .rank = 0};
  ModelWeights M = make_weights(kE, kHidden, kFfn, 2024);
  Dev<bf16> w1{M.w1}, w2{M.w2};
  Dev<bf16> x{size_t(kN) * kHidden};
  Dev<int32_t> ids{size_t(kN) * kK};
  Dev<float> wts{size_t(kN) * kK};
  Dev<bf16> y{size_t(kN) * kHidden};
  Dev<int64_t> num_tokens{1};
  cudaStream_t stream = nullptr;
  std::unique_ptr<MoeLayer> layer;

  explicit Fixture(CapturableTransport transport = CapturableTransport::local, int64_t capacity = kN,
                   const char* plan = "") {
    ck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    LayerOptions opt;
    opt.expert_path = ExpertPath::sm90;
    opt.sm90_plan = parse_sm90_plan_override(plan);
    opt.max_tokens_per_rank = capacity;
    opt.capturable_transport = transport;
    layer = std::make_unique<MoeLayer>(cfg, weights(), single_comm(), opt);
  }
  ~Fixture() { cudaStreamDestroy(stream); }
  ExpertWeights weights() const {
    return {dview(w1.get(), DType::bf16, {kE, 2 * kFfn, kHidden}), dview(w2.get(), DType::bf16, {kE, kHidden, kFfn})};
  }
  void forward() {
    layer->forward_capturable(dview(x.get(), DType::bf16, {kN, kHidden}), dview(ids.get(), DType::i32, {kN, kK}),
                              dview(wts.get(), DType::f32, {kN, kK}), dview(y.get(), DType::bf16, {kN, kHidden}),
                              num_tokens.get(), stream);
  }
  // Fresh inputs: T real tokens, the rest of the N rows filled with ids that would fail if read.
  void upload(int64_t T, const std::vector<bf16>& hx, const Routing& R) {
    std::vector<bf16> xa = make_x(77, 0, kN, kHidden);  // rows past T: any finite values
    std::copy(hx.begin(), hx.end(), xa.begin());
    std::vector<int32_t> ia(size_t(kN) * kK, kE + 1000);
    std::vector<float> wa(size_t(kN) * kK, 1.f);
    std::copy(R.ids.begin(), R.ids.end(), ia.begin());
    std::copy(R.weights.begin(), R.weights.end(), wa.begin());
    ck(cudaMemcpyAsync(x.get(), xa.data(), xa.size() * 2, cudaMemcpyHostToDevice, stream), "x");
    ck(cudaMemcpyAsync(ids.get(), ia.data(), ia.size() * 4, cudaMemcpyHostToDevice, stream), "ids");
    ck(cudaMemcpyAsync(wts.get(), wa.data(), wa.size() * 4, cudaMemcpyHostToDevice, stream), "w");
    ck(cudaMemcpyAsync(num_tokens.get(), &T, 8, cudaMemcpyHostToDevice, stream), "T");
    ck(cudaMemsetAsync(y.get(), 0xff, size_t(kN) * kHidden * 2, stream), "poison y");  // NaN
    ck(cudaStreamSynchronize(stream), "sync");
  }
  std::vector<float> reference(int64_t T, const std::vector<bf16>& hx, const Routing& R) const {
    std::vector<float> ref(size_t(T) * kHidden);
    reference_moe(hx.data(), R.ids.data(), R.weights.data(), T, kK, M.w1.data(), M.w2.data(), kE, kHidden, kFfn,
                  ref.data());
    return ref;
  }
};

// Rows [from, kN) of y are exactly 0.
::testing::AssertionResult rows_zero(const std::vector<bf16>& y, int64_t from) {
  return epmoe::test::rows_zero(y, from, kN, kHidden);
}

void graph_replays(CapturableTransport transport, const char* plan = "") {
  SCOPED_TRACE(std::string(transport_name(transport)) + " plan '" + plan + "'");
  Fixture f(transport, kN, plan);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ck(cudaStreamBeginCapture(f.stream, cudaStreamCaptureModeThreadLocal), "begin capture");
  f.forward();
  ck(cudaStreamEndCapture(f.stream, &graph), "end capture");
  ck(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  int round = 0, replays = 0, bad = 0;
  for (RoutingKind kind : {RoutingKind::uniform, RoutingKind::zipf, RoutingKind::one_expert, RoutingKind::with_drops})
    for (int64_t T : {int64_t(0), int64_t(1), int64_t(2), int64_t(8), int64_t(33), int64_t(64), int64_t(65), kN}) {
      SCOPED_TRACE(std::string(routing_name(kind)) + " T=" + std::to_string(T));
      const std::vector<bf16> hx = make_x(mix(11, T, ++round), 0, T, kHidden);
      const Routing R = make_routing(T, kE, kK, kind, mix(13, T, round), /*focus=*/round % kE, 1);
      f.upload(T, hx, R);
      ck(cudaGraphLaunch(exec, f.stream), "replay");
      ck(cudaStreamSynchronize(f.stream), "sync");
      const std::vector<bf16> y = f.y.host();
      const std::vector<float> ref = f.reference(T, hx, R);
      const bool close = close_to_reference(y.data(), ref.data(), T, kHidden, kTolerance), zero = rows_zero(y, T);
      EXPECT_TRUE(close_to_reference(y.data(), ref.data(), T, kHidden, kTolerance));
      EXPECT_TRUE(rows_zero(y, T));
      EXPECT_NO_THROW(f.layer->check_capturable(f.stream));
      ++replays;
      bad += !(close && zero);
    }
  matrix_row(std::string("one captured graph replayed at T 0..") + std::to_string(kN) + ", 4 routings (1 GPU, " +
                 transport_name(transport) + (plan[0] ? std::string(", ") + plan : std::string()) + ")",
             "every replay matches the reference, rows past T zero",
             std::to_string(replays - bad) + " of " + std::to_string(replays) + " replays right");
  // The same inputs outside a graph: the same contract.
  const int64_t T = 50;
  const std::vector<bf16> hx = make_x(19, 0, T, kHidden);
  const Routing R = make_routing(T, kE, kK, RoutingKind::zipf, 23, 0, 1);
  f.upload(T, hx, R);
  f.forward();
  ck(cudaStreamSynchronize(f.stream), "sync");
  const std::vector<bf16> y = f.y.host();
  EXPECT_TRUE(close_to_reference(y.data(), f.reference(T, hx, R).data(), T, kHidden, kTolerance));
  EXPECT_TRUE(rows_zero(y, T));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST_F(CapturableGpu, GraphReplaysAtEveryTokenCount) {
  for (CapturableTransport t : kTransports) graph_replays(t);
}

// The fused pipeline under replay: its fp32 accumulator must be zero again after every replay (a
// leftover would show in the next T's rows), and rows past T are the write-out's zeros.
TEST_F(CapturableGpu, FusedGraphReplaysAtEveryTokenCount) {
  for (CapturableTransport t : kTransports) graph_replays(t, "fused=on");
}

// A bad id makes its token's row NaN (local; slots: every row of the rank, as its layout fails
// whole), and check_capturable throws it once.
void bad_ids(CapturableTransport transport) {
  SCOPED_TRACE(transport_name(transport));
  Fixture f(transport);
  const bool whole_rank = transport == CapturableTransport::slots;
  struct Bad {
    int slot;
    int32_t id;
    ErrorCode code;
  };
  for (const Bad& b : {Bad{1, kE + 5, ErrorCode::expert_id_out_of_range}, Bad{2, -7, ErrorCode::expert_id_out_of_range},
                       Bad{3, -2, ErrorCode::expert_id_out_of_range}, Bad{1, -1, ErrorCode::ok}}) {
    const int64_t T = 12, bad_t = 5;
    const std::vector<bf16> hx = make_x(29, 0, T, kHidden);
    Routing R = make_routing(T, kE, kK, RoutingKind::uniform, 31, 0, 1);
    Routing Rref = R;
    R.ids[size_t(bad_t) * kK + b.slot] = b.id;
    if (b.code == ErrorCode::ok) {
      Rref = R;  // -1 is a dropped slot, not an error
    } else {
      for (int j = 0; j < kK; ++j) Rref.ids[size_t(bad_t) * kK + j] = -1;
    }
    // A repeated id (slot 3 = slot 0's) on another token.
    const int64_t dup_t = 9;
    const bool with_dup = b.code != ErrorCode::ok;
    if (with_dup) {
      R.ids[size_t(dup_t) * kK + 3] = R.ids[size_t(dup_t) * kK + 0];
      for (int j = 0; j < kK; ++j) Rref.ids[size_t(dup_t) * kK + j] = -1;
    }
    SCOPED_TRACE("bad id " + std::to_string(b.id) + " in slot " + std::to_string(b.slot));
    f.upload(T, hx, R);
    f.forward();
    ck(cudaStreamSynchronize(f.stream), "sync");
    const std::vector<bf16> y = f.y.host();
    const std::vector<float> ref = f.reference(T, hx, Rref);
    for (int64_t t = 0; t < T; ++t) {
      const bool poisoned = with_dup && (whole_rank || t == bad_t || t == dup_t);
      if (poisoned) {
        for (int c = 0; c < kHidden; ++c) ASSERT_TRUE(is_nan(y[size_t(t) * kHidden + c])) << "row " << t << " col " << c;
      } else {
        EXPECT_TRUE(close_to_reference(y.data() + t * kHidden, ref.data() + t * kHidden, 1, kHidden, kTolerance))
            << "row " << t;
      }
    }
    EXPECT_TRUE(rows_zero(y, T));
    if (b.code == ErrorCode::ok) {
      EXPECT_NO_THROW(f.layer->check_capturable(f.stream));
      continue;
    }
    try {
      f.layer->check_capturable(f.stream);
      ADD_FAILURE() << "check_capturable did not throw";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), b.code) << e.what();
      EXPECT_NE(std::string(e.what()).find("token 5 slot " + std::to_string(b.slot)), std::string::npos) << e.what();
    }
    EXPECT_NO_THROW(f.layer->check_capturable(f.stream)) << "the record is cleared once thrown";
  }
  // Only the repeated id: duplicate_expert_id.
  const int64_t T = 4;
  const std::vector<bf16> hx = make_x(37, 0, T, kHidden);
  Routing R = make_routing(T, kE, kK, RoutingKind::uniform, 41, 0, 1);
  R.ids[2 * kK + 2] = R.ids[2 * kK + 1];
  f.upload(T, hx, R);
  f.forward();
  try {
    f.layer->check_capturable(f.stream);
    ADD_FAILURE() << "check_capturable did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::duplicate_expert_id) << e.what();
    EXPECT_NE(std::string(e.what()).find("token 2 slot 2"), std::string::npos) << e.what();
  }
}

TEST_F(CapturableGpu, BadIdsPoisonTheirRowAndAreReported) {
  for (CapturableTransport t : kTransports) bad_ids(t);
}

// num_tokens outside [0, N]: every row NaN, and invalid_argument from check_capturable.
TEST_F(CapturableGpu, BadTokenCountPoisonsEveryRow) {
  for (CapturableTransport transport : kTransports)
  for (int64_t T : {kN + 1, int64_t(-3)}) {
    Fixture f(transport);
    SCOPED_TRACE(std::string(transport_name(transport)) + " num_tokens " + std::to_string(T));
    const Routing R = make_routing(kN, kE, kK, RoutingKind::uniform, 43, 0, 1);
    f.upload(kN, make_x(47, 0, kN, kHidden), R);
    ck(cudaMemcpy(f.num_tokens.get(), &T, 8, cudaMemcpyHostToDevice), "T");
    ck(cudaDeviceSynchronize(), "T sync");  // (a pageable upload may still be in flight: device_array.h)
    f.forward();
    ck(cudaStreamSynchronize(f.stream), "sync");
    const std::vector<bf16> y = f.y.host();
    for (size_t i = 0; i < y.size(); ++i) ASSERT_TRUE(is_nan(y[i])) << "element " << i;
    try {
      f.layer->check_capturable(f.stream);
      ADD_FAILURE() << "check_capturable did not throw";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
      EXPECT_NE(std::string(e.what()).find("num_tokens " + std::to_string(T)), std::string::npos) << e.what();
    }
  }
}

TEST_F(CapturableGpu, ArgumentAndConstructionErrors) {
  Fixture f(CapturableTransport::local, kN - 1);  // capacity below the buffers' rows
  EXPECT_THROW(f.forward(), Error);
  Fixture g;
  int64_t host_T = 1;
  try {
    g.layer->forward_capturable(dview(g.x.get(), DType::bf16, {kN, kHidden}), dview(g.ids.get(), DType::i32, {kN, kK}),
                                dview(g.wts.get(), DType::f32, {kN, kK}), dview(g.y.get(), DType::bf16, {kN, kHidden}),
                                &host_T, g.stream);
    ADD_FAILURE() << "a host num_tokens was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
  }
  EXPECT_THROW(g.layer->forward_capturable(dview(g.x.get(), DType::bf16, {kN, kHidden}),
                                           dview(g.ids.get(), DType::i32, {kN, kK}),
                                           dview(g.wts.get(), DType::f32, {kN, kK}),
                                           dview(g.y.get(), DType::bf16, {kN - 1, kHidden}), g.num_tokens.get(), g.stream),
               Error);
  // The cuBLAS path has no capturable forward; a layer without the option refuses the call.
  LayerOptions opt;
  opt.expert_path = ExpertPath::cublas;
  opt.max_tokens_per_rank = kN;
  try {
    MoeLayer bad(g.cfg, g.weights(), single_comm(), opt);
    ADD_FAILURE() << "cuBLAS path with max_tokens_per_rank was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::unsupported) << e.what();
  }
  MoeLayer plain(g.cfg, g.weights(), single_comm(), LayerOptions{});
  EXPECT_THROW(plain.forward_capturable(dview(g.x.get(), DType::bf16, {kN, kHidden}),
                                        dview(g.ids.get(), DType::i32, {kN, kK}), dview(g.wts.get(), DType::f32, {kN, kK}),
                                        dview(g.y.get(), DType::bf16, {kN, kHidden}), g.num_tokens.get(), g.stream),
               Error);
}

// World 2 and 4 on device mock ranks: each rank its own thread, stream, expert shard and T; the
// capturable forward (slots transport) and the regular forward against the reference, then (world 2)
// a bad id on rank 1 only: rank 1's rows below its T NaN (zero past it) and its check throws, rank
// 0's rows still right.
TEST_F(CapturableGpu, SlotsAcrossDeviceMockRanks) {
  const ModelWeights M = make_weights(kE, kHidden, kFfn, 4048);
  const int dev = current_device();
  for (int W : {2, 4}) {
    SCOPED_TRACE("world " + std::to_string(W));
    const int El = kE / W;
    const std::vector<int64_t> Ts = {33, 80, 0, 1};
    run_device_mock_ranks(W, dev, [&](int r, std::shared_ptr<Communicator> comm) {
      const MoeConfig cfg{.num_experts = kE, .top_k = kK, .hidden = kHidden, .ffn = kFfn, .world_size = W, .rank = r};
      const size_t n1 = size_t(2) * kFfn * kHidden, n2 = size_t(kHidden) * kFfn;
      Dev<bf16> w1(std::vector<bf16>(M.w1.begin() + r * El * n1, M.w1.begin() + (r + 1) * El * n1));
      Dev<bf16> w2(std::vector<bf16>(M.w2.begin() + r * El * n2, M.w2.begin() + (r + 1) * El * n2));
      LayerOptions opt;
      opt.expert_path = ExpertPath::sm90;
      opt.max_tokens_per_rank = kN;
      MoeLayer layer(cfg, {dview(w1.get(), DType::bf16, {El, 2 * kFfn, kHidden}),
                           dview(w2.get(), DType::bf16, {El, kHidden, kFfn})},
                     std::move(comm), opt);
      cudaStream_t st;
      ck(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream");
      std::string why;
      for (int round = 0; round < (W == 2 ? 2 : 1); ++round) {
        const int64_t T = Ts[size_t(r)];
        const std::vector<bf16> hx = make_x(mix(51, r, round), 0, T, kHidden);
        Routing R = make_routing(T, kE, kK, round ? RoutingKind::uniform : RoutingKind::zipf, mix(53, r, round), 0, 1);
        const bool bad = round == 1 && r == 1 && T > 0;
        if (bad) R.ids[size_t(T / 2) * kK + 1] = kE + 3;
        std::vector<bf16> xa(size_t(kN) * kHidden, bf16(0.f));
        std::copy(hx.begin(), hx.end(), xa.begin());
        std::vector<int32_t> ia(size_t(kN) * kK, kE + 1000);  // rows past T: never read
        std::vector<float> wa(size_t(kN) * kK, 1.f);
        std::copy(R.ids.begin(), R.ids.end(), ia.begin());
        std::copy(R.weights.begin(), R.weights.end(), wa.begin());
        Dev<bf16> x(xa), y(size_t(kN) * kHidden, 0xff), y2(size_t(kN) * kHidden, 0xff);
        Dev<int32_t> ids(ia);
        Dev<float> wts(wa);
        Dev<int64_t> d_T(std::vector<int64_t>{T});
        layer.forward_capturable(dview(x.get(), DType::bf16, {kN, kHidden}), dview(ids.get(), DType::i32, {kN, kK}),
                                 dview(wts.get(), DType::f32, {kN, kK}), dview(y.get(), DType::bf16, {kN, kHidden}),
                                 d_T.get(), st);
        ck(cudaStreamSynchronize(st), "sync");
        const std::vector<bf16> hy = y.host();
        if (bad) {  // (rows below T NaN, the rows past it zero)
          for (size_t i = 0; i < size_t(T) * kHidden; ++i)
            if (!is_nan(hy[i])) {
              why += "rank 1: a row without NaN after its bad id; ";
              break;
            }
          if (auto z = rows_zero(hy, T); !z) why += "rank 1: " + std::string(z.message()) + "; ";
          try {
            layer.check_capturable(st);
            why += "rank 1: check_capturable did not throw; ";
          } catch (const Error& e) {
            if (e.code() != ErrorCode::expert_id_out_of_range) why += std::string("rank 1: ") + e.what() + "; ";
          }
          continue;
        }
        std::vector<float> ref(size_t(T) * kHidden);
        reference_moe(hx.data(), R.ids.data(), R.weights.data(), T, kK, M.w1.data(), M.w2.data(), kE, kHidden, kFfn,
                      ref.data());
        if (auto ok = close_to_reference(hy.data(), ref.data(), T, kHidden, kTolerance); !ok)
          why += "capturable: " + std::string(ok.message()) + "; ";
        if (auto z = rows_zero(hy, T); !z) why += "capturable: " + std::string(z.message()) + "; ";
        layer.check_capturable(st);
        if (round == 1) continue;  // (a bad id there would fail every rank's regular forward alike)
        // The regular forward over the same mock world: the EP path at W > 1 on one GPU.
        layer.forward(dview(x.get(), DType::bf16, {T, kHidden}), dview(ids.get(), DType::i32, {T, kK}),
                      dview(wts.get(), DType::f32, {T, kK}), dview(y2.get(), DType::bf16, {T, kHidden}), st);
        ck(cudaStreamSynchronize(st), "sync");
        const std::vector<bf16> hy2 = y2.host(size_t(T) * kHidden);
        if (auto ok = close_to_reference(hy2.data(), ref.data(), T, kHidden, kTolerance); !ok)
          why += "regular: " + std::string(ok.message()) + "; ";
      }
      cudaStreamDestroy(st);
      return why;
    });
  }
}

}  // namespace
}  // namespace epmoe::test
