// token.cuh — per-token preprocessing of the decode kernels: l2 norms, scale, gate -> decay,
// beta activation. stage_token (one copy per warp, the tile kernel), load_raw_token / prep_token
// (raw loads issued early, converted late; one copy per block, the staged and bulk
// kernels), prep_lane (the same in registers, one copy per warp: the warp kernel), and the L2
// prefetch of a row's later tokens.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/ptx.cuh"
#include "cuda/decode/rows.cuh"
#include "cuda/heuristics/decode.h"

namespace kda::cuda::dec {

constexpr int kPersistK = 128, kPersistTileV = 32;  // K (= V) and value rows of a prepared token
static_assert(kPersistK == kDecodeFastK, "heuristics/decode.h: the K of the fast kernels");

// Hints the per-token inputs of tokens [bos + 1, bos + min(len, 8)) of this head into L2 while the
// state tile is in flight, so later tokens do not wait on DRAM.
__device__ __forceinline__ void prefetch_later_tokens(const DecodeArgs& a, const SeqRow& row, int h,
                                                      int hv) {
  const int64_t later = (row.len < 8 ? row.len : 8) - 1;
  if (later <= 0) return;
  // Per token: q, k (K elements), g (K), v (V), beta (1 or V): lines of 128 bytes.
  const int lines_k = (a.K * (a.g.dtype == kF32 ? 4 : 2) + 127) / 128;  // covers q, k, g
  const int per_token = 4 * lines_k + (a.beta_per_v ? lines_k : 1);
  for (int i = threadIdx.x; i < later * per_token; i += blockDim.x) {
    const int64_t tok = row.bos + 1 + i / per_token;
    const int j = i % per_token;
    const int which = j / lines_k, line = j % lines_k;
    const char* p = nullptr;
    int64_t bytes = 0;
    switch (which) {
      case 0:
        p = static_cast<const char*>(a.q.data) +
            a.q.offset(row.b, tok, h) * (a.q.dtype == kF32 ? 4 : 2);
        bytes = a.K * 2;
        break;
      case 1:
        p = static_cast<const char*>(a.k.data) +
            a.k.offset(row.b, tok, h) * (a.k.dtype == kF32 ? 4 : 2);
        bytes = a.K * 2;
        break;
      case 2:
        p = static_cast<const char*>(a.g.data) +
            a.g.offset(row.b, tok, hv) * (a.g.dtype == kF32 ? 4 : 2);
        bytes = a.K * (a.g.dtype == kF32 ? 4 : 2);
        break;
      case 3:
        p = static_cast<const char*>(a.v.data) + a.v.offset(row.b, tok, hv) * 2;
        bytes = a.V * 2;
        break;
      default:
        p = static_cast<const char*>(a.beta.data) +
            a.beta.offset(row.b, tok, hv) * (a.beta.dtype == kF32 ? 4 : 2);
        bytes = (a.beta_per_v ? a.V : 1) * (a.beta.dtype == kF32 ? 4 : 2);
        break;
    }
    if (line * 128 < bytes) prefetch_l2(p + line * 128);
  }
}

// One warp's copy of the preprocessed inputs of the current token (3 x kMaxK fp32: 1.5 KB at
// K = 128). Every warp stages its own copy, so no block barrier is needed.
template <int kMaxK>
struct __align__(16) TokenStage {
  float q[kMaxK];      // l2-normalized, scaled q of head h
  float k[kMaxK];      // l2-normalized k of head h
  float decay[kMaxK];  // exp(a_t) of value head hv
};

// Lane l preprocesses the kMaxK / 32 contiguous k elements starting at l * kMaxK / 32 (padded
// elements k >= K: q = k = 0, decay = 1); the l2 norms are full-warp butterflies.
template <int kMaxK>
__device__ __forceinline__ void stage_token(const DecodeArgs& a, int64_t b, int64_t tok, int h,
                                            int hv, float exp_A, TokenStage<kMaxK>& sh) {
  constexpr int kPer = kMaxK / 32;
  const int k0 = lane_id() * kPer;
  float q[kPer], k[kPer], d[kPer];
  if (k0 < a.K) {
    load_run<kPer>(a.q.data, a.q.dtype, a.q.vec, a.q.offset(b, tok, h) + k0, q);
    load_run<kPer>(a.k.data, a.k.dtype, a.k.vec, a.k.offset(b, tok, h) + k0, k);
    load_run<kPer>(a.g.data, a.g.dtype, a.g.vec, a.g.offset(b, tok, hv) + k0, d);
    float bias[kPer];
    if (a.dt_bias.data != nullptr) {
      load_run<kPer>(a.dt_bias.data, a.dt_bias.dtype, a.dt_bias.vec, hv * a.dt_bias.s0 + k0, bias);
    } else {
#pragma unroll
      for (int e = 0; e < kPer; ++e) bias[e] = 0.f;
    }
#pragma unroll
    for (int e = 0; e < kPer; ++e)
      d[e] = expf(detail::log_decay<float>(a.gate, d[e], exp_A, bias[e], a.lower_bound));
  } else {
#pragma unroll
    for (int e = 0; e < kPer; ++e) q[e] = 0.f, k[e] = 0.f, d[e] = 1.f;
  }
  float q_norm = 1.f, k_norm = 1.f;
  if (a.use_qk_l2norm) {
    float qq = 0.f, kq = 0.f;
#pragma unroll
    for (int e = 0; e < kPer; ++e) qq = fmaf(q[e], q[e], qq), kq = fmaf(k[e], k[e], kq);
    qq = lane_group_sum<32>(qq);
    kq = lane_group_sum<32>(kq);
    q_norm = 1.f / sqrtf(qq + static_cast<float>(detail::kL2NormEps));
    k_norm = 1.f / sqrtf(kq + static_cast<float>(detail::kL2NormEps));
  }
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    sh.q[k0 + e] = (q[e] * q_norm) * a.scale;
    sh.k[k0 + e] = k[e] * k_norm;
    sh.decay[k0 + e] = d[e];
  }
}

struct __align__(16) PreparedToken {
  float q[kPersistK];
  float k[kPersistK];
  float decay[kPersistK];
  float v[kPersistTileV];
  float beta[kPersistTileV];
};

// The raw inputs of one token that one producer lane needs (q, k, g at k = 4 * lane .. + 3, the
// gate bias there and A_log of the head, v and beta of row 32 * tile + lane), as loaded (raw bits,
// see load_raw4): converted by prep_token, so that the loads of a token (and the index loads
// after them) are all in flight at once.
struct RawToken {
  Raw4 q, k, g, bias;
  uint32_t v, beta;
  float A_log;
};

__device__ __forceinline__ void load_raw_token(const DecodeArgs& a, int64_t n, int64_t tok, int h,
                                               int hv, int tile_v0, int lane, RawToken& r) {
  const int k0 = lane * 4;
  if (k0 < a.K) {
    r.q = load_raw4(a.q.data, a.q.dtype, a.q.vec, a.q.offset(n, tok, h) + k0);
    r.k = load_raw4(a.k.data, a.k.dtype, a.k.vec, a.k.offset(n, tok, h) + k0);
    r.g = load_raw4(a.g.data, a.g.dtype, a.g.vec, a.g.offset(n, tok, hv) + k0);
    if (a.dt_bias.data != nullptr)
      r.bias = load_raw4(a.dt_bias.data, a.dt_bias.dtype, a.dt_bias.vec, hv * a.dt_bias.s0 + k0);
  }
  const int v = tile_v0 + lane;
  r.v = load_raw_elem(a.v.data, a.v.dtype, a.v.offset(n, tok, hv) + v);
  r.beta =
      load_raw_elem(a.beta.data, a.beta.dtype, a.beta.offset(n, tok, hv) + (a.beta_per_v ? v : 0));
  r.A_log = a.A_log != nullptr ? a.A_log[hv * a.A_log_s0] : 0.f;
}

// load_raw_token for a lane whose v and beta are those of value row v_row (any layout of rows over
// lanes; q, k, g and dt_bias as above).
__device__ __forceinline__ void load_raw_token_row(const DecodeArgs& a, int64_t n, int64_t tok,
                                                   int h, int hv, int v_row, int lane,
                                                   RawToken& r) {
  load_raw_token(a, n, tok, h, hv, v_row - lane, lane, r);
}

// Preprocesses one token (full-warp l2 norms, as stage_token) and hands this lane's part to
// `sink`, in this order: sink.q(q) (l2-normalized, scaled), sink.k(k) (l2-normalized),
// sink.decay(exp(a_t)), each a float4 at k = 4 lane .. 4 lane + 3, then sink.v(v) and
// sink.beta(beta) (activated) of the lane's value row (load_raw_token_row's v_row).
template <class Sink>
__device__ __forceinline__ void prep_token_to(const DecodeArgs& a, const RawToken& r, int lane,
                                              Sink&& sink) {
  const int k0 = lane * 4;
  const float exp_A = a.A_log != nullptr ? expf(r.A_log) : 1.f;
  float q[4] = {0.f, 0.f, 0.f, 0.f}, k[4] = {0.f, 0.f, 0.f, 0.f}, d[4] = {1.f, 1.f, 1.f, 1.f};
  if (k0 < a.K) {
    float g[4], bias[4] = {0.f, 0.f, 0.f, 0.f};
    convert4(r.q, a.q.dtype, a.q.vec, q);
    convert4(r.k, a.k.dtype, a.k.vec, k);
    convert4(r.g, a.g.dtype, a.g.vec, g);
    if (a.dt_bias.data != nullptr) convert4(r.bias, a.dt_bias.dtype, a.dt_bias.vec, bias);
#pragma unroll
    for (int e = 0; e < 4; ++e)
      d[e] = expf(detail::log_decay<float>(a.gate, g[e], exp_A, bias[e], a.lower_bound));
  }
  normalize_qk4(q, k, a.use_qk_l2norm, a.scale);
  sink.q(make_float4(q[0], q[1], q[2], q[3]));
  sink.k(make_float4(k[0], k[1], k[2], k[3]));
  sink.decay(make_float4(d[0], d[1], d[2], d[3]));
  sink.v(convert_elem(r.v, a.v.dtype));
  sink.beta(detail::activate_beta<float>(a.beta_logits, a.allow_neg_eigval,
                                         convert_elem(r.beta, a.beta.dtype)));
}

// prep_token_to into the stage's token slot (one block's copy, every lane of warp 0 storing its
// part).
__device__ __forceinline__ void prep_token(const DecodeArgs& a, const RawToken& r, int lane,
                                           PreparedToken& dst) {
  struct Slot {
    PreparedToken& dst;
    int lane;
    __device__ __forceinline__ void q(float4 x) {
      *reinterpret_cast<float4*>(&dst.q[4 * lane]) = x;
    }
    __device__ __forceinline__ void k(float4 x) {
      *reinterpret_cast<float4*>(&dst.k[4 * lane]) = x;
    }
    __device__ __forceinline__ void decay(float4 x) {
      *reinterpret_cast<float4*>(&dst.decay[4 * lane]) = x;
    }
    __device__ __forceinline__ void v(float x) { dst.v[lane] = x; }
    __device__ __forceinline__ void beta(float x) { dst.beta[lane] = x; }
  };
  Slot sink{dst, lane};
  prep_token_to(a, r, lane, sink);
}

// One lane's part of a preprocessed token in registers (prep_token_to): q, k and decay at
// k = 4 lane .. 4 lane + 3, v and beta of the lane's value row.
struct LaneToken {
  float4 q, k, decay;
  float v, beta;
};

__device__ __forceinline__ LaneToken prep_lane(const DecodeArgs& a, const RawToken& r, int lane) {
  struct Regs {
    LaneToken& t;
    __device__ __forceinline__ void q(float4 x) { t.q = x; }
    __device__ __forceinline__ void k(float4 x) { t.k = x; }
    __device__ __forceinline__ void decay(float4 x) { t.decay = x; }
    __device__ __forceinline__ void v(float x) { t.v = x; }
    __device__ __forceinline__ void beta(float x) { t.beta = x; }
  };
  LaneToken t;
  Regs sink{t};
  prep_token_to(a, r, lane, sink);
  return t;
}

}  // namespace kda::cuda::dec
