// recurrence_steps.cuh — the pieces of the recurrence kernel (recurrence.cuh) as device functions:
// shared-memory sizes of its stages, fragment loads of the record operands, the mma.sync chunk
// products, the wgmma chunk products (64- and 16-token steps) and their completion.
#pragma once

#include "cuda/prefill/common.cuh"

namespace kda::cuda::pf {

// A pipeline stage (record + v tile), rounded to the 1024-byte period of the record's swizzle.
__host__ __device__ constexpr int recurrence_stage_bytes(int vs) {
  return (kRecordBytes + kChunk * vs * 2 + 1023) & ~1023;
}
// The chunk-16 path (wgmma, vs >= 64): a stage is a 16-token record + its v tile.
__host__ __device__ constexpr int recurrence_stage_bytes16(int vs) {
  return (kRecord16Bytes + kChunk16 * vs * 2 + 1023) & ~1023;
}
// Bytes of a 16-token record that are copied (gL ends the record; the rest is alignment).
inline constexpr int kRecord16CopyBytes = kR16OffGL + kHeadDim * 4;
__host__ __device__ constexpr int recurrence_warps(int vs, bool ksplit) {
  return (ksplit ? 2 : 1) * (vs / 16);
}
// Exchange area of the K split: per warp its partial U^T and O^T (2 x 32 fp32 per thread).
inline constexpr int kXchWarpBytes = 2 * 32 * 32 * 4;
// Two stages (from the first 1024-byte aligned address: + 1024 bytes of slack), then one output
// tile [64 t][16 v] (2 KB) per warp, then two mbarriers (stage full) and two counters (wgmma
// path: warps done with a stage), then
// (K split) the exchange area.
inline constexpr int kBarBytes = 32;
__host__ __device__ constexpr int recurrence_smem_bytes(int vs, bool ksplit = false) {
  return 1024 + 2 * recurrence_stage_bytes(vs) + recurrence_warps(vs, ksplit) * kChunk * 32 +
         kBarBytes + (ksplit ? recurrence_warps(vs, ksplit) * kXchWarpBytes : 0);
}
// Four stages (records and v tiles three steps ahead), then the output tiles, four mbarriers and
// four counters.
inline constexpr int kStages16 = 4;
inline constexpr int kBarBytes16 = 64;
__host__ __device__ constexpr int recurrence_smem_bytes16(int vs) {
  return 1024 + kStages16 * recurrence_stage_bytes16(vs) +
         recurrence_warps(vs, false) * kChunk16 * 32 + kBarBytes16;
}
static_assert(recurrence_smem_bytes16(128) <= 232448, "recurrence shared memory (chunk 16)");
// One block per SM on sm_90 (232,448 bytes of dynamic shared memory at most) in both
// configurations.
static_assert(recurrence_smem_bytes(128) <= 232448 && recurrence_smem_bytes(32, true) <= 232448,
              "recurrence shared memory");

// Byte offset of 16-byte chunk `chunk` (0, 1) of row t in a warp's output tile [64][16] (32-byte
// rows; the chunk is swapped every 4 rows so that 8 consecutive rows hit 8 bank groups).
__device__ __forceinline__ int out_tile_offset(int t, int chunk) {
  return t * 32 + ((chunk ^ ((t >> 2) & 1)) << 4);
}

// Eight 16-bit outputs (16 bytes) at obase + off: one vector store when the output view allows it.
__device__ __forceinline__ void store_out16(uint16_t* obase, int64_t off, uint4 x, bool vec) {
  if (vec) {
    st_global_16(obase + off, x);
    return;
  }
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    obase[off + 2 * i] = static_cast<uint16_t>(w[i] & 0xffffu);
    obase[off + 2 * i + 1] = static_cast<uint16_t>(w[i] >> 16);
  }
}

// Element offset of state element (value row v, key column kk) of head hv in row `row`.
__device__ __forceinline__ int64_t state_offset(const StateView& s, bool kfirst, int64_t row,
                                                int hv, int v, int kk) {
  return row * s.s0 + hv * s.s1 +
         (kfirst ? static_cast<int64_t>(kk) * s.s2 + v : static_cast<int64_t>(v) * s.s2 + kk);
}

// This thread's S^T elements: acc[j][e] = S^T[vw + g + 8 (e >> 1)][k0 + 8j + 2c + (e & 1)].
template <int NJ>
__device__ __forceinline__ void load_state(float (&acc)[NJ][4], const StateView& s, bool kfirst,
                                           int64_t row, int hv, int vw, int k0, int g, int c) {
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      acc[j][e] = load_any(
          s.data, s.dtype,
          state_offset(s, kfirst, row, hv, vw + g + 8 * (e >> 1), k0 + 8 * j + 2 * c + (e & 1)));
}
template <int NJ>
__device__ __forceinline__ void store_state(const float (&acc)[NJ][4], const StateView& s,
                                            bool kfirst, int64_t row, int hv, int vw, int k0, int g,
                                            int c) {
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      store_any(
          s.data, s.dtype,
          state_offset(s, kfirst, row, hv, vw + g + 8 * (e >> 1), k0 + 8 * j + 2 * c + (e & 1)),
          acc[j][e]);
}

// A segment's start from zero, or from the identity (the transition's rows: S^T[v][k] = [v == k]).
template <int NJ>
__device__ __forceinline__ void init_segment_state(float (&acc)[NJ][4], bool identity, int vw,
                                                   int k0, int g, int c) {
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      acc[j][e] = identity && vw + g + 8 * (e >> 1) == k0 + 8 * j + 2 * c + (e & 1) ? 1.f : 0.f;
}

// K split: the warp of key half kh computes the outputs of token pairs (16 tokens each) {0, 3}
// (kh = 0) or {1, 2} (kh = 1): 18 of the 36 triangular U^T Aqk^T mma each.
__device__ __forceinline__ bool owns_token_pair(int jj, int kh) {
  return ((jj == 0 || jj == 3) ? 0 : 1) == kh;
}

// U^T's accumulator tiles as tf32 A operands of the products over tokens (k-slot c <-> token 2c,
// c + 4 <-> 2c + 1 of each 8-token step).
template <int NT>
__device__ __forceinline__ void u_tf32_operands(const float (&acc)[NT][4], uint32_t (&ua)[NT][4]) {
#pragma unroll
  for (int sj = 0; sj < NT; ++sj) {
    ua[sj][0] = f32_to_tf32(acc[sj][0]);
    ua[sj][1] = f32_to_tf32(acc[sj][2]);
    ua[sj][2] = f32_to_tf32(acc[sj][1]);
    ua[sj][3] = f32_to_tf32(acc[sj][3]);
  }
}
// Accumulator tiles 2q, 2q + 1 (16 columns) as the bf16 A operands of a k16 step: registers rows
// g / g + 8 x columns 2c.. / 2c + 8...
template <int NT, int NQ>
__device__ __forceinline__ void bf16_operands(const float (&acc)[NT][4], uint32_t (&a)[NQ][4]) {
  static_assert(NT == 2 * NQ, "two accumulator tiles per k16 step");
#pragma unroll
  for (int q = 0; q < NQ; ++q)
#pragma unroll
    for (int r = 0; r < 4; ++r)
      a[q][r] =
          pack_bf16(acc[2 * q + (r >> 1)][2 * (r & 1)], acc[2 * q + (r >> 1)][2 * (r & 1) + 1]);
}
// The same in two terms hi + lo (~16 significant bits).
template <int NT, int NQ>
__device__ __forceinline__ void bf16_hi_lo_operands(const float (&acc)[NT][4],
                                                    uint32_t (&hi)[NQ][4], uint32_t (&lo)[NQ][4]) {
  static_assert(NT == 2 * NQ, "two accumulator tiles per k16 step");
#pragma unroll
  for (int q = 0; q < NQ; ++q)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float x0 = acc[2 * q + (r >> 1)][2 * (r & 1)],
                  x1 = acc[2 * q + (r >> 1)][2 * (r & 1) + 1];
      const uint32_t h = pack_bf16(x0, x1);
      hi[q][r] = h;
      lo[q][r] = pack_bf16(x0 - lo_f32<false>(h), x1 - hi_f32<false>(h));
    }
}
// S^T <- S^T diag(gL) over the thread's 16 key tiles (gL: the record's per-channel decay).
__device__ __forceinline__ void decay_state(float (&accS)[16][4], const float* gl, int lane) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const float2 d = *reinterpret_cast<const float2*>(gl + 8 * j + 2 * (lane & 3));
    accS[j][0] *= d.x;
    accS[j][1] *= d.y;
    accS[j][2] *= d.x;
    accS[j][3] *= d.y;
  }
}
// Between a wgmma chunk / step's two commit groups: waits for the first (U^T, O^T), builds U^T's
// A operands (tf32 ua; bf16 hi + lo uh, ul) and decays the state, fenced for the second group.
template <int NT, int NQ, int NO>
__device__ __forceinline__ void wgmma_between_groups(float (&accU)[NT][4], float (&accO)[NO][4],
                                                     float (&accS)[16][4], const float* gl,
                                                     int lane, uint32_t (&ua)[NT][4],
                                                     uint32_t (&uh)[NQ][4], uint32_t (&ul)[NQ][4]) {
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_acc(accU);
  wgmma_fence_acc(accO);
  u_tf32_operands(accU, ua);
  bf16_hi_lo_operands(accU, uh, ul);
  decay_state(accS, gl, lane);
  wgmma_fence_acc(accS);
  wgmma_fence_acc(ua);
  wgmma_fence_acc(uh);
  wgmma_fence_acc(ul);
  wgmma_fence();
}
// Byte offset of this lane's ldmatrix_x2 row address for the mma.sync B fragment of the Aqk / Tm
// tile at (rows t0.., tokens s0..; multiples of 8): lanes 0-7 address rows t0 + l at k-slots 0-3
// (tokens 2c), lanes 8-15 at k-slots 4-7 (tokens 2c + 1), so that lane 4g + c receives (b0, b1) =
// (slot c, slot c + 4) of row t0 + g.
__device__ __forceinline__ uint32_t rec_f32_block_offset(int t0, int s0, int lane) {
  return static_cast<uint32_t>(
      sw128_offset(kChunk, t0 + (lane & 7), 4 * (s0 + (lane & 8 ? 4 : 0))));
}
// Descriptor of a K step of the record matrix at `off` (`rows` rows) in the stage at sbase
// (1024-byte aligned): the step's first byte within the rows, kbyte (a multiple of 32).
// dlo: wgmma_desc_lo of sbase, so that each descriptor is one add to it.
__device__ __forceinline__ uint64_t rec_desc(uint32_t dlo, int off, int rows, int kbyte) {
  return wgmma_desc_at(dlo, off + (kbyte >> 7) * rows * 128 + (kbyte & 127), kDescHiSw128);
}

// One chunk of a warpgroup (4 warps = 64 value rows; vs >= 64) on wgmma: the products of the
// mma.sync path below with B read from the stage's record by descriptor (sbase: the stage's shared
// address) and A from registers, in two commit groups, each waited before the next is issued:
//   1. U^T = -S^T W^T + v^T Tm^T,  O^T = S^T qg^T     (S^T bf16 from the accumulators; v^T tf32)
//   2. O^T += U^T Aqk^T (U^T tf32),  S^T <- S^T diag(gL) + U^T kb
// The triangular products (Tm, Aqk) run over all 64 tokens (zero above the diagonal): with n =
// 64 - 8 sj per k-step, ptxas serialized every wgmma (register allocation of the sub-tiles). The
// state update takes U^T as two bf16 terms (hi + lo: ~16 significant bits, finer than tf32) against
// the bf16 kbT, which wgmma cannot pair with a tf32 A.
template <bool kFp16>
__device__ __forceinline__ void chunk_wgmma(float (&accS)[16][4], float (&accO)[8][4],
                                            const uint8_t* sb, uint32_t sbase, int rg, int lane,
                                            int vs) {
  float accU[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) accU[j][e] = 0.f;
  uint32_t sa[8][4], vr[4][4];
  bf16_operands(accS, sa);
#pragma unroll
  for (int hh = 0; hh < 4;
       ++hh) {  // v^T by ldmatrix.trans: pairs (s = 2c, 2c + 1) are k-slots c, c + 4
    const int row = 16 * hh + ((lane >> 4) << 3) + (lane & 7);
    const int chunk = 2 * rg + ((lane >> 3) & 1);
    ldmatrix_x4_trans(vr[hh], sbase + kRecordBytes + swizzle_vtile(row, chunk, vs));
  }
  uint32_t va[8][4];
#pragma unroll
  for (int hh = 0; hh < 4; ++hh)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      uint32_t* a = va[2 * hh + half];
      a[0] = __float_as_uint(lo_f32<kFp16>(vr[hh][2 * half]));
      a[1] = __float_as_uint(lo_f32<kFp16>(vr[hh][2 * half + 1]));
      a[2] = __float_as_uint(hi_f32<kFp16>(vr[hh][2 * half]));
      a[3] = __float_as_uint(hi_f32<kFp16>(vr[hh][2 * half + 1]));
    }
  const uint32_t dlo = wgmma_desc_lo(sbase);
  wgmma_fence_acc(accU);
  wgmma_fence_acc(accO);
  wgmma_fence_acc(sa);
  wgmma_fence_acc(va);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
    wgmma_bf16<8, -1>(accU, sa[ks], rec_desc(dlo, kOffW, kChunk, 32 * ks), 1);
    wgmma_bf16<8>(accO, sa[ks], rec_desc(dlo, kOffQg, kChunk, 32 * ks), 1);
  }
#pragma unroll
  for (int sj = 0; sj < 8; ++sj)  // all 64 rows of Tm (zero above the diagonal blocks)
    wgmma_tf32<8>(accU, va[sj], rec_desc(dlo, kOffTm, kChunk, 32 * sj), 1);
  // U^T as A operands: tf32 in k-slot order (slot c <-> token 2c, c + 4 <-> 2c + 1), and bf16 hi +
  // lo per 16-token step (registers: rows g / g + 8 x tokens 2c.. / 2c + 8..).
  uint32_t ua[8][4], uh[4][4], ul[4][4];
  wgmma_between_groups(accU, accO, accS, reinterpret_cast<const float*>(sb + kOffGL), lane, ua, uh,
                       ul);
#pragma unroll
  for (int sj = 0; sj < 8; ++sj)
    wgmma_tf32<8>(accO, ua[sj], rec_desc(dlo, kOffAqk, kChunk, 32 * sj), 1);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint64_t d = rec_desc(dlo, kOffKbT, kHeadDim, 32 * q);
    wgmma_bf16<16>(accS, uh[q], d, 1);
    wgmma_bf16<16>(accS, ul[q], d, 1);
  }
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_acc(accO);
  wgmma_fence_acc(accS);
}

// One 16-token step of a warpgroup on wgmma (the chunk-16 path): chunk_wgmma's
// products at n = 16 tokens on a 16-token record (common.cuh, rec16_*), in three commit groups:
//   1. U^T = -S^T W^T + v^T Tm^T (m64n16k16 x 8, m64n16k8 x 2),  O^T = S^T qg^T (m64n16k16 x 8)
//   2. O^T += U^T Aqk^T (m64n16k8 x 2), waited for before the return
//   3. S^T <- S^T diag(gL) + U^T kb (m64n128k16, U^T bf16 hi + lo), in flight at the return
//      (step16_done), so that the outputs' stores overlap it
// accO's first two n-tiles receive the 16 outputs.
// vaddr: the shared address of the step's v tile [16][vs] (swizzle_vtile); the recurrence kernel's
// follows the record in its stage.
template <bool kFp16>
__device__ __forceinline__ void step_wgmma16(float (&accS)[16][4], float (&accO)[8][4],
                                             const uint8_t* sb, uint32_t sbase, uint32_t vaddr,
                                             int rg, int lane, int vs) {
  float(&accO2)[2][4] = *reinterpret_cast<float(*)[2][4]>(&accO[0][0]);
  float accU[2][4];
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) accU[t][e] = 0.f;
  // S^T as one bf16 term, as in chunk_wgmma. Measured on the emulator (case A, vs = 128): output /
  // state 1.753e-3 / 1.736e-3 (lower bound -5), 1.762e-3 / 1.726e-3 (softplus), 2.845e-3 / 1.772e-3
  // (lower bound -0.05); with S^T as bf16 hi + lo in both products 1.751e-3 / 1.736e-3,
  // 1.756e-3 / 1.726e-3, 2.538e-3 / 1.757e-3, at +12% of the time on P4 (H200: 1.272 against 1.132
  // ms; the hi + lo conversion is ~190 instructions per thread and step).
  uint32_t sa[8][4], vr[4], va[2][4];
  bf16_operands(accS, sa);
  {  // v^T by ldmatrix.trans: pairs (s = 2c, 2c + 1) are k-slots c, c + 4
    const int row = ((lane >> 4) << 3) + (lane & 7);
    const int chunk = 2 * rg + ((lane >> 3) & 1);
    ldmatrix_x4_trans(vr, vaddr + swizzle_vtile(row, chunk, vs));
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    va[half][0] = __float_as_uint(lo_f32<kFp16>(vr[2 * half]));
    va[half][1] = __float_as_uint(lo_f32<kFp16>(vr[2 * half + 1]));
    va[half][2] = __float_as_uint(hi_f32<kFp16>(vr[2 * half]));
    va[half][3] = __float_as_uint(hi_f32<kFp16>(vr[2 * half + 1]));
  }
  const uint32_t dlo = wgmma_desc_lo(sbase);  // the stage's descriptors: dlo + offset / 16
  wgmma_fence_acc(accU);
  wgmma_fence_acc(accO2);
  wgmma_fence_acc(sa);
  wgmma_fence_acc(va);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
    wgmma_bf16<2, -1>(accU, sa[ks], rec_desc(dlo, kR16OffW, kChunk16, 32 * ks), 1);
    wgmma_bf16<2>(accO2, sa[ks], rec_desc(dlo, kR16OffQg, kChunk16, 32 * ks), 1);
  }
#pragma unroll
  for (int q = 0; q < 2; ++q)
    wgmma_tf32<2>(accU, va[q], wgmma_desc_at(dlo, kR16OffTm + 32 * q, kDescHiSw64), 1);
  // U^T as A operands: tf32 in k-slot order per 8-token step, bf16 hi + lo for the 16-token step.
  uint32_t ua[2][4], uh[1][4], ul[1][4];
  wgmma_between_groups(accU, accO2, accS, reinterpret_cast<const float*>(sb + kR16OffGL), lane, ua,
                       uh, ul);
#pragma unroll
  for (int q = 0; q < 2; ++q)
    wgmma_tf32<2>(accO2, ua[q], wgmma_desc_at(dlo, kR16OffAqk + 32 * q, kDescHiSw64), 1);
  wgmma_commit();  // group 2: the outputs, waited for here
  {
    const uint64_t d = wgmma_desc_at(dlo, kR16OffKbT, kDescHiSw32);
    wgmma_bf16<16>(accS, uh[0], d, 1);
    wgmma_bf16<16>(accS, ul[0], d, 1);
  }
  wgmma_commit();  // group 3: the state update, waited for after the outputs' stores (step16_done)
  wgmma_wait<1>();
  wgmma_fence_acc(accO2);
}
// The end of a 16-token step: its state update complete (before the stage's release and the next
// step's operands).
__device__ __forceinline__ void step16_done(float (&accS)[16][4]) {
  wgmma_wait<0>();
  wgmma_fence_acc(accS);
}

}  // namespace kda::cuda::pf
