// Emulation shim (see ../engine.h).
#pragma once
#include "core/kda_math.h"
#include "cuda_runtime.h"
struct __nv_bfloat16 {
  uint16_t x;
};
struct __nv_bfloat162 {
  uint16_t x, y;
};
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return {kda::detail::float_to_bf16_bits(f)}; }
inline float __bfloat162float(__nv_bfloat16 h) { return kda::detail::bf16_bits_to_float(h.x); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.x; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return {kda::detail::float_to_bf16_bits(a), kda::detail::float_to_bf16_bits(b)};
}
