#include "epmoe/tensor_view.h"

#include <sstream>

#include "epmoe/error.h"

namespace epmoe {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::bf16: case DType::f16: return 2;
    case DType::f32: case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::u8: case DType::e4m3: case DType::e8m0: return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::f32: return "f32";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u8: return "u8";
    case DType::e4m3: return "e4m3";
    case DType::e8m0: return "e8m0";
  }
  return "?";
}

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape, DeviceType device,
                                  int device_index) {
  EPMOE_CHECK(int(shape.size()) <= kMaxDims, ErrorCode::invalid_argument, "at most ", kMaxDims, " dims");
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.device_index = device_index;
  t.ndim = int(shape.size());
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  int64_t st = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.stride[d] = st;
    st *= t.shape[d];
  }
  return t;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t st = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && stride[d] != st) return false;
    st *= shape[d];
  }
  return true;
}

std::string TensorView::describe() const {
  std::ostringstream os;
  os << dtype_name(dtype) << "[";
  for (int d = 0; d < ndim; ++d) os << (d ? ", " : "") << shape[d];
  os << "] " << (device == DeviceType::cpu ? "cpu" : "cuda:") ;
  if (device == DeviceType::cuda) os << device_index;
  return os.str();
}

void check_tensor(const TensorView& t, const char* name, DType dtype, std::initializer_list<int64_t> shape,
                  DeviceType device) {
  std::ostringstream want;
  want << dtype_name(dtype) << "[";
  int i = 0;
  for (int64_t s : shape) want << (i++ ? ", " : "") << s;
  want << "]";
  EPMOE_CHECK(t.dtype == dtype, ErrorCode::invalid_argument, name, ": expected dtype ", dtype_name(dtype), ", got ",
              t.describe());
  EPMOE_CHECK(t.ndim == int(shape.size()), ErrorCode::invalid_argument, name, ": expected ", want.str(), ", got ",
              t.describe());
  i = 0;
  for (int64_t s : shape) {
    EPMOE_CHECK(t.shape[i] == s, ErrorCode::invalid_argument, name, ": expected ", want.str(), ", got ", t.describe());
    ++i;
  }
  EPMOE_CHECK(t.device == device, ErrorCode::invalid_argument, name, ": expected it on ",
              device == DeviceType::cpu ? "cpu" : "cuda", ", got ", t.describe());
  EPMOE_CHECK(t.numel() == 0 || t.data != nullptr, ErrorCode::invalid_argument, name, ": null data pointer");
  check_contiguous(t, name);
}

void check_contiguous(const TensorView& t, const char* name) {
  EPMOE_CHECK(t.is_contiguous(), ErrorCode::invalid_argument, name, ": must be contiguous, got ", t.describe());
}

}  // namespace epmoe
