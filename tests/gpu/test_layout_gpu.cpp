// The per-rank device kernels against the host protocol (src/ep_protocol.h), bit for bit:
// dispatch_layout + count headers, expert_layout, pack_rows, combine_reduce. No communicator: the
// layouts are per rank, and the destination's received metadata is synthesized from the sources'
// CPU layouts. Skips without a CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "ep_protocol.h"
#include "kernels/ep/combine_reduce.cuh"
#include "kernels/ep/dispatch_layout.cuh"
#include "kernels/ep/expert_layout.cuh"
#include "kernels/expert_problem.cuh"
#include "kernels/ep/pack_rows.cuh"
#include "kernels/ep/pack_rows_fp8b.cuh"
#include "kernels/ep/pack_rows_mx.cuh"
#include "epmoe/fp8_block.h"
#include "epmoe/mxfp8.h"
#include "test_support.h"

#include "device_array.h"

namespace epmoe::test {
namespace {

#define REQUIRE_CUDA()                              \
  do {                                              \
    std::string why_;                               \
    if (!cuda_available(why_)) GTEST_SKIP() << why_; \
  } while (0)

MoeConfig make_cfg(int E, int k, int W, int rank = 0) {
  return MoeConfig{.num_experts = E, .top_k = k, .hidden = 128, .ffn = 128, .world_size = W, .rank = rank};
}

// Bitwise equality of two vectors, reporting the first difference.
template <class T>
::testing::AssertionResult same_bits(const std::vector<T>& got, const std::vector<T>& want, const char* what) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << what << ": size " << got.size() << " != " << want.size();
  for (size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0)
      return ::testing::AssertionFailure() << what << "[" << i << "]: got " << got[i] << ", want " << want[i];
  return ::testing::AssertionSuccess();
}

struct DeviceLayout {
  std::vector<int64_t> status, send_rows, send_offsets, send_pairs, headers;
  std::vector<int32_t> token_row, send_meta, send_token;
};

// Runs the device dispatch layout and the count headers on ids/weights[T, k].
DeviceLayout run_dispatch_layout(const MoeConfig& cfg, int64_t T, const std::vector<int32_t>& ids,
                                 const std::vector<float>& weights) {
  const int W = cfg.world_size, k = cfg.top_k, El = cfg.experts_per_rank(), mw = protocol::meta_words(k);
  const int hw = protocol::header_words(El);
  const int64_t max_rows = T * std::min(k, W);
  Dev<int32_t> d_ids(ids);
  Dev<float> d_w(weights);
  Dev<int64_t> status(4), rows(W), offsets(W + 1), pairs(size_t(W) * El), headers(size_t(W) * hw);
  Dev<int32_t> token_row(size_t(T) * W), meta(size_t(max_rows) * mw), token(max_rows);
  const size_t ws_bytes = kernels::dispatch_layout_workspace_bytes(T, W);
  Dev<char> ws(ws_bytes);
  kernels::DispatchLayoutArgs a;
  a.topk_ids = d_ids.get();
  a.topk_weights = d_w.get();
  a.num_tokens = T;
  a.top_k = k;
  a.num_experts = cfg.num_experts;
  a.world = W;
  a.status = status.get();
  a.send_rows = rows.get();
  a.send_offsets = offsets.get();
  a.token_row = token_row.get();
  a.send_meta = meta.get();
  a.send_token = token.get();
  a.send_pairs = pairs.get();
  a.workspace = ws.get();
  a.workspace_bytes = ws_bytes;
  cudaStream_t s;
  ck(cudaStreamCreate(&s), "stream");
  kernels::dispatch_layout_launch(a, s);
  kernels::count_headers_launch(status.get(), rows.get(), pairs.get(), nullptr, W, El, headers.get(), s);
  ck(cudaStreamSynchronize(s), "sync");
  ck(cudaStreamDestroy(s), "stream destroy");
  DeviceLayout D;
  D.status = status.host();
  D.send_rows = rows.host();
  D.send_offsets = offsets.host();
  D.send_pairs = pairs.host();
  D.headers = headers.host();
  const int64_t total = D.send_offsets[W];
  D.token_row = token_row.host();
  D.send_meta = meta.host(size_t(std::clamp<int64_t>(total, 0, max_rows)) * mw);
  D.send_token = token.host(size_t(std::clamp<int64_t>(total, 0, max_rows)));
  return D;
}

void expect_same_layout(const MoeConfig& cfg, int64_t T, const Routing& R) {
  const protocol::DispatchLayout L = protocol::dispatch_layout(R.ids.data(), R.weights.data(), T, cfg);
  const DeviceLayout D = run_dispatch_layout(cfg, T, R.ids, R.weights);
  EXPECT_EQ(D.status[0], int64_t(L.status.code));
  EXPECT_EQ(D.status[1], L.status.a);
  EXPECT_EQ(D.status[2], L.status.b);
  EXPECT_EQ(D.status[3], L.status.c);
  EXPECT_TRUE(same_bits(D.send_rows, L.send_rows, "send_rows"));
  EXPECT_TRUE(same_bits(D.send_offsets, L.send_offsets, "send_offsets"));
  EXPECT_TRUE(same_bits(D.send_pairs, L.send_pairs, "send_pairs"));
  std::vector<int64_t> h;
  protocol::encode_count_headers(L, L.status, h);
  EXPECT_TRUE(same_bits(D.headers, h, "headers"));
  if (!L.status.ok()) return;
  EXPECT_TRUE(same_bits(D.token_row, L.token_row, "token_row"));
  EXPECT_TRUE(same_bits(D.send_token, L.send_token, "send_token"));
  EXPECT_TRUE(same_bits(D.send_meta, L.send_meta, "send_meta"));
}

std::string label(int E, int k, int W, int64_t T, RoutingKind kind) {
  std::ostringstream os;
  os << "E=" << E << " k=" << k << " world=" << W << " T=" << T << " routing=" << routing_name(kind);
  return os.str();
}

const RoutingKind kAllKinds[] = {RoutingKind::uniform,    RoutingKind::zipf,        RoutingKind::one_expert,
                                 RoutingKind::with_drops, RoutingKind::all_dropped, RoutingKind::local_only};

TEST(DispatchLayoutGpu, MatchesCpuOverRoutingsAndWorlds) {
  REQUIRE_CUDA();
  struct Shape {
    int E, k, W;
  };
  for (Shape sh : {Shape{16, 4, 1}, Shape{16, 4, 2}, Shape{32, 4, 4}, Shape{64, 8, 8}, Shape{8, 8, 8}})
    for (RoutingKind kind : kAllKinds)
      for (int64_t T : {int64_t(0), int64_t(1), int64_t(2), int64_t(777)}) {
        SCOPED_TRACE(label(sh.E, sh.k, sh.W, T, kind));
        const int focus = kind == RoutingKind::local_only ? sh.W - 1 : sh.E - 1;
        const Routing R = make_routing(T, sh.E, sh.k, kind, mix(11, T, sh.W), focus, sh.W);
        expect_same_layout(make_cfg(sh.E, sh.k, sh.W), T, R);
      }
}

TEST(DispatchLayoutGpu, LargeAndWideShapes) {
  REQUIRE_CUDA();
  {  // many blocks, shared-memory pair histogram
    SCOPED_TRACE("T=70000 E=64 k=8 world=8");
    expect_same_layout(make_cfg(64, 8, 8), 70000, make_routing(70000, 64, 8, RoutingKind::zipf, 5, 0, 8));
  }
  {  // 64 ranks: the top bit of the destination mask
    SCOPED_TRACE("world=64 local_only rank 63");
    expect_same_layout(make_cfg(128, 8, 64), 500, make_routing(500, 128, 8, RoutingKind::local_only, 6, 63, 64));
    expect_same_layout(make_cfg(128, 8, 64), 500, make_routing(500, 128, 8, RoutingKind::uniform, 7, 0, 64));
  }
  {  // more experts than the shared histogram holds: global atomics
    SCOPED_TRACE("E=16384");
    expect_same_layout(make_cfg(16384, 4, 2), 3000, make_routing(3000, 16384, 4, RoutingKind::uniform, 8, 0, 2));
  }
}

TEST(DispatchLayoutGpu, BadIdsGiveTheCpuStatus) {
  REQUIRE_CUDA();
  const int E = 16, k = 4, W = 2;
  const MoeConfig cfg = make_cfg(E, k, W);
  auto base = [&](int64_t T) { return make_routing(T, E, k, RoutingKind::uniform, 21, 0, W); };
  struct Bad {
    int64_t t;
    int j;
    int32_t value;  // >= 0 and == -3: set; -100: duplicate slot 0 of the row
  };
  const std::vector<std::vector<Bad>> cases = {
      {{17, 2, E}},                                   // just past the range
      {{0, 0, -2}},                                   // below -1
      {{5, 3, -100}},                                 // duplicate of slot 0
      {{30, 1, -100}, {17, 2, E + 5}},                // out of range comes first (row 17)
      {{9, 3, INT32_MAX}, {9, 1, -100}},              // in one row: the duplicate at slot 1 first
      {{40, 0, INT32_MIN}, {41, 0, 99}, {3, 2, -100}},
      {{999, 3, -100}},                               // last token, many blocks (T = 1000 below)
      {{998, 1, 77}, {999, 0, -2}, {256, 3, -100}},   // bad slots in several blocks: the smallest wins
  };
  for (size_t c = 0; c < cases.size(); ++c) {
    SCOPED_TRACE("case " + std::to_string(c));
    const int64_t T = c >= 6 ? 1000 : 50;
    Routing R = base(T);
    for (const Bad& b : cases[c]) R.ids[b.t * k + b.j] = b.value == -100 ? R.ids[b.t * k] : b.value;
    const protocol::DispatchLayout L = protocol::dispatch_layout(R.ids.data(), R.weights.data(), T, cfg);
    ASSERT_FALSE(L.status.ok());
    expect_same_layout(cfg, T, R);
  }
  {  // repeated -1 slots are fine
    Routing R = base(8);
    R.ids[2 * k + 0] = R.ids[2 * k + 1] = R.ids[2 * k + 3] = -1;
    const DeviceLayout D = run_dispatch_layout(cfg, 8, R.ids, R.weights);
    EXPECT_EQ(D.status[0], 0);
    expect_same_layout(cfg, 8, R);
  }
}

// The destination side: rows that `dest` receives from every source (synthesized from the
// sources' CPU layouts), laid out by expert on the device vs protocol::expert_layout.
void expect_same_expert_layout(int E, int k, int W, int dest, RoutingKind kind, const std::vector<int64_t>& tokens,
                               uint64_t seed, bool corrupt_counts = false) {
  const int El = E / W, mw = protocol::meta_words(k), tile = kernels::kExpertTile;
  std::vector<int32_t> recv_meta;
  std::vector<int64_t> counts(El, 0);
  for (int p = 0; p < W; ++p) {
    const Routing R = make_routing(tokens[p], E, k, kind, mix(seed, p), kind == RoutingKind::local_only ? dest : 0, W);
    const protocol::DispatchLayout L = protocol::dispatch_layout(R.ids.data(), R.weights.data(), tokens[p],
                                                                 make_cfg(E, k, W, p));
    ASSERT_TRUE(L.status.ok());
    recv_meta.insert(recv_meta.end(), L.send_meta.begin() + L.send_offsets[dest] * mw,
                     L.send_meta.begin() + L.send_offsets[dest + 1] * mw);
    for (int l = 0; l < El; ++l) counts[l] += L.send_pairs[size_t(dest) * El + l];
  }
  const int64_t R = int64_t(recv_meta.size()) / mw;
  const protocol::ExpertLayout X = protocol::expert_layout(recv_meta.data(), R, k, El, tile);
  if (corrupt_counts) counts[El / 2] += 1;  // the device must notice, and stay inside the segments
  // What the engine computes on the host from the headers' counts.
  std::vector<int64_t> offsets(El + 1, 0);
  for (int l = 0; l < El; ++l) offsets[l + 1] = offsets[l] + protocol::round_up(counts[l], tile);
  if (!corrupt_counts) {
    ASSERT_TRUE(same_bits(counts, X.expert_counts, "expert_counts (host, from headers)"));
    ASSERT_TRUE(same_bits(offsets, X.padded_offsets, "padded_offsets (host, from headers)"));
  }
  const int64_t P = offsets[El];
  Dev<int32_t> d_meta(recv_meta), d_pair_row(P), d_error(1, 0);
  Dev<float> d_pair_weight(P);
  Dev<int64_t> d_off(offsets), d_cnt(counts);
  const size_t ws_bytes = kernels::expert_layout_workspace_bytes(R, El);
  Dev<char> ws(ws_bytes);
  kernels::ExpertLayoutArgs a;
  a.recv_meta = d_meta.get();
  a.recv_rows = R;
  a.top_k = k;
  a.experts = El;
  a.padded_offsets = d_off.get();
  a.expert_counts = d_cnt.get();
  a.pair_row = d_pair_row.get();
  a.pair_weight = d_pair_weight.get();
  a.error_flag = d_error.get();
  a.workspace = ws.get();
  a.workspace_bytes = ws_bytes;
  kernels::expert_layout_launch(a, nullptr);
  ck(cudaDeviceSynchronize(), "sync");
  const int32_t err = d_error.host()[0];
  if (corrupt_counts) {
    EXPECT_EQ(err, 1) << "a count that disagrees with the metadata must raise the device flag";
    return;
  }
  EXPECT_EQ(err, 0);
  EXPECT_TRUE(same_bits(d_pair_row.host(), X.pair_row, "pair_row"));
  EXPECT_TRUE(same_bits(d_pair_weight.host(), X.pair_weight, "pair_weight"));
}

TEST(ExpertLayoutGpu, MatchesCpu) {
  REQUIRE_CUDA();
  struct Shape {
    int E, k, W;
  };
  for (Shape sh : {Shape{16, 4, 1}, Shape{16, 4, 2}, Shape{32, 4, 4}, Shape{64, 8, 8}})
    for (RoutingKind kind : kAllKinds)
      for (const std::vector<int64_t>& tok :
           {std::vector<int64_t>(sh.W, 300), std::vector<int64_t>(sh.W, 1), std::vector<int64_t>(sh.W, 0)})
        for (int dest : {0, sh.W - 1}) {
          SCOPED_TRACE(label(sh.E, sh.k, sh.W, tok[0], kind) + " dest=" + std::to_string(dest));
          expect_same_expert_layout(sh.E, sh.k, sh.W, dest, kind, tok, 31 + tok[0]);
        }
  {
    SCOPED_TRACE("uneven sources, one with no tokens");
    expect_same_expert_layout(32, 4, 4, 2, RoutingKind::zipf, {500, 0, 129, 1}, 41);
  }
  {
    SCOPED_TRACE("large: 40000 rows, all experts");
    expect_same_expert_layout(8, 8, 1, 0, RoutingKind::uniform, {40000}, 43);
  }
}

TEST(ExpertLayoutGpu, CountMismatchRaisesTheFlag) {
  REQUIRE_CUDA();
  expect_same_expert_layout(16, 4, 2, 1, RoutingKind::uniform, {200, 300}, 51, /*corrupt_counts=*/true);
}

TEST(PackAndReduceGpu, MatchCpu) {
  REQUIRE_CUDA();
  const int H = 256;
  for (int W : {1, 3, 8, 64})
    for (RoutingKind kind : {RoutingKind::uniform, RoutingKind::with_drops, RoutingKind::all_dropped}) {
      const int E = 2 * W, k = std::min(4, E);
      const int64_t T = 333;
      SCOPED_TRACE(label(E, k, W, T, kind));
      const MoeConfig cfg = make_cfg(E, k, W);
      const Routing R = make_routing(T, E, k, kind, mix(61, W), 0, W);
      const protocol::DispatchLayout L = protocol::dispatch_layout(R.ids.data(), R.weights.data(), T, cfg);
      ASSERT_TRUE(L.status.ok());
      const int64_t rows = L.total_rows();

      // pack: send_x[r] = x[send_token[r]]
      const std::vector<bf16> x = make_x(63, 0, T, H);
      Dev<bf16> d_x(x), d_send(size_t(rows) * H);
      Dev<int32_t> d_token(L.send_token);
      kernels::pack_rows_launch(reinterpret_cast<const __nv_bfloat16*>(d_x.get()), H, d_token.get(), rows,
                                reinterpret_cast<__nv_bfloat16*>(d_send.get()), nullptr);
      ck(cudaDeviceSynchronize(), "sync");
      const std::vector<bf16> send = d_send.host();
      for (int64_t r = 0; r < rows; ++r)
        ASSERT_EQ(0, std::memcmp(&send[size_t(r) * H], &x[size_t(L.send_token[r]) * H], H * sizeof(bf16)))
            << "packed row " << r;

      // reduce: random returned rows, fp32 sums in rank order, one rounding
      const std::vector<bf16> returned = random_bf16(size_t(rows) * H, mix(65, W), 1.0f);
      std::vector<bf16> y_cpu(size_t(T) * H);
      protocol::combine_reduce(L, returned.data(), H, y_cpu.data());
      Dev<bf16> d_ret(returned), d_y(size_t(T) * H, 0xff);
      Dev<int32_t> d_tr(L.token_row);
      kernels::combine_reduce_launch(reinterpret_cast<const __nv_bfloat16*>(d_ret.get()), d_tr.get(), T, W, H,
                                     reinterpret_cast<__nv_bfloat16*>(d_y.get()), nullptr);
      ck(cudaDeviceSynchronize(), "sync");
      const std::vector<bf16> y = d_y.host();
      for (size_t i = 0; i < y.size(); ++i)
        ASSERT_EQ(y[i].bits, y_cpu[i].bits) << "y[" << i / H << ", " << i % H << "]";
    }
}

// got [rows, bytes] against want_row(r, dst) (the host's packed row r, `bytes` long), byte for byte;
// reports the first differences (bytes past H are scales or padding).
template <class WantRow>
void expect_packed_rows(const std::vector<uint8_t>& got, int64_t rows, int64_t bytes, int H, WantRow&& want_row) {
  std::vector<uint8_t> want(static_cast<size_t>(bytes));
  int64_t bad = 0;
  for (int64_t r = 0; r < rows; ++r) {
    want_row(r, want.data());
    for (int64_t i = 0; i < bytes; ++i)
      if (got[size_t(r * bytes + i)] != want[size_t(i)] && bad++ < 5)
        ADD_FAILURE() << "row " << r << " byte " << i << (i < H ? " (element)" : " (scale or padding)") << ": 0x"
                      << std::hex << int(got[size_t(r * bytes + i)]) << ", want 0x" << int(want[size_t(i)]);
  }
  EXPECT_EQ(bad, 0);
}

// An MXFP8 layer's pack: each send row quantized to a packed MXFP8 row on the device, bit for bit
// the host's mx::quantize_packed_row (scales, E4M3 rounding and saturation, NaN blocks, the padding),
// on rows with a NaN, an infinity, an all-zero block, saturating and subnormal values, and widths
// whose scale bytes need padding (hidden 2048: 64, none; 160: 5, padded to 16; 7168: 224).
TEST(PackAndReduceGpu, PackRowsMxMatchesTheHostQuantizer) {
  REQUIRE_CUDA();
  for (int H : {2048, 160, 7168}) {
    SCOPED_TRACE("hidden " + std::to_string(H));
    const int64_t T = 53, rows = 97;
    std::vector<bf16> x = random_bf16(size_t(T) * H, mix(71, H), 1.0f);
    for (int64_t t = 0; t < T; ++t) {  // a few rows' blocks at the format's edges
      bf16* r = &x[size_t(t) * H];
      if (t % 5 == 1) r[(t * 37) % H] = bf16(std::nanf(""));
      if (t % 5 == 2) r[(t * 41) % H] = bf16(INFINITY);
      if (t % 5 == 3)
        for (int c = 32; c < 64; ++c) r[c] = bf16(0.0f);
      if (t % 5 == 4)
        for (int c = 0; c < H; ++c) r[c] = bf16(r[c].f() * (c % 64 < 32 ? 3.0e30f : 1.0e-38f));
    }
    std::vector<int32_t> token(rows);
    for (int64_t r = 0; r < rows; ++r) token[size_t(r)] = int32_t(mix(73, r) % uint64_t(T));
    const int64_t bytes = mx::packed_row_bytes(H);
    Dev<bf16> d_x(x);
    Dev<int32_t> d_token(token);
    Dev<uint8_t> d_send(size_t(rows * bytes));  // (poisoned: the padding must be written too)
    kernels::pack_rows_mx_launch(reinterpret_cast<const __nv_bfloat16*>(d_x.get()), H, d_token.get(), rows,
                                 d_send.get(), nullptr);
    ck(cudaDeviceSynchronize(), "sync");
    const std::vector<uint8_t> got = d_send.host();
    expect_packed_rows(got, rows, bytes, H, [&](int64_t r, uint8_t* want) {
      mx::quantize_packed_row(&x[size_t(token[size_t(r)]) * H], H, want);
    });
  }
}

// forward_mxfp8's pack: rows already in MXFP8 copied into packed rows, byte for byte mx::pack_row
// (the padding zeroed), at widths with and without scale padding.
TEST(PackAndReduceGpu, PackRowsMxGivenCopiesThePackedRow) {
  REQUIRE_CUDA();
  for (int H : {2048, 384, 7168}) {
    SCOPED_TRACE("hidden " + std::to_string(H));
    const int64_t T = 41, rows = 67;
    const std::vector<bf16> x = random_bf16(size_t(T) * H, mix(79, H), 1.0f);
    std::vector<uint8_t> q(size_t(T) * H), sc(size_t(T) * H / 32);
    mx::quantize_rows(x.data(), T, H, q.data(), sc.data());
    std::vector<int32_t> token(rows);
    for (int64_t r = 0; r < rows; ++r) token[size_t(r)] = int32_t(mix(81, r) % uint64_t(T));
    const int64_t bytes = mx::packed_row_bytes(H);
    Dev<uint8_t> d_q(q), d_s(sc), d_send(size_t(rows * bytes));  // (send poisoned)
    Dev<int32_t> d_token(token);
    kernels::pack_rows_mx_given_launch(d_q.get(), d_s.get(), H, d_token.get(), rows, d_send.get(), nullptr);
    ck(cudaDeviceSynchronize(), "sync");
    const std::vector<uint8_t> got = d_send.host();
    expect_packed_rows(got, rows, bytes, H, [&](int64_t r, uint8_t* want) {
      const int64_t t = token[size_t(r)];
      mx::pack_row(&q[size_t(t) * H], &sc[size_t(t) * H / 32], H, want);
    });
  }
}

// An FP8 block-128 layer's pack: bit for bit the host's fp8b::quantize_packed_row (the amax / 448 scale
// by an IEEE division, E4M3 of v / scale, zero blocks at scale 1, NaN and infinite blocks at the NaN
// scale, the padding), on rows with a NaN, an infinity, an all-zero block, saturating and subnormal
// values, at widths whose scale words need padding (hidden 2048: 16 words, none; 384: 3, padded to 4;
// 7168: 56).
TEST(PackAndReduceGpu, PackRowsFp8BlockMatchesTheHostQuantizer) {
  REQUIRE_CUDA();
  for (int H : {2048, 384, 7168}) {
    SCOPED_TRACE("hidden " + std::to_string(H));
    const int64_t T = 53, rows = 97;
    std::vector<bf16> x = random_bf16(size_t(T) * H, mix(75, H), 1.0f);
    for (int64_t t = 0; t < T; ++t) {
      bf16* r = &x[size_t(t) * H];
      if (t % 5 == 1) r[(t * 37) % H] = bf16(std::nanf(""));
      if (t % 5 == 2) r[(t * 41) % H] = bf16(-INFINITY);
      if (t % 5 == 3)
        for (int c = 128; c < 256 && c < H; ++c) r[c] = bf16(0.0f);
      if (t % 5 == 4)
        for (int c = 0; c < H; ++c) r[c] = bf16(r[c].f() * (c % 256 < 128 ? 3.0e30f : 1.0e-38f));
    }
    std::vector<int32_t> token(rows);
    for (int64_t r = 0; r < rows; ++r) token[size_t(r)] = int32_t(mix(77, r) % uint64_t(T));
    const int64_t bytes = fp8b::packed_row_bytes(H);
    Dev<bf16> d_x(x);
    Dev<int32_t> d_token(token);
    Dev<uint8_t> d_send(size_t(rows * bytes));  // (poisoned: the padding must be written too)
    kernels::pack_rows_fp8b_launch(reinterpret_cast<const __nv_bfloat16*>(d_x.get()), H, d_token.get(), rows,
                                   d_send.get(), nullptr);
    ck(cudaDeviceSynchronize(), "sync");
    const std::vector<uint8_t> got = d_send.host();
    expect_packed_rows(got, rows, bytes, H, [&](int64_t r, uint8_t* want) {
      fp8b::quantize_packed_row(&x[size_t(token[size_t(r)]) * H], H, want);
    });
  }
}

// The capturable forward's quantization of x: no token list (row r from x[r]) and a device count
// (read when the kernel runs): rows below min(rows, count) are the host quantizer's bytes, the rest
// keep their poison (never written), for both formats, x given in MXFP8 (the copy of
// forward_capturable_mxfp8), and counts 0, 1, 37, rows and past rows.
TEST(PackAndReduceGpu, PackRowsByDeviceCountWritesOnlyThoseRows) {
  REQUIRE_CUDA();
  const int H = 384;
  const int64_t rows = 40;
  const std::vector<bf16> x = random_bf16(size_t(rows) * H, 83, 1.0f);
  Dev<bf16> d_x(x);
  std::vector<uint8_t> hq(size_t(rows) * H), hs(size_t(rows) * H / 32);
  mx::quantize_rows(x.data(), rows, H, hq.data(), hs.data());
  Dev<uint8_t> d_q(hq), d_s(hs);
  for (int form = 0; form < 3; ++form)  // MXFP8 quantized, block-128 quantized, MXFP8 given
    for (int64_t count : {int64_t(0), int64_t(1), int64_t(37), rows, rows + 5}) {
      const bool block = form == 1;
      SCOPED_TRACE(std::string(form == 0 ? "MXFP8" : form == 1 ? "block-128" : "MXFP8 given") + " count " +
                   std::to_string(count));
      const int64_t bytes = block ? fp8b::packed_row_bytes(H) : mx::packed_row_bytes(H);
      Dev<uint8_t> d_send(size_t(rows * bytes), 0x5a);
      Dev<int64_t> d_count(std::vector<int64_t>{count});
      const auto* xb = reinterpret_cast<const __nv_bfloat16*>(d_x.get());
      if (form == 1)
        kernels::pack_rows_fp8b_launch(xb, H, nullptr, rows, d_send.get(), nullptr, d_count.get());
      else if (form == 0)
        kernels::pack_rows_mx_launch(xb, H, nullptr, rows, d_send.get(), nullptr, d_count.get());
      else
        kernels::pack_rows_mx_given_launch(d_q.get(), d_s.get(), H, nullptr, rows, d_send.get(), nullptr,
                                           d_count.get());
      ck(cudaDeviceSynchronize(), "sync");
      const std::vector<uint8_t> got = d_send.host();
      const int64_t written = std::min(rows, count);
      std::vector<uint8_t> want(static_cast<size_t>(bytes));
      int64_t bad = 0;
      for (int64_t r = 0; r < rows; ++r) {
        if (r < written) {
          if (block) fp8b::quantize_packed_row(&x[size_t(r) * H], H, want.data());
          else mx::quantize_packed_row(&x[size_t(r) * H], H, want.data());
        } else {
          std::fill(want.begin(), want.end(), uint8_t(0x5a));
        }
        bad += std::memcmp(got.data() + r * bytes, want.data(), size_t(bytes)) != 0 ? 1 : 0;
      }
      EXPECT_EQ(bad, 0) << "rows differing from the quantizer's (below the count) or from the poison (past it)";
    }
}

}  // namespace
}  // namespace epmoe::test
