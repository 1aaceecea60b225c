// The protocol's pieces on hand-made inputs: orders, dedup, padding, status folding.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "ep_protocol.h"

namespace epmoe::protocol {
namespace {

MoeConfig cfg4() { return {.num_experts = 8, .top_k = 2, .hidden = 128, .ffn = 128, .world_size = 4, .rank = 0}; }

float wbits(int32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

TEST(DispatchLayout, OrderDedupAndMeta) {
  // E=8 over 4 ranks: experts 2r, 2r+1 on rank r.
  const int32_t ids[] = {1, 0,    // token 0: both on rank 0 -> one row to rank 0
                         7, 2,    // token 1: rank 3 and rank 1
                         -1, -1,  // token 2: dropped entirely
                         3, -1};  // token 3: rank 1
  const float w[] = {0.25f, 0.75f, 0.5f, 0.5f, 0, 0, 1.0f, 0};
  auto L = dispatch_layout(ids, w, 4, cfg4());
  ASSERT_TRUE(L.status.ok());
  EXPECT_EQ(L.send_rows, (std::vector<int64_t>{1, 2, 0, 1}));
  EXPECT_EQ(L.send_offsets, (std::vector<int64_t>{0, 1, 3, 3, 4}));
  EXPECT_EQ(L.send_token, (std::vector<int32_t>{0, 1, 3, 1}));
  const int mw = meta_words(2);
  // Row 0: token 0 to rank 0, local ids in slot order (1 then 0), weights in the same order.
  EXPECT_EQ(L.send_meta[0 * mw + 0], 0);
  EXPECT_EQ(L.send_meta[0 * mw + 1], 1);
  EXPECT_EQ(L.send_meta[0 * mw + 2], 0);
  EXPECT_EQ(wbits(L.send_meta[0 * mw + 3]), 0.25f);
  EXPECT_EQ(wbits(L.send_meta[0 * mw + 4]), 0.75f);
  // Row 2: token 3 to rank 1: local id 1, then -1.
  EXPECT_EQ(L.send_meta[2 * mw + 0], 3);
  EXPECT_EQ(L.send_meta[2 * mw + 1], 1);
  EXPECT_EQ(L.send_meta[2 * mw + 2], -1);
  EXPECT_EQ(wbits(L.send_meta[2 * mw + 3]), 1.0f);
  EXPECT_EQ(wbits(L.send_meta[2 * mw + 4]), 0.0f);
  // token_row: token 1 is row 1 at rank 1 and row 3 at rank 3.
  EXPECT_EQ(L.token_row[1 * 4 + 1], 1);
  EXPECT_EQ(L.token_row[1 * 4 + 3], 3);
  EXPECT_EQ(L.token_row[2 * 4 + 0], -1);
  EXPECT_EQ(L.send_pairs[0 * 2 + 0], 1);  // rank 0, local expert 0
  EXPECT_EQ(L.send_pairs[0 * 2 + 1], 1);
  EXPECT_EQ(L.send_pairs[1 * 2 + 0], 1);  // expert 2
  EXPECT_EQ(L.send_pairs[1 * 2 + 1], 1);  // expert 3
  EXPECT_EQ(L.send_pairs[3 * 2 + 1], 1);  // expert 7
}

TEST(DispatchLayout, FirstBadSlotWins) {
  const int32_t ids[] = {0, 1, 2, 2, 9, 0};
  const float w[6] = {};
  auto L = dispatch_layout(ids, w, 3, cfg4());
  EXPECT_EQ(L.status.code, ErrorCode::duplicate_expert_id);
  EXPECT_EQ(L.status.a, 1);
  EXPECT_EQ(L.status.b, 1);
  EXPECT_EQ(L.status.c, 2);
  const int32_t ids2[] = {0, 1, 5, -2};
  L = dispatch_layout(ids2, w, 2, cfg4());
  EXPECT_EQ(L.status.code, ErrorCode::expert_id_out_of_range);
  EXPECT_EQ(L.status.message(), "topk_ids[1, 1] = -2 is outside [-1, num_experts)");
}

TEST(CountHeaders, RoundTripAndLowestFailingRankWins) {
  const int W = 3, El = 2, hw = header_words(El);
  std::vector<int64_t> recv(size_t(W) * hw, 0);
  for (int p = 0; p < W; ++p) {
    recv[p * hw + kHdrRows] = 10 + p;
    recv[p * hw + kHdrPairs + 0] = p;
    recv[p * hw + kHdrPairs + 1] = 2 * p;
  }
  auto P = decode_count_headers(recv, W, El);
  EXPECT_EQ(P.recv_rows, (std::vector<int64_t>{10, 11, 12}));
  EXPECT_EQ(P.recv_offsets.back(), 33);
  EXPECT_EQ(P.expert_pairs, (std::vector<int64_t>{3, 6}));
  EXPECT_EQ(P.total_pairs(), 9);

  // Ranks 1 and 2 fail; everyone must raise rank 1's error.
  DispatchLayout L;
  L.world = W;
  L.experts_per_rank = El;
  Status s1{ErrorCode::invalid_argument, 0, 0, 0, "x: bad"};
  std::vector<int64_t> h1, h2;
  encode_count_headers(L, s1, h1);
  Status s2{ErrorCode::expert_id_out_of_range, 4, 1, 99, ""};
  encode_count_headers(L, s2, h2);
  for (int c = 0; c < hw; ++c) recv[1 * hw + c] = h1[0 * hw + c], recv[2 * hw + c] = h2[0 * hw + c];
  try {
    decode_count_headers(recv, W, El);
    FAIL() << "expected a throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_STREQ(e.what(), "epmoe: [invalid_argument] rank 1: x: bad");
  }
}

TEST(ExpertLayout, PaddedSegmentsInRowOrder) {
  const int k = 2, mw = meta_words(k);
  // 3 rows; local experts: row0 {1,0}, row1 {1,-1}, row2 {-1}
  std::vector<int32_t> meta(3 * mw, -1);
  auto put = [&](int r, int j, int e, float w) {
    meta[r * mw + 1 + j] = e;
    std::memcpy(&meta[r * mw + 1 + k + j], &w, 4);
  };
  put(0, 0, 1, 0.5f);
  put(0, 1, 0, 0.25f);
  put(1, 0, 1, 1.0f);
  auto X = expert_layout(meta.data(), 3, k, 3, 4);
  EXPECT_EQ(X.expert_counts, (std::vector<int64_t>{1, 2, 0}));
  EXPECT_EQ(X.padded_offsets, (std::vector<int64_t>{0, 4, 8, 8}));
  EXPECT_EQ(X.pair_row, (std::vector<int32_t>{0, -1, -1, -1, 0, 1, -1, -1}));
  EXPECT_EQ(X.pair_weight[0], 0.25f);
  EXPECT_EQ(X.pair_weight[4], 0.5f);
  EXPECT_EQ(X.pair_weight[5], 1.0f);
  EXPECT_EQ(X.pair_weight[6], 0.0f);
}

// The world-1 form agrees with expert_layout on the same pairs (meta rows built from the tokens'
// top-k, compacted as dispatch_layout would), and drops a -1 slot wherever it sits.
TEST(TokenExpertLayout, MatchesExpertLayoutAndDropsAnySlot) {
  const int k = 3, E = 4, tile = 4;
  const int32_t ids[] = {2, 0, 3,     // token 0
                         -1, 2, -1,   // token 1: -1 before a real slot
                         1, 2, 0,     // token 2
                         -1, -1, -1,  // token 3: routed nowhere
                         2, 3, -1};   // token 4
  const float w[] = {0.5f, 0.25f, 0.25f, 0, 1.0f, 0, 0.125f, 0.375f, 0.5f, 0, 0, 0, 0.75f, 0.25f, 0};
  const int64_t T = 5;
  auto X = token_expert_layout(ids, w, T, k, E, tile);
  const int mw = meta_words(k);
  std::vector<int32_t> meta(T * mw, -1);
  for (int64_t t = 0; t < T; ++t) {
    int n = 0;
    for (int j = 0; j < k; ++j)
      if (ids[t * k + j] >= 0) {
        meta[t * mw + 1 + n] = ids[t * k + j];
        std::memcpy(&meta[t * mw + 1 + k + n], &w[t * k + j], 4);
        ++n;
      }
  }
  auto Y = expert_layout(meta.data(), T, k, E, tile);
  EXPECT_EQ(X.expert_counts, (std::vector<int64_t>{2, 1, 4, 2}));
  EXPECT_EQ(X.expert_counts, Y.expert_counts);
  EXPECT_EQ(X.padded_offsets, (std::vector<int64_t>{0, 4, 8, 12, 16}));
  EXPECT_EQ(X.padded_offsets, Y.padded_offsets);
  EXPECT_EQ(X.pair_row, Y.pair_row);
  EXPECT_EQ(X.pair_weight, Y.pair_weight);
  EXPECT_EQ(X.pair_row, (std::vector<int32_t>{0, 2, -1, -1, 2, -1, -1, -1, 0, 1, 2, 4, 0, 4, -1, -1}));
  EXPECT_EQ(X.pair_weight[9], 1.0f);
  const int32_t bad[] = {0, 4, 1};
  EXPECT_THROW(token_expert_layout(bad, w, 1, k, E, tile), Error);
}

TEST(CombineReduce, SumsInRankOrderAndZeroesDropped) {
  DispatchLayout L;
  L.world = 2;
  L.num_tokens = 2;
  L.token_row = {0, 1, -1, -1};  // token 0 came back from both ranks, token 1 went nowhere
  const int H = 2;
  std::vector<bf16> ret = {bf16(1.5f), bf16(-2.f), bf16(0.25f), bf16(4.f)};
  std::vector<bf16> y(4, bf16(99.f));
  combine_reduce(L, ret.data(), H, y.data());
  EXPECT_EQ(y[0].f(), 1.75f);
  EXPECT_EQ(y[1].f(), 2.f);
  EXPECT_EQ(y[2].f(), 0.f);
  EXPECT_EQ(y[3].f(), 0.f);
}

TEST(MakePlane, BytesAndOffsets) {
  auto p = make_plane(nullptr, nullptr, {2, 0, 3}, {1, 4, 0}, 8);
  EXPECT_EQ(p.send_bytes, (std::vector<size_t>{16, 0, 24}));
  EXPECT_EQ(p.send_offsets, (std::vector<size_t>{0, 16, 16}));
  EXPECT_EQ(p.recv_bytes, (std::vector<size_t>{8, 32, 0}));
  EXPECT_EQ(p.recv_offsets, (std::vector<size_t>{0, 8, 40}));
}

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(bf16(1.0f).bits, 0x3F80);
  EXPECT_EQ(bf16::from_float(1.00390625f), 0x3F80);  // halfway, even stays
  EXPECT_EQ(bf16::from_float(1.01171875f), 0x3F82);  // halfway, odd rounds up
  EXPECT_TRUE(std::isnan(bf16(std::nanf("")).f()));
}

}  // namespace
}  // namespace epmoe::protocol
