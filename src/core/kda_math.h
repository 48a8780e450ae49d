// kda_math.h — per-token preprocessing of spec section 2, shared by every backend (host and
// device). Templated on the arithmetic type: double in the reference, float elsewhere.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KDA_HD __host__ __device__ __forceinline__
#else
#define KDA_HD inline
#endif

namespace kda::detail {

inline constexpr double kL2NormEps = 1e-6;

// Gate forms as plain ints so device code needs no enum from the public header.
inline constexpr int kGatePrecomputed = 0;
inline constexpr int kGateSoftplus = 1;
inline constexpr int kGateLowerBound = 2;

template <typename F>
KDA_HD F softplus(F x) {
  // spec: x for x > 20, else log(1 + exp(x))
  return x > F(20) ? x : log1p(exp(x));
}

template <typename F>
KDA_HD F sigmoid(F x) {
  // Both branches stay finite for any finite x.
  if (x >= F(0)) return F(1) / (F(1) + exp(-x));
  const F e = exp(x);
  return e / (F(1) + e);
}

// Log decay a (natural log, <= 0) of one channel from the gate input.
//   exp_A: exp(A_log[hv]) (1 when A_log is absent); bias: dt_bias[hv, k] (0 when absent).
template <typename F>
KDA_HD F log_decay(int form, F g, F exp_A, F bias, F lower_bound) {
  if (form == kGateSoftplus) return -exp_A * softplus(g + bias);
  if (form == kGateLowerBound) return lower_bound * sigmoid(exp_A * (g + bias));
  return g;
}

// b_t from beta input.
template <typename F>
KDA_HD F activate_beta(bool logits, bool allow_neg_eigval, F beta) {
  if (!logits) return beta;
  const F s = sigmoid(beta);
  return allow_neg_eigval ? F(2) * s : s;
}

// ---------------------------------------------------------------------------------------------
// Half-precision conversions on the host (no CUDA headers; round to nearest even).
// ---------------------------------------------------------------------------------------------

inline float bf16_bits_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float fp16_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while (!(mant & 0x400u)) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      u = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_fp16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u) return sign | (abs > 0x7f800000u ? 0x7e00 : 0x7c00);  // NaN / inf
  if (abs >= 0x477ff000u) return sign | 0x7c00;  // rounds to >= 65520: overflow to inf
  if (abs < 0x38800000u) {                       // below the smallest normal: subnormal or zero
    if (abs < 0x33000000u) return sign;          // < 2^-25 rounds to zero
    const uint32_t e = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14 + (113 - e) ... yields 10-bit subnormal mantissa
    const uint32_t half = 1u << (shift - 1);
    uint32_t r = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return sign | static_cast<uint16_t>(r);
  }
  uint32_t r = abs - ((127 - 15) << 23);
  r += 0xfffu + ((r >> 13) & 1u);
  return sign | static_cast<uint16_t>(r >> 13);
}

}  // namespace kda::detail
