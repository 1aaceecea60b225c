// Bad input on one rank gives the same named error on every rank, quickly, never a hang: every
// test runs 4 mock ranks under a 20 s collective deadline and asserts it finished within 10 s.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>

#include "comm/mock_comm.h"
#include "epmoe/error.h"
#include "epmoe/moe_layer.h"
#include "test_support.h"

namespace epmoe::test {
namespace {

constexpr int kWorld = 4, kE = 16, kK = 4, kH = 128, kF = 128;
constexpr int64_t kT = 32;

struct RankData {
  MoeConfig cfg;
  std::vector<bf16> w1, w2, x, y;
  Routing R;
  int64_t T = kT;
  int k = kK;
};

RankData make_rank(int rank) {
  RankData d;
  d.cfg = MoeConfig{.num_experts = kE, .top_k = kK, .hidden = kH, .ffn = kF, .world_size = kWorld, .rank = rank};
  const int El = kE / kWorld;
  d.w1 = random_bf16(size_t(El) * 2 * kF * kH, mix(5, rank), 0.1f);
  d.w2 = random_bf16(size_t(El) * kH * kF, mix(6, rank), 0.1f);
  d.x = make_x(9, rank, kT, kH);
  d.y.assign(size_t(kT) * kH, bf16(0.f));
  d.R = make_routing(kT, kE, kK, RoutingKind::uniform, mix(3, rank));
  return d;
}

ExpertWeights weights_of(RankData& d) {
  const int El = d.cfg.num_experts / d.cfg.world_size;
  return {TensorView::contiguous(d.w1.data(), DType::bf16, {El, 2 * int64_t(d.cfg.ffn), d.cfg.hidden}),
          TensorView::contiguous(d.w2.data(), DType::bf16, {El, int64_t(d.cfg.hidden), d.cfg.ffn})};
}

void forward(MoeLayer& layer, RankData& d) {
  layer.forward(TensorView::contiguous(d.x.data(), DType::bf16, {d.T, kH}),
                TensorView::contiguous(d.R.ids.data(), DType::i32, {d.T, d.k}),
                TensorView::contiguous(d.R.weights.data(), DType::f32, {d.T, d.k}),
                TensorView::contiguous(d.y.data(), DType::bf16, {d.T, kH}));
}

// Runs `body` on 4 mock ranks; returns each rank's error (code + text), "" for none.
struct Outcome {
  std::vector<ErrorCode> codes;
  std::vector<std::string> texts;
};
Outcome run4(const std::function<void(int, std::shared_ptr<Communicator>)>& body) {
  const auto t0 = std::chrono::steady_clock::now();
  auto errs = run_mock_ranks(kWorld, body, /*deadline=*/20.0);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 10.0) << "an error must surface within seconds, not at the deadline";
  Outcome o;
  for (auto& e : errs) {
    o.codes.push_back(ErrorCode::ok);
    o.texts.emplace_back();
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const Error& err) {
      o.codes.back() = err.code();
      o.texts.back() = err.what();
    } catch (const std::exception& err) {
      o.codes.back() = ErrorCode::internal;
      o.texts.back() = std::string("non-epmoe exception: ") + err.what();
    }
  }
  return o;
}

// The same code and text on all ranks, and the text mentions `needle`.
void expect_same_error_everywhere(const Outcome& o, ErrorCode code, const std::string& needle) {
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(o.codes[r], code) << "rank " << r << ": " << o.texts[r];
    EXPECT_EQ(o.texts[r], o.texts[0]) << "rank " << r << " raised a different text";
    EXPECT_NE(o.texts[r].find(needle), std::string::npos) << "rank " << r << ": '" << o.texts[r] << "' lacks '"
                                                          << needle << "'";
  }
}

// A bad forward on rank `bad` (altered by `spoil`), then a good forward on all ranks: the layer
// must still work, since the failing exchange completed on every rank.
Outcome bad_forward_then_recover(int bad, const std::function<void(RankData&)>& spoil) {
  return run4([&](int rank, std::shared_ptr<Communicator> comm) {
    RankData d = make_rank(rank);
    MoeLayer layer(d.cfg, weights_of(d), comm);
    RankData bad_d = d;
    if (rank == bad) spoil(bad_d);
    try {
      forward(layer, bad_d);
    } catch (const Error&) {
      forward(layer, d);  // recovers: must not throw, must not hang
      throw;
    }
  });
}

TEST(BadInput, IdAtLeastE) {
  auto o = bad_forward_then_recover(2, [](RankData& d) { d.R.ids[5 * kK + 1] = kE; });
  expect_same_error_everywhere(o, ErrorCode::expert_id_out_of_range, "rank 2: topk_ids[5, 1] = 16");
}

TEST(BadInput, IdBelowMinusOne) {
  auto o = bad_forward_then_recover(0, [](RankData& d) { d.R.ids[3] = -7; });
  expect_same_error_everywhere(o, ErrorCode::expert_id_out_of_range, "rank 0: topk_ids[0, 3] = -7");
}

TEST(BadInput, DuplicateIdInRow) {
  auto o = bad_forward_then_recover(3, [](RankData& d) { d.R.ids[9 * kK + 2] = d.R.ids[9 * kK + 0]; });
  expect_same_error_everywhere(o, ErrorCode::duplicate_expert_id, "rank 3: topk_ids[9, 2]");
}

TEST(BadInput, WrongIdsShape) {
  auto o = bad_forward_then_recover(1, [](RankData& d) { d.k = kK - 1; });
  expect_same_error_everywhere(o, ErrorCode::invalid_argument, "rank 1: topk_ids: expected i32[32, 4]");
}

TEST(BadInput, WrongXDtype) {
  auto o = run4([&](int rank, std::shared_ptr<Communicator> comm) {
    RankData d = make_rank(rank);
    MoeLayer layer(d.cfg, weights_of(d), comm);
    TensorView x = TensorView::contiguous(d.x.data(), rank == 2 ? DType::f16 : DType::bf16, {kT, kH});
    layer.forward(x, TensorView::contiguous(d.R.ids.data(), DType::i32, {kT, kK}),
                  TensorView::contiguous(d.R.weights.data(), DType::f32, {kT, kK}),
                  TensorView::contiguous(d.y.data(), DType::bf16, {kT, kH}));
  });
  expect_same_error_everywhere(o, ErrorCode::invalid_argument, "rank 2: x: expected bf16[32, 128]");
}

TEST(BadInput, ExpertsNotDivisibleByWorld) {
  auto o = run4([&](int rank, std::shared_ptr<Communicator> comm) {
    RankData d = make_rank(rank);
    MoeConfig cfg = d.cfg;
    cfg.num_experts = 18;
    MoeLayer layer(cfg, weights_of(d), comm);
  });
  expect_same_error_everywhere(o, ErrorCode::invalid_config, "num_experts (18) % world_size (4) != 0");
}

TEST(BadInput, ConfigMismatchBetweenRanks) {
  auto o = run4([&](int rank, std::shared_ptr<Communicator> comm) {
    RankData d = make_rank(rank);
    MoeConfig cfg = d.cfg;
    if (rank == 3) cfg.ffn = 256;
    std::vector<bf16> w1(size_t(kE / kWorld) * 2 * cfg.ffn * kH), w2(size_t(kE / kWorld) * kH * cfg.ffn);
    ExpertWeights W{TensorView::contiguous(w1.data(), DType::bf16, {kE / kWorld, 2 * int64_t(cfg.ffn), kH}),
                    TensorView::contiguous(w2.data(), DType::bf16, {kE / kWorld, int64_t(kH), cfg.ffn})};
    MoeLayer layer(cfg, W, comm);
  });
  expect_same_error_everywhere(o, ErrorCode::config_mismatch, "ffn ranges over [128, 256]");
}

TEST(BadInput, WrongWeightShapeOnOneRank) {
  auto o = run4([&](int rank, std::shared_ptr<Communicator> comm) {
    RankData d = make_rank(rank);
    ExpertWeights W = weights_of(d);
    if (rank == 1) W.w2.shape[1] = kH / 2;
    MoeLayer layer(d.cfg, W, comm);
  });
  for (int r = 0; r < kWorld; ++r) {
    if (r == 1) {
      EXPECT_EQ(o.codes[r], ErrorCode::invalid_argument) << o.texts[r];
      EXPECT_NE(o.texts[r].find("w2: expected"), std::string::npos) << o.texts[r];
    } else {
      EXPECT_EQ(o.codes[r], ErrorCode::remote_error) << o.texts[r];
      EXPECT_NE(o.texts[r].find("rank 1 failed to build its layer"), std::string::npos) << o.texts[r];
    }
  }
}

TEST(BadInput, ValidInputRaisesNothing) {
  auto o = run4([&](int rank, std::shared_ptr<Communicator> comm) {
    RankData d = make_rank(rank);
    MoeLayer layer(d.cfg, weights_of(d), comm);
    forward(layer, d);
  });
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(o.codes[r], ErrorCode::ok) << o.texts[r];
}

}  // namespace
}  // namespace epmoe::test
