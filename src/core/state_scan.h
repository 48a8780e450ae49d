// state_scan.h — the context-parallel prefill's per-element arithmetic and per-sequence layout
// (spec section 9), for the host and the CUDA code alike: one step of the scan over ranks (the
// state after a rank's piece from the state before it, through the piece's affine map,
// S_end = M S_start + S_local), where a rank's piece lies in its sequence, and which checkpoint
// rows the piece holds.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/index_rules.h"  // KDA_HOST_DEVICE
#include "kda/kda.h"

namespace kda::scan {

// Element (a, b) of the next state of one (sequence, value head), in the stored layout, rows of
// C elements. h: the current state (fp64, row-major); m: the rank's M as the prefill from the
// identity stores it ([K, K], row-major: M^T in the V-first layout, M in the K-first layout);
// s: the rank's S_local (as h).
//   V-first (h = S^T, [V, K], C = K):  h' = h m + s    h'[a][b] = s[a][b] + sum_c h[a][c] m[c][b]
//   K-first (h = S,   [K, V], C = V):  h' = m h + s    h'[a][b] = s[a][b] + sum_c m[a][c] h[c][b]
KDA_HOST_DEVICE inline double step_element(const double* h, const float* m, const float* s,
                                           int64_t a, int64_t b, int64_t K, int64_t C,
                                           bool v_first) {
  double acc = s[a * C + b];
  if (v_first) {
    for (int64_t c = 0; c < K; ++c) acc += h[a * C + c] * static_cast<double>(m[c * K + b]);
  } else {
    for (int64_t c = 0; c < K; ++c) acc += static_cast<double>(m[a * K + c]) * h[c * C + b];
  }
  return acc;
}

// Where one rank's gathered record keeps M and S_local of part p (a sequence's piece, or one of
// its parts: see Buffers::parts), value head hv: the record is [M: N x HV x K x K | S_local:
// N x HV x R x C] fp32 (N parts, R x C the stored state).
struct Record {
  int64_t N, HV, K, R, C;
  KDA_HOST_DEVICE int64_t floats() const { return N * HV * (K * K + R * C); }
  KDA_HOST_DEVICE int64_t m(int64_t p, int64_t hv) const { return (p * HV + hv) * K * K; }
  KDA_HOST_DEVICE int64_t s(int64_t p, int64_t hv) const {
    return N * HV * K * K + (p * HV + hv) * R * C;
  }
};

// Element i of an int32/int64 index vector (any stride).
KDA_HOST_DEVICE inline int64_t index_at(const TensorView& t, int64_t i) {
  const int64_t off = i * t.strides[0];
  if (t.dtype == DType::kInt32) return static_cast<const int32_t*>(t.data)[off];
  return static_cast<const int64_t*>(t.data)[off];
}

// The buffers of one context-parallel call on one device (in the caller's workspace, but the
// caller's tensors).
struct Buffers {
  scan::Record record;   // the layout of one rank's gathered [M | S_local] record
  const float* records;  // [world] records, rank order (the gather's output)
  int world = 0, rank = 0;
  bool v_first = true;
  int64_t N = 0;  // sequences
  // Parts per piece: 1, or 2 with checkpoints: the piece's head (its tokens before its first
  // checkpoint boundary, when it starts off one; else empty) and the rest, which then starts on
  // a boundary, so that the prefill's own checkpoints of the rest are the sequence's.
  int parts = 1;
  TensorView cu_seqlens;  // this rank's [N + 1] (varlen), or absent (dense)
  int64_t tokens = 0;     // T_r: this rank's tokens per row
  // [(1 + world) * N] int64, or nullptr (no pool, no checkpoints): this rank's piece lengths
  // (the gather's input), then every rank's (its output, rank-major).
  int64_t* lengths = nullptr;
  // With checkpoints: the passes' cu_seqlens over the parts ([2N + 1] varlen; dense: [3], the
  // head and the rest of every row) and the last pass's checkpoint_offsets ([2N + 1]; dense row
  // b reads entries [2b, 2b + 3)).
  int64_t* part_cu = nullptr;
  int64_t* part_offsets = nullptr;
  TensorView initial_state;       // [N, HV, R, C], any state dtype, or absent (zero)
  TensorView final_state;         // [N, HV, R, C], any state dtype, or absent
  TensorView state_pool;          // [P, HV, R, C], or absent (then state_indices too)
  TensorView state_indices;       // [N] int32/int64
  TensorView checkpoints;         // [rows, HV, R, C], or absent
  TensorView checkpoint_offsets;  // the global [N + 1]
  int64_t checkpoint_every = 0;
  float* start;     // [N * parts, HV, R, C] fp32 contiguous: this rank's start states of its parts
  double* h;        // [2, N, HV, R, C] fp64: the scan's states
  float* identity;  // [K, K] fp32: the M pass's initial state (broadcast)
  void* zeros;      // `zero_bytes` bytes: the M pass's v (broadcast)
  size_t zero_bytes = 0;
};

// Tokens of this rank's piece of sequence n (its local cu_seqlens span; dense: every row T_r).
KDA_HOST_DEVICE inline int64_t local_length(const Buffers& b, int64_t n) {
  if (b.cu_seqlens.ndim == 0) return b.tokens;
  return rules::clamp_span(index_at(b.cu_seqlens, n), index_at(b.cu_seqlens, n + 1), b.tokens).len;
}

// This rank's piece of sequence n in the whole sequence: `offset` tokens of it on the ranks
// before, `length` here, `after` on the ranks after (from the gathered lengths).
struct Piece {
  int64_t offset = 0, length = 0, after = 0;
  // Whether this rank holds the sequence's last token (a sequence without tokens has none).
  KDA_HOST_DEVICE bool holds_last() const { return length > 0 && after == 0; }
};

KDA_HOST_DEVICE inline Piece piece_of(const Buffers& b, int64_t n) {
  Piece p;
  const int64_t* all = b.lengths + b.N;
  for (int j = 0; j < b.world; ++j) {
    const int64_t len = all[j * b.N + n];
    if (j < b.rank) p.offset += len;
    if (j == b.rank) p.length = len;
    if (j > b.rank) p.after += len;
  }
  return p;
}

// The checkpoint rows a piece holds (checkpoint j of a sequence is the state after
// (j + 1) * every of its tokens, row offsets[n] + j while below offsets[n + 1]): the head's
// length (tokens up to the piece's first boundary when it starts off one, at most the piece; 0
// when it starts on one), the row of the checkpoint at the head's end (the head's final state;
// -1 when the head is empty, ends before the boundary, or the row is past the sequence's rows),
// and the rows [begin, end) of the rest (its own checkpoints).
struct PieceRows {
  int64_t head = 0, boundary = -1, begin = 0, end = 0;
};

KDA_HOST_DEVICE inline PieceRows piece_rows(const Piece& p, int64_t every, int64_t lo, int64_t hi) {
  PieceRows r;
  const int64_t off = p.offset % every;
  r.head = off == 0 ? 0 : (every - off < p.length ? every - off : p.length);
  const int64_t rest = p.offset + r.head;  // the rest's first token in the sequence
  if (r.head > 0 && rest % every == 0 && lo + rest / every - 1 < hi)
    r.boundary = lo + rest / every - 1;
  const int64_t begin = lo + rest / every, end = lo + (p.offset + p.length) / every;
  r.begin = begin < hi ? begin : hi;
  r.end = end < hi ? end : hi;
  return r;
}

// Sequence n's checkpoint rows [lo, hi) from the global checkpoint_offsets, clamped to the
// checkpoints' rows (the values are validated on the host for CPU tensors only).
KDA_HOST_DEVICE inline PieceRows piece_rows_of(const Buffers& b, int64_t n) {
  const int64_t rows = b.checkpoints.shape[0];
  const int64_t lo = rules::clamp_index(index_at(b.checkpoint_offsets, n), 0, rows);
  const int64_t hi = rules::clamp_index(index_at(b.checkpoint_offsets, n + 1), lo, rows);
  return piece_rows(piece_of(b, n), b.checkpoint_every, lo, hi);
}

// Sequence n's entries of part_cu and part_offsets (and the last ones, from n = N - 1; N = 0:
// call with n = -1). Varlen: parts 2n (the head) and 2n + 1 (the rest) of piece n. Dense: every
// row splits at the same token, part_cu = {0, head, T_r}.
KDA_HOST_DEVICE inline void write_part_layout(const Buffers& b, int64_t n) {
  const bool varlen = b.cu_seqlens.ndim != 0;
  if (n < 0) {
    b.part_cu[0] = 0;
    if (!varlen) b.part_cu[1] = b.part_cu[2] = 0;
    b.part_offsets[0] = 0;
    return;
  }
  const PieceRows r = piece_rows_of(b, n);
  // The head writes no checkpoint (it is shorter than checkpoint_every); its range ends where
  // the rest's begins and starts where the previous piece's rest ended.
  b.part_offsets[2 * n] = n == 0 ? r.begin : piece_rows_of(b, n - 1).end;
  b.part_offsets[2 * n + 1] = r.begin;
  if (n == b.N - 1) b.part_offsets[2 * b.N] = r.end;
  if (varlen) {
    const int64_t bos = rules::clamp_index(index_at(b.cu_seqlens, n), 0, b.tokens);
    b.part_cu[2 * n] = bos;
    b.part_cu[2 * n + 1] = bos + rules::clamp_index(r.head, 0, b.tokens - bos);
    if (n == b.N - 1)
      b.part_cu[2 * b.N] = rules::clamp_index(index_at(b.cu_seqlens, b.N), bos, b.tokens);
  } else if (n == 0) {
    b.part_cu[0] = 0;
    b.part_cu[1] = r.head;
    b.part_cu[2] = b.tokens;
  }
}

}  // namespace kda::scan
