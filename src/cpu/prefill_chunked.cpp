// prefill_chunked.cpp — fast CPU prefill: the chunked (WY) algorithm in fp32, chunk kChunkSize.
//
// This is also the algorithm mirror of the CUDA prefill kernel: same chunk (64), same 16-token
// sub-chunks, same exact treatment of unbounded decays. The math (docs/design.md, section 3):
//
//   G_t = sum_{s<=t} a_s                     (cumulative log decay inside the chunk, <= 0)
//   Akk[t,s] = sum_k k_t k_s exp(G_t - G_s)  (s < t)        Aqk[t,s] = same with q_t (s <= t)
//   Ut_t = b_t (v_t - sum_{s<t} Akk[t,s] Ut_s)                  (forward substitution)
//   W_t  = b_t (exp(G_t) k_t - sum_{s<t} Akk[t,s] W_s)
//   U    = Ut - W S                                            (S: state at chunk start, K x V)
//   O_t  = (exp(G_t) q_t)^T S + sum_{s<=t} Aqk[t,s] U_s
//   S'   = diag(exp(G_L)) S + sum_s (exp(G_L - G_s) k_s) U_s^T
//
// Exactness for unbounded decays: no decay factor ever exceeds 1. Every factor exp(G_t - G_s) is
// a product of per-token decays d_j = exp(a_j) <= 1 (a running product, never a difference of
// cumulative sums, which loses precision once |G| is large, e.g. after a -1000 gate). Off-diagonal
// 16x16 blocks factor exp(G_t - G_s) = exp(G_t - G_r) exp(G_r - G_s) with r the first token of
// the row block (s < r <= t, so both factors <= 1); diagonal blocks use the product directly.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu/backends.h"
#include "cpu/token.h"
#include "cpu/vec_math.h"

namespace kda::cpu {
inline namespace KDA_CPU_ISA {
namespace {

constexpr int kC = kChunkSize;  // tokens per chunk
constexpr int kSub = 16;        // tokens per sub-chunk
constexpr int kMaxD = 256;      // largest K or V

// C[M x N] += A[M x Kd] * B[Kd x N], all row-major with leading dimensions. Register tiles of
// 4 rows x 16 columns held in GCC/Clang vector types (two 8-float vectors per row), so the
// accumulators stay in registers whatever the target ISA.
typedef float v8f __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
  v8f x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
inline void store8(float* p, v8f x) { std::memcpy(p, &x, sizeof(x)); }

// With lower = true, A is lower triangular (A[i][kk] = 0 for kk > i) and those terms are skipped.
inline void gemm_acc(int M, int N, int Kd, const float* A, int lda, const float* B, int ldb,
                     float* C, int ldc, bool lower = false) {
  const int N16 = N & ~15;
  int r = 0;
  for (; r + 4 <= M; r += 4) {
    for (int c = 0; c < N16; c += 16) {
      v8f acc[4][2];
      for (int i = 0; i < 4; ++i) {
        acc[i][0] = load8(C + (r + i) * ldc + c);
        acc[i][1] = load8(C + (r + i) * ldc + c + 8);
      }
      const int kend = lower ? std::min(Kd, r + 4) : Kd;
      for (int kk = 0; kk < kend; ++kk) {
        const v8f b0 = load8(B + kk * ldb + c), b1 = load8(B + kk * ldb + c + 8);
        for (int i = 0; i < 4; ++i) {
          const float a = A[(r + i) * lda + kk];
          acc[i][0] += a * b0;
          acc[i][1] += a * b1;
        }
      }
      for (int i = 0; i < 4; ++i) {
        store8(C + (r + i) * ldc + c, acc[i][0]);
        store8(C + (r + i) * ldc + c + 8, acc[i][1]);
      }
    }
    for (int c = N16; c < N; ++c)
      for (int i = 0; i < 4; ++i) {
        float s = C[(r + i) * ldc + c];
        for (int kk = 0; kk < Kd; ++kk) s += A[(r + i) * lda + kk] * B[kk * ldb + c];
        C[(r + i) * ldc + c] = s;
      }
  }
  for (; r < M; ++r)
    for (int kk = 0; kk < Kd; ++kk) {
      const float a = A[r * lda + kk];
      for (int c = 0; c < N; ++c) C[r * ldc + c] += a * B[kk * ldb + c];
    }
}

// dst[c * ldd + r] = src[r * cols + c] for r < rows, c < cols.
inline void transpose(const float* src, int rows, int cols, float* dst, int ldd) {
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) dst[c * ldd + r] = src[r * cols + c];
}

// Per-task scratch, row-major [token][channel] unless named *T (transposed, [channel][token]).
struct Scratch {
  float q[kC * kMaxD], k[kC * kMaxD], v[kC * kMaxD];
  float P[kC * kMaxD];   // exp(G_t) = prod_{j <= t} d_j
  float qg[kC * kMaxD];  // exp(G_t) q_t
  float w[kC * kMaxD];   // W
  float ut[kC * kMaxD];  // Ut, then U
  float o[kC * kMaxD];
  float kbT[kMaxD * kC];                     // exp(G_L - G_s) k_s, transposed
  float rq[kSub * kMaxD], rk[kSub * kMaxD];  // row-block operands q_t exp(G_t - G_r), k_t exp(..)
  float kcT[kMaxD * kC];                     // column operand k_s exp(G_r - G_s), transposed
  float d[kC * kMaxD];                       // exp(a_t), per-token decays
  float e[kMaxD];                            // running decay product
  float Akk[kC * kC], Aqk[kC * kC];
  float Tm[kC * kC];     // (I + diag(b) Akk)^-1 diag(b), lower triangular
  float kg[kC * kMaxD];  // exp(G_t) k_t
  float b[kC];
  float S[kMaxD * kMaxD], tmp[kMaxD * kMaxD];
};

// Builds Akk (strictly lower) and Aqk (lower, with diagonal) of a chunk of L tokens.
void intra_chunk(Scratch& w, int L, int K) {
  const int K8 = K & ~7;
  std::fill(w.Akk, w.Akk + kC * kC, 0.0f);
  std::fill(w.Aqk, w.Aqk + kC * kC, 0.0f);
  for (int r0 = 0; r0 < L; r0 += kSub) {
    const int rows = std::min(kSub, L - r0);
    // Off-diagonal blocks: all columns s < r0 against rows [r0, r0 + rows), reference G_{r0}.
    if (r0 > 0) {
      // Row operands: q_t, k_t times exp(G_t - G_r) = prod_{r < j <= t} d_j.
      for (int c = 0; c < K; ++c) w.e[c] = 1.0f;
      for (int i = 0; i < rows; ++i) {
        const int t = r0 + i;
        if (i > 0)
          for (int c = 0; c < K; ++c) w.e[c] *= w.d[t * K + c];
        for (int c = 0; c < K; ++c) {
          w.rq[i * K + c] = w.q[t * K + c] * w.e[c];
          w.rk[i * K + c] = w.k[t * K + c] * w.e[c];
        }
      }
      // Column operand: k_s exp(G_r - G_s) = k_s prod_{s < j <= r} d_j, built backwards from r.
      for (int c = 0; c < K; ++c) w.e[c] = 1.0f;
      for (int s2 = r0 - 1; s2 >= 0; --s2) {
        for (int c = 0; c < K; ++c) w.e[c] *= w.d[(s2 + 1) * K + c];
        for (int c = 0; c < K; ++c) w.tmp[s2 * K + c] = w.k[s2 * K + c] * w.e[c];
      }
      transpose(w.tmp, r0, K, w.kcT, kC);
      gemm_acc(rows, r0, K, w.rk, K, w.kcT, kC, w.Akk + r0 * kC, kC);
      gemm_acc(rows, r0, K, w.rq, K, w.kcT, kC, w.Aqk + r0 * kC, kC);
    }
    // Diagonal block, s <= t inside the block: exp(G_t - G_s) = prod_{s < j <= t} exp(a_j), a
    // running product of per-token decays (every factor <= 1: exact for any decay, no exp here).
    for (int i = 0; i < rows; ++i) {
      const int s2 = r0 + i;
      const float* ks = w.k + s2 * K;
      for (int c = 0; c < K; ++c) w.e[c] = 1.0f;
      for (int t = s2; t < r0 + rows; ++t) {
        const float* dt = w.d + t * K;
        const float* kt = w.k + t * K;
        const float* qt = w.q + t * K;
        v8f akk = {}, aqk = {};
        for (int c = 0; c < K8; c += 8) {
          v8f e = load8(w.e + c);
          if (t > s2) {
            e *= load8(dt + c);
            store8(w.e + c, e);
          }
          const v8f p = e * load8(ks + c);
          akk += load8(kt + c) * p;
          aqk += load8(qt + c) * p;
        }
        float sa = 0.0f, sq = 0.0f;
        for (int j = 0; j < 8; ++j) {
          sa += akk[j];
          sq += aqk[j];
        }
        for (int c = K8; c < K; ++c) {  // channels past the last multiple of 8
          if (t > s2) w.e[c] *= dt[c];
          const float p = w.e[c] * ks[c];
          sa += kt[c] * p;
          sq += qt[c] * p;
        }
        if (t > s2) w.Akk[t * kC + s2] = sa;
        w.Aqk[t * kC + s2] = sq;
      }
    }
  }
}

// One chunk: intra-chunk products, forward substitution, output and state update.
void process_chunk(Scratch& w, int L, int K, int V) {
  intra_chunk(w, L, K);
  // Tm = (I + diag(b) Akk)^-1 diag(b) by forward substitution on the L x L triangle:
  // row t = b_t (e_t - sum_{s<t} Akk[t,s] row s).
  std::fill(w.Tm, w.Tm + kC * kC, 0.0f);
  for (int t = 0; t < L; ++t) {
    float* row = w.Tm + t * kC;
    for (int s = 0; s < t; ++s) {
      const float a = w.Akk[t * kC + s];
      const float* rs = w.Tm + s * kC;
      for (int j = 0; j <= s; ++j) row[j] -= a * rs[j];
    }
    row[t] = 1.0f;
    for (int j = 0; j <= t; ++j) row[j] *= w.b[t];
  }
  // Ut = Tm V, W = Tm (exp(G) k)
  for (int t = 0; t < L; ++t)
    for (int c = 0; c < K; ++c) w.kg[t * K + c] = w.k[t * K + c] * w.P[t * K + c];
  std::fill(w.ut, w.ut + L * V, 0.0f);
  std::fill(w.w, w.w + L * K, 0.0f);
  gemm_acc(L, V, L, w.Tm, kC, w.v, V, w.ut, V, true);
  gemm_acc(L, K, L, w.Tm, kC, w.kg, K, w.w, K, true);
  // U = Ut - W S  (in place in ut): accumulate -W S.
  for (int i = 0; i < L * K; ++i) w.w[i] = -w.w[i];
  gemm_acc(L, V, K, w.w, K, w.S, V, w.ut, V);
  // O = (exp(G) q) S + Aqk U
  const float* PL = w.P + (L - 1) * K;  // exp(G_L)
  for (int t = 0; t < L; ++t)
    for (int c = 0; c < K; ++c) w.qg[t * K + c] = w.q[t * K + c] * w.P[t * K + c];
  std::fill(w.o, w.o + L * V, 0.0f);
  gemm_acc(L, V, K, w.qg, K, w.S, V, w.o, V);
  gemm_acc(L, V, L, w.Aqk, kC, w.ut, V, w.o, V, true);
  // S' = diag(exp(G_L)) S + (exp(G_L - G_s) k_s)^T U
  // exp(G_L - G_s) k_s = k_s prod_{s < j < L} d_j, built backwards from the last token.
  for (int c = 0; c < K; ++c) w.e[c] = 1.0f;
  for (int s2 = L - 1; s2 >= 0; --s2) {
    if (s2 < L - 1)
      for (int c = 0; c < K; ++c) w.e[c] *= w.d[(s2 + 1) * K + c];
    for (int c = 0; c < K; ++c) w.tmp[s2 * K + c] = w.k[s2 * K + c] * w.e[c];
  }
  transpose(w.tmp, L, K, w.kbT, kC);
  for (int c = 0; c < K; ++c) {
    const float d = PL[c];
    for (int j = 0; j < V; ++j) w.S[c * V + j] *= d;
  }
  gemm_acc(K, V, L, w.kbT, kC, w.ut, V, w.S, V);
}

void prefill_task(const detail::PrefillProblem& pr, int64_t n, int64_t hv, Scratch& w) {
  const auto& d = pr.d;
  const int K = static_cast<int>(d.K), V = static_cast<int>(d.V);
  const SeqSpan span = seq_span(d, pr.cu_seqlens, n);
  const int64_t slot = prefill_pool_slot(pr, n);
  std::fill(w.S, w.S + K * V, 0.0f);
  if (pr.initial_state.present()) load_state(pr.initial_state, pr.layout, n, hv, K, V, w.S);
  if (slot >= 0) load_state(pr.state_pool, pr.layout, slot, hv, K, V, w.S);
  HeadGate<float> hg;
  load_head_gate(pr, hv, &hg);
  float a[kMaxD];
  const int gate = static_cast<int>(pr.math.gate);
  const float lower_bound = pr.math.lower_bound;
  for (int64_t c0 = 0; c0 < span.len; c0 += kC) {
    const int L = static_cast<int>(std::min<int64_t>(kC, span.len - c0));
    // Load and preprocess the chunk; G = cumulative log decay.
    for (int t = 0; t < L; ++t) {
      load_token</*kRawGate=*/true>(pr, hg, span.b, span.bos + c0 + t, hv, w.q + t * K, w.k + t * K,
                                    w.v + t * V, a, &w.b[t]);
      log_decay_row(gate, a, K, hg.exp_A, hg.bias, lower_bound);
      for (int c = 0; c < K; ++c) w.d[t * K + c] = exp_f32(a[c]);
      const float* prev = t > 0 ? w.P + (t - 1) * K : nullptr;
      for (int c = 0; c < K; ++c) w.P[t * K + c] = (prev ? prev[c] : 1.0f) * w.d[t * K + c];
    }
    process_chunk(w, L, K, V);
    // Outputs of the chunk.
    for (int t = 0; t < L; ++t)
      store_row(pr.out, offset4(pr.out, span.b, span.bos + c0 + t, hv, 0), V, w.o + t * V);
    // Checkpoint at chunk boundaries that are multiples of checkpoint_every.
    const int64_t done = c0 + L;
    if (pr.checkpoint_every > 0 && done % pr.checkpoint_every == 0) {
      const int64_t row =
          detail::load_index(pr.checkpoint_offsets, n) + done / pr.checkpoint_every - 1;
      if (row < detail::load_index(pr.checkpoint_offsets, n + 1) && row < pr.checkpoints.shape[0])
        store_state(pr.checkpoints, pr.layout, row, hv, K, V, w.S);
    }
  }
  if (pr.final_state.present()) store_state(pr.final_state, pr.layout, n, hv, K, V, w.S);
  if (slot >= 0) store_state(pr.state_pool, pr.layout, slot, hv, K, V, w.S);
}

}  // namespace

Status fast_prefill(const detail::PrefillProblem& pr, int num_threads) {
  const int64_t tasks = pr.d.N * pr.d.HV;
  const int nt = worker_count(num_threads, tasks);
  std::vector<std::unique_ptr<Scratch>> scratch(nt);
  return parallel_for(tasks, nt, [&](int64_t i, int worker) {
    ScopedFlushDenormals ftz;
    if (!scratch[worker]) scratch[worker] = std::make_unique<Scratch>();
    prefill_task(pr, i / pr.d.HV, i % pr.d.HV, *scratch[worker]);
  });
}

}  // namespace KDA_CPU_ISA
}  // namespace kda::cpu
