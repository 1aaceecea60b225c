// Shared by the NCCL communicator suites (run under mpirun, one rank per GPU).
//
// Every rank must take the same path through a test, or a collective hangs: the skip decision is
// agreed over MPI, and tests use EXPECT_* / ADD_FAILURE (never FAIL or ASSERT) around collectives.
#pragma once
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cstddef>
#include <string>
#include <vector>

namespace epmoe::nccl_test {

inline int mpi_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

inline int mpi_world() {
  int w = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &w);
  return w;
}

// Empty when every rank has its own CUDA device; else why not (the same decision on all ranks).
// Collective over MPI_COMM_WORLD on its first call; the answer is kept.
inline const std::string& why_no_gpus() {
  static const std::string why = [] {
    const int world = mpi_world();
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    std::string local;
    if (e != cudaSuccess)
      local = std::string("no CUDA device: cudaGetDeviceCount: ") + cudaGetErrorString(e);
    else if (count < world)
      local = "no CUDA device for every rank: " + std::to_string(world) + " ranks need " + std::to_string(world) +
              " GPUs, " + std::to_string(count) + " visible";
    int ok = local.empty() ? 1 : 0, all_ok = 0;
    MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (all_ok) return std::string();
    return local.empty() ? std::string("no CUDA device on another rank (this one has enough)") : local;
  }();
  return why;
}

// Fixture base: skips on every rank alike when the GPUs are not there.
class NcclTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!why_no_gpus().empty()) GTEST_SKIP() << why_no_gpus();
    rank_ = mpi_rank();
    world_ = mpi_world();
  }
  int rank_ = 0, world_ = 1;
};

// A device allocation for a test (errors are test failures, not exceptions).
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes_ > 0) EXPECT_EQ(cudaMalloc(&ptr_, bytes_), cudaSuccess);
  }
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <class T = void>
  T* get() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace epmoe::nccl_test
