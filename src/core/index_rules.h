// index_rules.h — the index rules of spec sections 4 and 5, written once for the CPU backends,
// the CUDA kernels and the host check (check_indices): the varlen span of a sequence, the read
// slot of a decode row (or why the row is padding), and the pool slot rule of [N, Tmax] write
// slots and prefill pools.
//
// Every function is a pure function of index values the caller has already loaded, from host or
// device memory; the one dependent load of the decode row rule (state_indices[n, col], whose
// column depends on num_accepted_tokens[n]) is a callback, so a kernel can issue its loads early
// and pass the values in. No CUDA include: under nvcc the functions are __host__ __device__.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define KDA_HOST_DEVICE __host__ __device__
#else
#define KDA_HOST_DEVICE
#endif

namespace kda::rules {

// "No slot": a padding row's read slot, or a write slot outside the pool.
inline constexpr int64_t kNoSlot = -1;

// Sequence n's tokens: batch row b of the per-token tensors, first token bos, length len.
struct SeqSpan {
  int64_t b, bos, len;
};

// Dense mode: sequence n is batch row n, all T tokens.
KDA_HOST_DEVICE inline SeqSpan dense_span(int64_t n, int64_t T) { return {n, 0, T}; }

// Varlen mode: sequence n spans [cu_seqlens[n], cu_seqlens[n + 1]) of batch row 0, clamped so
// that no value can index out of bounds: bos into [0, total], eos into [bos, total]. Values that
// validation accepts are unchanged; a decreasing pair gives an empty sequence.
KDA_HOST_DEVICE inline int64_t clamp_index(int64_t x, int64_t lo, int64_t hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}
KDA_HOST_DEVICE inline SeqSpan clamp_span(int64_t bos, int64_t eos, int64_t total) {
  SeqSpan s;
  s.b = 0;
  s.bos = clamp_index(bos, 0, total);
  s.len = clamp_index(eos, s.bos, total) - s.bos;
  return s;
}

// A slot value against a pool of P slots. Used for the write slots of [N, Tmax] state_indices
// (the state after token t goes to state_indices[n, t] only when that is a valid slot) and for
// prefill pools (a slot outside [0, P) means "no pooled state": start from zero, write nothing).
KDA_HOST_DEVICE inline int64_t pool_slot(int64_t value, int64_t P) {
  return value < 0 || value >= P ? kNoSlot : value;
}

// Why a decode row reads the slot it reads, or why it is a padding row. Every state but kLive
// makes the row padding (zero output, no state read or written); check_indices reports every
// state but kLive and kNegativeSlot (the intended padding) as an error.
enum class RowState : int32_t {
  kLive = 0,                    // reads `slot`
  kNegativeSlot = 1,            // the read slot is negative: a padding row by intent
  kAcceptedOutOfRange = 2,      // num_accepted_tokens[n] outside [1, T_n]
  kLongerThanIndexColumns = 3,  // [N, Tmax] indices with T_n > Tmax (varlen)
  kSlotOutOfRange = 4,          // the read slot is >= P
  kNoSlotForRow = 5,            // no state_indices and n >= P
};

// True for the states check_indices reports as errors.
KDA_HOST_DEVICE inline bool is_index_error(RowState s) {
  return s != RowState::kLive && s != RowState::kNegativeSlot;
}

// What the row rule needs of a decode call besides the row's own values.
struct DecodeIndexing {
  int64_t P = 0;                  // pool slots
  int64_t Tmax = 0;               // columns of [N, Tmax] state_indices
  bool has_indices = false;       // state_indices present
  bool indices_2d = false;        // state_indices is [N, Tmax]
  bool has_num_accepted = false;  // num_accepted_tokens present (speculative decode)
};

// The read slot of a row, and the value that decided its state.
struct ReadSlot {
  RowState state;
  int64_t slot;   // the read slot when kLive, else kNoSlot
  int64_t value;  // kLive, kNegativeSlot, kSlotOutOfRange: the state_indices entry;
                  // kAcceptedOutOfRange: num_accepted_tokens[n]; kLongerThanIndexColumns: T_n;
                  // kNoSlotForRow: n
  KDA_HOST_DEVICE bool live() const { return state == RowState::kLive; }
};

// The column of state_indices row n that holds the read slot: num_accepted_tokens[n] - 1 in
// speculative mode, else 0 (state kLive), or why the row has none. `len` is T_n; `accepted` is
// num_accepted_tokens[n] (ignored without it).
struct ReadColumn {
  RowState state;  // kLive, kAcceptedOutOfRange or kLongerThanIndexColumns
  int64_t col;     // when kLive
};

KDA_HOST_DEVICE inline ReadColumn read_column(const DecodeIndexing& ix, int64_t len,
                                              int64_t accepted) {
  int64_t col = 0;
  if (ix.has_num_accepted) {
    if (accepted < 1 || accepted > len) return {RowState::kAcceptedOutOfRange, 0};
    col = accepted - 1;
  }
  if (ix.indices_2d && (len > ix.Tmax || col >= ix.Tmax))
    return {RowState::kLongerThanIndexColumns, 0};
  return {RowState::kLive, col};
}

// The read slot of decode row n (spec section 5): state_indices[n, num_accepted_tokens[n] - 1]
// in speculative mode, else state_indices[n, 0], or n without indices; a negative slot, a slot
// >= P, or num_accepted_tokens outside [1, T_n] makes the row padding. `len` is T_n, `accepted`
// num_accepted_tokens[n] (any value without it); load_slot(col) returns state_indices[n, col]
// and is called at most once, only for a column the rule has checked (col < Tmax).
template <typename LoadSlot>
KDA_HOST_DEVICE inline ReadSlot decode_read_slot(const DecodeIndexing& ix, int64_t n, int64_t len,
                                                 int64_t accepted, LoadSlot&& load_slot) {
  if (!ix.has_indices) {
    if (n < ix.P) return {RowState::kLive, n, n};
    return {RowState::kNoSlotForRow, kNoSlot, n};
  }
  const ReadColumn c = read_column(ix, len, accepted);
  if (c.state == RowState::kAcceptedOutOfRange) return {c.state, kNoSlot, accepted};
  if (c.state != RowState::kLive) return {c.state, kNoSlot, len};
  const int64_t value = load_slot(c.col);
  if (value < 0) return {RowState::kNegativeSlot, kNoSlot, value};
  if (value >= ix.P) return {RowState::kSlotOutOfRange, kNoSlot, value};
  return {RowState::kLive, value, value};
}

}  // namespace kda::rules
