// baseline.cuh — the baseline kernel (decode_baseline_kernel): the reference loop nest, one
// block per (sequence, value head), thread v owns value column v. Any K, layout and state dtype.
// Not chosen by the heuristic: a tested reference, the differential baseline of the GPU tests
// (Tuning::decode_kernel = kBaseline).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/ptx.cuh"
#include "cuda/decode/rows.cuh"

namespace kda::cuda::dec {

// ---------------------------------------------------------------------------------------------
// The baseline kernel: the reference loop nest, one block per (sequence, value head), thread v
// owns value column v (its K state elements in local memory). Any K, layout, state dtype.
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ int64_t state_elem(const StridedView& st, bool k_first, int64_t row,
                                              int hv, int k, int v) {
  return row * st.s0 + hv * st.s1 +
         (k_first ? static_cast<int64_t>(k) * st.s2 + v : static_cast<int64_t>(v) * st.s2 + k);
}

__global__ void __launch_bounds__(256)
    decode_baseline_kernel(const __grid_constant__ DecodeArgs a, bool k_first) {
  pdl_prologue();
  __shared__ float sh_q[256], sh_k[256], sh_decay[256], sh_norm[2];
  const int hv = static_cast<int>(blockIdx.x % static_cast<unsigned>(a.HV));
  const int64_t n = blockIdx.x / static_cast<unsigned>(a.HV);
  const int h = hv / a.groups;
  const int v = threadIdx.x;  // blockDim.x == V
  const bool bf16_state = a.state.dtype == kBF16;
  const SeqRow row = resolve_row(a, n);
  if (row.slot < 0) {
    for (int64_t t = 0; t < row.len; ++t)
      store_elem(a.out.data, a.out.dtype, a.out.offset(row.b, row.bos + t, hv) + v, 0.f);
    return;
  }
  float col[256];  // S[:, v]
  for (int k = 0; k < a.K; ++k)
    col[k] = a.use_initial_state ? load_elem(a.state.data, a.state.dtype,
                                             state_elem(a.state, k_first, row.slot, hv, k, v))
                                 : 0.f;
  const float exp_A = head_exp_A(a, hv);
  auto store_col = [&](const StridedView& st, int64_t r) {
    for (int k = 0; k < a.K; ++k)
      store_elem(st.data, st.dtype, state_elem(st, k_first, r, hv, k, v), col[k]);
  };
  for (int64_t t = 0; t < row.len; ++t) {
    const int64_t tok = row.bos + t;
    __syncthreads();  // the previous token is done with the shared inputs
    for (int k = threadIdx.x; k < a.K; k += blockDim.x) {
      sh_q[k] = load_elem(a.q.data, a.q.dtype, a.q.offset(row.b, tok, h) + k);
      sh_k[k] = load_elem(a.k.data, a.k.dtype, a.k.offset(row.b, tok, h) + k);
      const float g = load_elem(a.g.data, a.g.dtype, a.g.offset(row.b, tok, hv) + k);
      const float bias =
          a.dt_bias.data ? load_elem(a.dt_bias.data, a.dt_bias.dtype, hv * a.dt_bias.s0 + k) : 0.f;
      sh_decay[k] = expf(detail::log_decay<float>(a.gate, g, exp_A, bias, a.lower_bound));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float qq = 0.f, kq = 0.f;
      for (int k = 0; k < a.K; ++k) qq += sh_q[k] * sh_q[k], kq += sh_k[k] * sh_k[k];
      sh_norm[0] = a.use_qk_l2norm ? 1.f / sqrtf(qq + static_cast<float>(detail::kL2NormEps)) : 1.f;
      sh_norm[1] = a.use_qk_l2norm ? 1.f / sqrtf(kq + static_cast<float>(detail::kL2NormEps)) : 1.f;
    }
    __syncthreads();
    const float qn = sh_norm[0], kn = sh_norm[1];
    float sk = 0.f;
    for (int k = 0; k < a.K; ++k) {
      col[k] *= sh_decay[k];
      sk += col[k] * (sh_k[k] * kn);
    }
    const float u = activated_beta(a, row.b, tok, hv, v) *
                    (load_elem(a.v.data, a.v.dtype, a.v.offset(row.b, tok, hv) + v) - sk);
    float o = 0.f;
    for (int k = 0; k < a.K; ++k) {
      col[k] += (sh_k[k] * kn) * u;
      o += col[k] * ((sh_q[k] * qn) * a.scale);
      if (bf16_state) col[k] = round_bf16(col[k]);
    }
    store_elem(a.out.data, a.out.dtype, a.out.offset(row.b, tok, hv) + v, o);
    if (a.store_final_state) {
      if (a.has_intermediate) {
        store_col(a.intermediate_states, row.b * a.T + tok);
      } else if (a.indices_2d) {
        const int64_t ws = token_slot(a, n, t);
        if (ws >= 0) store_col(a.state, ws);
      }
    }
  }
  if (a.store_final_state && !a.has_intermediate && !a.indices_2d) {
    if (a.has_final_state)
      store_col(a.final_state, n);
    else
      store_col(a.state, row.slot);
  }
}

}  // namespace kda::cuda::dec
