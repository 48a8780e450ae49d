// types.cpp — the value types of the public API (dtype names and sizes, TensorView::numel,
// Status::to_string): used by every layer (dispatcher, validation, CPU and CUDA backends), so
// they live below all of them.
#include <string>

#include "kda/kda.h"

namespace kda {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "fp32";
    case DType::kFloat16:
      return "fp16";
    case DType::kBFloat16:
      return "bf16";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
  }
  return "unknown";
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kInt64:
      return 8;
  }
  return 0;
}

int64_t TensorView::numel() const {
  if (ndim == 0) return 0;
  if (ndim < 0 || ndim > kMaxDims) return -1;
  for (int i = 0; i < ndim; ++i) {
    if (shape[i] < 0) return -1;
    if (shape[i] == 0) return 0;
  }
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i)
    if (__builtin_mul_overflow(n, shape[i], &n)) return -1;
  return n;
}

std::string Status::to_string() const {
  static const char* names[] = {"ok", "invalid argument", "unsupported", "CUDA error",
                                "internal error"};
  const int c = static_cast<int>(code_);
  std::string s = (c >= 0 && c <= 4) ? names[c] : "unknown";
  return message_.empty() ? s : s + ": " + message_;
}

}  // namespace kda
