// The GPU engine's capturable forward (MoeLayer::forward_capturable): at world 1 the layout, UP and
// DOWN, all on the caller's stream with nothing read or allocated on the host, so that a CUDA graph
// captures it once and replays it at any token count up to the capacity.
//
//   capturable_layout   one CTA: expert-sorted pairs of the first *num_tokens tokens, padded to the
//                       tile (kernels/ep/capturable_layout.cuh); bad routing -> NaN rows + a record
//   sm90 UP             gathers x[pair_row] itself and zeroes y (ExpertProblem::zero_out)
//   sm90 DOWN           PDL-chained; weighted reduction straight into y[pair_row]
//
// At world 1 a token's only destination is this rank and its row in x is its own, so there is no
// dispatch, no combine and no source reduce: the combine row of the regular forward is y's row
// (the regular forward's source reduce only rounds that one bf16 row again, losslessly). The buffers
// are sized once (init_capturable) for LayerOptions::max_tokens_per_rank tokens.
#include <cuda_runtime.h>

#include <cstring>

#include "gpu_engine_impl.cuh"
#include "kernels/ep/capturable_layout.cuh"
#include "kernels/expert_problem.cuh"
#include "kernels/sm90/experts.cuh"

namespace epmoe::gpu {

namespace {
constexpr size_t align256(size_t n) { return (n + 255) / 256 * 256; }
}  // namespace

void GpuEngine::init_capturable() {
  const int El = cfg.experts_per_rank();
  const int64_t N = opt_.max_tokens_per_rank;
  EPMOE_CHECK(path == ExpertPath::sm90, ErrorCode::unsupported, "the capturable forward (max_tokens_per_rank) runs "
              "on the sm_90 path only (the cuBLAS fallback needs the counts on the host)");
  EPMOE_CHECK(El <= kernels::kCapturableMaxExperts, ErrorCode::unsupported, "the capturable forward holds at most ",
              kernels::kCapturableMaxExperts, " experts per rank; this layer has ", El);
  EPMOE_CHECK(N * cfg.top_k < int64_t(INT32_MAX), ErrorCode::unsupported, "max_tokens_per_rank ", N, " x top_k ",
              cfg.top_k, " exceeds the 32-bit pair index");
  cap_rows_ = kernels::capturable_rows_capacity(N, cfg.top_k, El);
  cap_layout_.ensure(align256((size_t(El) + 1) * 8) + align256(4 * 8) + align256(size_t(cap_rows_) * 4) +
                     size_t(cap_rows_) * 4);
  cap_act_.ensure(size_t(cap_rows_) * cfg.ffn * sizeof(bf16));
  EPMOE_CUDA_CHECK(cudaMemset(cap_layout_.as<void>(), 0, cap_layout_.bytes()));  // the error record: none
}

namespace {
// The capturable layout's arrays inside cap_layout_ (the order init_capturable sized).
struct CapturableArrays {
  int64_t* offsets;
  int64_t* error;
  int32_t* pair_row;
  float* pair_weight;
};
CapturableArrays carve(void* base, int El, int64_t rows) {
  char* p = static_cast<char*>(base);
  CapturableArrays a;
  a.offsets = reinterpret_cast<int64_t*>(p);
  p += align256((size_t(El) + 1) * 8);
  a.error = reinterpret_cast<int64_t*>(p);
  p += align256(4 * 8);
  a.pair_row = reinterpret_cast<int32_t*>(p);
  p += align256(size_t(rows) * 4);
  a.pair_weight = reinterpret_cast<float*>(p);
  return a;
}
}  // namespace

void GpuEngine::forward_capturable(const TensorView& x, const TensorView& ids, const TensorView& wts,
                                   const TensorView& y, const int64_t* num_tokens, void* stream) {
  EPMOE_CHECK(opt_.max_tokens_per_rank > 0, ErrorCode::invalid_argument,
              "forward_capturable: the layer was built without LayerOptions::max_tokens_per_rank");
  DeviceGuard guard(device_);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  protocol::Status st = validate_forward_args(cfg, x, ids, wts, y, DeviceType::cuda);
  if (st.ok()) st = check_devices({{&x, "x"}, {&ids, "topk_ids"}, {&wts, "topk_weights"}, {&y, "y"}});
  if (!st.ok()) throw Error(st.code, "forward_capturable: " + st.text);
  const int64_t N = x.shape[0];
  EPMOE_CHECK(N <= opt_.max_tokens_per_rank, ErrorCode::invalid_argument, "forward_capturable: ", N,
              " rows exceed max_tokens_per_rank ", opt_.max_tokens_per_rank);
  EPMOE_CHECK(num_tokens != nullptr, ErrorCode::invalid_argument, "forward_capturable: num_tokens is null");
  cudaPointerAttributes attr{};
  EPMOE_CUDA_CHECK(cudaPointerGetAttributes(&attr, num_tokens));
  EPMOE_CHECK(attr.type == cudaMemoryTypeManaged || (attr.type == cudaMemoryTypeDevice && attr.device == device_),
              ErrorCode::invalid_argument, "forward_capturable: num_tokens must be device memory of cuda:", device_,
              " (it is read when the work runs, so a graph replays at any count)");
  NvtxRange range("forward_capturable");
  const int El = cfg.experts_per_rank();
  const CapturableArrays arr = carve(cap_layout_.as<void>(), El, cap_rows_);

  kernels::CapturableLayoutArgs la;
  la.topk_ids = ids.ptr<int32_t>();
  la.topk_weights = wts.ptr<float>();
  la.num_tokens = num_tokens;
  la.capacity = N;
  la.top_k = cfg.top_k;
  la.experts = El;
  la.padded_offsets = arr.offsets;
  la.pair_row = arr.pair_row;
  la.pair_weight = arr.pair_weight;
  la.rows_capacity = cap_rows_;
  la.error = arr.error;
  kernels::capturable_layout_launch(la, s);
  if (N == 0) return;  // (the layout still records a bad count)

  const kernels::ExpertWeightsView w{w1_, w2_, El, cfg.hidden, cfg.ffn};
  const kernels::ExpertLayoutView layout{arr.offsets, arr.pair_row, arr.pair_weight, cap_rows_};
  const kernels::ExpertProblem prob = kernels::make_expert_problem(
      w, x.ptr<__nv_bfloat16>(), N, layout, cap_act_.as<__nv_bfloat16>(), y.ptr<__nv_bfloat16>(), N,
      /*zero_out=*/true);
  const Sm90Plan plan = kernels::resolve_sm90_plan(kernels::sm90_shape(prob), sm90_device_, opt_.sm90_plan);
  kernels::sm90_experts_launch(prob, plan, s);
}

void GpuEngine::check_capturable(void* stream) {
  if (opt_.max_tokens_per_rank <= 0) return;
  DeviceGuard guard(device_);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  int64_t* err = carve(cap_layout_.as<void>(), cfg.experts_per_rank(), cap_rows_).error;
  int64_t h[4] = {0, 0, 0, 0};
  EPMOE_CUDA_CHECK(cudaMemcpyAsync(h, err, sizeof h, cudaMemcpyDeviceToHost, s));
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(s));
  if (h[0] == 0) return;
  EPMOE_CUDA_CHECK(cudaMemsetAsync(err, 0, sizeof h, s));
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(s));
  const auto code = static_cast<ErrorCode>(h[0]);
  if (code == ErrorCode::invalid_argument)
    EPMOE_FAIL(code, "forward_capturable: num_tokens ", h[1], " is outside [0, ", h[2],
               "] (the rows of x): every output row was NaN");
  EPMOE_FAIL(code, "forward_capturable: token ", h[1], " slot ", h[2], ": expert id ", h[3],
             code == ErrorCode::duplicate_expert_id ? " repeats an earlier slot's"
                                                    : " is outside [-1, " + std::to_string(cfg.num_experts) + ")",
             " (its output row was NaN)");
}

}  // namespace epmoe::gpu
