// token.h — loads and preprocesses one token of one value head (spec section 2) on the host.
// Shared by the fp64 reference (F = double) and the fast CPU backend (F = float).
#pragma once

#include <cmath>

#include "cpu/access.h"

namespace kda::cpu {
inline namespace KDA_CPU_ISA {

// Per-value-head gate constants: exp(A_log[hv]) and dt_bias[hv, :].
template <typename F>
struct HeadGate {
  F exp_A = F(1);
  F bias[256] = {};
};

template <typename F, typename Problem>
void load_head_gate(const Problem& pr, int64_t hv, HeadGate<F>* hg) {
  hg->exp_A = pr.A_log.present() ? static_cast<F>(std::exp(load_scalar(
                                       pr.A_log.data, pr.A_log.dtype, hv * pr.A_log.strides[0])))
                                 : F(1);
  for (int64_t kk = 0; kk < pr.d.K; ++kk) hg->bias[kk] = F(0);
  if (pr.dt_bias.present()) load_row(pr.dt_bias, hv * pr.dt_bias.strides[0], pr.d.K, hg->bias);
}

template <typename F>
void l2_normalize(F* x, int64_t n) {
  F ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const F inv = F(1) / std::sqrt(ss + static_cast<F>(detail::kL2NormEps));
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

// Token (b, t) of value head hv: q (normalized, scaled), k (normalized), v, log decay a[K], and
// b_t in beta[0] (or beta[0..V) when the problem has one beta per value row). With kRawGate, a
// holds the raw gate input and the caller converts it (the fast path does whole rows at once).
template <bool kRawGate = false, typename F, typename Problem>
void load_token(const Problem& pr, const HeadGate<F>& hg, int64_t b, int64_t t, int64_t hv, F* q,
                F* k, F* v, F* a, F* beta) {
  const auto& d = pr.d;
  const int64_t h = hv / d.groups();
  load_row(pr.q, offset4(pr.q, b, t, h, 0), d.K, q);
  load_row(pr.k, offset4(pr.k, b, t, h, 0), d.K, k);
  if (pr.math.use_qk_l2norm) {
    l2_normalize(q, d.K);
    l2_normalize(k, d.K);
  }
  const F scale = static_cast<F>(pr.math.scale);
  for (int64_t i = 0; i < d.K; ++i) q[i] *= scale;
  load_row(pr.v, offset4(pr.v, b, t, hv, 0), d.V, v);
  load_row(pr.g, offset4(pr.g, b, t, hv, 0), d.K, a);
  if (!kRawGate) {
    const int form = static_cast<int>(pr.math.gate);
    const F lb = static_cast<F>(pr.math.lower_bound);
    for (int64_t i = 0; i < d.K; ++i)
      a[i] = detail::log_decay<F>(form, a[i], hg.exp_A, hg.bias[i], lb);
  }
  const int64_t nb = pr.beta.shape[3];  // 1, or V for per-value-row beta
  load_row(pr.beta, offset4(pr.beta, b, t, hv, 0), nb, beta);
  const bool logits = pr.math.beta_logits;
  for (int64_t i = 0; i < nb; ++i)
    beta[i] = detail::activate_beta<F>(logits, pr.math.allow_neg_eigval, beta[i]);
}

}  // namespace KDA_CPU_ISA
}  // namespace kda::cpu
