#include "fp8_model.h"

#include <cmath>
#include <memory>
#include <string>

#include "comm/mock_comm.h"
#include "epmoe/fp8_block.h"
#include "epmoe/mxfp8.h"
#include "epmoe/reference.h"

namespace epmoe::test {

Fp8Model quantize_model(const ModelWeights& M, Fp8Layout layout) {
  const int E = M.E, H = M.hidden, F = M.ffn;
  Fp8Model q;
  q.layout = layout, q.E = E, q.hidden = H, q.ffn = F;
  q.w1.resize(M.w1.size()), q.w2.resize(M.w2.size());
  if (layout == Fp8Layout::mxfp8) {
    q.w1s_e8m0.resize(M.w1.size() / mx::kBlock), q.w2s_e8m0.resize(M.w2.size() / mx::kBlock);
    mx::quantize_rows(M.w1.data(), int64_t(E) * 2 * F, H, q.w1.data(), q.w1s_e8m0.data());
    mx::quantize_rows(M.w2.data(), int64_t(E) * H, F, q.w2.data(), q.w2s_e8m0.data());
    return q;
  }
  constexpr int kB = fp8b::kBlock;
  const size_t s1 = size_t(2 * F / kB) * (H / kB), s2 = size_t(H / kB) * (F / kB);
  q.w1s_f32.resize(size_t(E) * s1), q.w2s_f32.resize(size_t(E) * s2);
  for (int e = 0; e < E; ++e) {
    fp8b::quantize_weight(M.w1_of(e), 2 * F, H, q.w1.data() + size_t(e) * 2 * F * H, q.w1s_f32.data() + e * s1);
    fp8b::quantize_weight(M.w2_of(e), H, F, q.w2.data() + size_t(e) * H * F, q.w2s_f32.data() + e * s2);
  }
  return q;
}

ExpertWeights Fp8Model::shard(int world, int rank) const {
  const int64_t El = E / world, H = hidden, F = ffn, e0 = El * rank;
  auto* m = const_cast<Fp8Model*>(this);  // (views; the tests do not write through them)
  ExpertWeights w{TensorView::contiguous(m->w1.data() + e0 * 2 * F * H, DType::e4m3, {El, 2 * F, H}),
                  TensorView::contiguous(m->w2.data() + e0 * H * F, DType::e4m3, {El, H, F})};
  if (layout == Fp8Layout::mxfp8) {
    w.w1_scale = TensorView::contiguous(m->w1s_e8m0.data() + e0 * 2 * F * (H / mx::kBlock), DType::e8m0,
                                        {El, 2 * F, H / mx::kBlock});
    w.w2_scale = TensorView::contiguous(m->w2s_e8m0.data() + e0 * H * (F / mx::kBlock), DType::e8m0,
                                        {El, H, F / mx::kBlock});
  } else {
    constexpr int64_t kB = fp8b::kBlock;
    w.w1_scale = TensorView::contiguous(m->w1s_f32.data() + e0 * (2 * F / kB) * (H / kB), DType::f32,
                                        {El, 2 * F / kB, H / kB});
    w.w2_scale = TensorView::contiguous(m->w2s_f32.data() + e0 * (H / kB) * (F / kB), DType::f32,
                                        {El, H / kB, F / kB});
  }
  return w;
}

void Fp8Model::reference(const bf16* x, const int32_t* topk_ids, const float* topk_weights, int64_t T, int top_k,
                         float* y) const {
  if (layout == Fp8Layout::mxfp8)
    reference_moe_mxfp8(x, topk_ids, topk_weights, T, top_k, w1.data(), w1s_e8m0.data(), w2.data(), w2s_e8m0.data(),
                        E, hidden, ffn, y);
  else
    reference_moe_fp8_block(x, topk_ids, topk_weights, T, top_k, w1.data(), w1s_f32.data(), w2.data(),
                            w2s_f32.data(), E, hidden, ffn, y);
}

double fp8_layer_case(Fp8Layout layout, const Fp8LayerRun& c, uint64_t seed) {
  const bool is_mx = layout == Fp8Layout::mxfp8;
  SCOPED_TRACE(std::string(is_mx ? "MXFP8" : "block-128") + " W=" + std::to_string(c.W) + " E=" + std::to_string(c.E) +
               " k=" + std::to_string(c.k) + " " + std::to_string(c.H) + "/" + std::to_string(c.F) +
               " T=" + std::to_string(c.T));
  const ModelWeights M = make_weights(c.E, c.H, c.F, seed + uint64_t(c.W));
  const Fp8Model q = quantize_model(M, layout);
  const int64_t row_bytes = is_mx ? mx::packed_row_bytes(c.H) : fp8b::packed_row_bytes(c.H);
  const QuantizeRow quantize_row = is_mx ? QuantizeRow(mx::quantize_packed_row) : QuantizeRow(fp8b::quantize_packed_row);
  std::vector<double> err2(size_t(c.W), 0), ref2(size_t(c.W), 0);
  std::vector<int64_t> bad_rows(size_t(c.W), -1);
  auto run = [&](int r, std::shared_ptr<Communicator> comm) {
    const MoeConfig cfg{.num_experts = c.E, .top_k = c.k, .hidden = c.H, .ffn = c.F, .world_size = c.W, .rank = r};
    LayerOptions opt;
    opt.on_receive = [&, r](const void* rows, const int32_t* meta, const std::vector<int64_t>& per_rank) {
      bad_rows[size_t(r)] = count_mismatched_rows(rows, meta, per_rank, c.k, seed + 100, c.T, c.H, row_bytes, quantize_row);
    };
    MoeLayer layer(cfg, q.shard(c.W, r), std::move(comm), opt);
    const std::vector<bf16> x = make_x(seed + 100, r, c.T, c.H);
    const Routing R = make_routing(c.T, c.E, c.k, c.kind, mix(seed + 200, r), 0, c.W);
    std::vector<bf16> y(x.size());
    layer.forward(TensorView::contiguous(const_cast<bf16*>(x.data()), DType::bf16, {c.T, c.H}),
                  TensorView::contiguous(const_cast<int32_t*>(R.ids.data()), DType::i32, {c.T, c.k}),
                  TensorView::contiguous(const_cast<float*>(R.weights.data()), DType::f32, {c.T, c.k}),
                  TensorView::contiguous(y.data(), DType::bf16, {c.T, c.H}));
    const ForwardStats& st = layer.last_stats();
    int64_t sent = 0;
    for (int64_t n : st.send_rows) sent += n;
    EXPECT_EQ(st.dispatch_bytes, sent * (row_bytes + 4 * (1 + 2 * c.k))) << "rank " << r;
    std::vector<float> ref(y.size()), ref_bf16(y.size());
    q.reference(x.data(), R.ids.data(), R.weights.data(), c.T, c.k, ref.data());
    EXPECT_TRUE(close_to_reference(y.data(), ref.data(), c.T, c.H, kCpuTolerance)) << "rank " << r;
    reference_moe(x.data(), R.ids.data(), R.weights.data(), c.T, c.k, M.w1.data(), M.w2.data(), c.E, c.H, c.F,
                  ref_bf16.data());
    for (size_t i = 0; i < y.size(); ++i) {
      const double d = double(y[i].f()) - ref_bf16[i];
      err2[size_t(r)] += d * d;
      ref2[size_t(r)] += double(ref_bf16[i]) * ref_bf16[i];
    }
  };
  report_rank_errors(run_mock_ranks(c.W, run), is_mx ? "mxfp8 layer" : "fp8 block layer");
  for (int r = 0; r < c.W; ++r) EXPECT_EQ(bad_rows[size_t(r)], 0) << "rank " << r << "'s received rows";
  double e = 0, n = 0;
  for (int r = 0; r < c.W; ++r) e += err2[size_t(r)], n += ref2[size_t(r)];
  const double rel = n > 0 ? std::sqrt(e / n) : 0.0;
  std::printf("%s layer W=%d E=%d k=%d %d/%d T=%lld: relative L2 against the bf16 layer %.4f\n",
              is_mx ? "MXFP8" : "FP8 block-128", c.W, c.E, c.k, c.H, c.F, (long long)c.T, rel);
  return rel;
}

}  // namespace epmoe::test
