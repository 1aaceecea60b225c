// Helpers of the capturable-forward suites (test_capturable_gpu, test_capturable_backward_gpu,
// test_capturable_fp8_gpu): the NaN and zero-row checks of the forward's contract on bf16 outputs,
// the transports, and ranks as threads over a device mock world on one GPU.
#pragma once
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "comm/mock_comm.h"
#include "epmoe/bf16.h"
#include "epmoe/moe_layer.h"

#include "device_array.h"
#include "kernels/sm90/experts.cuh"
#include "single_comm.h"

namespace epmoe::test {

// The suites' fixture: skips without a CUDA device or an sm_90a build; the single-rank NCCL
// communicator released before exit.
class CapturableSuite : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!cuda_available(why)) GTEST_SKIP() << why;
    if (!kernels::sm90_experts_supported(current_device())) GTEST_SKIP() << "no sm_90a device";
  }
  static void TearDownTestSuite() { release_single_comm(); }
};

inline bool is_nan(bf16 v) {
  uint16_t b;
  std::memcpy(&b, &v, 2);
  return (b & 0x7f80) == 0x7f80 && (b & 0x7f) != 0;
}

// Rows [from, rows) of y ([rows, hidden]) are exactly +0 / -0 (the forward writes rows past T as 0).
inline ::testing::AssertionResult rows_zero(const std::vector<bf16>& y, int64_t from, int64_t rows, int hidden) {
  for (int64_t i = from * hidden; i < rows * hidden; ++i) {
    uint16_t b;
    std::memcpy(&b, &y[size_t(i)], 2);
    if ((b & 0x7fff) != 0) {
      std::ostringstream os;  // (AssertionResult's << formats each value in a fresh stream: no std::hex there)
      os << "y[" << i / hidden << ", " << i % hidden << "] = 0x" << std::hex << b << std::dec << " past T = " << from
         << " (must be 0)";
      return ::testing::AssertionFailure() << os.str();
    }
  }
  return ::testing::AssertionSuccess();
}

inline const char* transport_name(CapturableTransport t) {
  return t == CapturableTransport::slots ? "slots" : "local";
}
inline constexpr CapturableTransport kTransports[] = {CapturableTransport::local, CapturableTransport::slots};

// W ranks as threads over a device mock world on `device`: fn(rank, comm) returns what failed on
// that rank ("" if nothing); a rank that throws aborts the world (its peers do not wait out the
// deadline). One gtest failure per rank that threw or reported something.
template <class F>
void run_device_mock_ranks(int W, int device, F fn, double deadline_seconds = 120.0) {
  auto comms = make_device_mock_world(W, device, deadline_seconds);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(W));
  std::vector<std::string> failures(static_cast<size_t>(W));
  std::vector<std::thread> threads;
  for (int r = 0; r < W; ++r)
    threads.emplace_back([&, r] {
      try {
        ck(cudaSetDevice(device), "cudaSetDevice");
        failures[size_t(r)] = fn(r, comms[size_t(r)]);
      } catch (...) {
        errors[size_t(r)] = std::current_exception();
        mock_world_abort(*comms[size_t(r)], "rank " + std::to_string(r) + " failed");
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < W; ++r) {
    EXPECT_FALSE(errors[size_t(r)]) << "rank " << r << ": " << describe_exception(errors[size_t(r)]);
    EXPECT_EQ(failures[size_t(r)], "") << "rank " << r;
  }
}

}  // namespace epmoe::test
