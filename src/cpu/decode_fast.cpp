// decode_fast.cpp — fast CPU decode: the recurrence in fp32, threads over (sequence, value head).
//
// Loops run over the contiguous value dimension of S[k][v] so they vectorize without
// reassociating sums; a bf16 state is rounded back to bf16 after every token (spec section 5).
#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "cpu/backends.h"
#include "cpu/token.h"

namespace kda::cpu {
inline namespace KDA_CPU_ISA {
namespace {

constexpr int kMaxD = 256;

struct DecodeScratch {
  float S[kMaxD * kMaxD];
  float q[kMaxD], k[kMaxD], v[kMaxD], a[kMaxD], beta[kMaxD], u[kMaxD], o[kMaxD];
};

void step_f32(DecodeScratch& w, int K, int V, bool beta_per_v, bool bf16_state) {
  float* S = w.S;
  for (int i = 0; i < K; ++i) {
    const float decay = std::exp(w.a[i]);
    for (int j = 0; j < V; ++j) S[i * V + j] *= decay;
  }
  std::fill(w.u, w.u + V, 0.0f);
  for (int i = 0; i < K; ++i) {
    const float ki = w.k[i];
    for (int j = 0; j < V; ++j) w.u[j] += S[i * V + j] * ki;
  }
  for (int j = 0; j < V; ++j) w.u[j] = w.beta[beta_per_v ? j : 0] * (w.v[j] - w.u[j]);
  std::fill(w.o, w.o + V, 0.0f);
  for (int i = 0; i < K; ++i) {
    const float ki = w.k[i], qi = w.q[i];
    for (int j = 0; j < V; ++j) {
      const float s = S[i * V + j] + ki * w.u[j];
      w.o[j] += s * qi;  // the output reads the state before it is rounded (as the reference)
      S[i * V + j] = bf16_state ? detail::bf16_bits_to_float(detail::float_to_bf16_bits(s)) : s;
    }
  }
}

void decode_task(const detail::DecodeProblem& pr, int64_t n, int64_t hv, DecodeScratch& w) {
  const auto& d = pr.d;
  const int K = static_cast<int>(d.K), V = static_cast<int>(d.V);
  const SeqSpan span = seq_span(d, pr.cu_seqlens, n);
  const int64_t slot = decode_read_slot(pr, n, span.len);
  if (slot < 0) {  // padding row: zero output, no state access
    std::fill(w.o, w.o + V, 0.0f);
    for (int64_t t = 0; t < span.len; ++t)
      store_row(pr.out, offset4(pr.out, span.b, span.bos + t, hv, 0), V, w.o);
    return;
  }
  const bool bf16_state = pr.state.dtype == DType::kBFloat16;
  HeadGate<float> hg;
  load_head_gate(pr, hv, &hg);
  std::fill(w.S, w.S + K * V, 0.0f);
  if (pr.use_initial_state) load_state(pr.state, pr.layout, slot, hv, K, V, w.S);
  for (int64_t t = 0; t < span.len; ++t) {
    load_token(pr, hg, span.b, span.bos + t, hv, w.q, w.k, w.v, w.a, w.beta);
    step_f32(w, K, V, pr.beta_per_v, bf16_state);
    store_row(pr.out, offset4(pr.out, span.b, span.bos + t, hv, 0), V, w.o);
    if (!pr.store_final_state) continue;
    if (pr.intermediate_states.present()) {
      store_state(pr.intermediate_states, pr.layout, span.b * d.T + span.bos + t, hv, K, V, w.S);
    } else if (pr.indices_2d) {
      const int64_t ws = decode_token_slot(pr, n, t);
      if (ws >= 0) store_state(pr.state, pr.layout, ws, hv, K, V, w.S);
    }
  }
  if (pr.store_final_state && !pr.intermediate_states.present() && !pr.indices_2d) {
    if (pr.final_state.present())
      store_state(pr.final_state, pr.layout, n, hv, K, V, w.S);
    else
      store_state(pr.state, pr.layout, slot, hv, K, V, w.S);
  }
}

}  // namespace

Status fast_decode(const detail::DecodeProblem& pr, int num_threads) {
  const int64_t tasks = pr.d.N * pr.d.HV;
  const int nt = worker_count(num_threads, tasks);
  std::vector<std::unique_ptr<DecodeScratch>> scratch(nt);
  return parallel_for(tasks, nt, [&](int64_t i, int worker) {
    ScopedFlushDenormals ftz;
    if (!scratch[worker]) scratch[worker] = std::make_unique<DecodeScratch>();
    decode_task(pr, i / pr.d.HV, i % pr.d.HV, *scratch[worker]);
  });
}

}  // namespace KDA_CPU_ISA
}  // namespace kda::cpu
