// Device dispatch layout (see dispatch_layout.cuh for shapes and the contract).
//
// Design: the send row of (token t, dest r) is, in the protocol order (dest ascending, token
// ascending), the number of (r', t') pairs before it that are sent: an exclusive scan of the flag
// matrix flags[r, t] = "t goes to r" laid out dest-major. One CUB scan over world * T integers gives
// every row index at once, deterministically (integer sums), and its segment starts are the send
// offsets. Three launches: route (validate + mask + flags + pair counts), scan, scatter (token_row,
// send_token, send_meta); then a one-block finalize for status / offsets / rows.
#include <cub/device/device_scan.cuh>

#include "ep_protocol.h"
#include "kernels/cuda_check.cuh"
#include "kernels/ep/dispatch_layout.cuh"

namespace epmoe::kernels {

namespace {

constexpr int kThreads = 256;
constexpr unsigned long long kNoBadSlot = ~0ull;
// Pair histogram in shared memory up to this many experts (48 KB of int); beyond, global atomics.
constexpr int kMaxSharedExperts = 12288;

size_t align_up(size_t n) { return (n + 255) / 256 * 256; }

struct Workspace {
  unsigned long long* first_bad;  // [1] min over bad slots of t * k + j
  uint64_t* mask;                 // [T] destination ranks of each token
  int32_t* flags;                 // [world * T] dest-major
  int32_t* pos;                   // [world * T] exclusive scan of flags
  void* scan_tmp;
  size_t scan_tmp_bytes;
};

size_t scan_tmp_bytes(int64_t items) {
  size_t bytes = 0;
  EPMOE_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, bytes, static_cast<const int32_t*>(nullptr),
                                                 static_cast<int32_t*>(nullptr), int(items)));
  return bytes;
}

Workspace carve(void* base, int64_t T, int world) {
  char* p = static_cast<char*>(base);
  Workspace w;
  w.first_bad = reinterpret_cast<unsigned long long*>(p);
  p += align_up(sizeof(unsigned long long));
  w.mask = reinterpret_cast<uint64_t*>(p);
  p += align_up(size_t(T) * sizeof(uint64_t));
  w.flags = reinterpret_cast<int32_t*>(p);
  p += align_up(size_t(T) * world * sizeof(int32_t));
  w.pos = reinterpret_cast<int32_t*>(p);
  p += align_up(size_t(T) * world * sizeof(int32_t));
  w.scan_tmp = p;
  w.scan_tmp_bytes = T > 0 ? scan_tmp_bytes(T * world) : 0;
  return w;
}

// One thread per token: validate the row, build the destination mask, write the token's column of
// the flag matrix and count (row, expert) pairs. ids[T, k] -> mask[T], flags[world, T],
// first_bad, send_pairs[E] (global expert index == dest * E_local + local).
// A bad row stops at its first bad slot; what it counted before is discarded by the caller (the
// status is not ok then), but every write stays in bounds.
__global__ void route_tokens_kernel(const int32_t* __restrict__ ids, int64_t T, const int64_t* __restrict__ dT,
                                    int k, int E, int El, int world,
                                    uint64_t* __restrict__ mask_out, int32_t* __restrict__ flags,
                                    unsigned long long* __restrict__ first_bad,
                                    unsigned long long* __restrict__ send_pairs, bool shared_hist) {
  extern __shared__ int hist[];  // [E] when shared_hist
  if (shared_hist) {
    for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
    __syncthreads();
  }
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < T) {
    const int32_t* row = ids + t * k;
    uint64_t mask = 0;
    int bad = -1;
    const bool live = dT == nullptr || t < *dT;  // (rows past a device count are not tokens)
    for (int j = 0; j < k && bad < 0 && live; ++j) {
      const int32_t e = __ldg(row + j);
      if (e == -1) continue;
      if (e < -1 || e >= E) {
        bad = j;
        break;
      }
      for (int i = 0; i < j; ++i)
        if (__ldg(row + i) == e) bad = j;
      if (bad >= 0) break;
      mask |= uint64_t(1) << (e / El);
      if (shared_hist)
        atomicAdd(&hist[e], 1);
      else
        atomicAdd(&send_pairs[e], 1ull);
    }
    if (bad >= 0) atomicMin(first_bad, static_cast<unsigned long long>(t * k + bad));
    mask_out[t] = mask;
    for (int r = 0; r < world; ++r) flags[int64_t(r) * T + t] = int32_t((mask >> r) & 1);
  }
  if (shared_hist) {
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x)
      if (hist[e]) atomicAdd(&send_pairs[e], static_cast<unsigned long long>(hist[e]));
  }
}

// One thread per token: for every destination of the token, its send row (from the scan) gets the
// token index and the metadata; token_row gets the row or -1.
// ids/weights[T, k], mask[T], pos[world, T] -> token_row[T, world], send_token[rows],
// send_meta[rows, 1 + 2k].
__global__ void scatter_rows_kernel(const int32_t* __restrict__ ids, const float* __restrict__ weights, int64_t T,
                                    int k, int E, int El, int world, const uint64_t* __restrict__ mask_in,
                                    const int32_t* __restrict__ pos, int32_t* __restrict__ token_row,
                                    int32_t* __restrict__ send_token, int32_t* __restrict__ send_meta) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= T) return;
  const uint64_t mask = mask_in[t];
  const int mw = 1 + 2 * k;
  const int32_t* id_row = ids + t * k;
  const float* w_row = weights + t * k;
  for (int r = 0; r < world; ++r) {
    if (!((mask >> r) & 1)) {
      token_row[t * world + r] = -1;
      continue;
    }
    const int32_t row = pos[int64_t(r) * T + t];
    token_row[t * world + r] = row;
    send_token[row] = int32_t(t);
    int32_t* m = send_meta + int64_t(row) * mw;
    m[0] = int32_t(t);
    int n = 0;
    for (int j = 0; j < k; ++j) {
      const int32_t e = __ldg(id_row + j);
      // The range guard matters only for bad rows (status not ok): it keeps n <= k and ids sane.
      if (e < 0 || e >= E || e / El != r) continue;
      if (n >= k) break;
      m[1 + n] = e - r * El;
      m[1 + k + n] = __float_as_int(__ldg(w_row + j));
      ++n;
    }
    for (int j = n; j < k; ++j) {
      m[1 + j] = -1;
      m[1 + k + j] = 0;  // weight 0.0f bits, as the CPU layout writes for unused slots
    }
  }
}

// One block: status from the first bad slot, send offsets from the scan's segment starts, rows.
// When the status is not ok, rows / offsets / pairs are zeroed to match the CPU layout.
__global__ void finalize_layout_kernel(const int32_t* __restrict__ ids, int64_t T, const int64_t* __restrict__ dT,
                                       int k, int E, int El, int world,
                                       const unsigned long long* __restrict__ first_bad,
                                       const int32_t* __restrict__ flags, const int32_t* __restrict__ pos,
                                       int64_t* __restrict__ status, int64_t* __restrict__ send_rows,
                                       int64_t* __restrict__ send_offsets, int64_t* __restrict__ send_pairs) {
  __shared__ int64_t offs[65];  // world <= kMaxWorldSize = 64
  __shared__ bool ok;
  if (threadIdx.x == 0) {
    const unsigned long long fb = T > 0 ? *first_bad : kNoBadSlot;
    ok = fb == kNoBadSlot;
    int64_t code = 0, a = 0, b = 0, c = 0;
    if (dT != nullptr && (*dT < 0 || *dT > T)) {
      ok = false;
      code = int64_t(ErrorCode::invalid_argument);
      a = *dT;
      b = T;
    } else if (!ok) {
      a = int64_t(fb / k);
      b = int64_t(fb % k);
      c = ids[fb];
      code = (c < -1 || c >= E) ? int64_t(ErrorCode::expert_id_out_of_range) : int64_t(ErrorCode::duplicate_expert_id);
    }
    status[0] = code;
    status[1] = a;
    status[2] = b;
    status[3] = c;
  }
  for (int r = threadIdx.x; r <= world; r += blockDim.x) {
    int64_t o = 0;
    if (T > 0) {
      const int64_t last = int64_t(world) * T - 1;
      o = r < world ? int64_t(pos[int64_t(r) * T]) : int64_t(pos[last]) + flags[last];
    }
    offs[r] = o;
  }
  __syncthreads();
  for (int r = threadIdx.x; r <= world; r += blockDim.x) {
    send_offsets[r] = ok ? offs[r] : 0;
    if (r < world) send_rows[r] = ok ? offs[r + 1] - offs[r] : 0;
  }
  if (!ok)
    for (int i = threadIdx.x; i < world * El; i += blockDim.x) send_pairs[i] = 0;
}

__global__ void count_headers_kernel(const int64_t* __restrict__ status, const int64_t* __restrict__ send_rows,
                                     const int64_t* __restrict__ send_pairs, const int32_t* __restrict__ sticky_error,
                                     int El, int hw, int64_t* __restrict__ headers) {
  // grid: one block per peer p; headers[p, :] (protocol::HeaderWord layout)
  const int p = blockIdx.x;
  int64_t code = status[0], a = status[1], b = status[2], c = status[3];
  if (code == 0 && sticky_error && *sticky_error != 0) {
    code = int64_t(ErrorCode::internal);
    a = *sticky_error;
    b = c = 0;
  }
  const bool ok = code == 0;
  int64_t* h = headers + int64_t(p) * hw;
  for (int i = threadIdx.x; i < hw; i += blockDim.x) {
    int64_t v = 0;
    if (i == protocol::kHdrCode) v = code;
    else if (i == protocol::kHdrA) v = a;
    else if (i == protocol::kHdrB) v = b;
    else if (i == protocol::kHdrC) v = c;
    else if (i == protocol::kHdrRows) v = ok ? send_rows[p] : 0;
    else if (i >= protocol::kHdrPairs) v = ok ? send_pairs[int64_t(p) * El + (i - protocol::kHdrPairs)] : 0;
    // message words (kHdrMsg ..) stay zero: device-detected errors carry no text
    h[i] = v;
  }
}

}  // namespace

size_t dispatch_layout_workspace_bytes(int64_t T, int world) {
  size_t n = align_up(sizeof(unsigned long long)) + align_up(size_t(T) * sizeof(uint64_t)) +
             2 * align_up(size_t(T) * world * sizeof(int32_t));
  if (T > 0) n += align_up(scan_tmp_bytes(T * world));
  return n;
}

void dispatch_layout_launch(const DispatchLayoutArgs& a, cudaStream_t stream) {
  const int64_t T = a.num_tokens;
  const int k = a.top_k, E = a.num_experts, W = a.world;
  EPMOE_CHECK(W >= 1 && W <= 64 && E % W == 0 && k >= 1, ErrorCode::internal, "dispatch_layout: bad shape E=", E,
              " k=", k, " world=", W);
  EPMOE_CHECK(T * W < int64_t(INT32_MAX) && T * k < int64_t(INT32_MAX), ErrorCode::unsupported,
              "dispatch_layout: T=", T, " tokens x world=", W, " / k=", k, " exceed the 32-bit row index");
  EPMOE_CHECK(a.workspace_bytes >= dispatch_layout_workspace_bytes(T, W), ErrorCode::internal,
              "dispatch_layout: workspace too small");
  const int El = E / W;
  Workspace ws = carve(a.workspace, T, W);

  EPMOE_CUDA_CHECK(cudaMemsetAsync(a.send_pairs, 0, size_t(W) * El * sizeof(int64_t), stream));
  EPMOE_CUDA_CHECK(cudaMemsetAsync(ws.first_bad, 0xff, sizeof(unsigned long long), stream));
  if (T > 0) {
    const unsigned blocks = unsigned((T + kThreads - 1) / kThreads);
    const bool shared_hist = E <= kMaxSharedExperts;
    route_tokens_kernel<<<blocks, kThreads, shared_hist ? E * sizeof(int) : 0, stream>>>(
        a.topk_ids, T, a.device_num_tokens, k, E, El, W, ws.mask, ws.flags, ws.first_bad,
        reinterpret_cast<unsigned long long*>(a.send_pairs), shared_hist);
    EPMOE_CUDA_CHECK_LAUNCH("route_tokens_kernel");
    size_t tmp = ws.scan_tmp_bytes;
    EPMOE_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(ws.scan_tmp, tmp, ws.flags, ws.pos, int(T * W), stream));
    scatter_rows_kernel<<<blocks, kThreads, 0, stream>>>(a.topk_ids, a.topk_weights, T, k, E, El, W, ws.mask, ws.pos,
                                                         a.token_row, a.send_token, a.send_meta);
    EPMOE_CUDA_CHECK_LAUNCH("scatter_rows_kernel");
  }
  finalize_layout_kernel<<<1, 128, 0, stream>>>(a.topk_ids, T, a.device_num_tokens, k, E, El, W, ws.first_bad, ws.flags, ws.pos,
                                                a.status, a.send_rows, a.send_offsets, a.send_pairs);
  EPMOE_CUDA_CHECK_LAUNCH("finalize_layout_kernel");
}

void count_headers_launch(const int64_t* status, const int64_t* send_rows, const int64_t* send_pairs,
                          const int32_t* sticky_error, int world, int El, int64_t* headers, cudaStream_t stream) {
  const int hw = protocol::header_words(El);
  count_headers_kernel<<<world, 128, 0, stream>>>(status, send_rows, send_pairs, sticky_error, El, hw, headers);
  EPMOE_CUDA_CHECK_LAUNCH("count_headers_kernel");
}

}  // namespace epmoe::kernels
