// Uses only the installed public headers: a 1-rank mock world and one small forward.
#include <epmoe/bf16.h>
#include <epmoe/communicator.h>
#include <epmoe/moe_layer.h>

#include <cstdio>
#include <vector>

int main() {
  using namespace epmoe;
  MoeConfig cfg{.num_experts = 2, .top_k = 1, .hidden = 128, .ffn = 128, .world_size = 1, .rank = 0};
  std::vector<bf16> w1(2 * 256 * 128, bf16(0.01f)), w2(2 * 128 * 128, bf16(0.01f)), x(4 * 128, bf16(1.f)), y(4 * 128);
  std::vector<int32_t> ids = {0, 1, -1, 0};
  std::vector<float> wt = {1.f, 1.f, 1.f, 0.5f};
  auto comm = make_mock_world(1).at(0);
  MoeLayer layer(cfg,
                 {TensorView::contiguous(w1.data(), DType::bf16, {2, 256, 128}),
                  TensorView::contiguous(w2.data(), DType::bf16, {2, 128, 128})},
                 comm);
  layer.forward(TensorView::contiguous(x.data(), DType::bf16, {4, 128}),
                TensorView::contiguous(ids.data(), DType::i32, {4, 1}),
                TensorView::contiguous(wt.data(), DType::f32, {4, 1}),
                TensorView::contiguous(y.data(), DType::bf16, {4, 128}));
  // Token 2 is dropped (all -1): zero. Token 3 is token 0 at half weight.
  const bool ok = y[2 * 128].f() == 0.f && y[0].f() > 0.f && y[3 * 128].f() == bf16(0.5f * y[0].f()).f();
  std::printf("consumer: y[0]=%g y[2]=%g y[3]=%g %s\n", y[0].f(), y[2 * 128].f(), y[3 * 128].f(), ok ? "OK" : "WRONG");
  return ok ? 0 : 1;
}
