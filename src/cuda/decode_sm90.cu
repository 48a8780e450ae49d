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
// Staged tile kernel ("v3", the default for the hot shape: V-first, K = V = 128, fp32 or bf16
// pool with 16-byte aligned rows; any T, dense or varlen, every index / output mode, except the
// large fp32 batches the bulk kernel takes). The tile kernel's block and thread map, but the tile
// is staged through shared memory with 16-byte cp.async (each thread copies exactly the units it
// reads, so cp.async.wait_all + the token barrier is all the synchronization) and the recurrence
// streams it from shared memory in two passes, so 48 registers (no spills) and 19.5 KB (fp32) /
// 11.5 KB (bf16) of shared memory per block: 10 blocks (160 KB of state loads) in flight per SM
// instead of 6 (96 KB). Warp 0 preprocesses each token once per block (as the persistent
// kernel's producer: bitwise the same as stage_token); token 0's input loads of a dense row are
// issued before the index loads are consumed. The k products are summed in four partial sums
// (k mod 4) to shorten the dependency chains, so results match the tile kernel up to
// reassociation. A latency variant (no register bound, unrolled passes) runs grids of at most
// two blocks per SM (B = 1, 2 at HV = 32). See "The staged tile kernel" below and
// docs/perf_decode.md (v3, v4). Unaligned pools, K-first and K != 128 run the tile kernel.
//
// Bulk kernel ("v4", the default for fp32 pools when the grid has >= 64 blocks per SM, e.g. B >=
// 66 at HV = 32): the staged kernel's arithmetic (bitwise the same), but the copy engine moves the
// tile: one cp.async.bulk in (per row when rows are padded), s' written back in place in shared
// memory, one bulk copy out. Dense single-token calls use a one-slot token stage: 18.3 KB of
// shared memory and 40 registers, 12 blocks per SM. See "The bulk kernel" below. Its latency
// variant (no register bound, passes unrolled, s' stored from registers during pass 2 instead of
// the write-back, barrier and bulk store) is the default for dense single-token calls on grids
// of <= 2 blocks per SM and with every bf16 pool (docs/perf_decode.md, v8).
//
// Every kernel starts with pdl_prologue() and is launched with programmatic dependent launch
// (cuda/launch.cuh): the next kernel's launch overlaps this one's tail.
//
// Persistent kernel (the hot shape: V-first, K = V = 128, fp32 or bf16 pool with 16-byte
// aligned rows, dense tokens, T <= 8; see "The persistent kernel" below). The tile kernel above
// is latency bound: a block's life is index load -> state load -> token staging -> compute ->
// store, and registers cap residency at 6 blocks (96 KB of state loads) per SM, in flight only
// during the load phase (measured 2.8-3.0 TB/s at B = 256-1024, bf16 state no faster than fp32).
// The persistent kernel decouples the two: grid = min(items, 3 x SMs) blocks of 4 consumer warps +
// 1 producer warp; work items (n, hv, 32-row tile) are dealt round robin; the producer keeps a
// ring of S stages in shared memory filled with 1-D bulk copies (cp.async.bulk -> mbarrier
// transaction counts), S x 16 KB (fp32) or S x 8 KB (bf16) of state in flight per block, and
// preprocesses the item's tokens (l2 norm, scale, gate, beta) into the stage, once per item
// instead of once per warp. Its index loads and token-0 input loads for item i + 1 are issued
// right after item i's bulk copy, so the per-item chain is one load latency, hidden behind the ring.
// The consumers read the tile from shared memory (each quarter warp reads one 128-byte run of a
// row: no bank conflicts), run the same recurrence_token as the tile kernel (bitwise the same
// arithmetic), release the stage, and store the new state from registers with 16-byte streaming
// stores. At B = 1 (128 items, one per block) the chain is index + token loads together -> state
// copy -> compute -> store, one dependent load shorter than the tile kernel's.
//
// Byte model (what the benchmark counts): state 2 x B x HV x K x V x sizeof(state) (read once,
// written once; more writes with per-token states) + q, k, v, g, beta, out once each. The extra
// traffic of the redundant q/k/g reads (V/32 tiles per head, HV/H heads per q/k head) hits L2.
// Prediction (persistent kernel): per SM 3 blocks x (S - 1) x 16 KB = 144 KB fp32 (3 x 6 x 8 KB
// bf16) of reads in flight at all times, well above the ~25-35 KB of reads that Little's law
// asks per SM at ~4 TB/s (read + write) and 1.5-2 us loaded latency, so DRAM-bound: ~3.7-3.9
// TB/s at B = 256 / 1024, >= 3 TB/s at B = 32 (10 items per block; the ramp of the first stage is the cost), the bf16 state at
// about half the fp32 time, T = 4 at about the T = 1 time (the state traffic is the same; the
// per-token work is in the producer and the consumers' FMAs).
//
// Budget (ptxas 13.0, sm_90a): the tile kernel's V-first K = 128 tiles use 79 (fp32) / 80 (bf16)
// registers and 6 KB of shared memory per 128-thread block, so 6 blocks (24 warps, 96 KB of state
// loads in flight) fit on an SM. The persistent kernel: 160 threads, 126 (fp32) / 120 (bf16)
// registers (3 blocks x 5 warps x 128 x 32 = 61440 <= 64 K), dynamic shared memory 128 B of
// barriers + S stages of 16 KB (8 KB) state + T x 1792 B tokens + 80 B descriptor, S = min(8,
// (228 KB / 3 - 1 KB) / stage) = 4 (fp32, T = 1), 7 (bf16, T = 1), 3 (fp32, T = 4), 2 (fp32,
// T = 8). No kernel spills, except a few bytes in the bulk kernels (4-52 B outside the passes:
// -DKDA_PTXAS_VERBOSE=ON shows them).
//
// Kernels: decode_bulk_kernel<StateT, kSlots, kLatency> (6 instantiations; the default for
// large fp32 batches, dense single-token calls on small grids and bf16 pools),
// decode_staged_kernel<StateT, kLatency> (4 instantiations; the default elsewhere where it
// applies), decode_persistent_kernel<StateT> (2 instantiations), decode_sm90_kernel<kMaxK, StateT,
// kKFirst> ("tile kernel"; kMaxK in {64, 128, 256}: K is padded up to it with masked lanes; 12
// instantiations; every shape the others do not take), and decode_baseline_kernel, a plain
// one-thread-per-value-column version kept as the differential baseline. choose_kernel
// (decode_heuristics.h, host-only, tested on the CPU) is the one heuristic; KDA_CUDA_DECODE_KERNEL = baseline | tile | staged | bulk | bulklat |
// persistent overrides it (where eligible), KDA_CUDA_DECODE_GRID caps the persistent grid (a test
// hook: many items per block).
// Nothing is allocated on the device and nothing synchronizes, except check_indices, which
// copies the index tensors to the host and waits for them.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "core/problem.h"
#include "cuda/cuda_backend.h"
#include "cuda/decode_heuristics.h"
#include "cuda/decode_common.cuh"
#include "cuda/launch.cuh"

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

// One token of the recurrence on the thread's tile s (Map layout), the preprocessed token in
// shared memory (q: l2-normalized and scaled, k: l2-normalized, decay = exp(a_t); all indexed by
// k), vv / bt: v and the activated beta of the thread's rows (columns). o: the outputs of the
// thread's rows, summed over the row's lanes (every lane of a group holds the same bits).
//   S <- diag(exp a) S;  u = b (v - S^T k);  S <- S + k u^T;  o = S^T q
template <class Map, bool kBf16State>
__device__ __forceinline__ void recurrence_token(const Map& m, float (&s)[Map::kVt][Map::kKt], const float* __restrict__ q_sh,
                                                 const float* __restrict__ k_sh, const float* __restrict__ d_sh,
                                                 const float (&vv)[Map::kVt], const float (&bt)[Map::kVt],
                                                 float (&o)[Map::kVt]) {
  constexpr int kVt = Map::kVt, kKt = Map::kKt, kRun = Map::kRun;
  constexpr int kKLanes = Map::kKLanes;
  float sk[kVt] = {};
#pragma unroll
  for (int k4 = 0; k4 < kKt; k4 += 4) {
    const int kx = m.k_of_run(k4 / kRun) + k4 % kRun;
    const float4 d4 = *reinterpret_cast<const float4*>(&d_sh[kx]);
    const float4 kv4 = *reinterpret_cast<const float4*>(&k_sh[kx]);
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
#pragma unroll
  for (int vt = 0; vt < kVt; ++vt) o[vt] = 0.f;
#pragma unroll
  for (int k4 = 0; k4 < kKt; k4 += 4) {
    const int kx = m.k_of_run(k4 / kRun) + k4 % kRun;
    const float4 q4 = *reinterpret_cast<const float4*>(&q_sh[kx]);
    const float4 kv4 = *reinterpret_cast<const float4*>(&k_sh[kx]);
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
}

// ---------------------------------------------------------------------------------------------
// The fast kernel
// ---------------------------------------------------------------------------------------------

template <int kMaxK, typename StateT, bool kKFirst>
__global__ void __launch_bounds__(TileMap<kMaxK, StateT, kKFirst>::kThreads, TileMap<kMaxK, StateT, kKFirst>::kMinBlocks)
    decode_sm90_kernel(const __grid_constant__ DecodeArgs a) {
  pdl_prologue();
  using Map = TileMap<kMaxK, StateT, kKFirst>;
  constexpr int kVt = Map::kVt, kKt = Map::kKt;
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
    zero_padding_outputs(a, row, hv, m);
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
    float o[kVt];
    recurrence_token<Map, kBf16State>(m, s, sh.q, sh.k, sh.decay, vv, bt, o);
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
// The persistent kernel (V-first, K = V = 128, fp32 or bf16 state, dense tokens, T <= 8)
// ---------------------------------------------------------------------------------------------
//
// Work item = (sequence n, value head hv, tile of 32 value rows), item j = (n * HV + hv) * 4 +
// tile; block b handles items b, b + G, b + 2G, ... (G = gridDim.x <= 3 blocks per SM). Each block
// is 4 consumer warps (the tile kernel's thread map, 128 threads, 32 state elements per thread)
// and 1 producer warp, around a ring of S stages in dynamic shared memory (S = 2..8, chosen by the
// host from T and the state dtype so that 3 blocks fit an SM). Stage layout:
//   state tile   32 rows x 128 k of StateT (16 KB fp32 / 8 KB bf16), a bulk copy of global memory
//   tokens[T]    per token: q (l2-normalized, scaled), k (l2-normalized), decay = exp(a_t) over k,
//                v and activated beta of the tile's 32 rows (1792 bytes), written by the producer
//   ItemDesc     the read slot (-1: padding row) and the [N, Tmax] write slots of every token
// Barriers: full[s] (33 producer arrivals: lane 0's expect_tx one and, after the stage writes,
// one per lane; + the state tile's bytes), empty[s] (128 consumer
// arrivals). For item i the producer waits for empty[s], issues the state copy (its read slot
// came from loads issued one item earlier), issues item i + 1's index and token-0 input loads,
// preprocesses item i's tokens into the stage and arrives; so up to S state tiles per block (S x 16 KB) are in flight while the
// consumers compute from shared memory and store the new state from registers with 16-byte
// streaming stores.
constexpr int kPersistMaxStages = 8;
constexpr int kPersistMaxT = 8;
constexpr int kPersistBlocksPerSM = 3;
constexpr int kPersistConsumers = 128;             // threads: 4 warps, TileMap<128, *, false>
constexpr int kPersistThreads = kPersistConsumers + 32;
constexpr int kPersistBarrierBytes = 2 * kPersistMaxStages * 8;  // full[8], empty[8]
constexpr int kPersistK = 128, kPersistTileV = 32;
static_assert(kPersistK == kDecodeFastK, "decode_heuristics.h: the persistent kernel's K");

struct __align__(16) PersistToken {
  float q[kPersistK];
  float k[kPersistK];
  float decay[kPersistK];
  float v[kPersistTileV];
  float beta[kPersistTileV];
};

struct __align__(16) PersistDesc {
  long long slot;                   // read slot (-1: padding row)
  long long wslot[kPersistMaxT];    // [N, Tmax] indices: slot written after token t (-1: none)
};

// Bytes of one stage (a multiple of 128) for T tokens per item.
__host__ __device__ constexpr int persist_stage_bytes(int state_elem_bytes, int T) {
  return (kPersistTileV * kPersistK * state_elem_bytes + T * static_cast<int>(sizeof(PersistToken)) +
          static_cast<int>(sizeof(PersistDesc)) + 127) / 128 * 128;
}

// The raw inputs of one token that one producer lane needs (q, k, g at k = 4 * lane .. + 3, the
// gate bias there and A_log of the head, v and beta of row 32 * tile + lane), as loaded (raw bits,
// see dec::load_raw4): converted by prep_token, so that the loads of a token (and the index loads
// after them) are all in flight at once.
struct RawToken {
  dec::Raw4 q, k, g, bias;
  uint32_t v, beta;
  float A_log;
};

__device__ __forceinline__ void load_raw_token(const DecodeArgs& a, int64_t n, int64_t tok, int h, int hv, int tile_v0,
                                               int lane, RawToken& r) {
  const int k0 = lane * 4;
  if (k0 < a.K) {
    r.q = dec::load_raw4(a.q.data, a.q.dtype, a.q.vec, a.q.offset(n, tok, h) + k0);
    r.k = dec::load_raw4(a.k.data, a.k.dtype, a.k.vec, a.k.offset(n, tok, h) + k0);
    r.g = dec::load_raw4(a.g.data, a.g.dtype, a.g.vec, a.g.offset(n, tok, hv) + k0);
    if (a.dt_bias.data != nullptr) r.bias = dec::load_raw4(a.dt_bias.data, a.dt_bias.dtype, a.dt_bias.vec, hv * a.dt_bias.s0 + k0);
  }
  const int v = tile_v0 + lane;
  r.v = dec::load_raw_elem(a.v.data, a.v.dtype, a.v.offset(n, tok, hv) + v);
  r.beta = dec::load_raw_elem(a.beta.data, a.beta.dtype, a.beta.offset(n, tok, hv) + (a.beta_per_v ? v : 0));
  r.A_log = a.A_log != nullptr ? a.A_log[hv * a.A_log_s0] : 0.f;
}

// Preprocesses one token (full-warp l2 norms, as stage_token) into the stage's token slot.
__device__ __forceinline__ void prep_token(const DecodeArgs& a, const RawToken& r, int lane, PersistToken& dst) {
  const int k0 = lane * 4;
  const float exp_A = a.A_log != nullptr ? expf(r.A_log) : 1.f;
  float q[4] = {0.f, 0.f, 0.f, 0.f}, k[4] = {0.f, 0.f, 0.f, 0.f}, d[4] = {1.f, 1.f, 1.f, 1.f};
  if (k0 < a.K) {
    float g[4], bias[4] = {0.f, 0.f, 0.f, 0.f};
    dec::convert4(r.q, a.q.dtype, a.q.vec, q);
    dec::convert4(r.k, a.k.dtype, a.k.vec, k);
    dec::convert4(r.g, a.g.dtype, a.g.vec, g);
    if (a.dt_bias.data != nullptr) dec::convert4(r.bias, a.dt_bias.dtype, a.dt_bias.vec, bias);
#pragma unroll
    for (int e = 0; e < 4; ++e) d[e] = expf(detail::log_decay<float>(a.gate_form, g[e], exp_A, bias[e], a.lower_bound));
  }
  float q_norm = 1.f, k_norm = 1.f;
  if (a.l2norm) {
    float qq = 0.f, kq = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) qq = fmaf(q[e], q[e], qq), kq = fmaf(k[e], k[e], kq);
    qq = dec::lane_group_sum<32>(qq);
    kq = dec::lane_group_sum<32>(kq);
    q_norm = 1.f / sqrtf(qq + static_cast<float>(detail::kL2NormEps));
    k_norm = 1.f / sqrtf(kq + static_cast<float>(detail::kL2NormEps));
  }
  *reinterpret_cast<float4*>(&dst.q[k0]) = make_float4((q[0] * q_norm) * a.scale, (q[1] * q_norm) * a.scale,
                                                       (q[2] * q_norm) * a.scale, (q[3] * q_norm) * a.scale);
  *reinterpret_cast<float4*>(&dst.k[k0]) = make_float4(k[0] * k_norm, k[1] * k_norm, k[2] * k_norm, k[3] * k_norm);
  *reinterpret_cast<float4*>(&dst.decay[k0]) = make_float4(d[0], d[1], d[2], d[3]);
  dst.v[lane] = dec::convert_elem(r.v, a.v.dtype);
  dst.beta[lane] = detail::activate_beta<float>(a.beta_logits, a.allow_neg_eigval, dec::convert_elem(r.beta, a.beta.dtype));
}

// The index loads that resolve a dense row's read slot (resolve_row without varlen), issued
// ahead of their use: state_indices[n, 0] and num_accepted[n].
struct RowRaw {
  int64_t idx0, acc;
};

__device__ __forceinline__ RowRaw load_row_raw(const DecodeArgs& a, int64_t n) {
  RowRaw r{-1, 1};
  if (a.has_indices && (!a.indices_2d || a.Tmax > 0)) r.idx0 = dec::load_index(a.state_indices, n * a.state_indices.s0);
  if (a.has_num_accepted) r.acc = dec::load_index(a.num_accepted, n * a.num_accepted.s0);
  return r;
}

// resolve_row(a, n).slot for a dense row (len = T), from the prefetched loads.
__device__ __forceinline__ int64_t finish_row_slot(const DecodeArgs& a, int64_t n, const RowRaw& r) {
  if (!a.has_indices) return n < a.P ? n : -1;
  int64_t col = 0;
  if (a.has_num_accepted) {
    if (r.acc < 1 || r.acc > a.T) return -1;
    col = r.acc - 1;
  }
  if (a.indices_2d && (a.T > a.Tmax || col >= a.Tmax)) return -1;
  const int64_t slot = col == 0 ? r.idx0 : dec::load_index(a.state_indices, n * a.state_indices.s0 + col * a.state_indices.s1);
  return (slot >= 0 && slot < a.P) ? slot : -1;
}

struct PersistItem {
  int64_t n;
  int hv, h, tile_v0;
};

__device__ __forceinline__ PersistItem persist_item(const DecodeArgs& a, int64_t j) {
  constexpr int kTiles = kPersistK / kPersistTileV;  // V = K = 128: 4 tiles per head
  const int64_t head = j / kTiles;
  PersistItem it;
  it.tile_v0 = static_cast<int>(j - head * kTiles) * kPersistTileV;
  it.n = head / a.HV;
  it.hv = static_cast<int>(head - it.n * a.HV);
  it.h = it.hv / a.groups;
  return it;
}

template <typename StateT>
__global__ void __launch_bounds__(kPersistThreads, kPersistBlocksPerSM)
    decode_persistent_kernel(const __grid_constant__ DecodeArgs a, int64_t items, int stages, int stage_bytes) {
  pdl_prologue();
  using Map = TileMap<kPersistK, StateT, false>;
  static_assert(Map::kThreads == kPersistConsumers && Map::kTileV == kPersistTileV, "consumer map");
  constexpr int kVt = Map::kVt, kVec = Map::kVec;
  constexpr bool kBf16State = sizeof(StateT) == 2;
  constexpr uint32_t kStateBytes = kPersistTileV * kPersistK * sizeof(StateT);
  constexpr int kRowBytes = kPersistK * static_cast<int>(sizeof(StateT));

  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + kPersistMaxStages;
  unsigned char* ring = smem + kPersistBarrierBytes;
  const int T = static_cast<int>(a.T);  // dense: every row has T tokens (T <= kPersistMaxT)
  auto stage_tokens = [&](int s) { return reinterpret_cast<PersistToken*>(ring + s * stage_bytes + kStateBytes); };
  auto stage_desc = [&](int s) {
    return reinterpret_cast<PersistDesc*>(ring + s * stage_bytes + kStateBytes + T * sizeof(PersistToken));
  };

  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      dec::mbar_init(&full[s], 33);  // lane 0's arrive.expect_tx + the 32 producer lanes' arrivals
      dec::mbar_init(&empty[s], kPersistConsumers);
    }
    dec::fence_mbar_init();
  }
  __syncthreads();  // the only block barrier: the roles never meet again except through mbarriers

  if (threadIdx.x >= kPersistConsumers) {
    // ================= Producer warp
    const int lane = dec::lane_id();
    const uint64_t policy = dec::l2_evict_first_policy();
    const bool rows_contiguous = a.state.s2 == kPersistK;  // the tile is one 16 KB (8 KB) run
    int64_t j = blockIdx.x;
    PersistItem it = persist_item(a, j);
    RowRaw rr = load_row_raw(a, it.n);
    RawToken tk;
    if (T > 0) load_raw_token(a, it.n, 0, it.h, it.hv, it.tile_v0, lane, tk);
    int s = 0;
    uint32_t phase = 0;
#pragma unroll 1
    for (;;) {
      const int64_t slot = finish_row_slot(a, it.n, rr);  // rr was loaded one item ago

      dec::mbar_wait(&empty[s], phase ^ 1u);  // the consumers are done with this stage's last use
      // Generic-proxy accesses of this stage (the consumers' reads, this warp's token writes)
      // before the bulk copy's async-proxy writes. The copy only ever overwrites the state region,
      // which no thread writes with generic stores, so this is belt and braces; it is placed
      // before the next item's loads are issued, because it compiles to MEMBAR.CTA, which may
      // wait for this thread's outstanding loads.
      dec::fence_proxy_async_smem();
      unsigned char* st = ring + s * stage_bytes;
      PersistToken* toks = stage_tokens(s);
      PersistDesc* desc = stage_desc(s);
      const uint32_t bytes = (slot >= 0 && a.use_initial_state) ? kStateBytes : 0u;
      if (lane == 0) dec::mbar_arrive_expect_tx(&full[s], bytes);  // before any copy completes on it
      __syncwarp();
      if (bytes != 0) {
        const StateT* src = static_cast<const StateT*>(a.state.data) + slot * a.state.s0 + it.hv * a.state.s1 +
                            static_cast<int64_t>(it.tile_v0) * a.state.s2;
        if (rows_contiguous) {
          if (lane == 0) dec::bulk_copy_g2s(st, src, kStateBytes, &full[s], policy);
        } else {  // one row per lane (rows are 16-byte aligned: state.vec)
          dec::bulk_copy_g2s(st + lane * kRowBytes, src + static_cast<int64_t>(lane) * a.state.s2, kRowBytes, &full[s],
                             policy);
        }
      }
      // Prefetch the next item's index loads and token-0 inputs (consumed next iteration).
      const int64_t jn = j + gridDim.x;
      const bool has_next = jn < items;
      PersistItem itn = it;
      RowRaw rrn = rr;
      RawToken tkn = tk;
      if (has_next) {
        itn = persist_item(a, jn);
        rrn = load_row_raw(a, itn.n);
        if (T > 0) load_raw_token(a, itn.n, 0, itn.h, itn.hv, itn.tile_v0, lane, tkn);
      }
      if (slot >= 0) {
        RawToken cur = tk;
#pragma unroll 1
        for (int t = 0; t < T; ++t) {
          RawToken nxt = cur;
          if (t + 1 < T) load_raw_token(a, it.n, t + 1, it.h, it.hv, it.tile_v0, lane, nxt);
          prep_token(a, cur, lane, toks[t]);
          cur = nxt;
        }
        if (a.indices_2d && a.store_final_state && !a.has_intermediate && lane < T)
          desc->wslot[lane] = token_slot(a, it.n, lane);
      }
      if (lane == 0) desc->slot = slot;
      dec::mbar_arrive(&full[s]);  // all 32 lanes: releases each lane's stage writes
      if (!has_next) break;
      j = jn;
      it = itn;
      rr = rrn;
      tk = tkn;
      if (++s == stages) s = 0, phase ^= 1u;
    }
    return;
  }

  // ================= Consumer warps
  const int tid = threadIdx.x;
  int s = 0;
  uint32_t phase = 0;
#pragma unroll 1
  for (int64_t j = blockIdx.x; j < items; j += gridDim.x) {
    const PersistItem it = persist_item(a, j);
    const Map m(tid, it.tile_v0);
    const bool out_lane = m.lane_k == 0;
    dec::mbar_wait(&full[s], phase);
    const unsigned char* st = ring + s * stage_bytes;
    const PersistToken* toks = stage_tokens(s);
    const PersistDesc* desc = stage_desc(s);
    const int64_t slot = desc->slot;

    if (slot < 0) {  // padding row: zero output, no state access
      dec::mbar_arrive(&empty[s]);
      if (out_lane)
        for (int t = 0; t < T; ++t) {
          const int64_t o_off = a.out.offset(it.n, t, it.hv);
#pragma unroll
          for (int vt = 0; vt < kVt; ++vt) dec::store_elem(a.out.data, a.out.dtype, o_off + m.v_of(vt), 0.f);
        }
    } else {
      // ---- State tile: shared memory -> registers (each quarter warp reads one 128-byte run of a row)
      float sreg[kVt][Map::kKt];
      if (a.use_initial_state) {
#pragma unroll
        for (int vt = 0; vt < kVt; ++vt) {
          const StateT* row = reinterpret_cast<const StateT*>(st) + (m.v_of(vt) - it.tile_v0) * kPersistK;
#pragma unroll
          for (int r = 0; r < Map::kRuns; ++r) {
            const int k0 = m.k_of_run(r);
            if constexpr (kBf16State) {
              const uint4 x = *reinterpret_cast<const uint4*>(row + k0);
              const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
              for (int q = 0; q < 4; ++q) {
                sreg[vt][r * kVec + 2 * q] = __uint_as_float(w[q] << 16);
                sreg[vt][r * kVec + 2 * q + 1] = __uint_as_float(w[q] & 0xffff0000u);
              }
            } else {
              const float4 x = *reinterpret_cast<const float4*>(row + k0);
              sreg[vt][r * kVec] = x.x, sreg[vt][r * kVec + 1] = x.y, sreg[vt][r * kVec + 2] = x.z,
                            sreg[vt][r * kVec + 3] = x.w;
            }
          }
        }
      } else {
#pragma unroll
        for (int vt = 0; vt < kVt; ++vt)
#pragma unroll
          for (int kt = 0; kt < Map::kKt; ++kt) sreg[vt][kt] = 0.f;
      }

#pragma unroll 1
      for (int t = 0; t < T; ++t) {
        const PersistToken& tok = toks[t];
        float vv[kVt], bt[kVt], o[kVt];
#pragma unroll
        for (int vt = 0; vt < kVt; ++vt) {
          const int lr = m.v_of(vt) - it.tile_v0;
          vv[vt] = tok.v[lr];
          bt[vt] = tok.beta[lr];
        }
        recurrence_token<Map, kBf16State>(m, sreg, tok.q, tok.k, tok.decay, vv, bt, o);
        if (out_lane) {
          const int64_t o_off = a.out.offset(it.n, t, it.hv);
#pragma unroll
          for (int vt = 0; vt < kVt; ++vt) dec::store_elem(a.out.data, a.out.dtype, o_off + m.v_of(vt), o[vt]);
        }
        if (a.store_final_state) {
          if (a.has_intermediate) {
            store_state_tile<Map, StateT, false>(m, a.inter, it.n * a.T + t, it.hv, a.K, sreg);
          } else if (a.indices_2d) {
            const int64_t ws = desc->wslot[t];
            if (ws >= 0) store_state_tile<Map, StateT, false>(m, a.state, ws, it.hv, a.K, sreg);
          }
        }
      }
      dec::mbar_arrive(&empty[s]);  // every read of this stage is done (values are in registers)

      // ---- Final state: separate output, or in place to the read slot
      if (a.store_final_state && !a.has_intermediate && !a.indices_2d) {
        if (a.has_final_state) store_state_tile<Map, StateT, false>(m, a.final_state, it.n, it.hv, a.K, sreg);
        else store_state_tile<Map, StateT, false>(m, a.state, slot, it.hv, a.K, sreg);
      }
    }
    if (++s == stages) s = 0, phase ^= 1u;
  }
}

// ---------------------------------------------------------------------------------------------
// The staged tile kernel ("v3"; V-first, K = V = 128, fp32 or bf16 pool with 16-byte aligned rows)
// ---------------------------------------------------------------------------------------------
//
// The tile kernel's block (n, hv, 32 value rows; 128 threads; TileMap<128, StateT, false>: the
// same thread <-> element map; the k products go to four partial sums instead of one chain), but
// the state tile goes global -> shared memory with 16-byte cp.async instead of into registers.
// Every thread copies exactly the 16-byte units it later reads (unit u of thread i at
// tile_sh[u * 128 + i]: a warp's accesses are 512 contiguous bytes, no bank conflicts), so its
// own cp.async.wait_all is the only wait its state reads need. The compute streams the tile from
// shared memory in two passes per token (pass 1: S^T k of the decayed state; pass 2: s' = s *
// decay + k u, S'^T q, then s' to global memory with 16-byte streaming stores and, if another
// token follows, back to shared memory), so only a few values per thread are live: ~40 registers
// instead of 79, 10 blocks (160 KB of state loads) resident per SM instead of 6 (96 KB).
// Token preprocessing is done once per block by warp 0 (load_raw_token / prep_token, as the
// persistent kernel: bitwise the same as stage_token) into one of two PersistToken slots
// (alternating by token parity, so one block barrier per token suffices). Token 0's input loads
// of a dense row are issued before the index loads are consumed, and preprocessed while the
// state copies are in flight.
constexpr int kStagedK = 128;
static_assert(kStagedK == kDecodeFastK, "decode_heuristics.h: the staged / bulk kernels' K");
constexpr int kStagedThreads = 128;
constexpr int kStagedMinBlocks = 10;  // registers <= 48: 10 x 128 x 48 = 61440 <= 64 K

// 16 bytes of state (StateT) <-> fp32 (the StateVec<StateT>::load / store element order).
template <typename StateT>
__device__ __forceinline__ void unpack_unit(const uint4& x, float* dst) {
  if constexpr (sizeof(StateT) == 4) {
    dst[0] = __uint_as_float(x.x), dst[1] = __uint_as_float(x.y), dst[2] = __uint_as_float(x.z), dst[3] = __uint_as_float(x.w);
  } else {
    const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      dst[2 * j] = __uint_as_float(w[j] << 16);
      dst[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
  }
}

template <typename StateT>
__device__ __forceinline__ uint4 pack_unit(const float* src) {
  if constexpr (sizeof(StateT) == 4) {
    return make_uint4(__float_as_uint(src[0]), __float_as_uint(src[1]), __float_as_uint(src[2]), __float_as_uint(src[3]));
  } else {
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      w[j] = static_cast<uint32_t>(dec::float_to_bf16_bits(src[2 * j])) |
             (static_cast<uint32_t>(dec::float_to_bf16_bits(src[2 * j + 1])) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// Where a state tile goes in global memory: row `r` of tensor `t`, head hv (data == nullptr: nowhere).
template <typename StateT>
struct TileDst {
  StateT* data = nullptr;
  int64_t s2 = 0;
  bool vec = false;
  __device__ __forceinline__ void set(const Tensor4& t, int64_t r, int hv) {
    data = static_cast<StateT*>(t.data) + r * t.s0 + hv * t.s1;
    s2 = t.s2;
    vec = t.vec;
  }
  // Stores the kVec values of unit (vt, r) of a smem-staged tile's thread (TileMap layout).
  template <class Map>
  __device__ __forceinline__ void store_unit(const Map& m, int vt, int r, const float* v) const {
    dec::StateVec<StateT>::store(data + static_cast<int64_t>(m.v_of(vt)) * s2 + m.k_of_run(r), vec, v);
  }
};

// The emit callback of smem_tile_token: row vt's output, stored by the row's output lane.
template <class Map>
struct RowOutput {
  const DecodeArgs& a;
  const Map& m;
  int64_t off;
  bool lane;
  __device__ __forceinline__ void operator()(int vt, float o) const {
    if (lane) dec::store_elem(a.out.data, a.out.dtype, off + m.v_of(vt), o);
  }
};

// A padding row (no read slot): zero output for its tokens, no state access. The lane of each
// row group that stores outputs writes its rows (columns) of every token.
template <class Map>
__device__ __forceinline__ void zero_padding_outputs(const DecodeArgs& a, const SeqRow& row, int hv, const Map& m) {
  if (m.lane_k != 0) return;
  for (int64_t t = 0; t < row.len; ++t) {
    const int64_t o_off = a.out.offset(row.b, row.bos + t, hv);
#pragma unroll
    for (int vt = 0; vt < Map::kVt; ++vt) dec::store_elem(a.out.data, a.out.dtype, o_off + m.v_of(vt), 0.f);
  }
}

// Where the state after token t of row n goes (at most one place; data == nullptr: nowhere):
// per-token states, [N, Tmax] write slots, or after the last token the final state / read slot.
template <typename StateT>
__device__ __forceinline__ TileDst<StateT> token_dst(const DecodeArgs& a, const SeqRow& row, int64_t n, int hv, int64_t t) {
  TileDst<StateT> dst;
  if (!a.store_final_state) return dst;
  if (a.has_intermediate) {
    dst.set(a.inter, row.b * a.T + row.bos + t, hv);
  } else if (a.indices_2d) {
    const int64_t ws = token_slot(a, n, t);
    if (ws >= 0) dst.set(a.state, ws, hv);
  } else if (t + 1 == row.len) {
    if (a.has_final_state) dst.set(a.final_state, n, hv);
    else dst.set(a.state, row.slot, hv);
  }
  return dst;
}

// A row without tokens (an empty varlen sequence, T = 0) passes its initial state through to the
// final state or its read slot, unless states go per token (data == nullptr: nothing to store).
template <typename StateT>
__device__ __forceinline__ TileDst<StateT> empty_row_dst(const DecodeArgs& a, const SeqRow& row, int64_t n, int hv) {
  TileDst<StateT> dst;
  if (row.len != 0 || !a.store_final_state || a.has_intermediate || a.indices_2d) return dst;
  if (a.has_final_state) dst.set(a.final_state, n, hv);
  else dst.set(a.state, row.slot, hv);
  return dst;
}

// Token t > 0 of a shared-memory tile kernel: warp 0 preprocesses it into `slot`, then the block
// barrier publishes it (uniform over the block).
__device__ __forceinline__ void stage_next_token(const DecodeArgs& a, const SeqRow& row, int64_t t, int h, int hv,
                                                 int tile_v0, bool prep_warp, PersistToken& slot) {
  if (prep_warp) {
    RawToken r;
    load_raw_token(a, row.b, row.bos + t, h, hv, tile_v0, dec::lane_id(), r);
    prep_token(a, r, dec::lane_id(), slot);
  }
  __syncthreads();
}

// Block -> (sequence n, value head hv, first value row tile_v0 of its tile of kTileV rows), for a
// grid of N x HV x V / kTileV blocks.
struct TileBlock {
  int64_t n;
  int hv, h, tile_v0;
  __device__ __forceinline__ TileBlock(const DecodeArgs& a, int tile_rows) {
    const unsigned vtiles = static_cast<unsigned>(a.V) / tile_rows;
    const unsigned head_blk = blockIdx.x / vtiles;
    tile_v0 = static_cast<int>(blockIdx.x - head_blk * vtiles) * tile_rows;
    hv = static_cast<int>(head_blk % static_cast<unsigned>(a.HV));
    n = head_blk / static_cast<unsigned>(a.HV);
    h = hv / a.groups;
  }
};

// One token over this thread's two rows of a tile in shared memory (the staged and bulk kernels):
//   pass 1: u = beta (v - (diag(decay) S)^T k) per row, over the row's kKLanes lanes;
//   pass 2: s' = s * decay + k u (rounded to bf16 for a bf16 state), o = S'^T q (before the
//           rounding).
// The k products go to four partial sums (k mod 4): 16-deep FMA chains per row instead of 64.
// unit(vt, r) is the thread's 16-byte unit of row vt, run r; sink(vt, r, unit, s) receives s' of
// each unit (kVec fp32 values); emit(vt, o) the row's output (every lane of the row holds it).
template <class Map, typename StateT, int kUnrollR, int kUnrollVt, class Unit, class Sink, class Emit>
__device__ __forceinline__ void smem_tile_token(const Map& m, int tile_v0, const PersistToken& tk, Unit unit, Sink sink,
                                                Emit emit) {
  constexpr int kVt = Map::kVt, kRuns = Map::kRuns, kVec = Map::kVec;
  constexpr bool kBf16State = sizeof(StateT) == 2;
  static_assert(kVt == 2, "two rows per thread");
  float u0 = 0.f, u1 = 0.f;
#pragma unroll(kUnrollVt)
  for (int vt = 0; vt < kVt; ++vt) {
    float sk4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll(kUnrollR)
    for (int r = 0; r < kRuns; ++r) {
      float s[kVec];
      unpack_unit<StateT>(unit(vt, r), s);
#pragma unroll
      for (int e4 = 0; e4 < kVec; e4 += 4) {
        const int kx = m.k_of_run(r) + e4;
        const float4 d4 = *reinterpret_cast<const float4*>(&tk.decay[kx]);
        const float4 kv4 = *reinterpret_cast<const float4*>(&tk.k[kx]);
        const float d[4] = {d4.x, d4.y, d4.z, d4.w}, kv[4] = {kv4.x, kv4.y, kv4.z, kv4.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) sk4[e] = fmaf(s[e4 + e] * d[e], kv[e], sk4[e]);
      }
    }
    const int vr = m.v_of(vt) - tile_v0;
    const float sk = (sk4[0] + sk4[1]) + (sk4[2] + sk4[3]);
    const float uv = tk.beta[vr] * (tk.v[vr] - dec::lane_group_sum<Map::kKLanes>(sk));
    if (vt == 0) u0 = uv;
    else u1 = uv;
  }
#pragma unroll(kUnrollVt)
  for (int vt = 0; vt < kVt; ++vt) {
    const float uv = vt == 0 ? u0 : u1;
    float acc4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll(kUnrollR)
    for (int r = 0; r < kRuns; ++r) {
      uint4& un = unit(vt, r);
      float s[kVec];
      unpack_unit<StateT>(un, s);
#pragma unroll
      for (int e4 = 0; e4 < kVec; e4 += 4) {
        const int kx = m.k_of_run(r) + e4;
        const float4 d4 = *reinterpret_cast<const float4*>(&tk.decay[kx]);
        const float4 kv4 = *reinterpret_cast<const float4*>(&tk.k[kx]);
        const float4 q4 = *reinterpret_cast<const float4*>(&tk.q[kx]);
        const float d[4] = {d4.x, d4.y, d4.z, d4.w}, kv[4] = {kv4.x, kv4.y, kv4.z, kv4.w};
        const float qv[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = fmaf(kv[e], uv, s[e4 + e] * d[e]);
          acc4[e] = fmaf(x, qv[e], acc4[e]);
          if (kBf16State) x = dec::round_bf16(x);
          s[e4 + e] = x;
        }
      }
      sink(vt, r, un, s);
    }
    emit(vt, dec::lane_group_sum<Map::kKLanes>((acc4[0] + acc4[1]) + (acc4[2] + acc4[3])));
  }
}

#ifdef KDA_DECODE_TRACE
// Development build only (-DKDA_DECODE_TRACE in the CUDA and C++ flags): thread 0 of each of the
// first kTraceBlocks blocks of the staged kernel stamps %globaltimer at kTracePoints points, per
// call (the call index advances when the last block of a call finishes, and is read by the next
// call after its griddepcontrol.wait). decode_trace_fetch (cuda_backend.h) copies the stamps out.
namespace trace {
__device__ unsigned long long g_stamps[kTraceCalls][kTracePoints][kTraceBlocks];
__device__ unsigned int g_call, g_done;
__device__ __forceinline__ unsigned long long now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
struct Stamps {
  unsigned call = 0;
  __device__ __forceinline__ void at(int point, unsigned long long t) const {
    if (threadIdx.x == 0 && blockIdx.x < kTraceBlocks) g_stamps[call % kTraceCalls][point][blockIdx.x] = t;
  }
  __device__ __forceinline__ void at(int point) const { at(point, now()); }
  // Last point; the last block of the call advances the call index.
  __device__ __forceinline__ void finish() const {
    at(kTracePoints - 1);
    if (threadIdx.x == 0) {
      __threadfence();
      if (atomicAdd(&g_done, 1u) == gridDim.x - 1) {
        g_done = 0;
        g_call = call + 1;
        __threadfence();
      }
    }
  }
};
}  // namespace trace
#define KDA_TRACE_BEGIN()                   \
  const unsigned long long trace_t0 = trace::now(); \
  pdl_prologue();                            \
  trace::Stamps trace_s;                     \
  trace_s.call = *static_cast<volatile unsigned*>(&trace::g_call); \
  trace_s.at(0, trace_t0);                   \
  trace_s.at(1)
#define KDA_TRACE(point) trace_s.at(point)
#define KDA_TRACE_END() trace_s.finish()
#else
#define KDA_TRACE_BEGIN() pdl_prologue()
#define KDA_TRACE(point) ((void)0)
#define KDA_TRACE_END() ((void)0)
#endif

// kLatency: the variant for grids of at most a couple of blocks per SM (B = 1, 2 at HV = 32),
// where a call's time is its critical path (index -> state -> compute -> store), not the bytes in
// flight: no register bound (the compiler keeps every load in flight and unrolls the passes).
template <typename StateT, bool kLatency>
__global__ void __launch_bounds__(kStagedThreads, kLatency ? 1 : kStagedMinBlocks)
    decode_staged_kernel(const __grid_constant__ DecodeArgs a) {
  KDA_TRACE_BEGIN();  // points: 0 entry, 1 after the wait
  using Map = TileMap<kStagedK, StateT, false>;
  constexpr int kVt = Map::kVt, kRuns = Map::kRuns, kVec = Map::kVec;
  constexpr int kUnits = kVt * kRuns;  // 16-byte units per thread: 8 (fp32), 4 (bf16)
  constexpr bool kBf16State = sizeof(StateT) == 2;
  // Runs unrolled per step of the compute passes: the most that ptxas 13.0 fits in 48 registers
  // without spilling (fp32: 2 of 4 runs; bf16: 1 of 2, each run holds 8 elements).
  constexpr int kUnrollR = kLatency ? kRuns : (kBf16State ? 1 : 2);
  constexpr int kUnrollVt = kLatency ? kVt : 1;
  static_assert(Map::kThreads == kStagedThreads && Map::kKLanes == 8 && Map::kRun == kVec, "staged map");

  // ---- Block -> (sequence n, value head hv, tile of 32 value rows), as the tile kernel
  const TileBlock blk(a, Map::kTileV);
  const int64_t n = blk.n;
  const int hv = blk.hv, h = blk.h, tile_v0 = blk.tile_v0;
  const Map m(threadIdx.x, tile_v0);
  const bool out_lane = m.lane_k == 0;
  const bool prep_warp = threadIdx.x < 32;  // warp 0 preprocesses the tokens for the block

  __shared__ uint4 tile_sh[kUnits * kStagedThreads];  // 16 KB (fp32) / 8 KB (bf16)
  __shared__ PersistToken tok_sh[2];                  // 2 x 1792 B, by token parity
  uint4* mine = tile_sh + threadIdx.x;                // this thread's unit u: mine[u * 128]

  // ---- Token 0's raw inputs of a dense row (b = n, bos = 0, len = T: known without index
  //      loads) are issued first, so they overlap the index loads of resolve_row.
  RawToken raw;
  if (prep_warp && !a.varlen && a.T > 0) load_raw_token(a, n, 0, h, hv, tile_v0, dec::lane_id(), raw);

  // ---- Sequence span and read slot (padding rows: zero output, no state access)
  const SeqRow row = resolve_row(a, n);
  KDA_TRACE(2);  // read slot known
  if (row.slot < 0) {  // uniform over the block: no barrier is skipped by part of it
    zero_padding_outputs(a, row, hv, m);
    KDA_TRACE_END();
    return;
  }

  // ---- State tile -> shared memory: kUnits 16-byte cp.async per thread, all in flight at once
  if (a.use_initial_state) {
    const StateT* base = static_cast<const StateT*>(a.state.data) + row.slot * a.state.s0 + hv * a.state.s1;
#pragma unroll
    for (int vt = 0; vt < kVt; ++vt) {
      const StateT* p = base + static_cast<int64_t>(m.v_of(vt)) * a.state.s2;
#pragma unroll
      for (int r = 0; r < kRuns; ++r) dec::cp_async_16(&mine[(vt * kRuns + r) * kStagedThreads], p + m.k_of_run(r));
    }
    dec::cp_async_commit();
  } else {
#pragma unroll
    for (int u = 0; u < kUnits; ++u) mine[u * kStagedThreads] = make_uint4(0u, 0u, 0u, 0u);  // +0.0 (fp32 and bf16)
  }
  if (prep_warp && row.len > 0) {
    if (a.varlen) load_raw_token(a, row.b, row.bos, h, hv, tile_v0, dec::lane_id(), raw);
    prep_token(a, raw, dec::lane_id(), tok_sh[0]);
  }
  KDA_TRACE(3);  // token 0 staged (thread 0 is in warp 0)
  prefetch_later_tokens(a, row, h, hv);
  dec::cp_async_wait_all();  // this thread's copies: the only units it reads
  __syncthreads();           // token 0's stage
  KDA_TRACE(4);  // state tile and token 0 in shared memory

#pragma unroll 1
  for (int64_t t = 0; t < row.len; ++t) {
    const int64_t tok = row.bos + t;
    // Slot t & 1 was last read at token t - 2, before every thread passed token t - 1's barrier.
    if (t > 0) stage_next_token(a, row, t, h, hv, tile_v0, prep_warp, tok_sh[t & 1]);
    const PersistToken& tk = tok_sh[t & 1];

    // ---- Where this token's state goes in global memory (at most one place per token)
    const TileDst<StateT> dst = token_dst<StateT>(a, row, n, hv, t);
    const bool keep = t + 1 < row.len;  // another token follows: s' back to shared memory

    // ---- The two passes; s' to global memory and, if another token follows, back to shared
    //      memory. (Loops over vt stay rolled in the throughput variant: unrolled, the compiler
    //      hoists every shared-memory load of the tile and runs out of the 48-register budget.)
    const int64_t o_off = a.out.offset(row.b, tok, hv);
    smem_tile_token<Map, StateT, kUnrollR, kUnrollVt>(
        m, tile_v0, tk, [&](int vt, int r) -> uint4& { return mine[(vt * kRuns + r) * kStagedThreads]; },
        [&](int vt, int r, uint4& un, const float* sv) {
          if (dst.data != nullptr) dst.store_unit(m, vt, r, sv);
          if (keep) un = pack_unit<StateT>(sv);
        },
        RowOutput<Map>{a, m, o_off, out_lane});
  }

  KDA_TRACE(5);  // every token computed, its stores issued

  // ---- No tokens (an empty varlen sequence, T = 0): the final state is the initial one
  if (const TileDst<StateT> dst = empty_row_dst<StateT>(a, row, n, hv); dst.data != nullptr) {
#pragma unroll
    for (int vt = 0; vt < kVt; ++vt)
#pragma unroll
      for (int r = 0; r < kRuns; ++r) {
        float s[kVec];
        unpack_unit<StateT>(mine[(vt * kRuns + r) * kStagedThreads], s);
        dst.store_unit(m, vt, r, s);
      }
  }
  KDA_TRACE_END();  // point 6
}
// ---------------------------------------------------------------------------------------------
// The bulk kernel ("v4", the default for the hot shape): the staged kernel's block, thread map,
// token staging and arithmetic, but the copy engine moves the tile both ways. One lane issues one
// 1-D bulk copy of the whole tile (32 rows of K contiguous elements; one copy per row, one lane
// each, when the rows are padded) completing on an mbarrier, instead of 8 (fp32) / 4 (bf16)
// 16-byte cp.async per thread; the tile stays in shared memory in the global row-major layout
// (a quarter warp reads one 128-byte run of one row: conflict-free), pass 2 writes s' back in
// place, and one bulk copy stores it (after fence.proxy.async and a block barrier) instead of 8
// (4) 16-byte stores per thread. Fewer memory instructions and shorter block lives: the bare
// pattern (bulk in, bulk out) measured 3.92 TB/s on the H200 against 3.85 for cp.async + stores
// (bench_gpu_mempattern). Needs 16-byte aligned rows in every state tensor it writes
// (choose_kernel). Same arithmetic in the same order as the staged and tile kernels.
// ---------------------------------------------------------------------------------------------
constexpr int kBulkMinBlocks = 10;  // 48 registers; smem 16 KB + 3.5 KB (fp32) per block

// kSlots: token stages (2 alternate by token parity; 1 for dense single-token calls, which frees
// 1.75 KB of shared memory per block: 12 blocks per SM instead of 10).
// kLatency (kSlots == 1 only): the variant for grids of at most a couple of blocks per SM, as the
// staged kernel's: no register bound, passes unrolled, and s' stored from registers during pass 2
// (no write-back, fence, barrier and bulk store at the end of the block's critical path).
template <typename StateT, int kSlots, bool kLatency = false>
__global__ void __launch_bounds__(kStagedThreads, kLatency ? 1 : (kSlots == 1 ? 12 : kBulkMinBlocks))
    decode_bulk_kernel(const __grid_constant__ DecodeArgs a) {
  static_assert(!kLatency || kSlots == 1, "the latency variant takes dense single-token calls");
  pdl_prologue();
  using Map = TileMap<kStagedK, StateT, false>;
  constexpr int kVt = Map::kVt, kRuns = Map::kRuns, kVec = Map::kVec;
  constexpr bool kBf16State = sizeof(StateT) == 2;
  constexpr int kUnrollR = kLatency ? kRuns : (kBf16State || kSlots == 1 ? 1 : 2);  // what fits the register bound
  constexpr int kUnrollVt = kLatency ? kVt : 1;
  constexpr uint32_t kRowBytes = kStagedK * sizeof(StateT);
  constexpr uint32_t kTileBytes = Map::kTileV * kRowBytes;
  static_assert(Map::kThreads == kStagedThreads && Map::kKLanes == 8 && Map::kRun == kVec, "bulk map");
  static_assert(kVt == 2, "two rows per thread");

  const TileBlock blk(a, Map::kTileV);
  const int64_t n = blk.n;
  const int hv = blk.hv, h = blk.h, tile_v0 = blk.tile_v0;
  const Map m(threadIdx.x, tile_v0);
  const bool out_lane = m.lane_k == 0;
  const bool prep_warp = threadIdx.x < 32;               // warp 0: token preprocessing
  const bool copy_warp = (threadIdx.x >> 5) == 1;        // warp 1: issues the bulk copies
  const int lane = dec::lane_id();

  __shared__ __align__(128) uint8_t tile_sh[kTileBytes];  // rows of the tile, as in global memory
  __shared__ PersistToken tok_sh[kSlots];                 // by token parity
  __shared__ uint64_t full_bar;                           // the tile's bulk load
  // This thread's unit (vt, r): row v_of(vt) - tile_v0 = tid / 8 + 16 vt, bytes 16 (8 r + lane_k).
  static_assert(Map::kThreads / Map::kKLanes == 16, "rows vt = 0, 1 are 16 apart");
  const uint32_t my_units = (threadIdx.x / Map::kKLanes) * kRowBytes + m.lane_k * 16;
  auto unit = [my_units](int vt, int r) -> uint4& {
    return *reinterpret_cast<uint4*>(tile_sh + my_units + vt * 16 * kRowBytes + r * 128);
  };
  // Bulk store of the tile in shared memory to rows tile_v0.. of `dst` (issued by the copy warp;
  // the caller fenced and passed a block barrier). Waits until shared memory has been read, or,
  // with `complete`, until the global writes are done: [N, Tmax] write slots of one row may
  // repeat, and the later token's state must land last.
  auto store_tile = [&](const TileDst<StateT>& dst, bool complete) {
    if (!copy_warp) return;
    StateT* g = dst.data + static_cast<int64_t>(tile_v0) * dst.s2;
    if (dst.s2 == kStagedK) {
      if (lane == 0) dec::bulk_store(g, tile_sh, kTileBytes);
    } else {
      dec::bulk_store(g + lane * dst.s2, tile_sh + lane * kRowBytes, kRowBytes);
    }
    dec::bulk_commit();
    if (complete) dec::bulk_wait_all();
    else dec::bulk_wait_read();
  };

  RawToken raw;
  if (prep_warp && !a.varlen && a.T > 0) load_raw_token(a, n, 0, h, hv, tile_v0, lane, raw);
  if (threadIdx.x == 32) {
    dec::mbar_init(&full_bar, 1);
    dec::fence_mbar_init();
  }

  SeqRow row = resolve_row(a, n);
  if constexpr (kSlots == 1) row.len = 1;  // launched for dense calls with T = 1 only
  if (row.slot < 0) {  // padding row: zero output, no state access (uniform over the block)
    zero_padding_outputs(a, row, hv, m);
    return;
  }

  if (a.use_initial_state) {
    if (copy_warp) {
      const StateT* src = static_cast<const StateT*>(a.state.data) + row.slot * a.state.s0 + hv * a.state.s1 +
                          static_cast<int64_t>(tile_v0) * a.state.s2;
      if (lane == 0) dec::mbar_arrive_expect_tx(&full_bar, kTileBytes);
      __syncwarp();
      if (a.state.s2 == kStagedK) {
        if (lane == 0) dec::bulk_load(tile_sh, src, kTileBytes, &full_bar);
      } else {
        dec::bulk_load(tile_sh + lane * kRowBytes, src + lane * a.state.s2, kRowBytes, &full_bar);
      }
    }
  } else {
#pragma unroll
    for (int vt = 0; vt < kVt; ++vt)
#pragma unroll
      for (int r = 0; r < kRuns; ++r) unit(vt, r) = make_uint4(0u, 0u, 0u, 0u);  // +0.0 (fp32 and bf16)
  }
  if (prep_warp && row.len > 0) {
    if (a.varlen) load_raw_token(a, row.b, row.bos, h, hv, tile_v0, lane, raw);
    prep_token(a, raw, lane, tok_sh[0]);
  }
  if constexpr (kSlots > 1) prefetch_later_tokens(a, row, h, hv);
  __syncthreads();  // token 0's stage; the barrier's initialization
  if (a.use_initial_state) dec::mbar_wait(&full_bar, 0);

#pragma unroll 1
  for (int64_t t = 0; t < row.len; ++t) {
    const int64_t tok = row.bos + t;
    // Slot t & 1 was last read at token t - 2; the previous token's bulk store (if any) has
    // finished reading the tile (the copy warp waited before this barrier).
    if (t > 0) stage_next_token(a, row, t, h, hv, tile_v0, prep_warp, tok_sh[(kSlots - 1) & t]);
    const PersistToken& tk = tok_sh[(kSlots - 1) & t];

    const TileDst<StateT> dst = token_dst<StateT>(a, row, n, hv, t);  // uniform over the block
    const int64_t o_off = a.out.offset(row.b, tok, hv);
    if constexpr (kLatency) {  // one token: s' straight from registers to global memory
      smem_tile_token<Map, StateT, kUnrollR, kUnrollVt>(
          m, tile_v0, tk, unit,
          [&](int vt, int r, uint4&, const float* sv) {
            if (dst.data != nullptr) dst.store_unit(m, vt, r, sv);
          },
          RowOutput<Map>{a, m, o_off, out_lane});
      continue;
    }
    const bool write_back = dst.data != nullptr || t + 1 < row.len;

    // ---- The two passes; s' back in place in shared memory (for the bulk store or the next token)
    smem_tile_token<Map, StateT, kUnrollR, 1>(
        m, tile_v0, tk, unit,
        [&](int, int, uint4& un, const float* sv) {
          if (write_back) un = pack_unit<StateT>(sv);
        },
        RowOutput<Map>{a, m, o_off, out_lane});
    if (dst.data != nullptr) {
      dec::fence_proxy_async_smem();
      __syncthreads();
      store_tile(dst, a.indices_2d && t + 1 < row.len);
    }
  }

  // ---- No tokens (an empty varlen sequence, T = 0): the final state is the initial one
  if (const TileDst<StateT> dst = empty_row_dst<StateT>(a, row, n, hv); dst.data != nullptr) {
    dec::fence_proxy_async_smem();
    __syncthreads();
    store_tile(dst, false);
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
  pdl_prologue();
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
  KDA_CUDA_RETURN_IF_ERROR(launch_kernel(decode_sm90_kernel<kMaxK, StateT, kKFirst>, dim3(static_cast<unsigned>(blocks)),
                                         dim3(Map::kThreads), 0, stream, a),
                           "launch of decode_sm90_kernel");
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

// ---- Kernel choice


// Device facts the launch needs, read once per device.
struct DeviceInfo {
  int sms = 0;
  int smem_per_sm = 0;         // bytes of shared memory per SM
  int smem_reserved = 0;       // bytes the runtime reserves per resident block
  std::atomic<bool> persist_configured[2] = {false, false};  // cudaFuncSetAttribute done (fp32, bf16 state)
  std::atomic<bool> staged_configured[4] = {};               // staged kernel carveout set (state dtype x variant)
  std::atomic<bool> bulk_configured[8] = {};  // bulk kernel carveout set (state dtype x slots x latency)
};

Status device_info(DeviceInfo** out) {
  static std::mutex mu;
  static DeviceInfo infos[64];
  int dev = 0;
  KDA_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev), "cudaGetDevice");
  if (dev < 0 || dev >= 64) return {StatusCode::kUnsupported, "CUDA device index out of range"};
  std::lock_guard<std::mutex> lock(mu);
  DeviceInfo& d = infos[dev];
  if (d.sms == 0) {
    KDA_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&d.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev),
                             "cudaDeviceGetAttribute");
    KDA_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&d.smem_reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev),
                             "cudaDeviceGetAttribute");
    KDA_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
  }
  *out = &d;
  return Status::Ok();
}

// Dynamic shared memory one persistent block may use: kPersistBlocksPerSM blocks per SM.
int persist_block_smem(const DeviceInfo& d) {
  return d.smem_per_sm / kPersistBlocksPerSM - d.smem_reserved;
}

// Ring stages of the persistent kernel for T tokens per item (0: it does not fit).
int persist_stages(const DeviceInfo& d, int state_elem_bytes, int64_t T) {
  if (T < 0 || T > kPersistMaxT) return 0;
  const int per_stage = persist_stage_bytes(state_elem_bytes, static_cast<int>(T));
  const int s = (persist_block_smem(d) - kPersistBarrierBytes) / per_stage;
  return s < 2 ? 0 : (s > kPersistMaxStages ? kPersistMaxStages : s);
}


// Launches a 128-thread decode kernel with static shared memory, with the whole unified L1 /
// shared array as shared memory (set once per kernel and device; racing callers set the same value).
Status launch_max_shared(void (*kernel)(DecodeArgs), std::atomic<bool>& configured, int64_t blocks,
                         cudaStream_t stream, const DecodeArgs& a, const char* name) {
  if (!configured.load(std::memory_order_acquire)) {
    KDA_CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared),
        std::string("cudaFuncSetAttribute(") + name + ")");
    configured.store(true, std::memory_order_release);
  }
  KDA_CUDA_RETURN_IF_ERROR(launch_kernel(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kStagedThreads), 0, stream, a),
                           std::string("launch of ") + name);
  return Status::Ok();
}

template <typename StateT>
Status launch_staged(const DecodeArgs& a, DeviceInfo& d, int64_t blocks, bool latency, cudaStream_t stream) {
  const int which = (sizeof(StateT) == 2 ? 1 : 0) + (latency ? 2 : 0);
  return launch_max_shared(latency ? decode_staged_kernel<StateT, true> : decode_staged_kernel<StateT, false>,
                           d.staged_configured[which], blocks, stream, a, "decode_staged_kernel");
}

template <typename StateT>
Status launch_bulk(const DecodeArgs& a, DeviceInfo& d, int64_t blocks, bool latency, cudaStream_t stream) {
  const bool one_token = !a.varlen && a.T == 1;
  latency = latency && one_token;  // the latency variant handles one token per row only
  const int which = (sizeof(StateT) == 2 ? 1 : 0) + (one_token ? 2 : 0) + (latency ? 4 : 0);
  return launch_max_shared(latency ? decode_bulk_kernel<StateT, 1, true>
                                   : one_token ? decode_bulk_kernel<StateT, 1> : decode_bulk_kernel<StateT, 2>,
                           d.bulk_configured[which], blocks, stream, a, "decode_bulk_kernel");
}

template <typename StateT>
Status launch_persistent(const DecodeArgs& a, DeviceInfo& d, int stages, cudaStream_t stream) {
  auto* kernel = decode_persistent_kernel<StateT>;
  const int which = sizeof(StateT) == 2 ? 1 : 0;
  if (!d.persist_configured[which].load(std::memory_order_acquire)) {  // racing callers set the same value
    KDA_CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, persist_block_smem(d)),
        "cudaFuncSetAttribute(decode_persistent_kernel)");
    d.persist_configured[which].store(true, std::memory_order_release);
  }
  const int stage_bytes = persist_stage_bytes(static_cast<int>(sizeof(StateT)), static_cast<int>(a.T));
  const int smem = kPersistBarrierBytes + stages * stage_bytes;
  const int64_t items = a.N * a.HV * (kPersistK / kPersistTileV);
  int64_t grid = static_cast<int64_t>(d.sms) * kPersistBlocksPerSM;
  if (const char* e = std::getenv("KDA_CUDA_DECODE_GRID")) {  // test hook: a smaller persistent grid
    const long g = std::strtol(e, nullptr, 10);
    if (g > 0) grid = g;
  }
  if (grid > items) grid = items;
  KDA_CUDA_RETURN_IF_ERROR(launch_kernel(kernel, dim3(static_cast<unsigned>(grid)), dim3(kPersistThreads),
                                         static_cast<size_t>(smem), stream, a, items, stages, stage_bytes),
                           "launch of decode_persistent_kernel");
  return Status::Ok();
}

}  // namespace

#ifdef KDA_DECODE_TRACE
Status decode_trace_fetch(std::vector<unsigned long long>* stamps, bool reset) {
  stamps->assign(static_cast<size_t>(kTraceCalls) * kTracePoints * kTraceBlocks, 0ull);
  KDA_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize(), "cudaDeviceSynchronize (trace)");
  KDA_CUDA_RETURN_IF_ERROR(cudaMemcpyFromSymbol(stamps->data(), trace::g_stamps, stamps->size() * sizeof(unsigned long long)),
                           "cudaMemcpyFromSymbol (trace)");
  if (reset) {
    const unsigned zero = 0;
    std::vector<unsigned long long> z(stamps->size(), 0ull);
    KDA_CUDA_RETURN_IF_ERROR(cudaMemcpyToSymbol(trace::g_stamps, z.data(), z.size() * sizeof(unsigned long long)), "trace reset");
    KDA_CUDA_RETURN_IF_ERROR(cudaMemcpyToSymbol(trace::g_call, &zero, sizeof zero), "trace reset");
    KDA_CUDA_RETURN_IF_ERROR(cudaMemcpyToSymbol(trace::g_done, &zero, sizeof zero), "trace reset");
  }
  return Status::Ok();
}
#endif

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
  const bool bf16_state = pr.state.dtype == DType::kBFloat16;
  DeviceInfo* info = nullptr;
  {
    const Status s = device_info(&info);
    if (!s.ok()) return s;
  }
  const int stages = persist_stages(*info, bf16_state ? 2 : 4, pr.d.T);
  const DecodeKernel kernel = choose_kernel(pr, stages, info->sms, std::getenv("KDA_CUDA_DECODE_KERNEL"));
  if (kernel == DecodeKernel::kBaseline) {
    const int64_t blocks = pr.d.N * pr.d.HV;
    if (blocks > INT32_MAX)
      return {StatusCode::kUnsupported, "argument 'q': N x HV = " + std::to_string(blocks) + " blocks exceed the grid limit"};
    KDA_CUDA_RETURN_IF_ERROR(launch_kernel(decode_baseline_kernel, dim3(static_cast<unsigned>(blocks)),
                                           dim3(static_cast<unsigned>(a.V)), 0, stream, a, k_first),
                             "launch of decode_baseline_kernel");
    return Status::Ok();
  }
  if (kernel == DecodeKernel::kPersistent)
    return bf16_state ? launch_persistent<__nv_bfloat16>(a, *info, stages, stream) : launch_persistent<float>(a, *info, stages, stream);
  const int64_t blocks = pr.d.N * pr.d.HV * (pr.d.V / 32);
  if (blocks > INT32_MAX)
    return {StatusCode::kUnsupported, "argument 'q': N x HV x V/32 = " + std::to_string(blocks) +
                                          " blocks exceed the grid limit; split the batch"};
  if (kernel == DecodeKernel::kBulk || kernel == DecodeKernel::kBulkLatency) {
    const bool latency = kernel == DecodeKernel::kBulkLatency;
    return bf16_state ? launch_bulk<__nv_bfloat16>(a, *info, blocks, latency, stream)
                      : launch_bulk<float>(a, *info, blocks, latency, stream);
  }
  if (kernel == DecodeKernel::kStaged || kernel == DecodeKernel::kStagedLatency) {
    const bool latency = kernel == DecodeKernel::kStagedLatency;
    return bf16_state ? launch_staged<__nv_bfloat16>(a, *info, blocks, latency, stream)
                      : launch_staged<float>(a, *info, blocks, latency, stream);
  }
  if (bf16_state) return dispatch_fast<__nv_bfloat16>(a, k_first, blocks, stream);
  return dispatch_fast<float>(a, k_first, blocks, stream);
}

}  // namespace kda::cuda
