// load.cuh — loads and stores of the decode kernels: index loads, runtime-dtype element and run
// loads (raw bits loaded early, converted at first use), 16-byte state vectors (fp32 / bf16),
// lane-group sums.
//
// Inputs (q, k, v, g, beta, out, dt_bias) keep their dtype as a runtime code (a uniform branch
// per load), so the kernel is instantiated only on what changes its register layout: the K tile,
// the state dtype and the state layout.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/kda_math.h"
#include "cuda/common/view.cuh"
#include "kda/kda.h"

namespace kda::cuda::dec {

// An int32/int64 index tensor of rank 1 or 2 (s1 = 0 for rank 1).
struct IndexTensor {
  const void* data = nullptr;
  int64_t s0 = 0, s1 = 0;
  bool is64 = false;
};

__device__ __forceinline__ int64_t load_index(const IndexTensor& t, int64_t off) {
  return t.is64 ? static_cast<const int64_t*>(t.data)[off]
                : static_cast<int64_t>(static_cast<const int32_t*>(t.data)[off]);
}

// ---------------------------------------------------------------------------------------------
// Scalar conversions
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ float bf16_bits_to_float(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}
__device__ __forceinline__ float half_bits_to_float(uint16_t b) {
  return __half2float(__ushort_as_half(b));
}
__device__ __forceinline__ uint16_t float_to_bf16_bits(float x) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}
// x rounded to bf16 and widened back (round to nearest even, as the reference's rounding).
__device__ __forceinline__ float round_bf16(float x) {
  return bf16_bits_to_float(float_to_bf16_bits(x));
}

__device__ __forceinline__ void store_elem(void* base, int dtype, int64_t off, float x) {
  if (dtype == kBF16) {
    static_cast<uint16_t*>(base)[off] = float_to_bf16_bits(x);
  } else if (dtype == kF16) {
    static_cast<uint16_t*>(base)[off] = __half_as_ushort(__float2half_rn(x));
  } else {
    static_cast<float*>(base)[off] = x;
  }
}

// Raw (unconverted) loads for inputs that are loaded early and used late. A load whose
// conversion sits right behind it inside a dtype branch makes the warp wait for that load before
// it can issue the next one (measured: a decode block's token loads ran as ~6 serial memory round
// trips before its index load). These keep the bits in registers; the conversion runs at the
// first use, so every load issued together is in flight together.
// Raw4: 4 contiguous elements. fp32: w[i] = element i. 16-bit with vec: w[0] = e0 | e1 << 16,
// w[1] = e2 | e3 << 16. 16-bit without vec: w[i] = element i (zero-extended).
struct Raw4 {
  uint32_t w[4];
};
__device__ __forceinline__ Raw4 load_raw4(const void* base, int dtype, bool vec, int64_t off) {
  Raw4 r;
  if (dtype == kF32) {
    const uint32_t* p = static_cast<const uint32_t*>(base) + off;
    if (vec) {
      const uint4 x = *reinterpret_cast<const uint4*>(p);
      r.w[0] = x.x, r.w[1] = x.y, r.w[2] = x.z, r.w[3] = x.w;
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) r.w[i] = p[i];
    }
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(base) + off;
    if (vec) {
      const uint2 x = *reinterpret_cast<const uint2*>(p);
      r.w[0] = x.x, r.w[1] = x.y, r.w[2] = 0u, r.w[3] = 0u;
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) r.w[i] = p[i];
    }
  }
  return r;
}
__device__ __forceinline__ float bits16_to_float(uint32_t b, int dtype) {
  return dtype == kBF16 ? bf16_bits_to_float(static_cast<uint16_t>(b))
                        : half_bits_to_float(static_cast<uint16_t>(b));
}
__device__ __forceinline__ void convert4(const Raw4& r, int dtype, bool vec, float* dst) {
  if (dtype == kF32) {
#pragma unroll
    for (int i = 0; i < 4; ++i) dst[i] = __uint_as_float(r.w[i]);
  } else if (vec) {
    dst[0] = bits16_to_float(r.w[0] & 0xffffu, dtype),
    dst[1] = bits16_to_float(r.w[0] >> 16, dtype);
    dst[2] = bits16_to_float(r.w[1] & 0xffffu, dtype),
    dst[3] = bits16_to_float(r.w[1] >> 16, dtype);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) dst[i] = bits16_to_float(r.w[i], dtype);
  }
}
// One element's bits (fp32, or 16-bit zero-extended), converted by convert_elem.
__device__ __forceinline__ uint32_t load_raw_elem(const void* base, int dtype, int64_t off) {
  if (dtype == kF32) return static_cast<const uint32_t*>(base)[off];
  return static_cast<const uint16_t*>(base)[off];
}
__device__ __forceinline__ float convert_elem(uint32_t bits, int dtype) {
  return dtype == kF32 ? __uint_as_float(bits) : bits16_to_float(bits, dtype);
}
// One element as fp32: load_raw_elem then convert_elem.
__device__ __forceinline__ float load_elem(const void* base, int dtype, int64_t off) {
  return convert_elem(load_raw_elem(base, dtype, off), dtype);
}

// Loads N contiguous elements at base[off ..] as fp32. `vec`: use 8/16-byte loads (the caller
// guarantees off is a multiple of N and the row is 16-byte aligned, see StridedView::vec).
template <int N>
__device__ __forceinline__ void load_run(const void* base, int dtype, bool vec, int64_t off,
                                         float* dst) {
  if (dtype == kF32) {
    const float* p = static_cast<const float*>(base) + off;
    if (N % 4 == 0 && vec) {
#pragma unroll
      for (int i = 0; i < N; i += 4) {
        const float4 x = *reinterpret_cast<const float4*>(p + i);
        dst[i] = x.x, dst[i + 1] = x.y, dst[i + 2] = x.z, dst[i + 3] = x.w;
      }
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) dst[i] = p[i];
    }
    return;
  }
  const uint16_t* p = static_cast<const uint16_t*>(base) + off;
  uint16_t raw[N];
  if (N % 8 == 0 && vec) {
#pragma unroll
    for (int i = 0; i < N; i += 8) {
      const uint4 x = *reinterpret_cast<const uint4*>(p + i);
      const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        raw[i + 2 * j] = static_cast<uint16_t>(w[j] & 0xffffu);
        raw[i + 2 * j + 1] = static_cast<uint16_t>(w[j] >> 16);
      }
    }
  } else if (N % 4 == 0 && vec) {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const uint2 x = *reinterpret_cast<const uint2*>(p + i);
      raw[i] = static_cast<uint16_t>(x.x & 0xffffu), raw[i + 1] = static_cast<uint16_t>(x.x >> 16);
      raw[i + 2] = static_cast<uint16_t>(x.y & 0xffffu),
              raw[i + 3] = static_cast<uint16_t>(x.y >> 16);
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) raw[i] = p[i];
  }
  if (dtype == kBF16) {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = bf16_bits_to_float(raw[i]);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = half_bits_to_float(raw[i]);
  }
}

// ---------------------------------------------------------------------------------------------
// State vectors: 16 bytes = 4 fp32 or 8 bf16 elements, widened to fp32 in registers. Streaming
// cache hints: every state byte is read once and written once per call.
// ---------------------------------------------------------------------------------------------

template <typename StateT>
struct StateVec;

template <>
struct StateVec<float> {
  static constexpr int kElems = 4;
  __device__ __forceinline__ static void load(const float* p, bool vec, float* dst) {
    if (vec) {
      const float4 x = __ldcs(reinterpret_cast<const float4*>(p));
      dst[0] = x.x, dst[1] = x.y, dst[2] = x.z, dst[3] = x.w;
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) dst[i] = __ldcs(p + i);
    }
  }
  __device__ __forceinline__ static void store(float* p, bool vec, const float* src) {
    if (vec) {
      __stcs(reinterpret_cast<float4*>(p), make_float4(src[0], src[1], src[2], src[3]));
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) __stcs(p + i, src[i]);
    }
  }
};

template <>
struct StateVec<__nv_bfloat16> {
  static constexpr int kElems = 8;
  __device__ __forceinline__ static void load(const __nv_bfloat16* p, bool vec, float* dst) {
    if (vec) {
      const uint4 x = __ldcs(reinterpret_cast<const uint4*>(p));
      const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        dst[2 * j] = __uint_as_float(w[j] << 16);
        dst[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
      }
    } else {
      const unsigned short* q = reinterpret_cast<const unsigned short*>(p);
#pragma unroll
      for (int i = 0; i < 8; ++i) dst[i] = bf16_bits_to_float(__ldcs(q + i));
    }
  }
  __device__ __forceinline__ static void store(__nv_bfloat16* p, bool vec, const float* src) {
    if (vec) {
      uint32_t w[4];
#pragma unroll
      for (int j = 0; j < 4; ++j)
        w[j] = static_cast<uint32_t>(float_to_bf16_bits(src[2 * j])) |
               (static_cast<uint32_t>(float_to_bf16_bits(src[2 * j + 1])) << 16);
      __stcs(reinterpret_cast<uint4*>(p), make_uint4(w[0], w[1], w[2], w[3]));
    } else {
      unsigned short* q = reinterpret_cast<unsigned short*>(p);
#pragma unroll
      for (int i = 0; i < 8; ++i) __stcs(q + i, float_to_bf16_bits(src[i]));
    }
  }
};

// Sum over groups of kLanes consecutive lanes (kLanes a power of two <= 32). The xor butterfly
// gives every lane of a group the bitwise-same sum (each step adds the same pair of partials).
template <int kLanes>
__device__ __forceinline__ float lane_group_sum(float x) {
#pragma unroll
  for (int m = 1; m < kLanes; m <<= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

// A lane's 4 of the 128 q and k values of a token (k = 4 lane .. 4 lane + 3): divided by their
// l2 norms over the warp (full-warp butterflies; when `l2norm`), then q times `scale`.
__device__ __forceinline__ void normalize_qk4(float (&q)[4], float (&k)[4], bool l2norm,
                                              float scale) {
  float q_norm = 1.f, k_norm = 1.f;
  if (l2norm) {
    float qq = 0.f, kq = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) qq = fmaf(q[e], q[e], qq), kq = fmaf(k[e], k[e], kq);
    qq = lane_group_sum<32>(qq);
    kq = lane_group_sum<32>(kq);
    q_norm = 1.f / sqrtf(qq + static_cast<float>(detail::kL2NormEps));
    k_norm = 1.f / sqrtf(kq + static_cast<float>(detail::kL2NormEps));
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) q[e] = (q[e] * q_norm) * scale, k[e] = k[e] * k_norm;
}

}  // namespace kda::cuda::dec
