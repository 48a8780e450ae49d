// fused.cuh — the fused prefill kernel (docs/design.md section 6.7): one launch, no workspace. A
// CTA of one warpgroup walks one (sequence, value head) over 16-token chunks with the whole state
// S^T [128 v][128 k] in registers (two 64-row halves of wgmma accumulators, 128 per thread), and
// builds each chunk's operands itself, from its raw q, k, g, beta, v, while the previous chunk's
// state update runs on the tensor cores. Two CTAs per SM. Measured slower than the two-kernel
// path on every reference case (docs/design.md section 6.8), so the plan takes it only when forced
// (KDA_CUDA_PREFILL_FUSED=1).
//
// Per chunk j (16 tokens, the 16-token path's math, common.cuh rec16_*):
//   q^ = q / |q| * scale, k^ = k / |k| (l2norm; else q * scale, k), a = log2 decay (lower-bound
//   gate), G = cumsum a within the chunk, b = beta (activated); then, anchored at the middle token
//   m = 8 (exp(G_t - G_s) = exp(G_t - G_m) exp(G_m - G_s); the gate's bound keeps both factors
//   within e^+-45, fused_applies):
//   Akk = (k^ e^(G - G_m)) (k^ e^(G_m - G))^T (s < t), Aqk = (q^ e^(G - G_m)) (...)^T (s <= t),
//   on tf32 mma.sync (fp32 operands rounded to tf32, fp32 sums);
//   X = (I + diag(b) Akk)^-1 by fp32 forward substitution, Tm = X diag(b) (tf32);
//   W = Tm (k^ e^G) = e^(G_m) (Tm (k^ e^(G - G_m))) per key column (bf16), qg = q^ e^G (bf16),
//   kbT = (k^ e^(G_L - G))^T (bf16), gL = e^(G_L): the 16-token record in shared memory, read by
//   the recurrence's step (step_wgmma16) as it reads the workspace record on the two-kernel path.
//
// Pipeline (cp.async groups, one per chunk: raw q, k, g of chunk j into raw stage j % 2, v into
// v tile j % 3): chunk j + 2 is loaded while chunk j runs its step and chunk j + 1 is prepared;
// beta, whose elements are not 16-byte runs, goes through a register one load ahead.
#pragma once

#include "cuda/common/warp_sums.cuh"
#include "cuda/prefill/common.cuh"
#include "cuda/prefill/prepare_steps.cuh"
#include "cuda/prefill/recurrence_steps.cuh"

namespace kda::cuda::pf {

inline constexpr int kFusedThreads = 128;
// Shared memory (from the first 1024-byte aligned address):
inline constexpr int kFOffRec = 0;  // two 16-token records (15,360 B each)
inline constexpr int kFVBytes = kChunk16 * kHeadDim * 2;
inline constexpr int kFOffV = kFOffRec + 2 * kRecord16Bytes;  // three v tiles [16][128] bf16
// Raw stage: q, k [16][128] (16-bit), g [16][128] (16-bit or fp32), b [16] fp32 (activated beta).
// Once the elementwise pass has read q, k and g, the same bytes hold the Gram products' per-warp
// partial sums [4][2][16][16] (at 0), M^T [16][kFMPitch] (b_t Akk[t][r] at [r][t]) and Tm
// [16][kFMPitch] (W's A operand).
inline constexpr int kFRawQ = 0, kFRawK = 4096, kFRawG = 8192, kFRawB = 16384;
inline constexpr int kFRawBytes = kFRawB + 128;
inline constexpr int kFMPitch = 20;
inline constexpr int kFScrP = 0, kFScrM = 8192, kFScrTm = kFScrM + 16 * kFMPitch * 4;
static_assert(kFScrTm + 16 * kFMPitch * 4 <= kFRawB, "raw-stage scratch below the beta slot");
inline constexpr int kFOffRaw = kFOffV + 3 * kFVBytes;
// Gram / W operands, fp32 (tf32-rounded) [16][kFOpPitch]: qa = q^ e^(G - G_m), ka = k^ e^(G - G_m),
// kd = k^ e^(G_m - G). Pitch 132: the mma.sync fragment reads (row g, column c) are conflict-free.
inline constexpr int kFOpPitch = 132;
inline constexpr int kFOpBytes = kChunk16 * kFOpPitch * 4;
inline constexpr int kFOffQa = kFOffRaw + 2 * kFRawBytes;
inline constexpr int kFOffKa = kFOffQa + kFOpBytes;
inline constexpr int kFOffKd = kFOffKa + kFOpBytes;
// Output tiles: per warp and value half [16 t][16 v] bf16 (512 B).
inline constexpr int kFOffOut = kFOffKd + kFOpBytes;
// em [128] (e^(G_m) per key), the warps' norm partial sums [4][32], the norms' reciprocals [32].
inline constexpr int kFOffEm = kFOffOut + 4 * 2 * 512;
inline constexpr int kFOffRed = kFOffEm + 512;
inline constexpr int kFOffRn = kFOffRed + 512;
inline constexpr int kFusedSmemBytes = 1024 + kFOffRn + 128;
static_assert(kFOffQa % 16 == 0 && kFOffOut % 128 == 0 && kFOffRaw % 128 == 0, "alignment");
static_assert(2 * (kFusedSmemBytes + 1024) <= 233472, "two fused CTAs per SM");

// The tf32 A fragment of m16n8k8 (rows g, g + 8 x columns k0 + c, k0 + c + 4) of an fp32 matrix
// in shared memory with row pitch `pitch` (values already tf32-rounded).
__device__ __forceinline__ void fused_a_frag(const float* m, int pitch, int k0, int g, int c,
                                             uint32_t (&a)[4]) {
  a[0] = __float_as_uint(m[g * pitch + k0 + c]);
  a[1] = __float_as_uint(m[(g + 8) * pitch + k0 + c]);
  a[2] = __float_as_uint(m[g * pitch + k0 + c + 4]);
  a[3] = __float_as_uint(m[(g + 8) * pitch + k0 + c + 4]);
}

template <bool kFp16>
__global__ void __launch_bounds__(kFusedThreads, 2) fused_kernel(const __grid_constant__ Params p) {
  pdl_prologue();
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  const uint32_t s0 = smem_addr(smem);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c = lane & 3;
  const int hv = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.HV));
  const int64_t n = blockIdx.x / static_cast<unsigned>(p.HV);
  const int h = hv / p.groups;
  const SeqSpan sp = seq_span(p, n);
  const int64_t nchunks = (sp.len + kChunk16 - 1) / kChunk16;

  // ---- Initial state: S^T rows [64 half + 16 warp, + 16) of both halves.
  float accS0[16][4], accS1[16][4];
  const int vw0 = 16 * warp, vw1 = 64 + 16 * warp;
  auto load_both = [&](const StateView& v, int64_t row) {
    load_state(accS0, v, p.kfirst, row, hv, vw0, 0, g, c);
    load_state(accS1, v, p.kfirst, row, hv, vw1, 0, g, c);
  };
  auto store_both = [&](const StateView& v, int64_t row) {
    store_state(accS0, v, p.kfirst, row, hv, vw0, 0, g, c);
    store_state(accS1, v, p.kfirst, row, hv, vw1, 0, g, c);
  };
  int64_t slot = rules::kNoSlot;
  if (p.has_state_pool) slot = rules::pool_slot(p.state_indices.load(n), p.state_pool.rows);
  if (slot >= 0) {
    load_both(p.state_pool, slot);
  } else if (!p.has_state_pool && p.initial_state.data != nullptr) {
    load_both(p.initial_state, n);
  } else {
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) accS0[j][e] = accS1[j][e] = 0.f;
  }
  int64_t ck_lo = 0, ck_hi = 0;
  if (p.checkpoint_every > 0) {
    ck_lo = p.checkpoint_offsets.load(n);
    const int64_t hi = p.checkpoint_offsets.load(n + 1);
    ck_hi = hi < p.checkpoints.rows ? hi : p.checkpoints.rows;
  }

  // ---- Loads of chunk j: q, k, g rows into raw stage j % 2 and v into tile j % 3 (cp.async, 16
  // bytes; zeros past the sequence), one commit group per chunk (empty past the end). beta: the
  // previous chunk's value (loaded one chunk ahead, in `bbits`) is activated into its raw stage,
  // then this chunk's is loaded (threads 0..15, one token each).
  const bool vec = p.q.vec && p.k.vec && p.v.vec && p.g.vec;
  const bool g32 = p.g.dtype == kF32;
  uint32_t bbits = 0;
  auto issue = [&](int64_t j) {
    if (j >= 1 && j - 1 < nchunks && tid < kChunk16) {
      const int64_t tl = (j - 1) * kChunk16 + tid;
      float* bd = reinterpret_cast<float*>(smem + kFOffRaw + ((j - 1) & 1) * kFRawBytes + kFRawB);
      bd[tid] = tl < sp.len
                    ? beta_fast(p.beta_logits, p.allow_neg_eigval, bits_to_f32(bbits, p.beta.dtype))
                    : 0.f;
    }
    if (j < nchunks) {
      uint8_t* raw = smem + kFOffRaw + (j & 1) * kFRawBytes;
      const uint32_t raw_s = s0 + kFOffRaw + (j & 1) * kFRawBytes;
      const uint32_t v_s = s0 + kFOffV + static_cast<int>(j % 3) * kFVBytes;
      const int64_t t0 = sp.bos + j * kChunk16;
      if (tid < kChunk16) {
        const int64_t tl = j * kChunk16 + tid;
        bbits = tl < sp.len
                    ? load_bits_any(p.beta.data, p.beta.dtype, p.beta.offset(sp.b, t0 + tid, hv))
                    : 0u;
      }
      const uint16_t* qb = static_cast<const uint16_t*>(p.q.data);
      const uint16_t* kb = static_cast<const uint16_t*>(p.k.data);
      const uint16_t* vb = static_cast<const uint16_t*>(p.v.data);
      const uint8_t* gb = static_cast<const uint8_t*>(p.g.data);
#pragma unroll
      for (int m = 0; m < 2; ++m) {  // q, k, v: 16 rows x 16 chunks of 16 bytes
        const int i = tid + kFusedThreads * m, r = i >> 4, ch = i & 15;
        const bool ok = j * kChunk16 + r < sp.len;
        const int64_t oq = ok ? p.q.offset(sp.b, t0 + r, h) + 8 * ch : 0;
        const int64_t ok_ = ok ? p.k.offset(sp.b, t0 + r, h) + 8 * ch : 0;
        const int64_t ov = ok ? p.v.offset(sp.b, t0 + r, hv) + 8 * ch : 0;
        if (vec) {
          cp_async_16_zfill(raw_s + kFRawQ + r * 256 + 16 * ch, qb + oq, ok ? 16 : 0);
          cp_async_16_zfill(raw_s + kFRawK + r * 256 + 16 * ch, kb + ok_, ok ? 16 : 0);
          cp_async_16_zfill(v_s + swizzle_vtile(r, ch, kHeadDim), vb + ov, ok ? 16 : 0);
        } else {
          uint16_t wq[8], wk[8], wv[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            wq[e] = ok ? qb[oq + e] : uint16_t{0};
            wk[e] = ok ? kb[ok_ + e] : uint16_t{0};
            wv[e] = ok ? vb[ov + e] : uint16_t{0};
          }
          uint8_t* vt = smem + kFOffV + static_cast<int>(j % 3) * kFVBytes;
          std::memcpy(raw + kFRawQ + r * 256 + 16 * ch, wq, 16);
          std::memcpy(raw + kFRawK + r * 256 + 16 * ch, wk, 16);
          std::memcpy(vt + swizzle_vtile(r, ch, kHeadDim), wv, 16);
        }
      }
      const int gch = g32 ? 32 : 16;  // 16-byte chunks per g row
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const int i = tid + kFusedThreads * m, r = i / gch, ch = i % gch;
        if (r < kChunk16) {
          const bool ok = j * kChunk16 + r < sp.len;
          const int per = g32 ? 4 : 8;  // elements per chunk
          const int64_t og = ok ? p.g.offset(sp.b, t0 + r, hv) + per * ch : 0;
          const int esz = g32 ? 4 : 2;
          if (vec) {
            cp_async_16_zfill(raw_s + kFRawG + r * (128 * esz) + 16 * ch, gb + og * esz,
                              ok ? 16 : 0);
          } else {
            uint8_t w[16];
            for (int e = 0; e < 16; ++e) w[e] = ok ? gb[og * esz + e] : uint8_t{0};
            std::memcpy(raw + kFRawG + r * (128 * esz) + 16 * ch, w, 16);
          }
        }
      }
    }
    cp_async_commit();
  };

  // ---- Gate constants of this thread's key channel (the elementwise pass: thread = channel).
  const float exp_a = p.A_log ? expf(p.A_log[hv * p.A_log_s]) : 1.f;
  const float ca = -exp_a * kLog2e;
  const float cb = ca * (p.dt_bias ? p.dt_bias[hv * p.dt_bias_s + tid] : 0.f);
  const float lb2 = p.lower_bound * kLog2e;
  const float eps = static_cast<float>(detail::kL2NormEps);

  // ---- Build chunk j's record (record stage j % 2) from raw stage j % 2. Ends with a barrier
  // after which the raw stage is free.
  auto prepare = [&](int64_t j) {
    uint8_t* raw = smem + kFOffRaw + (j & 1) * kFRawBytes;
    uint8_t* rec = smem + kFOffRec + (j & 1) * kRecord16Bytes;
    float* qa = reinterpret_cast<float*>(smem + kFOffQa);
    float* ka = reinterpret_cast<float*>(smem + kFOffKa);
    float* kd = reinterpret_cast<float*>(smem + kFOffKd);
    float* red = reinterpret_cast<float*>(smem + kFOffRed);
    float* rn = reinterpret_cast<float*>(smem + kFOffRn);
    const float* bet = reinterpret_cast<const float*>(raw + kFRawB);
    // -- Elementwise pass, thread = key channel cc over the 16 tokens.
    {
      const int cc = tid;
      float q[16], k[16], G[16];
      const uint16_t* rq = reinterpret_cast<const uint16_t*>(raw + kFRawQ);
      const uint16_t* rk = reinterpret_cast<const uint16_t*>(raw + kFRawK);
      float run = 0.f;
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        q[r] = in_to_f32<kFp16>(rq[r * 128 + cc]);
        k[r] = in_to_f32<kFp16>(rk[r * 128 + cc]);
        const float gr =
            g32 ? reinterpret_cast<const float*>(raw + kFRawG)[r * 128 + cc]
                : in_to_f32<kFp16>(reinterpret_cast<const uint16_t*>(raw + kFRawG)[r * 128 + cc]);
        // Rows past the sequence were loaded as zeros; their decay is 1 (a = 0).
        const bool valid = j * kChunk16 + r < sp.len;
        run += valid ? log2_decay_lower_bound(gr, ca, cb, lb2) : 0.f;
        G[r] = run;
      }
      if (p.use_qk_l2norm) {
        float v[32];
#pragma unroll
        for (int r = 0; r < 16; ++r) {
          v[r] = q[r] * q[r];
          v[16 + r] = k[r] * k[r];
        }
        red[warp * 32 + lane] = warp_row_sums<32>(v, lane);  // lane l: the sum of v[l]
        __syncthreads();
        if (tid < 32)
          rn[tid] = rsqrtf(red[tid] + red[32 + tid] + red[64 + tid] + red[96 + tid] + eps);
        __syncthreads();
#pragma unroll
        for (int r = 0; r < 16; ++r) {
          q[r] *= rn[r] * p.scale;
          k[r] *= rn[16 + r];
        }
      } else {
#pragma unroll
        for (int r = 0; r < 16; ++r) q[r] *= p.scale;
      }
      // Two exponentials per token: up = e^(G - G_m), dn = e^(G_m - G); e^G = e^(G_m) up and
      // e^(G_L - G) = e^(G_L - G_m) dn (every factor within 2^+-58: |G| <= 16 x 5 log2 e).
      const float gm = G[8], gl = G[15], em = fast_exp2(gm), elm = fast_exp2(gl - gm);
      uint32_t kbw[8];
      uint16_t* qg = reinterpret_cast<uint16_t*>(rec + kR16OffQg);
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        const float up = fast_exp2(G[r] - gm), dn = fast_exp2(gm - G[r]);
        qg[rec16_b16(r, cc)] = out_bits<false>(q[r] * (em * up));
        const float kbv = k[r] * (elm * dn);
        if (r & 1)
          kbw[r >> 1] = pack_bf16(__uint_as_float(kbw[r >> 1]), kbv);
        else
          kbw[r >> 1] = __float_as_uint(kbv);
        qa[r * kFOpPitch + cc] = tf32_round(q[r] * up);
        ka[r * kFOpPitch + cc] = tf32_round(k[r] * up);
        kd[r * kFOpPitch + cc] = tf32_round(k[r] * dn);
      }
      uint16_t* kbt = reinterpret_cast<uint16_t*>(rec + kR16OffKbT);
      *reinterpret_cast<uint4*>(kbt + rec16_kbt(cc, 0)) =
          make_uint4(kbw[0], kbw[1], kbw[2], kbw[3]);
      *reinterpret_cast<uint4*>(kbt + rec16_kbt(cc, 8)) =
          make_uint4(kbw[4], kbw[5], kbw[6], kbw[7]);
      reinterpret_cast<float*>(rec + kR16OffGL)[cc] = fast_exp2(gl);
      reinterpret_cast<float*>(smem + kFOffEm)[cc] = em;
    }
    __syncthreads();
    // -- Gram products: warp w sums over key columns [32 w, 32 w + 32): Akk = ka kd^T, Aqk = qa
    // kd^T (tf32 m16n8k8; A (row g | g + 8, k c | c + 4), B (k c | c + 4, column g)).
    {
      float acck[2][4] = {}, accq[2][4] = {};
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        const int k0 = 32 * warp + 8 * ks;
        uint32_t ak[4], aq[4];
        fused_a_frag(ka, kFOpPitch, k0, g, c, ak);
        fused_a_frag(qa, kFOpPitch, k0, g, c, aq);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const int s = 8 * nt + g;
          const uint32_t b0 = __float_as_uint(kd[s * kFOpPitch + k0 + c]);
          const uint32_t b1 = __float_as_uint(kd[s * kFOpPitch + k0 + c + 4]);
          mma_tf32(acck[nt], ak, b0, b1);
          mma_tf32(accq[nt], aq, b0, b1);
        }
      }
      float* part = reinterpret_cast<float*>(raw + kFScrP) + warp * 512;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = g + 8 * (e >> 1), s = 8 * nt + 2 * c + (e & 1);
          part[t * 16 + s] = acck[nt][e];
          part[256 + t * 16 + s] = accq[nt][e];
        }
    }
    __syncthreads();
    // -- The four partials summed: M^T (b_t Akk[t][s], s < t, at [s][t]) and the record's Aqk
    // (s <= t, tf32; zero above the diagonal). Thread: row t = tid / 8, columns 2 (tid % 8) +
    // {0,1}.
    {
      const float* part = reinterpret_cast<const float*>(raw + kFScrP);
      float* mt = reinterpret_cast<float*>(raw + kFScrM);
      float* aqk = reinterpret_cast<float*>(rec + kR16OffAqk);
      const int t = tid >> 3;
      const float bt = bet[t];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int s = 2 * (tid & 7) + e, i = t * 16 + s;
        const float sk = part[i] + part[512 + i] + part[1024 + i] + part[1536 + i];
        const float sq = part[256 + i] + part[768 + i] + part[1280 + i] + part[1792 + i];
        mt[s * kFMPitch + t] = s < t ? bt * sk : 0.f;
        aqk[rec16_f32(t, s)] = s <= t ? tf32_round(sq) : 0.f;
      }
    }
    __syncthreads();
    // -- X = (I + M)^-1 by forward substitution, lane s < 16 of warp 0 holding column s (updates
    // of every later row as soon as x_r is known: a chain of 16 FMAs); Tm = X diag(b).
    if (warp == 0) {
      const float* mt = reinterpret_cast<const float*>(raw + kFScrM);
      float* tms = reinterpret_cast<float*>(raw + kFScrTm);
      float* tmr = reinterpret_cast<float*>(rec + kR16OffTm);
      const int s = lane & 15;
      float acc[16];
#pragma unroll
      for (int t = 0; t < 16; ++t) acc[t] = t == s ? 1.f : 0.f;
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        const float xr = acc[r];
#pragma unroll
        for (int t = r + 1; t < 16; ++t) acc[t] = fmaf(-mt[r * kFMPitch + t], xr, acc[t]);
      }
      const float bs = bet[s];
      if (lane < 16) {
#pragma unroll
        for (int t = 0; t < 16; ++t) {
          const float v = tf32_round(acc[t] * bs);
          tms[t * kFMPitch + s] = v;
          tmr[rec16_f32(t, s)] = v;
        }
      }
    }
    __syncthreads();
    // -- W = e^(G_m) (Tm ka): warp w, key columns [32 w, 32 w + 32) (4 n-tiles, 2 k-steps).
    {
      const float* tms = reinterpret_cast<const float*>(raw + kFScrTm);
      const float* em = reinterpret_cast<const float*>(smem + kFOffEm);
      uint16_t* wr = reinterpret_cast<uint16_t*>(rec + kR16OffW);
      float acc[4][4] = {};
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        const int s0 = 8 * ks;
        uint32_t a[4];
        fused_a_frag(tms, kFMPitch, s0, g, c, a);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const int col = 32 * warp + 8 * nt + g;
          mma_tf32(acc[nt], a, __float_as_uint(ka[(s0 + c) * kFOpPitch + col]),
                   __float_as_uint(ka[(s0 + c + 4) * kFOpPitch + col]));
        }
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int col = 32 * warp + 8 * nt + 2 * c;
        const float e0 = em[col], e1 = em[col + 1];
        *reinterpret_cast<uint32_t*>(wr + rec16_b16(g, col)) =
            pack_bf16(acc[nt][0] * e0, acc[nt][1] * e1);
        *reinterpret_cast<uint32_t*>(wr + rec16_b16(g + 8, col)) =
            pack_bf16(acc[nt][2] * e0, acc[nt][3] * e1);
      }
    }
    // The record is read by the tensor cores (async proxy) after the next block barrier.
    fence_proxy_async();
    __syncthreads();
  };

  // ---- Output of one value half: O^T (accO's first two n-tiles: 16 value rows x 16 tokens of
  // this warp) -> this warp's tile (stmatrix.trans) -> out, 32 bytes per token row.
  uint16_t* obase = static_cast<uint16_t*>(p.out.data);
  auto store_out = [&](const float(&accO)[8][4], int half, int64_t j, int L) {
    uint8_t* otile = smem + kFOffOut + (warp * 2 + half) * 512;
    const uint32_t o_s = smem_addr(otile);
    __syncwarp();
    {
      const int row = ((lane >> 4) << 3) + (lane & 7);
      stmatrix_x4_trans(
          o_s + out_tile_offset(row, (lane >> 3) & 1), pack_out<kFp16>(accO[0][0], accO[0][1]),
          pack_out<kFp16>(accO[0][2], accO[0][3]), pack_out<kFp16>(accO[1][0], accO[1][1]),
          pack_out<kFp16>(accO[1][2], accO[1][3]));
    }
    __syncwarp();
    const int r = lane >> 1, ch = lane & 1;
    if (r < L) {
      const uint4 x = *reinterpret_cast<const uint4*>(otile + out_tile_offset(r, ch));
      const int64_t goff =
          p.out.offset(sp.b, sp.bos + j * kChunk16 + r, hv) + 64 * half + 16 * warp + 8 * ch;
      store_out16(obase, goff, x, p.out.vec);
    }
  };

  // ---- Prologue: chunks 0 and 1 in flight, chunk 0 prepared, chunk 2 in flight.
  issue(0);
  issue(1);
  if (nchunks > 0) {
    cp_async_wait<1>();
    __syncthreads();
    prepare(0);
  }
  issue(2);

  for (int64_t j = 0; j < nchunks; ++j) {
    cp_async_wait<1>();  // chunk j + 1's raw inputs and chunk j's v tile
    __syncthreads();     // ... for every thread; chunk j's record complete
    const int L =
        static_cast<int>(sp.len - j * kChunk16 < kChunk16 ? sp.len - j * kChunk16 : kChunk16);
    const uint8_t* sb = smem + kFOffRec + (j & 1) * kRecord16Bytes;
    const uint32_t sbase = s0 + kFOffRec + (j & 1) * kRecord16Bytes;
    const uint32_t vaddr = s0 + kFOffV + static_cast<int>(j % 3) * kFVBytes;
    // Each half: its step (the state update left in flight) and its outputs. The first half's
    // update completes inside the second half's step (its first wait).
    auto step_half = [&](float(&accS)[16][4], int half) {
      float accO[8][4] = {};
      step_wgmma16<kFp16>(accS, accO, sb, sbase, vaddr, 4 * half + warp, lane, kHeadDim);
      store_out(accO, half, j, L);
    };
    step_half(accS0, 0);
    step_half(accS1, 1);
    wgmma_fence_acc(accS0);
    if (j + 1 < nchunks) prepare(j + 1);  // while the second half's state update runs
    step16_done(accS1);
    issue(j + 3);
    // ---- Checkpoint: the state after every checkpoint_every tokens (full chunks only).
    if (p.checkpoint_every > 0 && L == kChunk16) {
      const int64_t done = (j + 1) * kChunk16;
      if (done % p.checkpoint_every == 0) {
        const int64_t row = ck_lo + done / p.checkpoint_every - 1;
        if (row >= 0 && row < ck_hi) store_both(p.checkpoints, row);
      }
    }
  }
  cp_async_wait<0>();

  // ---- Final state.
  if (!p.has_state_pool && p.final_state.data != nullptr) store_both(p.final_state, n);
  if (slot >= 0) store_both(p.state_pool, slot);
}

}  // namespace kda::cuda::pf
