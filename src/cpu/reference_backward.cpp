// reference_backward.cpp — the analytic backward of the prefill in fp64 (spec section 8).
//
// Reverse mode through the token recurrence of reference.cpp, per (sequence, value head); the
// derivation is in docs/backward.md. Per head the forward is run once, keeping the state before
// every kCheckpoint-th token; the backward then walks the chunks from the last to the first,
// recomputing the chunk's states from its checkpoint. Memory per head: ceil(T / 64) + 64 states
// of K x V doubles and O(T (K + V)) preprocessed inputs. Single-threaded, in a fixed order, so
// the sums over tokens (dA_log, ddt_bias) and over value heads (dq, dk) are deterministic.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/backends.h"
#include "cpu/token.h"

namespace kda::cpu {
namespace {

constexpr int64_t kCheckpoint = 64;  // tokens between stored states

// The math options of the call in plain values.
struct Forms {
  int gate = detail::kGatePrecomputed;
  bool beta_logits = false, neg_eigval = false, l2norm = true;
  double scale = 1.0, lower_bound = -5.0;
};

Forms forms_of(const detail::MathConsts& g) {
  Forms f;
  f.gate = static_cast<int>(g.gate);
  f.beta_logits = g.beta_logits;
  f.neg_eigval = g.allow_neg_eigval;
  f.l2norm = g.use_qk_l2norm;
  f.scale = g.scale;
  f.lower_bound = g.lower_bound;
  return f;
}

// l2norm of x[n] in place (x <- x / r, r = sqrt(|x|^2 + eps)); returns r (1 without l2norm).
double normalize(double* x, int64_t n, bool l2norm) {
  if (!l2norm) return 1.0;
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const double r = std::sqrt(ss + detail::kL2NormEps);
  for (int64_t i = 0; i < n; ++i) x[i] /= r;
  return r;
}

// Backward of x_hat = x / r (r as returned by normalize): dx = (dx_hat - x_hat (x_hat . dx_hat)) /
// r.
void normalize_backward(const double* x_hat, double r, int64_t n, bool l2norm, double* dx) {
  if (!l2norm) return;
  double dot = 0;
  for (int64_t i = 0; i < n; ++i) dot += x_hat[i] * dx[i];
  for (int64_t i = 0; i < n; ++i) dx[i] = (dx[i] - x_hat[i] * dot) / r;
}

// The preprocessed inputs of one (sequence, value head), token-major, and the local derivatives
// the chain rule needs: a = log decay, dadx = da/d(g + dt_bias) (da/dg for the precomputed
// gate), dadA = da/dA_log, dbdbeta = db/dbeta.
struct HeadTokens {
  int64_t len = 0;
  std::vector<double> q_hat, k, v, a, dadx, dadA, b, dbdbeta, rq, rk;
};

void load_head_tokens(const detail::PrefillProblem& pr, const Forms& f, const SeqSpan& span,
                      int64_t hv, HeadTokens* ht) {
  const auto& d = pr.d;
  const int64_t K = d.K, V = d.V, len = span.len, h = hv / d.groups();
  ht->len = len;
  for (auto* x : {&ht->q_hat, &ht->k, &ht->a, &ht->dadx, &ht->dadA}) x->assign(len * K, 0.0);
  ht->v.assign(len * V, 0.0);
  for (auto* x : {&ht->b, &ht->dbdbeta, &ht->rq, &ht->rk}) x->assign(len, 0.0);
  HeadGate<double> hg;
  load_head_gate(pr, hv, &hg);
  const double lb = f.lower_bound;
  for (int64_t t = 0; t < len; ++t) {
    const int64_t tok = span.bos + t;
    double* q = &ht->q_hat[t * K];
    double* k = &ht->k[t * K];
    load_row(pr.q, offset4(pr.q, span.b, tok, h, 0), K, q);
    load_row(pr.k, offset4(pr.k, span.b, tok, h, 0), K, k);
    ht->rq[t] = normalize(q, K, f.l2norm);
    ht->rk[t] = normalize(k, K, f.l2norm);
    load_row(pr.v, offset4(pr.v, span.b, tok, hv, 0), V, &ht->v[t * V]);
    double* a = &ht->a[t * K];
    load_row(pr.g, offset4(pr.g, span.b, tok, hv, 0), K, a);
    for (int64_t i = 0; i < K; ++i) {
      const double x = a[i] + hg.bias[i];
      double& dadx = ht->dadx[t * K + i];
      double& dadA = ht->dadA[t * K + i];
      if (f.gate == detail::kGateSoftplus) {  // a = -e^A softplus(x), softplus(x) = x for x > 20
        dadx = -hg.exp_A * (x > 20.0 ? 1.0 : detail::sigmoid(x));
        dadA = -hg.exp_A * detail::softplus(x);
      } else if (f.gate == detail::kGateLowerBound) {  // a = lb sigmoid(z), z = e^A x
        const double z = hg.exp_A * x, s = detail::sigmoid(z), dadz = lb * s * (1.0 - s);
        dadx = dadz * hg.exp_A;
        dadA = dadz * z;
      } else {  // a = g
        dadx = 1.0;
        dadA = 0.0;
      }
      a[i] = detail::log_decay<double>(f.gate, a[i], hg.exp_A, hg.bias[i], lb);
    }
    double beta = 0;
    load_row(pr.beta, offset4(pr.beta, span.b, tok, hv, 0), 1, &beta);
    ht->b[t] = detail::activate_beta<double>(f.beta_logits, f.neg_eigval, beta);
    if (f.beta_logits) {
      const double s = detail::sigmoid(beta);
      ht->dbdbeta[t] = (f.neg_eigval ? 2.0 : 1.0) * s * (1.0 - s);
    } else {
      ht->dbdbeta[t] = 1.0;
    }
  }
}

// Scratch of one token step: the decayed state S' = diag(e^a) S_prev, p = S'^T k, u = b (v - p).
struct Step {
  std::vector<double> Sp, p, u;
  Step(int64_t K, int64_t V) : Sp(K * V), p(V), u(V) {}
};

// The forward of token t from S_prev into st (S' and u); S_next = S' + k u^T when given.
void forward_step(const HeadTokens& ht, int64_t t, const double* S_prev, int64_t K, int64_t V,
                  Step* st, double* S_next) {
  const double* k = &ht.k[t * K];
  const double* a = &ht.a[t * K];
  for (int64_t i = 0; i < K; ++i) {
    const double decay = std::exp(a[i]);
    for (int64_t j = 0; j < V; ++j) st->Sp[i * V + j] = decay * S_prev[i * V + j];
  }
  std::fill(st->p.begin(), st->p.end(), 0.0);
  for (int64_t i = 0; i < K; ++i)
    for (int64_t j = 0; j < V; ++j) st->p[j] += st->Sp[i * V + j] * k[i];
  for (int64_t j = 0; j < V; ++j) st->u[j] = ht.b[t] * (ht.v[t * V + j] - st->p[j]);
  if (S_next == nullptr) return;
  for (int64_t i = 0; i < K; ++i)
    for (int64_t j = 0; j < V; ++j) S_next[i * V + j] = st->Sp[i * V + j] + k[i] * st->u[j];
}

// Gradients of one token with respect to the preprocessed inputs.
struct TokenGrads {
  std::vector<double> dq, dk, dv, da, du;
  double db = 0;
  TokenGrads(int64_t K, int64_t V) : dq(K), dk(K), dv(V), da(K), du(V) {}
};

// Reverse of token t. G holds dL/dS_t (from the later tokens and the final state) on entry and
// dL/dS_{t-1} on return; dO = dL/do_t (nullptr = 0); st holds the token's forward_step.
//   o = S^T q            -> dq = S dO, G += q dO^T           (S = S' + k u^T)
//   S = S' + k u^T       -> du = G^T k, dk = G u, dS' = G
//   u = b (v - p)        -> db = du . (v - p), dv = b du, dp = -b du
//   p = S'^T k           -> dS' += k dp^T, dk += S' dp
//   S' = diag(e^a) S_prev -> da_i = sum_j S'_ij dS'_ij, dS_prev = diag(e^a) dS'
void backward_step(const HeadTokens& ht, int64_t t, const Step& st, const double* dO, double scale,
                   int64_t K, int64_t V, double* G, TokenGrads* tg) {
  const double* k = &ht.k[t * K];
  const double* a = &ht.a[t * K];
  const double* v = &ht.v[t * V];
  const double b = ht.b[t];
  std::fill(tg->dq.begin(), tg->dq.end(), 0.0);
  if (dO != nullptr) {
    double u_dO = 0;
    for (int64_t j = 0; j < V; ++j) u_dO += st.u[j] * dO[j];
    for (int64_t i = 0; i < K; ++i) {
      double s = 0;
      for (int64_t j = 0; j < V; ++j) s += st.Sp[i * V + j] * dO[j];
      tg->dq[i] = s + k[i] * u_dO;
      const double qi = scale * ht.q_hat[t * K + i];
      for (int64_t j = 0; j < V; ++j) G[i * V + j] += qi * dO[j];
    }
  }
  std::fill(tg->du.begin(), tg->du.end(), 0.0);
  for (int64_t i = 0; i < K; ++i)
    for (int64_t j = 0; j < V; ++j) tg->du[j] += G[i * V + j] * k[i];
  tg->db = 0;
  for (int64_t j = 0; j < V; ++j) {
    tg->db += tg->du[j] * (v[j] - st.p[j]);
    tg->dv[j] = b * tg->du[j];
  }
  // dp = -b du, kept in du from here on.
  for (int64_t j = 0; j < V; ++j) tg->du[j] *= -b;
  const std::vector<double>& dp = tg->du;
  for (int64_t i = 0; i < K; ++i) {
    double dk = 0, da = 0;
    const double decay = std::exp(a[i]);
    for (int64_t j = 0; j < V; ++j) {
      const double dSp = G[i * V + j] + k[i] * dp[j];
      dk += G[i * V + j] * st.u[j] + st.Sp[i * V + j] * dp[j];
      da += st.Sp[i * V + j] * dSp;
      G[i * V + j] = decay * dSp;
    }
    tg->dk[i] = dk;
    tg->da[i] = da;
  }
}

// Accumulators of one call: dA_log, ddt_bias over every sequence; dq, dk over a group's heads.
struct Sums {
  std::vector<double> dA_log, ddt_bias;  // [HV], [HV * K]
  std::vector<double> dq, dk;            // [len * K] of the current (sequence, q/k head)
};

// The backward of one (sequence, value head): writes dv, dg, dbeta, d_initial_state rows and
// adds to the sums.
void head_backward(const detail::PrefillBackwardProblem& bp, const Forms& f, int64_t n,
                   const SeqSpan& span, int64_t hv, HeadTokens* ht, Sums* sums) {
  const detail::PrefillProblem& pr = bp.fwd;
  const int64_t K = pr.d.K, V = pr.d.V, KV = K * V, len = span.len;
  load_head_tokens(pr, f, span, hv, ht);

  // Forward: the state before every kCheckpoint-th token.
  const int64_t chunks = (len + kCheckpoint - 1) / kCheckpoint;
  std::vector<double> S(KV, 0.0), ckpt(chunks * KV);
  if (pr.initial_state.present()) load_state(pr.initial_state, pr.layout, n, hv, K, V, S.data());
  Step st(K, V);
  std::vector<double> S_next(KV);
  for (int64_t t = 0; t < len; ++t) {
    if (t % kCheckpoint == 0) std::copy(S.begin(), S.end(), ckpt.begin() + (t / kCheckpoint) * KV);
    forward_step(*ht, t, S.data(), K, V, &st, S_next.data());
    S.swap(S_next);
  }

  // Backward, chunk by chunk from the last: recompute the chunk's states, then reverse its tokens.
  std::vector<double> G(KV, 0.0);
  if (bp.d_final_state.present()) load_state(bp.d_final_state, pr.layout, n, hv, K, V, G.data());
  std::vector<double> chunk_states(kCheckpoint * KV), dO(V), dg(K);
  TokenGrads tg(K, V);
  for (int64_t c = chunks - 1; c >= 0; --c) {
    const int64_t t0 = c * kCheckpoint, L = std::min(kCheckpoint, len - t0);
    std::copy(ckpt.begin() + c * KV, ckpt.begin() + (c + 1) * KV, chunk_states.begin());
    for (int64_t j = 0; j + 1 < L; ++j)
      forward_step(*ht, t0 + j, &chunk_states[j * KV], K, V, &st, &chunk_states[(j + 1) * KV]);
    for (int64_t j = L - 1; j >= 0; --j) {
      const int64_t t = t0 + j, tok = span.bos + t;
      forward_step(*ht, t, &chunk_states[j * KV], K, V, &st, nullptr);
      if (bp.d_out.present())
        load_row(bp.d_out, offset4(bp.d_out, span.b, tok, hv, 0), V, dO.data());
      backward_step(*ht, t, st, bp.d_out.present() ? dO.data() : nullptr, f.scale, K, V, G.data(),
                    &tg);

      // Chain through the preprocessing of spec section 2.
      if (bp.dv.present()) store_row(bp.dv, offset4(bp.dv, span.b, tok, hv, 0), V, tg.dv.data());
      if (bp.dbeta.present()) {
        const double dbeta = tg.db * ht->dbdbeta[t];
        store_row(bp.dbeta, offset4(bp.dbeta, span.b, tok, hv, 0), 1, &dbeta);
      }
      double dA = 0;
      for (int64_t i = 0; i < K; ++i) {
        dg[i] = tg.da[i] * ht->dadx[t * K + i];
        dA += tg.da[i] * ht->dadA[t * K + i];
        if (f.gate != detail::kGatePrecomputed) sums->ddt_bias[hv * K + i] += dg[i];
      }
      sums->dA_log[hv] += dA;
      if (bp.dg.present()) store_row(bp.dg, offset4(bp.dg, span.b, tok, hv, 0), K, dg.data());
      for (int64_t i = 0; i < K; ++i) tg.dq[i] *= f.scale;
      normalize_backward(&ht->q_hat[t * K], ht->rq[t], K, f.l2norm, tg.dq.data());
      normalize_backward(&ht->k[t * K], ht->rk[t], K, f.l2norm, tg.dk.data());
      for (int64_t i = 0; i < K; ++i) {
        sums->dq[t * K + i] += tg.dq[i];
        sums->dk[t * K + i] += tg.dk[i];
      }
    }
  }
  if (bp.d_initial_state.present())
    store_state(bp.d_initial_state, pr.layout, n, hv, K, V, G.data());
}

}  // namespace

void reference_prefill_backward(const detail::PrefillBackwardProblem& bp) {
  const detail::PrefillProblem& pr = bp.fwd;
  const auto& d = pr.d;
  const Forms f = forms_of(pr.math);
  Sums sums;
  sums.dA_log.assign(d.HV, 0.0);
  sums.ddt_bias.assign(d.HV * d.K, 0.0);
  HeadTokens ht;
  for (int64_t n = 0; n < d.N; ++n) {
    const SeqSpan span = seq_span(d, pr.cu_seqlens, n);
    for (int64_t h = 0; h < d.H; ++h) {
      sums.dq.assign(span.len * d.K, 0.0);
      sums.dk.assign(span.len * d.K, 0.0);
      for (int64_t hv = h * d.groups(); hv < (h + 1) * d.groups(); ++hv)
        head_backward(bp, f, n, span, hv, &ht, &sums);
      for (int64_t t = 0; t < span.len; ++t) {
        const int64_t tok = span.bos + t;
        if (bp.dq.present())
          store_row(bp.dq, offset4(bp.dq, span.b, tok, h, 0), d.K, &sums.dq[t * d.K]);
        if (bp.dk.present())
          store_row(bp.dk, offset4(bp.dk, span.b, tok, h, 0), d.K, &sums.dk[t * d.K]);
      }
    }
  }
  // The precomputed gate reads neither A_log nor dt_bias: their gradients stay zero.
  if (bp.dA_log.present())
    for (int64_t hv = 0; hv < d.HV; ++hv)
      store_row(bp.dA_log, hv * bp.dA_log.strides[0], 1, &sums.dA_log[hv]);
  if (bp.ddt_bias.present())
    for (int64_t hv = 0; hv < d.HV; ++hv)
      store_row(bp.ddt_bias, hv * bp.ddt_bias.strides[0], d.K, &sums.ddt_bias[hv * d.K]);
}

}  // namespace kda::cpu
