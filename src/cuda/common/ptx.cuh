// ptx.cuh — the one set of PTX wrappers of the CUDA kernels (decode and prefill): programmatic
// dependent launch, lane id, L2 prefetch, mma.sync (bf16 / fp16 m16n8k16, tf32 m16n8k8), wgmma,
// ldmatrix / stmatrix, cp.async, mbarriers, bulk copies (the TMA engine) in both directions, tf32
// rounding. Shared-memory operands are 32-bit shared addresses (smem_addr). Fragment layouts: see
// prefill/common.cuh. dev/prefill_emu/shim/cuda/common/ptx.cuh emulates the part that the prefill
// kernels use.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kda::cuda {

// Every kernel of the library starts with pdl_prologue(): it lets the next kernel in the stream
// (if that one was launched with PDL, common/launch.cuh) be scheduled while this grid finishes,
// then waits until every grid this one depends on has completed and its memory is visible.
// Nothing is read or written in global memory before the wait, so a PDL launch is exactly as
// ordered as a plain one. Without the launch attribute both instructions do nothing.
// pdl_launch_dependents() and pdl_wait() are its two halves, for a kernel that does work between
// them that reads no global memory (kernel parameters and shared memory only).
__device__ __forceinline__ void pdl_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_prologue() {
  pdl_launch_dependents();
  pdl_wait();
}

// The lane index, re-read at every use (volatile: the compiler neither hoists nor keeps it live
// across loops, which keeps values derived from it out of the register budget).
__device__ __forceinline__ int lane_id() {
  int lane;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
  return lane;
}

// Reads a kernel's parameter block once, so that the SM's constant caches hold it when the code
// after pdl_wait() uses it (each node of a CUDA graph has its own copy, cold at its launch): one
// 4-byte word per 64-byte piece of the struct, the pieces spread over the block's warps (piece
// lane * kWarps + warp, so that no warp serializes many distinct constant addresses), left in
// `sink` (shared memory) to keep the loads alive. Parameters only: legal before pdl_wait().
template <int kWarps, typename Args>
__device__ __forceinline__ void warm_params(const Args& a, int warp_in_block,
                                            volatile uint32_t* sink) {
  constexpr int kWords = static_cast<int>(sizeof(Args) / 4), kPieceWords = 16;
  static_assert(sizeof(Args) <= 32 * kWarps * kPieceWords * 4, "one piece per lane");
  const int piece = lane_id() * kWarps + warp_in_block;
  if (piece * kPieceWords < kWords)
    *sink = reinterpret_cast<const uint32_t*>(&a)[piece * kPieceWords];
}

// L2 prefetch of the line at p (a hint).
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// The 32-bit shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// fp32 -> tf32, round to nearest (ties away from zero) on the 13 dropped bits: what
// cvt.rna.tf32.f32 computes, in two full-rate integer operations (the conversion instruction is
// not full rate). Finite inputs only (the kernels never feed it inf/NaN).
__device__ __forceinline__ uint32_t f32_to_tf32(float x) {
  return (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
}
__device__ __forceinline__ float tf32_round(float x) { return __uint_as_float(f32_to_tf32(x)); }

// 2^x (MUFU.EX2, ~2 ulp; flushes denormal results to zero: 2^x < 2^-126 reads as 0).
__device__ __forceinline__ float fast_exp2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// ---------------------------------------------------------------------------------------------
// PTX wrappers
// ---------------------------------------------------------------------------------------------

// D = A B + D, bf16 inputs, fp32 accumulate. Not volatile: a pure register operation that the
// compiler may schedule freely (interleaving independent accumulators).
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// D = A B + D, fp16 inputs (pairs packed in 32-bit registers), fp32 accumulate (m16n8k16).
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Two fp32 values as a packed f16 pair (lo in the low half), round to nearest even, subnormals
// kept (one F2FP).
__device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
// Element-wise product of two f16 pairs, round to nearest even, subnormals kept (one HMUL2).
__device__ __forceinline__ uint32_t mul_f16x2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// D = A B + D, tf32 inputs (32-bit registers holding tf32 values), fp32 accumulate.
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// Two 8x8 b16 matrices (row addresses from lanes 0-15); also two 8 x 4 fp32 blocks: lane 4g + c
// gets word c of row g of each.
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// Stores four 8x8 b16 matrices, each transposed: the fragment element (row g, col 2c..2c+1) of
// matrix i lands at row 2c..2c+1, column g of the 8x8 block whose rows lane 8i..8i+7 address.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1,
                                                  uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(addr),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// 16-byte asynchronous copy global -> shared, bypassing L1 (.cg); src_bytes = 0 writes zeros and
// reads nothing.
__device__ __forceinline__ void cp_async_16_zfill(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}
// L2 prefetch of `bytes` (a multiple of 16) from a 16-byte aligned global address: a hint, no
// completion to wait for.
__device__ __forceinline__ void bulk_prefetch_l2(const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes the mbarrier initializations visible (to the other threads after a barrier, and to the
// async proxy, the bulk-copy engine, that completes transactions on them).
__device__ __forceinline__ void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Orders this thread's generic-proxy shared-memory accesses before its later async-proxy ones
// (a bulk copy into a buffer that generic loads / stores used before).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// The same between the generic proxy's and the async proxy's accesses of global memory.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Warpgroup register reallocation (sm_90a; every thread of the warpgroup executes it): the
// warpgroup's per-thread register limit rises to / falls to kRegs (a multiple of 8 in [24, 256]);
// an increase waits until the CTA's other warpgroups have released enough.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
// Barrier `id` (1..15; 0 is __syncthreads) of `count` threads (a multiple of 32).
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// Waits (acquire, CTA scope) until the phase of parity `parity` has completed; the retry loop is
// C++ (the compiler sees it). A fresh barrier is in phase 0, so waiting for parity 1 returns at
// once.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, "
        "1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
}
// Bulk copy global -> shared (16-byte aligned, size a multiple of 16), completing `bytes`
// transactions on `bar`.
__device__ __forceinline__ void bulk_copy_g2s(uint32_t dst, const void* src, uint32_t bytes,
                                              uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

// ---------------------------------------------------------------------------------------------
// wgmma (sm_90a): warpgroup-wide asynchronous products. A comes from registers: warp w of the
// warpgroup holds rows 16w..16w+15 in the mma.sync A fragment (bf16 m16n8k16 / tf32 m16n8k8,
// common.cuh); B is read from shared memory through a descriptor; the fp32 accumulators d[j][e]
// are (row 16w + g + 8 (e >> 1), column 8j + 2c + (e & 1)), the mma.sync C fragment of n-tile j.
// Order: wgmma_fence() before the first product of a group (after the registers it reads were
// written), wgmma_commit() after the last, wgmma_wait<n>() before the accumulators are read, then
// wgmma_fence_acc() on them so that the compiler does not move their reads above the wait.
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Also before wgmma_fence() on A operands and accumulators written just before, so that the
// compiler does not sink those writes below the fence (ptxas then inserts its own fences).
template <int NJ>
__device__ __forceinline__ void wgmma_fence_acc(float (&d)[NJ][4]) {
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}
template <int NJ>
__device__ __forceinline__ void wgmma_fence_acc(uint32_t (&d)[NJ][4]) {
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(d[j][e])::"memory");
}

// Descriptors of B operands stored K-major in a swizzle layout, e.g. the 128-byte one (common.cuh,
// sw128_offset): start address / 16, leading byte offset unused (1), stride byte offset 1024 (the
// next 8 rows), layout type 1. The 128-byte swizzle acts on address bits [4, 7) ^ [7, 10), so a
// tile starts 1024-byte aligned; the K step k inside a 128-byte row is start + k bytes (32 per
// bf16 k16 or tf32 k8 step). Built from two 32-bit halves: the low word (start address / 16,
// leading byte offset 1) of a base address plus a byte offset, so that the descriptors of one stage
// cost one integer add each (shared addresses are below 2^18: the start field never carries into
// bit 16), and the high word (stride byte offset = 8 rows, layout type) of the swizzle mode:
// 128-byte; 64-byte (rows of 64 bytes, atom 8 x 64 B: stride 512, type 2; chunk bits [4, 6) ^ [7,
// 9)); 32-byte (rows of 32 bytes, atom 8 x 32 B: stride 256, type 3; bit 4 ^ bit 7). The 16-token
// records use all three (common.cuh).
__device__ __forceinline__ uint32_t wgmma_desc_lo(uint32_t addr) {
  return ((addr & 0x3ffffu) >> 4) | (1u << 16);
}
inline constexpr uint32_t kDescHiSw128 = 64u | (1u << 30), kDescHiSw64 = 32u | (2u << 30),
                          kDescHiSw32 = 16u | (3u << 30);
__device__ __forceinline__ uint64_t wgmma_desc_at(uint32_t lo, uint32_t bytes, uint32_t hi) {
  uint64_t d;
  asm("mov.b64 %0, {%1, %2};" : "=l"(d) : "r"(lo + (bytes >> 4)), "r"(hi));
  return d;
}

// Operand lists of the wgmma wrappers: accumulator n-tiles j..j+7 (32 registers), their
// placeholders, and the product: D (%0..) = kScaleA A (4 registers) B (descriptor) + D if
// `accumulate` (a predicate from the register after the descriptor).
#define KDA_WG_ACC4(d, j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define KDA_WG_ACC32(d, j)                                                                \
  KDA_WG_ACC4(d, j), KDA_WG_ACC4(d, j + 1), KDA_WG_ACC4(d, j + 2), KDA_WG_ACC4(d, j + 3), \
      KDA_WG_ACC4(d, j + 4), KDA_WG_ACC4(d, j + 5), KDA_WG_ACC4(d, j + 6), KDA_WG_ACC4(d, j + 7)
#define KDA_WG_D32                                                                                 \
  "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25," \
  "%26,%27,%28,%29,%30,%31"
// clang-format off
#define KDA_WG_D64 KDA_WG_D32 ",%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47," \
  "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
// clang-format on
#define KDA_WG_IN \
  "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate), "n"(kScaleA)
// The n16 shapes (NJ = 2: 8 accumulator registers): types = "m64n16k16.f32.bf16.bf16" or
// "m64n16k8.f32.tf32.tf32", tail = the operands after imm-scale-b (bf16: ", 0" for tnspB).
#define KDA_WG_N16(types, tail)                                                                   \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %13, 0;\n wgmma.mma_async.sync.aligned." types \
               " {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, %14, 1" tail ";\n}\n"        \
               : KDA_WG_ACC4(d, 0), KDA_WG_ACC4(d, 1)                                             \
               : KDA_WG_IN                                                                        \
               : "memory")

// D[64 x 8 NJ] (+)= kScaleA A[64 x 16] B[16 x 8 NJ]: bf16 inputs, fp32 accumulators (accumulate
// = 0: D = the product). NJ = 2, 8 or 16.
template <int NJ, int kScaleA = 1>
__device__ __forceinline__ void wgmma_bf16(float (&d)[NJ][4], const uint32_t (&a)[4],
                                           uint64_t b_desc, int accumulate) {
  static_assert(NJ == 2 || NJ == 8 || NJ == 16, "wgmma_bf16: n16, n64 or n128");
  if constexpr (NJ == 2) {
    KDA_WG_N16("m64n16k16.f32.bf16.bf16", ", 0");
  } else if constexpr (NJ == 8) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n "
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" KDA_WG_D32
        "}, {%32,%33,%34,%35}, %36, p, %38, 1, 0;\n}\n"
        : KDA_WG_ACC32(d, 0)
        : KDA_WG_IN
        : "memory");
  } else {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n "
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" KDA_WG_D64
        "}, {%64,%65,%66,%67}, %68, p, %70, 1, 0;\n}\n"
        : KDA_WG_ACC32(d, 0), KDA_WG_ACC32(d, 8)
        : KDA_WG_IN
        : "memory");
  }
}
// D[64 x 8 NJ] (+)= kScaleA A[64 x 8] B[8 x 8 NJ]: tf32 inputs, fp32 accumulators. NJ = 2 or 8.
template <int NJ, int kScaleA = 1>
__device__ __forceinline__ void wgmma_tf32(float (&d)[NJ][4], const uint32_t (&a)[4],
                                           uint64_t b_desc, int accumulate) {
  static_assert(NJ == 2 || NJ == 8, "wgmma_tf32: n16 or n64");
  if constexpr (NJ == 2) {
    KDA_WG_N16("m64n16k8.f32.tf32.tf32", "");
    return;
  }
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n "
      "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 {" KDA_WG_D32
      "}, {%32,%33,%34,%35}, %36, p, %38, 1;\n}\n"
      : KDA_WG_ACC32(d, 0)
      : KDA_WG_IN
      : "memory");
}
#undef KDA_WG_ACC4
#undef KDA_WG_ACC32
#undef KDA_WG_D32
#undef KDA_WG_D64
#undef KDA_WG_IN
#undef KDA_WG_N16

// 16-byte global store (p 16-byte aligned): one instruction (a plain uint4 store through a 16-bit
// pointer compiled to four 4-byte stores).
__device__ __forceinline__ void st_global_16(void* p, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}
// 16-byte read-only global load (p 16-byte aligned).
__device__ __forceinline__ uint4 ld_global_16(const void* p) {
  return __ldg(static_cast<const uint4*>(p));
}

// Waits as mbar_wait, with the retry loop inside the asm block (one branch back to the try_wait;
// the decode kernels' measured code uses this form, the prefill kernels' mbar_wait's).
__device__ __forceinline__ void mbar_wait_spin(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred P1;\n"
      "WAIT_LOOP:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      "@!P1 bra WAIT_LOOP;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// An L2 policy for data read once (the decode state tiles).
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}

// bulk_copy_g2s with an L2 cache policy (l2_evict_first_policy).
__device__ __forceinline__ void bulk_copy_g2s_hint(uint32_t dst, const void* src, uint32_t bytes,
                                                   uint32_t bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], "
      "[%1], %2, [%3], %4;" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "l"(policy)
      : "memory");
}

// Bulk copy shared -> global (a multiple of 16 bytes, 16-byte aligned), in the calling thread's
// bulk async-group. Every thread that wrote the shared source with generic stores must have run
// fence_proxy_async() before the barrier that precedes this call.
__device__ __forceinline__ void bulk_store(void* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Waits until the calling thread's committed bulk stores have finished reading shared memory
// (the source may be overwritten; the global writes complete before the grid does).
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}

// Waits until the calling thread's committed bulk stores are complete (their global writes
// performed): a later bulk store to the same addresses is then ordered after them.
__device__ __forceinline__ void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// 16-byte cp.async global -> shared, bypassing L1 (.cg), both addresses 16-byte aligned. A
// thread's copies complete for that thread at cp_async_wait_all (the data is visible to other
// threads only after a barrier).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;" ::: "memory");
}

}  // namespace kda::cuda
