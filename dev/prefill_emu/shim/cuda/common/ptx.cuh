// Emulation of src/cuda/common/ptx.cuh (host), the part the prefill kernels use: warp collectives
// through emu::WarpCtx.
#pragma once
#include <cassert>
#include <cstdio>
#include <cstdlib>

#include "core/kda_math.h"
#include "cuda_runtime.h"
#include "tsan.h"
namespace kda::cuda::pf {
#define EMU_CHECK(cond, msg)                                              \
  do {                                                                    \
    if (!(cond)) {                                                        \
      std::fprintf(stderr, "EMU: %s (%s:%d)\n", msg, __FILE__, __LINE__); \
      std::abort();                                                       \
    }                                                                     \
  } while (0)
inline uint32_t f32_to_tf32(float x) {
  uint32_t u = __float_as_uint(x);
  if ((u & 0x7f800000u) != 0x7f800000u) {
    u += 0x1000u;
    u &= 0xffffe000u;
  }
  return u;
}
inline float tf32_round(float x) { return __uint_as_float(f32_to_tf32(x)); }
inline float fast_exp2(float x) {
  float r = std::exp2(x);
  return r < 1.17549435e-38f ? 0.f : r;
}
inline uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
inline uint8_t* sptr(uint32_t a, int bytes) {
  EMU_CHECK(a + bytes <= emu::smem_size, "shared address out of range");
  return emu::smem_base + a;
}
inline float bf(uint32_t r, int hi) { return __uint_as_float(hi ? (r & 0xffff0000u) : (r << 16)); }
// m16n8k16 with 16-bit inputs (bf16 or f16: elem decodes the half `hi` of a register), fp32
// accumulate.
// Every lane's A fragment and B pair into the warp's exchange slots (slot[lane][0..3] = A,
// [4], [5] = B), then the warp synchronized: each mma reads the whole warp's fragments from there.
inline auto* share_mma_operands(const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  auto* s = emu::warp_ctx->slot;
  const int l = emu::lane_id;
  for (int i = 0; i < 4; ++i) s[l][i] = a[i];
  s[l][4] = b0;
  s[l][5] = b1;
  emu::warp_collective();
  return s;
}
template <typename Elem>
inline void mma_k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, Elem elem) {
  auto* s = share_mma_operands(a, b0, b1);
  const int l = emu::lane_id;
  float out[4];
  for (int e = 0; e < 4; ++e) {
    const int r = l / 4 + 8 * (e >> 1), n = 2 * (l % 4) + (e & 1);
    double acc = d[e];
    for (int k = 0; k < 16; ++k) {
      const int al = 4 * (r % 8) + (k % 8) / 2, ar = (r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
      const int bl = 4 * n + (k % 8) / 2, br = k >= 8 ? 1 : 0;
      acc += (double)elem((uint32_t)s[al][ar], k & 1) * elem((uint32_t)s[bl][4 + br], k & 1);
    }
    out[e] = (float)acc;
  }
  emu::warp_collective();
  for (int e = 0; e < 4; ++e) d[e] = out[e];
}
inline void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  mma_k16(d, a, b0, b1, bf);
}
inline float h16(uint32_t r, int hi) {
  return kda::detail::fp16_bits_to_float(static_cast<uint16_t>(hi ? r >> 16 : r & 0xffffu));
}
inline void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  mma_k16(d, a, b0, b1, h16);
}
inline uint32_t pack_f16(float lo, float hi) {
  return static_cast<uint32_t>(kda::detail::float_to_fp16_bits(lo)) |
         (static_cast<uint32_t>(kda::detail::float_to_fp16_bits(hi)) << 16);
}
// The product of two f16 values is exact in fp32 (11 x 11 significant bits); one rounding to f16.
inline uint32_t mul_f16x2(uint32_t a, uint32_t b) {
  return pack_f16(h16(a, 0) * h16(b, 0), h16(a, 1) * h16(b, 1));
}
inline float tf(uint32_t r) { return __uint_as_float(r & 0xffffe000u); }
inline void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  auto* s = share_mma_operands(a, b0, b1);
  const int l = emu::lane_id;
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
  emu::warp_collective();
  for (int e = 0; e < 4; ++e) d[e] = out[e];
}
inline uint16_t ld16(uint32_t a) {
  uint16_t v;
  std::memcpy(&v, sptr(a, 2), 2);
  return v;
}
inline void ldmatrix_impl(uint32_t* r, uint32_t addr, bool trans, int count = 4) {
  auto* s = emu::warp_ctx->slot;
  const int l = emu::lane_id;
  if (l < 8 * count) EMU_CHECK(addr % 16 == 0, "ldmatrix row address not 16-byte aligned");
  s[l][0] = addr;
  emu::warp_collective();
  for (int i = 0; i < count; ++i) {
    uint32_t lo, hi;
    if (!trans) {
      const uint32_t A = (uint32_t)s[8 * i + l / 4][0];
      lo = ld16(A + 4 * (l % 4));
      hi = ld16(A + 4 * (l % 4) + 2);
    } else {
      lo = ld16((uint32_t)s[8 * i + 2 * (l % 4)][0] + 2 * (l / 4));
      hi = ld16((uint32_t)s[8 * i + 2 * (l % 4) + 1][0] + 2 * (l / 4));
    }
    r[i] = lo | (hi << 16);
  }
  emu::warp_collective();
}
inline void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) { ldmatrix_impl(r, addr, false); }
inline void ldmatrix_x2(uint32_t (&r)[2], uint32_t addr) { ldmatrix_impl(r, addr, false, 2); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) { ldmatrix_impl(r, addr, true); }
inline void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  auto* s = emu::warp_ctx->slot;
  const int l = emu::lane_id;
  EMU_CHECK(addr % 16 == 0, "stmatrix row address not 16-byte aligned");
  s[l][0] = addr;
  emu::warp_collective();
  const uint32_t rr[4] = {r0, r1, r2, r3};
  for (int i = 0; i < 4; ++i) {
    const uint16_t lo = rr[i] & 0xffff, hi = rr[i] >> 16;
    std::memcpy(sptr((uint32_t)s[8 * i + 2 * (l % 4)][0] + 2 * (l / 4), 2), &lo, 2);
    std::memcpy(sptr((uint32_t)s[8 * i + 2 * (l % 4) + 1][0] + 2 * (l / 4), 2), &hi, 2);
  }
  emu::warp_collective();
}
inline void cp_async_16_zfill(uint32_t dst, const void* src, int src_bytes) {
  EMU_CHECK(dst % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0, "cp.async misaligned");
  uint8_t* d = sptr(dst, 16);
  std::memset(d, 0, 16);
  if (src_bytes) std::memcpy(d, src, src_bytes);
  emu::tsan::cp_async_issued(d);
}
inline void cp_async_16(uint32_t dst, const void* src) { cp_async_16_zfill(dst, src, 16); }
// Copies complete at issue; the ThreadSanitizer mode writes them again at their wait (tsan.h).
inline void cp_async_commit() { emu::tsan::cp_async_committed(); }
inline void cp_async_wait_all() { emu::tsan::cp_async_waited(0); }
}  // namespace kda::cuda::pf
namespace kda::cuda {
inline void pdl_prologue() {}  // no dependent grids on the CPU
}  // namespace kda::cuda
namespace kda::cuda::pf {
template <int kPending>
inline void cp_async_wait() {
  emu::tsan::cp_async_waited(kPending);
}
inline void fence_mbar_init() {}
inline void fence_proxy_async() {}
inline void fence_proxy_async_global() {}
inline void named_barrier_sync(int id, int count) { emu::named_sync(id, count); }
template <int kRegs>
inline void setmaxnreg_inc() {}  // registers are not modelled
template <int kRegs>
inline void setmaxnreg_dec() {}
// mbarriers with their hardware semantics, kept in their 8 bytes of shared memory: expected
// arrivals, pending arrivals, phase bit, transaction bytes. A phase completes when its arrivals
// and bytes are all in; mbar_wait(parity) returns once the phase of that parity has completed
// (the current phase bit differs), yielding to the other fibers meanwhile, and aborts on a
// deadlock. Bulk copies land at once, so the protocol (counts, parities, who waits for whom) is
// what this checks, not the timing. The ThreadSanitizer mode (tsan.h) keeps the bookkeeping out of
// its checks, releases each arrival and each copy's bytes into a synchronization object of the
// barrier's phase parity and acquires it when a wait returns.
struct EmuMbar {
  uint32_t count : 12, pending : 12, phase : 1, init : 7;
  int32_t tx;
};
static_assert(sizeof(EmuMbar) == 8, "mbarrier is 8 bytes");
inline EmuMbar* mbar_at(uint32_t bar) {
  EMU_CHECK(bar % 8 == 0, "mbarrier not 8-byte aligned");
  return reinterpret_cast<EmuMbar*>(sptr(bar, 8));
}
inline const char* mbar_token(uint32_t bar, uint32_t parity) {
  static char tokens[2 * 240000 / 8];
  return &tokens[2 * (bar / 8) + (parity & 1)];
}
inline void mbar_complete_if_done(EmuMbar* m) {
  if (m->pending == 0 && m->tx == 0) {
    m->phase ^= 1;
    m->pending = m->count;
  }
}
inline void mbar_init(uint32_t bar, uint32_t count) {
  EMU_CHECK(count >= 1 && count < 4096, "mbarrier count");
  const emu::tsan::Ignore ig;
  EmuMbar* m = mbar_at(bar);
  m->count = count;
  m->pending = count;
  m->phase = 0;
  m->init = 0x5a;
  m->tx = 0;
}
inline EmuMbar* mbar_live(uint32_t bar) {
  const emu::tsan::Ignore ig;
  EmuMbar* m = mbar_at(bar);
  EMU_CHECK(m->init == 0x5a, "mbarrier used before init");
  return m;
}
// An arrival (or a copy's bytes) in the current phase of the barrier: a release into its parity.
inline EmuMbar* mbar_release(uint32_t bar) {
  EmuMbar* m = mbar_live(bar);
  uint32_t phase;
  {
    const emu::tsan::Ignore ig;
    phase = m->phase;
  }
  emu::tsan::release(mbar_token(bar, phase));
  return m;
}
inline void mbar_arrive(uint32_t bar) {
  EmuMbar* m = mbar_release(bar);
  const emu::tsan::Ignore ig;
  EMU_CHECK(m->pending > 0, "mbarrier: more arrivals than expected");
  --m->pending;
  mbar_complete_if_done(m);
}
inline void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  {
    const emu::tsan::Ignore ig;
    mbar_live(bar)->tx += static_cast<int32_t>(bytes);
  }
  mbar_arrive(bar);
}
inline bool mbar_phase_is(uint32_t bar, uint32_t parity) {
  const emu::tsan::Ignore ig;
  return mbar_live(bar)->phase == (parity & 1);
}
inline void mbar_wait(uint32_t bar, uint32_t parity) {
  for (long spins = 0; mbar_phase_is(bar, parity); ++spins) {
    EMU_CHECK(spins < 1000000, "mbarrier wait: deadlock (the phase never completes)");
    emu::yield_fiber();
  }
  emu::tsan::acquire(mbar_token(bar, parity));
}
inline void bulk_copy_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  EMU_CHECK(dst % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0 && bytes % 16 == 0,
            "bulk copy misaligned");
  std::memcpy(sptr(dst, bytes), src, bytes);
  EmuMbar* m = mbar_release(bar);  // the bytes' completion
  const emu::tsan::Ignore ig;
  m->tx -= static_cast<int32_t>(bytes);
  EMU_CHECK(m->tx >= 0, "bulk copy: more bytes than the barrier expects");
  mbar_complete_if_done(m);
}
inline void prefetch_l2(const void*) {}  // a line prefetch never faults: nothing to check
// The range's first and last bytes are read, so that a prefetch outside an allocation shows up.
inline void bulk_prefetch_l2(const void* src, uint32_t bytes) {
  EMU_CHECK(reinterpret_cast<uintptr_t>(src) % 16 == 0 && bytes % 16 == 0, "prefetch misaligned");
  EMU_CHECK(bytes > 0, "empty prefetch");
  const volatile uint8_t* b = static_cast<const uint8_t*>(src);
  (void)b[0];
  (void)b[bytes - 1];
}
// wgmma (sm_90a), emulated: products complete at issue, so fence/commit/wait are no-ops (the
// ThreadSanitizer mode reads a group's shared-memory operands again at its wait, tsan.h). Each warp
// of the warpgroup computes its own 16 rows (16w..16w+15) from its own A fragment, so a warp-level
// rendezvous is enough (the 4 warps are not checked to be present).
inline void wgmma_fence() {}
inline void wgmma_commit() { emu::tsan::wgmma_committed(); }
template <int kPending>
inline void wgmma_wait() {
  emu::tsan::wgmma_waited(kPending);
}
template <int NJ>
inline void wgmma_fence_acc(float (&)[NJ][4]) {}
template <int NJ>
inline void wgmma_fence_acc(uint32_t (&)[NJ][4]) {}  // A operand registers
inline uint64_t wgmma_desc_sw128(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3ffffu) >> 4) | (1ull << 16) | (64ull << 32) |
         (1ull << 62);
}
inline uint32_t wgmma_desc_lo(uint32_t addr) { return ((addr & 0x3ffffu) >> 4) | (1u << 16); }
inline constexpr uint32_t kDescHiSw128 = 64u | (1u << 30), kDescHiSw64 = 32u | (2u << 30),
                          kDescHiSw32 = 16u | (3u << 30);
inline uint64_t wgmma_desc_at(uint32_t lo, uint32_t bytes, uint32_t hi) {
  return static_cast<uint64_t>(lo + (bytes >> 4)) | (static_cast<uint64_t>(hi) << 32);
}
// Element (n, k) of B (K-major, swizzled rows of rb = 128, 64 or 32 bytes) through the descriptor;
// esize 2 (bf16) or 4 (tf32). The swizzle XORs the 16-byte chunk bits [4, 4 + log2(rb / 16)) of the
// absolute shared address with the bits from 7 up.
inline float wgmma_b(uint32_t start, uint32_t sbo, int rb, int n, int k, int esize) {
  uint32_t a = start + (n / 8) * sbo + (n % 8) * rb + k * esize;
  a ^= ((a >> 7) & (rb / 16 - 1)) << 4;
  emu::tsan::wgmma_read(sptr(a, esize), esize);
  if (esize == 2) {
    uint16_t v;
    std::memcpy(&v, sptr(a, 2), 2);
    return __uint_as_float((uint32_t)v << 16);
  }
  uint32_t v;
  std::memcpy(&v, sptr(a, 4), 4);
  return __uint_as_float(v & 0xffffe000u);
}
// D[64 x 8 NJ] (+)= kScaleA A[64 x K] B[K x 8 NJ] (this warp's 16 rows); kTf32: K = 8, else bf16 K
// = 16.
template <int NJ, bool kTf32, int kScaleA>
inline void wgmma_impl(float (&d)[NJ][4], const uint32_t (&a)[4], uint64_t desc, int accumulate) {
  static_assert(kScaleA == 1 || kScaleA == -1, "wgmma imm-scale-a is 1 or -1");
  constexpr int K = kTf32 ? 8 : 16, esize = kTf32 ? 4 : 2;
  const uint32_t start = (uint32_t)(desc & 0x3fff) << 4, sbo = (uint32_t)((desc >> 32) & 0x3fff)
                                                               << 4;
  const int type = (int)(desc >> 62);  // 1: 128-byte, 2: 64-byte, 3: 32-byte swizzle
  EMU_CHECK(type != 0, "wgmma descriptor: layout type 0 (no swizzle) is not used here");
  const int rb = type == 1 ? 128 : (type == 2 ? 64 : 32);  // row bytes; the atom is 8 rows
  EMU_CHECK(sbo == (uint32_t)(8 * rb),
            "wgmma descriptor: stride byte offset != 8 rows of the swizzle");
  EMU_CHECK(((desc >> 49) & 7) == 0, "wgmma descriptor: base offset != 0");
  EMU_CHECK(start % 16 == 0, "wgmma descriptor: start not 16-byte aligned");
  EMU_CHECK(start % (8 * rb) < (uint32_t)rb,
            "wgmma descriptor: tile not aligned to its swizzle atom (start beyond the first row)");
  EMU_CHECK(start % rb + K * esize <= (uint32_t)rb,
            "wgmma descriptor: K slice crosses the swizzled row");
  auto* s = emu::warp_ctx->slot;
  const int l = emu::lane_id;
  for (int i = 0; i < 4; ++i) s[l][i] = a[i];
  emu::warp_collective();
  // This lane's A rows g and g + 8, decoded from the warp's fragments.
  double ar[2][K];
  for (int rr = 0; rr < 2; ++rr)
    for (int k = 0; k < K; ++k) {
      const int r = l / 4 + 8 * rr;
      if (kTf32)
        ar[rr][k] = tf((uint32_t)s[4 * (r % 8) + k % 4][(r >= 8 ? 1 : 0) + (k >= 4 ? 2 : 0)]);
      else
        ar[rr][k] =
            bf((uint32_t)s[4 * (r % 8) + (k % 8) / 2][(r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)], k & 1);
    }
  float out[NJ][4];
  for (int j = 0; j < NJ; ++j)
    for (int cc = 0; cc < 2; ++cc) {
      const int n = 8 * j + 2 * (l % 4) + cc;
      double b[K];
      for (int k = 0; k < K; ++k) b[k] = wgmma_b(start, sbo, rb, n, k, esize);
      for (int rr = 0; rr < 2; ++rr) {
        const int e = 2 * rr + cc;
        double acc = accumulate ? (double)d[j][e] : 0.0;
        for (int k = 0; k < K; ++k) acc += kScaleA * (ar[rr][k] * b[k]);
        out[j][e] = (float)acc;
      }
    }
  emu::warp_collective();
  for (int j = 0; j < NJ; ++j)
    for (int e = 0; e < 4; ++e) d[j][e] = out[j][e];
}
// src/cuda/common/ptx.cuh's products: bf16 NJ = 2, 8 or 16 (n16, n64, n128); tf32 NJ = 2 or 8.
template <int NJ, int kScaleA = 1>
inline void wgmma_bf16(float (&d)[NJ][4], const uint32_t (&a)[4], uint64_t b_desc, int accumulate) {
  static_assert(NJ == 2 || NJ == 8 || NJ == 16, "wgmma_bf16: n16, n64 or n128");
  wgmma_impl<NJ, false, kScaleA>(d, a, b_desc, accumulate);
}
template <int NJ, int kScaleA = 1>
inline void wgmma_tf32(float (&d)[NJ][4], const uint32_t (&a)[4], uint64_t b_desc, int accumulate) {
  static_assert(NJ == 2 || NJ == 8, "wgmma_tf32: n16 or n64");
  wgmma_impl<NJ, true, kScaleA>(d, a, b_desc, accumulate);
}
inline void st_global_16(void* p, uint4 v) {
  EMU_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0, "st16 misaligned");
  std::memcpy(p, &v, 16);
}
inline uint4 ld_global_16(const void* p) {
  EMU_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0, "ld16 misaligned");
  uint4 r;
  std::memcpy(&r, p, 16);
  return r;
}
}  // namespace kda::cuda::pf
