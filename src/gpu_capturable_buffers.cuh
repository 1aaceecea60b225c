// The capturable forward's and backward's fixed buffers, carved out of one allocation each
// (gpu_capturable.cu, gpu_capturable_backward.cu): sized once, so a captured graph's pointers stay
// valid for every replay.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "ep_protocol.h"
#include "epmoe/bf16.h"
#include "epmoe/communicator.h"
#include "epmoe/moe_config.h"
#include "gpu_support.cuh"
#include "kernels/ep/dispatch_layout.cuh"

namespace epmoe::gpu::capturable {

constexpr size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// Consecutive 256-byte aligned arrays in one buffer: `take` hands out the next one (base null:
// only sizes, for the allocation).
struct Carver {
  char* base = nullptr;
  size_t used = 0;
  template <class T>
  T* take(size_t count) {
    T* p = base ? reinterpret_cast<T*>(base + used) : nullptr;
    used += align256(std::max<size_t>(count, 1) * sizeof(T));
    return p;
  }
};

// cap_layout_: the expert layout of the local experts' pairs, and the error record.
struct LayoutArrays {
  int64_t* offsets;
  int64_t* error;
  int32_t* pair_row;
  float* pair_weight;
};
inline LayoutArrays carve_layout(Carver c, int El, int64_t rows, size_t* bytes = nullptr) {
  LayoutArrays a;
  a.offsets = c.take<int64_t>(size_t(El) + 1);
  a.error = c.take<int64_t>(4);
  a.pair_row = c.take<int32_t>(size_t(rows));
  a.pair_weight = c.take<float>(size_t(rows));
  if (bytes) *bytes = c.used;
  return a;
}

// cap_slots_: the slots transport's source and destination buffers (N tokens, W slots of N rows).
// send_x / recv_x hold dispatched rows of wire_row_bytes (bf16 rows, or an FP8 layer's packed rows);
// combine / back bf16 rows of hidden.
struct SlotArrays {
  int64_t *status, *send_rows, *send_offsets, *send_pairs, *hdr_send, *hdr_recv;
  int32_t *token_row, *send_meta, *send_token, *send_meta_slots, *recv_meta;
  void* layout_ws;
  size_t layout_ws_bytes;
  uint8_t *send_x, *recv_x;
  bf16 *combine, *back;
};
inline SlotArrays carve_slots(Carver c, const MoeConfig& cfg, int64_t N, size_t wire_row_bytes,
                              size_t* bytes = nullptr) {
  const int W = cfg.world_size, El = cfg.experts_per_rank(), hw = protocol::header_words(El);
  const int mw = protocol::meta_words(cfg.top_k);
  const size_t slots = size_t(W) * size_t(N), max_rows = size_t(N) * std::min(cfg.top_k, W);
  SlotArrays a;
  a.status = c.take<int64_t>(4);
  a.send_rows = c.take<int64_t>(size_t(W));
  a.send_offsets = c.take<int64_t>(size_t(W) + 1);
  a.send_pairs = c.take<int64_t>(size_t(W) * El);
  a.hdr_send = c.take<int64_t>(size_t(W) * hw);
  a.hdr_recv = c.take<int64_t>(size_t(W) * hw);
  a.token_row = c.take<int32_t>(size_t(N) * W);
  a.send_meta = c.take<int32_t>(max_rows * mw);
  a.send_token = c.take<int32_t>(max_rows);
  a.send_meta_slots = c.take<int32_t>(slots * mw);
  a.recv_meta = c.take<int32_t>(slots * mw);
  a.layout_ws_bytes = kernels::dispatch_layout_workspace_bytes(N, W);
  a.layout_ws = c.take<char>(a.layout_ws_bytes);
  a.send_x = c.take<uint8_t>(slots * wire_row_bytes);
  a.recv_x = c.take<uint8_t>(slots * wire_row_bytes);
  a.combine = c.take<bf16>(slots * cfg.hidden);
  a.back = c.take<bf16>(slots * cfg.hidden);
  if (bytes) *bytes = c.used;
  return a;
}

// A plane of W equal blocks of `bytes` each way (protocol::make_plane with one "row" per peer).
inline AlltoallvPlane equal_plane(const void* send, void* recv, int W, size_t bytes) {
  const std::vector<int64_t> one(size_t(W), 1);
  return protocol::make_plane(send, recv, one, one, bytes);
}


// cap_bwd_: the capturable backward's scratch, P = the layout's rows capacity, R = the rows the
// layout reads (N local, W N slots). dxp aliases dys (dys is dead once dW2 is queued).
struct BackwardArrays {
  bf16 *h, *xs, *dys, *da, *dh, *act_s, *dxp, *recv_dy;
  float *ds_pair, *ds_rows, *ds_back;
  int32_t* row_pair;
};
inline BackwardArrays carve_backward(Carver c, const MoeConfig& cfg, int64_t P, int64_t R, bool slots,
                                     size_t* bytes = nullptr) {
  const size_t H = size_t(cfg.hidden), F = size_t(cfg.ffn), k = size_t(cfg.top_k);
  BackwardArrays a;
  a.h = c.take<bf16>(size_t(P) * 2 * F);
  a.xs = c.take<bf16>(size_t(P) * H);
  a.dys = c.take<bf16>(size_t(P) * H);
  a.dxp = a.dys;
  a.da = c.take<bf16>(size_t(P) * F);
  a.dh = c.take<bf16>(size_t(P) * 2 * F);
  a.act_s = c.take<bf16>(size_t(P) * F);
  a.ds_pair = c.take<float>(size_t(P));
  a.row_pair = c.take<int32_t>(size_t(R) * k);
  a.recv_dy = slots ? c.take<bf16>(size_t(R) * H) : nullptr;
  a.ds_rows = slots ? c.take<float>(size_t(R) * k) : nullptr;
  a.ds_back = slots ? c.take<float>(size_t(R) * k) : nullptr;
  if (bytes) *bytes = c.used;
  return a;
}

}  // namespace epmoe::gpu::capturable
