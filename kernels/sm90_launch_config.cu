// Host-side launch heuristics of the sm_90a split pipeline (see sm90_launch_config.cuh) and the
// environment knobs of sm90_experts.cuh. Defaults chosen from the same-run A/Bs in docs/PERF.md.
#include "kernels/sm90_launch_config.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "kernels/cuda_check.cuh"
#include "kernels/sm90_common.cuh"
#include "kernels/sm90_work_items.cuh"
#include "kernels/sm90_experts.cuh"

namespace epmoe::kernels::sm90 {

void check_expert_problem(const ExpertProblem& p, const char* who) {
  auto aligned = [](const void* q) { return q != nullptr && reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  EPMOE_CHECK(p.experts > 0, ErrorCode::invalid_argument, who, ": experts must be > 0, got ", p.experts);
  EPMOE_CHECK(p.hidden > 0 && p.hidden % 128 == 0, ErrorCode::invalid_argument, who,
              ": hidden must be a positive multiple of 128, got ", p.hidden);
  EPMOE_CHECK(p.ffn > 0 && p.ffn % 128 == 0, ErrorCode::invalid_argument, who,
              ": ffn must be a positive multiple of 128, got ", p.ffn);
  EPMOE_CHECK(p.rows_capacity > 0 && p.rows_capacity < (int64_t(1) << 31), ErrorCode::invalid_argument, who,
              ": rows_capacity must be in (0, 2^31), got ", p.rows_capacity);
  EPMOE_CHECK(p.padded_offsets != nullptr && p.pair_row != nullptr && p.pair_weight != nullptr,
              ErrorCode::invalid_argument, who, ": null layout pointer");
  EPMOE_CHECK((p.x != nullptr ? aligned(p.x) : aligned(p.xs)) && aligned(p.w1) && aligned(p.w2) && aligned(p.act) &&
                  aligned(p.out),
              ErrorCode::invalid_argument, who,
              ": xs (or x), w1, w2, act and out must be non-null and 16-byte aligned");
  EPMOE_CHECK(p.x == nullptr || p.x_rows > 0, ErrorCode::invalid_argument, who, ": x given with x_rows = ", p.x_rows);
}

namespace {
// Persistent grids unless EPMOE_SM90_PERSISTENT=0 (one CTA or cluster per item).
bool persistent_grid() {
  const char* env = std::getenv("EPMOE_SM90_PERSISTENT");
  return env == nullptr || env[0] != '0';
}
int device_sm_count(int* dev_out = nullptr) {
  int dev = 0, sms = 0;
  EPMOE_CUDA_CHECK(cudaGetDevice(&dev));
  EPMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  if (dev_out != nullptr) *dev_out = dev;
  return std::max(sms, 1);
}
}  // namespace

unsigned sm90_grid(int64_t items, const char* who) {
  EPMOE_CHECK(items > 0 && items <= 0x7fffffff, ErrorCode::invalid_argument, who, ": work items out of range: ", items);
  if (!persistent_grid()) return unsigned(items);
  return unsigned(std::min<int64_t>(items, device_sm_count()));
}

size_t sm90_dyn_smem_bytes(bool by_expert, int experts, size_t staging) {
  return kDynSmemBytes + staging + (by_expert ? expert_schedule_smem_bytes(experts) : 0);
}

int64_t sm90_work_items(int64_t tiles, int experts, int nn, bool cluster, bool by_expert) {
  if (!cluster) return tiles * nn;
  return by_expert ? expert_items_bound(tiles, experts, nn, true) : (tiles + 1) / 2 * nn;
}

Sm90LaunchPlan sm90_launch_plan(int64_t tiles, int experts, int hidden, int blocks, bool cluster, size_t staging) {
  Sm90LaunchPlan plan{};
  plan.by_expert = sm90_kernel_order_by_expert(experts, hidden, staging);
  plan.smem = sm90_dyn_smem_bytes(plan.by_expert, experts, staging);
  plan.items = sm90_work_items(tiles, experts, blocks, cluster, plan.by_expert);
  return plan;
}

bool sm90_pad_halves_auto(int64_t tiles, int experts, int k_dim, int64_t grid, int group, int64_t l2_bytes) {
  if (tiles <= 0 || experts <= 0 || k_dim <= 0 || grid <= 0 || l2_bytes <= 0) return false;
  const int64_t partners = std::clamp<int64_t>(tiles / experts, 1, std::max(group, 1));
  const int64_t slices = (grid + partners - 1) / partners;
  const int64_t wave_bytes = slices * kBN * int64_t(k_dim) * 2;
  return 4 * wave_bytes <= l2_bytes;
}

bool sm90_skip_pad_halves(int64_t tiles, int experts, int k_dim, int64_t items, bool cluster) {
  const int mode = sm90_pad_halves_mode();  // 0 compute, 1 skip, 2 auto
  if (cluster || mode == 0) return false;
  if (mode == 1) return true;
  int dev = 0, l2 = 0;
  const int sms = device_sm_count(&dev);
  EPMOE_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
  // A wave: the CTAs resident at once - min(items, SMs) also without a persistent grid, so not sm90_grid.
  return sm90_pad_halves_auto(tiles, experts, k_dim, std::min<int64_t>(items, sms), sm90_group_tiles(), l2);
}

cudaLaunchAttribute sm90_cluster_pair_attr() {
  cudaLaunchAttribute a{};
  a.id = cudaLaunchAttributeClusterDimension;
  a.val.clusterDim.x = 2;
  a.val.clusterDim.y = 1;
  a.val.clusterDim.z = 1;
  return a;
}

unsigned sm90_cluster_grid(int64_t cluster_items, const void* kernel, size_t dyn_smem, cudaStream_t stream,
                           const char* who) {
  EPMOE_CHECK(cluster_items > 0 && cluster_items <= 0x3fffffff, ErrorCode::invalid_argument, who,
              ": cluster work items out of range: ", cluster_items);
  if (!persistent_grid()) return unsigned(2 * cluster_items);
  int dev = 0;
  const int sms = device_sm_count(&dev);
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int> cache;  // (kernel, device) -> active clusters
  // Under stream capture the occupancy query is not made (it is not a stream operation, but keep
  // captures free of anything that could invalidate them): one cluster per SM pair until a launch
  // outside capture has asked. Too many clusters would only cost an extra wave, never correctness:
  // no CTA waits on a cluster that is not yet resident.
  int clusters = std::max(1, sms / 2);
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  EPMOE_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
  {
    std::lock_guard<std::mutex> lock(mu);
    auto found = cache.find({kernel, dev});
    if (found != cache.end()) {
      clusters = found->second;
    } else if (capturing == cudaStreamCaptureStatusNone) {
      cudaLaunchConfig_t cfg{};
      cfg.gridDim = dim3(2);
      cfg.blockDim = dim3(unsigned(kThreads));
      cfg.dynamicSmemBytes = dyn_smem;
      cudaLaunchAttribute attr[1] = {sm90_cluster_pair_attr()};
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      EPMOE_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg));
      EPMOE_CHECK(clusters > 0, ErrorCode::unsupported, who, ": no 2-CTA cluster of this kernel fits on device ", dev);
      cache[{kernel, dev}] = clusters;
    }
  }
  return unsigned(2 * std::min<int64_t>(cluster_items, clusters));
}

}  // namespace epmoe::kernels::sm90

namespace epmoe::kernels {
namespace {
int env_int(const char* name, int fallback) {
  const char* env = std::getenv(name);
  if (env == nullptr || env[0] == '\0') return fallback;
  char* end = nullptr;
  const long v = std::strtol(env, &end, 10);
  EPMOE_CHECK(end != env && *end == '\0' && v >= 0 && v <= 1 << 20, ErrorCode::invalid_argument, name,
              " must be a non-negative integer, got '", env, "'");
  return int(v);
}
// A two-valued string knob: true for `yes`, false for `no`, `fallback` when unset or empty; anything
// else is an invalid_argument naming both values.
bool env_choice(const char* name, const char* yes, const char* no, bool fallback) {
  const char* env = std::getenv(name);
  if (env == nullptr || env[0] == '\0') return fallback;
  const std::string v(env);
  EPMOE_CHECK(v == yes || v == no, ErrorCode::invalid_argument, name, " must be ", yes, " or ", no, ", got '", v,
              "'");
  return v == yes;
}
// A three-valued string knob: the index of its value in `values`, `fallback` when unset or empty;
// anything else is an invalid_argument naming the three.
int env_choice3(const char* name, const std::array<const char*, 3>& values, int fallback) {
  const char* env = std::getenv(name);
  if (env == nullptr || env[0] == '\0') return fallback;
  for (int i = 0; i < 3; ++i)
    if (std::strcmp(env, values[size_t(i)]) == 0) return i;
  EPMOE_CHECK(false, ErrorCode::invalid_argument, name, " must be ", values[0], ", ", values[1], " or ", values[2],
              ", got '", env, "'");
  return fallback;
}
}  // namespace

int sm90_cluster_knob() {
  const char* env = std::getenv("EPMOE_SM90_CLUSTER");
  if (env == nullptr || env[0] == '\0' || std::string(env) == "auto") return -1;
  const int mode = env_int("EPMOE_SM90_CLUSTER", 0);
  EPMOE_CHECK(mode <= 2, ErrorCode::invalid_argument, "EPMOE_SM90_CLUSTER must be 0, 1, 2 or auto, got ", mode);
  return mode;
}
// auto: the pairs halve L2->SM weight bytes but read more from DRAM (UP at 7168/T=2k: 3.48 vs 2.92
// GB). Session 5's interleaved A/Bs had them 1-2% slower everywhere; steady-state blocks (session 14)
// agree at hidden 2048 (T=16k +0.4%) and at 7168 with ~640 rows per expert (T=2k +0.7%), but at 7168
// with ~2200 rows per expert (T=8k) they are 1.3-2.2% faster (three runs, global and by-expert order).
int sm90_cluster_mode(int hidden, int64_t rows_capacity, int experts) {
  const int knob = sm90_cluster_knob();
  if (knob >= 0) return knob;
  return hidden >= kClusterMinHidden && experts > 0 && rows_capacity / experts >= kClusterMinRowsPerExpert ? 1 : 0;
}
bool sm90_up_uses_cluster(bool gather, int hidden, int64_t rows_capacity, int experts) {
  const int mode = sm90_cluster_mode(hidden, rows_capacity, experts);
  return mode == 1 || (mode == 2 && !gather);
}
bool sm90_down_uses_cluster(int hidden, int64_t rows_capacity, int experts) {
  return sm90_cluster_mode(hidden, rows_capacity, experts) != 0;
}
// Pairs before weight-multicast clusters in auto: at E=32 k=8 7168/2048 T=8k (the one bench shape where
// the cluster rule fires) the gathering UP as pairs took 6.03 ms against 6.48 with the clusters (UP
// from xs 6.01: the pairs remove the gather's whole extra cost there), steady-state blocks of the
// layer 0.9763 (3/4) and 0.9687 (6/6, A/A 1.0007) on two leases (docs/PERF.md session 19). DOWN and
// UP from xs keep the clusters.
UpGatherForm sm90_up_gather_form(int hidden, int ffn, int64_t rows_capacity, int experts, bool staged_epilogue) {
  const bool cluster = sm90_up_uses_cluster(true, hidden, rows_capacity, experts);
  const int share_a = sm90_up_share_a_mode();  // 0 off, 1 on, 2 auto
  const bool pairs_auto = share_a == 2 && sm90_gather_async_arrive() && (sm90_early_decode() & 2) == 0 &&
                          sm90_pad_halves_mode() != 1;
  const bool pairs = staged_epilogue && ffn % 256 == 0 && (share_a == 1 || pairs_auto);
  if (pairs && (!cluster || sm90_cluster_knob() < 0)) return UpGatherForm::pairs;
  return cluster ? UpGatherForm::cluster : UpGatherForm::single;
}
// Default 16. By expert at 7168/T=8k (~17 tiles per expert, so two groups and W1 streamed twice),
// 32 cut UP's DRAM reads 8.07 -> 5.61 GB under ncu but not the layer's time: steady-state blocks
// 0.9947 (session 19) and 0.9989 (session 22, A/A 0.9995; docs/PERF.md).
int sm90_group_tiles() { return std::max(1, env_int("EPMOE_SM90_GROUP", 16)); }
// The knob, the rule and the fit: the schedule's per-expert offsets must fit in shared memory next
// to the ring and the kernel's staging buffers. Sessions 5 and 7 kept the global order because the
// by-expert order measured 0.5-4% slower in same-process interleaved A/Bs, which favor the variant
// drawing more power (session 13); in steady-state blocks (session 14, --ab-blocks) it is 1.2-4%
// faster at E=32 k=8 hidden 7168 (T=2k / 8k: UP DRAM reads 2.92 -> 2.19 GB, L2 bytes 13.2 -> 10.2 GB)
// and 1.9-2.8% slower at hidden 2048 (T=16k, E=128 T=16k), where its decode costs more than the
// bytes it saves.
static int sm90_order_mode() {  // 0 global, 1 expert, 2 auto
  return env_choice3("EPMOE_SM90_ORDER", {"global", "expert", "auto"}, 2);
}
bool sm90::sm90_kernel_order_by_expert(int experts, int hidden, size_t staging) {
  const int mode = sm90_order_mode();
  const bool wanted = mode == 1 || (mode == 2 && hidden >= kOrderByExpertMinHidden);
  return wanted && sm90_dyn_smem_bytes(true, experts, staging) <= kMaxDynSmemBytes - kStaticSmemReserve;
}
bool sm90_order_by_expert(int experts, int hidden) { return sm90::sm90_kernel_order_by_expert(experts, hidden, 0); }
bool sm90_order_forced_by_expert() { return sm90_order_mode() == 1; }
// Default staged: same-process A/B (session 7) B/A 0.989 / 0.994 / 0.977 / 0.998 / 0.989 on the five
// bench shapes; steady-state blocks (session 15) staged -> direct 1.0025 / 1.0019 / 1.0076 (7168 2k /
// 8k, 2048 16k; docs/PERF.md).
bool sm90_up_staged_epilogue() { return env_choice("EPMOE_SM90_UP_EPILOGUE", "staged", "direct", true); }
// Default auto (pairs wherever the gathering UP would run single CTAs): steady-state blocks
// (docs/PERF.md session 18) off -> on 0.9619 / 0.9758 / 0.9759 / 0.9767 (2048/16k, 64k, E=128 16k, 4k;
// B faster in 6/6 rounds each), again 0.9740 (6/6) at 16k; at 7168/2k 1.0052 with the pairs in the
// global order and 0.9976 (4/6) by expert, the order auto runs there.
int sm90_up_share_a_mode() { return env_choice3("EPMOE_SM90_UP_SHARE_A", {"off", "on", "auto"}, 2); }
// Tile shape per kernel: whole (128-row tiles, the default) or granular (swap-AB token-granular
// tiles). Default whole from steady-state runs (docs/PERF.md S13-6: separate processes alternated on
// one H200, 3 each): the layer with both kernels granular 2.7090 vs 2.7209 ms at E=32 k=8 7168/2048
// T=2k (-0.4%, inside the spread: UP +0.6%, DOWN -2%) and 9.8072 vs 9.6765 ms at T=8k (+1.4%, UP
// +2.6%); the board's power cap holds both at ~666 W and the granular kernels, which move more L2
// bytes (UP 16.3 vs 13.0 GB under ncu), run ~1% lower clocks. Same-process interleaved A/Bs had
// shown -4.2% at T=2k: interleaving gives both variants the mix's clock, which favors the one that
// draws more power. At hidden 2048 the granular kernels are slower in A/Bs too (+1…+4%).
bool sm90_up_granular() { return env_choice("EPMOE_SM90_UP_TILES", "granular", "whole", false); }
bool sm90_down_granular() { return env_choice("EPMOE_SM90_DOWN_TILES", "granular", "whole", false); }
// Default end: same-process A/B (session 13, both kernels granular) first -> end B/A 0.992 / 0.996 /
// 0.999 / 1.005 / 0.995 (7168/2k, 7168/8k, 16k, E128/16k, 4k); UP alone at 7168/2k under ncu: DRAM
// reads 3.91 -> 3.10 GB (the 128-row kernel: 2.92), 1.56 -> 1.47 ms. Claimed at an item's first step,
// the next item starts one item's duration after its claim, and that duration follows the item's N,
// so items claimed one after another (a weight slice's partners) start apart and miss each other in
// L2. Decoding the claimed item during the last stages ("ahead", docs/experiments/
// sm90_granular_decode_ahead.patch) measured 1-3% slower than end.
int sm90_granular_claim_kt(int num_k) {
  return env_choice("EPMOE_SM90_GRAN_CLAIM", "end", "first", true) && num_k > 3 ? num_k - 3 : 0;
}
// Default tanh: same-process A/B (session 11) exp -> tanh B/A 0.974 / 0.993 / 0.991 / 0.979 / 0.976
// on the five bench shapes, the suite's errors unchanged; steady-state blocks (session 15) tanh -> exp
// 1.0205 / 1.0047 / 1.0090 (docs/PERF.md).
bool sm90_up_silu_tanh() { return env_choice("EPMOE_SM90_SILU", "tanh", "exp", true); }
// Default staged (session 6); steady-state blocks (session 15) staged -> direct 1.0092 / 1.0211 / 1.0319.
bool sm90_down_staged_epilogue() { return env_choice("EPMOE_SM90_DOWN_EPILOGUE", "staged", "direct", true); }
// Default num_k / 2: same-process A/Bs (session 10) of the step against the older fixed 2.
int sm90_down_flush_step(int num_k) { return env_int("EPMOE_SM90_DOWN_FLUSH_STEP", num_k / 2); }
// Default 1 (DOWN early, session 20): steady-state blocks 0 -> 1 at 2048/T=16k were faster on all
// five leases that measured it (0.9762 ... 0.9893 in session 16, 0.9865 in session 20; each inside the
// +-1.8% floor, the sign never changed) and inside the noise at 64k / 4k / E=128 / 7168 (session 20:
// 0.9972 ... 1.0015; 7168/T=2k 0.9864 / 1.0059 / 0.9994 across leases). Bit 1 (the gathering UP
// early) stays off: 0 -> 3 was 1.4% slower at 7168/T=2k (0/8 rounds, session 16) and it keeps the
// A-sharing pairs from running (sm90_up_gather_form).
int sm90_early_decode() {
  const int bits = env_int("EPMOE_SM90_EARLY_DECODE", 1);
  EPMOE_CHECK(bits <= 3, ErrorCode::invalid_argument,
              "EPMOE_SM90_EARLY_DECODE must be 0..3 (bit 0 DOWN, bit 1 the gathering UP), got ", bits);
  return bits;
}
// Default half (session 9); steady-state blocks (session 15) half -> off 0.9981 / 1.0007 / 1.0129.
bool sm90_tail_split() { return env_choice("EPMOE_SM90_TAIL_SPLIT", "half", "off", true); }
// The pairs' own last-wave halving; unset it follows EPMOE_SM90_TAIL_SPLIT (so an A/B can switch it
// without changing DOWN's tail). Steady-state blocks off -> half (docs/PERF.md session 19): 2048/T=16k
// 0.9892 (5/6) and 0.9918 (6/8) on two leases (A/A 1.0031), T=128k 0.9976 (6/8); 64k / E=128 16k / 4k
// 1.0054 / 0.9982 / 1.0070 (inside the noise). The prediction was -1% at 16k (31.03 waves).
// By expert too (session 21): no 7168 shape had halved a tail before. Steady-state blocks off -> on on
// three boards (docs/PERF.md session 21): 7168/T=2k 0.9954 / 0.9954 / 1.0008 (B won 18 of 24 rounds),
// T=8k 0.9945 / 1.0056 / 0.9972 (16 of 24), EP E=256 shapes 1.0048 / 1.0010 (A/A 0.9898 / 1.0018);
// predicted -0.6% / -0.5% from the bench's tile counts (DOWN's last wave at 2k: 24 items on 132 SMs;
// the pairs' at 8k: 8 items on 66 clusters).
bool sm90_tail_by_expert() { return env_choice("EPMOE_SM90_TAIL_BY_EXPERT", "on", "off", true); }
bool sm90_up_pair_tail_split() {
  return env_choice("EPMOE_SM90_UP_PAIR_TAIL", "half", "off", sm90_tail_split());
}
// Default auto (sm90_pad_halves_auto): same-process A/Bs in docs/PERF.md, session 9; steady-state
// blocks auto -> compute at hidden 2048: 0.9893 / 0.9867 at 16k (session 14), then 0.9950 / 1.0025 /
// 0.9987 / 1.0028 (4k, 16k, 64k, E=128 16k; session 15) - inside the A/A noise (+-1.8%), kept.
int sm90_pad_halves_mode() { return env_choice3("EPMOE_SM90_PAD_HALVES", {"compute", "skip", "auto"}, 2); }
// Default split (session 31): the experts the split rule picks (as the split UP's, over DOWN's column
// blocks) on the 192-row DOWN, the rest on the 128-row DOWN, which runs first (PDL); by expert only
// (hidden >= 4096 under EPMOE_SM90_ORDER=auto), else every expert on 128. With the 192-row DOWN's
// buffered epilogue (session 31): 7168/T=2k 128 -> split 0.9853 (5/6), 0.9918 (10/10; A/A 0.9994)
// in steady-state blocks on two boards, 0.9736 in separate processes on a third (DOWN alone 0.898 ->
// 0.855 ms); 7168/T=8k 1.0019 (2/6), T=4k 1.0014 (2/6), E=64 4096/768 T=4k 1.0033 (2/6). Session 30's
// form (the 192-row DOWN staged in its ring) lost 1-2% at T=4k and E=64. "192" alone stays opt-in:
// DOWN alone ~1% slower than 128 at 7168/T=2k (+3.7% / +7.5% / +9.9% at 7168/T=2k / T=8k /
// 2048/T=16k in session 27's form; docs/PERF.md).
static int sm90_down_rows_mode() { return env_choice3("EPMOE_SM90_DOWN_ROWS", {"128", "192", "split"}, 2); }
int sm90_down_rows() { return sm90_down_rows_mode() == 1 ? 192 : 128; }
bool sm90_down_split() { return sm90_down_rows_mode() == 2; }
// The 192-row UP alone (gathering from x, session 28; opt-in "192"): steady-state blocks of the layer
// 7168/T=2k 0.9804 (4/4) and 0.9855 (5/6; A/A 0.9994), 7168/T=8k 0.9948 / 0.9996, 2048/T=16k 1.0097
// (docs/PERF.md, session 28). Alone it is no default: the rows its tiles cover swing with the
// per-expert counts (uniform routing, rows over the 128-row kernels': 1.125 at 448 rows per expert,
// 1.208 at 256, 1.004 at 512), which the launch cannot see (they are on the device).
// Default split: each expert on 192-row tiles where they cover fewer rows (expert_prefers_tall,
// decided on the device from the counts): the 128-row UP, then the 192-row UP (PDL) for the rest;
// nothing changes where the 128-row UP runs the global order (hidden < 4096 by default). Session 29
// (docs/PERF.md): steady-state blocks of the layer 128 -> split (every picked expert tall) 0.9734
// (6/6) at 7168/T=2k, 0.9916 (4/6) at T=8k, up to 1.0064 where few experts are picked; the wave test
// (sm90_up_split_ctas) keeps those on 128.
static int sm90_up_rows_mode() { return env_choice3("EPMOE_SM90_UP_ROWS", {"128", "192", "split"}, 2); }
int sm90_up_rows() { return sm90_up_rows_mode() == 1 ? 192 : 128; }
bool sm90_up_split() { return sm90_up_rows_mode() == 2; }
// Default on: the wave rule (split_cut_score) over the device's SM count; off: 1, which sends every
// expert expert_prefers_tall picks (session 29's first default, kept for the tests: it puts experts
// in both halves on small problems, where the wave rule keeps all on 128).
int sm90_up_split_ctas() {
  return env_choice("EPMOE_SM90_UP_SPLIT_WAVES", "on", "off", true) ? sm90::device_sm_count() : 1;
}
// Default on (session 30): act's padding rows are all zero, as after the 128-row UP. Built to test
// whether the stale rows slowed DOWN (session 29: 0.894 ms after the 128-row UP, 0.904-0.909 after the
// split): they did not - layer off -> on 0.9969 (3/6, A/A 1.0008), DOWN alone 0.892 / 0.897 -> 0.897 /
// 0.900 ms, and with the zeroing on DOWN alone after the 128-row UP and the split alike (0.877-0.889).
bool sm90_up_zero_gap() { return env_choice("EPMOE_SM90_UP_ZERO_GAP", "on", "off", true); }
// Default async; steady-state blocks (session 15) async -> wait 1.0564 / 1.0537 / 1.0170.
bool sm90_gather_async_arrive() { return env_choice("EPMOE_SM90_GATHER_ARRIVE", "async", "wait", true); }
}  // namespace epmoe::kernels
