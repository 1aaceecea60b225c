// epmoe_bench_mxfp8: the local expert layer in MXFP8 (kernels/sm90/swap_mx.cuh) beside our bf16
// path (the automatic sm_90 plan, and swap-AB split explicitly) at decode and small-batch sizes, with
// the weight-streaming floors of both formats (touched experts' weight bytes / the HBM read rate
// measured in the same run).
//
// Same routing and operands for both: fp32 N(0, 1) draws (weights / sqrt(K)), rounded to bf16 for the
// bf16 path and quantized to MXFP8 (mx::quantize_rows) for the MX path; "mx vs bf16" is the relative
// L2 distance of the two outputs (the format's end-to-end error). Each point: 50 timed replays of the
// layer's CUDA graph, each after a streaming read of 256 MB that evicts the L2 (so every replay streams
// its weights from HBM as a decode step does), median; the first replays untimed. "mx up": the MX UP
// kernel alone (of the split form the tile rule picks: swap-AB or tile); "mx fused": the fused MX
// pipeline (one grid + its bf16 write-out; act never in HBM); "form": the heuristics' form, whose time
// is "mxfp8". "b128": the same layer in FP8 block-128 (epmoe/fp8_block.h: fp32 scales per 1 x 128 /
// 128 x 128, the block-128 tile kernels; weights fp8b::quantize_weight, x fp8b::quantize_rows), its
// floor the same bytes as MX's (E4M3 + 1/32 of scale bytes: 4 bytes per 128 of x, 4 per 128 x 128 of w),
// "b128~bf16" its distance to the bf16 output.
//   epmoe_bench_mxfp8 [--shapes E,k,H,F;...] [--tokens 1,8,...] [--json FILE]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "epmoe/bf16.h"
#include "epmoe/fp8_block.h"
#include "epmoe/mxfp8.h"
#include "epmoe/sm90_plan.h"
#include "kernels/cuda_check.cuh"
#include "kernels/sm90/experts.cuh"
#include "kernels/heuristics/mx_heuristics.h"
#include "kernels/sm90/swap_mx.cuh"
#include "programs/bench_hbm.cuh"

namespace {

using epmoe::bf16;
namespace mx = epmoe::mx;
namespace fp8b = epmoe::fp8b;
namespace ek = epmoe::kernels;

template <class T>
T* upload(const std::vector<T>& h) {
  T* p = nullptr;
  EPMOE_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(h.size(), 1) * sizeof(T)));
  if (!h.empty()) EPMOE_CUDA_CHECK(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  EPMOE_CUDA_CHECK(cudaDeviceSynchronize());
  return p;
}
template <class T>
T* zeros(size_t n) {
  T* p = nullptr;
  EPMOE_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  EPMOE_CUDA_CHECK(cudaMemset(p, 0, std::max<size_t>(n, 1) * sizeof(T)));
  EPMOE_CUDA_CHECK(cudaDeviceSynchronize());
  return p;
}

struct Point {
  int E, k, H, F, T;
  double bf16_auto_us, bf16_swap_us, mx_us, mx_up_us, floor_bf16_us, floor_mx_us, mx_vs_bf16;
  double mx_swap_us = 0, mx_tile_us = 0, mx_fused_us = 0;  // each form forced (mx_us: the heuristics' form)
  const char* mx_form = "swap";
  std::string auto_plan;
  double b128_us = 0, b128_up_us = 0, b128_vs_bf16 = 0;  // FP8 block-128 (tile form), and its UP alone
};

// Median µs of `reps` replays of g, each after a streaming read of `evict` (outside the timed events:
// the L2 holds none of the layer's bytes, and no dirty lines that a write would leave to drain).
double time_graph(cudaGraphExec_t g, cudaStream_t s, void* evict, size_t evict_bytes, int reps) {
  static unsigned* sink = zeros<unsigned>(1);
  cudaEvent_t e0, e1;
  EPMOE_CUDA_CHECK(cudaEventCreate(&e0));
  EPMOE_CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<double> us;
  for (int r = 0; r < reps + 5; ++r) {
    epmoe::bench::hbm_read_kernel<<<132 * 8, 512, 0, s>>>(static_cast<const uint4*>(evict), int64_t(evict_bytes / 16),
                                                          sink);
    EPMOE_CUDA_CHECK(cudaEventRecord(e0, s));
    EPMOE_CUDA_CHECK(cudaGraphLaunch(g, s));
    EPMOE_CUDA_CHECK(cudaEventRecord(e1, s));
    EPMOE_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    EPMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (r >= 5) us.push_back(double(ms) * 1e3);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

template <class F>
cudaGraphExec_t capture(cudaStream_t s, F&& body) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  EPMOE_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  body();
  EPMOE_CUDA_CHECK(cudaStreamEndCapture(s, &g));
  EPMOE_CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
  cudaGraphDestroy(g);
  return ge;
}

// One shape's weights on the device in both formats (drawn once, shared by its token counts).
struct Weights {
  int E, H, F;
  bf16 *w1 = nullptr, *w2 = nullptr;
  uint8_t *q1 = nullptr, *s1 = nullptr, *q2 = nullptr, *s2 = nullptr;
  uint8_t *b1 = nullptr, *b2 = nullptr;  // FP8 block-128 elements
  float *bs1 = nullptr, *bs2 = nullptr;  // and their 128 x 128 block scales
};
void to_mx(const std::vector<float>& v, int K, std::vector<uint8_t>& q, std::vector<uint8_t>& sc) {
  q.resize(v.size());
  sc.resize(v.size() / 32);
  mx::quantize_rows(v.data(), int64_t(v.size() / size_t(K)), K, q.data(), sc.data());
}
std::vector<bf16> to_bf16(const std::vector<float>& v) {
  std::vector<bf16> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = bf16(v[i]);
  return b;
}
Weights make_weights(int E, int H, int F) {
  std::mt19937 rng(99);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  Weights w{E, H, F};
  std::vector<uint8_t> q, sc;
  for (int which = 0; which < 2; ++which) {  // w1 [E, 2F, H] (K = H), w2 [E, H, F] (K = F)
    const int K = which == 0 ? H : F;
    std::vector<float> v(size_t(E) * (which == 0 ? 2 * F : H) * K);
    for (float& x : v) x = nd(rng) / std::sqrt(float(K));
    (which == 0 ? w.w1 : w.w2) = upload(to_bf16(v));
    to_mx(v, K, q, sc);
    (which == 0 ? w.q1 : w.q2) = upload(q);
    (which == 0 ? w.s1 : w.s2) = upload(sc);
    const int64_t rows = int64_t(v.size() / size_t(K));
    std::vector<float> bs(size_t(rows / fp8b::kBlock) * (K / fp8b::kBlock));
    fp8b::quantize_weight(v.data(), rows, K, q.data(), bs.data());
    (which == 0 ? w.b1 : w.b2) = upload(q);
    (which == 0 ? w.bs1 : w.bs2) = upload(bs);
  }
  return w;
}

Point run_point(const Weights& W, int k, int T, double hbm_tbs, void* evict, size_t evict_bytes, cudaStream_t s) {
  const int E = W.E, H = W.H, F = W.F;
  std::mt19937 rng(1234 + uint32_t(T));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(size_t(T) * H);
  for (float& v : x) v = nd(rng);
  // Routing: k distinct uniform experts per token; layout segments padded to 128 rows.
  std::vector<std::vector<std::pair<int, float>>> seg(static_cast<size_t>(E));
  std::uniform_real_distribution<float> wd(0.1f, 1.0f);
  std::vector<int> ids(static_cast<size_t>(E));
  for (int t = 0; t < T; ++t) {
    for (int e = 0; e < E; ++e) ids[size_t(e)] = e;
    std::shuffle(ids.begin(), ids.end(), rng);
    for (int j = 0; j < k; ++j) seg[size_t(ids[size_t(j)])].push_back({t, wd(rng)});
  }
  std::vector<int64_t> off(size_t(E) + 1, 0);
  int touched = 0;
  for (int e = 0; e < E; ++e) {
    off[size_t(e) + 1] = off[size_t(e)] + (int64_t(seg[size_t(e)].size()) + 127) / 128 * 128;
    touched += seg[size_t(e)].empty() ? 0 : 1;
  }
  const int64_t cap = std::max<int64_t>(off[size_t(E)], 128);
  std::vector<int32_t> prow(size_t(cap), -1);
  std::vector<float> pwt(size_t(cap), 0.0f);
  for (int e = 0; e < E; ++e)
    for (size_t i = 0; i < seg[size_t(e)].size(); ++i) {
      prow[size_t(off[size_t(e)]) + i] = seg[size_t(e)][i].first;
      pwt[size_t(off[size_t(e)]) + i] = seg[size_t(e)][i].second;
    }
  int64_t* d_off = upload(off);
  int32_t* d_row = upload(prow);
  float* d_wt = upload(pwt);

  // bf16 path.
  bf16* d_x = upload(to_bf16(x));
  bf16* d_act = zeros<bf16>(size_t(cap) * F);
  bf16* d_out = zeros<bf16>(size_t(T) * H);
  float* d_acc = zeros<float>(size_t(T) * H);
  ek::ExpertProblem p = ek::make_expert_problem(
      {reinterpret_cast<const __nv_bfloat16*>(W.w1), reinterpret_cast<const __nv_bfloat16*>(W.w2), E, H, F},
      reinterpret_cast<const __nv_bfloat16*>(d_x), T, {d_off, d_row, d_wt, cap},
      reinterpret_cast<__nv_bfloat16*>(d_act), reinterpret_cast<__nv_bfloat16*>(d_out), T, /*zero_out=*/true);
  p.pairs = int64_t(T) * k;
  p.out_acc = d_acc;
  const epmoe::Sm90Plan auto_plan = ek::sm90_plan_for(p);
  const epmoe::Sm90Plan swap_plan = ek::sm90_plan_for(p, epmoe::parse_sm90_plan_override("swap=on"));
  ek::ExpertProblem p_auto = p;
  if (!auto_plan.fused) p_auto.out_acc = nullptr;  // (the split kernels zero out themselves)
  ek::ExpertProblem p_swap = p;
  p_swap.out_acc = nullptr;
  cudaGraphExec_t g_auto = capture(s, [&] { ek::sm90_experts_launch(p_auto, auto_plan, s); });
  cudaGraphExec_t g_swap = capture(s, [&] { ek::sm90_experts_launch(p_swap, swap_plan, s); });

  // MX path.
  std::vector<uint8_t> qx, sx;
  to_mx(x, H, qx, sx);
  const int64_t xrb = mx::packed_row_bytes(H);
  std::vector<uint8_t> xp(size_t(std::max(T, 1)) * size_t(xrb), 0);
  for (int t = 0; t < T; ++t) mx::pack_row(&qx[size_t(t) * H], &sx[size_t(t) * H / 32], H, &xp[size_t(t) * size_t(xrb)]);
  uint8_t* m_x = upload(xp);
  uint8_t* m_act = zeros<uint8_t>(size_t(cap) * size_t(mx::packed_row_bytes(F)));
  bf16* m_out = zeros<bf16>(size_t(T) * H);
  ek::MxExpertProblem m;
  m.x = m_x, m.x_rows = std::max(T, 1), m.padded_offsets = d_off, m.pair_row = d_row, m.pair_weight = d_wt;
  m.w1 = W.q1, m.w1_scale = W.s1, m.w2 = W.q2, m.w2_scale = W.s2, m.act = m_act;
  m.out = reinterpret_cast<__nv_bfloat16*>(m_out), m.out_rows = T, m.rows_capacity = cap;
  m.experts = E, m.hidden = H, m.ffn = F, m.zero_out = true;
  float* m_acc = zeros<float>(size_t(T) * H);  // the fused form's accumulator (left zero by each call)
  m.out_acc = m_acc;
  ek::MxExpertProblem m_swap = m, m_tile = m, m_fused = m, m_split = m;
  m_swap.form = ek::MxForm::swap;
  m_tile.form = ek::MxForm::tile;
  m_fused.form = ek::MxForm::fused;
  m.form = ek::choose_mx_form(int64_t(T) * k, E, std::nullopt, std::nullopt);  // the engine's rule
  m_split.form = ek::mx_tile_form_pays(int64_t(T) * k, E) ? ek::MxForm::tile : ek::MxForm::swap;
  cudaGraphExec_t g_mx = capture(s, [&] { ek::sm90_mx_experts_launch(m, s); });
  cudaGraphExec_t g_mx_up = capture(s, [&] { ek::sm90_mx_up_launch(m_split, s); });
  cudaGraphExec_t g_mx_fused = capture(s, [&] { ek::sm90_mx_experts_launch(m_fused, s); });
  cudaGraphExec_t g_mx_swap = capture(s, [&] { ek::sm90_mx_experts_launch(m_swap, s); });
  cudaGraphExec_t g_mx_tile = capture(s, [&] { ek::sm90_mx_experts_launch(m_tile, s); });

  // FP8 block-128 path (its tile form).
  const int64_t brb = fp8b::packed_row_bytes(H);
  std::vector<uint8_t> bp(size_t(std::max(T, 1)) * size_t(brb), 0);
  {
    std::vector<uint8_t> bq(static_cast<size_t>(H));
    std::vector<float> bsc(static_cast<size_t>(H / fp8b::kBlock));
    for (int t = 0; t < T; ++t) {
      fp8b::quantize_rows(&x[size_t(t) * H], 1, H, bq.data(), bsc.data());
      std::memcpy(&bp[size_t(t) * size_t(brb)], bq.data(), size_t(H));
      std::memcpy(&bp[size_t(t) * size_t(brb) + size_t(H)], bsc.data(), bsc.size() * 4);
    }
  }
  uint8_t* b_x = upload(bp);
  uint8_t* b_act = zeros<uint8_t>(size_t(cap) * size_t(fp8b::packed_row_bytes(F)));
  bf16* b_out = zeros<bf16>(size_t(T) * H);
  ek::MxExpertProblem mb = m_tile;
  mb.scales = ek::Fp8Scales::block128;
  mb.x = b_x, mb.act = b_act, mb.out = reinterpret_cast<__nv_bfloat16*>(b_out);
  mb.w1 = W.b1, mb.w1_scale = reinterpret_cast<const uint8_t*>(W.bs1);
  mb.w2 = W.b2, mb.w2_scale = reinterpret_cast<const uint8_t*>(W.bs2);
  cudaGraphExec_t g_b128 = capture(s, [&] { ek::sm90_mx_experts_launch(mb, s); });
  cudaGraphExec_t g_b128_up = capture(s, [&] { ek::sm90_mx_up_launch(mb, s); });

  Point pt{E, k, H, F, T, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, "swap", epmoe::to_string(auto_plan)};
  pt.bf16_auto_us = time_graph(g_auto, s, evict, evict_bytes, 50);
  pt.bf16_swap_us = time_graph(g_swap, s, evict, evict_bytes, 50);
  pt.mx_up_us = time_graph(g_mx_up, s, evict, evict_bytes, 50);
  pt.mx_swap_us = time_graph(g_mx_swap, s, evict, evict_bytes, 50);
  pt.mx_tile_us = time_graph(g_mx_tile, s, evict, evict_bytes, 50);
  pt.mx_fused_us = time_graph(g_mx_fused, s, evict, evict_bytes, 50);
  pt.b128_up_us = time_graph(g_b128_up, s, evict, evict_bytes, 50);
  pt.b128_us = time_graph(g_b128, s, evict, evict_bytes, 50);
  pt.mx_us = time_graph(g_mx, s, evict, evict_bytes, 50);  // (last: m_out holds its result below)
  pt.mx_form = m.form == ek::MxForm::tile ? "tile" : m.form == ek::MxForm::fused ? "fused" : "swap";
  const double wbytes = 3.0 * double(H) * double(F) * touched;
  pt.floor_bf16_us = wbytes * 2 / (hbm_tbs * 1e12) * 1e6;
  pt.floor_mx_us = wbytes * (1.0 + 1.0 / 32) / (hbm_tbs * 1e12) * 1e6;
  // The two outputs (the last replays' results).
  std::vector<bf16> yb(size_t(T) * H), ym(size_t(T) * H), yq(size_t(T) * H);
  EPMOE_CUDA_CHECK(cudaMemcpy(yb.data(), d_out, yb.size() * 2, cudaMemcpyDeviceToHost));
  EPMOE_CUDA_CHECK(cudaMemcpy(ym.data(), m_out, ym.size() * 2, cudaMemcpyDeviceToHost));
  EPMOE_CUDA_CHECK(cudaMemcpy(yq.data(), b_out, yq.size() * 2, cudaMemcpyDeviceToHost));
  auto distance = [&](const std::vector<bf16>& y) {
    double num = 0, den = 0;
    for (size_t i = 0; i < yb.size(); ++i) {
      const double a = yb[i].f(), b = y[i].f();
      num += (a - b) * (a - b), den += a * a;
    }
    return den > 0 ? std::sqrt(num / den) : 0;
  };
  pt.mx_vs_bf16 = distance(ym);
  pt.b128_vs_bf16 = distance(yq);
  for (cudaGraphExec_t g : {g_auto, g_swap, g_mx, g_mx_up, g_mx_swap, g_mx_tile, g_mx_fused, g_b128, g_b128_up})
    cudaGraphExecDestroy(g);
  for (void* q : std::initializer_list<void*>{d_off, d_row, d_wt, d_x, d_act, d_out, d_acc, m_x, m_act, m_out, m_acc, b_x,
                                              b_act, b_out})
    cudaFree(q);
  return pt;
}

std::vector<int> parse_ints(const std::string& s, char sep) {
  std::vector<int> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep))
    if (!item.empty()) v.push_back(std::stoi(item));
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  std::string shapes = "32,4,2048,1024", tokens = "1,8,64,128", json;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "epmoe_bench_mxfp8: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--shapes") shapes = next();
    else if (a == "--tokens") tokens = next();
    else if (a == "--json") json = next();
    else {
      std::fprintf(stderr, "usage: epmoe_bench_mxfp8 [--shapes E,k,H,F;...] [--tokens 1,8,...] [--json FILE]\n");
      return 2;
    }
  }
  int dev = 0;
  EPMOE_CUDA_CHECK(cudaGetDevice(&dev));
  if (!ek::sm90_experts_supported(dev)) {
    std::fprintf(stderr, "epmoe_bench_mxfp8: needs a compute capability 9.0 device and an sm_90a build\n");
    return 1;
  }
  cudaStream_t s;
  EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const size_t evict_bytes = size_t(256) << 20;
  void* evict = zeros<uint8_t>(evict_bytes);
  const double hbm = epmoe::bench::hbm_read_tbs(s, {{evict, evict_bytes}});
  std::printf("# epmoe_bench_mxfp8: HBM read %.2f TB/s (256 MB streamed); µs = median of 50 graph replays, L2 evicted\n", hbm);
  std::printf("# %4s %2s %5s %5s %5s %10s %10s %10s %5s %8s %8s %8s %9s %9s %9s %9s %8s %8s %9s %9s %8s %8s  %s\n", "E", "k",
              "H", "F", "T", "bf16 auto", "bf16 swap", "mxfp8", "form", "mx swap", "mx tile", "mx up", "floor16", "floor8",
              "auto/mx", "mx/flr8", "mx~bf16", "b128", "auto/b128", "b128~bf16", "b128 up", "mx fused", "auto plan");
  std::vector<Point> pts;
  std::stringstream ss(shapes);
  std::string sh;
  while (std::getline(ss, sh, ';')) {
    const std::vector<int> d = parse_ints(sh, ',');
    if (d.size() != 4) {
      std::fprintf(stderr, "epmoe_bench_mxfp8: bad shape '%s' (E,k,H,F)\n", sh.c_str());
      return 2;
    }
    const Weights W = make_weights(d[0], d[2], d[3]);
    for (int T : parse_ints(tokens, ',')) {
      const Point p = run_point(W, d[1], T, hbm, evict, evict_bytes, s);
      std::printf(
          "  %4d %2d %5d %5d %5d %10.1f %10.1f %10.1f %5s %8.1f %8.1f %8.1f %9.1f %9.1f %9.2f %9.2f %8.4f %8.1f %9.2f %9.4f %8.1f %8.1f  %s\n",
          p.E, p.k, p.H, p.F, p.T, p.bf16_auto_us, p.bf16_swap_us, p.mx_us, p.mx_form, p.mx_swap_us,
          p.mx_tile_us, p.mx_up_us, p.floor_bf16_us, p.floor_mx_us, p.bf16_auto_us / p.mx_us, p.mx_us / p.floor_mx_us,
          p.mx_vs_bf16, p.b128_us, p.bf16_auto_us / p.b128_us, p.b128_vs_bf16, p.b128_up_us, p.mx_fused_us,
          p.auto_plan.c_str());
      std::fflush(stdout);
      pts.push_back(p);
    }
    for (void* q : std::initializer_list<void*>{W.w1, W.w2, W.q1, W.s1, W.q2, W.s2, W.b1, W.b2, W.bs1, W.bs2}) cudaFree(q);
  }
  if (!json.empty()) {
    FILE* f = std::fopen(json.c_str(), "w");
    if (!f) {
      std::fprintf(stderr, "epmoe_bench_mxfp8: cannot write %s\n", json.c_str());
      return 1;
    }
    std::fprintf(f, "{\"hbm_tbs\": %.4f, \"points\": [", hbm);
    for (size_t i = 0; i < pts.size(); ++i) {
      const Point& p = pts[i];
      std::fprintf(f,
                   "%s{\"E\": %d, \"k\": %d, \"hidden\": %d, \"ffn\": %d, \"T\": %d, \"bf16_auto_us\": %.3f, "
                   "\"bf16_swap_us\": %.3f, \"mxfp8_us\": %.3f, \"mxfp8_up_us\": %.3f, \"floor_bf16_us\": %.3f, \"floor_mxfp8_us\": %.3f, "
                   "\"mx_vs_bf16_rel_l2\": %.5f, \"auto_plan\": \"%s\", \"mx_form\": \"%s\", \"mxfp8_swap_us\": %.3f, "
                   "\"mxfp8_tile_us\": %.3f, \"mxfp8_fused_us\": %.3f, \"fp8_block_us\": %.3f, \"fp8_block_vs_bf16_rel_l2\": %.5f, "
                   "\"fp8_block_up_us\": %.3f}",
                   i ? ", " : "", p.E, p.k, p.H, p.F, p.T, p.bf16_auto_us, p.bf16_swap_us, p.mx_us, p.mx_up_us,
                   p.floor_bf16_us, p.floor_mx_us, p.mx_vs_bf16, p.auto_plan.c_str(), p.mx_form,
                   p.mx_swap_us, p.mx_tile_us, p.mx_fused_us, p.b128_us, p.b128_vs_bf16, p.b128_up_us);
    }
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }
  cudaFree(evict);
  cudaStreamDestroy(s);
  return 0;
}
