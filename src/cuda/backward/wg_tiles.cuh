// wg_tiles.cuh — the backward's wgmma building blocks: bf16 hi + lo B tiles in the 128-byte
// swizzle (K-major, common.cuh sw128_offset), their descriptors, the three-term product
// (hi hi, lo hi, hi lo: ~fp32 products from bf16 operands), a warpgroup's accumulator and A
// fragment layouts. Used by the record kernel (kernels.cuh) and the wgmma kernels (passes_wg.cuh).
#pragma once

#include "cuda/prefill/recurrence_steps.cuh"

namespace kda::cuda::bw {

using namespace pf;  // the prefill's device helpers (and, in emulation, the PTX wrappers)

// A bf16 tile of `rows` rows and K columns (K-major, 128-byte swizzle): rows * K * 2 bytes.
__host__ __device__ constexpr int wg_tile_bytes(int rows, int K) { return rows * K * 2; }

// x as two bf16 terms hi + lo, eight of them packed as two 16-byte rows.
__device__ __forceinline__ void split8(const float (&x)[8], uint4* hi, uint4* lo) {
  uint32_t h[4], l[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    h[i] = pf::pack_bf16(x[2 * i], x[2 * i + 1]);
    l[i] =
        pf::pack_bf16(x[2 * i] - pf::lo_f32<false>(h[i]), x[2 * i + 1] - pf::hi_f32<false>(h[i]));
  }
  *hi = make_uint4(h[0], h[1], h[2], h[3]);
  *lo = make_uint4(l[0], l[1], l[2], l[3]);
}

// tile_load / tile_store: one batch of stage_tile (units u0, u0 + nt, ..., kBatch of them), so
// that a caller can have several tiles' loads in flight before any store.
template <int kRows, int kK, bool kKContiguous, int kBatch>
__device__ __forceinline__ void tile_load(float (&x)[kBatch][8], const float* src, int rs, int ks,
                                          int u0, int t0, int nt) {
  constexpr int kUnits = kRows * kK / 8, kGroups = kK / 8;
#pragma unroll
  for (int v = 0; v < kBatch; ++v) {
    const int u = u0 + v * nt < kUnits ? u0 + v * nt : t0;  // past the end: a unit reread
    const int n = kKContiguous ? u / kGroups : u % kRows;
    const int kb = kKContiguous ? u % kGroups : u / kRows;
    if constexpr (kKContiguous) {
      const float4 a = *reinterpret_cast<const float4*>(src + n * rs + 8 * kb);
      const float4 b = *reinterpret_cast<const float4*>(src + n * rs + 8 * kb + 4);
      x[v][0] = a.x, x[v][1] = a.y, x[v][2] = a.z, x[v][3] = a.w, x[v][4] = b.x, x[v][5] = b.y,
      x[v][6] = b.z, x[v][7] = b.w;
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) x[v][i] = src[n * rs + (8 * kb + i) * ks];
    }
  }
}
template <int kRows, int kK, bool kKContiguous, int kBatch>
__device__ __forceinline__ void tile_store(const float (&x)[kBatch][8], uint8_t* hi, int u0,
                                           int nt) {
  constexpr int kUnits = kRows * kK / 8, kGroups = kK / 8;
  uint8_t* lo = hi + wg_tile_bytes(kRows, kK);
#pragma unroll
  for (int v = 0; v < kBatch; ++v) {
    const int u = u0 + v * nt;
    if (u >= kUnits) break;
    const int n = kKContiguous ? u / kGroups : u % kRows;
    const int kb = kKContiguous ? u % kGroups : u / kRows;
    uint4 h, l;
    split8(x[v], &h, &l);
    const int off = pf::sw128_offset(kRows, n, 16 * kb);
    *reinterpret_cast<uint4*>(hi + off) = h;
    *reinterpret_cast<uint4*>(lo + off) = l;
  }
}

// B operand tile (rows x K, element (n, k) = src[n * rs + k * ks], fp32 in device memory) into
// the bf16 hi tile at `hi` and the lo tile right after it, by threads t0, t0 + 1, .. (nt of
// them). A thread per (row, 8 columns) unit: with ks == 1 the units of a row go to consecutive
// threads (contiguous 32-byte reads), otherwise the rows do (rs == 1: consecutive threads read
// consecutive addresses). A thread's units are loaded in batches of kBatch, each batch's loads
// issued before its stores (a store to shared memory through a generic pointer may alias a later
// load, so the compiler would not move the loads up itself).
template <int kRows, int kK, bool kKContiguous, int kBatch = 4>
__device__ __forceinline__ void stage_tile(uint8_t* hi, const float* src, int rs, int ks,
                                           int t0 = static_cast<int>(threadIdx.x),
                                           int nt = static_cast<int>(blockDim.x)) {
  constexpr int kUnits = kRows * kK / 8;
#pragma unroll 1
  for (int u0 = t0; u0 < kUnits; u0 += kBatch * nt) {
    float x[kBatch][8];
    tile_load<kRows, kK, kKContiguous, kBatch>(x, src, rs, ks, u0, t0, nt);
    tile_store<kRows, kK, kKContiguous, kBatch>(x, hi, u0, nt);
  }
}

// Descriptor of k16 step q of the tile at byte offset `off` (rows rows) from the 1024-byte
// aligned base whose wgmma_desc_lo is dlo; the lo tile follows at + tile bytes.
__device__ __forceinline__ uint64_t wg_desc(uint32_t dlo, int off, int rows, int q) {
  return pf::rec_desc(dlo, off, rows, 32 * q);
}

// D (+)= A B with A = hi + lo (registers), B = hi + lo (tiles at off, off + tile bytes): the
// three terms hi hi, lo hi, hi lo, over k16 steps q0 .. q0 + NQ - 1 of B and of the A fragments.
// kALoZero: A's values are bf16 numbers (a bf16 dO), so its lo term is zero and lo hi, which
// would add exactly zero, is skipped; kBLoZero: likewise B's (hi lo skipped).
template <int NJ, int kScale, int NQ, bool kALoZero = false, bool kBLoZero = false>
__device__ __forceinline__ void wg_product(float (&d)[NJ][4], const uint32_t (&ah)[NQ][4],
                                           const uint32_t (&al)[NQ][4], uint32_t dlo, int off,
                                           int rows, int K) {
  const int lo = off + wg_tile_bytes(rows, K);
#pragma unroll
  for (int q = 0; q < NQ; ++q) {
    wgmma_bf16<NJ, kScale>(d, ah[q], wg_desc(dlo, off, rows, q), 1);
    if constexpr (!kALoZero) wgmma_bf16<NJ, kScale>(d, al[q], wg_desc(dlo, off, rows, q), 1);
    if constexpr (!kBLoZero) wgmma_bf16<NJ, kScale>(d, ah[q], wg_desc(dlo, lo, rows, q), 1);
  }
}
// The dynamic shared memory's first 1024-byte aligned byte (the tiles' swizzle period; the
// kernels' sizes include 1 KB of slack).
__device__ __forceinline__ uint8_t* align1024(uint8_t* p) {
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(p) + 1023) &
                                    ~static_cast<uintptr_t>(1023));
}

// Element (column 16 w + g + 8 (e >> 1), key / token 8 j + 2 c + (e & 1)) of a thread's
// accumulator tile j, register e (w: warp, g = lane / 4, c = lane % 4).
__device__ __forceinline__ int acc_row(int e) {
  const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3;
  return 16 * w + (lane >> 2) + 8 * (e >> 1);
}
__device__ __forceinline__ int acc_col(int j, int e) {
  return 8 * j + 2 * (threadIdx.x & 3) + (e & 1);
}

// A operands (bf16 hi + lo, k16 steps 0 .. NQ - 1) of the warp's 16 rows from a ( m, k ) -> value
// function: step q, register r holds rows 16 w + g (+ 8 for odd r), k = 16 q + 2 c (+ 8 for r >=
// 2) and the next k (w: warp in the warpgroup, g = lane / 4, c = lane % 4). a_values gathers the
// values (raw bits, say, so that their loads are in flight while the caller does other work),
// split_a makes the hi + lo pairs, load_a does both.
__device__ __forceinline__ int a_row(int r) {
  return 16 * ((threadIdx.x >> 5) & 3) + ((threadIdx.x & 31) >> 2) + 8 * (r & 1);
}
__device__ __forceinline__ int a_k(int q, int r, int i) {
  return 16 * q + 8 * (r >> 1) + 2 * (threadIdx.x & 3) + i;
}
template <int NQ, typename T, typename F>
__device__ __forceinline__ void a_values(F&& f, T (&x)[NQ][4][2]) {
#pragma unroll
  for (int q = 0; q < NQ; ++q)
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int i = 0; i < 2; ++i) x[q][r][i] = f(a_row(r), a_k(q, r, i));
}
template <int NQ>
__device__ __forceinline__ void split_a(const float (&x)[NQ][4][2], uint32_t (&hi)[NQ][4],
                                        uint32_t (&lo)[NQ][4]) {
#pragma unroll
  for (int q = 0; q < NQ; ++q)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const uint32_t h = pf::pack_bf16(x[q][r][0], x[q][r][1]);
      hi[q][r] = h;
      lo[q][r] =
          pf::pack_bf16(x[q][r][0] - pf::lo_f32<false>(h), x[q][r][1] - pf::hi_f32<false>(h));
    }
}

template <int NQ, typename F>
__device__ __forceinline__ void load_a(F&& f, uint32_t (&hi)[NQ][4], uint32_t (&lo)[NQ][4]) {
  float x[NQ][4][2];
  a_values(f, x);
  split_a(x, hi, lo);
}

// One product of this warpgroup, waited for: acc = kScale A B, A (NQ k16 steps) gathered by
// a(m, k) and split into bf16 hi + lo (load_a), B the tile at `off` (rows, K) of the 1024-byte
// aligned base whose wgmma_desc_lo is dlo (wg_product).
template <int NJ, int kScale, int NQ, typename F>
__device__ __forceinline__ void wg_product_of(F&& a, float (&acc)[NJ][4], uint32_t dlo, int off,
                                              int rows, int K) {
  uint32_t ah[NQ][4], al[NQ][4];
  load_a(a, ah, al);
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
  wgmma_fence_acc(acc);
  wgmma_fence_acc(ah);
  wgmma_fence_acc(al);
  wgmma_fence();
  wg_product<NJ, kScale, NQ>(acc, ah, al, dlo, off, rows, K);
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_acc(acc);
}

// An accumulator of this warpgroup (rows m = row0 + acc_row, columns n = acc_col) as the bf16 hi +
// lo tile at `hi` (lo after it) of kRows rows and K columns: kTransposed, element (n, m) (rows: the
// accumulator's columns), else (m, n).
template <int kRows, int kK, bool kTransposed>
__device__ __forceinline__ void store_tile(const float (&acc)[8][4], uint8_t* hi, int row0) {
  uint8_t* lo = hi + wg_tile_bytes(kRows, kK);
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float x = acc[j][e];
      const uint16_t h = pf::out_bits<false>(x);
      const uint16_t l = pf::out_bits<false>(x - __uint_as_float(static_cast<uint32_t>(h) << 16));
      const int m = row0 + acc_row(e), n = acc_col(j, e);
      const int off =
          kTransposed ? pf::sw128_offset(kRows, n, 2 * m) : pf::sw128_offset(kRows, m, 2 * n);
      *reinterpret_cast<uint16_t*>(hi + off) = h;
      *reinterpret_cast<uint16_t*>(lo + off) = l;
    }
}
}  // namespace kda::cuda::bw
