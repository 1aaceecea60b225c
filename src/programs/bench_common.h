// What the MPI benchmarks (epmoe_bench_ep, epmoe_bench_train) share beyond bench_data.h: device
// buffers and the expert weight set, and the MPI helpers.
#pragma once
#include <cuda_runtime.h>
#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "bench_data.h"
#include "epmoe/bf16.h"
#include "epmoe/error.h"
#include "epmoe/moe_layer.h"
#include "kernels/cuda_check.cuh"

#define BENCH_CUDA(call) EPMOE_CUDA_CHECK(call)

namespace epmoe::bench {

// The --path value's name (the JSON's "path" / "requested_path").
inline const char* path_name(ExpertPath p) {
  switch (p) {
    case ExpertPath::automatic: return "auto";
    case ExpertPath::cpu: return "cpu";
    case ExpertPath::cublas: return "cublas";
    case ExpertPath::sm90: return "sm90";
  }
  return "?";
}

// ---- device memory -------------------------------------------------------------------------------

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes_) BENCH_CUDA(cudaMalloc(&ptr_, bytes_));
  }
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr, o.bytes_ = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      if (ptr_) cudaFree(ptr_);
      ptr_ = o.ptr_, bytes_ = o.bytes_;
      o.ptr_ = nullptr, o.bytes_ = 0;
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// This rank's slice of the experts, kept across shapes with the same (E, hidden, ffn).
struct WeightSet {
  int E = 0, hidden = 0, ffn = 0;
  DeviceBuffer w1, w2;
  bool matches(const Shape& s) const { return E == s.E && hidden == s.hidden && ffn == s.ffn; }
};

inline void upload_weights(WeightSet& ws, uint64_t seed, const Shape& s, int rank, int world, float w1_std,
                           float w2_std) {
  ws = WeightSet{};  // free the previous set first
  const int el = s.E / world;
  const size_t n1 = size_t(2) * s.ffn * s.hidden, n2 = size_t(s.hidden) * s.ffn;
  ws.w1 = DeviceBuffer(size_t(el) * n1 * sizeof(bf16));
  ws.w2 = DeviceBuffer(size_t(el) * n2 * sizeof(bf16));
  std::vector<bf16> h1(n1), h2(n2);
  for (int le = 0; le < el; ++le) {
    generate_expert(seed, s, rank * el + le, h1.data(), h2.data(), w1_std, w2_std);
    BENCH_CUDA(cudaMemcpy(static_cast<char*>(ws.w1.get()) + size_t(le) * n1 * sizeof(bf16), h1.data(),
                          n1 * sizeof(bf16), cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaMemcpy(static_cast<char*>(ws.w2.get()) + size_t(le) * n2 * sizeof(bf16), h2.data(),
                          n2 * sizeof(bf16), cudaMemcpyHostToDevice));
  }
  // (pageable cudaMemcpy returns before the device has the bytes; the benches run on other streams)
  BENCH_CUDA(cudaDeviceSynchronize());
  ws.E = s.E, ws.hidden = s.hidden, ws.ffn = s.ffn;
}

// ---- MPI helpers ---------------------------------------------------------------------------------
// (Overloads of one name stay together here: a program's own overload would hide these.)

inline double allreduce_max(double v) {
  double r = 0;
  MPI_Allreduce(&v, &r, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return r;
}
inline double allreduce_sum(double v) {
  double r = 0;
  MPI_Allreduce(&v, &r, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  return r;
}
inline int64_t allreduce_sum(int64_t v) {
  int64_t r = 0;
  MPI_Allreduce(&v, &r, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  return r;
}
inline int64_t allreduce_max(int64_t v) {
  int64_t r = 0;
  MPI_Allreduce(&v, &r, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
  return r;
}
inline int allreduce_min(int v) {
  int r = 0;
  MPI_Allreduce(&v, &r, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return r;
}

// main() of an MPI benchmark: MPI around run(argc, argv); an exception on any rank prints and aborts
// the job (its peers may be waiting in a collective).
inline int mpi_bench_main(int argc, char** argv, const char* name, int (*run)(int, char**)) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int rc = 0;
  try {
    rc = run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[%s] rank %d: error: %s\n", name, rank, e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  MPI_Finalize();
  return rc;
}

}  // namespace epmoe::bench
