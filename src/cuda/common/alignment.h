// alignment.h — alignment facts of host tensor views that decide vector and bulk-copy access
// (host only, no CUDA headers: the heuristics use them too).
#pragma once

#include <cstdint>

#include "kda/kda.h"

namespace kda::cuda {

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// 16-byte aligned data and row strides (every dimension but the last; dimensions of size 1
// excepted): 16-byte vector loads and bulk copies of whole rows.
inline bool rows_aligned16(const TensorView& t) {
  if (!aligned16(t.data)) return false;
  const int64_t es = static_cast<int64_t>(dtype_size(t.dtype));
  for (int i = 0; i + 1 < t.ndim; ++i)
    if (t.shape[i] > 1 && (t.strides[i] * es) % 16 != 0) return false;
  return true;
}

}  // namespace kda::cuda
