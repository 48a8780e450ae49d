// decode_common.cuh — device helpers of the CUDA decode (decode_sm90.cu): strided views with
// runtime dtypes, index loads, 16-byte state vectors (fp32 / bf16), lane-group sums.
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
#include "kda/kda.h"

namespace kda::cuda::dec {

// dtype codes seen by the device: static_cast<int>(DType).
inline constexpr int kF32 = static_cast<int>(DType::kFloat32);
inline constexpr int kF16 = static_cast<int>(DType::kFloat16);
inline constexpr int kBF16 = static_cast<int>(DType::kBFloat16);

// A strided rank-4 view in device memory: element strides of the three leading dimensions; the
// last dimension is contiguous. `vec`: the data pointer and every leading stride are 16-byte
// aligned, so any run of elements that starts at a multiple of its own length (up to 16 bytes)
// may be read with one vector load.
struct Tensor4 {
  void* data = nullptr;
  int64_t s0 = 0, s1 = 0, s2 = 0;
  int dtype = kF32;
  bool vec = false;
  __device__ __forceinline__ int64_t offset(int64_t i0, int64_t i1, int64_t i2) const {
    return i0 * s0 + i1 * s1 + i2 * s2;
  }
};

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
  return dtype == kBF16 ? bf16_bits_to_float(static_cast<uint16_t>(b)) : half_bits_to_float(static_cast<uint16_t>(b));
}
__device__ __forceinline__ void convert4(const Raw4& r, int dtype, bool vec, float* dst) {
  if (dtype == kF32) {
#pragma unroll
    for (int i = 0; i < 4; ++i) dst[i] = __uint_as_float(r.w[i]);
  } else if (vec) {
    dst[0] = bits16_to_float(r.w[0] & 0xffffu, dtype), dst[1] = bits16_to_float(r.w[0] >> 16, dtype);
    dst[2] = bits16_to_float(r.w[1] & 0xffffu, dtype), dst[3] = bits16_to_float(r.w[1] >> 16, dtype);
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
// guarantees off is a multiple of N and the row is 16-byte aligned, see Tensor4::vec).
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
      raw[i + 2] = static_cast<uint16_t>(x.y & 0xffffu), raw[i + 3] = static_cast<uint16_t>(x.y >> 16);
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

// The lane index, re-read at every use (volatile: the compiler neither hoists nor keeps it live
// across loops, which keeps values derived from it out of the register budget).
__device__ __forceinline__ int lane_id() {
  int lane;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
  return lane;
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}


// ---------------------------------------------------------------------------------------------
// Hopper asynchronous copies (the persistent kernel): mbarriers in shared memory, 1-D bulk copies
// global -> shared (cp.async.bulk, the TMA engine) completing on an mbarrier's transaction count.
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// Makes the mbarrier initializations visible (to the other threads after a barrier, and to the
// async proxy that completes transactions on them).
__device__ __forceinline__ void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Arrive (release, CTA scope): the calling thread's earlier memory accesses happen before the
// completion of the phase.
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// Arrive and raise the phase's expected transaction count by `bytes` (before any copy that
// completes `bytes` on this barrier is issued).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

// Waits (acquire, CTA scope) until the phase of parity `parity` has completed. A fresh barrier is
// in phase 0, so waiting for parity 1 returns at once (the "previous" phase counts as complete).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred P1;\n"
      "WAIT_LOOP:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      "@!P1 bra WAIT_LOOP;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// Orders this thread's generic-proxy shared-memory accesses before its later async-proxy ones
// (a bulk copy into a buffer that generic loads / stores used before).
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// An L2 policy for data read once (the state tiles).
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}

// Bulk copy of `bytes` (a multiple of 16; both addresses 16-byte aligned) global -> shared,
// completing `bytes` transactions on `bar`.
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar,
                                              uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy)
      : "memory");
}

// Plain bulk copy global -> shared (no cache hint), completing `bytes` transactions on `bar`.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

// Bulk copy shared -> global (a multiple of 16 bytes, 16-byte aligned), in the calling thread's
// bulk async-group. Every thread that wrote the shared source with generic stores must have run
// fence_proxy_async_smem() before the barrier that precedes this call.
__device__ __forceinline__ void bulk_store(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_addr(src)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Waits until the calling thread's committed bulk stores have finished reading shared memory
// (the source may be overwritten; the global writes complete before the grid does).
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }

// Waits until the calling thread's committed bulk stores are complete (their global writes
// performed): a later bulk store to the same addresses is then ordered after them.
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// ---------------------------------------------------------------------------------------------
// Ampere-style asynchronous copies (the staged tile kernel): 16-byte cp.async global -> shared,
// bypassing L1 (.cg). Both addresses must be 16-byte aligned. A thread's copies complete for that
// thread at cp_async_wait_all (the data is visible to other threads only after a barrier).
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(smem_dst)), "l"(gmem_src) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

}  // namespace kda::cuda::dec
