// A non-owning description of a tensor: pointer, dtype, device, shape and strides (in
// elements). The torch binding and the GPU path pass their storage through this without copies.
#pragma once
#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace epmoe {

// e4m3: FP8 E4M3FN, e8m0: the MX block scale (epmoe/mxfp8.h); both one byte.
enum class DType : uint8_t { bf16, f16, f32, i32, i64, u8, e4m3, e8m0 };
enum class DeviceType : uint8_t { cpu, cuda };

size_t dtype_size(DType t);
const char* dtype_name(DType t);

struct TensorView {
  static constexpr int kMaxDims = 4;
  void* data = nullptr;
  DType dtype = DType::f32;
  DeviceType device = DeviceType::cpu;
  int device_index = 0;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> stride{};  // elements

  // Row-major contiguous view.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               DeviceType device = DeviceType::cpu, int device_index = 0);

  int64_t numel() const;
  int64_t size(int d) const { return shape[d]; }
  bool is_contiguous() const;
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype); }
  std::string describe() const;  // "bf16[4096, 2048] cuda:0"
  template <class T>
  T* ptr() const { return static_cast<T*>(data); }
};

// Argument checks with messages naming the argument; all throw ErrorCode::invalid_argument.
void check_tensor(const TensorView& t, const char* name, DType dtype, std::initializer_list<int64_t> shape,
                  DeviceType device);
void check_contiguous(const TensorView& t, const char* name);

}  // namespace epmoe
