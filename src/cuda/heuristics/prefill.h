// prefill.h — launch choices of the CUDA prefill, as pure host functions of the problem's sizes,
// the device's multiprocessor count and the tuning struct (no CUDA headers, no environment reads;
// tested in the CPU build, tests/test_heuristics.cpp).
//
// Worked example (132 SMs, default tuning): P1 = one sequence of 8192 tokens, HV = 96: 96
// (sequence, value head) pairs -> value split 128 (96 blocks reach 70% of 132), no K split (vs >
// 32), wgmma (vs >= 64), chunk 16 (vs = 128); 128 x 64-token record slots. P5 = 1 x 32768, HV =
// 32: 32 pairs -> vs = 32 (128 blocks of 2 warps), K split on, mma.sync, chunk 64.
#pragma once

#include <cstdint>

#include "core/tuning.h"

namespace kda::cuda::pf {

// Value columns per recurrence block. The recurrence of one (sequence, value head) is independent
// per value column, so V = 128 may be split across 128 / vs blocks of vs / 16 warps each. Splitting
// re-reads the chunk's shared operands (W, qg, kbT, Aqk, Tm: ~80 KB) once per slice, so split only
// as far as needed to fill the GPU: the largest vs in {128, 64, 32, 16} whose block count reaches
// 70% of the multiprocessors (one block per SM: ~211 KB of shared memory at vs = 128).
// Worked examples on 132 SMs (threshold 92.4 blocks):
//   P1 1x8192, HV=96:  96 pairs -> vs = 128 (96 blocks: one wave, 8 warps each)
//   P2 1x8192, HV=64:  64 pairs -> vs = 64  (128 blocks)
//   P5 1x32768, HV=32: 32 pairs -> vs = 32  (128 blocks of 2 warps)
//   P6 16x4096, HV=32: 512 pairs -> vs = 128 (512 blocks, ~3.9 waves)
inline int recurrence_value_split(int64_t pairs, int num_sms) {
  for (int vs = 128; vs > 16; vs /= 2)
    if (pairs * (128 / vs) * 10 >= static_cast<int64_t>(num_sms) * 7) return vs;
  return 16;
}

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

// The recurrence's configuration for a call, in one place for the host (prefill/host.h), the tests
// and the emulator: value split (Tuning::prefill_vs, or the heuristic for `pairs` sequence x
// value-head pairs on num_sms SMs), K split, wgmma, chunk 16.
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
inline RecurrenceChoice recurrence_choice(int64_t pairs, int num_sms, const detail::Tuning& t) {
  return recurrence_choice_for_split(
      t.prefill_vs ? t.prefill_vs : recurrence_value_split(pairs, num_sms), t);
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

// ---- Segments (docs/design.md section 6.2). The state map of a token range is affine, S_end =
// S_start Mt + S_local (S^T rows), so a sequence splits into segments of `tokens` tokens (a multiple
// of 64) that run in parallel: pass 1 runs the first segment from the true initial state (its
// outputs are final) and every later segment but the last from zero (S_local) and from the
// identity with zero values (Mt: 128 more state rows); a scan gives every segment its true start;
// pass 2 reruns the later segments from it. Chains of pass 1 per (sequence, value head): 1 + 2 (s -
// 2); of pass 2: s - 1 (s segments).
//
// The choice is the fastest predicted by a model of one recurrence block per SM and 4.5 us per
// 64-token chunk and block at any value split (measured: vs = 128 chunk 16 ~4.1, vs = 32 K split
// ~3.1-4.4), 2 us per scan step and 6 us for the two extra launches, over segments of 128, 256, ...
// tokens; segments only where they beat one chain per sequence by 20%. Varlen: the mean sequence
// length stands in for the (device-side) lengths; any choice is exact for every length.
// Worked examples on 132 SMs (HV = heads):
//   S1  1 x 1024,  HV = 4:  128 tokens (8 segments; one chain: 72 us, segments ~36 us)
//   S11 1 x 65536, HV = 4:  2048 tokens (32 segments)
//   P1  1 x 8192,  HV = 96: none (96 chains already fill the SMs)
struct SegmentPlan {
  int64_t tokens = 0;  // tokens per segment; 0: one segment per sequence
  int64_t chains = 0;  // pass 1's chains (the value split's input)
};
inline constexpr double kModelChunkUs = 4.5, kModelScanStepUs = 2.0, kModelSegmentLaunchUs = 6.0;
// Predicted time of `chains` chains of `chunks` 64-token chunks at value split vs on `sms` SMs.
inline double recurrence_model_us(int64_t chains, int64_t chunks, int vs, int sms) {
  const int64_t blocks = chains * (128 / vs);
  return static_cast<double>((blocks + sms - 1) / sms) * static_cast<double>(chunks) *
         kModelChunkUs;
}
inline int64_t segment_chains_pass1(int64_t pairs, int64_t segments) {
  return pairs * (1 + 2 * (segments > 2 ? segments - 2 : 0));
}
inline SegmentPlan prefill_segments(bool varlen, int64_t T, int64_t N, int64_t HV, int sms,
                                    const detail::Tuning& t) {
  SegmentPlan plan;
  if (N <= 0 || T <= 0 || HV <= 0 || sms <= 0 || t.prefill_segment < 0) return plan;
  const int64_t len = varlen ? (T + N - 1) / N : T;  // tokens per sequence (varlen: the mean)
  const int64_t pairs = N * HV;
  if (t.prefill_segment > 0) {
    plan.tokens = t.prefill_segment;
    plan.chains = segment_chains_pass1(pairs, (len + plan.tokens - 1) / plan.tokens);
    return plan;
  }
  const double one = recurrence_model_us(pairs, (len + 63) / 64,
                                         t.prefill_vs ? t.prefill_vs : recurrence_value_split(pairs, sms), sms);
  double best = 0.8 * one;
  for (int64_t L = 128; L < len; L *= 2) {
    const int64_t segs = (len + L - 1) / L;
    const int64_t c1 = segment_chains_pass1(pairs, segs), c2 = pairs * (segs - 1);
    const int vs = t.prefill_vs ? t.prefill_vs : recurrence_value_split(c1, sms);
    const double us = recurrence_model_us(c1, L / 64, vs, sms) +
                      recurrence_model_us(c2, L / 64, vs, sms) +
                      static_cast<double>(segs > 2 ? segs - 2 : 0) * kModelScanStepUs +
                      kModelSegmentLaunchUs;
    if (us < best) {
      best = us;
      plan.tokens = L;
      plan.chains = c1;
    }
  }
  return plan;
}

// The whole launch choice of a call: segments, then the value split for their chains. Segmented
// calls stay on 64-token steps unless Tuning::prefill_chunk = 16 forces 16-token ones: the few-head
// cases that take segments gain little from the 16-token records' cheaper prepare kernel, and
// 16-token steps miss the output bar under weak decay (docs/design.md section 6.2, accuracy).
struct PrefillPlan {
  SegmentPlan seg;
  RecurrenceChoice rec;
};
inline PrefillPlan prefill_plan(bool varlen, int64_t T, int64_t N, int64_t HV, int sms,
                                const detail::Tuning& t) {
  PrefillPlan p;
  p.seg = prefill_segments(varlen, T, N, HV, sms, t);
  p.rec = recurrence_choice(p.seg.tokens > 0 ? p.seg.chains : N * HV, sms, t);
  if (p.seg.tokens > 0 && t.prefill_chunk != 16) p.rec.chunk16 = false;
  return p;
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
