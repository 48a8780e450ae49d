// fused.cuh — the fused prefill kernel (docs/design.md sections 6.7-6.9): one launch, no
// workspace. A CTA walks one (sequence, value head) over 16-token chunks with two roles:
//   - the producer (warps 8..15, 256 threads, two groups of 4 warps taking alternate chunks)
//     builds each chunk's operands, the 16-token record of the chunk-16 path (common.cuh, rec16_*)
//     and the chunk's v tile, from the raw q, k, g, beta, v into a ring of three shared-memory
//     stages;
//   - the consumers (warps 0..7, two warpgroups) hold the state S^T [128 v][128 k] in registers,
//     warpgroup w its value rows [64 w, 64 w + 64), and run the recurrence's 16-token step
//     (step_wgmma16) on each stage in turn, storing the outputs.
// Stage s has a "full" mbarrier (the producer's arrival once the record is written) and an
// "empty" one (one arrival per consumer warp once its products have read the stage), so the
// producer prepares up to three chunks ahead of the state chain and the two run side by side.
// setmaxnreg gives the consumers kFConsumerRegs registers and the producer kFProducerRegs.
//
// Per chunk j (16 tokens, the 16-token path's math), thread of its group (token t, key channels
// 8 cg .. 8 cg + 7 for two channel groups cg, 64 channels apart; 16-byte reads and writes):
//   q^ = q / |q| * scale, k^ = k / |k| (l2norm: the warps' partial sums through shared memory;
//   else q * scale, k), a = log2 decay (lower-bound gate), G = cumsum a within the chunk (a scan
//   over the 16 lanes of one channel group),
//   b = beta (activated); then, anchored at the chunk's start (exp(G_t - G_s) = e^(G_t) e^(-G_s);
//   the gate's bound, |a| <= 5 log2 e, keeps both factors within 2^+-116, fused_applies):
//   Akk = (k^ e^G) (k^ e^-G)^T (s < t), Aqk = (q^ e^G) (k^ e^-G)^T (s <= t),
//   on tf32 mma.sync, each of the group's 4 warps summing 32 keys, the partials added in shared
//   memory;
//   X = (I + diag(b) Akk)^-1 by fp32 forward substitution in one warp, Tm = X diag(b) (tf32);
//   W = Tm (k^ e^G) (tf32 mma.sync, bf16 out), qg = q^ e^G (bf16),
//   kbT = (k^ e^(G_L - G))^T (bf16), gL = e^(G_L).
// Raw inputs (cp.async, one commit group per chunk) go into the group's two raw stages, its next
// chunk's in flight while one is built; beta, whose elements are not 16-byte runs, goes through a
// register one load ahead.
#pragma once

#include <type_traits>

#include "cuda/common/warp_sums.cuh"
#include "cuda/prefill/common.cuh"
#include "cuda/prefill/phase_timing.cuh"
#include "cuda/prefill/prepare_steps.cuh"
#include "cuda/prefill/recurrence_steps.cuh"

namespace kda::cuda::pf {

inline constexpr int kFConsumerThreads = 256, kFProducerThreads = 256;
inline constexpr int kFusedThreads = kFConsumerThreads + kFProducerThreads;
inline constexpr int kFConsumerRegs = 168, kFProducerRegs = 88;
static_assert(kFConsumerThreads * kFConsumerRegs + kFProducerThreads * kFProducerRegs <= 65536,
              "the two roles' registers fit the register file");
static_assert(kFusedThreads * 128 <= 65536, "the launch's registers (128 a thread)");
// The producer is two groups of 4 warps (128 threads) that build alternate chunks (group gp the
// chunks j = gp mod 2), each with its own named barrier, raw stages and scratch, so that one
// group's barrier-separated phases overlap the other's.
inline constexpr int kFGroups = 2, kFGroupThreads = kFProducerThreads / kFGroups;
inline constexpr int kFGroupBarrier0 = 1;  // named barriers 1, 2 (0 is __syncthreads)

// Shared memory (from the first 1024-byte aligned address):
// Stages: the 16-token record (15,360 B) and the chunk's v tile [16][128] bf16 (swizzle_vtile).
inline constexpr int kFStages = 3;
inline constexpr int kFVBytes = kChunk16 * kHeadDim * 2;
inline constexpr int kFStageBytes = kRecord16Bytes + kFVBytes;
static_assert(kFStageBytes % 1024 == 0, "stages at the records' swizzle period");
// Raw stages, two per group (chunk j of group gp in stage 2 gp + (j / 2) % 2): q, k [16][128]
// (16-bit, row-major), v (the stage's v tile layout), g [16][128] (16-bit or fp32), b [16] fp32
// (activated beta).
inline constexpr int kFRaws = 2;
inline constexpr int kFRawQ = 0, kFRawK = 4096, kFRawV = 8192, kFRawG = 12288, kFRawB = 20480;
inline constexpr int kFRawBytes = kFRawB + 128;
inline constexpr int kFOffRaw = kFStages * kFStageBytes;
// Byte offset of 16-byte chunk `ch` of row r of a raw tile with `row_bytes` per row: the chunk
// index XORed with r % 8, so that the elementwise pass's 16-byte reads of 8 rows at one chunk hit
// 8 different bank groups.
__host__ __device__ constexpr int raw_offset(int r, int ch, int row_bytes) {
  return r * row_bytes + ((ch ^ (r & 7)) << 4);
}
// A group's scratch: the Gram / W operands, fp32 (tf32-rounded) [16][kFOpPitch]: qa = q^ e^G,
// ka = k^ e^G, kd = k^ e^-G (pitch 132: the mma.sync fragment reads (row g, column c) are
// conflict-free); the Gram products' per-warp partial sums [4][2][16][16]; M^T [16][kFMPitch]
// (b_t Akk[t][r] at [r][t]); Tm [16][kFMPitch] (W's A operand); the warps' norm partial sums of q
// and k [2][16 t][4 warps].
inline constexpr int kFOpPitch = 132;
inline constexpr int kFOpBytes = kChunk16 * kFOpPitch * 4;
inline constexpr int kFMPitch = 20;
inline constexpr int kFGQa = 0, kFGKa = kFOpBytes, kFGKd = 2 * kFOpBytes;
inline constexpr int kFGPart = 3 * kFOpBytes;
inline constexpr int kFGM = kFGPart + 4 * 2 * 256 * 4;
inline constexpr int kFGTm = kFGM + kChunk16 * kFMPitch * 4;
inline constexpr int kFGRed = kFGTm + kChunk16 * kFMPitch * 4;
inline constexpr int kFGroupBytes = kFGRed + 2 * 16 * 4 * 4;
inline constexpr int kFOffGroup = kFOffRaw + kFGroups * kFRaws * kFRawBytes;
// The gate's per-key constants cb [128]; the sequence ranking's scratch (fused_sequence_of_rank,
// before the roles start).
inline constexpr int kFOffCb = kFOffGroup + kFGroups * kFGroupBytes;
inline constexpr int kFOffOrder = kFOffCb + 512;
// Output tiles: per consumer warp [16 t][16 v] bf16 (512 B). Then the mbarriers: full[3], empty[3].
inline constexpr int kFOffOut = kFOffOrder + 640;
inline constexpr int kFOffBar = kFOffOut + 8 * 512;
// Then, in builds with KDA_FUSED_PHASE_TIMING, the warps' phase clocks (phase_timing.cuh).
inline constexpr int kFOffPhase = kFOffBar + 16 * kFStages;
inline constexpr int kFusedSmemBytes = 1024 + kFOffPhase + phase_timing_bytes(kFusedThreads / 32);
static_assert(kFOffGroup % 16 == 0 && kFGroupBytes % 16 == 0 && kFOffOut % 128 == 0 &&
                  kFRawBytes % 16 == 0,
              "alignment");
static_assert(kFusedSmemBytes <= 232448, "one fused CTA per SM");

// The tf32 A fragment of m16n8k8 (rows g, g + 8 x columns k0 + c, k0 + c + 4) of an fp32 matrix
// in shared memory with row pitch `pitch` (values already tf32-rounded).
__device__ __forceinline__ void fused_a_frag(const float* m, int pitch, int k0, int g, int c,
                                             uint32_t (&a)[4]) {
  a[0] = __float_as_uint(m[g * pitch + k0 + c]);
  a[1] = __float_as_uint(m[(g + 8) * pitch + k0 + c]);
  a[2] = __float_as_uint(m[g * pitch + k0 + c + 4]);
  a[3] = __float_as_uint(m[(g + 8) * pitch + k0 + c + 4]);
}

// Where a CTA's walk is: its sequence, head and chunk count, shared memory and barriers.
struct FusedCta {
  SeqSpan sp;            // the sequence, or the segment (kSeg; with its warm-up)
  SegRole role;          // one segment per sequence unless kSeg
  int64_t out_from = 0;  // the first chunk of sp whose outputs and checkpoints are written
  int64_t n, nchunks;
  int hv, h;
  uint8_t* smem;
  uint32_t s0, bar_full, bar_empty;
};

// ---- The producer: thread pt (0..255) of group gp = pt / 128 (local thread lt, warp lw 0..3),
// which builds the chunks j = gp, gp + 2, ...
// kSeg: chunks before f.out_from (a warm-up's, whose outputs are discarded) are built without their
// q side (prepare<false>: no q loads, norm, qg, qa or Aqk); the consumers' output products read the
// stage's stale qg and Aqk there and their results are dropped.
template <bool kFp16, bool kSeg>
__device__ __forceinline__ void fused_producer(const Params& p, const FusedCta& f, int pt) {
  const int gp = pt / kFGroupThreads, lt = pt % kFGroupThreads;
  const SeqSpan& sp = f.sp;
  uint8_t* const smem = f.smem;
  auto sync = [gp] { named_barrier_sync(kFGroupBarrier0 + gp, kFGroupThreads); };
  PhaseClock clk;  // phases: 0 stage wait, 1 norms, 2 elementwise, 3 its barrier, 4 Gram, 5 its
                   // barrier, 6 partial sums, 7 their barrier, 8 solve or loads, 9 their barrier,
                   // 10 W, 11 the chunk's end (raw wait, barrier, arrival)
  clk.start(smem + kFOffPhase);
  auto raw_at = [&](int64_t j) { return kFOffRaw + (2 * gp + ((j >> 1) & 1)) * kFRawBytes; };

  // Loads of chunk j into its raw stage (cp.async, 16 bytes; zeros past the sequence), one commit
  // group per call (empty past the end), by warps 1-3 of the group (kLoaders threads: they run
  // while warp 0 solves); beta's bits into `bbits` (activated into the raw stage by put_beta, by
  // the same threads). The element offsets of the sequence's first token are computed once.
  const bool vec = p.q.vec && p.k.vec && p.v.vec && p.g.vec;
  const bool g32 = p.g.dtype == kF32;
  constexpr int kLoaders = kFGroupThreads - 32;  // warps 1-3
  const int il = lt - 32;                        // the loading thread (negative: warp 0)
  const uint16_t* const qs = static_cast<const uint16_t*>(p.q.data) + p.q.offset(sp.b, sp.bos, f.h);
  const uint16_t* const ks = static_cast<const uint16_t*>(p.k.data) + p.k.offset(sp.b, sp.bos, f.h);
  const uint16_t* const vs =
      static_cast<const uint16_t*>(p.v.data) + p.v.offset(sp.b, sp.bos, f.hv);
  const int gesz = g32 ? 4 : 2;
  const uint8_t* const gsq =
      static_cast<const uint8_t*>(p.g.data) + p.g.offset(sp.b, sp.bos, f.hv) * gesz;
  uint32_t bbits = 0;
  auto put_beta = [&](int64_t j) {
    if (j < f.nchunks && il >= 0 && il < kChunk16) {
      const int64_t tl = j * kChunk16 + il;
      float* bd = reinterpret_cast<float*>(smem + raw_at(j) + kFRawB);
      bd[il] = tl < sp.len
                   ? beta_fast(p.beta_logits, p.allow_neg_eigval, bits_to_f32(bbits, p.beta.dtype))
                   : 0.f;
    }
  };
  auto issue = [&](int64_t j) {
    if (il >= 0 && j < f.nchunks) {
      uint8_t* raw = smem + raw_at(j);
      const uint32_t raw_s = f.s0 + raw_at(j);
      const int64_t tj = j * kChunk16;  // the chunk's first token, in the sequence
      if (il < kChunk16) {
        const int64_t tl = tj + il;
        bbits = tl < sp.len ? load_bits_any(p.beta.data, p.beta.dtype,
                                            p.beta.offset(sp.b, sp.bos + tl, f.hv))
                            : 0u;
      }
      // q, k, v: 16 rows x 16 runs of 16 bytes.
#pragma unroll 1
      for (int i = il; i < kChunk16 * 16; i += kLoaders) {
        const int r = i >> 4, ch = i & 15;
        const int64_t t = tj + r;
        const bool ok = t < sp.len, okv = ok && !f.role.trans;  // the transition's rows: zero v
        const bool okq = !kSeg || j >= f.out_from;              // q is read (fused_producer)
        const int64_t tc = ok ? t : 0;
        const uint16_t* const qp = qs + tc * p.q.s1 + 8 * ch;
        const uint16_t* const kp = ks + tc * p.k.s1 + 8 * ch;
        const uint16_t* const vp = vs + tc * p.v.s1 + 8 * ch;
        const int vt = kFRawV + swizzle_vtile(r, ch, kHeadDim);
        if (vec) {
          if (okq) cp_async_16_zfill(raw_s + kFRawQ + raw_offset(r, ch, 256), qp, ok ? 16 : 0);
          cp_async_16_zfill(raw_s + kFRawK + raw_offset(r, ch, 256), kp, ok ? 16 : 0);
          cp_async_16_zfill(raw_s + vt, vp, okv ? 16 : 0);
        } else {
          uint16_t wq[8], wk[8], wv[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            wq[e] = ok ? qp[e] : uint16_t{0};
            wk[e] = ok ? kp[e] : uint16_t{0};
            wv[e] = okv ? vp[e] : uint16_t{0};
          }
          std::memcpy(raw + kFRawQ + raw_offset(r, ch, 256), wq, 16);
          std::memcpy(raw + kFRawK + raw_offset(r, ch, 256), wk, 16);
          std::memcpy(raw + vt, wv, 16);
        }
      }
      // g: 16 rows of 16 (bf16 / fp16) or 32 (fp32) runs.
      const int gsh = g32 ? 5 : 4;
#pragma unroll 1
      for (int i = il; i < (kChunk16 << gsh); i += kLoaders) {
        const int r = i >> gsh, ch = i & ((1 << gsh) - 1);
        const int64_t t = tj + r;
        const bool ok = t < sp.len;
        const uint8_t* const gp8 = gsq + ((ok ? t : 0) * p.g.s1) * gesz + 16 * ch;
        const uint32_t dst = kFRawG + raw_offset(r, ch, 128 * gesz);
        if (vec) {
          cp_async_16_zfill(raw_s + dst, gp8, ok ? 16 : 0);
        } else {
          uint8_t w[16];
          for (int e = 0; e < 16; ++e) w[e] = ok ? gp8[e] : uint8_t{0};
          std::memcpy(raw + dst, w, 16);
        }
      }
    }
    cp_async_commit();
  };

  // Gate constants: ca, and cb [128] in shared memory (fused_kernel writes them before the roles
  // start).
  const float exp_a = p.A_log ? expf(p.A_log[f.hv * p.A_log_s]) : 1.f;
  const float ca = -exp_a * kLog2e;
  const float lb2 = p.lower_bound * kLog2e;
  const float eps = static_cast<float>(detail::kL2NormEps);
  // Chunk j's record and v tile into stage j % 3 (free once its previous chunk's consumers have
  // released it), from its raw stage (complete and visible to every thread of the group).
  auto prepare = [&](int64_t j, auto q_side) {
    constexpr bool kQ = decltype(q_side)::value;  // the q side is built
    // The thread's index, opaque to the compiler here: otherwise it hoists every chunk-invariant
    // shared-memory address and constant derived from it out of the loop and, short of
    // registers, spills them (a local load at each use instead of an integer add).
    int ltv = lt;
    asm volatile("" : "+r"(ltv));
    const int lane = ltv & 31, lw = ltv >> 5, g = lane >> 2, c = lane & 3;
    // Elementwise pass: token tok (the lane's low 4 bits) of channel groups cgl and cgl + 8 (the
    // key channels 8 cgl .. 8 cgl + 7 and 64 more).
    const int tok = lane & 15, cgl = 2 * lw + (lane >> 4);
    const float* const cbv = reinterpret_cast<const float*>(smem + kFOffCb);
    uint8_t* const gs = smem + kFOffGroup + gp * kFGroupBytes;
    float* const qa = reinterpret_cast<float*>(gs + kFGQa);
    float* const ka = reinterpret_cast<float*>(gs + kFGKa);
    float* const kd = reinterpret_cast<float*>(gs + kFGKd);
    float* const red = reinterpret_cast<float*>(gs + kFGRed);
    float* const mt = reinterpret_cast<float*>(gs + kFGM);
    float* const tms = reinterpret_cast<float*>(gs + kFGTm);
    const int st = static_cast<int>(j % kFStages);
    const uint8_t* raw = smem + raw_at(j);
    uint8_t* rec = smem + st * kFStageBytes;
    const float* bet = reinterpret_cast<const float*>(raw + kFRawB);
    mbar_wait(f.bar_empty + 8 * st, static_cast<uint32_t>(((j / kFStages) & 1) ^ 1));
    clk.mark(0);
    // -- Elementwise pass. The norms first: this token's sums over the thread's 16 channels, the
    // warp's 32 (lanes tok, tok + 16), then the group's four warps through shared memory. Then
    // the two halves one after the other (q and k read again: fewer live registers).
    auto raw16 = [&](int off, int h) {
      return *reinterpret_cast<const uint4*>(raw + off + raw_offset(tok, cgl + 8 * h, 256));
    };
    float rq = p.scale, rk = 1.f;
    if (p.use_qk_l2norm) {
      float sq = 0.f, sk = 0.f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 qw = kQ ? raw16(kFRawQ, h) : uint4{}, kw = raw16(kFRawK, h);
        const uint32_t qv[4] = {qw.x, qw.y, qw.z, qw.w};
        const uint32_t kv[4] = {kw.x, kw.y, kw.z, kw.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float k0 = lo_f32<kFp16>(kv[i]), k1 = hi_f32<kFp16>(kv[i]);
          if constexpr (kQ) {
            const float q0 = lo_f32<kFp16>(qv[i]), q1 = hi_f32<kFp16>(qv[i]);
            sq = fmaf(q1, q1, fmaf(q0, q0, sq));
          }
          sk = fmaf(k1, k1, fmaf(k0, k0, sk));
        }
      }
      sq += __shfl_xor_sync(0xffffffffu, sq, 16);
      sk += __shfl_xor_sync(0xffffffffu, sk, 16);
      if (lane < 16) {
        red[tok * 4 + lw] = sq;
        red[64 + tok * 4 + lw] = sk;
      }
      sync();
      const float4 q4 = *reinterpret_cast<const float4*>(red + tok * 4);
      const float4 k4 = *reinterpret_cast<const float4*>(red + 64 + tok * 4);
      rq = rsqrtf(((q4.x + q4.y) + (q4.z + q4.w)) + eps) * p.scale;
      rk = rsqrtf(((k4.x + k4.y) + (k4.z + k4.w)) + eps);
    }
    clk.mark(1);
    // Rows past the sequence were loaded as zeros; their decay is 1 (a = 0).
    const bool valid = j * kChunk16 + tok < sp.len;
    uint16_t* kbt = reinterpret_cast<uint16_t*>(rec + kR16OffKbT);
#pragma unroll 1
    for (int h = 0; h < 2; ++h) {
      const int cg = cgl + 8 * h, c0 = 8 * cg;
      float q[8], k[8], G[8];
      {
        const uint4 qw = kQ ? raw16(kFRawQ, h) : uint4{}, kw = raw16(kFRawK, h);
        const uint32_t qv[4] = {qw.x, qw.y, qw.z, qw.w};
        const uint32_t kv[4] = {kw.x, kw.y, kw.z, kw.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          q[2 * i] = kQ ? lo_f32<kFp16>(qv[i]) * rq : 0.f;
          q[2 * i + 1] = kQ ? hi_f32<kFp16>(qv[i]) * rq : 0.f;
          k[2 * i] = lo_f32<kFp16>(kv[i]) * rk;
          k[2 * i + 1] = hi_f32<kFp16>(kv[i]) * rk;
        }
      }
      {
        float gr[8];
        if (g32) {
          const uint4 g0 =
              *reinterpret_cast<const uint4*>(raw + kFRawG + raw_offset(tok, 2 * cg, 512));
          const uint4 g1 =
              *reinterpret_cast<const uint4*>(raw + kFRawG + raw_offset(tok, 2 * cg + 1, 512));
          const uint32_t gv[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
#pragma unroll
          for (int i = 0; i < 8; ++i) gr[i] = __uint_as_float(gv[i]);
        } else {
          const uint4 gw = *reinterpret_cast<const uint4*>(raw + kFRawG + raw_offset(tok, cg, 256));
          const uint32_t gv[4] = {gw.x, gw.y, gw.z, gw.w};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            gr[2 * i] = lo_f32<kFp16>(gv[i]);
            gr[2 * i + 1] = hi_f32<kFp16>(gv[i]);
          }
        }
        const float4 cb0 = *reinterpret_cast<const float4*>(cbv + c0);
        const float4 cb1 = *reinterpret_cast<const float4*>(cbv + c0 + 4);
        const float cb[8] = {cb0.x, cb0.y, cb0.z, cb0.w, cb1.x, cb1.y, cb1.z, cb1.w};
        // G: the inclusive scan of a over the chunk's 16 tokens (the 16 lanes of this channel
        // group).
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          float x = valid ? log2_decay_lower_bound(gr[i], ca, cb[i], lb2) : 0.f;
#pragma unroll
          for (int d = 1; d < 16; d *= 2) {
            const float y = __shfl_up_sync(0xffffffffu, x, d, 16);
            if (tok >= d) x += y;
          }
          G[i] = x;
        }
      }
      // Two exponentials per element, anchored at the chunk's start: e^G and e^-G (G in
      // [-16 x 5 log2 e, 0]: both factors within 2^+-116, normal fp32 and tf32 numbers), and
      // e^(G_L - G) = e^-G e^(G_L) with e^(G_L) the last token's e^G (a shuffle from lane 15).
      uint32_t qgw[4], qaw[8], kaw[8], kdw[8];
      float eg[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        eg[i] = fast_exp2(G[i]);
        const float ieg = fast_exp2(-G[i]);
        const float egl = __shfl_sync(0xffffffffu, eg[i], 15, 16);
        const float qgv = q[i] * eg[i];
        if constexpr (kQ) {
          if (i & 1)
            qgw[i >> 1] = pack_bf16(__uint_as_float(qgw[i >> 1]), qgv);
          else
            qgw[i >> 1] = __float_as_uint(qgv);
        }
        const float kdv = k[i] * ieg;
        kbt[rec16_kbt(c0 + i, tok)] = out_bits<false>(kdv * egl);
        if constexpr (kQ) qaw[i] = f32_to_tf32(qgv);
        kaw[i] = f32_to_tf32(k[i] * eg[i]);
        kdw[i] = f32_to_tf32(kdv);
      }
      if constexpr (kQ)
        *reinterpret_cast<uint4*>(rec + kR16OffQg + 2 * rec16_b16(tok, c0)) =
            make_uint4(qgw[0], qgw[1], qgw[2], qgw[3]);
      uint4* qa4 = reinterpret_cast<uint4*>(qa + tok * kFOpPitch + c0);
      uint4* ka4 = reinterpret_cast<uint4*>(ka + tok * kFOpPitch + c0);
      uint4* kd4 = reinterpret_cast<uint4*>(kd + tok * kFOpPitch + c0);
      if constexpr (kQ) {
        qa4[0] = make_uint4(qaw[0], qaw[1], qaw[2], qaw[3]);
        qa4[1] = make_uint4(qaw[4], qaw[5], qaw[6], qaw[7]);
      }
      ka4[0] = make_uint4(kaw[0], kaw[1], kaw[2], kaw[3]);
      ka4[1] = make_uint4(kaw[4], kaw[5], kaw[6], kaw[7]);
      kd4[0] = make_uint4(kdw[0], kdw[1], kdw[2], kdw[3]);
      kd4[1] = make_uint4(kdw[4], kdw[5], kdw[6], kdw[7]);
      if (tok == 15) {
        float4* g4 = reinterpret_cast<float4*>(rec + kR16OffGL + 4 * c0);
        g4[0] = make_float4(eg[0], eg[1], eg[2], eg[3]);
        g4[1] = make_float4(eg[4], eg[5], eg[6], eg[7]);
      }
    }
    // The v tile: raw stage -> stage, 32 bytes a thread (the same layout).
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      const int o = 16 * (lt + kFGroupThreads * m);
      *reinterpret_cast<uint4*>(rec + kRecord16Bytes + o) =
          *reinterpret_cast<const uint4*>(raw + kFRawV + o);
    }
    clk.mark(2);
    sync();
    clk.mark(3);
    // -- Gram products: warp lw sums over key columns [32 lw, 32 lw + 32): Akk = ka kd^T,
    // Aqk = qa kd^T (tf32 m16n8k8; A (row g | g + 8, k c | c + 4), B (k c | c + 4, column g)).
    {
      float acck[2][4] = {}, accq[2][4] = {};
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        const int k0 = 32 * lw + 8 * ks;
        uint32_t ak[4], aq[4];
        fused_a_frag(ka, kFOpPitch, k0, g, c, ak);
        if constexpr (kQ) fused_a_frag(qa, kFOpPitch, k0, g, c, aq);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const int s = 8 * nt + g;
          const uint32_t b0 = __float_as_uint(kd[s * kFOpPitch + k0 + c]);
          const uint32_t b1 = __float_as_uint(kd[s * kFOpPitch + k0 + c + 4]);
          mma_tf32(acck[nt], ak, b0, b1);
          if constexpr (kQ) mma_tf32(accq[nt], aq, b0, b1);
        }
      }
      float* part = reinterpret_cast<float*>(gs + kFGPart) + lw * 512;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = g + 8 * (e >> 1), s = 8 * nt + 2 * c + (e & 1);
          part[t * 16 + s] = acck[nt][e];
          if constexpr (kQ) part[256 + t * 16 + s] = accq[nt][e];
        }
    }
    clk.mark(4);
    sync();
    clk.mark(5);
    // -- The four partials summed: M^T (b_t Akk[t][s], s < t, at [s][t]) and the record's Aqk
    // (s <= t, tf32; zero above the diagonal). Thread: elements (t, s) = (i / 16, i % 16) for
    // i = lt, lt + 128.
    {
      const float* part = reinterpret_cast<const float*>(gs + kFGPart);
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        const int i = lt + kFGroupThreads * m, t = i >> 4, s = i & 15;
        float sk = 0.f, sq = 0.f;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          sk += part[512 * w + i];
          if constexpr (kQ) sq += part[512 * w + 256 + i];
        }
        mt[s * kFMPitch + t] = s < t ? bet[t] * sk : 0.f;
        if constexpr (kQ)
          reinterpret_cast<float*>(rec + kR16OffAqk)[rec16_f32(t, s)] =
              s <= t ? tf32_round(sq) : 0.f;
      }
    }
    clk.mark(6);
    sync();
    clk.mark(7);
    // -- X = (I + M)^-1 by forward substitution, lane s < 16 of the group's warp 0 holding column
    // s (updates of every later row as soon as x_r is known: a chain of 16 FMAs); Tm = X diag(b).
    // Row r of M^T is read in 16-byte runs from the first run holding a column t > r (36
    // broadcast reads).
    if (lw == 0) {
      const int s = lane & 15;
      float acc[16];
#pragma unroll
      for (int t = 0; t < 16; ++t) acc[t] = t == s ? 1.f : 0.f;
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        const float xr = acc[r];
#pragma unroll
        for (int q4 = (r + 1) / 4; q4 < 4; ++q4) {
          const float4 m4 = *reinterpret_cast<const float4*>(mt + r * kFMPitch + 4 * q4);
          const float m[4] = {m4.x, m4.y, m4.z, m4.w};
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (4 * q4 + e > r) acc[4 * q4 + e] = fmaf(-m[e], xr, acc[4 * q4 + e]);
        }
      }
      const float bs = bet[s];
      if (lane < 16) {
        float* tmr = reinterpret_cast<float*>(rec + kR16OffTm);
#pragma unroll
        for (int t = 0; t < 16; ++t) {
          const float v = tf32_round(acc[t] * bs);
          tms[t * kFMPitch + s] = v;
          tmr[rec16_f32(t, s)] = v;
        }
      }
    } else {
      // Meanwhile warps 1-3: chunk j + 2's beta, then chunk j + 4's loads into chunk j's raw
      // stage (its q, k, g and v were last read before the Gram products' barrier; its beta,
      // which the solve still reads, is not a cp.async destination).
      put_beta(j + 2);
      issue(j + 4);
    }
    clk.mark(8);
    sync();
    clk.mark(9);
    // -- W = Tm ka: warp lw, key columns [32 lw, 32 lw + 32) (4 n-tiles, 2 k-steps).
    {
      uint16_t* wr = reinterpret_cast<uint16_t*>(rec + kR16OffW);
      float acc[4][4] = {};
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        const int sk0 = 8 * ks;
        uint32_t a[4];
        fused_a_frag(tms, kFMPitch, sk0, g, c, a);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const int col = 32 * lw + 8 * nt + g;
          mma_tf32(acc[nt], a, __float_as_uint(ka[(sk0 + c) * kFOpPitch + col]),
                   __float_as_uint(ka[(sk0 + c + 4) * kFOpPitch + col]));
        }
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int col = 32 * lw + 8 * nt + 2 * c;
        *reinterpret_cast<uint32_t*>(wr + rec16_b16(g, col)) = pack_bf16(acc[nt][0], acc[nt][1]);
        *reinterpret_cast<uint32_t*>(wr + rec16_b16(g + 8, col)) =
            pack_bf16(acc[nt][2], acc[nt][3]);
      }
    }
    clk.mark(10);
  };

  // Chunks j = gp, gp + 2, ...: the raw inputs of j + 2 are in flight while j is prepared; those
  // of j + 4 are issued during j's solve (prepare).
  issue(gp);
  put_beta(gp);
  issue(gp + 2);
  cp_async_wait<1>();  // chunk gp's raw inputs
  sync();
  for (int64_t j = gp; j < f.nchunks; j += kFGroups) {
    if (!kSeg || j >= f.out_from)
      prepare(j, std::true_type{});
    else
      prepare(j, std::false_type{});
    cp_async_wait<1>();   // chunk j + 2's raw inputs (j + 4's may be in flight)
    fence_proxy_async();  // the record's generic stores before the consumers' wgmma reads
    sync();
    if (lt == 0) mbar_arrive(f.bar_full + 8 * static_cast<int>(j % kFStages));
    clk.mark(11);
  }
  cp_async_wait<0>();
  clk.report("producer", (f.nchunks - gp + kFGroups - 1) / kFGroups);
}

// ---- The consumers: warp rg (0..7) holds S^T rows [16 rg, 16 rg + 16), all 128 key columns.
template <bool kFp16>
__device__ __forceinline__ void fused_consumer(const Params& p, const FusedCta& f, int tid) {
  const int lane = tid & 31, rg = tid >> 5, g = lane >> 2, c = lane & 3, vw = 16 * rg;
  const SeqSpan& sp = f.sp;
  const SegRole& role = f.role;
  float accS[16][4];
  int64_t slot = rules::kNoSlot;
  if (p.has_state_pool) slot = rules::pool_slot(p.state_indices.load(f.n), p.state_pool.rows);
  if (!role.first) {
    if (role.from_start)
      load_state(accS, p.seg_start, false, role.slot, f.hv, vw, 0, g, c);
    else
      init_segment_state(accS, role.trans, vw, 0, g, c);
  } else if (slot >= 0) {
    load_state(accS, p.state_pool, p.kfirst, slot, f.hv, vw, 0, g, c);
  } else if (!p.has_state_pool && p.initial_state.data != nullptr) {
    load_state(accS, p.initial_state, p.kfirst, f.n, f.hv, vw, 0, g, c);
  } else {
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) accS[j][e] = 0.f;
  }
  int64_t ck_lo = 0, ck_hi = 0;
  if (role.outputs && p.checkpoint_every > 0) {
    ck_lo = p.checkpoint_offsets.load(f.n);
    const int64_t hi = p.checkpoint_offsets.load(f.n + 1);
    ck_hi = hi < p.checkpoints.rows ? hi : p.checkpoints.rows;
  }
  uint8_t* otile = f.smem + kFOffOut + rg * 512;
  const uint32_t o_s = f.s0 + kFOffOut + rg * 512;
  uint16_t* obase = static_cast<uint16_t*>(p.out.data);
  // This lane's output offset (token row lane / 2, 16-byte chunk lane & 1 of its warp's 16 value
  // columns) at chunk 0; per chunk + 16 token rows.
  const int64_t ooff0 = p.out.offset(sp.b, sp.bos + (lane >> 1), f.hv) + vw + 8 * (lane & 1);
  PhaseClock clk;  // phases: 0 wait for the stage, 1 the step and outputs, 2 release, checkpoint
  clk.start(f.smem + kFOffPhase);

  for (int64_t j = 0; j < f.nchunks; ++j) {
    const int st = static_cast<int>(j % kFStages);
    const uint32_t sbase = f.s0 + st * kFStageBytes;
    mbar_wait(f.bar_full + 8 * st, static_cast<uint32_t>((j / kFStages) & 1));
    clk.mark(0);
    const int L =
        static_cast<int>(sp.len - j * kChunk16 < kChunk16 ? sp.len - j * kChunk16 : kChunk16);
    float accO[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) accO[i][e] = 0.f;
    step_wgmma16<kFp16>(accS, accO, f.smem + st * kFStageBytes, sbase, sbase + kRecord16Bytes, rg,
                        lane, kHeadDim);
    // Outputs: O^T (16 value rows x 16 tokens of this warp) -> the warp's tile (stmatrix.trans)
    // -> out, 32 bytes per token row; while the state update runs.
    if (role.outputs && j >= f.out_from) {
      __syncwarp();
      const int row = ((lane >> 4) << 3) + (lane & 7);
      stmatrix_x4_trans(
          o_s + out_tile_offset(row, (lane >> 3) & 1), pack_out<kFp16>(accO[0][0], accO[0][1]),
          pack_out<kFp16>(accO[0][2], accO[0][3]), pack_out<kFp16>(accO[1][0], accO[1][1]),
          pack_out<kFp16>(accO[1][2], accO[1][3]));
      __syncwarp();
      const int r = lane >> 1, ch = lane & 1;
      if (r < L) {
        const uint4 x = *reinterpret_cast<const uint4*>(otile + out_tile_offset(r, ch));
        store_out16(obase, ooff0 + j * kChunk16 * p.out.s1, x, p.out.vec);
      }
    }
    step16_done(accS);
    clk.mark(1);
    __syncwarp();
    if (lane == 0) mbar_arrive(f.bar_empty + 8 * st);  // this warp is done with the stage
    // Checkpoint: the state after every checkpoint_every tokens (full chunks only).
    if (role.outputs && j >= f.out_from && p.checkpoint_every > 0 && L == kChunk16) {
      const int64_t done = role.tok0 + (j + 1) * kChunk16;
      if (done % p.checkpoint_every == 0) {
        const int64_t row = ck_lo + done / p.checkpoint_every - 1;
        if (row >= 0 && row < ck_hi)
          store_state(accS, p.checkpoints, p.kfirst, row, f.hv, vw, 0, g, c);
      }
    }
    clk.mark(2);
  }
  clk.report("consumer", f.nchunks);
  if (role.last) {
    if (!p.has_state_pool && p.final_state.data != nullptr)
      store_state(accS, p.final_state, p.kfirst, f.n, f.hv, vw, 0, g, c);
    if (slot >= 0) store_state(accS, p.state_pool, p.kfirst, slot, f.hv, vw, 0, g, c);
  } else if (role.end_row >= 0) {  // a segment's end state that is not the sequence's
    store_state(accS,
                role.trans                 ? p.seg_trans
                : role.first && !role.warm ? p.seg_start
                                           : p.seg_local,
                false, role.end_row, f.hv, vw, 0, g, c);
  }
}

// Varlen batches of 2..kFusedOrderMaxN sequences: CTA b takes the sequence of rank b / HV in the
// order of decreasing length (ties by index), so that the longest sequences start first and none
// runs alone at the end of the grid; every CTA ranks the sequences itself (one cu_seqlens value a
// thread, then each thread counts the sequences before its own), with no workspace.
inline constexpr int kFusedOrderMaxN = 64;
__device__ __forceinline__ int64_t fused_sequence_of_rank(const Params& p, int64_t rank,
                                                          uint8_t* smem) {
  int64_t* lens = reinterpret_cast<int64_t*>(smem);  // [N]
  int64_t* found = lens + kFusedOrderMaxN;
  const int tid = threadIdx.x;
  const int N = static_cast<int>(p.N);
  if (tid < N) lens[tid] = seq_span(p, tid).len;
  __syncthreads();
  if (tid < N) {
    int64_t r = 0;
    for (int j = 0; j < N; ++j)
      r += lens[j] > lens[tid] || (lens[j] == lens[tid] && j < tid) ? 1 : 0;
    if (r == rank) *found = tid;
  }
  __syncthreads();
  const int64_t n = *found;
  __syncthreads();  // the scratch is the producer's before it is read again
  return n;
}

// Warm-up segments (Params::seg_pass = 3; heuristics/prefill.h fused_choice; docs/design.md
// 6.10). A zero start w chunks before a segment's first chunk leaves, at the segment's start, the
// error E = prod_t (I - b_t k_t k_t^T) D_t E_0 over the warm-up's tokens, E_0 the true state
// there. With l2norm (|k| <= 1) and beta in (0, 2), |I - b k k^T| <= 1, so
// |E| <= 2^(sum_t max_k a_t,k) |E_0| (a: log2 decays, <= 0). The walk goes back from chunk c0 of
// the sequence, 64 tokens a step (a thread per token and 16 key channels: the largest gate
// argument gives the token's largest decay), and returns the first chunk at which the sum reaches
// -p.warm_log2_bound (Tuning::prefill_warm_bits: the dropped state at most 2^-bits of the state it
// replaces), or 0 when the walk reaches the sequence's start (the segment then runs exactly, from
// the initial state), or -1 past warm_max_chunks chunks. All threads of the CTA; `scratch`:
// 64 floats and one int64.
__device__ __forceinline__ int64_t fused_warm_start(const Params& p, const SeqSpan& seq, int hv,
                                                    int64_t c0, uint8_t* scratch) {
  if (c0 <= 0) return 0;
  float* const a = reinterpret_cast<float*>(scratch);  // [64]: the tokens' largest log2 decay
  int64_t* const res = reinterpret_cast<int64_t*>(scratch + 256);
  const int tid = static_cast<int>(threadIdx.x), tl = tid >> 3, cg = tid & 7;
  const float exp_a = p.A_log ? expf(p.A_log[hv * p.A_log_s]) : 1.f;
  const float ca = -exp_a * kLog2e, lb2 = p.lower_bound * kLog2e;
  float cb[16];
#pragma unroll
  for (int e = 0; e < 16; ++e)
    cb[e] = p.dt_bias ? ca * p.dt_bias[hv * p.dt_bias_s + 16 * cg + e] : 0.f;
  float sum = 0.f;  // thread 0: the walked chunks' sum
  for (int64_t c = c0;; c -= 4) {
    const int64_t t =
        (c - 4) * kChunk16 + tl;  // this thread's token in the sequence (c0 * 16 <= len)
    float y = -INFINITY;          // the largest gate argument: decay = lb2 * sigmoid(-y ln 2)
    if (t >= 0) {
      const int64_t off = p.g.offset(seq.b, seq.bos + t, hv) + 16 * cg;
#pragma unroll
      for (int e = 0; e < 16; ++e)
        y = fmaxf(y, fmaf(ca, load_any(p.g.data, p.g.dtype, off + e), cb[e]));
    }
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) y = fmaxf(y, __shfl_xor_sync(0xffffffffu, y, o));
    if (cg == 0)
      a[tl] = t >= 0 ? lb2 * __fdividef(1.f, 1.f + fast_exp2(fminf(y, 80.f * kLog2e))) : 0.f;
    __syncthreads();
    if (tid == 0) {
      int64_t r = -2;  // -2: walk on
      for (int q = 3; q >= 0 && r == -2; --q) {
        const int64_t cq = c - 4 + q;  // walked backwards: chunks c - 1, c - 2, ...
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < kChunk16; ++i) s += a[kChunk16 * q + i];
        sum += s;
        if (sum <= -p.warm_log2_bound || cq <= 0)
          r = cq > 0 ? cq : 0;
        else if (c0 - cq >= p.warm_max_chunks)
          r = -1;
      }
      *res = r;
    }
    __syncthreads();
    const int64_t r = *res;
    __syncthreads();  // the scratch is rewritten by the next step
    if (r != -2) return r;
  }
}

// Walks of the warm-up pass since the process started, on this device: segments that ran [0] from
// the sequence's start, [1] from a zero state after a warm-up, [2] segments left to the exact
// passes (a testing hook: tests check which path their cases took; prefill_warm_counts).
static __device__ unsigned g_fused_warm_walks[3];

// kSeg: a pass of the segmented prefill (Params::seg_pass; segments.cuh, docs/design.md 6.5), one
// CTA per (segment slot, value head) and, in pass 1, per part: the segment's state from zero
// (S_local) or its transition (the identity's rows with zero values, Mt). With warm-up segments
// (Params::warm_flags), the warm-up pass (seg_pass = 3, one CTA per segment slot and value head)
// runs first, and passes 1 and 2 only for the pairs it left.
template <bool kFp16, bool kSeg = false>
__global__ void __launch_bounds__(kFusedThreads, 1) fused_kernel(const __grid_constant__ Params p) {
  pdl_prologue();
  extern __shared__ __align__(128) uint8_t smem_raw[];
  FusedCta f;
  f.smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  f.s0 = smem_addr(f.smem);
  if constexpr (kSeg) {
    if (p.seg_pass == 3) {
      const int64_t slot = blockIdx.x / static_cast<unsigned>(p.HV);
      f.hv = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.HV));
      const SegTask task = seg_task(p, slot);
      if (!task.valid) return;
      const int64_t c0 = task.j * (p.seg_tokens / kChunk16);
      const int64_t w0 = fused_warm_start(p, task.seq, f.hv, c0, f.smem + kFOffOrder);
      if (threadIdx.x == 0) {
        p.warm_flags[slot * p.HV + f.hv] = w0 < 0 ? 1 : 0;
        atomicAdd(&g_fused_warm_walks[w0 < 0 ? 2 : w0 > 0 ? 1 : 0], 1u);
      }
      if (w0 < 0) return;
      const SeqSpan seg = segment_span(p, task.seq, task.j);
      f.n = task.n;
      f.role.slot = slot;
      f.role.first = w0 == 0;
      f.role.last = false;  // the final state goes through seg_local (the scan copies it)
      f.role.warm = true;
      f.role.end_row = task.j == task.count - 1 ? slot : -1;
      f.role.tok0 = w0 * kChunk16;
      f.sp = task.seq;
      f.sp.bos = task.seq.bos + w0 * kChunk16;
      f.sp.len = seg.bos + seg.len - f.sp.bos;
      f.out_from = c0 - w0;
    } else {
      const unsigned parts = p.seg_pass == 1 ? 2u : 1u;
      const int64_t pair = blockIdx.x / parts;
      f.hv = static_cast<int>(pair % p.HV);
      const SegTask task = seg_task(p, pair / p.HV);
      f.role = segment_role(p, task, pair / p.HV, blockIdx.x % parts == 1);
      if (f.role.idle) return;
      if (!exact_pass_needed(p, SegRange{pair / p.HV - task.j, task.count}, f.hv)) return;
      f.n = task.n;
      f.sp = segment_span(p, task.seq, task.j);
    }
  } else {
    f.hv = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.HV));
    f.n = blockIdx.x / static_cast<unsigned>(p.HV);
    if (p.varlen && p.N > 1 && p.N <= kFusedOrderMaxN)
      f.n = fused_sequence_of_rank(p, f.n, f.smem + kFOffOrder);
    f.sp = seq_span(p, f.n);
  }
  f.h = f.hv / p.groups;
  f.nchunks = (f.sp.len + kChunk16 - 1) / kChunk16;
  f.bar_full = f.s0 + kFOffBar;
  f.bar_empty = f.bar_full + 8 * kFStages;
  const int tid = threadIdx.x;
  if (tid < kHeadDim) {  // the gate's per-key constants (exp(A_log) dt_bias in log2 units)
    const float ca = -(p.A_log ? expf(p.A_log[f.hv * p.A_log_s]) : 1.f) * kLog2e;
    reinterpret_cast<float*>(f.smem + kFOffCb)[tid] =
        ca * (p.dt_bias ? p.dt_bias[f.hv * p.dt_bias_s + tid] : 0.f);
  }
  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < kFStages; ++i) {
      mbar_init(f.bar_full + 8 * i, 1);
      mbar_init(f.bar_empty + 8 * i, kFConsumerThreads / 32);
    }
    fence_mbar_init();
  }
  __syncthreads();
  if (tid >= kFConsumerThreads) {
    setmaxnreg_dec<kFProducerRegs>();
    fused_producer<kFp16, kSeg>(p, f, tid - kFConsumerThreads);
  } else {
    setmaxnreg_inc<kFConsumerRegs>();
    fused_consumer<kFp16>(p, f, tid);
  }
}

}  // namespace kda::cuda::pf
