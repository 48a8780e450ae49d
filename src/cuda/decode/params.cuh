// params.cuh — the parameters of every decode kernel (DecodeArgs, passed by value as
// __grid_constant__) and the per-head scalars read from them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/kda_math.h"
#include "cuda/common/view.cuh"
#include "cuda/decode/load.cuh"

namespace kda::cuda::dec {

// ---------------------------------------------------------------------------------------------
// Kernel parameters (passed by value as __grid_constant__)
// ---------------------------------------------------------------------------------------------

// Token tensors are rank-4 views [B, T, heads, dim]; varlen calls have B = 1, T = total tokens.
// State tensors are [rows, HV, V, K] (V-first) or [rows, HV, K, V] (K-first).
struct DecodeArgs {
  StridedView q, k;              // [B, T, H, K]   bf16/fp16
  StridedView v;                 // [B, T, HV, V]  as q
  StridedView g;                 // [B, T, HV, K]  q's dtype or fp32: gate input
  StridedView beta;              // [B, T, HV, 1] or [B, T, HV, V]: q's dtype or fp32
  StridedView out;               // [B, T, HV, V]  q's dtype or fp32
  StridedView dt_bias;           // [HV, K] fp32/bf16 (s0 only); data == nullptr: absent (0)
  const float* A_log = nullptr;  // [HV] fp32 with element stride A_log_s0; nullptr: exp(A) = 1
  int64_t A_log_s0 = 0;
  IndexTensor cu_seqlens;           // [N + 1] (varlen)
  IndexTensor state_indices;        // [N] or [N, Tmax] (has_indices)
  IndexTensor num_accepted_tokens;  // [N] (has_num_accepted)
  StridedView state;                // [P, HV, ..] the pool, fp32 or bf16
  StridedView final_state;          // [N, HV, ..] (has_final_state)
  StridedView intermediate_states;  // [B * T, HV, ..] state after every token (has_intermediate)
  int64_t N = 0;                    // sequences
  int64_t T = 0;                    // tokens dimension of the token tensors
  int64_t Tmax = 0;                 // columns of 2-D state_indices (= T in dense mode)
  int64_t P = 0;                    // pool slots
  int H = 0, HV = 0, K = 0, V = 0;
  int groups = 1;            // HV / H: value head hv reads q/k head hv / groups
  int gate = 0;              // detail::kGatePrecomputed / kGateSoftplus / kGateLowerBound
  float scale = 1.f;         // q scale (after the l2 norm)
  float lower_bound = -5.f;  // kGateLowerBound
  bool varlen = false;
  bool has_indices = false, indices_2d = false, has_num_accepted = false;
  bool has_final_state = false, has_intermediate = false;
  bool use_initial_state = true, store_final_state = true;
  bool use_qk_l2norm = true, beta_logits = false, allow_neg_eigval = false, beta_per_v = false;
  bool state_stream = true;  // warp kernel: state loads / stores with the streaming cache hint
};

__device__ __forceinline__ float head_exp_A(const DecodeArgs& a, int hv) {
  return a.A_log != nullptr ? expf(a.A_log[hv * a.A_log_s0]) : 1.f;
}

__device__ __forceinline__ float activated_beta(const DecodeArgs& a, int64_t b, int64_t tok, int hv,
                                                int v) {
  const int64_t off = a.beta.offset(b, tok, hv) + (a.beta_per_v ? v : 0);
  return detail::activate_beta<float>(a.beta_logits, a.allow_neg_eigval,
                                      load_elem(a.beta.data, a.beta.dtype, off));
}

}  // namespace kda::cuda::dec
