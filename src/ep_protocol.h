// The expert-parallel forward protocol, host side. One definition of every exchanged format,
// shared by the CPU engine (which runs all of it) and the GPU engine (whose kernels produce the
// same layouts bit for bit, checked by tests/gpu/test_layout_gpu).
//
//   layout -> count exchange (+status) -> dispatch -> expert layout -> experts -> combine -> reduce
//
// Orders (fixed, so results are deterministic and comparable across backends):
//  * send rows: grouped by destination rank ascending, tokens ascending within a rank; a token is
//    sent once to each rank that owns at least one of its experts.
//  * receive rows: grouped by source rank ascending, in the order that rank sent them.
//  * expert pairs: per local expert, (recv row, slot) pairs in recv row order; each expert's segment
//    padded to a multiple of the tile (pair_row = -1, weight 0 for padding rows).
//  * combine: rows return in the order they were received; the source sums a token's returned rows
//    in destination rank order in fp32 and rounds once to bf16.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "epmoe/bf16.h"
#include "epmoe/communicator.h"
#include "epmoe/error.h"
#include "epmoe/moe_config.h"

namespace epmoe::protocol {

// Per dispatched row: word 0 = source token index; words 1..k = local expert ids for this
// destination, compacted in slot order, -1 after the last; words k+1..2k = routing weights (fp32
// bits) in the same order.
inline int meta_words(int top_k) { return 1 + 2 * top_k; }

// A local validation outcome that travels in the count exchange, so every rank raises the same
// error. For ids: a = token, b = slot, c = offending value. Host-detected errors carry text.
struct Status {
  ErrorCode code = ErrorCode::ok;
  int64_t a = 0, b = 0, c = 0;
  std::string text;  // at most kMsgBytes - 1 chars travel
  bool ok() const { return code == ErrorCode::ok; }
  std::string message() const;  // text if any, else formatted from code and a/b/c
};

// Count exchange header, per peer, in int64 words.
inline constexpr int kMsgWords = 24;
inline constexpr int kMsgBytes = kMsgWords * 8;
enum HeaderWord : int { kHdrCode = 0, kHdrA, kHdrB, kHdrC, kHdrRows, kHdrMsg, kHdrPairs = kHdrMsg + kMsgWords };
inline int header_words(int experts_per_rank) { return kHdrPairs + experts_per_rank; }

// Source side: which rows go where.
struct DispatchLayout {
  int world = 0, top_k = 0, experts_per_rank = 0;
  int64_t num_tokens = 0;
  std::vector<int64_t> send_rows;        // [world]
  std::vector<int64_t> send_offsets;     // [world + 1], row offsets into the send buffer
  std::vector<int32_t> send_meta;        // [total rows, meta_words]
  std::vector<int32_t> send_token;       // [total rows] source token of each row
  std::vector<int64_t> send_pairs;       // [world, experts_per_rank] (row, expert) pairs per dest expert
  std::vector<int32_t> token_row;        // [num_tokens, world] row index in the send buffer, -1 if not sent
  Status status;                         // first bad id, if any (then the rest is empty)
  int64_t total_rows() const { return send_offsets.empty() ? 0 : send_offsets.back(); }
};

// A layout that sends nothing: what a rank with a bad argument announces in the count exchange.
DispatchLayout empty_dispatch_layout(const MoeConfig& cfg);
// Checks ids (in [-1, E), no expert twice per token) and builds the layout.
DispatchLayout dispatch_layout(const int32_t* topk_ids, const float* topk_weights, int64_t num_tokens,
                               const MoeConfig& cfg);

// Writes the per-peer headers (world * header_words) for the count exchange.
void encode_count_headers(const DispatchLayout& layout, const Status& status, std::vector<int64_t>& headers);

// What this rank learned from the count exchange.
struct ReceivePlan {
  int world = 0, experts_per_rank = 0;
  std::vector<int64_t> recv_rows;     // [world] rows arriving from each peer
  std::vector<int64_t> recv_offsets;  // [world + 1]
  std::vector<int64_t> recv_pairs;    // [world, experts_per_rank] pairs for my experts from each peer
  std::vector<int64_t> expert_pairs;  // [experts_per_rank] total over peers
  int64_t total_rows() const { return recv_offsets.empty() ? 0 : recv_offsets.back(); }
  int64_t total_pairs() const;
};

// Decodes the received headers. If any rank reported an error, throws the lowest failing rank's
// error - the same text on every rank.
ReceivePlan decode_count_headers(const std::vector<int64_t>& recv_headers, int world, int experts_per_rank);

// Destination side: (row, weight) pairs grouped by local expert, each segment padded to `tile`.
struct ExpertLayout {
  int experts_per_rank = 0, tile = 1;
  std::vector<int64_t> expert_counts;   // [experts_per_rank] real pairs
  std::vector<int64_t> padded_offsets;  // [experts_per_rank + 1]
  std::vector<int32_t> pair_row;        // [padded total] recv row, -1 for padding
  std::vector<float> pair_weight;       // [padded total] 0 for padding
  int64_t padded_total() const { return padded_offsets.empty() ? 0 : padded_offsets.back(); }
};
ExpertLayout expert_layout(const int32_t* recv_meta, int64_t recv_rows, int top_k, int experts_per_rank, int tile);
// The same for tokens that never left their rank (world 1, the local-expert benchmarks and tests):
// pairs from the raw top-k of `num_tokens` tokens, pair_row = token index, token order inside each
// expert. A slot with id < 0 is dropped wherever it appears; an id >= experts throws.
ExpertLayout token_expert_layout(const int32_t* topk_ids, const float* topk_weights, int64_t num_tokens, int top_k,
                                 int experts, int tile);

// Rounds n up to a multiple of tile (tile >= 1).
inline int64_t round_up(int64_t n, int64_t tile) { return (n + tile - 1) / tile * tile; }

// Source side: y[t] = bf16( sum over dest ranks ascending of returned[token_row[t, r]] ), fp32 sums.
void combine_reduce(const DispatchLayout& layout, const bf16* returned, int hidden, bf16* y);

// Source side: row r of the send buffer = src[send_token[r]] (x in the forward, dy in the backward:
// combine's backward is a dispatch of dy along the forward's routes).
void pack_send_rows(const DispatchLayout& layout, const bf16* src, int hidden, bf16* send);

// Source side of the backward: d_topk_weights[t, j] from the d(weight)s the destinations returned,
// returned[row, n] for the n-th local slot (in slot order) of send row `row` - the meta order of the
// forward's dispatch - and 0 for dropped slots. topk_ids as in the forward.
void scatter_weight_grads(const DispatchLayout& layout, const int32_t* topk_ids, const float* returned, float* d_weights);

// Byte counts of one plane for rows of row_bytes bytes, given rows per peer.
AlltoallvPlane make_plane(const void* send, void* recv, const std::vector<int64_t>& send_rows,
                          const std::vector<int64_t>& recv_rows, size_t row_bytes);

// Collective. All-reduces the configuration's agreement words and a local failure flag. Throws on
// every rank: the local error if this rank failed (or another rank's: 'rank R failed to build its
// layer'), else Error(config_mismatch) naming each field whose value differs across ranks.
void check_config_agreement(Communicator& comm, const MoeConfig& cfg, const Error* local_failure = nullptr);

}  // namespace epmoe::protocol
