// heuristics.h — launch choices of the CUDA prefill, as pure host functions (tested on the CPU in
// tests/test_gpu_prefill.cpp; no CUDA headers).
#pragma once

#include <cstdint>
#include <cstdlib>

namespace kda::cuda::pf {

// The launch knobs' environment values. env_off: exactly "0" (a feature that is on by default,
// turned off). env_digits: a string of decimal digits as a number (saturating at 1e6); -1 for
// null, empty or anything else.
inline bool env_off(const char* env) { return env != nullptr && env[0] == '0' && env[1] == '\0'; }
inline long env_digits(const char* env) {
  if (env == nullptr || env[0] == '\0') return -1;
  long v = 0;
  for (const char* c = env; *c != '\0'; ++c) {
    if (*c < '0' || *c > '9') return -1;
    if (v < 1000000) v = 10 * v + (*c - '0');
  }
  return v;
}

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

// Forced value split for tests and timing (env KDA_CUDA_PREFILL_VS): 16, 32, 64 or 128 replace
// recurrence_value_split's choice; anything else (or unset) returns 0 = no override.
inline int recurrence_value_split_override(const char* env) {
  const long v = env_digits(env);
  return (v == 16 || v == 32 || v == 64 || v == 128) && env[0] != '0' ? static_cast<int>(v) : 0;
}

// The recurrence's K split (two warps per 16 value rows, each half of the key columns; see
// recurrence.cuh) for blocks of vs <= 32 columns (2 warps otherwise: half the SM's schedulers
// idle), whose shared memory then still fits one block per SM. On by default (measured on the
// H200, session 3: P5 3.93 -> 3.60 ms, P7 0.296 -> 0.267 ms); env = "0" (from
// KDA_CUDA_PREFILL_KSPLIT) turns it off, for differential tests and timing. At vs = 64 (P2: 4 ->
// 8 warps, in a compact shared-memory layout) it was measured slower (session 4: P2 1.327 vs
// 1.232 ms) and removed.
inline bool recurrence_k_split(int vs, const char* env) { return vs <= 32 && !env_off(env); }

// The recurrence on wgmma (one warpgroup per 64 value rows, record operands read from shared
// memory once per warpgroup instead of once per warp) for blocks of vs >= 64 columns; the
// mma.sync path stays for vs <= 32 (the K split) and as the differential baseline. On by default;
// env = "0" (from KDA_CUDA_PREFILL_WGMMA) turns it off.
inline bool recurrence_wgmma(int vs, const char* env) { return vs >= 64 && !env_off(env); }

// The chunk-16 path (16-token records and recurrence steps; wgmma recurrences only): by default for
// blocks of vs = 128 (pairs >= 70% of the SMs), where the prepare kernel's saved work (no
// off-diagonal 16-token blocks) outweighs the four times as many recurrence steps. Measured on the
// H200 (session 11, ms, chunk 64 -> 16): P1 1.265 -> 1.172, P3 1.298 -> 1.124, P4 1.299 -> 1.132,
// P6 3.146 -> 2.748; at vs = 64 it loses (P2 0.909 -> 0.982: half the value columns per block,
// the same steps). env (KDA_CUDA_PREFILL_CHUNK): "16" forces it on any wgmma recurrence, "64"
// forces chunk 64; anything else keeps the default.
inline bool prefill_chunk16(bool wgmma, int vs, const char* env) {
  const long v = env_digits(env);
  if (!wgmma || v == 64) return false;
  return v == 16 || vs == 128;
}

// The recurrence's configuration for a call (the functions above under the environment's knobs),
// in one place for the host (host.h), the tests and the emulator: value split (KDA_CUDA_PREFILL_VS
// or the heuristic for `pairs` sequence x value-head pairs on num_sms SMs), K split, wgmma, chunk 16.
struct RecurrenceChoice {
  int vs = 128;
  bool ksplit = false, wgmma = false, chunk16 = false;
};
inline RecurrenceChoice recurrence_choice_for_split(int vs) {
  RecurrenceChoice r;
  r.vs = vs;
  r.ksplit = recurrence_k_split(vs, std::getenv("KDA_CUDA_PREFILL_KSPLIT"));
  r.wgmma = recurrence_wgmma(vs, std::getenv("KDA_CUDA_PREFILL_WGMMA"));
  r.chunk16 = prefill_chunk16(r.wgmma, vs, std::getenv("KDA_CUDA_PREFILL_CHUNK"));
  return r;
}
inline RecurrenceChoice recurrence_choice(int64_t pairs, int num_sms) {
  const int forced = recurrence_value_split_override(std::getenv("KDA_CUDA_PREFILL_VS"));
  return recurrence_choice_for_split(forced ? forced : recurrence_value_split(pairs, num_sms));
}

// L2 prefetch distance of the prepare kernel, in blocks (0: off): each block prefetches the q, k,
// g rows of block (its index + this). Off by default: at 2 x SMs (about one block life ahead)
// it was measured slower on the H200 (session 4: P1 1.932 vs 1.835 ms, P6 4.491 vs 4.200; the
// prefetched lines compete with the record writes in L2). env (KDA_CUDA_PREFILL_PREFETCH): digits
// set the distance ("264": the measured setting; tests: "1" exercises it on small grids), "auto"
// means 2 x SMs, anything else is off.
inline int prepare_prefetch_blocks(int num_sms, const char* env) {
  if (env != nullptr && env[0] == 'a' && env[1] == 'u' && env[2] == 't' && env[3] == 'o' && env[4] == '\0')
    return 2 * num_sms;
  const long v = env_digits(env);
  return v > 0 ? static_cast<int>(v) : 0;
}

// Chunk slots of the workspace (records of one chunk per value head): dense, every sequence owns
// ceil(T / 64) slots; varlen, sequence n owns slots from cu[n] / 64 + n on, which stays below
// T / 64 + N whatever the (device-side, unread) cu_seqlens values are.
inline int64_t prefill_chunk_slots(bool varlen, int64_t B, int64_t T, int64_t N) {
  if (varlen) return N > 0 ? T / 64 + N : 0;
  return B * ((T + 63) / 64);
}

}  // namespace kda::cuda::pf
