// prepare_steps.cuh — the stages of the prepare kernel (prepare.cuh) as device functions: its
// shared-memory layout, the token loads and gate / beta conversions, the Akk / Aqk tiles, the
// varlen chunk -> sequence search, the sequence order and the L2 prefetch of the next chunk (the
// inversion of M is in inverse.cuh).
#pragma once

#include <type_traits>

#include "cuda/prefill/common.cuh"
#include "cuda/prefill/inverse.cuh"
#include "cuda/prefill/prepare_smem.cuh"

namespace kda::cuda::pf {

// Log decay in log2 units (a * log2 e) of one channel. The lower-bound form (the common one)
// takes a fast sigmoid: 1 / (1 + 2^(-x log2 e)) with an approximate reciprocal (x clamped at -80,
// where the sigmoid is below 2e-35); the other forms use the shared accurate formula. The caller
// branches on the form once for all its channels (uniform), so that their exp / reciprocal chains
// interleave: a branch per channel serialized them (seen in the SASS).
// 1 / (1 + e^-x) by ex2 and an approximate reciprocal: 0 for x -> -inf, 1 for x -> +inf.
__device__ __forceinline__ float fast_sigmoid(float x) {
  return __fdividef(1.f, 1.f + fast_exp2(-x * kLog2e));
}
// Folded per channel: y = ca g + cb = -x log2 e with ca = -exp(A_log) log2 e, cb = ca dt_bias (one
// FFMA; the clamp x >= -80 becomes y <= 80 log2 e), lb2 = lower_bound log2 e.
__device__ __forceinline__ float log2_decay_lower_bound(float g, float ca, float cb, float lb2) {
  const float y = fminf(fmaf(ca, g, cb), 80.f * kLog2e);
  return lb2 * __fdividef(1.f, 1.f + fast_exp2(y));
}
__device__ __forceinline__ float log2_decay_other(int form, float g, float exp_a, float bias,
                                                  float lower_bound) {
  return detail::log_decay<float>(form, g, exp_a, bias, lower_bound) * kLog2e;
}

// The sequence of chunk slot `slot` (varlen): the largest n with varlen_base(n) <= slot, and its
// span, in every lane of the calling warp. A 32-ary search: rounds over spans of more than 32
// sequences load one cu_seqlens value per lane; the last round (at most 32 candidates, the only
// one for N <= 32) loads each candidate's start and end together, so a short batch costs one
// dependent round trip to L2.
__device__ __forceinline__ SeqSpan find_span(const Params& p, int64_t slot, int lane) {
  int64_t lo = 0, hi = p.N;  // the answer lies in [lo, hi); slot_base(0) = 0 <= slot
  while (hi - lo > 32) {
    const int64_t span = hi - lo;
    const int64_t cand = lo + (span * lane) / 32;  // < hi; lane 0 -> lo
    const unsigned m = __ballot_sync(0xffffffffu, varlen_base(p, cand) <= slot);
    const int i = m ? 31 - __clz(static_cast<int>(m)) : 0;
    const int64_t next = __shfl_sync(0xffffffffu, cand, i < 31 ? i + 1 : 31);
    lo = __shfl_sync(0xffffffffu, cand, i);
    hi = i < 31 ? next : hi;
  }
  const int64_t cand = lo + lane;
  SeqSpan c = {};
  if (cand < hi)
    c = varlen_span(p, cand, p.cu_seqlens.load(cand),
                    p.cu_seqlens.load(cand + 1));  // cand + 1 <= N
  const unsigned m = __ballot_sync(0xffffffffu, cand < hi && c.base <= slot);
  const int i = m ? 31 - __clz(static_cast<int>(m)) : 0;
  SeqSpan s;
  s.b = 0;
  s.bos = __shfl_sync(0xffffffffu, c.bos, i);
  s.len = __shfl_sync(0xffffffffu, c.len, i);
  s.base = __shfl_sync(0xffffffffu, c.base, i);
  return s;
}

// 8 consecutive 16-bit elements (16 bytes) of a token tensor at p; kVec: the
// caller checked t.vec (a separate instantiation, so that the scalar fallback's packing is not
// predicated into the vector path, where it would wait for the load).
template <bool kVec>
__device__ __forceinline__ uint4 load8_b16(const uint16_t* p) {
  if constexpr (kVec) {
    return ld_global_16(p);
  } else {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      w[i] = static_cast<uint32_t>(p[2 * i]) | (static_cast<uint32_t>(p[2 * i + 1]) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// 8 consecutive gate inputs (q's dtype or fp32), as loaded: fp32 in w[0..7], 16-bit pairs in
// w[0..3]. The conversion (gate_to_f32) runs after every load of the chunk is issued: a
// conversion right behind its load inside the dtype branch makes the warp wait for that load
// before issuing the next (measured: the load phase ran as several serial memory round trips).
template <bool kVec>
__device__ __forceinline__ void load8_gate_raw(const uint8_t* at, bool f32, uint32_t (&w)[8]) {
  if (f32) {
    const uint32_t* p = reinterpret_cast<const uint32_t*>(at);
    if constexpr (kVec) {
      const uint4 a = ld_global_16(p), b = ld_global_16(p + 4);
      w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w, w[4] = b.x, w[5] = b.y, w[6] = b.z,
      w[7] = b.w;
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) w[i] = p[i];
    }
  } else {
    const uint4 r = load8_b16<kVec>(reinterpret_cast<const uint16_t*>(at));
    w[0] = r.x, w[1] = r.y, w[2] = r.z, w[3] = r.w, w[4] = w[5] = w[6] = w[7] = 0u;
  }
}
// b_t from the beta input (detail::activate_beta with fast_sigmoid).
__device__ __forceinline__ float beta_fast(bool logits, bool neg_eig, float x) {
  if (!logits) return x;
  const float s = fast_sigmoid(x);
  return neg_eig ? 2.f * s : s;
}
// Branch-free (selects), so that the conversions of several passes interleave.
template <bool kFp16>
__device__ __forceinline__ void gate_to_f32(bool f32, const uint32_t (&w)[8], float (&x)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t h = w[i >> 1];
    x[i] = f32 ? __uint_as_float(w[i]) : ((i & 1) ? hi_f32<kFp16>(h) : lo_f32<kFp16>(h));
  }
}

// Akk / Aqk results of row block i against column tiles [tile0, tile0 + kTiles) (accumulator
// fragments of q-hat / k-hat products) with the per-row factors applied: into M (b_t Akk, s < t)
// and the Aqk record (s <= t; zero above the diagonal).
template <int kTiles, bool kC16 = false>
__device__ __forceinline__ void akk_aqk_store(const float (&acc_k)[kTiles][4],
                                              const float (&acc_q)[kTiles][4], const float* fq,
                                              const float* fk, const float* bet, float* M,
                                              float* rec_aqk, int i, int tile0, int g, int c) {
  const int ta = 16 * i + g, tb = ta + 8;
#pragma unroll
  for (int jt = 0; jt < kTiles; ++jt) {
    const int s = 8 * (tile0 + jt) + 2 * c;
    const float fs0 = fk[s], fs1 = fk[s + 1];
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // h = 0: row ta (c0, c1); h = 1: row tb (c2, c3)
      const int t = h ? tb : ta;
      const float kt = bet[t] * fk[t], qt = fq[t];
      const float k0 = acc_k[jt][2 * h], k1 = acc_k[jt][2 * h + 1];
      const float q0 = acc_q[jt][2 * h], q1 = acc_q[jt][2 * h + 1];
      if (s < t) M[t * kMPitch + s] = kt * fs0 * k0;
      if (s + 1 < t) M[t * kMPitch + s + 1] = kt * fs1 * k1;
      // s, s + 1: k-slots c, c + 4; 16-token records (kC16): the diagonal block's own matrix
      rec_aqk[kC16 ? rec16_f32(t & 15, s & 15) : rec_f32(t, s)] =
          s <= t ? tf32_round(qt * fs0 * q0) : 0.f;
      rec_aqk[kC16 ? rec16_f32(t & 15, (s + 1) & 15) : rec_f32(t, s + 1)] =
          s + 1 <= t ? tf32_round(qt * fs1 * q1) : 0.f;
    }
  }
}

// Diagonal tiles of row block i (tf32): factored around reference token r (the block's middle),
// operands k^_t exp(G_t - G_r) and k^_s exp(G_r - G_s) (q^_t for Aqk) in fp32, rounded to tf32
// (G in log2 units). The factors reach e^+-45 here, beyond fp16, hence tf32.
template <int kTiles, bool kC16 = false>
__device__ __forceinline__ void akk_aqk_tiles(const uint16_t* qh, const uint16_t* kh,
                                              const float* G, const float* fq, const float* fk,
                                              const float* bet, float* M, float* rec_aqk, int i,
                                              int r, int tile0, int g, int c) {
  float acc_k[kTiles][4], acc_q[kTiles][4];
#pragma unroll
  for (int jt = 0; jt < kTiles; ++jt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_k[jt][e] = acc_q[jt][e] = 0.f;
  const int ta = 16 * i + g, tb = ta + 8;
  // Paired k mapping: k-slot c <-> channel 8ks + 2c, k-slot c+4 <-> 8ks + 2c + 1 (one 32-bit load
  // of two f16 values, one float2 of G per row).
  auto lo = [](uint32_t x) { return lo_f32<true>(x); };
  auto hi = [](uint32_t x) { return hi_f32<true>(x); };
#pragma unroll 4
  for (int ks = 0; ks < 16; ++ks) {
    const int ch = 8 * ks + 2 * c;
    const float2 gr = *reinterpret_cast<const float2*>(G + r * kGPitch + ch);
    const float2 gta = *reinterpret_cast<const float2*>(G + ta * kGPitch + ch);
    const float2 gtb = *reinterpret_cast<const float2*>(G + tb * kGPitch + ch);
    const float ea0 = fast_exp2(gta.x - gr.x), eb0 = fast_exp2(gtb.x - gr.x);
    const float ea1 = fast_exp2(gta.y - gr.y), eb1 = fast_exp2(gtb.y - gr.y);
    const uint32_t ka = *reinterpret_cast<const uint32_t*>(kh + ta * kQkPitch + ch);
    const uint32_t kb = *reinterpret_cast<const uint32_t*>(kh + tb * kQkPitch + ch);
    const uint32_t qa = *reinterpret_cast<const uint32_t*>(qh + ta * kQkPitch + ch);
    const uint32_t qb = *reinterpret_cast<const uint32_t*>(qh + tb * kQkPitch + ch);
    const uint32_t ak[4] = {f32_to_tf32(lo(ka) * ea0), f32_to_tf32(lo(kb) * eb0),
                            f32_to_tf32(hi(ka) * ea1), f32_to_tf32(hi(kb) * eb1)};
    const uint32_t aq[4] = {f32_to_tf32(lo(qa) * ea0), f32_to_tf32(lo(qb) * eb0),
                            f32_to_tf32(hi(qa) * ea1), f32_to_tf32(hi(qb) * eb1)};
#pragma unroll
    for (int jt = 0; jt < kTiles; ++jt) {
      const int s = 8 * (tile0 + jt) + g;
      const float2 gs = *reinterpret_cast<const float2*>(G + s * kGPitch + ch);
      const uint32_t ks2 = *reinterpret_cast<const uint32_t*>(kh + s * kQkPitch + ch);
      const uint32_t b0 = f32_to_tf32(lo(ks2) * fast_exp2(gr.x - gs.x));
      const uint32_t b1 = f32_to_tf32(hi(ks2) * fast_exp2(gr.y - gs.y));
      mma_tf32(acc_k[jt], ak, b0, b1);
      mma_tf32(acc_q[jt], aq, b0, b1);
    }
  }
  akk_aqk_store<kTiles, kC16>(acc_k, acc_q, fq, fk, bet, M, rec_aqk, i, tile0, g, c);
}

// Off-diagonal tiles of row block i (fp16, m16n8k16): reference token r = 16 i, the block's first,
// so that every column s < r and both factors exp(G_t - G_r), exp(G_r - G_s) are <= 1: operands
// k^ (|k^| <= 1, f16 in shared memory) times the factor rounded to f16, one HMUL2 per pair. An
// f16 operand carries 11 significant bits like tf32; the exponent range ends at 2^-24, where a
// factor's absolute error (<= 2^-25, products bounded by 1) is far below the tf32 rounding of the
// large entries. Natural k mapping: k-index j of step ks <-> channel 16 ks + j.
template <int kTiles>
__device__ __forceinline__ void akk_aqk_tiles_f16(const uint16_t* qh, const uint16_t* kh,
                                                  const float* G, const float* fq, const float* fk,
                                                  const float* bet, float* M, float* rec_aqk, int i,
                                                  int tile0, int g, int c) {
  float acc_k[kTiles][4], acc_q[kTiles][4];
#pragma unroll
  for (int jt = 0; jt < kTiles; ++jt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_k[jt][e] = acc_q[jt][e] = 0.f;
  const int r = 16 * i, ta = r + g, tb = ta + 8;
  auto ld2 = [](const uint16_t* p) { return *reinterpret_cast<const uint32_t*>(p); };
  auto gld = [&](int t, int ch) { return *reinterpret_cast<const float2*>(G + t * kGPitch + ch); };
#pragma unroll 2
  for (int ks = 0; ks < 8; ++ks) {
    uint32_t ak[4], aq[4];
    float2 gr[2];
#pragma unroll
    for (int hh = 0; hh < 2;
         ++hh) {  // registers a0, a1 (hh = 0: k 2c, 2c + 1) and a2, a3 (hh = 1: + 8)
      const int ch = 16 * ks + 8 * hh + 2 * c;
      gr[hh] = gld(r, ch);
      const float2 gta = gld(ta, ch), gtb = gld(tb, ch);
      const uint32_t ea = pack_f16(fast_exp2(gta.x - gr[hh].x), fast_exp2(gta.y - gr[hh].y));
      const uint32_t eb = pack_f16(fast_exp2(gtb.x - gr[hh].x), fast_exp2(gtb.y - gr[hh].y));
      ak[2 * hh] = mul_f16x2(ld2(kh + ta * kQkPitch + ch), ea);
      ak[2 * hh + 1] = mul_f16x2(ld2(kh + tb * kQkPitch + ch), eb);
      aq[2 * hh] = mul_f16x2(ld2(qh + ta * kQkPitch + ch), ea);
      aq[2 * hh + 1] = mul_f16x2(ld2(qh + tb * kQkPitch + ch), eb);
    }
#pragma unroll
    for (int jt = 0; jt < kTiles; ++jt) {
      const int s = 8 * (tile0 + jt) + g;
      uint32_t b[2];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {  // b0: k 2c, 2c + 1; b1: + 8
        const int ch = 16 * ks + 8 * hh + 2 * c;
        const float2 gs = gld(s, ch);
        b[hh] = mul_f16x2(ld2(kh + s * kQkPitch + ch),
                          pack_f16(fast_exp2(gr[hh].x - gs.x), fast_exp2(gr[hh].y - gs.y)));
      }
      mma_f16(acc_k[jt], ak, b[0], b[1]);
      mma_f16(acc_q[jt], aq, b[0], b[1]);
    }
  }
  akk_aqk_store<kTiles>(acc_k, acc_q, fq, fk, bet, M, rec_aqk, i, tile0, g, c);
}

// Diagonal block i by pairwise differences (any decay): lanes = 16 columns s x 2 channel halves.
template <bool kC16 = false>
__device__ __forceinline__ void akk_aqk_diag_pairwise(const uint16_t* qh, const uint16_t* kh,
                                                      const float* G, const float* fq,
                                                      const float* fk, const float* bet, float* M,
                                                      float* rec_aqk, int i, int lane) {
  const int sl = lane & 15, hc = lane >> 4, s = 16 * i + sl;
  for (int tl = 0; tl < 16; ++tl) {
    const int t = 16 * i + tl;
    float sk = 0.f, sq = 0.f;
    if (sl <= tl) {
      for (int m = 0; m < 64; ++m) {
        const int cc = 64 * hc + ((m + (sl >> 3) + 2 * hc) & 63);  // rotated: fewer bank conflicts
        const float e =
            fast_exp2(G[t * kGPitch + cc] - G[s * kGPitch + cc]);  // t >= s: argument <= 0
        const float ks = in_to_f32<true>(kh[s * kQkPitch + cc]) * e;
        sk = fmaf(in_to_f32<true>(kh[t * kQkPitch + cc]), ks, sk);
        sq = fmaf(in_to_f32<true>(qh[t * kQkPitch + cc]), ks, sq);
      }
    }
    sk += __shfl_xor_sync(0xffffffffu, sk, 16);
    sq += __shfl_xor_sync(0xffffffffu, sq, 16);
    if (hc == 0) {
      if (sl < tl) M[t * kMPitch + s] = bet[t] * fk[t] * fk[s] * sk;
      rec_aqk[kC16 ? rec16_f32(tl, sl) : rec_f32(t, s)] =
          sl <= tl ? tf32_round(fq[t] * fk[s] * sq) : 0.f;
    }
  }
}

// Dense chunk slot -> (sequence n, chunk j) by a 32-bit division; false (n, j unset) where the
// values do not fit 32 bits.
__device__ __forceinline__ bool dense_slot32(const Params& p, int64_t slot, int64_t& n,
                                             int64_t& j) {
  if (slot > INT32_MAX || p.chunks_per_seq > INT32_MAX) return false;
  const uint32_t s32 = static_cast<uint32_t>(slot), c32 = static_cast<uint32_t>(p.chunks_per_seq);
  n = s32 / c32;
  j = s32 - static_cast<uint32_t>(n) * c32;
  return true;
}
// The same for any slot: the 64-bit division (a ~100-instruction call) only where 32 bits do not
// suffice.
__device__ __forceinline__ void dense_slot(const Params& p, int64_t slot, int64_t& n, int64_t& j) {
  if (!dense_slot32(p, slot, n, j)) {
    n = slot / p.chunks_per_seq;
    j = slot % p.chunks_per_seq;
  }
}

// Opt-in (heuristics/prefill.h: measured slower at the natural distance) L2 prefetch (a hint) of
// the q, k, g rows of the chunk that prepare block `block` + p.prefetch_blocks will load; threads
// 0..191: one 256- or 512-byte row each. Dense: that block's rows exactly; varlen: this block's
// sequence continued (exact while it lasts, a harmless guess past its end). Only for 16-byte
// aligned rows.
__device__ __forceinline__ void prefetch_next_chunk(const Params& p, unsigned block, int64_t slot,
                                                    int64_t t0, int tid) {
  if (p.prefetch_blocks <= 0 || tid >= 3 * kChunk || !(p.q.vec && p.k.vec && p.g.vec)) return;
  const uint32_t nb = block + static_cast<uint32_t>(p.prefetch_blocks);
  if (nb >= p.num_slots * p.HV) return;  // the prepare blocks: chunk slots x value heads
  const int hv2 = static_cast<int>(nb % static_cast<unsigned>(p.HV));
  const int64_t slot2 = nb / static_cast<unsigned>(p.HV);
  int64_t b2 = 0, t2;
  if (!p.varlen) {
    // The 32-bit division only (a hint: beyond that range, no prefetch). A second call site of
    // dense_slot's 64-bit division makes it a subroutine, and in the single-launch kernel that
    // kept the recurrence phase's descriptor arithmetic off the uniform datapath.
    int64_t j2;
    if (!dense_slot32(p, slot2, b2, j2)) return;
    t2 = j2 * kChunk;
  } else {
    t2 = t0 + (slot2 - slot) * kChunk;
  }
  const int which = tid / kChunk;  // 0: q, 1: k, 2: g
  const int64_t tok = t2 + (tid % kChunk);
  if (tok >= p.T) return;
  const StridedView& tv = which == 0 ? p.q : (which == 1 ? p.k : p.g);
  const int esize = tv.dtype == kF32 ? 4 : 2;
  const int64_t off = tv.offset(b2, tok, which == 2 ? hv2 : hv2 / p.groups);
  bulk_prefetch_l2(static_cast<const uint8_t*>(tv.data) + off * esize,
                   static_cast<uint32_t>(kHeadDim * esize));
}

// Varlen batches (p.order set): the recurrence's sequence order, longest first, by a counting sort
// of the chunk counts (capped at 1023: longer sequences tie) in one block. Ties land in any order:
// every (sequence, value head) is computed by one recurrence block whatever its index, so results
// do not depend on it. cnt: 1024 + 8 ints of shared scratch. Ends with a barrier.
__device__ __forceinline__ void order_sequences(const Params& p, int* cnt, int tid) {
  constexpr int kKeys = 1024;
  static_assert(kKeys == 4 * kPrepareThreads, "four keys per thread");
  auto key = [&](int64_t n) {  // more chunks -> smaller key
    const int64_t ch = (seq_span(p, n).len + kChunk - 1) / kChunk;
    return kKeys - 1 - static_cast<int>(ch < kKeys - 1 ? ch : kKeys - 1);
  };
  for (int i = tid; i < kKeys; i += kPrepareThreads) cnt[i] = 0;
  __syncthreads();
  for (int64_t n = tid; n < p.N; n += kPrepareThreads) atomicAdd(&cnt[key(n)], 1);
  __syncthreads();
  // Exclusive prefix sums of the counts: four keys per thread, a warp scan, the warp totals.
  int* wsum = cnt + kKeys;
  const int lane = tid & 31, warp = tid >> 5;
  int v[4], local = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) local += (v[j] = cnt[4 * tid + j]);
  int incl = local;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int x = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += x;
  }
  if (lane == 31) wsum[warp] = incl;
  __syncthreads();
  int base = incl - local;
  for (int w = 0; w < warp; ++w) base += wsum[w];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    cnt[4 * tid + j] = base;
    base += v[j];
  }
  __syncthreads();
  for (int64_t n = tid; n < p.N; n += kPrepareThreads)
    p.order[atomicAdd(&cnt[key(n)], 1)] = static_cast<int32_t>(n);
  __syncthreads();
}

}  // namespace kda::cuda::pf
