// One EP backward case on one rank: forward with a saved context, backward, and every gradient
// (dx, d_topk_weights, dW1, dW2 of this rank's experts) against the fp64 reference gradients of the
// whole layer (epmoe/reference.h), which this rank computes for every rank's tokens. Shared by the
// mock-rank and mpirun suites.
#pragma once
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "ep_case.h"
#include "epmoe/communicator.h"
#include "epmoe/moe_layer.h"

namespace epmoe::test {

struct BackwardCase {
  EpCase ep;
  SavePolicy policy = SavePolicy::rows_and_preactivation;
  DType grad_dtype = DType::f32;  // dw1 / dw2
  std::string name() const;
};
inline void PrintTo(const BackwardCase& c, std::ostream* os) { *os << c.name(); }

// Gradient tolerance against the fp64 reference. The CPU engine rounds [g, u] and the activation to
// bf16 (2^-9 relative each, round to nearest), each destination's dx rows to bf16 and the final dx
// once more (2^-9 each), and sums in fp32; the reference rounds nothing. Every gradient element is a
// sum of products of such values, so it carries a few 2^-9 relative errors of its terms' magnitudes -
// but terms can cancel, so single elements are judged against the tensor's largest reference value:
// |got - ref| <= 2^-5 max|ref| (8x the 4 * 2^-9 of the roundings) and the relative L2 error <= 1.5e-2
// (measured ~3e-3). bf16 gradient tensors add one rounding (2^-9). A wrong row, slot, expert or
// weight is an O(1) error in both measures.
inline constexpr double kGradElem = 1.0 / 32, kGradL2 = 1.5e-2;

// The pieces the device suites share with run_backward_case_cpu:
std::vector<bf16> dy_of(const EpCase& c, int rank);  // the case's dy on `rank`
std::vector<float> as_float(const std::vector<bf16>& v);
// got against ref by kGradElem (elementwise, of max |ref|) and kGradL2 (relative L2).
::testing::AssertionResult grad_close(const char* what, const std::vector<float>& got, const std::vector<double>& ref);
// The fp64 reference gradients of rank `me`: dx and d_topk_weights of its tokens, dW of its experts
// (summed over every rank's tokens), and the rows it receives in the dispatch.
struct ReferenceGrads {
  std::vector<double> dx, dwts, dw1, dw2;
  int64_t recv_rows = 0;
};
ReferenceGrads reference_grads(const EpCase& c, int me);

struct BackwardReport {
  int64_t pairs = 0;
  double activation_bytes_per_pair = 0;
  int64_t recv_rows = 0;
};
// Builds the layer (cpu weights) on `comm`, runs forward(save) + backward and checks the gradients
// with gtest assertions (thread-safe). Also checks: backward twice gives bit-identical gradients,
// accumulate adds exactly (f32) into a prefilled tensor, and the other save policy gives
// bit-identical gradients.
BackwardReport run_backward_case_cpu(const BackwardCase& c, std::shared_ptr<Communicator> comm);

}  // namespace epmoe::test
