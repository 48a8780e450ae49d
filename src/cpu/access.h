// access.h — host element access for strided views of any dtype (CPU backends only).
#pragma once

#include <cstdint>

#include "core/kda_math.h"
#include "core/problem.h"
#include "cpu/isa.h"

namespace kda::cpu {
inline namespace KDA_CPU_ISA {

inline double load_scalar(const void* base, DType dt, int64_t off) {
  switch (dt) {
    case DType::kFloat32:
      return static_cast<const float*>(base)[off];
    case DType::kFloat16:
      return detail::fp16_bits_to_float(static_cast<const uint16_t*>(base)[off]);
    case DType::kBFloat16:
      return detail::bf16_bits_to_float(static_cast<const uint16_t*>(base)[off]);
    case DType::kInt32:
      return static_cast<const int32_t*>(base)[off];
    case DType::kInt64:
      return static_cast<double>(static_cast<const int64_t*>(base)[off]);
  }
  return 0.0;
}

inline void store_scalar(void* base, DType dt, int64_t off, double x) {
  switch (dt) {
    case DType::kFloat32:
      static_cast<float*>(base)[off] = static_cast<float>(x);
      break;
    case DType::kFloat16:
      static_cast<uint16_t*>(base)[off] = detail::float_to_fp16_bits(static_cast<float>(x));
      break;
    case DType::kBFloat16:
      static_cast<uint16_t*>(base)[off] = detail::float_to_bf16_bits(static_cast<float>(x));
      break;
    default:
      break;
  }
}

// Rounds x to what storing it in dt and loading it back gives.
inline double round_to(DType dt, double x) {
  switch (dt) {
    case DType::kFloat32:
      return static_cast<float>(x);
    case DType::kFloat16:
      return detail::fp16_bits_to_float(detail::float_to_fp16_bits(static_cast<float>(x)));
    case DType::kBFloat16:
      return detail::bf16_bits_to_float(detail::float_to_bf16_bits(static_cast<float>(x)));
    default:
      return x;
  }
}

// Offset of [i0, i1, i2, i3] (missing trailing indices = 0) in a rank <= 4 view.
inline int64_t offset4(const TensorView& t, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
  return i0 * t.strides[0] + i1 * t.strides[1] + i2 * t.strides[2] + i3 * t.strides[3];
}

// Loads a row of n contiguous elements (last dimension) starting at offset `off` as F.
template <typename F>
inline void load_row(const TensorView& t, int64_t off, int64_t n, F* dst) {
  switch (t.dtype) {
    case DType::kFloat32: {
      const float* p = static_cast<const float*>(t.data) + off;
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<F>(p[i]);
      break;
    }
    case DType::kBFloat16: {
      const uint16_t* p = static_cast<const uint16_t*>(t.data) + off;
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<F>(detail::bf16_bits_to_float(p[i]));
      break;
    }
    case DType::kFloat16: {
      const uint16_t* p = static_cast<const uint16_t*>(t.data) + off;
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<F>(detail::fp16_bits_to_float(p[i]));
      break;
    }
    default:
      for (int64_t i = 0; i < n; ++i)
        dst[i] = static_cast<F>(load_scalar(t.data, t.dtype, off + i));
  }
}

template <typename F>
inline void store_row(const TensorView& t, int64_t off, int64_t n, const F* src) {
  switch (t.dtype) {
    case DType::kFloat32: {
      float* p = static_cast<float*>(t.data) + off;
      for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(src[i]);
      break;
    }
    case DType::kBFloat16: {
      uint16_t* p = static_cast<uint16_t*>(t.data) + off;
      for (int64_t i = 0; i < n; ++i) p[i] = detail::float_to_bf16_bits(static_cast<float>(src[i]));
      break;
    }
    case DType::kFloat16: {
      uint16_t* p = static_cast<uint16_t*>(t.data) + off;
      for (int64_t i = 0; i < n; ++i) p[i] = detail::float_to_fp16_bits(static_cast<float>(src[i]));
      break;
    }
    default:
      break;
  }
}

// Sequence n's tokens: batch row b, first token bos, length len (core/index_rules.h).
using rules::SeqSpan;

inline SeqSpan seq_span(const detail::Dims& d, const TensorView& cu, int64_t n) {
  return detail::seq_span_at(d, cu, cu.data, n);
}

// Reads the state row [HV, V, K] (V-first) or [HV, K, V] (K-first) of head hv into math order
// S[k * V + v]; `row` indexes the leading dimension of the rank-4 state view.
template <typename F>
inline void load_state(const TensorView& st, StateLayout layout, int64_t row, int64_t hv, int64_t K,
                       int64_t V, F* S) {
  if (layout == StateLayout::kKFirst) {
    for (int64_t kk = 0; kk < K; ++kk) load_row(st, offset4(st, row, hv, kk, 0), V, S + kk * V);
  } else {
    F tmp[256];
    for (int64_t vv = 0; vv < V; ++vv) {
      load_row(st, offset4(st, row, hv, vv, 0), K, tmp);
      for (int64_t kk = 0; kk < K; ++kk) S[kk * V + vv] = tmp[kk];
    }
  }
}

template <typename F>
inline void store_state(const TensorView& st, StateLayout layout, int64_t row, int64_t hv,
                        int64_t K, int64_t V, const F* S) {
  if (layout == StateLayout::kKFirst) {
    for (int64_t kk = 0; kk < K; ++kk) store_row(st, offset4(st, row, hv, kk, 0), V, S + kk * V);
  } else {
    F tmp[256];
    for (int64_t vv = 0; vv < V; ++vv) {
      for (int64_t kk = 0; kk < K; ++kk) tmp[kk] = S[kk * V + vv];
      store_row(st, offset4(st, row, hv, vv, 0), K, tmp);
    }
  }
}

}  // namespace KDA_CPU_ISA
}  // namespace kda::cpu
