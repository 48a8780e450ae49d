// problem.h — the validated, normalized form of a call that every backend consumes.
//
// validate() turns the public params into a Problem: sizes resolved, every per-token tensor
// viewed as rank 4 ([B, T, heads, dim]; beta as [B, T, HV, 1] or [B, T, HV, V]) with varlen
// tensors given a leading dimension of 1, and every state tensor viewed as [rows, HV, V, K] in
// the *math-independent* storage order recorded in `layout`.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/index_rules.h"
#include "core/kda_math.h"
#include "kda/kda.h"

// Returns a failed Status from the enclosing function (every layer's one early return).
#define KDA_RETURN_IF_ERROR(expr)              \
  do {                                         \
    const ::kda::Status kda_status_ = (expr);  \
    if (!kda_status_.ok()) return kda_status_; \
  } while (0)

namespace kda::detail {

// The device code's plain-int gate codes are GateForm's (kda_math.h needs no public header).
static_assert(kGatePrecomputed == static_cast<int>(GateForm::kPrecomputed) &&
                  kGateSoftplus == static_cast<int>(GateForm::kSoftplus) &&
                  kGateLowerBound == static_cast<int>(GateForm::kLowerBound) && kNumGateForms == 3,
              "kda_math.h's gate codes must match GateForm");

// Resolved sizes and flags shared by prefill and decode.
struct Dims {
  int64_t B = 0;  // leading dimension of the per-token tensors (1 in varlen mode)
  int64_t T = 0;  // tokens dimension (total tokens in varlen mode)
  int64_t N = 0;  // sequences
  int64_t H = 0, HV = 0, K = 0, V = 0;
  bool varlen = false;
  int64_t groups() const { return HV / H; }  // value heads per q/k head
};

// Resolved MathOptions (the scale given its default); all arithmetic in at least fp32.
struct MathConsts {
  GateForm gate = GateForm::kPrecomputed;
  bool beta_logits = false;
  bool allow_neg_eigval = false;
  bool use_qk_l2norm = true;
  double scale = 1.0;
  float lower_bound = -5.0f;
};

struct PrefillProblem {
  Dims d;
  MathConsts math;
  TensorView q, k, v, g, beta, out;                                  // rank 4 (beta: [B, T, HV, 1])
  TensorView A_log, dt_bias, cu_seqlens;                             // as given (optional)
  TensorView initial_state, final_state, state_pool, state_indices;  // rank 4 / as given
  TensorView checkpoints, checkpoint_offsets;
  int64_t checkpoint_every = 0;
  StateLayout layout = StateLayout::kVFirst;
  Device device = Device::kCPU;
};

struct DecodeProblem {
  Dims d;
  MathConsts math;
  int64_t Tmax = 0;  // tokens per sequence (dense) or max tokens any sequence may have (varlen)
  bool beta_per_v = false;
  TensorView q, k, v, g, beta, out;
  TensorView A_log, dt_bias, cu_seqlens;
  TensorView state, state_indices, num_accepted_tokens, final_state, intermediate_states;
  bool indices_2d = false;  // state_indices is [N, Tmax]
  bool use_initial_state = true, store_final_state = true;
  StateLayout layout = StateLayout::kVFirst;
  Device device = Device::kCPU;
};

Status validate_prefill(const PrefillParams& p, PrefillProblem* out);
Status validate_decode(const DecodeParams& p, DecodeProblem* out);

// Element [i] or [i, j] of an int32/int64 index tensor of rank 1 or 2, read from `data`: the
// tensor's own memory (host tensors), or a host copy with the tensor's strides.
inline int64_t load_index_at(const TensorView& t, const void* data, int64_t i, int64_t j = 0) {
  const int64_t off = i * t.strides[0] + (t.ndim > 1 ? j * t.strides[1] : 0);
  if (t.dtype == DType::kInt32) return static_cast<const int32_t*>(data)[off];
  return static_cast<const int64_t*>(data)[off];
}
inline int64_t load_index(const TensorView& t, int64_t i, int64_t j = 0) {
  return load_index_at(t, t.data, i, j);
}

// Sequence n's tokens (rules::dense_span / rules::clamp_span), cu_seqlens read from `cu_data`.
inline rules::SeqSpan seq_span_at(const Dims& d, const TensorView& cu, const void* cu_data,
                                  int64_t n) {
  if (!d.varlen) return rules::dense_span(n, d.T);
  return rules::clamp_span(load_index_at(cu, cu_data, n), load_index_at(cu, cu_data, n + 1), d.T);
}

// Host-readable values of a decode call's index tensors: the tensors' own memory, or host copies
// with their strides (check_indices on CUDA tensors). Absent tensors: nullptr.
struct DecodeIndexData {
  const void* state_indices = nullptr;
  const void* num_accepted_tokens = nullptr;
  const void* cu_seqlens = nullptr;
};

inline DecodeIndexData own_index_data(const DecodeProblem& pr) {
  return {pr.state_indices.data, pr.num_accepted_tokens.data, pr.cu_seqlens.data};
}

// The read slot of decode row n of T_n = len tokens (rules::decode_read_slot).
inline rules::ReadSlot decode_row_slot(const DecodeProblem& pr, const DecodeIndexData& x, int64_t n,
                                       int64_t len) {
  rules::DecodeIndexing ix;
  ix.P = pr.state.shape[0];
  ix.Tmax = pr.Tmax;
  ix.has_indices = pr.state_indices.present();
  ix.indices_2d = pr.indices_2d;
  ix.has_num_accepted = pr.num_accepted_tokens.present();
  const int64_t accepted =
      ix.has_num_accepted ? load_index_at(pr.num_accepted_tokens, x.num_accepted_tokens, n) : 1;
  return rules::decode_read_slot(ix, n, len, accepted, [&](int64_t col) {
    return load_index_at(pr.state_indices, x.state_indices, n, col);
  });
}

// Whether two elements of a view (rank 1..kMaxDims, sizes and strides >= 0, element offsets
// within int64) share memory: whether some nonzero x with |x_i| < shape_i has
// sum_i x_i strides_i = 0. kUnknown when the strides are too irregular to decide in 2^20 steps.
enum class Overlap { kNo, kYes, kUnknown };
Overlap internal_overlap(const TensorView& t);

// Host-side content checks of index tensors (host-accessible memory only).
Status check_cu_seqlens_values(const TensorView& cu, int64_t total_tokens);
// check_indices of decode: every row's RowState that rules::is_index_error flags, then slots
// shared by two live rows where one of them writes it.
// The values are read from the host pointers (the tensors' own memory, or host copies).
Status check_decode_index_values(const DecodeProblem& pr, const void* indices_host,
                                 const void* nat_host, const void* cu_host);
// check_indices of prefill: pool slots >= P, then two sequences with the same pool slot.
Status check_prefill_index_values(const PrefillProblem& pr, const void* state_indices_host);

// The validated backward of a prefill: the forward's inputs (fwd.out and fwd.final_state absent,
// no pool, no checkpoints) and the gradient views, per-token ones rank 4 as in the forward
// (dbeta [B, T, HV, 1]). Absent views are not read (upstream) or not computed (gradients).
struct PrefillBackwardProblem {
  PrefillProblem fwd;
  TensorView d_out, d_final_state;
  TensorView dq, dk, dv, dg, dbeta;
  TensorView dA_log, ddt_bias, d_initial_state;
};

Status validate_prefill_backward(const PrefillBackwardParams& p, PrefillBackwardProblem* out);

}  // namespace kda::detail
