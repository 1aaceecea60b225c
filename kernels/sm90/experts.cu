// The sm_90a pipeline's entry points (experts.cuh): the plan -> kernel dispatch.
#include "kernels/sm90/experts.cuh"

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>
#include <string>

#include "kernels/cuda_check.cuh"
#include "kernels/sm90/launch.cuh"

namespace epmoe::kernels {

bool sm90_experts_supported_here() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return sm90_experts_supported(dev);
}

bool sm90_experts_supported(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  if (major != 9 || minor != 0) return false;
  int prev = 0;
  if (cudaGetDevice(&prev) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  if (prev != device && cudaSetDevice(device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  cudaFuncAttributes attr{};
  const cudaError_t err = sm90::up_kernel_attributes(&attr);
  if (prev != device) (void)cudaSetDevice(prev);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  // The mbarriers are static shared memory that exists only in the sm_90a body of the kernel: the
  // image the runtime picked for this device has the real kernel iff they are there.
  return attr.sharedSizeBytes >= 2 * sm90::kStages * sizeof(uint64_t);
}

Sm90Device sm90_device(int device) {
  int sms = 0, l2 = 0;
  EPMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  EPMOE_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  return {sms, int64_t(l2)};
}

Sm90Plan sm90_plan_for(const ExpertProblem& p, const Sm90PlanOverride& o) {
  int dev = 0;
  EPMOE_CUDA_CHECK(cudaGetDevice(&dev));
  return resolve_sm90_plan(sm90_shape(p), sm90_device(dev), o);
}

namespace {
// EPMOE_PRINT_PLAN=1 (debug only): each distinct (shape, plan) the pipeline launches, once, to stderr.
void maybe_print_plan(const ExpertProblem& p, const Sm90Plan& plan) {
  static const bool on = [] {
    const char* v = std::getenv("EPMOE_PRINT_PLAN");
    return v != nullptr && v[0] != '\0' && v[0] != '0';
  }();
  if (!on) return;
  static std::mutex mu;
  static std::set<std::string> seen;
  const std::string line = "E=" + std::to_string(p.experts) + " hidden=" + std::to_string(p.hidden) +
                           " ffn=" + std::to_string(p.ffn) + " rows_capacity=" + std::to_string(p.rows_capacity) +
                           ": " + to_string(plan);
  std::lock_guard<std::mutex> lock(mu);
  if (seen.insert(line).second) std::fprintf(stderr, "[epmoe sm90 plan] %s\n", line.c_str());
}
void check(const ExpertProblem& p, const Sm90Plan& plan, const char* who) {
  sm90::check_expert_problem(p, who);
  check_sm90_plan(plan, sm90_shape(p));
  maybe_print_plan(p, plan);
}
}  // namespace

void sm90_up_launch(const ExpertProblem& p, const Sm90Plan& plan, cudaStream_t s) {
  check(p, plan, "sm90_up_launch");
  if (plan.swap_ab) return sm90::launch_swap_ab_kernel(p, /*up=*/true, /*pdl=*/false, s);
  // The split's 192-row half needs the interleaved W1 map; where the driver rejects it every expert
  // stays on the 128-row kernel (as the plain W1 map stands in for the folded one).
  // The 192-row kernel stores no h: a saving forward (p.preact) keeps every expert on 128-row tiles.
  const int split = plan.up_split && p.preact == nullptr && sm90::up_tall_kernel_ready(p) ? plan.split_ctas : 0;
  if (plan.up_form == Sm90UpForm::pairs) sm90::launch_up_pair_kernel(p, plan, split, s);
  else sm90::launch_up_kernel(p, plan, split, s);
  if (split > 0) sm90::launch_up_tall_kernel(p, split, s);
}

void sm90_down_launch(const ExpertProblem& p, const Sm90Plan& plan, cudaStream_t s, bool pdl) {
  check(p, plan, "sm90_down_launch");
  if (plan.swap_ab) return sm90::launch_swap_ab_kernel(p, /*up=*/false, pdl, s);
  const int split = plan.down_split ? plan.split_ctas : 0;
  sm90::launch_down_kernel(p, plan, split, pdl, s);
  if (split > 0) sm90::launch_down_tall_kernel(p, split, s);
}

void sm90_experts_launch(const ExpertProblem& p, const Sm90Plan& plan, cudaStream_t s) {
  // The fused pipeline where the problem allows it (Sm90Plan::fused); else its split swap-AB kernels.
  if (plan.fused && p.out_acc != nullptr && p.preact == nullptr && p.pair_out == nullptr) {
    check(p, plan, "sm90_experts_launch");
    return sm90::launch_fused_swap_kernel(p, s);
  }
  sm90_up_launch(p, plan, s);
  sm90_down_launch(p, plan, s, /*pdl=*/true);
}

}  // namespace epmoe::kernels
