#include "fp8_model.h"

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

}  // namespace epmoe::test
