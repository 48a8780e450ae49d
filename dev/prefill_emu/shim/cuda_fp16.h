// Emulation shim (see ../engine.h).
#pragma once
#include "core/kda_math.h"
#include "cuda_runtime.h"
struct __half {
  uint16_t x;
};
struct __half2 {
  uint16_t x, y;
};
inline float __half2float(__half h) { return kda::detail::fp16_bits_to_float(h.x); }
inline __half __ushort_as_half(unsigned short b) { return {b}; }
inline unsigned short __half_as_ushort(__half h) { return h.x; }
inline __half __float2half_rn(float f) { return {kda::detail::float_to_fp16_bits(f)}; }
inline __half2 __floats2half2_rn(float a, float b) {
  return {kda::detail::float_to_fp16_bits(a), kda::detail::float_to_fp16_bits(b)};
}
