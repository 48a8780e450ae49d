// common.cuh — device helpers of the CUDA prefill (prefill/prefill.cu): the kernel parameter block,
// strided views, the workspace record layout with its shared-memory swizzles, conversions.
// PTX wrappers live in common/ptx.cuh.
//
// Fragment notation used in both kernels (PTX ISA, "warp-level matrix fragments"): lane = 4 g + c
// (g = groupID 0..7, c = threadID_in_group 0..3).
//   m16n8k16 bf16  A: {(g, 2c..2c+1), (g+8, 2c..), (g, 2c+8..), (g+8, 2c+8..)}  B: {(2c.., g),
//   (2c+8.., g)} m16n8k8  tf32  A: {(g, c), (g+8, c), (g, c+4), (g+8, c+4)}                 B: {(c,
//   g), (c+4, g)} accumulator    C: {(g, 2c), (g, 2c+1), (g+8, 2c), (g+8, 2c+1)}
// A tf32 product may relabel its 8 k indices as long as A and B agree. We use
//   k-slot c <-> k = 2c,   k-slot c+4 <-> k = 2c+1
// so that an fp32 accumulator tile (columns 2c, 2c+1) is directly the A operand of the next tf32
// product over those columns, and B operands are read as float2 pairs along k.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/index_rules.h"
#include "core/kda_math.h"
#include "cuda/common/ptx.cuh"
#include "cuda/common/view.cuh"
#include "cuda/heuristics/prefill.h"

namespace kda::cuda::pf {

// ---------------------------------------------------------------------------------------------
// Sizes and the workspace record
// ---------------------------------------------------------------------------------------------

inline constexpr int kChunk = 64;     // tokens per chunk (kda::kChunkSize)
inline constexpr int kSub = 16;       // tokens per sub-chunk (row block of Akk/Aqk)
inline constexpr int kHeadDim = 128;  // K == V == 128

// One record per (chunk slot, value head), written by the prepare kernel and read (one bulk copy)
// by the recurrence kernel. Every matrix is stored as the recurrence's tensor-core B operand in the
// 128-byte swizzle layout of wgmma (sw128_offset; K-major: a row holds the product's K index):
//   W    [64 t][128 k] bf16   Tm (exp(G) k)                       rec_b16
//   qg   [64 t][128 k] bf16   exp(G_t) q_t (q normalized, scaled)  rec_b16
//   kbT  [128 k][64 s] bf16   exp(G_L - G_s) k_s, transposed (rec_kbt). bf16, not fp32: 16 KB less
//                             record traffic for a final-state error of ~1.6e-3 instead of ~4e-4
//                             (docs/perf_notes.md, precision)
//   Aqk  [64 t][64 s]  fp32   lower triangle incl. diagonal, tf32-rounded, zero above; s in tf32
//                             k-slot order (rec_f32)
//   Tm   [64 t][64 s]  fp32   (I + diag(b) Akk)^-1 diag(b), tf32-rounded (rec_f32), zero above
//                             the diagonal blocks
//   gL   [128]         fp32   exp(G_L), the per-channel decay of the state over the chunk
// Every matrix starts 1024-byte aligned within the record (the swizzle's period).
inline constexpr int kOffW = 0;
inline constexpr int kOffQg = kOffW + kChunk * kHeadDim * 2;
inline constexpr int kOffKbT = kOffQg + kChunk * kHeadDim * 2;
inline constexpr int kOffAqk = kOffKbT + kHeadDim * kChunk * 2;
inline constexpr int kOffTm = kOffAqk + kChunk * kChunk * 4;
inline constexpr int kOffGL = kOffTm + kChunk * kChunk * 4;
inline constexpr int kRecordBytes = kOffGL + kHeadDim * 4;  // 82,432
static_assert(kRecordBytes % 128 == 0, "records stay 128-byte aligned");
// Two always-zero parts of the record are neither written by the prepare kernel nor copied by
// the recurrence: the second 128-byte column block (s = 32..63) of rows 0..31 of Aqk and of Tm
// (above their diagonal blocks), 4 KB each, contiguous in the swizzle layout. The recurrence's
// stages hold zeros there from its start. The copied spans: [0, kHoleAqk),
// [kHoleAqk + kHoleBytes, kHoleTm), [kHoleTm + kHoleBytes, kRecordBytes).
inline constexpr int kHoleRows = kChunk / 2;  // rows 0..31, columns 32..63
inline constexpr int kHoleBytes = kHoleRows * 128;
inline constexpr int kHoleAqk =
    kOffAqk + kChunk * 128;  // column block 1 follows all rows of block 0
inline constexpr int kHoleTm = kOffTm + kChunk * 128;
inline constexpr int kRecordCopyBytes = kRecordBytes - 2 * kHoleBytes;  // 74,240
// Element (t, s) of Aqk or Tm lies in the record's zero part (never stored nor copied).
__host__ __device__ constexpr bool rec_in_hole(int t, int s) {
  return t < kHoleRows && s >= kHoleRows;
}

static_assert(kOffQg % 1024 == 0 && kOffKbT % 1024 == 0 && kOffAqk % 1024 == 0 &&
                  kOffTm % 1024 == 0,
              "record matrices start at the swizzle period");

// The 128-byte swizzle layout (wgmma's SWIZZLE_128B, K-major) of a matrix of `rows` rows: its rows
// are cut into 128-byte column blocks stored one after the other ([block][rows][128 B]); inside a
// block, 16-byte chunk j of row r sits at chunk j ^ (r % 8). Byte offset of byte `byte` of row
// `row`. Eight consecutive rows at one logical chunk hit eight bank groups (ldmatrix and the
// mma.sync B fragment reads are conflict-free too).
__host__ __device__ constexpr int sw128_offset(int rows, int row, int byte) {
  return (byte >> 7) * rows * 128 + row * 128 + ((((byte >> 4) & 7) ^ (row & 7)) << 4) +
         (byte & 15);
}
// W, qg: element (t, k) of a [64][128] bf16 matrix (element offset).
__host__ __device__ constexpr int rec_b16(int t, int k) {
  return sw128_offset(kChunk, t, 2 * k) >> 1;
}
// kbT: element (k, s) of the [128][64] bf16 matrix.
__host__ __device__ constexpr int rec_kbt(int k, int s) {
  return sw128_offset(kHeadDim, k, 2 * s) >> 1;
}
// tf32 k-slot order of 8 consecutive tokens (common.cuh header: slot c <-> 2c, slot c + 4 <->
// 2c + 1): token s sits at position perm8(s), so that an accumulator tile used as the A operand
// of a wgmma meets B rows in the same order.
__host__ __device__ constexpr int perm8(int s) {
  return (s & ~7) | ((s & 1) << 2) | ((s & 7) >> 1);
}
// Aqk, Tm: element (t, s) of a [64][64] fp32 matrix.
__host__ __device__ constexpr int rec_f32(int t, int s) {
  return sw128_offset(kChunk, t, 4 * perm8(s)) >> 2;
}
// ---- 16-token records (the chunk-16 path: docs/design.md, docs/perf_notes.md).
// Four per record slot (the workspace is sized as for 64-token records). Each matrix is a wgmma B
// operand, K-major, in the swizzle mode of its row length (PTX ISA, shared memory matrix layouts:
// the 16-byte chunk index of a row is XORed with row bits, 3 / 2 / 1 of them for 128 / 64 / 32-byte
// rows), starting at a multiple of its swizzle atom:
//   W, qg  [16 t][128 k] bf16   128-byte swizzle (sw128_offset with 16 rows)   rec16_b16
//   kbT    [128 k][16 s] bf16   32-byte swizzle                                rec16_kbt
//   Aqk, Tm [16 t][16 s] fp32   64-byte swizzle, s in tf32 k-slot order        rec16_f32
//   gL     [128] fp32           exp(G_L) over the 16 tokens
inline constexpr int kChunk16 = 16;
inline constexpr int kR16OffW = 0;
inline constexpr int kR16OffQg = kR16OffW + kChunk16 * kHeadDim * 2;              // 4096
inline constexpr int kR16OffKbT = kR16OffQg + kChunk16 * kHeadDim * 2;            // 8192
inline constexpr int kR16OffAqk = kR16OffKbT + kHeadDim * kChunk16 * 2;           // 12288
inline constexpr int kR16OffTm = kR16OffAqk + kChunk16 * kChunk16 * 4;            // 13312
inline constexpr int kR16OffGL = kR16OffTm + kChunk16 * kChunk16 * 4;             // 14336
inline constexpr int kRecord16Bytes = (kR16OffGL + kHeadDim * 4 + 1023) & ~1023;  // 15360
static_assert(kChunk / kChunk16 * kRecord16Bytes <= kRecordBytes,
              "four 16-token records fit in a record slot");
static_assert(kRecord16Bytes % 1024 == 0 && kR16OffKbT % 256 == 0 && kR16OffAqk % 512 == 0 &&
                  kR16OffTm % 512 == 0,
              "16-token record matrices start at their swizzle atoms");
// 64-byte swizzle (SWIZZLE_64B; atom 8 rows x 64 B): chunk j (0..3) of row r at j ^ ((r / 2) % 4).
__host__ __device__ constexpr int sw64_offset(int row, int byte) {
  return row * 64 + ((((byte >> 4) & 3) ^ ((row >> 1) & 3)) << 4) + (byte & 15);
}
// 32-byte swizzle (SWIZZLE_32B; atom 8 rows x 32 B): chunk j (0..1) of row r at j ^ ((r / 4) % 2).
__host__ __device__ constexpr int sw32_offset(int row, int byte) {
  return row * 32 + ((((byte >> 4) & 1) ^ ((row >> 2) & 1)) << 4) + (byte & 15);
}
__host__ __device__ constexpr int rec16_b16(int t, int k) {
  return sw128_offset(kChunk16, t, 2 * k) >> 1;
}
__host__ __device__ constexpr int rec16_kbt(int k, int s) { return sw32_offset(k, 2 * s) >> 1; }
__host__ __device__ constexpr int rec16_f32(int t, int s) {
  return sw64_offset(t, 4 * perm8(s)) >> 2;
}

// bf16 tile [64 rows][vs columns] (vs = 16, 32, 64, 128; rows of vs/8 16-byte chunks): byte offset
// of 16-byte chunk `chunk` of `row`, swizzled so that 8 consecutive rows at one chunk are
// conflict-free for ldmatrix/stmatrix.
__device__ __forceinline__ int swizzle_vtile(int row, int chunk, int vs) {
  const int cpr = vs >> 3;  // chunks per row: 2, 4, 8, 16
  const int x = cpr >= 8 ? (row & 7) : ((row / (8 / cpr)) & (cpr - 1));
  return row * (vs * 2) + ((chunk ^ x) << 4);
}

// ---------------------------------------------------------------------------------------------
// Views
// ---------------------------------------------------------------------------------------------

// Token tensors [B, T, heads, dim] (beta: [B, T, HV, 1]) are StridedViews (common/view.cuh).

// A state tensor [rows, HV, V, K] (V-first) or [rows, HV, K, V] (K-first); absent: data null.
struct StateView {
  void* data = nullptr;
  int64_t rows = 0, s0 = 0, s1 = 0, s2 = 0;
  int dtype = kF32;
};

// An int32/int64 vector.
struct IndexView {
  const void* data = nullptr;
  int64_t stride = 1;
  bool is64 = false;
  __device__ __forceinline__ int64_t load(int64_t i) const {
    return is64 ? static_cast<const int64_t*>(data)[i * stride]
                : static_cast<int64_t>(static_cast<const int32_t*>(data)[i * stride]);
  }
};

// Everything both kernels read, passed by value (__grid_constant__).
struct Params {
  StridedView q, k, v, g, beta, out;  // out: written (const dropped at the store)
  const float* A_log = nullptr;       // [HV] (stride A_log_s), optional
  const float* dt_bias = nullptr;     // [HV, K] (row stride dt_bias_s), optional
  int64_t A_log_s = 1, dt_bias_s = kHeadDim;
  IndexView cu_seqlens;  // varlen: [N + 1]
  bool varlen = false;
  int64_t B = 0, T = 0, N = 0;    // per-token tensors are [B, T, ...]; N sequences
  int H = 0, HV = 0, groups = 1;  // groups = HV / H
  int64_t chunks_per_seq = 0;     // dense: ceil(T / 64)
  int64_t num_slots = 0;          // chunk slots (see slot_base)

  int gate = 0;  // detail::kGate*
  bool beta_logits = false, allow_neg_eigval = false, use_qk_l2norm = true;
  float scale = 1.f, lower_bound = -5.f;

  uint8_t* ws = nullptr;     // records [num_slots][HV][kRecordBytes], 128-byte aligned
  int32_t* order = nullptr;  // varlen, N > 1: sequences longest first (after the records;
                             // written by prepare block 0, read by the recurrence)

  // States (kernel B only).
  StateView initial_state, final_state, state_pool, checkpoints;
  IndexView state_indices, checkpoint_offsets;
  bool has_state_pool = false;
  int64_t checkpoint_every = 0;
  bool kfirst = false;
  int vs = 128, nslices = 1;  // value columns per recurrence block, blocks per (seq, head)
  bool ksplit = false;        // recurrence: two warps per 16 value rows, each half of K
  bool wgmma = false;         // recurrence: warpgroup products (vs >= 64; recurrence.cuh)
  bool chunk16 = false;       // both kernels on 16-token records (wgmma only; heuristics.h)
  bool fused = false;         // the fused kernel alone (fused.cuh): no prepare kernel, no workspace
  bool single = false;        // prepare and recurrence in one cooperative launch (single.cuh)
  int prefetch_blocks = 0;    // prepare: opt-in L2 prefetch for block index + this (0: off)

  // Segments (heuristics/prefill.h prefill_plan; segments.cuh): seg_tokens = 0 runs one
  // segment per sequence. seg_start / seg_local / seg_trans: fp32 [seg_slots][HV][128][128] S^T
  // rows in the workspace (a segment's true start state, its state from zero, its transition).
  int64_t seg_tokens = 0, segs_per_seq = 0, seg_slots = 0;  // segs_per_seq: dense ceil(T / tokens)
  int seg_pass = 0;  // the launch: 1 = pass 1, 2 = pass 2, 3 = warm-up pass (set per launch)
  StateView seg_start, seg_local, seg_trans;
  // Warm-up segments (fused.cuh, fused_warm_start; docs/design.md 6.10): the warm-up pass runs
  // every segment from a zero state some chunks before its start, at most warm_max_chunks 16-token
  // chunks, where a bound on the dropped state computed from the gates allows it (at most
  // 2^-warm_log2_bound of the state it stands for), and writes warm_flags[slot][hv] = 1 where it
  // does not (0 where it ran). With warm_flags set, passes 1 and 2 and the scan run only the
  // (sequence, value head) pairs with a flag set.
  int64_t warm_max_chunks = 0;
  float warm_log2_bound = static_cast<float>(detail::Tuning{}.prefill_warm_bits);
  int32_t* warm_flags = nullptr;  // [seg_slots][HV]
};

// Sequence n: batch row b, first token bos, length len (clamped into [0, T]: cu_seqlens is read
// on the device and never trusted to stay in bounds).
struct SeqSpan {
  int64_t b, bos, len, base;  // base: chunk slot of the sequence's first chunk
};

__device__ __forceinline__ int64_t clamp64(int64_t x, int64_t lo, int64_t hi) {
  return rules::clamp_index(x, lo, hi);
}

// Chunk slots: dense, sequence n owns [n * ceil(T/64), (n+1) * ceil(T/64)); varlen, sequence n
// owns [bos/64 + n, bos/64 + n + ceil(len/64)), disjoint for non-decreasing cu_seqlens and always
// below T/64 + N (the workspace bound) even for arbitrary values.
__device__ __forceinline__ int64_t varlen_base_at(const Params& p, int64_t n, int64_t cu_n) {
  return clamp64(cu_n, 0, p.T) / kChunk + n;
}
__device__ __forceinline__ int64_t varlen_base(const Params& p, int64_t n) {
  return varlen_base_at(p, n, p.cu_seqlens.load(n));
}

// Varlen sequence n from its cu_seqlens values cu[n], cu[n + 1], clamped into [0, T]
// (rules::clamp_span, the rule the CPU backends and the decode kernels share).
__device__ __forceinline__ SeqSpan varlen_span(const Params& p, int64_t n, int64_t cu_n,
                                               int64_t cu_n1) {
  const rules::SeqSpan r = rules::clamp_span(cu_n, cu_n1, p.T);
  SeqSpan s;
  s.b = r.b;
  s.bos = r.bos;
  s.len = r.len;
  s.base = r.bos / kChunk + n;  // varlen_base_at(p, n, cu_n)
  return s;
}
__device__ __forceinline__ SeqSpan seq_span(const Params& p, int64_t n) {
  SeqSpan s;
  if (!p.varlen) {
    const rules::SeqSpan r = rules::dense_span(n, p.T);
    s.b = r.b;
    s.bos = r.bos;
    s.len = r.len;
    s.base = n * p.chunks_per_seq;
  } else {
    s = varlen_span(p, n, p.cu_seqlens.load(n), p.cu_seqlens.load(n + 1));
  }
  return s;
}

// ---------------------------------------------------------------------------------------------
// Segments
// ---------------------------------------------------------------------------------------------

// The segment scan (segments.cuh): blocks of kScanThreads threads (8 warps) over kScanRows = 16
// rows of S^T; shared memory: kScanStages stages of Mt, the start rows transposed (row stride
// kScanXStride), the warps' partial products (row stride kScanRedStride), the stages' mbarriers.
inline constexpr int kScanThreads = 256, kScanStages = 2, kScanXStride = 20, kScanRedStride = 132;
inline constexpr int kScanSmemBytes =
    kScanStages * kHeadDim * kHeadDim * 4 + kHeadDim * kScanXStride * 4 +
    (kScanThreads / 32) * kScanRows * kScanRedStride * 4 + 8 * kScanStages;
static_assert(kScanRows == 16, "the scan's thread mapping");
static_assert(kScanSmemBytes <= 232448, "segment scan shared memory");

// Sequence n's segment slots [first, first + count) (heuristics/prefill.h prefill_segment_slots):
// count = max(1, ceil(len / seg_tokens)), so an empty sequence keeps one segment (its final state
// is its initial state).
struct SegRange {
  int64_t first, count;
};
__device__ __forceinline__ SegRange seg_range(const Params& p, int64_t n, const SeqSpan& sp) {
  SegRange r;
  if (!p.varlen) {
    r.first = n * p.segs_per_seq;
    r.count = p.segs_per_seq;
  } else {
    r.first = sp.bos / p.seg_tokens + n;
    r.count = sp.len > 0 ? (sp.len + p.seg_tokens - 1) / p.seg_tokens : 1;
  }
  return r;
}

// The segment of slot `slot`: its sequence n and index j (valid = false for a slot no sequence
// owns). Varlen: the last n whose first slot is <= slot (first slots strictly increase in n for
// any cu_seqlens values: bos / tokens + n), by binary search.
struct SegTask {
  int64_t n = 0, j = 0, count = 1;
  SeqSpan seq;  // the whole sequence
  bool valid = false;
};
__device__ __forceinline__ SegTask seg_task(const Params& p, int64_t slot) {
  SegTask t;
  if (!p.varlen) {
    t.n = slot / p.segs_per_seq;
  } else {
    int64_t lo = 0, hi = p.N - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (clamp64(p.cu_seqlens.load(mid), 0, p.T) / p.seg_tokens + mid <= slot)
        lo = mid;
      else
        hi = mid - 1;
    }
    t.n = lo;
  }
  t.seq = seq_span(p, t.n);
  const SegRange r = seg_range(p, t.n, t.seq);
  t.j = slot - r.first;
  t.count = r.count;
  t.valid = t.n < p.N && t.j >= 0 && t.j < r.count;
  return t;
}

// What one recurrence block does with its segment (the defaults: the whole sequence, as without
// segments). Pass 1: segment 0 from the sequence's initial state, outputs final, its end state
// the start of segment 1 (or the final state when it is the only one); segments 1 .. count - 2
// from zero (value slices) or the identity with zero values (transition slices, `trans`), no
// outputs, their end states to seg_local / seg_trans; the last segment idle. Pass 2: segments
// 1 .. count - 1 from seg_start, outputs and checkpoints; the last one's end state is the final.
struct SegRole {
  bool idle = false;
  bool first = true;        // starts from the sequence's initial state (pool / initial / zero)
  bool last = true;         // its end state is the sequence's final state
  bool outputs = true;      // writes outputs and checkpoints
  bool trans = false;       // the transition's rows (pass 1)
  bool from_start = false;  // starts from seg_start[slot] (pass 2); else zero / identity
  int64_t slot = 0;         // the segment slot
  int64_t tok0 = 0;         // the segment's first token within the sequence
  int64_t end_row = -1;     // segment slot of a non-final end state (seg_start / local / trans)
  bool warm = false;  // the warm-up pass: its last segment's end state goes to seg_local[end_row]
                      // (segment_scan_kernel copies it to the final state or pool slot)
};
__device__ __forceinline__ SegRole segment_role(const Params& p, const SegTask& t, int64_t slot,
                                                bool trans_half) {
  SegRole r;
  const bool last_seg = t.j == t.count - 1;
  if (!t.valid || (p.seg_pass == 1 && (t.j == 0 ? trans_half : last_seg)) ||
      (p.seg_pass == 2 && t.j == 0)) {
    r.idle = true;
    return r;
  }
  r.slot = slot;
  r.tok0 = t.j * p.seg_tokens;
  r.last = last_seg;
  if (p.seg_pass == 1 && t.j == 0) {
    r.end_row = !last_seg && slot + 1 < p.seg_slots ? slot + 1 : -1;
  } else if (p.seg_pass == 1) {
    r.first = r.outputs = false;
    r.trans = trans_half;
    r.end_row = slot;
  } else {
    r.first = false;
    r.from_start = true;
  }
  return r;
}

// Whether the exact passes run (sequence of segment slots `r`, value head hv): always without
// warm-up segments; with them, only where a segment's warm-up pass failed.
__device__ __forceinline__ bool exact_pass_needed(const Params& p, const SegRange& r, int hv) {
  if (p.warm_flags == nullptr) return true;
  for (int64_t s = r.first; s < r.first + r.count && s < p.seg_slots; ++s)
    if (p.warm_flags[s * p.HV + hv] != 0) return true;
  return false;
}

// Segment j of sequence span `sp`: its tokens and chunk slots.
__device__ __forceinline__ SeqSpan segment_span(const Params& p, const SeqSpan& sp, int64_t j) {
  SeqSpan s = sp;
  const int64_t t0 = j * p.seg_tokens;
  s.bos = sp.bos + t0;
  s.base = sp.base + t0 / kChunk;
  const int64_t rest = sp.len - t0;
  s.len = rest < 0 ? 0 : (rest < p.seg_tokens ? rest : p.seg_tokens);
  return s;
}

// ---------------------------------------------------------------------------------------------
// Conversions
// ---------------------------------------------------------------------------------------------

template <bool kFp16>
__device__ __forceinline__ float in_to_f32(uint32_t bits16) {
  if constexpr (kFp16)
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits16)));
  else
    return __uint_as_float(bits16 << 16);
}
// Low / high 16-bit halves of a packed pair.
template <bool kFp16>
__device__ __forceinline__ float lo_f32(uint32_t x) {
  return in_to_f32<kFp16>(x & 0xffffu);
}
template <bool kFp16>
__device__ __forceinline__ float hi_f32(uint32_t x) {
  if constexpr (kFp16)
    return in_to_f32<true>(x >> 16);
  else
    return __uint_as_float(x & 0xffff0000u);
}

template <bool kFp16>
__device__ __forceinline__ uint32_t pack_out(float lo, float hi) {
  if constexpr (kFp16) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  } else {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}
template <bool kFp16>
__device__ __forceinline__ uint16_t out_bits(float x) {
  if constexpr (kFp16)
    return __half_as_ushort(__float2half_rn(x));
  else
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// Element of a float tensor of runtime dtype (fp32 / fp16 / bf16): its bits as loaded (fp32, or
// 16-bit zero-extended), their value, and both at once. Loads issued early keep the bits and
// convert at the first use (prepare.cuh).
__device__ __forceinline__ uint32_t load_bits_any(const void* base, int dtype, int64_t off) {
  if (dtype == kF32) return static_cast<const uint32_t*>(base)[off];
  return static_cast<const uint16_t*>(base)[off];
}
// As selects, not branches on the dtype (the prepare kernel's per-row factors interleave).
__device__ __forceinline__ float bits_to_f32(uint32_t bits, int dtype) {
  const float h = in_to_f32<true>(bits), b = in_to_f32<false>(bits);
  return dtype == kF32 ? __uint_as_float(bits) : (dtype == kF16 ? h : b);
}
__device__ __forceinline__ float load_any(const void* base, int dtype, int64_t off) {
  return bits_to_f32(load_bits_any(base, dtype, off), dtype);
}
__device__ __forceinline__ void store_any(void* base, int dtype, int64_t off, float x) {
  if (dtype == kF32)
    static_cast<float*>(base)[off] = x;
  else if (dtype == kF16)
    static_cast<uint16_t*>(base)[off] = out_bits<true>(x);
  else
    static_cast<uint16_t*>(base)[off] = out_bits<false>(x);
}

}  // namespace kda::cuda::pf
