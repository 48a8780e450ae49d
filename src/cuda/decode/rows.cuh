// rows.cuh — batch row -> tokens and state slots of the decode kernels: resolve_row (the read
// slot of a row), finish_row_slot (the same from loads issued ahead), token_slot (the [N, Tmax]
// write slots), over the rules of spec section 5 that the CPU backends and the host check share
// (core/index_rules.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/index_rules.h"
#include "cuda/decode/params.cuh"

namespace kda::cuda::dec {

// Tokens [bos, bos + len) of batch row b, and the read slot (-1: padding row).
struct SeqRow {
  int64_t b, bos, len, slot;
};

// The decode row rule's view of the call (core/index_rules.h).
__device__ __forceinline__ rules::DecodeIndexing row_indexing(const DecodeArgs& a) {
  rules::DecodeIndexing ix;
  ix.P = a.P;
  ix.Tmax = a.Tmax;
  ix.has_indices = a.has_indices;
  ix.indices_2d = a.indices_2d;
  ix.has_num_accepted = a.has_num_accepted;
  return ix;
}

// state_indices[n, col].
__device__ __forceinline__ int64_t index_at(const DecodeArgs& a, int64_t n, int64_t col) {
  return load_index(a.state_indices, n * a.state_indices.s0 + col * a.state_indices.s1);
}

// Sequence n's tokens and read slot (rules::clamp_span / dense_span, rules::decode_read_slot):
// cu_seqlens values are clamped so that no input can index out of bounds.
__device__ __forceinline__ SeqRow resolve_row(const DecodeArgs& a, int64_t n) {
  const rules::SeqSpan s =
      a.varlen ? rules::clamp_span(load_index(a.cu_seqlens, n * a.cu_seqlens.s0),
                                   load_index(a.cu_seqlens, (n + 1) * a.cu_seqlens.s0), a.T)
               : rules::dense_span(n, a.T);
  const int64_t acc =
      a.has_num_accepted ? load_index(a.num_accepted_tokens, n * a.num_accepted_tokens.s0) : 1;
  const rules::ReadSlot r = rules::decode_read_slot(
      row_indexing(a), n, s.len, acc, [&](int64_t col) { return index_at(a, n, col); });
  return {s.b, s.bos, s.len, r.slot};
}

// Slot receiving the state after token t with [N, Tmax] indices (rules::kNoSlot: none).
__device__ __forceinline__ int64_t token_slot(const DecodeArgs& a, int64_t n, int64_t t) {
  return rules::pool_slot(index_at(a, n, t), a.P);
}

// An index element as loaded, converted at its first use (index_value): the low 32 bits, and the
// high 32 bits of an int64 index (0 for int32). The two loads have no branch between them and no
// conversion right behind them, so the warp issues its next loads without waiting for these.
struct RawIndex {
  uint32_t lo = 0, hi = 0;
};

__device__ __forceinline__ RawIndex load_index_raw(const IndexTensor& t, int64_t off) {
  const uint32_t* p = static_cast<const uint32_t*>(t.data) + (t.is64 ? 2 * off : off);
  RawIndex r;
  r.lo = p[0];
  if (t.is64) r.hi = p[1];
  return r;
}

__device__ __forceinline__ int64_t index_value(const RawIndex& r, bool is64) {
  return is64 ? static_cast<int64_t>((static_cast<uint64_t>(r.hi) << 32) | r.lo)
              : static_cast<int64_t>(static_cast<int32_t>(r.lo));
}

// The index loads that resolve a dense row's read slot (resolve_row without varlen), issued
// ahead of their use: state_indices[n, 0] and num_accepted[n].
struct RowRaw {
  RawIndex idx0, acc;
};

__device__ __forceinline__ RowRaw load_row_raw(const DecodeArgs& a, int64_t n) {
  RowRaw r;
  if (a.has_indices && (!a.indices_2d || a.Tmax > 0))
    r.idx0 = load_index_raw(a.state_indices, n * a.state_indices.s0);
  if (a.has_num_accepted)
    r.acc = load_index_raw(a.num_accepted_tokens, n * a.num_accepted_tokens.s0);
  return r;
}

// resolve_row(a, n).slot for a dense row (len = T), from the loads issued ahead.
__device__ __forceinline__ int64_t finish_row_slot(const DecodeArgs& a, int64_t n,
                                                   const RowRaw& r) {
  const int64_t acc = a.has_num_accepted ? index_value(r.acc, a.num_accepted_tokens.is64) : 1;
  return rules::decode_read_slot(row_indexing(a), n, a.T, acc,
                                 [&](int64_t col) {
                                   return col == 0 ? index_value(r.idx0, a.state_indices.is64)
                                                   : index_at(a, n, col);
                                 })
      .slot;
}

}  // namespace kda::cuda::dec
