// epmoe_bench_capturable: the decode-sized forward on one GPU (world 1), MoeLayer::forward_capturable
// captured once in a CUDA graph and replayed at each token count T, beside the regular forward
// (MoeLayer::forward, host-synchronising) at the same T, and the weight-streaming floor: the bytes of
// the experts the T tokens touch (W1 + W2 of each) over the HBM read rate measured in the same run
// (a streaming read of all the weights).
//
//   epmoe_bench_capturable [--shape E,k,hidden,ffn,N] [--tokens 0,1,8,...] [--iters N] [--json PATH]
//                          [--transport local|slots] [--plan SPEC] [--format mxfp8|block128 [--fp8-plan SPEC]]
//
// N = the capture's capacity (max_tokens_per_rank); T <= N. Times: the median over --iters of
// events around one replay (graph) or one forward call (regular; it waits on the host for its count
// exchange, so its events include that gap), and the regular forward in deterministic mode (determ_us). --plan: an sm_90 plan override for both (epmoe/sm90_plan.h;
// e.g. swap=off to time the 128-row kernels where the heuristics pick swap-AB). Each T's graph output is checked on sampled tokens
// against reference_moe (fp64), and its rows past T must be zero. Training columns: one graph of
// forward_capturable(save) + backward_capturable (train_graph_us) beside the regular forward(save) +
// backward (train_regular_us; host-synchronising), f32 weight gradients, LayerOptions' save policy.
// --format: also the same weights quantized to MXFP8 or FP8 block-128 (forward-only), its capturable
// forward's graph and its regular forward (fp8_graph_us, fp8_regular_us), its floor (1 + 1/32 or
// 1 + 4/16384 bytes per weight), bf16 graph / fp8 graph (fp8_gain), and its graph's y on the sampled
// tokens within 0.12 relative L2 of the bf16 reference (the format's own error: test_mxfp8);
// --fp8-plan: its form (swap=on|off, fused=on|off).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "bench_data.h"
#include "bench_hbm.cuh"
#include "epmoe/fp8_block.h"
#include "epmoe/moe_layer.h"
#include "epmoe/mxfp8.h"
#include "epmoe/nccl_communicator.h"
#include "kernels/cuda_check.cuh"

namespace {

using namespace epmoe;
using namespace epmoe::bench;

struct DevMem {
  void* p = nullptr;
  explicit DevMem(size_t bytes) { EPMOE_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 16))); }
  ~DevMem() { cudaFree(p); }
  template <class T>
  T* as() const { return static_cast<T*>(p); }
};

double event_ms(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0;
  EPMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  return ms;
}

}  // namespace

int main(int argc, char** argv) {
  Shape s{32, 4, 2048, 1024, 512};
  std::vector<int64_t> counts = {0, 1, 8, 64, 128, 512};
  int iters = 200;
  std::string json;
  CapturableTransport transport = CapturableTransport::automatic;
  std::string plan_spec, format = "bf16", fp8_plan_spec;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) { std::fprintf(stderr, "%s needs a value\n", a.c_str()); std::exit(2); }
      return argv[++i];
    };
    if (a == "--shape") {
      if (!scan_shape(next(), s) || !valid_shape(s, 1)) { std::fprintf(stderr, "bad --shape\n"); return 2; }
    } else if (a == "--tokens") {
      counts.clear();
      std::stringstream ss(next());
      for (std::string t; std::getline(ss, t, ',');) counts.push_back(std::stoll(t));
    } else if (a == "--iters") {
      iters = std::max(1, std::atoi(next().c_str()));
    } else if (a == "--json") {
      json = next();
    } else if (a == "--transport") {
      const std::string v = next();
      if (v != "local" && v != "slots") { std::fprintf(stderr, "--transport local|slots\n"); return 2; }
      transport = v == "local" ? CapturableTransport::local : CapturableTransport::slots;
    } else if (a == "--plan") {
      plan_spec = next();
    } else if (a == "--format") {
      format = next();
      if (format != "mxfp8" && format != "block128") { std::fprintf(stderr, "--format mxfp8|block128\n"); return 2; }
    } else if (a == "--fp8-plan") {
      fp8_plan_spec = next();
    } else {
      std::fprintf(stderr, "usage: %s [--shape E,k,hidden,ffn,N] [--tokens T,T,...] [--iters N] [--json PATH] "
                   "[--transport local|slots] [--plan SPEC] [--format mxfp8|block128 [--fp8-plan SPEC]]\n", argv[0]);
      return a == "--help" ? 0 : 2;
    }
  }
  const int64_t N = s.tokens;
  for (int64_t T : counts)
    if (T < 0 || T > N) { std::fprintf(stderr, "T=%lld outside [0, N=%lld]\n", (long long)T, (long long)N); return 2; }
  g_threads = int(std::max(1u, std::thread::hardware_concurrency()));
  const uint64_t seed = 7;
  const float w1_std = 1.f / std::sqrt(float(s.hidden)), w2_std = 1.f / std::sqrt(float(s.ffn));
  const size_t n1 = size_t(2) * s.ffn * s.hidden, n2 = size_t(s.hidden) * s.ffn;
  const bool fp8 = format != "bf16", block = format == "block128";
  if (fp8 && (s.hidden % 128 != 0 || s.ffn % 128 != 0)) {
    std::fprintf(stderr, "--format: hidden and ffn must be multiples of 128\n");
    return 2;
  }
  // An expert's scale bytes (block-128: fp32 per 128 x 128; MXFP8: one E8M0 per 32 along K).
  auto scale_bytes = [&](size_t n) { return !fp8 ? 0 : block ? n / (128 * 128) * 4 : n / 32; };
  const size_t sb1 = scale_bytes(n1), sb2 = scale_bytes(n2);
  DevMem w1(s.E * n1 * 2), w2(s.E * n2 * 2);
  DevMem q1(fp8 ? s.E * n1 : 0), q2(fp8 ? s.E * n2 : 0), sc1(s.E * sb1), sc2(s.E * sb2);
  {
    std::vector<bf16> h1(n1), h2(n2);
    std::vector<uint8_t> hq1(fp8 ? n1 : 0), hq2(fp8 ? n2 : 0), hs1(sb1), hs2(sb2);
    for (int e = 0; e < s.E; ++e) {
      generate_expert(seed, s, e, h1.data(), h2.data(), w1_std, w2_std);
      EPMOE_CUDA_CHECK(cudaMemcpy(w1.as<char>() + e * n1 * 2, h1.data(), n1 * 2, cudaMemcpyHostToDevice));
      EPMOE_CUDA_CHECK(cudaMemcpy(w2.as<char>() + e * n2 * 2, h2.data(), n2 * 2, cudaMemcpyHostToDevice));
      if (!fp8) continue;
      if (block) {
        fp8b::quantize_weight(h1.data(), 2 * s.ffn, s.hidden, hq1.data(), reinterpret_cast<float*>(hs1.data()));
        fp8b::quantize_weight(h2.data(), s.hidden, s.ffn, hq2.data(), reinterpret_cast<float*>(hs2.data()));
      } else {
        mx::quantize_rows(h1.data(), 2 * s.ffn, s.hidden, hq1.data(), hs1.data());
        mx::quantize_rows(h2.data(), s.hidden, s.ffn, hq2.data(), hs2.data());
      }
      EPMOE_CUDA_CHECK(cudaMemcpy(q1.as<char>() + e * n1, hq1.data(), n1, cudaMemcpyHostToDevice));
      EPMOE_CUDA_CHECK(cudaMemcpy(q2.as<char>() + e * n2, hq2.data(), n2, cudaMemcpyHostToDevice));
      EPMOE_CUDA_CHECK(cudaMemcpy(sc1.as<char>() + e * sb1, hs1.data(), sb1, cudaMemcpyHostToDevice));
      EPMOE_CUDA_CHECK(cudaMemcpy(sc2.as<char>() + e * sb2, hs2.data(), sb2, cudaMemcpyHostToDevice));
    }
  }
  std::vector<bf16> hx(size_t(N) * s.hidden);
  std::vector<int32_t> hids(size_t(N) * s.k);
  std::vector<float> hw(size_t(N) * s.k);
  fill_normal_bf16(hx.data(), int64_t(hx.size()), stream_key(seed, kTagX, 0, 0), 1.f);
  route_softmax_topk(stream_key(seed, kTagLogits, 0, 0), N, s.E, s.k, hids.data(), hw.data());
  DevMem x(hx.size() * 2), ids(hids.size() * 4), wts(hw.size() * 4), y(hx.size() * 2), y8(hx.size() * 2), d_T(8);
  DevMem dy(hx.size() * 2), dx(hx.size() * 2), dwts(hw.size() * 4), dw1(size_t(s.E) * n1 * 4), dw2(size_t(s.E) * n2 * 4);
  {
    std::vector<bf16> hdy(hx.size());
    fill_normal_bf16(hdy.data(), int64_t(hdy.size()), stream_key(seed, kTagX, 1, 0), 1.f);
    EPMOE_CUDA_CHECK(cudaMemcpy(dy.p, hdy.data(), hdy.size() * 2, cudaMemcpyHostToDevice));
  }
  EPMOE_CUDA_CHECK(cudaMemcpy(x.p, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
  EPMOE_CUDA_CHECK(cudaMemcpy(ids.p, hids.data(), hids.size() * 4, cudaMemcpyHostToDevice));
  EPMOE_CUDA_CHECK(cudaMemcpy(wts.p, hw.data(), hw.size() * 4, cudaMemcpyHostToDevice));
  // (a pageable cudaMemcpy returns before the device has the bytes; the layer runs on another stream)
  EPMOE_CUDA_CHECK(cudaDeviceSynchronize());

  int dev = 0;
  EPMOE_CUDA_CHECK(cudaGetDevice(&dev));
  auto view = [&](const DevMem& m, DType t, std::initializer_list<int64_t> shape) {
    return TensorView::contiguous(m.p, t, shape, DeviceType::cuda, dev);
  };
  const MoeConfig cfg{.num_experts = s.E, .top_k = s.k, .hidden = s.hidden, .ffn = s.ffn, .world_size = 1, .rank = 0};
  const ExpertWeights weights{view(w1, DType::bf16, {s.E, 2 * int64_t(s.ffn), s.hidden}),
                              view(w2, DType::bf16, {s.E, int64_t(s.hidden), s.ffn})};
  auto comm = make_nccl_communicator_single();
  LayerOptions opt;
  opt.expert_path = ExpertPath::sm90;
  opt.max_tokens_per_rank = N;
  opt.capturable_transport = transport;
  opt.sm90_plan = parse_sm90_plan_override(plan_spec);
  MoeLayer layer(cfg, weights, comm, opt);
  // The regular forward in deterministic mode (LayerOptions::deterministic; not capturable): its cost
  // against the regular forward's.
  LayerOptions opt_det = opt;
  opt_det.max_tokens_per_rank = 0;
  opt_det.deterministic = true;
  MoeLayer layer_det(cfg, weights, comm, opt_det);
  // The FP8 layer (--format): the same experts quantized, capturable with the same capacity and transport.
  std::unique_ptr<MoeLayer> layer8;
  if (fp8) {
    const int64_t E = s.E, H = s.hidden, F = s.ffn;
    ExpertWeights w8{view(q1, DType::e4m3, {E, 2 * F, H}), view(q2, DType::e4m3, {E, H, F})};
    w8.w1_scale = block ? view(sc1, DType::f32, {E, 2 * F / 128, H / 128}) : view(sc1, DType::e8m0, {E, 2 * F, H / 32});
    w8.w2_scale = block ? view(sc2, DType::f32, {E, H / 128, F / 128}) : view(sc2, DType::e8m0, {E, H, F / 32});
    LayerOptions opt8;
    opt8.max_tokens_per_rank = N;
    opt8.capturable_transport = transport;
    opt8.sm90_plan = parse_sm90_plan_override(fp8_plan_spec);
    layer8 = std::make_unique<MoeLayer>(cfg, w8, comm, opt8);
  }
  const char* transport_name = transport == CapturableTransport::slots ? "slots" : "local";
  cudaStream_t st;
  EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  EPMOE_CUDA_CHECK(cudaEventCreate(&e0));
  EPMOE_CUDA_CHECK(cudaEventCreate(&e1));

  // The HBM read rate: all the weights, streamed.
  const double read_tbs = hbm_read_tbs(st, {{w1.p, size_t(s.E) * n1 * 2}, {w2.p, size_t(s.E) * n2 * 2}});

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  EPMOE_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  layer.forward_capturable(view(x, DType::bf16, {N, s.hidden}), view(ids, DType::i32, {N, s.k}),
                           view(wts, DType::f32, {N, s.k}), view(y, DType::bf16, {N, s.hidden}), d_T.as<int64_t>(), st);
  EPMOE_CUDA_CHECK(cudaStreamEndCapture(st, &graph));
  EPMOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaGraph_t graph8 = nullptr;
  cudaGraphExec_t exec8 = nullptr;
  if (fp8) {
    EPMOE_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    layer8->forward_capturable(view(x, DType::bf16, {N, s.hidden}), view(ids, DType::i32, {N, s.k}),
                               view(wts, DType::f32, {N, s.k}), view(y8, DType::bf16, {N, s.hidden}), d_T.as<int64_t>(),
                               st);
    EPMOE_CUDA_CHECK(cudaStreamEndCapture(st, &graph8));
    EPMOE_CUDA_CHECK(cudaGraphInstantiate(&exec8, graph8, 0));
  }
  // The training graph: forward(save) + backward. The first saving forward sizes the backward's
  // buffers, so it runs once before the capture.
  ExpertGradients grads;
  grads.dw1 = view(dw1, DType::f32, {s.E, 2 * int64_t(s.ffn), s.hidden});
  grads.dw2 = view(dw2, DType::f32, {s.E, int64_t(s.hidden), s.ffn});
  auto train_step = [&] {
    layer.forward_capturable(view(x, DType::bf16, {N, s.hidden}), view(ids, DType::i32, {N, s.k}),
                             view(wts, DType::f32, {N, s.k}), view(y, DType::bf16, {N, s.hidden}), d_T.as<int64_t>(), st,
                             /*save=*/true);
    layer.backward_capturable(view(x, DType::bf16, {N, s.hidden}), view(ids, DType::i32, {N, s.k}),
                              view(dy, DType::bf16, {N, s.hidden}), view(dx, DType::bf16, {N, s.hidden}),
                              view(dwts, DType::f32, {N, s.k}), grads, d_T.as<int64_t>(), st);
  };
  EPMOE_CUDA_CHECK(cudaMemset(d_T.p, 0, 8));
  EPMOE_CUDA_CHECK(cudaDeviceSynchronize());
  train_step();
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(st));
  cudaGraph_t train_graph;
  cudaGraphExec_t train_exec;
  EPMOE_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  train_step();
  EPMOE_CUDA_CHECK(cudaStreamEndCapture(st, &train_graph));
  EPMOE_CUDA_CHECK(cudaGraphInstantiate(&train_exec, train_graph, 0));

  std::printf("# epmoe_bench_capturable: E=%d k=%d hidden=%d ffn=%d capacity N=%lld, world 1, transport %s, "
              "HBM read %.2f TB/s, plan override '%s'\n", s.E, s.k, s.hidden, s.ffn, (long long)N, transport_name, read_tbs,
              plan_spec.c_str());
  if (fp8) std::printf("# FP8 layer: %s, form override '%s'\n", format.c_str(), fp8_plan_spec.c_str());
  std::printf("#%7s %8s %10s %11s %8s %12s %8s %11s %9s %15s %17s", "T", "experts", "floor_us", "graph_us", "x_floor",
              "regular_us", "speedup", "determ_us", "check", "train_graph_us", "train_regular_us");
  if (fp8) std::printf(" %13s %13s %15s %9s %14s", "fp8_floor_us", "fp8_graph_us", "fp8_regular_us", "fp8_gain", "fp8_check");
  std::printf("\n");
  std::string rows;
  bool all_ok = true;
  for (int64_t T : counts) {
    EPMOE_CUDA_CHECK(cudaMemcpy(d_T.p, &T, 8, cudaMemcpyHostToDevice));
    EPMOE_CUDA_CHECK(cudaDeviceSynchronize());  // (as above)
    std::vector<char> touched(size_t(s.E), 0);
    for (int64_t i = 0; i < T * s.k; ++i)
      if (hids[size_t(i)] >= 0) touched[size_t(hids[size_t(i)])] = 1;
    int nt = 0;
    for (char c : touched) nt += c;
    const double floor_us = double(nt) * double(n1 + n2) * 2 / (read_tbs * 1e12) * 1e6;
    // The median of `iters` timed calls of `enqueue` (after 10 untimed), us between events.
    auto time_us = [&](auto&& enqueue) {
      std::vector<double> t;
      for (int r = 0; r < iters + 10; ++r) {
        EPMOE_CUDA_CHECK(cudaEventRecord(e0, st));
        enqueue();
        EPMOE_CUDA_CHECK(cudaEventRecord(e1, st));
        EPMOE_CUDA_CHECK(cudaEventSynchronize(e1));
        if (r >= 10) t.push_back(event_ms(e0, e1) * 1e3);
      }
      return median(t);
    };
    const double g = time_us([&] { EPMOE_CUDA_CHECK(cudaGraphLaunch(exec, st)); });
    // The graph's output: sampled tokens vs the fp64 reference, rows past T zero.
    std::vector<bf16> hy(hx.size());
    EPMOE_CUDA_CHECK(cudaMemcpy(hy.data(), y.p, hy.size() * 2, cudaMemcpyDeviceToHost));
    Shape sT = s;
    sT.tokens = T;
    const CheckResult c = check_sampled(seed, sT, hx.data(), hids.data(), hw.data(), hy.data(), 8, w1_std, w2_std);
    const double rel = c.ref2 > 0 ? std::sqrt(c.err2 / c.ref2) : 0;
    bool zero_past = true;
    for (size_t i = size_t(T) * s.hidden; i < hy.size(); ++i) zero_past = zero_past && hy[i].f() == 0.f;
    const bool ok = rel < 1e-2 && zero_past;
    all_ok = all_ok && ok;
    auto regular = [&](MoeLayer& l) {
      return time_us([&] {
        l.forward(view(x, DType::bf16, {T, s.hidden}), view(ids, DType::i32, {T, s.k}),
                  view(wts, DType::f32, {T, s.k}), view(y, DType::bf16, {T, s.hidden}), st);
      });
    };
    const double rg = regular(layer), dg = regular(layer_det);
    const double tg = time_us([&] { EPMOE_CUDA_CHECK(cudaGraphLaunch(train_exec, st)); });
    // The FP8 layer: its graph, checked (sampled tokens vs the bf16 reference, rows past T zero), and
    // its regular forward.
    double fg = 0, fr = 0, frel = 0;
    bool fok = true;
    const double fp8_floor_us =
        double(nt) * double(n1 + n2) * (block ? 1.0 + 4.0 / (128 * 128) : 1.0 + 1.0 / 32) / (read_tbs * 1e12) * 1e6;
    if (fp8) {
      fg = time_us([&] { EPMOE_CUDA_CHECK(cudaGraphLaunch(exec8, st)); });
      std::vector<bf16> hy8(hx.size());
      EPMOE_CUDA_CHECK(cudaMemcpy(hy8.data(), y8.p, hy8.size() * 2, cudaMemcpyDeviceToHost));
      const CheckResult c8 = check_sampled(seed, sT, hx.data(), hids.data(), hw.data(), hy8.data(), 8, w1_std, w2_std);
      frel = c8.ref2 > 0 ? std::sqrt(c8.err2 / c8.ref2) : 0;
      for (size_t i = size_t(T) * s.hidden; i < hy8.size(); ++i) fok = fok && hy8[i].f() == 0.f;
      fok = fok && frel < 0.12;
      all_ok = all_ok && fok;
      fr = time_us([&] {
        layer8->forward(view(x, DType::bf16, {T, s.hidden}), view(ids, DType::i32, {T, s.k}),
                        view(wts, DType::f32, {T, s.k}), view(y8, DType::bf16, {T, s.hidden}), st);
      });
    }
    const double tr = time_us([&] {
      MoeForwardContext ctx;
      layer.forward(view(x, DType::bf16, {T, s.hidden}), view(ids, DType::i32, {T, s.k}),
                    view(wts, DType::f32, {T, s.k}), view(y, DType::bf16, {T, s.hidden}), st, &ctx);
      layer.backward(ctx, view(dy, DType::bf16, {T, s.hidden}), view(dx, DType::bf16, {T, s.hidden}),
                     view(dwts, DType::f32, {T, s.k}), grads, st);
    });
    char check[32];
    std::snprintf(check, sizeof check, "%s %.1e", ok ? "ok" : "FAIL", rel);
    std::printf(" %7lld %8d %10.2f %11.2f %8.2f %12.2f %8.2f %11.2f %9s %15.2f %17.2f", (long long)T, nt, floor_us, g,
                floor_us > 0 ? g / floor_us : 0.0, rg, rg / g, dg, check, tg, tr);
    char check8[32];
    std::snprintf(check8, sizeof check8, "%s %.1e", fok ? "ok" : "FAIL", frel);
    if (fp8) std::printf(" %13.2f %13.2f %15.2f %9.2f %14s", fp8_floor_us, fg, fr, g / fg, check8);
    std::printf("\n");
    std::fflush(stdout);
    rows += std::string(rows.empty() ? "" : ",\n") + "    {\"T\": " + std::to_string(T) +
            ", \"experts_touched\": " + std::to_string(nt) + ", \"floor_us\": " + json_num(floor_us) +
            ", \"graph_us\": " + json_num(g) + ", \"regular_us\": " + json_num(rg) + ", \"deterministic_us\": " + json_num(dg) +
            ", \"train_graph_us\": " + json_num(tg) + ", \"train_regular_us\": " + json_num(tr) + ", \"check_rel_l2\": " +
            json_num(rel) + ", \"ok\": " + (ok ? "true" : "false") +
            (fp8 ? ", \"fp8_floor_us\": " + json_num(fp8_floor_us) + ", \"fp8_graph_us\": " + json_num(fg) +
                       ", \"fp8_regular_us\": " + json_num(fr) + ", \"fp8_check_rel_l2_vs_bf16_ref\": " + json_num(frel) +
                       ", \"fp8_ok\": " + (fok ? "true" : "false")
                 : std::string()) +
            "}";
  }
  if (!json.empty()) {
    FILE* f = std::fopen(json.c_str(), "w");
    if (f) {
      std::fprintf(f, "{\"shape\": {\"E\": %d, \"k\": %d, \"hidden\": %d, \"ffn\": %d, \"capacity\": %lld},\n"
                      " \"transport\": \"%s\", \"plan_override\": \"%s\", \"format\": \"%s\", \"fp8_plan_override\": \"%s\",\n"
                      " \"hbm_read_tbs\": %s, \"iters\": %d,\n"
                      " \"rows\": [\n%s\n ]}\n",
                   s.E, s.k, s.hidden, s.ffn, (long long)N, transport_name, plan_spec.c_str(), format.c_str(),
                   fp8_plan_spec.c_str(), json_num(read_tbs).c_str(),
                   iters, rows.c_str());
      std::fclose(f);
    }
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  if (exec8) cudaGraphExecDestroy(exec8);
  if (graph8) cudaGraphDestroy(graph8);
  cudaGraphExecDestroy(train_exec);
  cudaGraphDestroy(train_graph);
  return all_ok ? 0 : 1;
}
