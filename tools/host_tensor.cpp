// host_tensor.cpp — see host_tensor.h.
#include "host_tensor.h"

#include <cmath>
#include <cstring>
#include <limits>

namespace kda::tools {
namespace {

uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// bf16 is the upper half of an fp32: round the lower half away to nearest even (NaN stays NaN).
uint16_t to_bf16(float f) {
  const uint32_t u = float_bits(f);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

// fp16: 1 sign, 5 exponent (bias 15), 10 mantissa bits. Values are scaled into the fp16 grid by
// exact power-of-two factors and rounded once by the fp32 arithmetic (nearest even).
uint16_t to_fp16(float f) {
  const uint16_t sign = static_cast<uint16_t>((float_bits(f) >> 16) & 0x8000);
  const float a = std::fabs(f);
  if (std::isnan(f)) return sign | 0x7e00;
  if (a < 0x1p-14f) {  // subnormal: multiples of 2^-24
    return sign | static_cast<uint16_t>(std::nearbyint(a * 0x1p24f));
  }
  // Round the mantissa to 10 bits: adding and subtracting 2^(e + 13) does it in fp32.
  const float big = bits_float((float_bits(a) & 0x7f800000u) + (13u << 23));
  const float r = (a + big) - big;
  if (!(r < 65520.0f)) return sign | 0x7c00;  // infinity (and overflow)
  const uint32_t u = float_bits(r);
  const uint32_t exp = ((u >> 23) & 0xff) - 127 + 15, man = (u >> 13) & 0x3ff;
  return sign | static_cast<uint16_t>((exp << 10) | man);
}

float from_fp16(uint16_t h) {
  const float sign = (h & 0x8000) ? -1.0f : 1.0f;
  const int exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0) return sign * std::ldexp(static_cast<float>(man), -24);
  if (exp == 31) return man ? std::numeric_limits<float>::quiet_NaN() : sign * INFINITY;
  return sign * std::ldexp(static_cast<float>(man | 0x400), exp - 25);
}

}  // namespace

HostTensor::HostTensor(DType dt, std::vector<int64_t> shp) : dtype(dt), shape(std::move(shp)) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  storage.assign(static_cast<size_t>(n) * dtype_size(dt), 0);
}

TensorView HostTensor::view() const {
  if (shape.empty()) return TensorView{};
  return make_view(const_cast<uint8_t*>(storage.data()), dtype, shape);
}

double HostTensor::get(int64_t i) const {
  const uint8_t* p = storage.data() + i * dtype_size(dtype);
  uint16_t h = 0;
  int32_t i32 = 0;
  int64_t i64 = 0;
  switch (dtype) {
    case DType::kFloat32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kBFloat16:
      std::memcpy(&h, p, 2);
      return bits_float(static_cast<uint32_t>(h) << 16);
    case DType::kFloat16:
      std::memcpy(&h, p, 2);
      return from_fp16(h);
    case DType::kInt32:
      std::memcpy(&i32, p, 4);
      return i32;
    case DType::kInt64:
      std::memcpy(&i64, p, 8);
      return static_cast<double>(i64);
  }
  return 0;
}

void HostTensor::set(int64_t i, double x) {
  uint8_t* p = storage.data() + i * dtype_size(dtype);
  const float f = static_cast<float>(x);
  uint16_t h = 0;
  int32_t i32 = 0;
  int64_t i64 = 0;
  switch (dtype) {
    case DType::kFloat32:
      std::memcpy(p, &f, 4);
      break;
    case DType::kBFloat16:
      h = to_bf16(f);
      std::memcpy(p, &h, 2);
      break;
    case DType::kFloat16:
      h = to_fp16(f);
      std::memcpy(p, &h, 2);
      break;
    case DType::kInt32:
      i32 = static_cast<int32_t>(x);
      std::memcpy(p, &i32, 4);
      break;
    case DType::kInt64:
      i64 = static_cast<int64_t>(x);
      std::memcpy(p, &i64, 8);
      break;
  }
}

void HostTensor::fill(double x) {
  for (int64_t i = 0; i < numel(); ++i) set(i, x);
}

void HostTensor::fill_normal(std::mt19937_64& rng, double stddev) {
  std::normal_distribution<double> nd(0.0, stddev);
  for (int64_t i = 0; i < numel(); ++i) set(i, nd(rng));
}

void HostTensor::fill_uniform(std::mt19937_64& rng, double lo, double hi) {
  std::uniform_real_distribution<double> ud(lo, hi);
  for (int64_t i = 0; i < numel(); ++i) set(i, ud(rng));
}

double rel_l2_error(const HostTensor& got, const HostTensor& ref) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    const double g = got.get(i), r = ref.get(i);
    if (!std::isfinite(g)) return std::numeric_limits<double>::infinity();
    num += (g - r) * (g - r);
    den += r * r;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace kda::tools
