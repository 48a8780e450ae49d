// Emulation of ptx.cuh (host): warp collectives through emu::WarpCtx.
#pragma once
#include <cassert>
#include <cstdio>
#include <cstdlib>
#include "cuda_runtime.h"
namespace kda::cuda::pf {
#define EMU_CHECK(cond, msg) do { if (!(cond)) { std::fprintf(stderr, "EMU: %s (%s:%d)\n", msg, __FILE__, __LINE__); std::abort(); } } while (0)
inline uint32_t f32_to_tf32(float x) { uint32_t u = __float_as_uint(x); if ((u & 0x7f800000u) != 0x7f800000u) { u += 0x1000u; u &= 0xffffe000u; } return u; }
inline float tf32_round(float x) { return __uint_as_float(f32_to_tf32(x)); }
inline float fast_exp2(float x) { float r = std::exp2(x); return r < 1.17549435e-38f ? 0.f : r; }
inline uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
inline uint8_t* sptr(uint32_t a, int bytes) { EMU_CHECK(a + bytes <= emu::smem_size, "shared address out of range"); return emu::smem_base + a; }
inline float bf(uint32_t r, int hi) { return __uint_as_float(hi ? (r & 0xffff0000u) : (r << 16)); }
inline void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  auto* s = emu::warp_ctx->slot; const int l = emu::lane_id;
  for (int i = 0; i < 4; ++i) s[l][i] = a[i]; s[l][4] = b0; s[l][5] = b1;
  emu::warp_sync();
  float out[4];
  for (int e = 0; e < 4; ++e) {
    const int r = l / 4 + 8 * (e >> 1), n = 2 * (l % 4) + (e & 1);
    double acc = d[e];
    for (int k = 0; k < 16; ++k) {
      const int al = 4 * (r % 8) + (k % 8) / 2, ar = (r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
      const int bl = 4 * n + (k % 8) / 2, br = k >= 8 ? 1 : 0;
      acc += (double)bf((uint32_t)s[al][ar], k & 1) * bf((uint32_t)s[bl][4 + br], k & 1);
    }
    out[e] = (float)acc;
  }
  emu::warp_sync();
  for (int e = 0; e < 4; ++e) d[e] = out[e];
}
inline float tf(uint32_t r) { return __uint_as_float(r & 0xffffe000u); }
inline void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  auto* s = emu::warp_ctx->slot; const int l = emu::lane_id;
  for (int i = 0; i < 4; ++i) s[l][i] = a[i]; s[l][4] = b0; s[l][5] = b1;
  emu::warp_sync();
  float out[4];
  for (int e = 0; e < 4; ++e) {
    const int r = l / 4 + 8 * (e >> 1), n = 2 * (l % 4) + (e & 1);
    double acc = d[e];
    for (int k = 0; k < 8; ++k) {
      const int al = 4 * (r % 8) + k % 4, ar = (r >= 8 ? 1 : 0) + (k >= 4 ? 2 : 0);
      const int bl = 4 * n + k % 4, br = k >= 4 ? 1 : 0;
      acc += (double)tf((uint32_t)s[al][ar]) * tf((uint32_t)s[bl][4 + br]);
    }
    out[e] = (float)acc;
  }
  emu::warp_sync();
  for (int e = 0; e < 4; ++e) d[e] = out[e];
}
inline uint16_t ld16(uint32_t a) { uint16_t v; std::memcpy(&v, sptr(a, 2), 2); return v; }
inline void ldmatrix_impl(uint32_t (&r)[4], uint32_t addr, bool trans) {
  auto* s = emu::warp_ctx->slot; const int l = emu::lane_id;
  EMU_CHECK(addr % 16 == 0, "ldmatrix row address not 16-byte aligned");
  s[l][0] = addr; emu::warp_sync();
  for (int i = 0; i < 4; ++i) {
    uint32_t lo, hi;
    if (!trans) { const uint32_t A = (uint32_t)s[8 * i + l / 4][0]; lo = ld16(A + 4 * (l % 4)); hi = ld16(A + 4 * (l % 4) + 2); }
    else { lo = ld16((uint32_t)s[8 * i + 2 * (l % 4)][0] + 2 * (l / 4)); hi = ld16((uint32_t)s[8 * i + 2 * (l % 4) + 1][0] + 2 * (l / 4)); }
    r[i] = lo | (hi << 16);
  }
  emu::warp_sync();
}
inline void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) { ldmatrix_impl(r, addr, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) { ldmatrix_impl(r, addr, true); }
inline void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  auto* s = emu::warp_ctx->slot; const int l = emu::lane_id;
  EMU_CHECK(addr % 16 == 0, "stmatrix row address not 16-byte aligned");
  s[l][0] = addr; emu::warp_sync();
  const uint32_t rr[4] = {r0, r1, r2, r3};
  for (int i = 0; i < 4; ++i) {
    const uint16_t lo = rr[i] & 0xffff, hi = rr[i] >> 16;
    std::memcpy(sptr((uint32_t)s[8 * i + 2 * (l % 4)][0] + 2 * (l / 4), 2), &lo, 2);
    std::memcpy(sptr((uint32_t)s[8 * i + 2 * (l % 4) + 1][0] + 2 * (l / 4), 2), &hi, 2);
  }
  emu::warp_sync();
}
inline void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  EMU_CHECK(dst % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0, "cp.async misaligned");
  uint8_t* d = sptr(dst, 16); std::memset(d, 0, 16); if (src_bytes) std::memcpy(d, src, src_bytes);
}
inline void cp_async_commit() {}
}  // namespace kda::cuda::pf
namespace kda::cuda {
inline void pdl_prologue() {}  // no dependent grids on the CPU
}  // namespace kda::cuda
namespace kda::cuda::pf {
template <int kPending> inline void cp_async_wait() {}
inline void mbar_init(uint32_t bar, uint32_t) { sptr(bar, 8); }
inline void fence_barrier_init() {}
inline void fence_proxy_async() {}
inline void mbar_arrive_expect_tx(uint32_t bar, uint32_t) { sptr(bar, 8); }
inline void mbar_wait(uint32_t bar, uint32_t) { sptr(bar, 8); }
inline void bulk_copy_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  EMU_CHECK(dst % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0 && bytes % 16 == 0, "bulk copy misaligned");
  std::memcpy(sptr(dst, bytes), src, bytes); sptr(bar, 8);
}
inline void prefetch_l2(const void* src, uint32_t bytes) {
  EMU_CHECK(reinterpret_cast<uintptr_t>(src) % 16 == 0 && bytes % 16 == 0, "prefetch misaligned");
}
inline uint4 ld_global_16(const void* p) { EMU_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0, "ld16 misaligned"); uint4 r; std::memcpy(&r, p, 16); return r; }
}  // namespace kda::cuda::pf
