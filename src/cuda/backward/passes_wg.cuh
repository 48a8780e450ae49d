// passes_wg.cuh — the backward's two state passes on wgmma (docs/backward.md section 6, item 3):
// one warpgroup per (sequence, value head, 64 value columns), the state slice in its registers
// across the chunks, as the forward recurrence keeps S^T:
//   bwd_states_wg_kernel:   S at every chunk start, S <- diag(exp(G_L)) S + Kd^T (Ut - W S);
//   bwd_dstates_wg_kernel:  dS' of every chunk and d_initial_state,
//                             dU = Aqk^T dO + Kd dS',  dS = diag(exp(G_L)) dS' + Qg^T dO - W^T dU.
// Both run transposed (value columns as the rows M = 64 of the warpgroup): the state slice S^T /
// dS'^T [64 columns][128 keys] is a 64 x 128 fp32 accumulator (64 registers a thread), U^T / dU^T
// [64 columns][64 tokens] another, and each accumulator is the A operand of the next product
// straight from its registers (recurrence_steps.cuh, bf16_hi_lo_operands). Every product is bf16
// hi + lo on both sides (x = hi + lo, two bf16 terms, ~16 significant bits; the lo x lo term
// dropped: ~fp32 products like the 3xTF32 of the mma.sync passes, three wgmma per product). The B
// operands (the chunk's record parts) are converted from the fp32 record into bf16 hi and lo tiles,
// K-major in the 128-byte swizzle (common.cuh, sw128_offset), by the warpgroup's threads at each
// step; the record parts of the chunks two steps ahead are prefetched into L2.
#pragma once

#include "cuda/backward/kernels.cuh"
#include "cuda/prefill/recurrence_steps.cuh"

namespace kda::cuda::bw {

inline constexpr int kWgThreads = 256;  // two warpgroups: the products (0) and the staging (1)
inline constexpr int kWgWarpgroup = 128;
inline constexpr int kWgCols = 64;  // value columns per block
inline constexpr int kWgSlices = kD / kWgCols;

// Shared memory: two buffers (steps alternate between them), each the hi and lo tiles of every B
// operand of a step; then per buffer exp(G_L) [128] fp32 (and, in the states pass, the step's
// slice of Ut [64 tokens][kWgUtLd] fp32); then the mbarriers full[2], empty[2]. The tiles start at
// multiples of 1024 bytes (the swizzle's period) from a 1024-byte aligned base.
// States pass: Wr (rows: 64 tokens, K: 128 keys) and KdT (rows: 128 keys, K: 64 tokens).
inline constexpr int kWgStWr = 0;
inline constexpr int kWgStKdT = kWgStWr + 2 * wg_tile_bytes(kC, kD);
inline constexpr int kWgStBuf = kWgStKdT + 2 * wg_tile_bytes(kD, kC);  // one buffer's tiles
inline constexpr int kWgUtLd = kWgCols + 4;   // Ut's row stride: the accumulator reads on 32 banks
inline constexpr int kWgStGL = 2 * kWgStBuf;  // [2][128]
inline constexpr int kWgStUt = kWgStGL + 2 * kD * 4;  // [2][64][kWgUtLd]
inline constexpr int kWgStBar = kWgStUt + 2 * kC * kWgUtLd * 4;
inline constexpr int kWgStatesSmem = kWgStBar + 32 + 1024;  // + alignment slack
// Reverse pass: Kdr (rows: 64 tokens, K: 128 keys), AqkT (rows: 64 tokens s, K: 64 tokens t), QgT
// and WT (rows: 128 keys, K: 64 tokens).
inline constexpr int kWgDsKdr = 0;
inline constexpr int kWgDsAqkT = kWgDsKdr + 2 * wg_tile_bytes(kC, kD);
inline constexpr int kWgDsQgT = kWgDsAqkT + 2 * wg_tile_bytes(kC, kC);
inline constexpr int kWgDsWT = kWgDsQgT + 2 * wg_tile_bytes(kD, kC);
inline constexpr int kWgDsBuf = kWgDsWT + 2 * wg_tile_bytes(kD, kC);
inline constexpr int kWgDsGL = 2 * kWgDsBuf;  // [2][128]
inline constexpr int kWgDsBar = kWgDsGL + 2 * kD * 4;
inline constexpr int kWgDStatesSmem = kWgDsBar + 32 + 1024;
static_assert(kWgStatesSmem <= 232448 && kWgDStatesSmem <= 232448, "pass shared memory");
static_assert(kWgStKdT % 1024 == 0 && kWgStBuf % 1024 == 0 && kWgDsAqkT % 1024 == 0 &&
                  kWgDsQgT % 1024 == 0 && kWgDsWT % 1024 == 0 && kWgDsBuf % 1024 == 0,
              "tiles at the swizzle period");

// Between a pass step's two commit groups: waits for the first (U^T or dU^T in acc), builds its
// hi + lo A operands and decays the state by exp(G_L), fenced for the second group.
__device__ __forceinline__ void wg_between(float (&acc)[8][4], float (&state)[16][4],
                                           const float* gl, uint32_t (&h)[4][4],
                                           uint32_t (&l)[4][4]) {
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_acc(acc);
  pf::bf16_hi_lo_operands(acc, h, l);
  pf::decay_state(state, gl, static_cast<int>(threadIdx.x & 31));
  wgmma_fence_acc(state);
  wgmma_fence_acc(h);
  wgmma_fence_acc(l);
  wgmma_fence();
}

// A state slice (columns j0.., all keys) of row n, head hv of a state tensor into / from the
// transposed accumulator acc[key tile][e]; absent: zero / nothing.
__device__ __forceinline__ void load_state_t(float (&acc)[16][4], const StateView& s, bool kfirst,
                                             int64_t n, int hv, int j0) {
  // One branch around all the loads, none around each (a load converted inside a branch is
  // waited for there).
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
  if (s.data == nullptr) return;
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      acc[j][e] =
          load_any(s.data, s.dtype, state_off(s, kfirst, n, hv, acc_col(j, e), j0 + acc_row(e)));
}
__device__ __forceinline__ void store_state_t(const float (&acc)[16][4], const StateView& s,
                                              bool kfirst, int64_t n, int hv, int j0) {
  if (s.data == nullptr) return;
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      store_any(s.data, s.dtype, state_off(s, kfirst, n, hv, acc_col(j, e), j0 + acc_row(e)),
                acc[j][e]);
}
// A transposed accumulator (rows: columns j0.. of `out`, columns: its rows) into the fp32 matrix
// `out` of row stride kD: out[acc_col * kD + j0 + acc_row] (the workspace's [128 key][128 value]
// states of a chunk, and the [64 token][128] products of bwd_sprod_kernel).
template <int NJ>
__device__ __forceinline__ void store_ws_t(const float (&acc)[NJ][4], float* out, int j0) {
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) out[acc_col(j, e) * kD + j0 + acc_row(e)] = acc[j][e];
}

// split_a of token values gathered as raw bits by a_values (held as uint32_t, or as float bit
// patterns where they share an array with other values): zero where live(q, r, e) is false.
__device__ __forceinline__ uint32_t a_bits(uint32_t b) { return b; }
__device__ __forceinline__ uint32_t a_bits(float b) { return __float_as_uint(b); }
template <int NQ, typename T, typename Live>
__device__ __forceinline__ void split_token_a(const T (&b)[NQ][4][2], const StridedView& v,
                                              Live&& live, uint32_t (&hi)[NQ][4],
                                              uint32_t (&lo)[NQ][4]) {
  float x[NQ][4][2];
#pragma unroll
  for (int q = 0; q < NQ; ++q)
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int e = 0; e < 2; ++e) x[q][r][e] = token_value(a_bits(b[q][r][e]), v, live(q, r, e));
  split_a(x, hi, lo);
}
// dO is absent or bf16: its bf16 hi + lo split has zero lo terms (the wgmma kernels' kDoLoZero).
__host__ __device__ inline bool do_lo_zero(const BwdParams& P) {
  return P.d_out.data == nullptr || P.d_out.dtype == kBF16;
}

// Both passes run two warpgroups: warpgroup 1 stages the record parts of a step (fp32 from device
// memory, where the L2 prefetch kPassPrefetch steps earlier put them, into bf16 hi + lo tiles) into
// one of two buffers while warpgroup 0 runs the products of the step before on the other. Buffer
// b = step % 2 has an mbarrier full[b] (an arrival per stager thread, after its own writes and its
// proxy fence) and empty[b] (an arrival per product thread, after its reads of the buffer and once
// the step's wgmma have completed). Every thread arrives for its own accesses, so the ordering does
// not rest on a warp or named barrier before a single arrival.
struct WgPipe {
  uint32_t full, empty;  // shared addresses of full[0] and empty[0]; [1] at + 8
};
__device__ __forceinline__ WgPipe wg_pipe_init(uint8_t* bars) {
  const uint32_t a = smem_addr(bars);
  if (threadIdx.x == 0) {
    mbar_init(a, kWgWarpgroup);
    mbar_init(a + 8, kWgWarpgroup);
    mbar_init(a + 16, kWgWarpgroup);
    mbar_init(a + 24, kWgWarpgroup);
    fence_mbar_init();
  }
  __syncthreads();
  return {a, a + 16};
}
// The stager before writing buffer i % 2 for step i: step i - 2's products have completed.
__device__ __forceinline__ void wg_stage_acquire(const WgPipe& w, int64_t i) {
  if (i >= 2)
    mbar_wait(w.empty + 8 * static_cast<uint32_t>(i & 1), static_cast<uint32_t>((i / 2 - 1) & 1));
}
// The stager after its writes of step i: visible to the products' wgmma (async proxy).
__device__ __forceinline__ void wg_stage_release(const WgPipe& w, int64_t i) {
  fence_proxy_async();
  mbar_arrive(w.full + 8 * static_cast<uint32_t>(i & 1));
}
__device__ __forceinline__ void wg_consume_acquire(const WgPipe& w, int64_t i) {
  mbar_wait(w.full + 8 * static_cast<uint32_t>(i & 1), static_cast<uint32_t>((i / 2) & 1));
}
// After step i's wgmma have completed (wgmma_wait<0>): its buffer is free.
__device__ __forceinline__ void wg_consume_release(const WgPipe& w, int64_t i) {
  mbar_arrive(w.empty + 8 * static_cast<uint32_t>(i & 1));
}

// S at every chunk start.
__global__ void __launch_bounds__(kWgThreads, 1)
    bwd_states_wg_kernel(const __grid_constant__ BwdParams P) {
  pdl_prologue();
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* sb = align1024(smem_raw);
  const Params& p = P.f;
  const PassTask t = pass_task<kWgCols>(p);
  const int tid = threadIdx.x;
  const WgPipe w = wg_pipe_init(sb + kWgStBar);
  if (tid >= kWgWarpgroup) {  // the stager
    const int st = tid - kWgWarpgroup;
    for (int64_t ch = 0; ch < t.chunks; ++ch) {
      const float* rec = P.rec + ((t.sp.base + ch) * p.HV + t.hv) * kRecFloats;
      const int b = static_cast<int>(ch & 1);
      uint8_t* buf = sb + b * kWgStBuf;
      float* gl = reinterpret_cast<float*>(sb + kWgStGL) + b * kD;
      float* ut = reinterpret_cast<float*>(sb + kWgStUt) + b * kC * kWgUtLd;
      // Every load of the step in flight at once, before the wait for the buffer: W and Kd^T (8
      // units each), the Ut slice (8 float4) and exp(G_L).
      constexpr int kUt4 = kC * kWgCols / 4 / kWgWarpgroup;
      float xw[8][8], xk[8][8];
      float4 xu[kUt4];
      tile_load<kC, kD, true, 8>(xw, rec + kRecW, kD, 1, st, st, kWgWarpgroup);
      tile_load<kD, kC, false, 8>(xk, rec + kRecKd, 1, kD, st, st, kWgWarpgroup);
#pragma unroll
      for (int v = 0; v < kUt4; ++v) {
        const int e = st + v * kWgWarpgroup, r = e / (kWgCols / 4), c4 = e % (kWgCols / 4);
        xu[v] = *reinterpret_cast<const float4*>(rec + kRecUt + r * kD + t.j0 + 4 * c4);
      }
      const float4 xg = reinterpret_cast<const float4*>(rec + kRecGL)[st % (kD / 4)];
      wg_stage_acquire(w, ch);
      tile_store<kC, kD, true, 8>(xw, buf + kWgStWr, st, kWgWarpgroup);
      tile_store<kD, kC, false, 8>(xk, buf + kWgStKdT, st, kWgWarpgroup);
#pragma unroll
      for (int v = 0; v < kUt4; ++v) {
        const int e = st + v * kWgWarpgroup, r = e / (kWgCols / 4), c4 = e % (kWgCols / 4);
        *reinterpret_cast<float4*>(ut + r * kWgUtLd + 4 * c4) = xu[v];
      }
      if (st < kD / 4) reinterpret_cast<float4*>(gl)[st] = xg;
      wg_stage_release(w, ch);
    }
    return;
  }
  const uint32_t dlo = wgmma_desc_lo(smem_addr(sb));
  for (int ch = 0; ch < kPassPrefetch; ++ch) prefetch_states_step(P, t, ch);
  float accS[16][4];
  load_state_t(accS, p.initial_state, p.kfirst, t.n, t.hv, t.j0);
  for (int64_t ch = 0; ch < t.chunks; ++ch) {
    const int64_t rs = (t.sp.base + ch) * p.HV + t.hv;
    const int b = static_cast<int>(ch & 1);
    const float* gl = reinterpret_cast<const float*>(sb + kWgStGL) + b * kD;
    const float* ut = reinterpret_cast<const float*>(sb + kWgStUt) + b * kC * kWgUtLd;
    prefetch_states_step(P, t, ch + kPassPrefetch);
    store_ws_t(accS, P.states + rs * kStateFloats, t.j0);
    uint32_t sh[8][4], sl[8][4];
    pf::bf16_hi_lo_operands(accS, sh, sl);
    wg_consume_acquire(w, ch);
    // U^T = Ut^T - S^T W^T  (K: 128 keys), U^T starting as Ut^T (this block's columns).
    float accU[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) accU[j][e] = ut[acc_col(j, e) * kWgUtLd + acc_row(e)];
    wgmma_fence_acc(accU);
    wgmma_fence_acc(sh);
    wgmma_fence_acc(sl);
    wgmma_fence();
    wg_product<8, -1>(accU, sh, sl, dlo, b * kWgStBuf + kWgStWr, kC, kD);
    // S^T <- S^T diag(exp(G_L)) + U^T Kd  (K: 64 tokens)
    uint32_t uh[4][4], ul[4][4];
    wg_between(accU, accS, gl, uh, ul);
    wg_product<16, 1>(accS, uh, ul, dlo, b * kWgStBuf + kWgStKdT, kD, kC);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_acc(accS);
    wg_consume_release(w, ch);
  }
}

// dS' of every chunk (stored before the chunk is reversed) and d_initial_state. Steps run over
// the chunks in reverse: step i is chunk chunks - 1 - i. kDoLoZero (do_lo_zero): dO is
// absent or bf16, so the lo terms of dO^T's A operands are zero and their products are skipped;
// a template argument, not a run-time choice, which made ptxas inject warpgroup.arrive waits.
template <bool kDoLoZero>
__global__ void __launch_bounds__(kWgThreads, 1)
    bwd_dstates_wg_kernel(const __grid_constant__ BwdParams P) {
  pdl_prologue();
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* sb = align1024(smem_raw);
  const Params& p = P.f;
  const PassTask t = pass_task<kWgCols>(p);
  const int tid = threadIdx.x;
  const WgPipe w = wg_pipe_init(sb + kWgDsBar);
  if (tid >= kWgWarpgroup) {  // the stager
    const int st = tid - kWgWarpgroup;
    for (int64_t i = 0; i < t.chunks; ++i) {
      const int64_t ch = t.chunks - 1 - i;
      const float* rec = P.rec + ((t.sp.base + ch) * p.HV + t.hv) * kRecFloats;
      const int b = static_cast<int>(i & 1);
      uint8_t* buf = sb + b * kWgDsBuf;
      float* gl = reinterpret_cast<float*>(sb + kWgDsGL) + b * kD;
      // Kd, Aqk^T and exp(G_L) (8 + 4 units) loaded before the wait for the buffer, Qg^T and W^T
      // (8 + 8) while the first two are stored.
      float xa[8][8], xb[8][8];
      float xq[4][8];
      tile_load<kC, kD, true, 8>(xa, rec + kRecKd, kD, 1, st, st, kWgWarpgroup);
      tile_load<kC, kC, false, 4>(xq, rec + kRecAqk, 1, kC, st, st, kWgWarpgroup);
      const float4 xg = reinterpret_cast<const float4*>(rec + kRecGL)[st % (kD / 4)];
      wg_stage_acquire(w, i);
      tile_load<kD, kC, false, 8>(xb, rec + kRecQg, 1, kD, st, st, kWgWarpgroup);
      tile_store<kC, kD, true, 8>(xa, buf + kWgDsKdr, st, kWgWarpgroup);
      tile_store<kC, kC, false, 4>(xq, buf + kWgDsAqkT, st, kWgWarpgroup);
      if (st < kD / 4) reinterpret_cast<float4*>(gl)[st] = xg;
      tile_load<kD, kC, false, 8>(xa, rec + kRecW, 1, kD, st, st, kWgWarpgroup);
      tile_store<kD, kC, false, 8>(xb, buf + kWgDsQgT, st, kWgWarpgroup);
      tile_store<kD, kC, false, 8>(xa, buf + kWgDsWT, st, kWgWarpgroup);
      wg_stage_release(w, i);
    }
    return;
  }
  const uint32_t dlo = wgmma_desc_lo(smem_addr(sb));
  const bool has_do = P.d_out.data != nullptr;
  for (int ch = 0; ch < kPassPrefetch; ++ch)
    prefetch_dstates_step<kWgCols>(P, t, t.chunks - 1 - ch);
  float accD[16][4];
  load_state_t(accD, P.d_final_state, p.kfirst, t.n, t.hv, t.j0);
  for (int64_t i = 0; i < t.chunks; ++i) {
    const int64_t ch = t.chunks - 1 - i;
    const int64_t rs = (t.sp.base + ch) * p.HV + t.hv;
    const int b = static_cast<int>(i & 1);
    const float* gl = reinterpret_cast<const float*>(sb + kWgDsGL) + b * kD;
    const int off = b * kWgDsBuf;
    const int64_t tok0 = t.sp.bos + ch * kC;
    const int64_t L = t.sp.len - ch * kC < kC ? t.sp.len - ch * kC : kC;
    prefetch_dstates_step<kWgCols>(P, t, ch - kPassPrefetch);
    // dO^T as A operands (rows: this block's columns; k: the chunk's tokens), hi + lo: a k16 step
    // q holds tokens 16 q + 2 c (+ 1) and 16 q + 8 + 2 c (+ 1) of columns g and g + 8. Its loads
    // go out first, the stores of dS' while they are in flight, the conversion after.
    // Branch-free: dead tokens read token 0, an absent dO reads v (same shape), both zeroed
    // (chosen here: held across the chunk loop it costs a spill).
    const StridedView& src = has_do ? P.d_out : p.v;
    uint32_t ob[4][4][2];
    a_values(
        [&](int m, int tok) {
          return pf::load_bits_any(src.data, src.dtype,
                                   src.offset(t.sp.b, tok0 + (tok < L ? tok : 0), t.hv) + t.j0 + m);
        },
        ob);
    store_ws_t(accD, P.dstates + rs * kStateFloats, t.j0);
    uint32_t oh[4][4], ol[4][4];
    split_token_a(
        ob, src, [&](int q, int r, int e) { return has_do && a_k(q, r, e) < L; }, oh, ol);
    wg_consume_acquire(w, i);
    uint32_t dh[8][4], dl[8][4];
    pf::bf16_hi_lo_operands(accD, dh, dl);
    // dU^T = dO^T Aqk + dS'^T Kd^T  (K: 64 tokens, then 128 keys)
    float accU[8][4] = {};
    wgmma_fence_acc(accU);
    wgmma_fence_acc(oh);
    wgmma_fence_acc(ol);
    wgmma_fence_acc(dh);
    wgmma_fence_acc(dl);
    wgmma_fence();
    wg_product<8, 1, 4, kDoLoZero>(accU, oh, ol, dlo, off + kWgDsAqkT, kC, kC);
    wg_product<8, 1>(accU, dh, dl, dlo, off + kWgDsKdr, kC, kD);
    // dS'^T <- dS'^T diag(exp(G_L)) + dO^T Qg - dU^T W  (K: 64 tokens)
    uint32_t uh[4][4], ul[4][4];
    wg_between(accU, accD, gl, uh, ul);
    wg_product<16, 1, 4, kDoLoZero>(accD, oh, ol, dlo, off + kWgDsQgT, kD, kC);
    wg_product<16, -1>(accD, uh, ul, dlo, off + kWgDsWT, kD, kC);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_acc(accD);
    wg_consume_release(w, i);
  }
  store_state_t(accD, P.d_initial_state, p.kfirst, t.n, t.hv, t.j0);
}

// ---------------------------------------------------------------------------------------------
// The chunk gradients' products with a state operand, on wgmma: bwd_sprod_kernel
// ---------------------------------------------------------------------------------------------
// Per (chunk slot, value head), before bwd_chunk_kernel (which then skips them, BwdParams::wg):
//   U = Ut - W S,  dU = Aqk^T dO + Kd dS'     (dU into the workspace's uw part),
//   dQg = dO S^T,  dKd = U dS'^T              (into dqk, as bwd_chunk_kernel's own products),
//   dW = -dU S^T,  dAqk = dO U^T,  dKb = X^T dW,  dVb = X^T dU,  exp(G_L) rowsum(S * dS')  (uw).
// Two warpgroups. The products with a state operand run transposed so that the states are A
// operands read from device memory into registers (hi + lo) and the B operands are bf16 hi + lo
// tiles: first U^T and dU^T (M: the warpgroup's 64 value columns) against the record's W, Kd,
// Aqk^T and the dO tile; then, with U and dU written as tiles over W and Kd (and dU^T beside them),
// dQg^T, dW^T and dKd^T (M: the warpgroup's 64 keys); then, with dW^T written as a tile, dKb and
// dVb (the warpgroup's 64 keys / values) and, on warpgroup 0, dAqk. docs/backward.md section 6,
// "the chunk kernel's products on wgmma".
inline constexpr int kSpThreads = 256;
inline constexpr int kSpW = 0;                                     // rows: tokens, K: keys
inline constexpr int kSpKd = kSpW + 2 * wg_tile_bytes(kC, kD);     // rows: tokens, K: keys
inline constexpr int kSpAqkT = kSpKd + 2 * wg_tile_bytes(kC, kD);  // rows: s, K: t
inline constexpr int kSpDO = kSpAqkT + 2 * wg_tile_bytes(kC, kC);  // rows: tokens, K: values
inline constexpr int kSpU = kSpW, kSpDU = kSpKd;                   // rows: tokens, K: values
inline constexpr int kSpDUT = kSpDO + 2 * wg_tile_bytes(kC, kD);   // rows: values, K: tokens
inline constexpr int kSpDWT = kSpDUT + 2 * wg_tile_bytes(kD, kC);  // rows: keys, K: tokens
inline constexpr int kSprodSmem = kSpDWT + 2 * wg_tile_bytes(kD, kC) + 1024;
static_assert(kSprodSmem <= 232448 && kSpAqkT % 1024 == 0 && kSpDO % 1024 == 0 &&
                  kSpDUT % 1024 == 0 && kSpDWT % 1024 == 0,
              "sprod smem");

// An accumulator (rows m = acc_row, columns n = acc_col) into out[m * ld + col0 + n].
__device__ __forceinline__ void store_rows(const float (&acc)[8][4], float* out, int ld, int col0) {
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) out[acc_row(e) * ld + col0 + acc_col(j, e)] = acc[j][e];
}

// kDoLoZero (do_lo_zero): the products with dO as an operand skip its zero lo terms.
template <bool kDoLoZero>
__global__ void __launch_bounds__(kSpThreads, 1)
    bwd_sprod_kernel(const __grid_constant__ BwdParams P) {
  pdl_prologue();
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* sb = align1024(smem_raw);
  const Params& p = P.f;
  const int tid = threadIdx.x, wg = tid >> 7;
  const int hv = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.HV));
  const int64_t slot = blockIdx.x / static_cast<unsigned>(p.HV);
  const ChunkTask c = chunk_task(p, slot);
  if (!c.valid) return;
  const int64_t task = slot * p.HV + hv;
  const float* rec = P.rec + task * kRecFloats;
  const float* S = P.states + task * kStateFloats;
  const float* D = P.dstates + task * kStateFloats;
  float* uw = P.uw + task * static_cast<int64_t>(kUwFloats);
  float* dqh = P.dqk + task * (2 * kTile);
  float* dkh = dqh + kTile;
  const uint32_t dlo = wgmma_desc_lo(smem_addr(sb));
  const bool has_do = P.d_out.data != nullptr;
  // dO's loads are branch-free (token_bits): an absent dO reads v (same shape) and is zeroed.
  const StridedView& dsrc = has_do ? P.d_out : p.v;
  const int j0 = 64 * wg;  // this warpgroup's 64 values, then its 64 keys

  // The B tiles of the first products: W, Kd, Aqk^T from the record, dO from the input, every
  // load of the four in flight before the first store (a thread's 4 + 4 + 2 units and 4 dO units).
  {
    float xw[4][8], xk[4][8], xa[2][8];
    uint32_t ob[4][8];
    tile_load<kC, kD, true, 4>(xw, rec + kRecW, kD, 1, tid, tid, kSpThreads);
    tile_load<kC, kD, true, 4>(xk, rec + kRecKd, kD, 1, tid, tid, kSpThreads);
    tile_load<kC, kC, false, 2>(xa, rec + kRecAqk, 1, kC, tid, tid, kSpThreads);
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const int u = tid + v * kSpThreads, tok = u / (kD / 8), kb = u % (kD / 8);
#pragma unroll
      for (int i = 0; i < 8; ++i) ob[v][i] = token_bits(dsrc, c, tok, hv, 8 * kb + i);
    }
    tile_store<kC, kD, true, 4>(xw, sb + kSpW, tid, kSpThreads);
    tile_store<kC, kD, true, 4>(xk, sb + kSpKd, tid, kSpThreads);
    tile_store<kC, kC, false, 2>(xa, sb + kSpAqkT, tid, kSpThreads);
    float xo[4][8];
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const int tok = (tid + v * kSpThreads) / (kD / 8);
#pragma unroll
      for (int i = 0; i < 8; ++i) xo[v][i] = token_value(ob[v][i], dsrc, has_do && tok < c.L);
    }
    tile_store<kC, kD, true, 4>(xo, sb + kSpDO, tid, kSpThreads);
  }
  fence_proxy_async();
  __syncthreads();

  // Each product's A operands are loaded while the product before it runs (its raw values held
  // in registers, split into hi + lo after the wait), so a phase waits on one device-memory round
  // trip less.
  // U^T = Ut^T - S^T W^T (rows: values j0..; K: 128 keys).
  float accU[8][4], accV[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      accU[j][e] = rec[kRecUt + acc_col(j, e) * kD + j0 + acc_row(e)];
      accV[j][e] = 0.f;
    }
  uint32_t ob[4][4][2];  // dO^T's raw bits (dU^T's first A operand)
  float xd[8][4][2];     // dS'^T (dU^T's second A operand), the states' rows, dO's bits for dAqk
  {
    uint32_t ah[8][4], al[8][4];
    load_a([&](int m, int k) { return S[k * kD + j0 + m]; }, ah, al);
    wgmma_fence_acc(accU);
    wgmma_fence_acc(ah);
    wgmma_fence_acc(al);
    wgmma_fence();
    wg_product<8, -1>(accU, ah, al, dlo, kSpW, kC, kD);
    wgmma_commit();
    a_values([&](int m, int tok) { return token_bits(dsrc, c, tok, hv, j0 + m); }, ob);
    a_values([&](int m, int k) { return D[k * kD + j0 + m]; }, xd);
    wgmma_wait<0>();  // its A registers are free only then
  }
  // dU^T = dO^T Aqk + dS'^T Kd^T (K: 64 tokens, then 128 keys).
  {
    uint32_t oh[4][4], ol[4][4], ah[8][4], al[8][4];
    split_token_a(
        ob, dsrc, [&](int q, int r, int e) { return has_do && a_k(q, r, e) < c.L; }, oh, ol);
    split_a(xd, ah, al);
    wgmma_fence_acc(accV);
    wgmma_fence_acc(oh);
    wgmma_fence_acc(ol);
    wgmma_fence_acc(ah);
    wgmma_fence_acc(al);
    wgmma_fence();
    wg_product<8, 1, 4, kDoLoZero>(accV, oh, ol, dlo, kSpAqkT, kC, kC);
    wg_product<8, 1>(accV, ah, al, dlo, kSpKd, kC, kD);
    wgmma_commit();
    wgmma_wait<0>();
  }
  wgmma_fence_acc(accU);
  wgmma_fence_acc(accV);
  a_values([&](int m, int k) { return S[(j0 + m) * kD + k]; }, xd);  // in flight over the stores
  store_ws_t(accV, uw + kUwDU, j0);
  store_tile<kD, kC, false>(accV, sb + kSpDUT, j0);  // dU^T: rows values, K tokens
  __syncthreads();  // both warpgroups' products are complete: W and Kd are free
  store_tile<kC, kD, true>(accU, sb + kSpU, j0);  // U: rows tokens, K values
  store_tile<kC, kD, true>(accV, sb + kSpDU, j0);
  fence_proxy_async();
  __syncthreads();

  // dQg^T = S dO^T, dW^T = -S dU^T, dKd^T = dS' U^T (rows: keys j0..; K: 128 values).
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) accU[j][e] = accV[j][e] = 0.f;
  {
    uint32_t ah[8][4], al[8][4];
    split_a(xd, ah, al);
    wgmma_fence_acc(accU);
    wgmma_fence_acc(accV);
    wgmma_fence_acc(ah);
    wgmma_fence_acc(al);
    wgmma_fence();
    wg_product<8, 1, 8, false, kDoLoZero>(accU, ah, al, dlo, kSpDO, kC, kD);
    wg_product<8, -1>(accV, ah, al, dlo, kSpDU, kC, kD);
    wgmma_commit();
    a_values([&](int m, int k) { return D[(j0 + m) * kD + k]; }, xd);
    wgmma_wait<0>();
  }
  wgmma_fence_acc(accU);
  wgmma_fence_acc(accV);
  store_ws_t(accU, dqh, j0);
  store_ws_t(accV, uw + kUwDW, j0);
  store_tile<kD, kC, false>(accV, sb + kSpDWT, j0);  // dW^T: rows keys, K tokens
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) accU[j][e] = 0.f;
  float xx[4][4][2];  // X^T (the A operand of dKb, dVb)
  {
    uint32_t ah[8][4], al[8][4];
    split_a(xd, ah, al);
    wgmma_fence_acc(accU);
    wgmma_fence_acc(ah);
    wgmma_fence_acc(al);
    wgmma_fence();
    wg_product<8, 1>(accU, ah, al, dlo, kSpU, kC, kD);
    wgmma_commit();
    a_values([&](int m, int k) { return rec[kRecX + k * kC + m]; }, xx);
    wgmma_wait<0>();
  }
  wgmma_fence_acc(accU);
  store_ws_t(accU, dkh, j0);
  fence_proxy_async();
  __syncthreads();  // the dW^T tile

  // dKb = X^T dW, dVb = X^T dU (rows: tokens; the warpgroup's 64 keys / values; K: 64 tokens).
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) accU[j][e] = accV[j][e] = 0.f;
  {
    uint32_t xh[4][4], xl[4][4];
    split_a(xx, xh, xl);
    wgmma_fence_acc(accU);
    wgmma_fence_acc(accV);
    wgmma_fence_acc(xh);
    wgmma_fence_acc(xl);
    wgmma_fence();
    wg_product<8, 1>(accU, xh, xl, dlo, kSpDWT + j0 * 128, kD, kC);
    wg_product<8, 1>(accV, xh, xl, dlo, kSpDUT + j0 * 128, kD, kC);
    wgmma_commit();
    if (wg == 0)  // dO's raw bits for dAqk below
      a_values([&](int tok, int k) { return __uint_as_float(token_bits(dsrc, c, tok, hv, k)); },
               xd);
    wgmma_wait<0>();
  }
  wgmma_fence_acc(accU);
  wgmma_fence_acc(accV);
  store_rows(accU, uw + kUwDKb, kD, j0);
  store_rows(accV, uw + kUwDVb, kD, j0);
  if (wg == 0) {  // dAqk = dO U^T (rows t, columns s; all of it: the chunk kernel masks s > t)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) accU[j][e] = 0.f;
    uint32_t oh[8][4], ol[8][4];
    split_token_a(
        xd, dsrc, [&](int, int r, int) { return has_do && a_row(r) < c.L; }, oh, ol);
    wgmma_fence_acc(accU);
    wgmma_fence_acc(oh);
    wgmma_fence_acc(ol);
    wgmma_fence();
    wg_product<8, 1, 8, kDoLoZero>(accU, oh, ol, dlo, kSpU, kC, kD);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_acc(accU);
    store_rows(accU, uw + kUwDAqk, kC, 0);
  } else {  // exp(G_L) * rowsum(S * dS'): a warp per 32 keys, 8 rows' loads in flight at once
    const int lane = tid & 31, r0 = 32 * ((tid >> 5) & 3);
#pragma unroll 1
    for (int rb = r0; rb < r0 + 32; rb += 8) {
      float4 a[8], d[8];
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        a[r] = reinterpret_cast<const float4*>(S + (rb + r) * kD)[lane];
        d[r] = reinterpret_cast<const float4*>(D + (rb + r) * kD)[lane];
      }
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const float s =
            warp_sum(a[r].x * d[r].x + a[r].y * d[r].y + a[r].z * d[r].z + a[r].w * d[r].w);
        if (lane == 0) uw[kUwDgl + rb + r] = s * rec[kRecGL + rb + r];
      }
    }
  }
}

}  // namespace kda::cuda::bw
