#include "ep_protocol.h"

#include <algorithm>
#include <cstring>
#include <optional>

namespace epmoe::protocol {

std::string Status::message() const {
  if (!text.empty()) return text;
  switch (code) {
    case ErrorCode::ok: return "ok";
    case ErrorCode::expert_id_out_of_range:
      return detail::concat("topk_ids[", a, ", ", b, "] = ", c, " is outside [-1, num_experts)");
    case ErrorCode::duplicate_expert_id:
      return detail::concat("topk_ids[", a, ", ", b, "] = ", c, " repeats an expert already chosen for token ", a);
    default: return detail::concat(error_code_name(code), " (", a, ", ", b, ", ", c, ")");
  }
}

DispatchLayout empty_dispatch_layout(const MoeConfig& cfg) {
  const int W = cfg.world_size, El = cfg.experts_per_rank();
  DispatchLayout L;
  L.world = W;
  L.top_k = cfg.top_k;
  L.experts_per_rank = El;
  L.send_rows.assign(W, 0);
  L.send_offsets.assign(W + 1, 0);
  L.send_pairs.assign(size_t(W) * El, 0);
  return L;
}

DispatchLayout dispatch_layout(const int32_t* ids, const float* weights, int64_t T, const MoeConfig& cfg) {
  const int W = cfg.world_size, k = cfg.top_k, El = cfg.experts_per_rank(), E = cfg.num_experts;
  const int mw = meta_words(k);
  DispatchLayout L = empty_dispatch_layout(cfg);
  L.num_tokens = T;

  // Pass 1: validate (first bad slot in row-major order wins) and count.
  std::vector<uint64_t> dest_mask(T, 0);
  for (int64_t t = 0; t < T; ++t) {
    const int32_t* row = ids + t * k;
    for (int j = 0; j < k; ++j) {
      int32_t e = row[j];
      if (e == -1) continue;
      if (e < -1 || e >= E) {
        L.status = {ErrorCode::expert_id_out_of_range, t, j, e, {}};
        return L;
      }
      for (int i = 0; i < j; ++i)
        if (row[i] == e) {
          L.status = {ErrorCode::duplicate_expert_id, t, j, e, {}};
          return L;
        }
      dest_mask[t] |= uint64_t(1) << (e / El);
    }
  }
  for (int64_t t = 0; t < T; ++t)
    for (int r = 0; r < W; ++r)
      if (dest_mask[t] >> r & 1) ++L.send_rows[r];
  for (int r = 0; r < W; ++r) L.send_offsets[r + 1] = L.send_offsets[r] + L.send_rows[r];

  // Pass 2: fill rows, rank-major, tokens ascending within a rank.
  const int64_t rows = L.total_rows();
  L.send_meta.assign(size_t(rows) * mw, -1);
  L.send_token.assign(rows, -1);
  L.token_row.assign(size_t(T) * W, -1);
  std::vector<int64_t> cursor(L.send_offsets.begin(), L.send_offsets.end() - 1);
  for (int64_t t = 0; t < T; ++t) {
    if (!dest_mask[t]) continue;
    for (int r = 0; r < W; ++r) {
      if (!(dest_mask[t] >> r & 1)) continue;
      const int64_t row = cursor[r]++;
      L.send_token[row] = int32_t(t);
      L.token_row[t * W + r] = int32_t(row);
      int32_t* m = &L.send_meta[size_t(row) * mw];
      m[0] = int32_t(t);
      int n = 0;
      for (int j = 0; j < k; ++j) {
        int32_t e = ids[t * k + j];
        if (e < 0 || e / El != r) continue;
        m[1 + n] = e - r * El;
        std::memcpy(&m[1 + k + n], &weights[t * k + j], 4);
        ++L.send_pairs[size_t(r) * El + (e - r * El)];
        ++n;
      }
      for (int j = n; j < k; ++j) m[1 + k + j] = 0;  // weight 0 (bits) for unused slots
    }
  }
  return L;
}

void encode_count_headers(const DispatchLayout& L, const Status& status, std::vector<int64_t>& h) {
  const int W = L.world, El = L.experts_per_rank, hw = header_words(El);
  h.assign(size_t(W) * hw, 0);
  char msg[kMsgBytes] = {};
  std::strncpy(msg, status.text.c_str(), kMsgBytes - 1);
  for (int p = 0; p < W; ++p) {
    int64_t* b = &h[size_t(p) * hw];
    b[kHdrCode] = int64_t(status.code);
    b[kHdrA] = status.a;
    b[kHdrB] = status.b;
    b[kHdrC] = status.c;
    std::memcpy(&b[kHdrMsg], msg, kMsgBytes);
    if (!status.ok()) continue;  // an erring rank announces zero rows
    b[kHdrRows] = L.send_rows[p];
    for (int e = 0; e < El; ++e) b[kHdrPairs + e] = L.send_pairs[size_t(p) * El + e];
  }
}

int64_t ReceivePlan::total_pairs() const {
  int64_t n = 0;
  for (int64_t v : expert_pairs) n += v;
  return n;
}

ReceivePlan decode_count_headers(const std::vector<int64_t>& h, int W, int El) {
  const int hw = header_words(El);
  EPMOE_CHECK(h.size() == size_t(W) * hw, ErrorCode::internal, "count headers: ", h.size(), " words, expected ",
              size_t(W) * hw);
  // Every rank sees every rank's status (block p came from peer p): pick the lowest failing rank,
  // so all ranks raise the same text.
  for (int p = 0; p < W; ++p) {
    const int64_t* b = &h[size_t(p) * hw];
    if (b[kHdrCode] == 0) continue;
    // A code no rank can send is a corrupt header, not a peer's error.
    EPMOE_CHECK(b[kHdrCode] > 0 && b[kHdrCode] <= int64_t(ErrorCode::internal), ErrorCode::internal,
                "corrupt count header from rank ", p, ": status code ", b[kHdrCode]);
    Status s;
    s.code = ErrorCode(b[kHdrCode]);
    s.a = b[kHdrA];
    s.b = b[kHdrB];
    s.c = b[kHdrC];
    char msg[kMsgBytes];
    std::memcpy(msg, &b[kHdrMsg], kMsgBytes);
    msg[kMsgBytes - 1] = 0;
    s.text = msg;
    throw Error(s.code, detail::concat("epmoe: [", error_code_name(s.code), "] rank ", p, ": ", s.message()));
  }
  ReceivePlan P;
  P.world = W;
  P.experts_per_rank = El;
  P.recv_rows.assign(W, 0);
  P.recv_offsets.assign(W + 1, 0);
  P.recv_pairs.assign(size_t(W) * El, 0);
  P.expert_pairs.assign(El, 0);
  // Bounds a real header keeps (a corrupt one fails here, with the peer named, instead of sizing
  // buffers from garbage): rows in [0, 2^40), each pair count in [0, rows] (a row carries a local
  // expert at most once), and the totals far from overflow.
  constexpr int64_t kMaxRows = int64_t(1) << 40;
  for (int p = 0; p < W; ++p) {
    const int64_t* b = &h[size_t(p) * hw];
    const int64_t rows = b[kHdrRows];
    EPMOE_CHECK(rows >= 0 && rows < kMaxRows, ErrorCode::internal, "corrupt count header from rank ", p,
                ": row count ", rows);
    P.recv_rows[p] = rows;
    P.recv_offsets[p + 1] = P.recv_offsets[p] + rows;
    EPMOE_CHECK(P.recv_offsets[p + 1] < kMaxRows, ErrorCode::internal, "count headers: ", P.recv_offsets[p + 1],
                " rows received in all, beyond 2^40");
    for (int e = 0; e < El; ++e) {
      const int64_t pairs = b[kHdrPairs + e];
      EPMOE_CHECK(pairs >= 0 && pairs <= rows, ErrorCode::internal, "corrupt count header from rank ", p, ": ",
                  pairs, " pairs for local expert ", e, " in ", rows, " rows");
      P.recv_pairs[size_t(p) * El + e] = pairs;
      P.expert_pairs[e] += pairs;
    }
  }
  return P;
}

namespace {
// From X.expert_counts and X.tile: tile-padded segment offsets, padding-filled pair arrays (row -1,
// weight 0), and each expert's fill cursor (its segment start).
std::vector<int64_t> place_segments(ExpertLayout& X) {
  const int E = int(X.expert_counts.size());
  X.padded_offsets.assign(E + 1, 0);
  for (int e = 0; e < E; ++e) X.padded_offsets[e + 1] = X.padded_offsets[e] + round_up(X.expert_counts[e], X.tile);
  X.pair_row.assign(X.padded_total(), -1);
  X.pair_weight.assign(X.padded_total(), 0.f);
  return std::vector<int64_t>(X.padded_offsets.begin(), X.padded_offsets.end() - 1);
}
}  // namespace

ExpertLayout expert_layout(const int32_t* meta, int64_t rows, int k, int El, int tile) {
  const int mw = meta_words(k);
  ExpertLayout X;
  X.experts_per_rank = El;
  X.tile = tile;
  X.expert_counts.assign(El, 0);
  for (int64_t r = 0; r < rows; ++r)
    for (int j = 0; j < k; ++j) {
      int32_t e = meta[r * mw + 1 + j];
      if (e < 0) break;
      EPMOE_CHECK(e < El, ErrorCode::internal, "received local expert id ", e, " >= ", El);
      ++X.expert_counts[e];
    }
  std::vector<int64_t> cursor = place_segments(X);
  for (int64_t r = 0; r < rows; ++r)
    for (int j = 0; j < k; ++j) {
      int32_t e = meta[r * mw + 1 + j];
      if (e < 0) break;
      int64_t i = cursor[e]++;
      X.pair_row[i] = int32_t(r);
      std::memcpy(&X.pair_weight[i], &meta[r * mw + 1 + k + j], 4);
    }
  return X;
}

ExpertLayout token_expert_layout(const int32_t* ids, const float* weights, int64_t T, int k, int E, int tile) {
  EPMOE_CHECK(T >= 0 && k > 0 && E > 0 && tile > 0, ErrorCode::invalid_argument, "token_expert_layout: T=", T,
              " k=", k, " E=", E, " tile=", tile);
  ExpertLayout X;
  X.experts_per_rank = E;
  X.tile = tile;
  X.expert_counts.assign(E, 0);
  for (int64_t i = 0; i < T * k; ++i) {
    const int32_t e = ids[i];
    EPMOE_CHECK(e < E, ErrorCode::invalid_argument, "token_expert_layout: expert id ", e, " >= ", E, " at slot ", i);
    if (e >= 0) ++X.expert_counts[e];
  }
  std::vector<int64_t> cursor = place_segments(X);
  for (int64_t t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      const int32_t e = ids[t * k + j];
      if (e < 0) continue;
      const int64_t i = cursor[e]++;
      X.pair_row[i] = int32_t(t);
      X.pair_weight[i] = weights[t * k + j];
    }
  return X;
}

void combine_reduce(const DispatchLayout& L, const bf16* returned, int hidden, bf16* y) {
  std::vector<float> acc(hidden);
  for (int64_t t = 0; t < L.num_tokens; ++t) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int r = 0; r < L.world; ++r) {
      int32_t row = L.token_row[t * L.world + r];
      if (row < 0) continue;
      const bf16* src = returned + int64_t(row) * hidden;
      for (int c = 0; c < hidden; ++c) acc[c] += src[c].f();
    }
    bf16* dst = y + t * hidden;
    for (int c = 0; c < hidden; ++c) dst[c] = bf16(acc[c]);
  }
}

void pack_send_rows(const DispatchLayout& L, const bf16* src, int hidden, bf16* send) {
  for (int64_t r = 0; r < L.total_rows(); ++r)
    std::memcpy(send + r * hidden, src + int64_t(L.send_token[r]) * hidden, size_t(hidden) * sizeof(bf16));
}

void scatter_weight_grads(const DispatchLayout& L, const int32_t* ids, const float* returned, float* dw) {
  const int W = L.world, k = L.top_k, El = L.experts_per_rank;
  for (int64_t t = 0; t < L.num_tokens; ++t) {
    int seen[kMaxWorldSize] = {};  // local slots of token t met so far, per destination rank
    for (int j = 0; j < k; ++j) {
      const int32_t e = ids[t * k + j];
      float v = 0.f;
      if (e >= 0) {
        const int r = e / El;
        const int32_t row = L.token_row[t * W + r];
        v = returned[int64_t(row) * k + seen[r]++];
      }
      dw[t * k + j] = v;
    }
  }
}

AlltoallvPlane make_plane(const void* send, void* recv, const std::vector<int64_t>& send_rows,
                          const std::vector<int64_t>& recv_rows, size_t row_bytes) {
  AlltoallvPlane p;
  p.send = send;
  p.recv = recv;
  const size_t W = send_rows.size();
  p.send_bytes.resize(W);
  p.send_offsets.resize(W);
  p.recv_bytes.resize(W);
  p.recv_offsets.resize(W);
  size_t so = 0, ro = 0;
  for (size_t i = 0; i < W; ++i) {
    p.send_offsets[i] = so;
    p.send_bytes[i] = size_t(send_rows[i]) * row_bytes;
    so += p.send_bytes[i];
    p.recv_offsets[i] = ro;
    p.recv_bytes[i] = size_t(recv_rows[i]) * row_bytes;
    ro += p.recv_bytes[i];
  }
  return p;
}

void check_config_agreement(Communicator& comm, const MoeConfig& cfg, const Error* local_failure) {
  std::optional<Error> placement;
  if (!local_failure && (comm.world_size() != cfg.world_size || comm.rank() != cfg.rank)) {
    placement = Error(ErrorCode::invalid_config,
                      detail::concat("epmoe: [invalid_config] MoeConfig says rank ", cfg.rank, " of ", cfg.world_size,
                                     " but the ", comm.name(), " communicator is rank ", comm.rank(), " of ",
                                     comm.world_size()));
    local_failure = &*placement;
  }
  // max(v) and max(-v) give the range of every word; equal everywhere iff the ranks agree. The
  // message is built from all-reduced values only, so it is identical on every rank. The last
  // word carries (failing rank + 1) so a local failure fails every rank.
  auto w = cfg.agreement_words();
  const size_t n = w.size();
  std::vector<int64_t> v(2 * n + 1);
  for (size_t i = 0; i < n; ++i) {
    v[i] = w[i];
    v[n + i] = -w[i];
  }
  v[2 * n] = local_failure ? comm.rank() + 1 : 0;
  comm.allreduce_max_i64(v.data(), v.size());
  if (local_failure) throw *local_failure;
  if (v[2 * n] > 0)
    EPMOE_FAIL(ErrorCode::remote_error, "rank ", v[2 * n] - 1, " failed to build its layer (its error says why)");
  static const char* names[MoeConfig::kWords] = {"protocol_version", "num_experts", "top_k", "hidden", "ffn",
                                                 "world_size"};
  std::string diff;
  for (size_t i = 0; i < n; ++i) {
    const int64_t hi = v[i], lo = -v[n + i];
    if (hi != lo) diff += detail::concat(diff.empty() ? "" : ", ", names[i], " ranges over [", lo, ", ", hi, "]");
  }
  EPMOE_CHECK(diff.empty(), ErrorCode::config_mismatch, "ranks disagree on the MoE configuration: ", diff);
}

}  // namespace epmoe::protocol
