// view.cuh — the strided tensor view of the CUDA kernels' parameters: a rank <= 4 tensor in device
// memory with a runtime dtype code, element strides of its three leading dimensions and a
// contiguous last dimension (token tensors [B, T, heads, dim], decode states [rows, HV, .., ..]).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/alignment.h"
#include "kda/kda.h"

namespace kda::cuda {

// dtype codes seen by the device: static_cast<int>(DType).
inline constexpr int kF32 = static_cast<int>(DType::kFloat32);
inline constexpr int kF16 = static_cast<int>(DType::kFloat16);
inline constexpr int kBF16 = static_cast<int>(DType::kBFloat16);

// `vec`: the data pointer and every leading stride (of a dimension longer than 1) are 16-byte
// aligned, so any run of elements that starts at a multiple of its own length (up to 16 bytes)
// may be read with one vector load. Absent tensor: data == nullptr.
struct StridedView {
  void* data = nullptr;
  int64_t s0 = 0, s1 = 0, s2 = 0;
  int dtype = kF32;
  bool vec = false;
  __device__ __forceinline__ int64_t offset(int64_t i0, int64_t i1, int64_t i2) const {
    return i0 * s0 + i1 * s1 + i2 * s2;
  }
};

inline StridedView strided_view(const TensorView& t) {
  StridedView r;
  if (!t.present()) return r;
  r.data = t.data;
  r.s0 = t.strides[0];
  r.s1 = t.ndim > 1 ? t.strides[1] : 0;
  r.s2 = t.ndim > 2 ? t.strides[2] : 0;
  r.dtype = static_cast<int>(t.dtype);
  r.vec = rows_aligned16(t);
  return r;
}

}  // namespace kda::cuda
