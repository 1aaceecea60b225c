// Argument validation shared by the engines. Forward arguments are checked into a Status (not
// thrown) so that the failure travels in the count exchange and every rank raises it.
#include <sstream>

#include "engine.h"
#include "epmoe/fp8_block.h"
#include "epmoe/mxfp8.h"

namespace epmoe {

namespace {
const char* device_name(DeviceType d) { return d == DeviceType::cpu ? "cpu" : "cuda"; }

// Returns "" if t is dtype[d0, d1] contiguous on `device`, else a message naming the argument.
std::string tensor_problem(const TensorView& t, const char* name, DType dtype, int64_t d0, int64_t d1,
                           DeviceType device) {
  std::ostringstream want;
  want << dtype_name(dtype) << "[" << d0 << ", " << d1 << "] on " << device_name(device);
  if (t.dtype != dtype || t.ndim != 2 || t.shape[0] != d0 || t.shape[1] != d1 || t.device != device)
    return detail::concat(name, ": expected ", want.str(), ", got ", t.describe());
  if (!t.is_contiguous()) return detail::concat(name, ": must be contiguous, got ", t.describe());
  if (t.numel() > 0 && t.data == nullptr) return detail::concat(name, ": null data pointer");
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0)
    return detail::concat(name, ": data must be 16-byte aligned (vector loads), got ", t.data);
  return {};
}
}  // namespace

protocol::Status validate_forward_args(const MoeConfig& cfg, const TensorView& x, const TensorView& ids,
                                       const TensorView& w, const TensorView& y, DeviceType device,
                                       const TensorView* x_scale) {
  protocol::Status s;
  const DType xt = x_scale != nullptr ? DType::e4m3 : DType::bf16;
  if (x.ndim != 2) {
    s.code = ErrorCode::invalid_argument;
    s.text = detail::concat("x: expected a 2-d ", dtype_name(xt), "[T, ", cfg.hidden, "] tensor, got ", x.describe());
    return s;
  }
  const int64_t T = x.shape[0];
  if (x_scale != nullptr) {
    const std::string p = tensor_problem(*x_scale, "x_scale", DType::e8m0, T, cfg.hidden / mx::kBlock, device);
    if (!p.empty()) {
      s.code = ErrorCode::invalid_argument;
      s.text = p;
      return s;
    }
  }
  for (const std::string& p : {tensor_problem(x, "x", xt, T, cfg.hidden, device),
                               tensor_problem(ids, "topk_ids", DType::i32, T, cfg.top_k, device),
                               tensor_problem(w, "topk_weights", DType::f32, T, cfg.top_k, device),
                               tensor_problem(y, "y", DType::bf16, T, cfg.hidden, device)}) {
    if (!p.empty()) {
      s.code = ErrorCode::invalid_argument;
      s.text = p;
      return s;
    }
  }
  if (T > int64_t(INT32_MAX) / 2) {
    s.code = ErrorCode::invalid_argument;
    s.text = detail::concat("T = ", T, " tokens per rank exceeds the 32-bit token index");
  }
  return s;
}

protocol::Status validate_backward_tensors(const MoeConfig& cfg, int64_t T, const TensorView& dy, const TensorView& dx,
                                           const TensorView& dwts, const ExpertGradients& g, DeviceType device) {
  protocol::Status s;
  auto fail = [&](std::string text) {
    s.code = ErrorCode::invalid_argument;
    s.text = std::move(text);
    return s;
  };
  const int El = cfg.experts_per_rank();
  for (const std::string& p : {tensor_problem(dy, "dy", DType::bf16, T, cfg.hidden, device),
                               tensor_problem(dx, "dx", DType::bf16, T, cfg.hidden, device),
                               tensor_problem(dwts, "d_topk_weights", DType::f32, T, cfg.top_k, device)})
    if (!p.empty()) return fail("backward: " + p);
  const std::pair<const TensorView*, const char*> grads[2] = {{&g.dw1, "dw1"}, {&g.dw2, "dw2"}};
  const int64_t want[2][3] = {{El, 2 * int64_t(cfg.ffn), cfg.hidden}, {El, cfg.hidden, cfg.ffn}};
  for (int i = 0; i < 2; ++i) {
    const TensorView& t = *grads[i].first;
    const bool dtype_ok = t.dtype == DType::bf16 || t.dtype == DType::f32;
    const bool shape_ok = t.ndim == 3 && t.shape[0] == want[i][0] && t.shape[1] == want[i][1] && t.shape[2] == want[i][2];
    if (!dtype_ok || !shape_ok || t.device != device || !t.is_contiguous() || (t.numel() > 0 && t.data == nullptr))
      return fail(detail::concat("backward: ", grads[i].second, ": expected bf16 or f32 [", want[i][0], ", ",
                                 want[i][1], ", ", want[i][2], "] contiguous on ", device_name(device), ", got ",
                                 t.describe()));
  }
  return s;
}

protocol::Status validate_backward_args(const MoeConfig& cfg, const MoeForwardContext& ctx, const void* engine,
                                        int64_t T, const TensorView& dy, const TensorView& dx, const TensorView& dwts,
                                        const ExpertGradients& g, DeviceType device) {
  protocol::Status s;
  auto fail = [&](std::string text) {
    s.code = ErrorCode::invalid_argument;
    s.text = std::move(text);
    return s;
  };
  if (!ctx.saved()) return fail("backward: the context holds no saved forward (pass it to forward(..., save))");
  if (ctx.state->engine != engine) return fail("backward: the context was saved by another layer");
  return validate_backward_tensors(cfg, T, dy, dx, dwts, g, device);
}

const char* layer_format_name(bool fp8, bool block128) { return !fp8 ? "bf16" : block128 ? "FP8 block-128" : "MXFP8"; }

protocol::Status check_given_mx_layer(const char* who, bool fp8, bool block128) {
  protocol::Status s;
  if (!fp8 || block128) {
    s.code = ErrorCode::unsupported;
    s.text = detail::concat(who, " needs an MXFP8 layer (e4m3 weights, e8m0 scales); this one is ",
                            layer_format_name(fp8, block128));
  }
  return s;
}

void validate_weights(const MoeConfig& cfg, const ExpertWeights& w, DeviceType device) {
  const int El = cfg.experts_per_rank();
  const int64_t H = cfg.hidden, F = cfg.ffn;
  if (w.fp8_block()) {
    constexpr int B = fp8b::kBlock;
    EPMOE_CHECK(H % B == 0 && F % B == 0, ErrorCode::invalid_argument, "FP8 block-128 weights need hidden (", H,
                ") and ffn (", F, ") multiples of ", B, " (one scale per ", B, " x ", B, " block)");
    check_tensor(w.w1, "w1", DType::e4m3, {El, 2 * F, H}, device);
    check_tensor(w.w2, "w2", DType::e4m3, {El, H, F}, device);
    check_tensor(w.w1_scale, "w1_scale", DType::f32, {El, 2 * F / B, H / B}, device);
    check_tensor(w.w2_scale, "w2_scale", DType::f32, {El, H / B, F / B}, device);
    return;
  }
  if (!w.mxfp8()) {
    check_tensor(w.w1, "w1", DType::bf16, {El, 2 * F, H}, device);
    check_tensor(w.w2, "w2", DType::bf16, {El, H, F}, device);
    EPMOE_CHECK(w.w1_scale.data == nullptr && w.w2_scale.data == nullptr, ErrorCode::invalid_argument,
                "w1_scale / w2_scale are for MXFP8 (e4m3) weights; these are bf16");
    return;
  }
  EPMOE_CHECK(H % mx::kBlock == 0 && F % mx::kBlock == 0, ErrorCode::invalid_argument, "MXFP8 weights need hidden (",
              H, ") and ffn (", F, ") multiples of ", mx::kBlock, " (one scale per ", mx::kBlock, " along K)");
  check_tensor(w.w1, "w1", DType::e4m3, {El, 2 * F, H}, device);
  check_tensor(w.w2, "w2", DType::e4m3, {El, H, F}, device);
  check_tensor(w.w1_scale, "w1_scale", DType::e8m0, {El, 2 * F, H / mx::kBlock}, device);
  check_tensor(w.w2_scale, "w2_scale", DType::e8m0, {El, H, F / mx::kBlock}, device);
}

}  // namespace epmoe
