// The GPU engine over NCCL under mpirun (one process and one GPU per rank; registered for -np 2).
// Per case and expert path (cuBLAS; sm90 where every rank supports it):
//  * exact origin of every dispatched row (the engine's device receive buffers, read through
//    gpu_dispatch_view): row bits == x of (source rank, source token), metadata == the source's
//    protocol layout for this destination;
//  * y against the dense reference for this rank's tokens (all experts generated from the seed on
//    every rank, only this rank's slice uploaded);
//  * rows sent are deduplicated per (token, destination rank), never T*k, and the byte counts agree.
// Skips on every rank (agreed through MPI) unless each rank on a node has its own GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine.h"
#include "ep_case.h"
#include "ep_protocol.h"
#include "epmoe/error.h"
#include "epmoe/nccl_communicator.h"
#include "epmoe/reference.h"
#include "gpu_engine.h"
#include "kernels/sm90/experts.cuh"
#include "test_support.h"

#include "device_array.h"

namespace epmoe::test {
namespace {

// Same reasoning as tests/gpu/test_forward_gpu.cpp (bf16 GEMM outputs on the cuBLAS path, bf16
// atomic accumulation of <= k experts per row, split-K on sm90), plus the source reduce's final
// rounding of up to min(k, world) partial rows, which the CPU path has too.
constexpr Tolerance kGpuTolerance{1.0 / 32, 1.0 / 32, 1e-2};

int mpi_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int mpi_world() {
  int w = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &w);
  return w;
}
bool all_ranks(bool mine) {
  int v = mine ? 1 : 0, all = 0;
  MPI_Allreduce(&v, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all == 1;
}

class ForwardMpiGpu : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // One GPU per rank on each node, decided by all ranks together.
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    int local_ranks = 1;
    MPI_Comm_size(node, &local_ranks);
    MPI_Comm_free(&node);
    int gpus = 0;
    const bool mine = cudaGetDeviceCount(&gpus) == cudaSuccess && gpus >= local_ranks;
    ok_ = all_ranks(mine);
    if (!ok_) {
      why_ = "needs one CUDA device per rank on every node (this rank sees " + std::to_string(gpus) + " for " +
             std::to_string(local_ranks) + " local ranks, or another rank is short)";
      return;
    }
    try {
      comm_ = make_nccl_communicator_from_mpi(MPI_COMM_WORLD);
    } catch (const std::exception& e) {
      setup_error_ = e.what();
    }
    int dev = 0;
    cudaGetDevice(&dev);
    sm90_ = all_ranks(comm_ && kernels::sm90_experts_supported(dev));
  }
  static void TearDownTestSuite() { comm_.reset(); }
  void SetUp() override {
    if (!ok_) GTEST_SKIP() << why_;
    ASSERT_TRUE(setup_error_.empty()) << "NCCL communicator from MPI: " << setup_error_;
  }
  static std::vector<ExpertPath> paths() {
    std::vector<ExpertPath> p = {ExpertPath::cublas};
    if (sm90_) p.push_back(ExpertPath::sm90);
    return p;
  }

  static inline std::shared_ptr<Communicator> comm_;
  static inline bool ok_ = false, sm90_ = false;
  static inline std::string why_, setup_error_;
};

const char* path_str(ExpertPath p) { return p == ExpertPath::sm90 ? "sm90" : "cublas"; }

MoeConfig cfg_of(const EpCase& c, int rank) {
  return MoeConfig{.num_experts = c.E, .top_k = c.k, .hidden = c.hidden, .ffn = c.ffn, .world_size = c.world,
                   .rank = rank};
}

// Every row this rank received, against what each source's protocol layout says it sent here.
void check_received(const EpCase& c, int me, const std::vector<bf16>& rows, const std::vector<int32_t>& meta,
                    const std::vector<int64_t>& per_rank) {
  const int El = c.E / c.world, mw = protocol::meta_words(c.k);
  ASSERT_EQ(per_rank.size(), size_t(c.world));
  int64_t base = 0;
  for (int p = 0; p < c.world; ++p) {
    const Routing R = routing_of(c, p);
    const int64_t Tp = c.tokens_of(p);
    // Independent count: p's tokens with at least one expert on me.
    int64_t expect_rows = 0;
    for (int64_t t = 0; t < Tp; ++t)
      expect_rows += std::any_of(R.ids.begin() + t * c.k, R.ids.begin() + (t + 1) * c.k,
                                 [&](int32_t e) { return e >= 0 && e / El == me; });
    ASSERT_EQ(per_rank[p], expect_rows) << "rows from rank " << p;
    const protocol::DispatchLayout L = protocol::dispatch_layout(R.ids.data(), R.weights.data(), Tp, cfg_of(c, p));
    ASSERT_TRUE(L.status.ok());
    ASSERT_EQ(L.send_rows[me], expect_rows);
    for (int64_t i = 0; i < expect_rows; ++i) {
      const int64_t row = base + i, src = L.send_offsets[me] + i;
      const int32_t t = L.send_token[src];
      ASSERT_EQ(0, std::memcmp(&meta[row * mw], &L.send_meta[src * mw], mw * sizeof(int32_t)))
          << "metadata of row " << row << " (rank " << p << ", token " << t << ")";
      for (int col = 0; col < c.hidden; ++col)
        ASSERT_EQ(rows[row * c.hidden + col].bits, x_value(c.seed, p, t, col).bits)
            << "row " << row << " (rank " << p << ", token " << t << ") col " << col;
    }
    base += per_rank[p];
  }
  ASSERT_EQ(base, int64_t(rows.size()) / c.hidden);
}

void run_case(const EpCase& c, const std::shared_ptr<Communicator>& comm, ExpertPath path, int repeats = 1) {
  const int me = comm->rank(), El = c.E / c.world;
  ASSERT_EQ(c.world, comm->world_size());
  SCOPED_TRACE(c.name() + " path=" + path_str(path) + " rank " + std::to_string(me));
  int dev = 0;
  ck(cudaGetDevice(&dev), "cudaGetDevice");
  const ModelWeights M = make_weights(c.E, c.hidden, c.ffn, mix(c.seed, 7));
  Dev<bf16> w1(std::vector<bf16>(M.w1_of(me * El), M.w1_of((me + 1) * El)));
  Dev<bf16> w2(std::vector<bf16>(M.w2_of(me * El), M.w2_of((me + 1) * El)));
  const MoeConfig cfg = cfg_of(c, me);
  LayerOptions opt;
  opt.expert_path = path;
  const ExpertWeights W{
      TensorView::contiguous(w1.get(), DType::bf16, {El, 2 * int64_t(c.ffn), c.hidden}, DeviceType::cuda, dev),
      TensorView::contiguous(w2.get(), DType::bf16, {El, int64_t(c.hidden), c.ffn}, DeviceType::cuda, dev)};
  // The engine directly (not MoeLayer) for gpu_dispatch_view.
  std::unique_ptr<MoeLayer::Engine> engine = make_gpu_engine(cfg, W, comm, opt);
  ASSERT_EQ(engine->path, path);

  const int64_t T = c.tokens_of(me);
  const std::vector<bf16> x = make_x(c.seed, me, T, c.hidden);
  const Routing R = routing_of(c, me);
  std::vector<float> ref(size_t(T) * c.hidden);
  reference_moe(x.data(), R.ids.data(), R.weights.data(), T, c.k, M.w1.data(), M.w2.data(), c.E, c.hidden, c.ffn,
                ref.data());
  Dev<bf16> d_x(x);
  Dev<int32_t> d_ids(R.ids);
  Dev<float> d_w(R.weights);
  cudaStream_t stream;
  ck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  for (int rep = 0; rep < repeats; ++rep) {
    Dev<bf16> d_y(size_t(T) * c.hidden, 0xff);  // NaN bits: every element must be written
    engine->forward(TensorView::contiguous(d_x.get(), DType::bf16, {T, c.hidden}, DeviceType::cuda, dev),
                    TensorView::contiguous(d_ids.get(), DType::i32, {T, c.k}, DeviceType::cuda, dev),
                    TensorView::contiguous(d_w.get(), DType::f32, {T, c.k}, DeviceType::cuda, dev),
                    TensorView::contiguous(d_y.get(), DType::bf16, {T, c.hidden}, DeviceType::cuda, dev), stream,
                    nullptr);
    ck(cudaStreamSynchronize(stream), "sync");

    const GpuDispatchView v = gpu_dispatch_view(*engine);
    ASSERT_EQ(v.meta_words, protocol::meta_words(c.k));
    std::vector<bf16> rows(size_t(v.recv_rows) * c.hidden);
    std::vector<int32_t> meta(size_t(v.recv_rows) * v.meta_words);
    if (v.recv_rows > 0) {
      ck(cudaMemcpy(rows.data(), v.recv_x, rows.size() * sizeof(bf16), cudaMemcpyDeviceToHost), "rows");
      ck(cudaMemcpy(meta.data(), v.recv_meta, meta.size() * sizeof(int32_t), cudaMemcpyDeviceToHost), "meta");
    }
    check_received(c, me, rows, meta, v.rows_per_rank);

    const std::vector<bf16> y = d_y.host();
    EXPECT_TRUE(close_to_reference(y.data(), ref.data(), T, c.hidden, kGpuTolerance));

    // Deduplicated rows: one per (token, destination rank), never one per (token, slot).
    const ForwardStats& s = engine->stats;
    int64_t dedup = 0, pairs = 0;
    for (int64_t t = 0; t < T; ++t) {
      uint64_t mask = 0;
      for (int j = 0; j < c.k; ++j)
        if (R.ids[t * c.k + j] >= 0) mask |= 1ull << (R.ids[t * c.k + j] / El), ++pairs;
      dedup += __builtin_popcountll(mask);
    }
    int64_t sent = 0;
    for (int64_t r : s.send_rows) sent += r;
    EXPECT_EQ(sent, dedup);
    EXPECT_LE(sent, pairs);
    EXPECT_EQ(s.dispatch_bytes, dedup * (int64_t(c.hidden) * 2 + 4 * protocol::meta_words(c.k)));
    EXPECT_EQ(s.combine_bytes, v.recv_rows * int64_t(c.hidden) * 2);
    EXPECT_EQ(s.tokens, T);
  }
  ck(cudaStreamDestroy(stream), "stream destroy");
}

EpCase gpu_case(int E, int k, int hidden, int ffn, int64_t T, RoutingKind routing, int focus = 0) {
  return make_ep_case(mpi_world(), E, k, hidden, ffn, T, routing, focus, uint64_t(131 * E + k));
}

TEST_F(ForwardMpiGpu, Uniform) {
  for (ExpertPath p : paths()) run_case(gpu_case(8, 2, 1024, 256, 96, RoutingKind::uniform), comm_, p);
}
TEST_F(ForwardMpiGpu, ZipfLargeK) {
  for (ExpertPath p : paths()) run_case(gpu_case(32, 8, 1024, 128, 64, RoutingKind::zipf), comm_, p);
}
TEST_F(ForwardMpiGpu, Hidden7168) {
  for (ExpertPath p : paths()) run_case(gpu_case(8, 4, 7168, 256, 48, RoutingKind::uniform), comm_, p);
}
TEST_F(ForwardMpiGpu, AllToOneExpert) {  // expert E-1 lives on the last rank: one rank does all the work
  for (ExpertPath p : paths()) run_case(gpu_case(8, 2, 1024, 128, 64, RoutingKind::one_expert, 7), comm_, p);
}
TEST_F(ForwardMpiGpu, DropsAndEmptyRows) {
  for (ExpertPath p : paths()) run_case(gpu_case(32, 4, 1024, 128, 64, RoutingKind::with_drops), comm_, p);
}
TEST_F(ForwardMpiGpu, AllDropped) {
  for (ExpertPath p : paths()) run_case(gpu_case(8, 2, 1024, 128, 32, RoutingKind::all_dropped), comm_, p);
}
TEST_F(ForwardMpiGpu, OnlyRankZeroExpertsUsed) {
  for (ExpertPath p : paths()) run_case(gpu_case(8, 2, 1024, 128, 64, RoutingKind::local_only, 0), comm_, p);
}
TEST_F(ForwardMpiGpu, RankWithZeroTokens) {
  EpCase c = gpu_case(8, 2, 1024, 128, 0, RoutingKind::uniform);
  for (int r = 0; r < c.world; ++r) c.tokens[r] = r == 1 ? 0 : 40 + r;
  for (ExpertPath p : paths()) run_case(c, comm_, p);
}
TEST_F(ForwardMpiGpu, EveryRankZeroTokens) {
  for (ExpertPath p : paths()) run_case(gpu_case(8, 2, 1024, 128, 0, RoutingKind::uniform), comm_, p);
}
TEST_F(ForwardMpiGpu, UnevenTokensRepeated) {  // buffers reused across calls on one engine
  EpCase c = gpu_case(16, 4, 1024, 256, 0, RoutingKind::zipf);
  for (int r = 0; r < c.world; ++r) c.tokens[r] = 1 + 150 * r;
  for (ExpertPath p : paths()) run_case(c, comm_, p, /*repeats=*/3);
}

// A bad id on the last rank fails every rank with the same error; the layer works afterwards.
TEST_F(ForwardMpiGpu, BadIdOnLastRankFailsEveryRank) {
  const int Wd = mpi_world(), me = comm_->rank();
  EpCase c = gpu_case(4 * Wd, 2, 1024, 128, 16, RoutingKind::uniform);
  const int El = c.E / Wd;
  int dev = 0;
  ck(cudaGetDevice(&dev), "cudaGetDevice");
  const ModelWeights M = make_weights(c.E, c.hidden, c.ffn, mix(c.seed, 7));
  Dev<bf16> w1(std::vector<bf16>(M.w1_of(me * El), M.w1_of((me + 1) * El)));
  Dev<bf16> w2(std::vector<bf16>(M.w2_of(me * El), M.w2_of((me + 1) * El)));
  MoeLayer layer(cfg_of(c, me),
                 {TensorView::contiguous(w1.get(), DType::bf16, {El, 2 * int64_t(c.ffn), c.hidden}, DeviceType::cuda, dev),
                  TensorView::contiguous(w2.get(), DType::bf16, {El, int64_t(c.hidden), c.ffn}, DeviceType::cuda, dev)},
                 comm_);
  const int64_t T = 16;
  const std::vector<bf16> x = make_x(c.seed, me, T, c.hidden);
  Routing R = routing_of(c, me);
  Dev<bf16> d_x(x), d_y(size_t(T) * c.hidden);
  Dev<float> d_w(R.weights);
  auto fwd = [&](const std::vector<int32_t>& ids) {
    Dev<int32_t> d_ids(ids);
    layer.forward(TensorView::contiguous(d_x.get(), DType::bf16, {T, c.hidden}, DeviceType::cuda, dev),
                  TensorView::contiguous(d_ids.get(), DType::i32, {T, c.k}, DeviceType::cuda, dev),
                  TensorView::contiguous(d_w.get(), DType::f32, {T, c.k}, DeviceType::cuda, dev),
                  TensorView::contiguous(d_y.get(), DType::bf16, {T, c.hidden}, DeviceType::cuda, dev), nullptr);
    ck(cudaStreamSynchronize(nullptr), "sync");
  };
  std::vector<int32_t> bad = R.ids;
  if (me == Wd - 1) bad[5 * c.k + 1] = c.E + 3;
  std::string text;
  try {
    fwd(bad);
    ADD_FAILURE() << "rank " << me << ": expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::expert_id_out_of_range);
    text = e.what();
    EXPECT_NE(text.find("rank " + std::to_string(Wd - 1)), std::string::npos) << text;
  }
  // Same text on every rank: compare lengths and a checksum through MPI.
  long long h[2] = {static_cast<long long>(text.size()), 0};
  for (char ch : text) h[1] = h[1] * 131 + static_cast<unsigned char>(ch);
  long long lo[2], hi[2];
  MPI_Allreduce(h, lo, 2, MPI_LONG_LONG, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(h, hi, 2, MPI_LONG_LONG, MPI_MAX, MPI_COMM_WORLD);
  EXPECT_TRUE(lo[0] == hi[0] && lo[1] == hi[1]) << "ranks raised different texts; mine: " << text;
  fwd(R.ids);  // recovers
  std::vector<float> ref(size_t(T) * c.hidden);
  reference_moe(x.data(), R.ids.data(), R.weights.data(), T, c.k, M.w1.data(), M.w2.data(), c.E, c.hidden, c.ffn,
                ref.data());
  const std::vector<bf16> y = d_y.host();
  EXPECT_TRUE(close_to_reference(y.data(), ref.data(), T, c.hidden, kGpuTolerance));
}

}  // namespace
}  // namespace epmoe::test
