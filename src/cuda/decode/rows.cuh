// rows.cuh — batch row -> tokens and state slots of the decode kernels: resolve_row (the read
// slot of a row), finish_row_slot (the same from loads issued ahead), token_slot (the [N, Tmax]
// write slots). The slot / padding and varlen clamp rules of spec section 5, kept together here.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/decode/params.cuh"

namespace kda::cuda::dec {

// Tokens [bos, bos + len) of batch row b, and the read slot (-1: padding row).
struct SeqRow {
  int64_t b, bos, len, slot;
};

// Mirrors cpu::seq_span and cpu::decode_read_slot (spec section 5); cu_seqlens values are
// clamped so that no input can index out of bounds.
__device__ __forceinline__ SeqRow resolve_row(const DecodeArgs& a, int64_t n) {
  SeqRow r{n, 0, a.T, -1};
  if (a.varlen) {
    int64_t bos = load_index(a.cu_seqlens, n * a.cu_seqlens.s0);
    int64_t eos = load_index(a.cu_seqlens, (n + 1) * a.cu_seqlens.s0);
    bos = bos < 0 ? 0 : (bos > a.T ? a.T : bos);
    eos = eos < bos ? bos : (eos > a.T ? a.T : eos);
    r = {0, bos, eos - bos, -1};
  }
  if (!a.has_indices) {
    r.slot = n < a.P ? n : -1;
    return r;
  }
  int64_t col = 0;
  if (a.has_num_accepted) {
    const int64_t acc = load_index(a.num_accepted_tokens, n * a.num_accepted_tokens.s0);
    if (acc < 1 || acc > r.len) return r;
    col = acc - 1;
  }
  if (a.indices_2d && (r.len > a.Tmax || col >= a.Tmax)) return r;
  const int64_t slot = load_index(a.state_indices, n * a.state_indices.s0 + col * a.state_indices.s1);
  r.slot = (slot >= 0 && slot < a.P) ? slot : -1;
  return r;
}

// Slot receiving the state after token t with [N, Tmax] indices (-1: none).
__device__ __forceinline__ int64_t token_slot(const DecodeArgs& a, int64_t n, int64_t t) {
  const int64_t slot = load_index(a.state_indices, n * a.state_indices.s0 + t * a.state_indices.s1);
  return (slot >= 0 && slot < a.P) ? slot : -1;
}


// The index loads that resolve a dense row's read slot (resolve_row without varlen), issued
// ahead of their use: state_indices[n, 0] and num_accepted[n].
struct RowRaw {
  int64_t idx0, acc;
};

__device__ __forceinline__ RowRaw load_row_raw(const DecodeArgs& a, int64_t n) {
  RowRaw r{-1, 1};
  if (a.has_indices && (!a.indices_2d || a.Tmax > 0)) r.idx0 = load_index(a.state_indices, n * a.state_indices.s0);
  if (a.has_num_accepted) r.acc = load_index(a.num_accepted_tokens, n * a.num_accepted_tokens.s0);
  return r;
}

// resolve_row(a, n).slot for a dense row (len = T), from the prefetched loads.
__device__ __forceinline__ int64_t finish_row_slot(const DecodeArgs& a, int64_t n, const RowRaw& r) {
  if (!a.has_indices) return n < a.P ? n : -1;
  int64_t col = 0;
  if (a.has_num_accepted) {
    if (r.acc < 1 || r.acc > a.T) return -1;
    col = r.acc - 1;
  }
  if (a.indices_2d && (a.T > a.Tmax || col >= a.Tmax)) return -1;
  const int64_t slot = col == 0 ? r.idx0 : load_index(a.state_indices, n * a.state_indices.s0 + col * a.state_indices.s1);
  return (slot >= 0 && slot < a.P) ? slot : -1;
}

}  // namespace kda::cuda::dec
