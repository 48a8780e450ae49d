// Emulation shim: CUDA runtime/device intrinsics on the host (threads = std::thread).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "tsan.h"  // the ThreadSanitizer mode's model (no-ops without it)
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
// Empty, not __attribute__((noinline)): glibc spells that attribute __noinline__ itself.
#define __noinline__
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__
#define __align__(n)
struct dim3 {
  unsigned x = 0, y = 0, z = 0;
};
struct uint4 {
  uint32_t x, y, z, w;
};
struct float4 {
  float x, y, z, w;
};
struct float2 {
  float x, y;
};
inline uint4 make_uint4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return {a, b, c, d}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }
// The cycle counter (phase_timing.cuh): no clock in emulation.
inline long long clock64() { return 0; }
inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t __float_as_uint(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __expf(float x) { return std::exp(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}
namespace emu {
extern dim3 threadIdx_, blockIdx_, blockDim_, gridDim_;
extern uint8_t* smem_base;
extern size_t smem_size;
struct WarpCtx {
  int arrived = 0;
  long gen = 0;
  uint64_t slot[32][16];
};
extern WarpCtx* warp_ctx;
extern int lane_id;
void warp_sync();        // __syncwarp: a rendezvous that orders the lanes' memory accesses
void warp_collective();  // a collective's rendezvous (shuffles, mma.sync...): orders nothing
void block_sync();
void named_sync(int id, int count);
void yield_fiber();  // let the other fibers of the block run (spin-waits)
}  // namespace emu
#define threadIdx emu::threadIdx_
#define blockIdx emu::blockIdx_
#define blockDim emu::blockDim_
#define gridDim emu::gridDim_
inline void __syncthreads() { emu::block_sync(); }
inline void __syncwarp() { emu::warp_sync(); }
// Fibers run one at a time, so shared memory is always coherent; the ThreadSanitizer mode models
// the fences' and atomics' ordering (tsan.h).
inline void __threadfence_block() { emu::tsan::fence(); }
template <typename T>
inline T emu_atomic_add(T* p, T v) {
  T old;
  {
    const emu::tsan::Ignore ig;  // the access itself is not checked (tsan.h)
    old = __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
  }
  emu::tsan::atomic_rmw(p);
  return old;
}
inline unsigned atomicAdd(unsigned* p, unsigned v) { return emu_atomic_add(p, v); }
inline int atomicAdd(int* p, int v) { return emu_atomic_add(p, v); }
template <typename T>
inline T __shfl_sync(unsigned, T v, int src) {
  static_assert(sizeof(T) <= 8);
  uint64_t u = 0;
  std::memcpy(&u, &v, sizeof(T));
  emu::warp_ctx->slot[emu::lane_id][0] = u;
  emu::warp_collective();
  uint64_t r = emu::warp_ctx->slot[src & 31][0];
  emu::warp_collective();
  T out;
  std::memcpy(&out, &r, sizeof(T));
  return out;
}
// With a width (a power of two): lanes form segments of `width`; a source lane is taken within
// the caller's segment (PTX shfl.sync with the segment mask), as the hardware does.
template <typename T>
inline T __shfl_sync(unsigned m, T v, int src, int width) {
  const int base = emu::lane_id & ~(width - 1);
  return __shfl_sync(m, v, base + (src & (width - 1)));
}
template <typename T>
inline T __shfl_xor_sync(unsigned m, T v, int x) {
  return __shfl_sync(m, v, emu::lane_id ^ x);
}
// Lanes whose source (lane - d) falls before their segment keep their own value.
template <typename T>
inline T __shfl_up_sync(unsigned m, T v, int d, int width = 32) {
  const int base = emu::lane_id & ~(width - 1);
  return __shfl_sync(m, v, emu::lane_id - d >= base ? emu::lane_id - d : emu::lane_id);
}
inline unsigned __ballot_sync(unsigned, bool pred) {
  emu::warp_ctx->slot[emu::lane_id][0] = pred;
  emu::warp_collective();
  unsigned r = 0;
  for (int i = 0; i < 32; ++i)
    if (emu::warp_ctx->slot[i][0]) r |= 1u << i;
  emu::warp_collective();
  return r;
}
inline size_t __cvta_generic_to_shared(const void* p) {
  return static_cast<const uint8_t*>(p) - emu::smem_base;
}
#define smem emu_smem_alias
#define smem_raw emu_smem_raw  // the recurrence kernel's unaligned base (same array, engine.h)
