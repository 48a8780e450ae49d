// prefill.h — launch choices of the CUDA prefill, as pure host functions of the problem's sizes,
// the device's multiprocessor count and the tuning struct (no CUDA headers, no environment reads;
// tested in the CPU build, tests/test_heuristics.cpp).
//
// The choice (prefill_plan) is the configuration of least predicted time: segments (none, or 128,
// 256, ... tokens) x value split (16, 32, 64, 128) x 16- or 64-token records, under a model whose
// constants were measured on the H200 (bench_gpu_prefill --sweep; docs/design.md section 6.5).
// Worked examples (132 SMs, default tuning): P1 = 1 x 8192, HV = 96 -> no segments, vs = 128 on
// 16-token steps (96 blocks, one wave); P5 = 1 x 32768, HV = 32 -> segments of 8192 tokens, vs =
// 128, 64-token steps; S11 = 1 x 65536, HV = 4 -> segments of 2048 tokens (32 per sequence).
#pragma once

#include <cstdint>

#include "core/tuning.h"

namespace kda::cuda::pf {

// Value columns per recurrence block (vs): the recurrence of one (sequence, value head) is
// independent per value column, so V = 128 may be split across 128 / vs blocks of vs / 16 warps
// each (one block per SM: ~211 KB of shared memory at vs = 128). A split re-reads the chunk's
// shared operands (W, qg, kbT, Aqk, Tm: ~80 KB) once per slice; the plan below weighs it.

// The recurrence's K split (two warps per 16 value rows, each half of the key columns; see
// recurrence.cuh) for blocks of vs <= 32 columns (2 warps otherwise: half the SM's schedulers
// idle), whose shared memory then still fits one block per SM. On by default (measured on the
// H200: P5 3.93 -> 3.60 ms, P7 0.296 -> 0.267 ms); Tuning::prefill_ksplit = false turns it off,
// for differential tests and timing. At vs = 64 (P2: 4 -> 8 warps, in a compact shared-memory
// layout) it was measured slower (P2 1.327 vs 1.232 ms) and removed.
inline bool recurrence_k_split(int vs, const detail::Tuning& t) {
  return vs <= 32 && t.prefill_ksplit;
}

// The recurrence on wgmma (one warpgroup per 64 value rows, record operands read from shared
// memory once per warpgroup instead of once per warp) for blocks of vs >= 64 columns; the
// mma.sync path stays for vs <= 32 (the K split) and as the differential baseline (a tested
// reference: Tuning::prefill_wgmma = false runs it at every vs).
inline bool recurrence_wgmma(int vs, const detail::Tuning& t) {
  return vs >= 64 && t.prefill_wgmma;
}

// The chunk-16 path (16-token records and recurrence steps; wgmma recurrences only): by default for
// blocks of vs = 128 (pairs >= 70% of the SMs), where the prepare kernel's saved work (no
// off-diagonal 16-token blocks) outweighs the four times as many recurrence steps. Measured on the
// H200 (ms, chunk 64 -> 16): P1 1.265 -> 1.172, P3 1.298 -> 1.124, P4 1.299 -> 1.132, P6 3.146 ->
// 2.748; at vs = 64 it loses (P2 0.909 -> 0.982: half the value columns per block, the same
// steps). Tuning::prefill_chunk = 16 forces it on any wgmma recurrence, 64 forces chunk 64.
inline bool prefill_chunk16(bool wgmma, int vs, const detail::Tuning& t) {
  if (!wgmma || t.prefill_chunk == 64) return false;
  return t.prefill_chunk == 16 || vs == 128;
}

// The recurrence's configuration at value split vs under the tuning struct: K split, wgmma, chunk
// 16 (the defaults of the functions above; prefill_plan may still take chunk 64 at vs = 128).
struct RecurrenceChoice {
  int vs = 128;
  bool ksplit = false, wgmma = false, chunk16 = false;
};
inline RecurrenceChoice recurrence_choice_for_split(int vs, const detail::Tuning& t) {
  RecurrenceChoice r;
  r.vs = vs;
  r.ksplit = recurrence_k_split(vs, t);
  r.wgmma = recurrence_wgmma(vs, t);
  r.chunk16 = prefill_chunk16(r.wgmma, vs, t);
  return r;
}

// L2 prefetch distance of the prepare kernel, in blocks (0: off): each block prefetches the q, k,
// g rows of block (its index + this). Off by default: at 2 x SMs (about one block life ahead)
// it was measured slower on the H200 (P1 1.932 vs 1.835 ms, P6 4.491 vs 4.200; the prefetched
// lines compete with the record writes in L2). Tuning::prefill_prefetch: a distance (264: the
// measured setting; tests: 1 exercises it on small grids), -1 for 2 x SMs, 0 off.
inline int prepare_prefetch_blocks(int num_sms, const detail::Tuning& t) {
  if (t.prefill_prefetch < 0) return 2 * num_sms;
  return t.prefill_prefetch;
}

// ---- Segments and the plan (docs/design.md sections 6.2 and 6.5). The state map of a token range
// is affine, S_end = S_start Mt + S_local (S^T rows), so a sequence splits into segments of
// `tokens` tokens (a multiple of 64) that run in parallel: pass 1 runs the first segment from the
// true initial state (its outputs are final) and every later segment but the last from zero
// (S_local) and from the identity with zero values (Mt: 128 more state rows); a scan gives every
// segment its true start; pass 2 reruns the later segments from it. Chains of pass 1 per
// (sequence, value head): 1 + 2 (s - 2); of pass 2: s - 1 (s segments). Varlen: the mean sequence
// length stands in for the (device-side) lengths; any choice is exact for every length.
struct PrefillPlan {
  int64_t segment_tokens = 0;  // tokens per segment; 0: one segment per sequence
  RecurrenceChoice rec;
  bool fused = false;  // the fused kernel (prefill/fused.cuh): one launch, no workspace
  bool warm = false;   // fused with warm-up segments (fused_choice), the exact passes as fallback
  double predicted_us = 0;
};

// The segment scan (prefill/segments.cuh): blocks of kScanRows rows of S^T, kScanBlocksPerHead
// per (sequence, value head).
inline constexpr int kScanRows = 16, kScanBlocksPerHead = 128 / kScanRows;

// The model (us; H200, fitted to bench_gpu_prefill --sweep over P1-P7 and S1-S11, where it picks
// configurations within 0.3% of the fastest measured on geomean): one recurrence block per SM, a
// 64-token chunk per block in 2.3 us on the one-warpgroup wgmma path (vs = 64), 2.9 us on two
// warpgroups (vs = 128), 4.0 us as four 16-token steps, 3.5 us on mma.sync; 12 us per recurrence
// pass beyond that; the prepare kernel 72 ns per 64-token record and value head (53 ns for four
// 16-token ones), at least 25 us; 4 us per scan step and wave of scan blocks; 4 us for the extra
// launches of a segmented call.
inline constexpr double kModelPassUs = 12, kModelScanStepUs = 4, kModelPrepareMinUs = 25;
// Segments' two extra launches (host time and launch gaps): a segmented plan must win by more.
inline constexpr double kModelSegmentLaunchUs = 4;
inline double model_chunk_us(const RecurrenceChoice& r) {
  if (r.chunk16) return 4.0;
  if (r.wgmma) return r.vs == 128 ? 2.9 : 2.3;
  return 3.5;
}
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
// Predicted time of a call: `len` tokens per sequence, `records` 64-token record slots per value
// head, N x HV (sequence, value head) pairs, segments of `tokens` (0: none).
inline double predicted_prefill_us(int64_t len, int64_t records, int64_t N, int64_t HV,
                                   int64_t tokens, const RecurrenceChoice& r, int sms) {
  const double prep = static_cast<double>(records * HV) * (r.chunk16 ? 0.053 : 0.072);
  const double prepare = prep > kModelPrepareMinUs ? prep : kModelPrepareMinUs;
  const int64_t pairs = N * HV, slices = 128 / r.vs;
  auto pass = [&](int64_t chains, int64_t chunks) {
    return static_cast<double>(ceil_div(chains * slices, sms) * chunks) * model_chunk_us(r) +
           kModelPassUs;
  };
  if (tokens <= 0) return prepare + pass(pairs, ceil_div(len, 64));
  const int64_t segs = ceil_div(len, tokens), chunks = tokens / 64;
  const int64_t inner = segs > 2 ? segs - 2 : 0;
  const double scan =
      static_cast<double>(inner * ceil_div(pairs * kScanBlocksPerHead, sms)) * kModelScanStepUs;
  return kModelSegmentLaunchUs + prepare + pass(pairs * (1 + 2 * inner), chunks) + scan +
         pass(pairs * (segs - 1), chunks);
}

// The lower-bound gate's bound above which a call counts as weak decay (weak_decay_gate): every
// output beyond its 16-token step takes the state through one bf16 rounding, which the 16-token
// path cannot afford when the state carries most of the output (docs/design.md section 6.2,
// accuracy). Output error of P1 on the 16-token path by bound (H200, bench_gpu_prefill
// --lower-bound; bar 2.5e-3): -0.05 2.83e-3, -0.2 2.19e-3, -0.5 1.91e-3, -1 1.81e-3, -2 1.77e-3;
// 64-token chunks at -0.05: 2.24e-3 (1.263 against 1.207 ms).
inline constexpr double kChunk16MinDecayBound = -0.5;
// Whether a call may be of weak decay: the lower-bound gate with a bound above
// kChunk16MinDecayBound, and every softplus or precomputed gate, whose decay is in the data (not
// read by the host). A Kimi-Linear / Mamba-style softplus initialization (A in [1, 16], dt in
// [0.001, 0.1]) is weak decay: case A's shape measures 2.92e-3 on 16-token steps and 2.50e-3 on
// 64 (CPU emulation of the kernels, tests/test_gpu_prefill.cpp KimiGateInit*).
inline bool weak_decay_gate(bool lower_bound_gate, double lower_bound) {
  return !lower_bound_gate || lower_bound > kChunk16MinDecayBound;
}

// The plan of least predicted time over the configurations the tuning struct allows: a forced
// segment size (Tuning::prefill_segment; -1: none), value split (prefill_vs) or record length
// (prefill_chunk) fixes that dimension. Segmented calls, and calls of weak decay (weak_decay_gate),
// take 64-token records unless 16 are forced: 16-token steps miss the output bar under weak decay
// (docs/design.md section 6.2, accuracy).
inline PrefillPlan prefill_plan(bool varlen, int64_t T, int64_t N, int64_t HV, int sms,
                                const detail::Tuning& t, bool weak_decay = false) {
  PrefillPlan best;
  best.rec = recurrence_choice_for_split(t.prefill_vs ? t.prefill_vs : 128, t);
  if (N <= 0 || T <= 0 || HV <= 0 || sms <= 0) return best;
  const int64_t len = varlen ? ceil_div(T, N) : T;  // tokens per sequence (varlen: the mean)
  const int64_t records = varlen ? T / 64 + N : N * ceil_div(T, 64);
  bool found = false;
  for (int64_t tokens = 0; tokens < len || tokens == 0; tokens = tokens == 0 ? 128 : 2 * tokens) {
    int64_t seg = tokens;
    if (t.prefill_segment < 0) seg = 0;
    if (t.prefill_segment > 0) seg = t.prefill_segment;
    for (int vs = 16; vs <= 128; vs *= 2) {
      if (t.prefill_vs && vs != t.prefill_vs) continue;
      for (int alt = 0; alt < 2; ++alt) {
        RecurrenceChoice r = recurrence_choice_for_split(vs, t);
        if (alt == 1) {  // 64-token records where 16 are the default (vs = 128), unless forced
          if (!r.chunk16 || t.prefill_chunk == 16) continue;
          r.chunk16 = false;
        }
        if (r.chunk16 && (seg > 0 || weak_decay) && t.prefill_chunk != 16) continue;
        const double us = predicted_prefill_us(len, records, N, HV, seg, r, sms);
        if (!found || us < best.predicted_us) {
          found = true;
          best.segment_tokens = seg;
          best.rec = r;
          best.predicted_us = us;
        }
      }
    }
    if (t.prefill_segment != 0 || len <= 128) break;  // forced, or nothing to split
  }
  return best;
}

// The fused kernel (prefill/fused.cuh; docs/design.md sections 6.7-6.9): 16-token steps whose
// decay is anchored at each chunk's start: e^G and e^-G within 2^(16 x 5 log2 e) = 2^115.4, normal
// fp32 numbers, while lower_bound >= -5 (the lower-bound gate; spec section 2 requires it). One
// CTA per SM; with segments its passes replace the two-kernel plan's (pass 1 over segments and
// transitions, the scan, pass 2). Forced (Tuning::prefill_fused = 1) it runs wherever it applies,
// with the segment size of least predicted time (or the forced one); by default where the decay is
// not weak (the 16-token steps' accuracy, weak_decay_gate), no value split or record length is
// forced (knobs of the two-kernel plan) and its model predicts less than the two-kernel plan's. The
// model: a 16-token chunk costs kFusedStepUs whatever the wave (one CTA per SM), plus kFusedPassUs
// per pass; the scan and the segments' extra launches as in predicted_prefill_us.
inline constexpr double kFusedMaxDecayBound = 5.0;
// Measured (bench_gpu_prefill, forced; docs/design.md 6.9): 2.5-2.6 us per chunk on P1, P4, P6
// and S8 (the model within 5% of each), so that it predicts less than the two-kernel plan on
// many-chain shapes such as P4 and P6, where it measured faster; the pass overhead as the
// two-kernel plan's.
inline constexpr double kFusedStepUs = 2.5, kFusedPassUs = 10;
inline bool fused_applies(bool lower_bound_gate, double lower_bound) {
  return lower_bound_gate && lower_bound >= -kFusedMaxDecayBound;
}
// len tokens per sequence, N x HV chains, segments of `tokens` (0: none) on `sms` SMs.
inline double predicted_fused_us(int64_t len, int64_t N, int64_t HV, int64_t tokens, int sms) {
  const int64_t pairs = N * HV;
  auto pass = [&](int64_t ctas, int64_t chunks) {
    return static_cast<double>(ceil_div(ctas, sms) * chunks) * kFusedStepUs + kFusedPassUs;
  };
  if (tokens <= 0) return pass(pairs, ceil_div(len, 16));
  const int64_t segs = ceil_div(len, tokens), chunks = tokens / 16;
  const int64_t inner = segs > 2 ? segs - 2 : 0;
  const double scan =
      static_cast<double>(inner * ceil_div(pairs * kScanBlocksPerHead, sms)) * kModelScanStepUs;
  return kModelSegmentLaunchUs + pass(pairs * (1 + 2 * inner), chunks) + scan +
         pass(pairs * (segs - 1), chunks);
}
struct FusedChoice {
  bool take = false;
  int64_t segment_tokens = 0;  // 0: one segment per sequence
  bool warm = false;           // warm-up segments (below), the exact passes as their fallback
  double predicted_us = 0;
};

// Warm-up segments (prefill/fused.cuh fused_warm_start; docs/design.md 6.10): every segment of the
// fused kernel's segmented plan starts from a zero state some 16-token chunks early, as many as a
// bound on the dropped state computed from the actual gates needs (at most
// Tuning::prefill_warm_chunks); one pass, no transitions, no scan. Segments whose bound is not
// reached within that go, with the rest of their (sequence, value head), to the exact passes,
// which run after it and skip every other pair. Applies where the bound holds: the fused kernel's
// gate (lower bound), l2norm and beta logits (|k| <= 1, beta in (0, 2)). Final states go through
// the workspace (the scan copies them), so pools and in-place states work alike. The model: a call
// is its longest wave of CTAs, each the segment's chunks plus the warm-up's at kFusedStepUs, plus
// the pass, the walk and the exact passes' empty launches (kWarmExtraUs). The warm-up a call's
// slowest head needs is in its data, grows like 1 / |lower_bound| and like the bound's bits
// (Tuning::prefill_warm_bits): kWarmChunksAt5 chunks at -5 and the default kWarmBits, scaled so.
// On targets.md's inputs the reference cases' times put the slowest CTA's warm-up at 24-32 chunks
// (H100, 16 bits); the two-kernel model they are compared with reads 15-30% low on the small cases
// (S1 74 us modelled against 88 measured, S2 100 against 142), and at 16 chunks the comparison
// picks the faster plan on every case but S1 and P7 (warm-up 0.092 and 0.207 ms against 0.088 and
// 0.206). Unsegmented calls and the first segment of each sequence need no warm-up.
inline constexpr double kWarmExtraUs = 8, kWarmChunksAt5 = 16;
inline constexpr int kWarmBits = detail::Tuning{}.prefill_warm_bits;
inline int64_t warm_chunks_estimate(double lower_bound, int bits = kWarmBits) {
  if (!(lower_bound < 0)) return INT64_MAX / 4;
  return static_cast<int64_t>(kWarmChunksAt5 * (5.0 / -lower_bound) * bits / kWarmBits + 0.999);
}
inline double predicted_warm_us(int64_t len, int64_t N, int64_t HV, int64_t tokens, int sms,
                                int64_t warm_chunks) {
  const int64_t segs = ceil_div(len, tokens);
  const int64_t chunks = ceil_div(len < tokens ? len : tokens, 16) + (segs > 1 ? warm_chunks : 0);
  return static_cast<double>(ceil_div(N * HV * segs, sms) * chunks) * kFusedStepUs + kFusedPassUs +
         kWarmExtraUs;
}
// len: tokens per sequence (varlen: the longest is not known on the host; the mean stands in, as
// in prefill_plan). The segment sizes tried: none, 128, 256, ... below len (or the forced one).
// warm_applies: the call meets the warm-up segments' conditions (above); lower_bound: its gate's.
inline FusedChoice fused_choice(const PrefillPlan& plan, int64_t len, int64_t N, int64_t HV,
                                int sms, const detail::Tuning& t, bool applies, bool weak_decay,
                                bool warm_applies = false, double lower_bound = -5.0) {
  FusedChoice best;
  if (!applies || t.prefill_fused < 0 || N <= 0 || HV <= 0 || sms <= 0) return best;
  bool found = false;
  for (int64_t tokens = 0; tokens < len || tokens == 0; tokens = tokens == 0 ? 128 : 2 * tokens) {
    int64_t seg = tokens;
    if (t.prefill_segment < 0) seg = 0;
    if (t.prefill_segment > 0) seg = t.prefill_segment;
    const double us = predicted_fused_us(len, N, HV, seg, sms);
    if (!found || us < best.predicted_us) {
      best.segment_tokens = seg;
      best.predicted_us = us;
      found = true;
    }
    if (t.prefill_segment != 0 || len <= 128) break;  // forced, or nothing to split
  }
  // Warm-up segments: of 64, 128, ... tokens below len (or the forced size), where the estimate
  // of the warm-up fits the budget (or forced).
  const int64_t warm = warm_chunks_estimate(lower_bound, t.prefill_warm_bits);
  if (warm_applies && !weak_decay && t.prefill_warm >= 0 && t.prefill_segment >= 0 &&
      (t.prefill_warm > 0 || warm <= t.prefill_warm_chunks)) {
    bool wfound = false;
    FusedChoice w;
    for (int64_t tokens = 64; tokens < len; tokens *= 2) {
      const int64_t seg = t.prefill_segment > 0 ? t.prefill_segment : tokens;
      const double us = predicted_warm_us(len, N, HV, seg, sms, warm);
      if (!wfound || us < w.predicted_us) {
        w.segment_tokens = seg;
        w.predicted_us = us;
        wfound = true;
      }
      if (t.prefill_segment > 0) break;
    }
    if (wfound && (t.prefill_warm > 0 || w.predicted_us < best.predicted_us)) {
      best.segment_tokens = w.segment_tokens;
      best.predicted_us = w.predicted_us;
      best.warm = true;
    }
  }
  // A forced value split or record length describes the two-kernel plan: it keeps that plan.
  const bool two_kernel_forced = t.prefill_vs != 0 || t.prefill_chunk != 0;
  best.take = t.prefill_fused > 0 || (best.warm && t.prefill_warm > 0) ||
              (!weak_decay && !two_kernel_forced && best.predicted_us < plan.predicted_us);
  if (!best.take) best.warm = false;
  return best;
}

// The single launch (prefill/single.cuh): the two-kernel plan's prepare and recurrence blocks in
// one cooperative launch with a grid barrier between them, where both fit one block per SM at
// once: one launch's host time instead of two (a launch costs ~2.5-3.5 us of host time, the bar
// of a call from C++ is 5 us; docs/perf_notes.md, "Host cost") and no kernel boundary on the GPU.
// Where the prepare blocks exceed the SMs the two-kernel plan runs them two per SM, which the
// single kernel (one block per SM: the recurrence's shared memory) cannot. Taken for unsegmented
// plans of the one-warpgroup-per-64-rows wgmma recurrence (chunk 64 or 16) when
// Tuning::prefill_single is on (off by default: on the H100 the single kernel's recurrence steps
// run slower than the recurrence kernel's, S1 0.099 against 0.089-0.090 ms, which outweighs the
// 1.5-3.5 us of host time it saves; docs/design.md, "Launches"); `prep_blocks` = chunk slots x
// value heads, `rec_blocks` = sequences x value heads x value slices.
inline bool single_launch(const PrefillPlan& plan, int64_t prep_blocks, int64_t rec_blocks, int sms,
                          const detail::Tuning& t) {
  if (!t.prefill_single || plan.fused || plan.segment_tokens > 0 || !plan.rec.wgmma ||
      plan.rec.ksplit)
    return false;
  return prep_blocks > 0 && rec_blocks > 0 && prep_blocks <= sms && rec_blocks <= sms;
}

// Segment slots (like chunk slots): dense, sequence n owns [n s, (n + 1) s), s = ceil(T / tokens);
// varlen, sequence n owns max(1, ceil(len / tokens)) slots from bos / tokens + n on, below T /
// tokens + N whatever the cu_seqlens values are.
inline int64_t prefill_segment_slots(bool varlen, int64_t B, int64_t T, int64_t N, int64_t tokens) {
  if (tokens <= 0 || N <= 0) return 0;
  if (varlen) return T / tokens + N;
  return B * ((T + tokens - 1) / tokens > 0 ? (T + tokens - 1) / tokens : 1);
}

// Chunk slots of the workspace (records of one chunk per value head): dense, every sequence owns
// ceil(T / 64) slots; varlen, sequence n owns slots from cu[n] / 64 + n on, which stays below
// T / 64 + N whatever the (device-side, unread) cu_seqlens values are.
inline int64_t prefill_chunk_slots(bool varlen, int64_t B, int64_t T, int64_t N) {
  if (varlen) return N > 0 ? T / 64 + N : 0;
  return B * ((T + 63) / 64);
}

}  // namespace kda::cuda::pf
