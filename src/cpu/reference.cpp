// reference.cpp — the spec in code: the token-by-token recurrence in fp64 (spec sections 3-5).
//
// Deliberately short and single-threaded; every other backend is tested against it.
#include <cmath>
#include <vector>

#include "cpu/backends.h"
#include "cpu/token.h"

namespace kda::cpu {
namespace {

// One token of the recurrence on S[k * V + v] (spec section 3):
//   S <- diag(exp(a)) S;  u = b (v - S^T k);  S <- S + k u^T;  o = S^T q.
void recurrence_step(double* S, const double* q, const double* k, const double* v, const double* a,
                     const double* beta, bool beta_per_v, double* o, int64_t K, int64_t V) {
  for (int64_t i = 0; i < K; ++i) {
    const double decay = std::exp(a[i]);
    for (int64_t j = 0; j < V; ++j) S[i * V + j] *= decay;
  }
  std::vector<double> u(V);
  for (int64_t j = 0; j < V; ++j) {
    double sk = 0;
    for (int64_t i = 0; i < K; ++i) sk += S[i * V + j] * k[i];
    u[j] = beta[beta_per_v ? j : 0] * (v[j] - sk);
  }
  for (int64_t i = 0; i < K; ++i)
    for (int64_t j = 0; j < V; ++j) S[i * V + j] += k[i] * u[j];
  for (int64_t j = 0; j < V; ++j) {
    double s = 0;
    for (int64_t i = 0; i < K; ++i) s += S[i * V + j] * q[i];
    o[j] = s;
  }
}

struct TokenBuffers {
  std::vector<double> q, k, v, a, beta, o;
  TokenBuffers(int64_t K, int64_t V) : q(K), k(K), v(V), a(K), beta(V), o(V) {}
};

}  // namespace

void reference_prefill(const detail::PrefillProblem& pr) {
  const auto& d = pr.d;
  TokenBuffers buf(d.K, d.V);
  std::vector<double> S(d.K * d.V);
  HeadGate<double> hg;
  for (int64_t n = 0; n < d.N; ++n) {
    const SeqSpan span = seq_span(d, pr.cu_seqlens, n);
    const int64_t slot = prefill_pool_slot(pr, n);
    for (int64_t hv = 0; hv < d.HV; ++hv) {
      load_head_gate(pr, hv, &hg);
      std::fill(S.begin(), S.end(), 0.0);
      if (pr.initial_state.present())
        load_state(pr.initial_state, pr.layout, n, hv, d.K, d.V, S.data());
      if (slot >= 0) load_state(pr.state_pool, pr.layout, slot, hv, d.K, d.V, S.data());
      for (int64_t t = 0; t < span.len; ++t) {
        load_token(pr, hg, span.b, span.bos + t, hv, buf.q.data(), buf.k.data(), buf.v.data(),
                   buf.a.data(), buf.beta.data());
        recurrence_step(S.data(), buf.q.data(), buf.k.data(), buf.v.data(), buf.a.data(),
                        buf.beta.data(), false, buf.o.data(), d.K, d.V);
        store_row(pr.out, offset4(pr.out, span.b, span.bos + t, hv, 0), d.V, buf.o.data());
        if (pr.checkpoint_every > 0 && (t + 1) % pr.checkpoint_every == 0) {
          const int64_t row =
              detail::load_index(pr.checkpoint_offsets, n) + (t + 1) / pr.checkpoint_every - 1;
          if (row < detail::load_index(pr.checkpoint_offsets, n + 1) &&
              row < pr.checkpoints.shape[0])
            store_state(pr.checkpoints, pr.layout, row, hv, d.K, d.V, S.data());
        }
      }
      if (pr.final_state.present())
        store_state(pr.final_state, pr.layout, n, hv, d.K, d.V, S.data());
      if (slot >= 0) store_state(pr.state_pool, pr.layout, slot, hv, d.K, d.V, S.data());
    }
  }
}

int64_t decode_read_slot(const detail::DecodeProblem& pr, int64_t n, int64_t len) {
  return detail::decode_row_slot(pr, detail::own_index_data(pr), n, len).slot;
}

int64_t decode_token_slot(const detail::DecodeProblem& pr, int64_t n, int64_t t) {
  return rules::pool_slot(detail::load_index(pr.state_indices, n, t), pr.state.shape[0]);
}

void reference_decode(const detail::DecodeProblem& pr) {
  const auto& d = pr.d;
  const bool bf16_state = pr.state.dtype == DType::kBFloat16;
  TokenBuffers buf(d.K, d.V);
  std::vector<double> S(d.K * d.V);
  std::vector<double> zeros(d.V, 0.0);
  HeadGate<double> hg;
  for (int64_t n = 0; n < d.N; ++n) {
    const SeqSpan span = seq_span(d, pr.cu_seqlens, n);
    const int64_t slot = decode_read_slot(pr, n, span.len);
    for (int64_t hv = 0; hv < d.HV; ++hv) {
      if (slot < 0) {  // padding row: zero output, no state access
        for (int64_t t = 0; t < span.len; ++t)
          store_row(pr.out, offset4(pr.out, span.b, span.bos + t, hv, 0), d.V, zeros.data());
        continue;
      }
      load_head_gate(pr, hv, &hg);
      std::fill(S.begin(), S.end(), 0.0);
      if (pr.use_initial_state) load_state(pr.state, pr.layout, slot, hv, d.K, d.V, S.data());
      for (int64_t t = 0; t < span.len; ++t) {
        load_token(pr, hg, span.b, span.bos + t, hv, buf.q.data(), buf.k.data(), buf.v.data(),
                   buf.a.data(), buf.beta.data());
        recurrence_step(S.data(), buf.q.data(), buf.k.data(), buf.v.data(), buf.a.data(),
                        buf.beta.data(), pr.beta_per_v, buf.o.data(), d.K, d.V);
        if (bf16_state)  // a bf16 state is rounded back after every token
          for (double& x : S) x = round_to(DType::kBFloat16, x);
        store_row(pr.out, offset4(pr.out, span.b, span.bos + t, hv, 0), d.V, buf.o.data());
        if (!pr.store_final_state) continue;
        if (pr.intermediate_states.present()) {
          store_state(pr.intermediate_states, pr.layout, span.b * d.T + span.bos + t, hv, d.K, d.V,
                      S.data());
        } else if (pr.indices_2d) {
          const int64_t ws = decode_token_slot(pr, n, t);
          if (ws >= 0) store_state(pr.state, pr.layout, ws, hv, d.K, d.V, S.data());
        }
      }
      if (pr.store_final_state && !pr.intermediate_states.present() && !pr.indices_2d) {
        if (pr.final_state.present())
          store_state(pr.final_state, pr.layout, n, hv, d.K, d.V, S.data());
        else
          store_state(pr.state, pr.layout, slot, hv, d.K, d.V, S.data());
      }
    }
  }
}

}  // namespace kda::cpu
