// problem.h — the validated, normalized form of a call that every backend consumes.
//
// validate() turns the public params into a Problem: sizes resolved, every per-token tensor
// viewed as rank 4 ([B, T, heads, dim]; beta as [B, T, HV, 1] or [B, T, HV, V]) with varlen
// tensors given a leading dimension of 1, and every state tensor viewed as [rows, HV, V, K] in
// the *math-independent* storage order recorded in `layout`.
#pragma once

#include <cmath>
#include <cstdint>

#include "kda/kda.h"

namespace kda::detail {

// Resolved sizes and flags shared by prefill and decode.
struct Dims {
  int64_t B = 0;       // leading dimension of the per-token tensors (1 in varlen mode)
  int64_t T = 0;       // tokens dimension (total tokens in varlen mode)
  int64_t N = 0;       // sequences
  int64_t H = 0, HV = 0, K = 0, V = 0;
  bool varlen = false;
  int64_t groups() const { return HV / H; }  // value heads per q/k head
};

// Resolved gate constants; all arithmetic in at least fp32.
struct GateConsts {
  GateForm form = GateForm::kPrecomputed;
  BetaForm beta_form = BetaForm::kActivated;
  bool allow_neg_eigval = false;
  bool l2norm = true;
  double scale = 1.0;
  float lower_bound = -5.0f;
};

struct PrefillProblem {
  Dims d;
  GateConsts gate;
  TensorView q, k, v, g, beta, out;      // rank 4 (beta: [B, T, HV, 1])
  TensorView A_log, dt_bias, cu_seqlens;  // as given (optional)
  TensorView initial_state, final_state, state_pool, state_indices;  // rank 4 / as given
  TensorView checkpoints, checkpoint_offsets;
  int64_t checkpoint_every = 0;
  StateLayout layout = StateLayout::kVFirst;
  Device device = Device::kCPU;
};

struct DecodeProblem {
  Dims d;
  GateConsts gate;
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

// Host-side content checks of index tensors (host-accessible memory only).
Status check_cu_seqlens_values(const TensorView& cu, int64_t total_tokens);
Status check_decode_index_values(const DecodeProblem& pr, const void* indices_host,
                                 const void* nat_host, const void* cu_host);

// Reads element i of an int32/int64 vector on the host.
inline int64_t load_index(const TensorView& t, int64_t i) {
  const char* base = static_cast<const char*>(t.data);
  if (t.dtype == DType::kInt32) return reinterpret_cast<const int32_t*>(base)[i * t.strides[0]];
  return reinterpret_cast<const int64_t*>(base)[i * t.strides[0]];
}

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
