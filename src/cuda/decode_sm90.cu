// decode_sm90.cu — CUDA decode on Hopper (spec section 5): one or a few tokens per sequence
// against a state pool, at memory speed.
//
// Design. Decode is memory bound: every call reads and writes the whole state of each active
// (sequence, value head) once, and the per-token inputs are tiny. One block owns a tile of 32 value
// rows of one (sequence n, value head hv); the grid is N x HV x V/32 blocks (B = 256, HV = 32,
// V = 128: 32768 blocks of 128 threads). The tile lives in registers, 32 state elements per thread,
// read with 16-byte loads that are all issued before the first use, then kept across the tokens of
// the sequence (T = 1..8 typical, any T works), and written with 16-byte stores.
//
//   V-first [.., HV, V, K]: each value row is K contiguous elements. kKLanes = K/16 consecutive
//     lanes share a row, each holding 16 k elements (fp32: four 16-byte vectors interleaved so a
//     warp instruction reads whole 128-byte lines); a thread holds 2 rows. The k reductions
//     (S^T k and S^T q) are xor butterflies over the row's lanes: no shared memory, no barrier.
//   K-first [.., HV, K, V]: threads along V: a thread holds one 16-byte vector of 4 (fp32) or
//     8 (bf16) value columns for 8 (or 4) consecutive k rows; the lanes of one column group cover
//     all of K and reduce with the same butterflies.
//
// Per-token preprocessing (l2norm of q and k, scale, gate -> decay, beta activation) is computed
// redundantly by every row group from L1/L2-resident inputs: each lane loads only the k elements
// it holds, and the l2 norms reuse the row butterflies. A bf16 state is widened to fp32 and
// rounded back to bf16 after every token, exactly as the reference does; the output of a token
// reads the state before that rounding (as the reference does).
//
// Byte model (what the benchmark counts): state 2 x B x HV x K x V x sizeof(state) (read once,
// written once; more writes with per-token states) + q, k, v, g, beta, out once each. The extra
// traffic of the redundant q/k/g reads (V/32 tiles per head, HV/H heads per q/k head) hits L2.
//
// Budget (ptxas 13.0, sm_90a): the V-first K = 128 tiles use 79 (fp32) / 80 (bf16) registers and
// 6 KB of shared memory per 128-thread block, so 6 blocks (24 warps, 96 KB of state loads in
// flight) fit on an SM; no kernel spills.
//
// Kernels: decode_sm90_kernel<kMaxK, StateT, kKFirst> (kMaxK in {64, 128, 256}: K is padded up to
// it with masked lanes; 12 instantiations), and decode_baseline_kernel, a plain one-thread-per-
// value-column version kept as the differential baseline (KDA_CUDA_DECODE_KERNEL=baseline).
// Nothing is allocated on the device and nothing synchronizes, except check_indices, which
// copies the index tensors to the host and waits for them.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/problem.h"
#include "cuda/cuda_backend.h"
#include "cuda/decode_common.cuh"

namespace kda::cuda {
namespace {

using dec::IndexTensor;
using dec::Tensor4;

// ---------------------------------------------------------------------------------------------
// Kernel parameters (passed by value as __grid_constant__)
// ---------------------------------------------------------------------------------------------

// Token tensors are rank-4 views [B, T, heads, dim]; varlen calls have B = 1, T = total tokens.
// State tensors are [rows, HV, V, K] (V-first) or [rows, HV, K, V] (K-first).
struct DecodeArgs {
  Tensor4 q, k;                   // [B, T, H, K]   bf16/fp16
  Tensor4 v;                      // [B, T, HV, V]  as q
  Tensor4 g;                      // [B, T, HV, K]  q's dtype or fp32: gate input
  Tensor4 beta;                   // [B, T, HV, 1] or [B, T, HV, V]: q's dtype or fp32
  Tensor4 out;                    // [B, T, HV, V]  q's dtype or fp32
  Tensor4 dt_bias;                // [HV, K] fp32/bf16 (s0 only); data == nullptr: absent (0)
  const float* A_log = nullptr;   // [HV] fp32 with element stride A_log_s0; nullptr: exp(A) = 1
  int64_t A_log_s0 = 0;
  IndexTensor cu_seqlens;         // [N + 1] (varlen)
  IndexTensor state_indices;      // [N] or [N, Tmax] (has_indices)
  IndexTensor num_accepted;       // [N] (has_num_accepted)
  Tensor4 state;                  // [P, HV, ..] the pool, fp32 or bf16
  Tensor4 final_state;            // [N, HV, ..] (has_final_state)
  Tensor4 inter;                  // [B * T, HV, ..] state after every token (has_intermediate)
  int64_t N = 0;                  // sequences
  int64_t T = 0;                  // tokens dimension of the token tensors
  int64_t Tmax = 0;               // columns of 2-D state_indices (= T in dense mode)
  int64_t P = 0;                  // pool slots
  int H = 0, HV = 0, K = 0, V = 0;
  int groups = 1;                 // HV / H: value head hv reads q/k head hv / groups
  int gate_form = 0;              // detail::kGatePrecomputed / kGateSoftplus / kGateLowerBound
  float scale = 1.f;              // q scale (after the l2 norm)
  float lower_bound = -5.f;       // kGateLowerBound
  bool varlen = false;
  bool has_indices = false, indices_2d = false, has_num_accepted = false;
  bool has_final_state = false, has_intermediate = false;
  bool use_initial_state = true, store_final_state = true;
  bool l2norm = true, beta_logits = false, allow_neg_eigval = false, beta_per_v = false;
};

// Tokens [bos, bos + len) of batch row b, and the read slot (-1: padding row).
struct SeqRow {
  int64_t b, bos, len, slot;
};

// Mirrors cpu::seq_span and cpu::decode_read_slot (spec section 5); cu_seqlens values are
// clamped so that no input can index out of bounds.
__device__ __forceinline__ SeqRow resolve_row(const DecodeArgs& a, int64_t n) {
  SeqRow r{n, 0, a.T, -1};
  if (a.varlen) {
    int64_t bos = dec::load_index(a.cu_seqlens, n * a.cu_seqlens.s0);
    int64_t eos = dec::load_index(a.cu_seqlens, (n + 1) * a.cu_seqlens.s0);
    bos = bos < 0 ? 0 : (bos > a.T ? a.T : bos);
    eos = eos < bos ? bos : (eos > a.T ? a.T : eos);
    r = {0, bos, eos - bos, -1};
  }
  if (!a.has_indices) {
    r.slot = n < a.P ? n : -1;
    return r;
  }
  int64_t col = 0;
  if (a.has_num_accepted) {
    const int64_t acc = dec::load_index(a.num_accepted, n * a.num_accepted.s0);
    if (acc < 1 || acc > r.len) return r;
    col = acc - 1;
  }
  if (a.indices_2d && (r.len > a.Tmax || col >= a.Tmax)) return r;
  const int64_t slot = dec::load_index(a.state_indices, n * a.state_indices.s0 + col * a.state_indices.s1);
  r.slot = (slot >= 0 && slot < a.P) ? slot : -1;
  return r;
}

// Slot receiving the state after token t with [N, Tmax] indices (-1: none).
__device__ __forceinline__ int64_t token_slot(const DecodeArgs& a, int64_t n, int64_t t) {
  const int64_t slot = dec::load_index(a.state_indices, n * a.state_indices.s0 + t * a.state_indices.s1);
  return (slot >= 0 && slot < a.P) ? slot : -1;
}

__device__ __forceinline__ float head_exp_A(const DecodeArgs& a, int hv) {
  return a.A_log != nullptr ? expf(a.A_log[hv * a.A_log_s0]) : 1.f;
}

__device__ __forceinline__ float activated_beta(const DecodeArgs& a, int64_t b, int64_t tok, int hv, int v) {
  const int64_t off = a.beta.offset(b, tok, hv) + (a.beta_per_v ? v : 0);
  return detail::activate_beta<float>(a.beta_logits, a.allow_neg_eigval, dec::load_elem(a.beta.data, a.beta.dtype, off));
}

// ---------------------------------------------------------------------------------------------
// Thread <-> state-element map of the fast kernel
// ---------------------------------------------------------------------------------------------
//
// A thread holds s[vt][kt]: kVt value rows (columns) x kKt k elements; kKLanes consecutive lanes
// hold one row's (column group's) k elements between them, in runs of kRun contiguous k.
//   V-first (fp32, K = 128): kKt = 16 as 4 runs of one float4; lane_k in [0, 8); 2 rows / thread,
//            rows tid/8 and tid/8 + 16 of the tile; 128 threads.
//   K-first (fp32, K = 128): kKt = 8 k rows (one run) x kVt = 4 columns (one float4 per k row);
//            lane_k in [0, 16); 128 threads.
template <int kMaxK, typename StateT, bool kKFirst>
struct TileMap {
  static constexpr int kVec = dec::StateVec<StateT>::kElems;  // elements per 16-byte vector
  static constexpr int kTileV = 32;                           // value rows (columns) per block
  static constexpr int kKt = kKFirst ? (32 / kVec > kMaxK / 32 ? 32 / kVec : kMaxK / 32) : 16;
  static constexpr int kVt = kKFirst ? kVec : 2;
  static constexpr int kKLanes = kMaxK / kKt;
  static constexpr int kRun = kKFirst ? kKt : kVec;
  static constexpr int kRuns = kKt / kRun;
  static constexpr int kThreads = kTileV * kKLanes / kVt;
  // Register budget, as resident blocks per SM in units of 128 threads. The hot V-first K = 128
  // tiles fit 80 registers (6 blocks of 128 threads: 96 KB of state loads in flight per SM); the
  // others get the tightest bound that ptxas 13.0 meets without spilling (-DKDA_PTXAS_VERBOSE=ON
  // shows it). K-first bf16 K = 256 holds 64 state elements per thread and is left unbounded.
  static constexpr int kBlocksOf128 = !kKFirst ? (kMaxK == 128 ? 6 : kMaxK == 64 ? 5 : 4)
                                               : (kVt * kKt > 32 ? 0 : (kMaxK == 128 && kVec == 4) ? 4 : 5);
  static constexpr int kMinBlocks = kBlocksOf128 * 128 / kThreads > 1 ? kBlocksOf128 * 128 / kThreads : 1;
  static_assert(kKLanes >= 2 && kKLanes <= 32 && (kKLanes & (kKLanes - 1)) == 0, "lane group");
  static_assert(kThreads % 32 == 0 && kThreads <= 256, "block size");
  static_assert(kKt % kRun == 0 && kRun % 4 == 0 && kRuns >= 1, "runs of whole float4 slices");

  int lane_k;  // position among the kKLanes lanes that share a value row (column group)
  int v_base;  // V-first: this thread's first row; K-first: its first column

  __device__ __forceinline__ TileMap(int tid, int tile_v0)
      : lane_k(tid % kKLanes),
        v_base(kKFirst ? tile_v0 + (tid / kKLanes) * kVec : tile_v0 + tid / kKLanes) {}
  // Value row (column) of register slot vt.
  __device__ __forceinline__ int v_of(int vt) const {
    return kKFirst ? v_base + vt : v_base + vt * (kThreads / kKLanes);
  }
  // First k of run r.
  __device__ __forceinline__ int k_of_run(int r) const {
    return kKFirst ? lane_k * kKt : (r * kKLanes + lane_k) * kVec;
  }
};

template <class Map, typename StateT, bool kKFirst>
__device__ __forceinline__ void load_state_tile(const Map& m, const Tensor4& st, int64_t row, int hv,
                                                int K, float (&s)[Map::kVt][Map::kKt]) {
  using Vec = dec::StateVec<StateT>;
  constexpr int kVec = Map::kVec;
  const StateT* base = static_cast<const StateT*>(st.data) + row * st.s0 + hv * st.s1;
  if constexpr (!kKFirst) {
#pragma unroll
    for (int vt = 0; vt < Map::kVt; ++vt) {
      const StateT* p = base + static_cast<int64_t>(m.v_of(vt)) * st.s2;
#pragma unroll
      for (int r = 0; r < Map::kRuns; ++r) {
        const int k0 = m.k_of_run(r);
        if (k0 < K) {
          Vec::load(p + k0, st.vec, &s[vt][r * kVec]);
        } else {
#pragma unroll
          for (int e = 0; e < kVec; ++e) s[vt][r * kVec + e] = 0.f;
        }
      }
    }
  } else {
    const StateT* p = base + m.v_of(0);
#pragma unroll
    for (int kt = 0; kt < Map::kKt; ++kt) {
      const int k = m.k_of_run(0) + kt;
      float x[kVec];
      if (k < K) {
        Vec::load(p + static_cast<int64_t>(k) * st.s2, st.vec, x);
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) x[e] = 0.f;
      }
#pragma unroll
      for (int e = 0; e < kVec; ++e) s[e][kt] = x[e];
    }
  }
}

template <class Map, typename StateT, bool kKFirst>
__device__ __forceinline__ void store_state_tile(const Map& m, const Tensor4& st, int64_t row, int hv,
                                                 int K, const float (&s)[Map::kVt][Map::kKt]) {
  using Vec = dec::StateVec<StateT>;
  constexpr int kVec = Map::kVec;
  StateT* base = static_cast<StateT*>(st.data) + row * st.s0 + hv * st.s1;
  if constexpr (!kKFirst) {
#pragma unroll
    for (int vt = 0; vt < Map::kVt; ++vt) {
      StateT* p = base + static_cast<int64_t>(m.v_of(vt)) * st.s2;
#pragma unroll
      for (int r = 0; r < Map::kRuns; ++r) {
        const int k0 = m.k_of_run(r);
        if (k0 < K) Vec::store(p + k0, st.vec, &s[vt][r * kVec]);
      }
    }
  } else {
    StateT* p = base + m.v_of(0);
#pragma unroll
    for (int kt = 0; kt < Map::kKt; ++kt) {
      const int k = m.k_of_run(0) + kt;
      float x[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) x[e] = s[e][kt];
      if (k < K) Vec::store(p + static_cast<int64_t>(k) * st.s2, st.vec, x);
    }
  }
}

// Hints the per-token inputs of tokens [bos + 1, bos + min(len, 8)) of this head into L2 while the
// state tile is in flight, so later tokens do not wait on DRAM.
__device__ __forceinline__ void prefetch_later_tokens(const DecodeArgs& a, const SeqRow& row, int h, int hv) {
  const int64_t later = (row.len < 8 ? row.len : 8) - 1;
  if (later <= 0) return;
  // Per token: q, k (K elements), g (K), v (V), beta (1 or V): lines of 128 bytes.
  const int lines_k = (a.K * (a.g.dtype == dec::kF32 ? 4 : 2) + 127) / 128;  // covers q, k, g
  const int per_token = 4 * lines_k + (a.beta_per_v ? lines_k : 1);
  for (int i = threadIdx.x; i < later * per_token; i += blockDim.x) {
    const int64_t tok = row.bos + 1 + i / per_token;
    const int j = i % per_token;
    const int which = j / lines_k, line = j % lines_k;
    const char* p = nullptr;
    int64_t bytes = 0;
    switch (which) {
      case 0: p = static_cast<const char*>(a.q.data) + a.q.offset(row.b, tok, h) * (a.q.dtype == dec::kF32 ? 4 : 2); bytes = a.K * 2; break;
      case 1: p = static_cast<const char*>(a.k.data) + a.k.offset(row.b, tok, h) * (a.k.dtype == dec::kF32 ? 4 : 2); bytes = a.K * 2; break;
      case 2: p = static_cast<const char*>(a.g.data) + a.g.offset(row.b, tok, hv) * (a.g.dtype == dec::kF32 ? 4 : 2); bytes = a.K * (a.g.dtype == dec::kF32 ? 4 : 2); break;
      case 3: p = static_cast<const char*>(a.v.data) + a.v.offset(row.b, tok, hv) * 2; bytes = a.V * 2; break;
      default: p = static_cast<const char*>(a.beta.data) + a.beta.offset(row.b, tok, hv) * (a.beta.dtype == dec::kF32 ? 4 : 2); bytes = (a.beta_per_v ? a.V : 1) * (a.beta.dtype == dec::kF32 ? 4 : 2); break;
    }
    if (line * 128 < bytes) dec::prefetch_l2(p + line * 128);
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
__device__ __forceinline__ void stage_token(const DecodeArgs& a, int64_t b, int64_t tok, int h, int hv,
                                            float exp_A, TokenStage<kMaxK>& sh) {
  constexpr int kPer = kMaxK / 32;
  const int k0 = dec::lane_id() * kPer;
  float q[kPer], k[kPer], d[kPer];
  if (k0 < a.K) {
    dec::load_run<kPer>(a.q.data, a.q.dtype, a.q.vec, a.q.offset(b, tok, h) + k0, q);
    dec::load_run<kPer>(a.k.data, a.k.dtype, a.k.vec, a.k.offset(b, tok, h) + k0, k);
    dec::load_run<kPer>(a.g.data, a.g.dtype, a.g.vec, a.g.offset(b, tok, hv) + k0, d);
    float bias[kPer];
    if (a.dt_bias.data != nullptr) {
      dec::load_run<kPer>(a.dt_bias.data, a.dt_bias.dtype, a.dt_bias.vec, hv * a.dt_bias.s0 + k0, bias);
    } else {
#pragma unroll
      for (int e = 0; e < kPer; ++e) bias[e] = 0.f;
    }
#pragma unroll
    for (int e = 0; e < kPer; ++e)
      d[e] = expf(detail::log_decay<float>(a.gate_form, d[e], exp_A, bias[e], a.lower_bound));
  } else {
#pragma unroll
    for (int e = 0; e < kPer; ++e) q[e] = 0.f, k[e] = 0.f, d[e] = 1.f;
  }
  float q_norm = 1.f, k_norm = 1.f;
  if (a.l2norm) {
    float qq = 0.f, kq = 0.f;
#pragma unroll
    for (int e = 0; e < kPer; ++e) qq = fmaf(q[e], q[e], qq), kq = fmaf(k[e], k[e], kq);
    qq = dec::lane_group_sum<32>(qq);
    kq = dec::lane_group_sum<32>(kq);
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

// ---------------------------------------------------------------------------------------------
// The fast kernel
// ---------------------------------------------------------------------------------------------

template <int kMaxK, typename StateT, bool kKFirst>
__global__ void __launch_bounds__(TileMap<kMaxK, StateT, kKFirst>::kThreads, TileMap<kMaxK, StateT, kKFirst>::kMinBlocks)
    decode_sm90_kernel(const __grid_constant__ DecodeArgs a) {
  using Map = TileMap<kMaxK, StateT, kKFirst>;
  constexpr int kVt = Map::kVt, kKt = Map::kKt, kRun = Map::kRun;
  constexpr int kKLanes = Map::kKLanes;
  constexpr bool kBf16State = sizeof(StateT) == 2;

  // ---- Block -> (sequence n, value head hv, tile of 32 value rows / columns)
  const unsigned vtiles = static_cast<unsigned>(a.V) / Map::kTileV;
  const unsigned head_blk = blockIdx.x / vtiles;  // n * HV + hv (the grid is < 2^31 blocks)
  const int tile = static_cast<int>(blockIdx.x - head_blk * vtiles);
  const int hv = static_cast<int>(head_blk % static_cast<unsigned>(a.HV));
  const int64_t n = head_blk / static_cast<unsigned>(a.HV);
  const int h = hv / a.groups;
  const Map m(threadIdx.x, tile * Map::kTileV);
  const bool out_lane = m.lane_k == 0;  // the lane that stores its rows' (columns') outputs
  __shared__ TokenStage<kMaxK> stage[Map::kThreads / 32];
  TokenStage<kMaxK>& sh = stage[threadIdx.x / 32];

  // ---- Sequence span and read slot (padding rows: zero output, no state access)
  const SeqRow row = resolve_row(a, n);
  if (row.slot < 0) {
    for (int64_t t = 0; t < row.len; ++t) {
      const int64_t o_off = a.out.offset(row.b, row.bos + t, hv);
      if (out_lane) {
#pragma unroll
        for (int vt = 0; vt < kVt; ++vt) dec::store_elem(a.out.data, a.out.dtype, o_off + m.v_of(vt), 0.f);
      }
    }
    return;
  }

  // ---- State tile -> registers: kVt x kKt fp32 (32 for K <= 128), every load in flight at once
  float s[kVt][kKt];
  if (a.use_initial_state) {
    load_state_tile<Map, StateT, kKFirst>(m, a.state, row.slot, hv, a.K, s);
  } else {
#pragma unroll
    for (int vt = 0; vt < kVt; ++vt)
#pragma unroll
      for (int kt = 0; kt < kKt; ++kt) s[vt][kt] = 0.f;
  }
  prefetch_later_tokens(a, row, h, hv);
  const float exp_A = head_exp_A(a, hv);

#pragma unroll 1
  for (int64_t t = 0; t < row.len; ++t) {
    const int64_t tok = row.bos + t;

    // ---- Token inputs, preprocessed once per warp into its shared slice: q (l2norm, scale),
    //      k (l2norm), decay = exp(a_t); v and b_t of this thread's rows (columns)
    stage_token<kMaxK>(a, row.b, tok, h, hv, exp_A, sh);
    float vv[kVt], bt[kVt];
    const int64_t v_off = a.v.offset(row.b, tok, hv);
#pragma unroll
    for (int vt = 0; vt < kVt; ++vt) {
      vv[vt] = dec::load_elem(a.v.data, a.v.dtype, v_off + m.v_of(vt));
      bt[vt] = activated_beta(a, row.b, tok, hv, m.v_of(vt));
    }
    __syncwarp();

    // ---- Recurrence: S <- diag(exp a) S;  u = b (v - S^T k);  S <- S + k u^T;  o = S^T q
    //      (q, k, decay are read from the warp's slice 4 elements at a time)
    float sk[kVt] = {};
#pragma unroll
    for (int k4 = 0; k4 < kKt; k4 += 4) {
      const int kx = m.k_of_run(k4 / kRun) + k4 % kRun;
      const float4 d4 = *reinterpret_cast<const float4*>(&sh.decay[kx]);
      const float4 kv4 = *reinterpret_cast<const float4*>(&sh.k[kx]);
      const float d[4] = {d4.x, d4.y, d4.z, d4.w}, kv[4] = {kv4.x, kv4.y, kv4.z, kv4.w};
#pragma unroll
      for (int e = 0; e < 4; ++e)
#pragma unroll
        for (int vt = 0; vt < kVt; ++vt) {
          s[vt][k4 + e] *= d[e];
          sk[vt] = fmaf(s[vt][k4 + e], kv[e], sk[vt]);
        }
    }
    float u[kVt];
#pragma unroll
    for (int vt = 0; vt < kVt; ++vt) u[vt] = bt[vt] * (vv[vt] - dec::lane_group_sum<kKLanes>(sk[vt]));
    float o[kVt] = {};
#pragma unroll
    for (int k4 = 0; k4 < kKt; k4 += 4) {
      const int kx = m.k_of_run(k4 / kRun) + k4 % kRun;
      const float4 q4 = *reinterpret_cast<const float4*>(&sh.q[kx]);
      const float4 kv4 = *reinterpret_cast<const float4*>(&sh.k[kx]);
      const float qv[4] = {q4.x, q4.y, q4.z, q4.w}, kv[4] = {kv4.x, kv4.y, kv4.z, kv4.w};
#pragma unroll
      for (int e = 0; e < 4; ++e)
#pragma unroll
        for (int vt = 0; vt < kVt; ++vt) {
          s[vt][k4 + e] = fmaf(kv[e], u[vt], s[vt][k4 + e]);
          o[vt] = fmaf(s[vt][k4 + e], qv[e], o[vt]);  // o reads the state before the bf16 rounding
          if (kBf16State) s[vt][k4 + e] = dec::round_bf16(s[vt][k4 + e]);
        }
    }
#pragma unroll
    for (int vt = 0; vt < kVt; ++vt) o[vt] = dec::lane_group_sum<kKLanes>(o[vt]);
    __syncwarp();  // the slice is free for the next token

    // ---- Output row of this token
    if (out_lane) {
      const int64_t o_off = a.out.offset(row.b, tok, hv);
#pragma unroll
      for (int vt = 0; vt < kVt; ++vt) dec::store_elem(a.out.data, a.out.dtype, o_off + m.v_of(vt), o[vt]);
    }

    // ---- Per-token states: intermediate buffer, or in place through [N, Tmax] indices
    if (a.store_final_state) {
      if (a.has_intermediate) {
        store_state_tile<Map, StateT, kKFirst>(m, a.inter, row.b * a.T + tok, hv, a.K, s);
      } else if (a.indices_2d) {
        const int64_t ws = token_slot(a, n, t);
        if (ws >= 0) store_state_tile<Map, StateT, kKFirst>(m, a.state, ws, hv, a.K, s);
      }
    }
  }

  // ---- Final state: separate output, or in place to the read slot
  if (a.store_final_state && !a.has_intermediate && !a.indices_2d) {
    if (a.has_final_state) store_state_tile<Map, StateT, kKFirst>(m, a.final_state, n, hv, a.K, s);
    else store_state_tile<Map, StateT, kKFirst>(m, a.state, row.slot, hv, a.K, s);
  }
}

// ---------------------------------------------------------------------------------------------
// The baseline kernel: the reference loop nest, one block per (sequence, value head), thread v
// owns value column v (its K state elements in local memory). Any K, layout, state dtype.
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ int64_t state_elem(const Tensor4& st, bool k_first, int64_t row, int hv, int k, int v) {
  return row * st.s0 + hv * st.s1 + (k_first ? static_cast<int64_t>(k) * st.s2 + v : static_cast<int64_t>(v) * st.s2 + k);
}

__global__ void __launch_bounds__(256) decode_baseline_kernel(const __grid_constant__ DecodeArgs a, bool k_first) {
  __shared__ float sh_q[256], sh_k[256], sh_decay[256], sh_norm[2];
  const int hv = static_cast<int>(blockIdx.x % static_cast<unsigned>(a.HV));
  const int64_t n = blockIdx.x / static_cast<unsigned>(a.HV);
  const int h = hv / a.groups;
  const int v = threadIdx.x;  // blockDim.x == V
  const bool bf16_state = a.state.dtype == dec::kBF16;
  const SeqRow row = resolve_row(a, n);
  if (row.slot < 0) {
    for (int64_t t = 0; t < row.len; ++t)
      dec::store_elem(a.out.data, a.out.dtype, a.out.offset(row.b, row.bos + t, hv) + v, 0.f);
    return;
  }
  float col[256];  // S[:, v]
  for (int k = 0; k < a.K; ++k)
    col[k] = a.use_initial_state ? dec::load_elem(a.state.data, a.state.dtype, state_elem(a.state, k_first, row.slot, hv, k, v)) : 0.f;
  const float exp_A = head_exp_A(a, hv);
  auto store_col = [&](const Tensor4& st, int64_t r) {
    for (int k = 0; k < a.K; ++k) dec::store_elem(st.data, st.dtype, state_elem(st, k_first, r, hv, k, v), col[k]);
  };
  for (int64_t t = 0; t < row.len; ++t) {
    const int64_t tok = row.bos + t;
    __syncthreads();  // the previous token is done with the shared inputs
    for (int k = threadIdx.x; k < a.K; k += blockDim.x) {
      sh_q[k] = dec::load_elem(a.q.data, a.q.dtype, a.q.offset(row.b, tok, h) + k);
      sh_k[k] = dec::load_elem(a.k.data, a.k.dtype, a.k.offset(row.b, tok, h) + k);
      const float g = dec::load_elem(a.g.data, a.g.dtype, a.g.offset(row.b, tok, hv) + k);
      const float bias = a.dt_bias.data ? dec::load_elem(a.dt_bias.data, a.dt_bias.dtype, hv * a.dt_bias.s0 + k) : 0.f;
      sh_decay[k] = expf(detail::log_decay<float>(a.gate_form, g, exp_A, bias, a.lower_bound));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float qq = 0.f, kq = 0.f;
      for (int k = 0; k < a.K; ++k) qq += sh_q[k] * sh_q[k], kq += sh_k[k] * sh_k[k];
      sh_norm[0] = a.l2norm ? 1.f / sqrtf(qq + static_cast<float>(detail::kL2NormEps)) : 1.f;
      sh_norm[1] = a.l2norm ? 1.f / sqrtf(kq + static_cast<float>(detail::kL2NormEps)) : 1.f;
    }
    __syncthreads();
    const float qn = sh_norm[0], kn = sh_norm[1];
    float sk = 0.f;
    for (int k = 0; k < a.K; ++k) {
      col[k] *= sh_decay[k];
      sk += col[k] * (sh_k[k] * kn);
    }
    const float u = activated_beta(a, row.b, tok, hv, v) *
                    (dec::load_elem(a.v.data, a.v.dtype, a.v.offset(row.b, tok, hv) + v) - sk);
    float o = 0.f;
    for (int k = 0; k < a.K; ++k) {
      col[k] += (sh_k[k] * kn) * u;
      o += col[k] * ((sh_q[k] * qn) * a.scale);
      if (bf16_state) col[k] = dec::round_bf16(col[k]);
    }
    dec::store_elem(a.out.data, a.out.dtype, a.out.offset(row.b, tok, hv) + v, o);
    if (a.store_final_state) {
      if (a.has_intermediate) {
        store_col(a.inter, row.b * a.T + tok);
      } else if (a.indices_2d) {
        const int64_t ws = token_slot(a, n, t);
        if (ws >= 0) store_col(a.state, ws);
      }
    }
  }
  if (a.store_final_state && !a.has_intermediate && !a.indices_2d) {
    if (a.has_final_state) store_col(a.final_state, n);
    else store_col(a.state, row.slot);
  }
}

// ---------------------------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------------------------

#define KDA_CUDA_RETURN_IF_ERROR(expr, what)                                                    \
  do {                                                                                          \
    const cudaError_t _e = (expr);                                                              \
    if (_e != cudaSuccess)                                                                      \
      return Status(StatusCode::kCudaError, std::string(what) + " failed: " + cudaGetErrorString(_e) + \
                                                " (" __FILE__ ":" + std::to_string(__LINE__) + ")"); \
  } while (0)

// Every leading stride and the data pointer 16-byte aligned (dimensions of size 1 excepted).
bool rows_aligned16(const TensorView& t) {
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0) return false;
  const int64_t es = static_cast<int64_t>(dtype_size(t.dtype));
  for (int i = 0; i + 1 < t.ndim; ++i)
    if (t.shape[i] > 1 && (t.strides[i] * es) % 16 != 0) return false;
  return true;
}

Tensor4 to_tensor4(const TensorView& t) {
  Tensor4 r;
  if (!t.present()) return r;
  r.data = t.data;
  r.s0 = t.strides[0];
  r.s1 = t.ndim > 1 ? t.strides[1] : 0;
  r.s2 = t.ndim > 2 ? t.strides[2] : 0;
  r.dtype = static_cast<int>(t.dtype);
  r.vec = rows_aligned16(t);
  return r;
}

IndexTensor to_index(const TensorView& t) {
  IndexTensor r;
  if (!t.present()) return r;
  r.data = t.data;
  r.s0 = t.strides[0];
  r.s1 = t.ndim > 1 ? t.strides[1] : 0;
  r.is64 = t.dtype == DType::kInt64;
  return r;
}

DecodeArgs make_args(const detail::DecodeProblem& pr) {
  DecodeArgs a;
  a.q = to_tensor4(pr.q);
  a.k = to_tensor4(pr.k);
  a.v = to_tensor4(pr.v);
  a.g = to_tensor4(pr.g);
  a.beta = to_tensor4(pr.beta);
  a.out = to_tensor4(pr.out);
  a.dt_bias = to_tensor4(pr.dt_bias);
  if (pr.A_log.present()) {
    a.A_log = static_cast<const float*>(pr.A_log.data);
    a.A_log_s0 = pr.A_log.strides[0];
  }
  a.cu_seqlens = to_index(pr.cu_seqlens);
  a.state_indices = to_index(pr.state_indices);
  a.num_accepted = to_index(pr.num_accepted_tokens);
  a.state = to_tensor4(pr.state);
  a.final_state = to_tensor4(pr.final_state);
  a.inter = to_tensor4(pr.intermediate_states);
  a.N = pr.d.N;
  a.T = pr.d.T;
  a.Tmax = pr.Tmax;
  a.P = pr.state.shape[0];
  a.H = static_cast<int>(pr.d.H);
  a.HV = static_cast<int>(pr.d.HV);
  a.K = static_cast<int>(pr.d.K);
  a.V = static_cast<int>(pr.d.V);
  a.groups = static_cast<int>(pr.d.groups());
  a.gate_form = static_cast<int>(pr.gate.form);
  a.scale = static_cast<float>(pr.gate.scale);
  a.lower_bound = pr.gate.lower_bound;
  a.varlen = pr.d.varlen;
  a.has_indices = pr.state_indices.present();
  a.indices_2d = pr.indices_2d;
  a.has_num_accepted = pr.num_accepted_tokens.present();
  a.has_final_state = pr.final_state.present();
  a.has_intermediate = pr.intermediate_states.present();
  a.use_initial_state = pr.use_initial_state;
  a.store_final_state = pr.store_final_state;
  a.l2norm = pr.gate.l2norm;
  a.beta_logits = pr.gate.beta_form == BetaForm::kLogits;
  a.allow_neg_eigval = pr.gate.allow_neg_eigval;
  a.beta_per_v = pr.beta_per_v;
  return a;
}

// Restores the caller's current device on scope exit.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&saved_) == cudaSuccess && saved_ != device && cudaSetDevice(device) == cudaSuccess)
      switched_ = true;
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(saved_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int saved_ = 0;
  bool switched_ = false;
};

// check_indices: copies state_indices / num_accepted_tokens / cu_seqlens to the host (same
// strided layout), waits for them, and checks their values.
Status check_index_values(const detail::DecodeProblem& pr, cudaStream_t stream) {
  auto extent_bytes = [](const TensorView& t) -> size_t {
    if (!t.present() || t.numel() == 0) return 0;
    int64_t last = 0;
    for (int i = 0; i < t.ndim; ++i) last += (t.shape[i] - 1) * t.strides[i];
    return static_cast<size_t>(last + 1) * dtype_size(t.dtype);
  };
  std::vector<uint8_t> idx(extent_bytes(pr.state_indices)), nat(extent_bytes(pr.num_accepted_tokens)),
      cu(extent_bytes(pr.cu_seqlens));
  auto fetch = [&](const TensorView& t, std::vector<uint8_t>& h) -> cudaError_t {
    return h.empty() ? cudaSuccess : cudaMemcpyAsync(h.data(), t.data, h.size(), cudaMemcpyDeviceToHost, stream);
  };
  KDA_CUDA_RETURN_IF_ERROR(fetch(pr.state_indices, idx), "cudaMemcpyAsync(state_indices)");
  KDA_CUDA_RETURN_IF_ERROR(fetch(pr.num_accepted_tokens, nat), "cudaMemcpyAsync(num_accepted_tokens)");
  KDA_CUDA_RETURN_IF_ERROR(fetch(pr.cu_seqlens, cu), "cudaMemcpyAsync(cu_seqlens)");
  KDA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "cudaStreamSynchronize (check_indices)");
  if (pr.d.varlen) {
    TensorView host_cu = pr.cu_seqlens;
    host_cu.data = cu.data();
    host_cu.device = Device::kCPU;
    const Status s = detail::check_cu_seqlens_values(host_cu, pr.d.T);
    if (!s.ok()) return s;
  }
  return detail::check_decode_index_values(pr, idx.empty() ? nullptr : idx.data(),
                                           nat.empty() ? nullptr : nat.data(), cu.empty() ? nullptr : cu.data());
}

template <int kMaxK, typename StateT, bool kKFirst>
Status launch_fast(const DecodeArgs& a, int64_t blocks, cudaStream_t stream) {
  using Map = TileMap<kMaxK, StateT, kKFirst>;
  decode_sm90_kernel<kMaxK, StateT, kKFirst><<<static_cast<unsigned>(blocks), Map::kThreads, 0, stream>>>(a);
  KDA_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "launch of decode_sm90_kernel");
  return Status::Ok();
}

// The one dispatch point: K tile x state dtype x layout.
template <typename StateT>
Status dispatch_fast(const DecodeArgs& a, bool k_first, int64_t blocks, cudaStream_t stream) {
  if (a.K <= 64) return k_first ? launch_fast<64, StateT, true>(a, blocks, stream) : launch_fast<64, StateT, false>(a, blocks, stream);
  if (a.K <= 128) return k_first ? launch_fast<128, StateT, true>(a, blocks, stream) : launch_fast<128, StateT, false>(a, blocks, stream);
  if (a.K <= 256) return k_first ? launch_fast<256, StateT, true>(a, blocks, stream) : launch_fast<256, StateT, false>(a, blocks, stream);
  return {StatusCode::kUnsupported, "argument 'q': the CUDA decode supports K up to 256, got K = " + std::to_string(a.K)};
}

bool use_baseline_kernel() {
  const char* e = std::getenv("KDA_CUDA_DECODE_KERNEL");
  return e != nullptr && std::strcmp(e, "baseline") == 0;
}

}  // namespace

Status decode(const detail::DecodeProblem& pr, const ExecOptions& exec, bool check_indices) {
  // ---- What the GPU path runs (everything else the contract allows runs on the CPU backends)
  if (pr.q.dtype != DType::kBFloat16 && pr.q.dtype != DType::kFloat16)
    return {StatusCode::kUnsupported, std::string("argument 'q': the CUDA decode expects dtype bf16 or fp16, got ") +
                                          dtype_name(pr.q.dtype) + " (fp32 inputs run on the CPU backends)"};
  if (pr.state.dtype != DType::kFloat32 && pr.state.dtype != DType::kBFloat16)
    return {StatusCode::kUnsupported, std::string("argument 'state': the CUDA decode expects dtype fp32 or bf16, got ") +
                                          dtype_name(pr.state.dtype)};
  if (pr.d.K != pr.d.V || pr.d.K % 32 != 0 || pr.d.K > 256)
    return {StatusCode::kUnsupported, "argument 'q': the CUDA decode expects K == V, a multiple of 32 up to 256, got K = " +
                                          std::to_string(pr.d.K) + ", V = " + std::to_string(pr.d.V)};

  DeviceGuard guard(pr.q.device_index);
  cudaStream_t stream = static_cast<cudaStream_t>(exec.stream);
  if (check_indices) {
    const Status s = check_index_values(pr, stream);
    if (!s.ok()) return s;
  }
  if (pr.d.N == 0) return Status::Ok();

  const DecodeArgs a = make_args(pr);
  const bool k_first = pr.layout == StateLayout::kKFirst;
  if (use_baseline_kernel()) {
    const int64_t blocks = pr.d.N * pr.d.HV;
    if (blocks > INT32_MAX)
      return {StatusCode::kUnsupported, "argument 'q': N x HV = " + std::to_string(blocks) + " blocks exceed the grid limit"};
    decode_baseline_kernel<<<static_cast<unsigned>(blocks), a.V, 0, stream>>>(a, k_first);
    KDA_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "launch of decode_baseline_kernel");
    return Status::Ok();
  }
  const int64_t blocks = pr.d.N * pr.d.HV * (pr.d.V / 32);
  if (blocks > INT32_MAX)
    return {StatusCode::kUnsupported, "argument 'q': N x HV x V/32 = " + std::to_string(blocks) +
                                          " blocks exceed the grid limit; split the batch"};
  if (pr.state.dtype == DType::kBFloat16) return dispatch_fast<__nv_bfloat16>(a, k_first, blocks, stream);
  return dispatch_fast<float>(a, k_first, blocks, stream);
}

}  // namespace kda::cuda
