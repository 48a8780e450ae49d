// prepare.cuh — kernel A of the CUDA prefill: everything of a 64-token chunk that does not depend
// on the state, for one (chunk slot, value head), written to the workspace record (common.cuh).
//
// Mirrors src/cpu/prefill_chunked.cpp (same chunk, same 16-token sub-chunks, same exactness rules):
//   q, k  <- l2norm (scale applied with q's row factor);  a = log decay (gate form);  G = cumsum_t
//   a Akk[t,s] = sum_k k_t k_s exp(G_t - G_s)  (s < t),  Aqk[t,s] = same with q_t (s <= t) Tm = (I
//   + diag(b) Akk)^-1 diag(b)   (block inversion of the unit lower triangle M: diagonal
//        16x16 blocks by forward substitution, the others from them by 3xTF32 products, invert_m)
//   W = Tm (exp(G) k),  qg = exp(G) q,  kbT = (exp(G_L - G) k)^T,  gL = exp(G_L)
// Exact for unbounded decays: every exp() below has an argument <= 0 except the diagonal 16x16
// blocks, which factor exp(G_t - G_s) = exp(G_t - G_m) exp(G_m - G_s) around the block's middle
// token m only when both factors stay within e^+-45 (always for the lower-bound gate, |a| <= 5);
// other blocks take pairwise differences exp(G_t - G_s) (t >= s, argument <= 0).
//
// q and k are normalized to |x| <= 1 on load (by their L2 norm, or without l2norm by their largest
// magnitude; the row factors fq, fk multiply the results) and kept as f16. Products use mma.sync
// with fp32 accumulation: the off-diagonal Akk / Aqk blocks fp16 (m16n8k16; operands q^, k^ times
// factors <= 1, 11 significant bits like tf32), the diagonal blocks and W tf32 (m16n8k8; fp32
// operands rounded to tf32: their factors exceed the f16 range); Tm and Aqk leave this kernel
// tf32-rounded so kernel B sees exactly the matrices used here. The inverse alone splits its
// operands in two tf32 terms (3xTF32) and stays ~fp32 accurate, so that Tm carries one tf32
// rounding and not the errors of chained tf32 products.
// 256 threads, ~108 KB shared memory: two blocks per SM.
#pragma once

#include "cuda/prefill/common.cuh"
#include "cuda/prefill/prepare_steps.cuh"

namespace kda::cuda::pf {

// kC16: four 16-token records per block instead of one 64-token record (the chunk-16 path:
// common.cuh). The cumulative sum restarts every 16 tokens, only the diagonal 16 x 16
// blocks of Akk / Aqk and of the inverse are computed, W uses the diagonal blocks of Tm, and kbT /
// gL decay to each sub-chunk's last token.
// One block's work: chunk slot block / HV, value head block % HV (prepare_kernel's block, or a
// block of the single-launch kernel, single.cuh). kPrepareThreads threads.
template <bool kFp16, bool kC16>
__device__ __forceinline__ void prepare_block(const Params& p, unsigned block) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint16_t* qr = reinterpret_cast<uint16_t*>(smem + kSmQr);
  uint16_t* kr = reinterpret_cast<uint16_t*>(smem + kSmKr);
  float* G = reinterpret_cast<float*>(smem + kSmG);
  float* fq = reinterpret_cast<float*>(smem + kSmFq);
  float* fk = reinterpret_cast<float*>(smem + kSmFk);
  float* bet = reinterpret_cast<float*>(smem + kSmBeta);
  float* M = reinterpret_cast<float*>(smem + kSmM);
  float* X = reinterpret_cast<float*>(smem + kSmX);
  float* P = reinterpret_cast<float*>(smem + kSmP);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c = lane & 3;
  const int hv = static_cast<int>(block % static_cast<unsigned>(p.HV));
  const int64_t slot = block / static_cast<unsigned>(p.HV);
  if (p.order != nullptr && block == 0)
    order_sequences(p, reinterpret_cast<int*>(M), tid);  // M: unused yet

  // ---- Locate the chunk: slot -> (sequence n, chunk j) -> tokens [t0, t0 + L) of batch row b.
  int64_t b, t0;
  int L;
  if (!p.varlen) {
    int64_t n, j;
    dense_slot(p, slot, n, j);
    b = n;
    t0 = j * kChunk;
    L = static_cast<int>(clamp64(p.T - t0, 0, kChunk));
  } else {  // every warp locates the chunk itself: no block barrier behind one warp's loads
    const SeqSpan sp = find_span(p, slot, lane);
    const int64_t j = slot - sp.base;
    b = 0;
    t0 = sp.bos + j * kChunk;
    L = (j < 0 || j * kChunk >= sp.len) ? 0
                                        : static_cast<int>(clamp64(sp.len - j * kChunk, 0, kChunk));
  }
  if (L <= 0) return;  // an unused slot of a varlen batch
  prefetch_next_chunk(p, block, slot, t0, tid);
  uint8_t* rec = p.ws + (slot * p.HV + hv) * static_cast<int64_t>(kRecordBytes);
  float* rec_aqk = reinterpret_cast<float*>(rec + kOffAqk);

  // ---- Load q, k (raw), gate -> log decay a, beta. Thread: rows rr + 16 pass, channels
  // 8ch..8ch+7. Every load is issued (raw bits, no conversion) before the first use.
  {
    const int h = hv / p.groups;
    const int ch = tid & 15, rr = tid >> 4;
    const float a_log = p.A_log ? p.A_log[hv * p.A_log_s] : 0.f;
    float bias[8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
      bias[i] = p.dt_bias ? p.dt_bias[hv * p.dt_bias_s + 8 * ch + i] : 0.f;
    uint4 qv[4], kv[4];
    uint32_t gw[4][8], bw[4];
    // Row pointers of token t0 + rr, advanced by 16 tokens per pass (the 64-bit offset products
    // once per tensor, not once per pass and tensor).
    const bool g32 = p.g.dtype == kF32, b32 = p.beta.dtype == kF32;
    const uint16_t* qp =
        static_cast<const uint16_t*>(p.q.data) + p.q.offset(b, t0 + rr, h) + 8 * ch;
    const uint16_t* kp =
        static_cast<const uint16_t*>(p.k.data) + p.k.offset(b, t0 + rr, h) + 8 * ch;
    const uint8_t* gp = static_cast<const uint8_t*>(p.g.data) +
                        (p.g.offset(b, t0 + rr, hv) + 8 * ch) * (g32 ? 4 : 2);
    const uint8_t* bp =
        static_cast<const uint8_t*>(p.beta.data) + p.beta.offset(b, t0 + rr, hv) * (b32 ? 4 : 2);
    const int64_t qstep = 16 * p.q.s1, kstep = 16 * p.k.s1, gstep = 16 * p.g.s1 * (g32 ? 4 : 2),
                  bstep = 16 * p.beta.s1 * (b32 ? 4 : 2);
    auto issue_loads = [&](auto vec) {
      constexpr bool kVec = decltype(vec)::value;
#pragma unroll
      for (int pass = 0; pass < 4; ++pass) {
        const int row = 16 * pass + rr;
        bw[pass] = 0u;
        if (row < L) {
          qv[pass] = load8_b16<kVec>(qp + pass * qstep);
          kv[pass] = load8_b16<kVec>(kp + pass * kstep);
          load8_gate_raw<kVec>(gp + pass * gstep, g32, gw[pass]);
          if (ch == 0) bw[pass] = load_bits_any(bp + pass * bstep, p.beta.dtype, 0);
        } else {
          qv[pass] = kv[pass] = make_uint4(0, 0, 0, 0);
#pragma unroll
          for (int i = 0; i < 8; ++i) gw[pass][i] = 0u;
        }
      }
    };
    if (p.q.vec && p.k.vec && p.g.vec)
      issue_loads(std::true_type{});
    else
      issue_loads(std::false_type{});
    const float exp_a = p.A_log ? expf(a_log) : 1.f;
    // Row statistics of q and k (four independent passes): the squared norm (l2norm) or the
    // largest magnitude, then their half-warp reductions (the 16 threads of a row are one
    // half-warp).
    float sq[4], sk[4];
    auto row_stats = [&](auto l2) {
      constexpr bool kL2 = decltype(l2)::value;
#pragma unroll
      for (int pass = 0; pass < 4; ++pass) {
        const uint32_t wq[4] = {qv[pass].x, qv[pass].y, qv[pass].z, qv[pass].w};
        const uint32_t wk[4] = {kv[pass].x, kv[pass].y, kv[pass].z, kv[pass].w};
        sq[pass] = sk[pass] = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float q0 = lo_f32<kFp16>(wq[i]), q1 = hi_f32<kFp16>(wq[i]);
          const float k0 = lo_f32<kFp16>(wk[i]), k1 = hi_f32<kFp16>(wk[i]);
          if constexpr (kL2) {
            sq[pass] = fmaf(q0, q0, fmaf(q1, q1, sq[pass]));
            sk[pass] = fmaf(k0, k0, fmaf(k1, k1, sk[pass]));
          } else {
            sq[pass] = fmaxf(sq[pass], fmaxf(fabsf(q0), fabsf(q1)));
            sk[pass] = fmaxf(sk[pass], fmaxf(fabsf(k0), fabsf(k1)));
          }
        }
      }
#pragma unroll
      for (int o = 8; o >= 1; o >>= 1)
#pragma unroll
        for (int pass = 0; pass < 4; ++pass) {
          const float oq = __shfl_xor_sync(0xffffffffu, sq[pass], o),
                      ok = __shfl_xor_sync(0xffffffffu, sk[pass], o);
          sq[pass] = kL2 ? sq[pass] + oq : fmaxf(sq[pass], oq);
          sk[pass] = kL2 ? sk[pass] + ok : fmaxf(sk[pass], ok);
        }
    };
    if (p.use_qk_l2norm)
      row_stats(std::true_type{});
    else
      row_stats(std::false_type{});
    // q^ = q / ||q||, k^ = k / ||k|| (l2norm; factors fq = scale, fk = 1) or q / max|q|, k / max|k|
    // (factors scale max|q|, max|k|), as f16 in shared memory: |q^|, |k^| <= 1 whatever the input
    // range, so that the fp16 products of the Akk / Aqk phase cannot overflow. The division of the
    // second form is exact for any magnitude (a reciprocal of a tiny maximum would overflow).
    float fqr[4], fkr[4];
    const float eps = static_cast<float>(detail::kL2NormEps);
#pragma unroll
    for (int pass = 0; pass < 4; ++pass) {
      const int row = 16 * pass + rr;
      const uint32_t wq[4] = {qv[pass].x, qv[pass].y, qv[pass].z, qv[pass].w};
      const uint32_t wk[4] = {kv[pass].x, kv[pass].y, kv[pass].z, kv[pass].w};
      uint32_t oq[4], ok[4];
      if (p.use_qk_l2norm) {
        const float rq = rsqrtf(sq[pass] + eps), rk = rsqrtf(sk[pass] + eps);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          oq[i] = pack_f16(lo_f32<kFp16>(wq[i]) * rq, hi_f32<kFp16>(wq[i]) * rq);
          ok[i] = pack_f16(lo_f32<kFp16>(wk[i]) * rk, hi_f32<kFp16>(wk[i]) * rk);
        }
        fqr[pass] = p.scale;
        fkr[pass] = 1.f;
      } else {
        const float mq = sq[pass] > 0.f ? sq[pass] : 1.f, mk = sk[pass] > 0.f ? sk[pass] : 1.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          oq[i] =
              pack_f16(__fdiv_rn(lo_f32<kFp16>(wq[i]), mq), __fdiv_rn(hi_f32<kFp16>(wq[i]), mq));
          ok[i] =
              pack_f16(__fdiv_rn(lo_f32<kFp16>(wk[i]), mk), __fdiv_rn(hi_f32<kFp16>(wk[i]), mk));
        }
        fqr[pass] = p.scale * mq;
        fkr[pass] = mk;
      }
      *reinterpret_cast<uint4*>(qr + row * kQkPitch + 8 * ch) =
          make_uint4(oq[0], oq[1], oq[2], oq[3]);
      *reinterpret_cast<uint4*>(kr + row * kQkPitch + 8 * ch) =
          make_uint4(ok[0], ok[1], ok[2], ok[3]);
    }
    // Log decays of this thread's 32 gate inputs: one uniform branch on the gate form around all
    // of them; padded rows (row >= L) get a = 0.
    float a[4][8];
#pragma unroll
    for (int pass = 0; pass < 4; ++pass) gate_to_f32<kFp16>(p.g.dtype == kF32, gw[pass], a[pass]);
    if (p.gate == detail::kGateLowerBound) {
      const float ca = -exp_a * kLog2e, lb2 = p.lower_bound * kLog2e;
      float cb[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) cb[i] = ca * bias[i];
#pragma unroll
      for (int pass = 0; pass < 4; ++pass)
#pragma unroll
        for (int i = 0; i < 8; ++i) a[pass][i] = log2_decay_lower_bound(a[pass][i], ca, cb[i], lb2);
    } else {
#pragma unroll
      for (int pass = 0; pass < 4; ++pass)
#pragma unroll
        for (int i = 0; i < 8; ++i)
          a[pass][i] = log2_decay_other(p.gate, a[pass][i], exp_a, bias[i], p.lower_bound);
    }
    // Per-row values, computed by every thread (branch-free, so that the four passes interleave)
    // and stored by the lanes ch == 0: b_t by a fast sigmoid (relative error ~1e-7, far below the
    // tf32 rounding of every operand it scales).
#pragma unroll
    for (int pass = 0; pass < 4; ++pass) {
      const int row = 16 * pass + rr;
      const bool valid = row < L;
      float* gr = G + row * kGPitch + 8 * ch;
      *reinterpret_cast<float4*>(gr) =
          valid ? make_float4(a[pass][0], a[pass][1], a[pass][2], a[pass][3])
                : make_float4(0.f, 0.f, 0.f, 0.f);
      *reinterpret_cast<float4*>(gr + 4) =
          valid ? make_float4(a[pass][4], a[pass][5], a[pass][6], a[pass][7])
                : make_float4(0.f, 0.f, 0.f, 0.f);
      const float bt =
          valid ? beta_fast(p.beta_logits, p.allow_neg_eigval, bits_to_f32(bw[pass], p.beta.dtype))
                : 0.f;
      if (ch == 0) {
        fq[row] = fqr[pass];
        fk[row] = fkr[pass];
        bet[row] = bt;
      }
    }
  }
  __syncthreads();

  // ---- G = cumulative log decay over the chunk (padded tokens have a = 0: G_t = G_{L-1}).
  {
    const int cc = tid & 127, half = tid >> 7;
    float x[32];  // 32 independent loads, then the scan in registers
#pragma unroll
    for (int r = 0; r < 32; ++r) x[r] = G[(32 * half + r) * kGPitch + cc];
#pragma unroll
    for (int r = 1; r < 32; ++r) x[r] += (kC16 && r == 16) ? 0.f : x[r - 1];  // kC16: restart at 16
#pragma unroll
    for (int r = 0; r < 32; ++r) G[(32 * half + r) * kGPitch + cc] = x[r];
    __syncthreads();
    if (!kC16 && half == 1) {
      const float base = G[31 * kGPitch + cc];
#pragma unroll
      for (int r = 0; r < 32; ++r) G[(32 + r) * kGPitch + cc] = x[r] + base;
    }
  }
  __syncthreads();

  // ---- Akk (into M = b_t Akk), Aqk (into the record). Warps 0-3: diagonal block i = warp around
  // its middle token (or pairwise); warps 4-7: off-diagonal tiles of row blocks 3, 3, 2, 1 with
  // reference = the row block's first token.
  if (warp < 4) {
    const int i = warp, m = 16 * i + 8;
    float span = 0.f;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int cc = lane + 32 * q;
      span = fmaxf(span, fmaxf(G[(16 * i) * kGPitch + cc] - G[m * kGPitch + cc],
                               G[m * kGPitch + cc] - G[(16 * i + 15) * kGPitch + cc]));
    }
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) span = fmaxf(span, __shfl_xor_sync(0xffffffffu, span, o));
    float* aqk = kC16 ? reinterpret_cast<float*>(rec + i * kRecord16Bytes + kR16OffAqk) : rec_aqk;
    if (span <=
        45.f * kLog2e) {  // both factors within e^+-45: fp32 and tf32 hold them and their product
      akk_aqk_tiles<2, kC16>(qr, kr, G, fq, fk, bet, M, aqk, i, m, 2 * i, g, c);
    } else {
      akk_aqk_diag_pairwise<kC16>(qr, kr, G, fq, fk, bet, M, aqk, i, lane);
    }
  } else if constexpr (!kC16) {
    // (row block, first tile, tiles): 3: [0,3) and [3,6); 2: [0,4); 1: [0,2). The tile count is a
    // template argument (warp-uniform branch here): a runtime count put every tile behind its own
    // branch in the k loop, which kept the tiles' operand chains from interleaving.
    const int w = warp - 4;
    if (w < 2)
      akk_aqk_tiles_f16<3>(qr, kr, G, fq, fk, bet, M, rec_aqk, 3, 3 * w, g, c);
    else if (w == 2)
      akk_aqk_tiles_f16<4>(qr, kr, G, fq, fk, bet, M, rec_aqk, 2, 0, g, c);
    else
      akk_aqk_tiles_f16<2>(qr, kr, G, fq, fk, bet, M, rec_aqk, 1, 0, g, c);
  }
  __syncthreads();

  // ---- X = M^-1.
  invert_m<kC16>(M, X, P, warp, lane);

  // ---- Tm = X diag(b), tf32-rounded, zero above the diagonal blocks: into the record (positions
  // 0-3 of the record's k-slot order hold the even tokens of 8, 4-7 the odd) and, as W's tf32 A
  // fragments, into M's place (dead since the inverse): fragment (row block mi, k-step sk) is
  // 32 lanes x float4 {Tm[ta][s0], Tm[ta+8][s0], Tm[ta][s0+1], Tm[ta+8][s0+1]} (ta = 16 mi + g,
  // s0 = 8 sk + 2c: the paired k mapping), one conflict-free 16-byte load per lane in the W pass.
  // A task is rows ta, ta + 8 x columns 8 sk .. 8 sk + 7 (the four fragments of lanes 4g..4g+3).
  float* tfrag = reinterpret_cast<float*>(smem + kSmM);
  static_assert(kChunk / 16 * (kChunk / 8) * 32 * 16 <= kChunk * kMPitch * 4,
                "Tm fragments fit in M's place");
  {
    float* rec_tm = reinterpret_cast<float*>(rec + kOffTm);
    // kC16: the diagonal blocks only (threads 0..63: column steps 2 mi, 2 mi + 1 of row block mi).
    const int gg = tid & 7, sk = kC16 ? 2 * ((tid >> 4) & 3) + ((tid >> 3) & 1) : (tid >> 3) & 7;
    const int mi = kC16 ? (tid >> 4) & 3 : tid >> 6, ta = 16 * mi + gg, col = 8 * sk;
    float v[2][8];
    if (kC16 ? tid < 64 : sk <= 2 * mi + 1) {  // columns within the diagonal block or left of it
      // The two 16-byte halves of a row in lane-dependent order (gg >= 4: second half first), so
      // that the 8 lanes of a quarter warp (rows ta..ta+7 of pitch 72) cover all 32 banks.
      const int h = (gg >> 2) & 1;
      const float4 b0 = *reinterpret_cast<const float4*>(bet + col),
                   b1 = *reinterpret_cast<const float4*>(bet + col + 4);
      const float bb[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float* xr = X + (ta + 8 * r) * kMPitch + col;
        const float4 xa = *reinterpret_cast<const float4*>(xr + 4 * h),
                     xb = *reinterpret_cast<const float4*>(xr + 4 - 4 * h);
        const float4 lo = h ? xb : xa, hi = h ? xa : xb;
        const float x[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) v[r][e] = tf32_round(x[e] * bb[e]);
      }
      // Fragment c of lane 4 gg + c at slot 4 gg + tfrag_slot(gg, c) (rotated by gg / 2, so that a
      // quarter warp's stores cover all 32 banks; the W pass reads the same slot).
      float4* fr = reinterpret_cast<float4*>(tfrag) + (mi * 8 + sk) * 32 + 4 * gg;
#pragma unroll
      for (int c4 = 0; c4 < 4; ++c4)
        fr[tfrag_slot(gg, c4)] =
            make_float4(v[0][2 * c4], v[1][2 * c4], v[0][2 * c4 + 1], v[1][2 * c4 + 1]);
    } else {
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int e = 0; e < 8; ++e) v[r][e] = 0.f;
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = ta + 8 * r;
      if constexpr (kC16) {
        if (tid < 64) {
          float* tm16 = reinterpret_cast<float*>(rec + mi * kRecord16Bytes + kR16OffTm);
          *reinterpret_cast<float4*>(tm16 + rec16_f32(row & 15, col & 15)) =
              make_float4(v[r][0], v[r][2], v[r][4], v[r][6]);
          *reinterpret_cast<float4*>(tm16 + rec16_f32(row & 15, (col & 15) + 1)) =
              make_float4(v[r][1], v[r][3], v[r][5], v[r][7]);
        }
      } else if (!rec_in_hole(row, col)) {  // the 8 positions share the hole test (col % 8 == 0)
        *reinterpret_cast<float4*>(rec_tm + rec_f32(row, col)) =
            make_float4(v[r][0], v[r][2], v[r][4], v[r][6]);
        *reinterpret_cast<float4*>(rec_tm + rec_f32(row, col + 1)) =
            make_float4(v[r][1], v[r][3], v[r][5], v[r][7]);
      }
    }
    // Aqk's 16 x 16 blocks above the diagonal (row block i, column block jb > i: never computed)
    // are zero: the recurrence reads all 64 columns. Blocks (0, 1) and (2, 3) here; the other four
    // (rows 0..31, columns 32..63) are the record's zero part, not stored (common.cuh).
    if (!kC16 && tid < 2 * 64) {
      const int i = tid < 64 ? 0 : 2, jb = i + 1;
      const int row = 16 * i + ((tid >> 2) & 15),
                col = 16 * jb + 4 * (tid & 3);  // 4 consecutive positions
      *reinterpret_cast<float4*>(rec_aqk + (sw128_offset(kChunk, row, 4 * col) >> 2)) =
          make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  // ---- qg = exp(G) q (bf16, into the record) and kg = exp(G) k^ (f16, W's operand, into q^'s
  // place: each thread overwrites the q^ values it has just read), one exponential per element for
  // both. kg <= 1 in magnitude; an f16 carries 11 significant bits like the tf32 operand W used to
  // build from k^ and G, and below 2^-14 its absolute error (<= 2^-25) is far under W's bf16
  // rounding.
  uint16_t* kg = qr;
  {
    uint16_t* rec_qg = reinterpret_cast<uint16_t*>(rec + kOffQg);
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int task = tid + kPrepareThreads * m, t = task >> 4, col = (task & 15) * 8;
      const uint4 rq = *reinterpret_cast<const uint4*>(qr + t * kQkPitch + col);
      const uint4 rk = *reinterpret_cast<const uint4*>(kr + t * kQkPitch + col);
      const float4 ga = *reinterpret_cast<const float4*>(G + t * kGPitch + col);
      const float4 gb = *reinterpret_cast<const float4*>(G + t * kGPitch + col + 4);
      const float iq = fq[t];
      const float gg[8] = {ga.x, ga.y, ga.z, ga.w, gb.x, gb.y, gb.z, gb.w};
      const uint32_t wq[4] = {rq.x, rq.y, rq.z, rq.w}, wk[4] = {rk.x, rk.y, rk.z, rk.w};
      uint32_t oq[4], ok[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float e0 = fast_exp2(gg[2 * e]), e1 = fast_exp2(gg[2 * e + 1]);
        oq[e] = pack_bf16(lo_f32<true>(wq[e]) * iq * e0, hi_f32<true>(wq[e]) * iq * e1);
        ok[e] = mul_f16x2(wk[e], pack_f16(e0, e1));
      }
      uint16_t* qg_dst =
          kC16 ? reinterpret_cast<uint16_t*>(rec + (t >> 4) * kRecord16Bytes + kR16OffQg) +
                     rec16_b16(t & 15, col)
               : rec_qg + rec_b16(t, col);
      *reinterpret_cast<uint4*>(qg_dst) = make_uint4(oq[0], oq[1], oq[2], oq[3]);
      *reinterpret_cast<uint4*>(kg + t * kQkPitch + col) = make_uint4(ok[0], ok[1], ok[2], ok[3]);
    }
  }
  __syncthreads();

  // ---- W = Tm (kg fk), kg = exp(G) k^ from the pass above: warp w owns channels [16w, 16w + 16);
  // k-steps over tokens s with the paired k mapping (slot c <-> s0 = 8sk + 2c, slot c+4 <-> s0 +
  // 1).
  {
    float acc[4][2][4];
#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mi][nt][e] = 0.f;
#pragma unroll
    for (int sk = 0; sk < 8; ++sk) {
      const int s0 = 8 * sk + 2 * c, s1 = s0 + 1;
      uint32_t bb[2][2];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int col = 16 * warp + 8 * nt + g;
        bb[nt][0] = f32_to_tf32(in_to_f32<true>(kg[s0 * kQkPitch + col]) * fk[s0]);
        bb[nt][1] = f32_to_tf32(in_to_f32<true>(kg[s1 * kQkPitch + col]) * fk[s1]);
      }
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) {
        if (kC16
                ? (sk >> 1) == mi
                : sk <= 2 * mi + 1) {  // rows 16mi.. need tokens s <= t only (kC16: s in the block)
          const float4 f =
              reinterpret_cast<const float4*>(tfrag)[(mi * 8 + sk) * 32 + 4 * g + tfrag_slot(g, c)];
          const uint32_t a[4] = {__float_as_uint(f.x), __float_as_uint(f.y), __float_as_uint(f.z),
                                 __float_as_uint(f.w)};
          mma_tf32(acc[mi][0], a, bb[0][0], bb[0][1]);
          mma_tf32(acc[mi][1], a, bb[1][0], bb[1][1]);
        }
      }
    }
    uint16_t* rec_w = reinterpret_cast<uint16_t*>(rec + kOffW);
#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int col = 16 * warp + 8 * nt + 2 * c, ta = 16 * mi + g;
        if constexpr (kC16) {
          uint16_t* w16 = reinterpret_cast<uint16_t*>(rec + mi * kRecord16Bytes + kR16OffW);
          *reinterpret_cast<uint32_t*>(w16 + rec16_b16(g, col)) =
              pack_bf16(acc[mi][nt][0], acc[mi][nt][1]);
          *reinterpret_cast<uint32_t*>(w16 + rec16_b16(g + 8, col)) =
              pack_bf16(acc[mi][nt][2], acc[mi][nt][3]);
        } else {
          *reinterpret_cast<uint32_t*>(rec_w + rec_b16(ta, col)) =
              pack_bf16(acc[mi][nt][0], acc[mi][nt][1]);
          *reinterpret_cast<uint32_t*>(rec_w + rec_b16(ta + 8, col)) =
              pack_bf16(acc[mi][nt][2], acc[mi][nt][3]);
        }
      }
  }

  // ---- kbT = (exp(G_L - G) k)^T (bf16), gL = exp(G_L).
  {
    // kbT: a task is two adjacent channels kk, kk + 1 (one 32-bit k^ pair and one float2 of G per
    // token) over 8 tokens: two 16-byte rows of the record.
    uint16_t* kbt_out = reinterpret_cast<uint16_t*>(rec + kOffKbT);
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      const int task = tid + kPrepareThreads * m, kk = 2 * (task & 63), sg = task >> 6;
      // The decay's end: the chunk's last token (kC16: the sub-chunk's, sub-chunk sg / 2).
      const int tl = kC16 ? 16 * (sg >> 1) + 15 : kChunk - 1;
      const float2 gl = *reinterpret_cast<const float2*>(G + tl * kGPitch + kk);
      if (kC16 ? (sg & 1) == 0
               : (m == 0 && tid < kHeadDim / 2))  // sg == 0 (kC16: each sub-chunk's first half)
        *reinterpret_cast<float2*>(rec + (kC16 ? (sg >> 1) * kRecord16Bytes + kR16OffGL : kOffGL) +
                                   4 * kk) = make_float2(exp2f(gl.x), exp2f(gl.y));
      float v0[8], v1[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int s = 8 * sg + e;
        const uint32_t kp = *reinterpret_cast<const uint32_t*>(kr + s * kQkPitch + kk);
        const float2 gs = *reinterpret_cast<const float2*>(G + s * kGPitch + kk);
        const float f = fk[s];
        v0[e] = lo_f32<true>(kp) * f * fast_exp2(gl.x - gs.x);
        v1[e] = hi_f32<true>(kp) * f * fast_exp2(gl.y - gs.y);
      }
      uint16_t* const kbt16 =
          reinterpret_cast<uint16_t*>(rec + (sg >> 1) * kRecord16Bytes + kR16OffKbT);
      uint16_t* kb0 = kC16 ? kbt16 + rec16_kbt(kk, 8 * (sg & 1)) : kbt_out + rec_kbt(kk, 8 * sg);
      uint16_t* kb1 =
          kC16 ? kbt16 + rec16_kbt(kk + 1, 8 * (sg & 1)) : kbt_out + rec_kbt(kk + 1, 8 * sg);
      *reinterpret_cast<uint4*>(kb0) = make_uint4(pack_bf16(v0[0], v0[1]), pack_bf16(v0[2], v0[3]),
                                                  pack_bf16(v0[4], v0[5]), pack_bf16(v0[6], v0[7]));
      *reinterpret_cast<uint4*>(kb1) = make_uint4(pack_bf16(v1[0], v1[1]), pack_bf16(v1[2], v1[3]),
                                                  pack_bf16(v1[4], v1[5]), pack_bf16(v1[6], v1[7]));
    }
  }
}

template <bool kFp16, bool kC16 = false>
__global__ void __launch_bounds__(kPrepareThreads, 2)
    prepare_kernel(const __grid_constant__ Params p) {
  pdl_prologue();
  prepare_block<kFp16, kC16>(p, blockIdx.x);
}

}  // namespace kda::cuda::pf
