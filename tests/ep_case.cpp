#include "ep_case.h"

#include <cmath>
#include <cstring>
#include <mutex>
#include <sstream>
#include <tuple>

#include "epmoe/reference.h"

namespace epmoe::test {

std::string EpCase::name() const {
  std::ostringstream os;
  os << "E" << E << "_k" << k << "_h" << hidden << "_f" << ffn << "_w" << world << "_" << routing_name(routing);
  return os.str();
}

EpCase make_ep_case(int world, int E, int k, int hidden, int ffn, int64_t T, RoutingKind routing, int focus,
                    uint64_t seed) {
  EpCase c;
  c.world = world;
  c.E = E;
  c.k = k;
  c.hidden = hidden;
  c.ffn = ffn;
  c.tokens.assign(world, T);
  c.routing = routing;
  c.focus = focus;
  c.seed = seed;
  return c;
}

Routing routing_of(const EpCase& c, int rank) {
  return make_routing(c.tokens_of(rank), c.E, c.k, c.routing, mix(c.seed, 100 + rank), c.focus, c.world);
}

namespace {

// Checks the rows this rank received against what each source must have sent it.
void check_received(const EpCase& c, int me, const bf16* rows, const int32_t* meta,
                    const std::vector<int64_t>& rows_per_rank) {
  const int El = c.E / c.world, mw = 1 + 2 * c.k;
  int64_t base = 0;
  for (int p = 0; p < c.world; ++p) {
    const Routing R = routing_of(c, p);
    // Expected: p's tokens with >= 1 expert on me, ascending, each once.
    std::vector<int64_t> expect_tokens;
    for (int64_t t = 0; t < c.tokens_of(p); ++t)
      for (int j = 0; j < c.k; ++j)
        if (R.ids[t * c.k + j] >= 0 && R.ids[t * c.k + j] / El == me) {
          expect_tokens.push_back(t);
          break;
        }
    ASSERT_EQ(rows_per_rank[p], int64_t(expect_tokens.size())) << "rank " << me << ": rows from rank " << p;
    for (size_t i = 0; i < expect_tokens.size(); ++i) {
      const int64_t row = base + int64_t(i), t = expect_tokens[i];
      const int32_t* m = meta + row * mw;
      ASSERT_EQ(m[0], t) << "rank " << me << ": row " << row << " from rank " << p << " names the wrong token";
      for (int col = 0; col < c.hidden; ++col)
        ASSERT_EQ(rows[row * c.hidden + col].bits, x_value(c.seed, p, t, col).bits)
            << "rank " << me << ": row " << row << " (rank " << p << ", token " << t << ") col " << col;
      int n = 0;
      for (int j = 0; j < c.k; ++j) {
        const int32_t e = R.ids[t * c.k + j];
        if (e < 0 || e / El != me) continue;
        ASSERT_EQ(m[1 + n], e - me * El) << "local expert of slot " << j;
        float w;
        std::memcpy(&w, &m[1 + c.k + n], 4);
        ASSERT_EQ(w, R.weights[t * c.k + j]) << "weight of slot " << j;
        ++n;
      }
      for (int j = n; j < c.k; ++j) ASSERT_EQ(m[1 + j], -1) << "unused slot " << j << " must be -1";
    }
    base += rows_per_rank[p];
  }
}

// Mock ranks share one process: generate each weight set once and hand it to every rank.
std::shared_ptr<const ModelWeights> shared_weights(int E, int hidden, int ffn, uint64_t seed) {
  static std::mutex mu;
  static std::tuple<int, int, int, uint64_t> key{-1, -1, -1, 0};
  static std::shared_ptr<const ModelWeights> cached;
  std::lock_guard<std::mutex> lock(mu);
  if (!cached || key != std::make_tuple(E, hidden, ffn, seed)) {
    cached.reset();
    cached = std::make_shared<const ModelWeights>(make_weights(E, hidden, ffn, seed));
    key = {E, hidden, ffn, seed};
  }
  return cached;
}

}  // namespace

EpRankReport run_ep_case_cpu(const EpCase& c, std::shared_ptr<Communicator> comm) {
  const int me = comm->rank();
  const int64_t T = c.tokens_of(me);
  const auto Mp = shared_weights(c.E, c.hidden, c.ffn, mix(c.seed, 7));
  const ModelWeights& M = *Mp;
  const int El = c.E / c.world;
  MoeConfig cfg{.num_experts = c.E, .top_k = c.k, .hidden = c.hidden, .ffn = c.ffn, .world_size = c.world, .rank = me};
  ExpertWeights W{
      TensorView::contiguous(const_cast<bf16*>(M.w1_of(me * El)), DType::bf16, {El, 2 * int64_t(c.ffn), c.hidden}),
      TensorView::contiguous(const_cast<bf16*>(M.w2_of(me * El)), DType::bf16, {El, int64_t(c.hidden), c.ffn})};
  LayerOptions opt;
  bool observed = false;
  opt.on_receive = [&](const void* rows, const int32_t* meta, const std::vector<int64_t>& per_rank) {
    observed = true;
    check_received(c, me, static_cast<const bf16*>(rows), meta, per_rank);
  };
  MoeLayer layer(cfg, W, comm, opt);

  std::vector<bf16> x = make_x(c.seed, me, T, c.hidden);
  Routing R = routing_of(c, me);
  std::vector<bf16> y(size_t(T) * c.hidden, bf16(std::nanf("")));  // poisoned: every element must be written
  layer.forward(TensorView::contiguous(x.data(), DType::bf16, {T, c.hidden}),
                TensorView::contiguous(R.ids.data(), DType::i32, {T, c.k}),
                TensorView::contiguous(R.weights.data(), DType::f32, {T, c.k}),
                TensorView::contiguous(y.data(), DType::bf16, {T, c.hidden}));
  EXPECT_TRUE(observed);

  std::vector<float> ref(size_t(T) * c.hidden);
  reference_moe(x.data(), R.ids.data(), R.weights.data(), T, c.k, M.w1.data(), M.w2.data(), c.E, c.hidden, c.ffn,
                ref.data());
  EXPECT_TRUE(close_to_reference(y.data(), ref.data(), T, c.hidden, c.tol)) << c.name() << " rank " << me;

  // Rows sent are deduplicated per destination: count distinct destination ranks per token.
  const ForwardStats& s = layer.last_stats();
  int64_t dedup = 0;
  for (int64_t t = 0; t < T; ++t) {
    uint64_t mask = 0;
    for (int j = 0; j < c.k; ++j)
      if (R.ids[t * c.k + j] >= 0) mask |= 1ull << (R.ids[t * c.k + j] / El);
    dedup += __builtin_popcountll(mask);
  }
  int64_t sent = 0;
  for (int64_t v : s.send_rows) sent += v;
  EXPECT_EQ(sent, dedup) << "rows sent must be one per (token, destination rank)";
  EpRankReport rep;
  rep.rows_sent = sent;
  for (int64_t v : s.recv_rows) rep.rows_received += v;
  rep.stats = s;
  return rep;
}

}  // namespace epmoe::test
