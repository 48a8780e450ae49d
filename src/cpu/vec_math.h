// vec_math.h — fp32 elementary functions for the fast CPU backend, written as plain branch-free
// arithmetic so the compiler vectorizes the loops that call them.
#pragma once

#include <cstring>

#include "core/kda_math.h"
#include "cpu/isa.h"

namespace kda::cpu {
inline namespace KDA_CPU_ISA {

// exp(x) in fp32 for any finite x, written so the compiler vectorizes it: 2^(x log2 e) split into
// 2^n (exponent bits) times 2^f (degree-6 Taylor, |f| <= 1/2, relative error ~1e-7). Arguments
// below -87 return 0 (the true value is below fp32's normal range).
inline float exp_f32(float x) {
  float y = x * 1.44269504088896341f;
  y = y > 127.0f ? 127.0f : y;
  const bool tiny = y < -126.0f;
  y = tiny ? 0.0f : y;
  const int n = static_cast<int>(y + (y >= 0.0f ? 0.5f : -0.5f));
  const float f = (y - static_cast<float>(n)) * 0.693147180559945309f;  // in natural-log units
  float p = 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const int bits = (n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return tiny ? 0.0f : p * scale;
}

// log(x) for finite x > 0 (relative error ~1e-7): x = m 2^e with m in [sqrt(1/2), sqrt(2)),
// log m = 2 atanh(z), z = (m - 1) / (m + 1), |z| <= 0.172, odd series to z^9.
inline float log_f32(float x) {
  int bits;
  std::memcpy(&bits, &x, 4);
  int e = ((bits >> 23) & 0xff) - 127;
  int mb = (bits & 0x7fffff) | 0x3f800000;  // m in [1, 2)
  float m;
  std::memcpy(&m, &mb, 4);
  const bool big = m > 1.41421356f;
  m = big ? m * 0.5f : m;
  e = big ? e + 1 : e;
  const float z = (m - 1.0f) / (m + 1.0f), z2 = z * z;
  float p = 1.0f / 9.0f;
  p = p * z2 + 1.0f / 7.0f;
  p = p * z2 + 1.0f / 5.0f;
  p = p * z2 + 1.0f / 3.0f;
  p = p * z2 + 1.0f;
  return 2.0f * z * p + static_cast<float>(e) * 0.693147180559945309f;
}

// Spec softplus: x for x > 20, else log(1 + exp(x)) = max(x, 0) + log(1 + exp(-|x|)).
inline float softplus_f32(float x) {
  const float ax = x < 0.0f ? -x : x;
  const float r = (x > 0.0f ? x : 0.0f) + log_f32(1.0f + exp_f32(-ax));
  return x > 20.0f ? x : r;
}

inline float sigmoid_f32(float x) {
  const float ax = x < 0.0f ? -x : x;
  const float e = exp_f32(-ax);  // in (0, 1]
  const float s = 1.0f / (1.0f + e);
  return x >= 0.0f ? s : 1.0f - s;
}

// Log decay of a row of K channels from the raw gate input, in place (spec section 2).
inline void log_decay_row(int form, float* a, int K, float exp_A, const float* bias,
                          float lower_bound) {
  if (form == detail::kGateSoftplus) {
    for (int c = 0; c < K; ++c) a[c] = -exp_A * softplus_f32(a[c] + bias[c]);
  } else if (form == detail::kGateLowerBound) {
    for (int c = 0; c < K; ++c) a[c] = lower_bound * sigmoid_f32(exp_A * (a[c] + bias[c]));
  }
}

}  // namespace KDA_CPU_ISA
}  // namespace kda::cpu
