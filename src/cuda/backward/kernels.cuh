// kernels.cuh — the CUDA prefill backward (sm_90a; docs/backward.md section 4). Six kernels on
// the caller's stream, in this order, over the chunked form of docs/design.md section 3 (64-token
// chunks, per value head):
//   1. bwd_prepare_kernel   (chunk, value head): preprocessing, Akk, Aqk, X = (I + diag(b) Akk)^-1,
//                           W = X diag(b) exp(G) k, Ut = X diag(b) v, exp(G) q, exp(G_L - G) k,
//                           exp(G_L) into an fp32 record.
//   2. bwd_states_kernel    (sequence, value head, 32 value columns): the forward state pass,
//                           S at every chunk start.
//   3. bwd_dstates_kernel   (sequence, value head, 32 value columns): the reverse pass, dS' (the
//                           gradient of the state leaving each chunk) and d_initial_state:
//                             dU = Aqk^T dO + Kd dS',  dS = diag(exp(G_L)) dS' + Qg^T dO - W^T dU.
//   4. bwd_chunk_kernel     (chunk, value head; persistent blocks with a scratch slot each): every
//                           gradient of the chunk's tokens from S, dS', the record and dO:
//                           dv, dbeta, dg written, the A_log / dt_bias partials to the workspace;
//                           dq, dk written when every q/k head has one value head, else dq^, dk^
//                           (before the group sum and the l2norm chain) to the workspace.
//   5. bwd_qk_kernel        (chunk, q/k head; grouped values only): the group's value heads summed
//                           in order, scale and l2norm chained, dq and dk written.
//   6. bwd_params_kernel    (value head): dA_log, ddt_bias summed over the chunks in order.
// passes_wg.cuh holds the wgmma kernels: bwd_sprod_kernel, which computes the chunk gradients'
// products with a state operand before kernel 4 (Tuning::backward_wgmma, the default), and wgmma
// forms of kernels 2 and 3 (Tuning::backward_wg_passes, the default).
// The products with an operand in shared memory as a B tile run on wgmma, three bf16 terms
// (wg_tiles.cuh: hi hi, lo hi, hi lo, ~fp32 products): W, Ut (kernel 1), dX, T1, dM (kernel 4). The
// others run on tf32 mma.sync (m16n8k8, fp32 accumulation; 3xTF32, ~fp32 accurate), most through
// gemm_tf32, with operands in shared or global memory. Exponentials never see a positive
// argument. Off the diagonal 16 x 16 blocks, Akk / Aqk and their gradients factor the decay
// around the first token r of the row block, exp(G_t - G_r) exp(G_r - G_s); inside them they
// take exp(G_t - G_s), t >= s, per element. Gates of -1000 give zeros, never inf or NaN.
#pragma once

#include "cuda/backward/wg_tiles.cuh"
#include "cuda/prefill/common.cuh"

namespace kda::cuda::bw {

using namespace pf;  // the prefill's device helpers (and, in emulation, the PTX wrappers)
using pf::IndexView;
using pf::kChunk;
using pf::kHeadDim;
using pf::load_any;
using pf::Params;
using pf::SeqSpan;
using pf::StateView;
using pf::store_any;

inline constexpr int kD = kHeadDim;  // K == V == 128
inline constexpr int kC = kChunk;    // 64 tokens per chunk
inline constexpr int kTile = kC * kD;

// The fp32 record of one (chunk slot, value head), row-major, rows t >= L zero:
inline constexpr int kRecW = 0;                    // [64][128] X diag(b) exp(G) k^
inline constexpr int kRecUt = kRecW + kTile;       // [64][128] X diag(b) v
inline constexpr int kRecQg = kRecUt + kTile;      // [64][128] exp(G) q^
inline constexpr int kRecKd = kRecQg + kTile;      // [64][128] exp(G_L - G) k^
inline constexpr int kRecAqk = kRecKd + kTile;     // [64][64]  q^_t . (exp(G_t - G_s) k^_s), s <= t
inline constexpr int kRecAkk = kRecAqk + kC * kC;  // [64][64] the same with k^_t, s < t
inline constexpr int kRecX = kRecAkk + kC * kC;    // [64][64]  (I + diag(b) Akk)^-1
inline constexpr int kRecGL = kRecX + kC * kC;     // [128]     exp(G_L)
inline constexpr int kRecFloats = kRecGL + kD;     // 45,184 floats
inline constexpr int kStateFloats = kD * kD;       // S or dS': [128 key][128 value]
inline constexpr int kPartFloats = kD + 4;         // ddt_bias partial [128], dA_log partial
inline constexpr int kScratchTiles = 6;            // bwd_chunk_kernel's per-block tiles
inline constexpr int kScratchFloats = kScratchTiles * kTile;
// The workspace's part of bwd_sprod_kernel's results per (chunk slot, value head), fp32:
inline constexpr int kUwDU = 0;                   // [64][128] dU
inline constexpr int kUwDW = kUwDU + kTile;       // [64][128] dW
inline constexpr int kUwDKb = kUwDW + kTile;      // [64][128] dKb = X^T dW
inline constexpr int kUwDVb = kUwDKb + kTile;     // [64][128] dVb = X^T dU
inline constexpr int kUwDAqk = kUwDVb + kTile;    // [64][64]  dAqk = dO U^T (all of it)
inline constexpr int kUwDgl = kUwDAqk + kC * kC;  // [128] exp(G_L) * rowsum(S * dS')
inline constexpr int kUwFloats = kUwDgl + kD;

inline constexpr int kPrepThreads = 512, kChunkThreads = 512, kPassThreads = 128, kQkThreads = 256;
inline constexpr int kParamThreads = 128;
inline constexpr int kSlice = 32;  // value columns per pass block
inline constexpr int kSlices = kD / kSlice;
// The state passes prefetch the record parts of the chunk this many steps ahead into L2.
inline constexpr int kPassPrefetch = 2;

// Shared memory (floats) of the kernels.
// bwd_prepare_kernel's tiles of q^, k^ and G have a padded row stride (load_chunk).
inline constexpr int kPrepLd = kD + 4;
// Its B tiles of W = X Kb and Ut = X Vb (Kb^T, Vb^T: rows 128 keys / values, K 64 tokens, bf16
// hi + lo) after the fp32 part, from the next 1024-byte boundary.
inline constexpr int kPrepFloats = 3 * kC * kPrepLd + 2 * kC * kC + 3 * 256 + kC;
inline constexpr int kPrepKbT = 0, kPrepVbT = 2 * wg_tile_bytes(kD, kC);
inline constexpr int kPrepSmemFloats = kPrepFloats + (2 * kPrepVbT + 1024) / 4;
inline constexpr int kPassSmemFloats = kD * kSlice + 2 * kC * kD + kC * kC + 2 * kC * kSlice + kD;
// bwd_chunk_kernel's row groups of the elementwise pass (a thread per key column in each).
inline constexpr int kChunkRowGroups = kChunkThreads / kD;
inline constexpr int kChunkLd = kD + 4;  // row stride of its q^, k^, G and dq^ tiles
// Its per-warp staging rows (stage_dg): 8 rows of 32 keys, row stride kStgLd.
inline constexpr int kStgLd = 40;  // the fragment layout's writes: pairs on a bank
inline constexpr int kStgWarp = 8 * kStgLd;
inline constexpr int kChunkSmemFloats = 4 * kC * kChunkLd + 4 * kC * kC +
                                        (2 + kChunkRowGroups) * kD + 2 * kC +
                                        (kChunkThreads / 32) * kStgWarp;
inline constexpr int kPrepSmemBytes = kPrepSmemFloats * 4;
inline constexpr int kPassSmemBytes = kPassSmemFloats * 4;
inline constexpr int kChunkSmemBytes = kChunkSmemFloats * 4;
static_assert(kPrepSmemBytes <= 232448 && kPassSmemBytes <= 232448 && kChunkSmemBytes <= 232448,
              "backward shared memory");

struct BwdParams {
  Params f;  // the forward's inputs (q, k, v, g, beta, A_log, dt_bias, initial_state, shapes, math)
  StridedView d_out;                  // [B, T, HV, V], optional (absent: zero)
  StateView d_final_state;            // optional (absent: zero)
  StridedView dq, dk, dv, dg, dbeta;  // optional outputs
  float* dA_log = nullptr;            // [HV] (stride dA_log_s), optional
  float* ddt_bias = nullptr;          // [HV, K] (row stride ddt_bias_s), optional
  int64_t dA_log_s = 1, ddt_bias_s = kD;
  StateView d_initial_state;  // optional
  // Workspace parts (fp32).
  float* rec = nullptr;      // [slots][HV][kRecFloats]
  float* states = nullptr;   // [slots][HV][kStateFloats]: S at the chunk's start
  float* dstates = nullptr;  // [slots][HV][kStateFloats]: gradient of the state leaving it
  float* dqk = nullptr;      // [slots][HV][2][64][128]: dq^, dk^ of the chunk's tokens
  float* part = nullptr;     // [slots][HV][kPartFloats]
  float* uw = nullptr;       // [slots][HV][kUwFloats]: bwd_sprod_kernel's results
  // bwd_sprod_kernel (passes_wg.cuh) runs, and bwd_chunk_kernel reads its products from uw and dqk
  // instead of computing them.
  bool wg = false;
  bool wg_passes = false;    // the state passes on wgmma (passes_wg.cuh)
  float* scratch = nullptr;  // [chunk_blocks][kScratchFloats]
  int64_t chunk_blocks = 0;
};

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

// One chunk of one sequence: batch row b, first token t0 (of the row), L tokens (1..64).
struct ChunkTask {
  bool valid = false;
  int64_t n = 0, b = 0, t0 = 0;
  int L = 0;
};
__device__ __forceinline__ ChunkTask chunk_task(const Params& p, int64_t slot) {
  ChunkTask c;
  int64_t n;
  if (!p.varlen) {
    n = p.chunks_per_seq > 0 ? slot / p.chunks_per_seq : p.N;
  } else {  // the last n whose first slot (varlen_base) is <= slot
    int64_t lo = 0, hi = p.N - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (pf::varlen_base(p, mid) <= slot)
        lo = mid;
      else
        hi = mid - 1;
    }
    n = lo;
  }
  if (n < 0 || n >= p.N) return c;
  const SeqSpan sp = pf::seq_span(p, n);
  const int64_t j = slot - sp.base;
  if (j < 0 || j * kC >= sp.len) return c;
  c.valid = true;
  c.n = n;
  c.b = sp.b;
  c.t0 = sp.bos + j * kC;
  const int64_t rest = sp.len - j * kC;
  c.L = static_cast<int>(rest < kC ? rest : kC);
  return c;
}

// Element `col` of token t's row (head `head`) of a token tensor as raw bits (load_bits_any),
// loaded whether or not t is live (t >= L reads token 0, which every valid chunk has): a thread's
// loads carry no branch and issue back to back; convert with token_value at the use. A load whose
// conversion sits in the branch of `live ? load : 0` waits there, and every later load of the
// thread waits behind it.
__device__ __forceinline__ uint32_t token_bits(const StridedView& v, const ChunkTask& c, int t,
                                               int head, int64_t col) {
  return load_bits_any(v.data, v.dtype, v.offset(c.b, c.t0 + (t < c.L ? t : 0), head) + col);
}
__device__ __forceinline__ float token_value(uint32_t bits, const StridedView& v, bool live) {
  return live ? bits_to_f32(bits, v.dtype) : 0.f;
}

// Element (key i, value j) of row `row`, head hv of a state tensor.
__device__ __forceinline__ int64_t state_off(const StateView& s, bool kfirst, int64_t row, int hv,
                                             int i, int j) {
  return row * s.s0 + hv * s.s1 +
         (kfirst ? static_cast<int64_t>(i) * s.s2 + j : static_cast<int64_t>(j) * s.s2 + i);
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
// One round of warp_sum32: values j < W keep the half whose index bit W matches the lane's, the
// other half traded with lane ^ W. The choice as a bit mask on the values: `up ? v[j] : v[j + W]`
// becomes a select of addresses, which puts v in local memory.
template <int W>
__device__ __forceinline__ void warp_sum32_round(float (&v)[32]) {
  const uint32_t up = (threadIdx.x & W) != 0 ? 0xffffffffu : 0u;
#pragma unroll
  for (int j = 0; j < W; ++j) {
    const uint32_t a = __float_as_uint(v[j]), b = __float_as_uint(v[j + W]);
    const float send = __uint_as_float((a & up) | (b & ~up));
    const float keep = __uint_as_float((b & up) | (a & ~up));
    v[j] = keep + __shfl_xor_sync(0xffffffffu, send, W);
  }
}
// 32 warp sums at once: afterwards v[0] of lane L holds the sum over the warp of v[L] (31
// shuffles instead of 160; v[1..] are clobbered).
__device__ __forceinline__ void warp_sum32(float (&v)[32]) {
  warp_sum32_round<16>(v);
  warp_sum32_round<8>(v);
  warp_sum32_round<4>(v);
  warp_sum32_round<2>(v);
  warp_sum32_round<1>(v);
}

// L2 prefetch (a hint, nothing to wait for) of `floats` floats at src (16-byte aligned, a multiple
// of 4 floats), in bulk prefetches of at most kPrefetchPiece bytes: piece i is issued by thread
// lead + i of the block.
inline constexpr int kPrefetchPiece = 32768;
__device__ __forceinline__ void prefetch_floats(const float* src, int floats, int lead) {
  const int bytes = 4 * floats, i = static_cast<int>(threadIdx.x) - lead;
  if (i >= 0 && i * kPrefetchPiece < bytes) {
    const int off = i * kPrefetchPiece;
    bulk_prefetch_l2(
        reinterpret_cast<const uint8_t*>(src) + off,
        static_cast<uint32_t>(bytes - off < kPrefetchPiece ? bytes - off : kPrefetchPiece));
  }
}
// L2 prefetch (a hint) of the 128-byte lines that hold bytes [p, p + bytes), any alignment.
__device__ __forceinline__ void prefetch_lines(const void* p, int bytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  for (uintptr_t l = a & ~static_cast<uintptr_t>(127); l < a + bytes; l += 128)
    prefetch_l2(reinterpret_cast<const void*>(l));
}

// L2 prefetch (a hint) of the token rows of chunk c that the kernels read: q, k (q/k head of hv),
// g, beta, v and, if given, dO (value head hv). A thread per (tensor, row).
__device__ __forceinline__ void prefetch_rows(const Params& p, const ChunkTask& c, int hv,
                                              const StridedView* d_out) {
  const int h = hv / p.groups;
  for (int x = static_cast<int>(threadIdx.x); x < 6 * kC; x += static_cast<int>(blockDim.x)) {
    const int which = x / kC, t = x % kC;
    if (t >= c.L) continue;
    const int64_t tok = c.t0 + t;
    const StridedView* v = which == 0   ? &p.q
                           : which == 1 ? &p.k
                           : which == 2 ? &p.g
                           : which == 3 ? &p.beta
                           : which == 4 ? &p.v
                                        : d_out;
    if (v == nullptr || v->data == nullptr) continue;
    const int64_t off = v->offset(c.b, tok, which < 2 ? h : hv);
    const int esize = v->dtype == kF32 ? 4 : 2;
    prefetch_lines(static_cast<const uint8_t*>(v->data) + off * esize,
                   (which == 3 ? 1 : kD) * esize);
  }
}

// C(m, n) = sum_k A(m, k) B(k, n) over M x N x Kd (M a multiple of 16, N and Kd of 8), on tf32
// mma.sync with fp32 accumulation: A(m, k) = a[m * a_rs + k * a_cs], B(k, n) = b[k * b_rs +
// n * b_cs], shared or global memory. The block's warps take the 16 x (8 kNj) output tiles in turn
// (kNj = 2 gives a 64 x 64 product 16 tiles); each output element is handed once to epi(m, n,
// value) by the thread that owns it, and which thread owns (m, n) depends only on M, N, kNj and
// the block size: two products of the same M x N and kNj may update the same elements one after
// the other without a barrier.
// The k loop is software-pipelined: a ring of kGemmStages register sets of raw fragments, the
// loads of k-step k + 8 (kGemmStages - 1) issued before the mma of step k, so that a step's loads
// are in flight while the steps before it compute (the operands are often in global memory: an
// L2 or HBM latency per step otherwise). The mma of an output element run in k order (the same
// sums as one step at a time). 48 fragment registers; the 512-thread kernels fit in their 128
// registers per thread without spills, the 128-thread state passes (two blocks per SM) in 255.
// kSplit: 3xTF32, each operand split into two tf32 terms, the product of the small ones dropped
// (~fp32 accuracy, three mma per product; the default, Tuning::backward_split). With single tf32
// products the fp32 gradients that sum dG with cancellation (dA_log, ddt_bias) measure up to
// 3.5e-3 in emulation against ~1e-5.
//
// Swizzled shared-memory tiles (kSwA / kSwB): a tile with row stride R (a multiple of 32 floats)
// holds element (r, c) at r * R + (c ^ swz(r)), which permutes column bits 2..4 by the row, so a
// warp's fragment loads hit 32 different banks in either orientation of the operand (the
// plain layout puts 4 or 8 lanes on one bank), and 4-float groups stay contiguous (16-byte
// copies, copy_in). Such an operand has unit stride on one side: rs == 1 (the tile's rows
// are k) or cs == 1 (its rows are the operand's rows).
__host__ __device__ constexpr int swz(int r) { return ((r & 3) << 3) | (r & 4); }
__host__ __device__ constexpr int sw(int r, int c, int R) { return r * R + (c ^ swz(r)); }
// Checked at compile time for every row stride used: each of the eight fragment loads of a
// k-step (four per operand orientation) puts the 32 lanes (g = lane / 4, c = lane % 4) on 32
// different banks, and sw permutes each row's 4-float groups among themselves.
constexpr bool swizzle_ok(int R) {
  for (int r0 = 0; r0 < 64; r0 += 8)
    for (int k0 = 0; k0 < R; k0 += 8)
      for (int half = 0; half < 2; ++half)
        for (int rows_k = 0; rows_k < 2; ++rows_k) {
          unsigned banks = 0;
          for (int lane = 0; lane < 32; ++lane) {
            const int g = lane >> 2, c = (lane & 3) + 4 * half;
            // rows_k: the tile's row is k (lane reads row k0 + c, column r0 + g), else the row is
            // the operand's (row r0 + g, column k0 + c).
            const int idx = rows_k ? sw(k0 + c, (r0 + g) % R, R) : sw(r0 + g, k0 + c, R);
            banks |= 1u << (idx % 32);
          }
          if (banks != 0xffffffffu) return false;
        }
  for (int r = 0; r < 8; ++r)
    for (int c = 0; c < R; ++c)
      if ((sw(r, c, R) - r * R) / 4 != ((c ^ swz(r)) / 4) || (c ^ swz(r)) >= R ||
          (sw(r, c, R) - r * R) % 4 != c % 4)
        return false;
  return true;
}
static_assert(swizzle_ok(32) && swizzle_ok(64) && swizzle_ok(128), "swizzle bank mapping");

// One k8 step of a warp's m16n8 tile on tf32 mma.sync: A's fragment av (rows g, g + 8, columns
// c, c + 4) split into tf32 hi and lo terms once (split_a), then per n8 tile with B's b0, b1 (rows
// c, c + 4, column g): kSplit, the three products lo hi, hi lo, hi hi in that order (3xTF32),
// else hi hi. kBTf32: B's values are tf32 numbers (bf16 or fp16 inputs), whose lo term is zero, so
// the hi lo product (which would add exactly zero) is skipped.
__device__ __forceinline__ void split_a(const float (&av)[4], uint32_t (&af)[4],
                                        uint32_t (&al)[4]) {
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    af[e] = f32_to_tf32(av[e]);
    al[e] = f32_to_tf32(av[e] - __uint_as_float(af[e]));
  }
}
template <bool kSplit, bool kBTf32 = false>
__device__ __forceinline__ void mma_split(float (&acc)[4], const uint32_t (&af)[4],
                                          const uint32_t (&al)[4], float b0, float b1) {
  const uint32_t b0h = f32_to_tf32(b0), b1h = f32_to_tf32(b1);
  if constexpr (kSplit) {
    mma_tf32(acc, al, b0h, b1h);
    if constexpr (!kBTf32)
      mma_tf32(acc, af, f32_to_tf32(b0 - __uint_as_float(b0h)),
               f32_to_tf32(b1 - __uint_as_float(b1h)));
  }
  mma_tf32(acc, af, b0h, b1h);
}

inline constexpr int kGemmStages = 4;  // fragment sets of gemm_tf32: loads 3 k-steps ahead
template <bool kSplit, bool kSwA = false, bool kSwB = false, int kNj = 4, bool kBTf32 = false,
          typename Epi>
__device__ __forceinline__ void gemm_tf32(int M, int N, int Kd, const float* a, int a_rs, int a_cs,
                                          const float* b, int b_rs, int b_cs, Epi&& epi) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = static_cast<int>(blockDim.x >> 5);
  const int g = lane >> 2, c = lane & 3;
  constexpr int kTn = 8 * kNj;  // the tile's columns
  const int mt = M >> 4, nt = (N + kTn - 1) / kTn;
  for (int tile = warp; tile < mt * nt; tile += nwarps) {
    const int m0 = (tile / nt) << 4, n0 = (tile % nt) * kTn;
    const int nj = (N - n0) >= kTn ? kNj : (N - n0) >> 3;
    float acc[kNj][4];
#pragma unroll
    for (int j = 0; j < kNj; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    const float* a0 = a + static_cast<int64_t>(m0 + g) * a_rs + static_cast<int64_t>(c) * a_cs;
    const float* a1 = a0 + static_cast<int64_t>(8) * a_rs;
    const float* b0 = b + static_cast<int64_t>(c) * b_rs + static_cast<int64_t>(n0 + g) * b_cs;
    // The raw fp32 fragments of k-step k0: av (A rows g, g + 8, columns c, c + 4), bv[j] (B rows
    // c, c + 4 of n-tile j).
    auto load = [&](int k0, float(&av)[4], float(&bv)[kNj][2]) {
      if constexpr (kSwA) {
        const int r = m0 + g, k = k0 + c;
        if (a_cs == 1) {
          av[0] = a[sw(r, k, a_rs)];
          av[1] = a[sw(r + 8, k, a_rs)];
          av[2] = a[sw(r, k + 4, a_rs)];
          av[3] = a[sw(r + 8, k + 4, a_rs)];
        } else {
          av[0] = a[sw(k, r, a_cs)];
          av[1] = a[sw(k, r + 8, a_cs)];
          av[2] = a[sw(k + 4, r, a_cs)];
          av[3] = a[sw(k + 4, r + 8, a_cs)];
        }
      } else {
        const int64_t ka = static_cast<int64_t>(k0) * a_cs,
                      ka4 = ka + static_cast<int64_t>(4) * a_cs;
        av[0] = a0[ka];
        av[1] = a1[ka];
        av[2] = a0[ka4];
        av[3] = a1[ka4];
      }
      if constexpr (kSwB) {
        const int k = k0 + c;
        const bool rows_k = b_cs == 1;  // the tile's rows are k
#pragma unroll
        for (int j = 0; j < kNj; ++j) {
          const int n = n0 + 8 * j + g;
          bv[j][0] = j < nj ? b[rows_k ? sw(k, n, b_rs) : sw(n, k, b_cs)] : 0.f;
          bv[j][1] = j < nj ? b[rows_k ? sw(k + 4, n, b_rs) : sw(n, k + 4, b_cs)] : 0.f;
        }
      } else {
        const float* bk = b0 + static_cast<int64_t>(k0) * b_rs;
        const float* bk4 = bk + static_cast<int64_t>(4) * b_rs;
#pragma unroll
        for (int j = 0; j < kNj; ++j) {
          const int64_t nn = static_cast<int64_t>(8 * j) * b_cs;
          bv[j][0] = j < nj ? bk[nn] : 0.f;
          bv[j][1] = j < nj ? bk4[nn] : 0.f;
        }
      }
    };
    auto step = [&](const float(&av)[4], const float(&bv)[kNj][2]) {
      uint32_t af[4], al[4];
      split_a(av, af, al);
#pragma unroll
      for (int j = 0; j < kNj; ++j)
        if (j < nj) mma_split<kSplit, kBTf32>(acc[j], af, al, bv[j][0], bv[j][1]);
    };
    // Step k reads set (k / 8) % kGemmStages, after the load of step k + 8 (kGemmStages - 1) into
    // the set that step k - 8 freed.
    float fa[kGemmStages][4], fb[kGemmStages][kNj][2];
#pragma unroll
    for (int s = 0; s + 1 < kGemmStages; ++s)
      if (8 * s < Kd) load(8 * s, fa[s], fb[s]);
    for (int k0 = 0; k0 < Kd; k0 += 8 * kGemmStages) {
#pragma unroll
      for (int s = 0; s < kGemmStages; ++s) {
        const int k = k0 + 8 * s, kn = k + 8 * (kGemmStages - 1);
        if (k < Kd) {
          if (kn < Kd)
            load(kn, fa[(s + kGemmStages - 1) % kGemmStages],
                 fb[(s + kGemmStages - 1) % kGemmStages]);
          step(fa[s], fb[s]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kNj; ++j) {
      if (j < nj) {
        const int n = n0 + 8 * j + 2 * c;
        epi(m0 + g, n, acc[j][0]);
        epi(m0 + g, n + 1, acc[j][1]);
        epi(m0 + g + 8, n, acc[j][2]);
        epi(m0 + g + 8, n + 1, acc[j][3]);
      }
    }
  }
}
// gemm_tf32 with kBTf32 chosen at run time: b_tf32, B's values are tf32 numbers.
template <bool kSplit, bool kSwA, bool kSwB, typename Epi>
__device__ __forceinline__ void gemm_tf32_b(bool b_tf32, int M, int N, int Kd, const float* a,
                                            int a_rs, int a_cs, const float* b, int b_rs, int b_cs,
                                            Epi&& epi) {
  if (b_tf32)
    gemm_tf32<kSplit, kSwA, kSwB, 4, true>(M, N, Kd, a, a_rs, a_cs, b, b_rs, b_cs, epi);
  else
    gemm_tf32<kSplit, kSwA, kSwB, 4, false>(M, N, Kd, a, a_rs, a_cs, b, b_rs, b_cs, epi);
}

// Per-token preprocessing (spec section 2) of a chunk's tokens for value head hv, into shared
// memory: qh, kh [64][kLd] (l2norm; q scaled), G [64][kLd] the cumulative log decay from the
// chunk's start, bv[64] the activated beta. Rows t >= L: qh = kh = 0, bv = 0, G = G_{L-1}.
// One warp per token row, four channels per lane; a warp's loads of kRows rows issued together
// (kRows = 4 with 512 threads: every row of the chunk in one round). kLd: the row stride, kD or
// kD + 4 (the padded stride keeps a warp's tf32 fragment loads from the tiles on 32 banks).
template <int kLd = kD, int kRows = 2>
__device__ __forceinline__ void load_chunk(const Params& p, const ChunkTask& c, int hv, float* qh,
                                           float* kh, float* G, float* bv) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = static_cast<int>(blockDim.x >> 5);
  const int h = hv / p.groups;
  for (int t0 = warp; t0 < kC; t0 += kRows * nwarps) {
    uint32_t bq[kRows][4], bk[kRows][4], bg[kRows][4], bb[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int t = t0 + r * nwarps;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = lane + 32 * e;
        bq[r][e] = token_bits(p.q, c, t, h, i);
        bk[r][e] = token_bits(p.k, c, t, h, i);
        bg[r][e] = token_bits(p.g, c, t, hv, i);
      }
      bb[r] = token_bits(p.beta, c, t, hv, 0);
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int t = t0 + r * nwarps;
      if (t >= kC) break;
      const bool live = t < c.L;
      float xq[4], xk[4], xg[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        xq[e] = token_value(bq[r][e], p.q, live);
        xk[e] = token_value(bk[r][e], p.k, live);
        xg[e] = token_value(bg[r][e], p.g, live);
      }
      float sq = 0.f, sk = 0.f;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = lane + 32 * e;
        sq += xq[e] * xq[e];
        sk += xk[e] * xk[e];
        G[t * kLd + i] = xg[e];  // the raw gate input (0 where dead); its log decay below
      }
      sq = warp_sum(sq);
      sk = warp_sum(sk);
      const float fq =
          p.use_qk_l2norm ? p.scale / sqrtf(sq + static_cast<float>(detail::kL2NormEps)) : p.scale;
      const float fk =
          p.use_qk_l2norm ? 1.f / sqrtf(sk + static_cast<float>(detail::kL2NormEps)) : 1.f;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        qh[t * kLd + lane + 32 * e] = xq[e] * fq;
        kh[t * kLd + lane + 32 * e] = xk[e] * fk;
      }
      if (lane == 0)
        bv[t] = live ? detail::activate_beta<float>(p.beta_logits, p.allow_neg_eigval,
                                                    bits_to_f32(bb[r], p.beta.dtype))
                     : 0.f;
    }
  }
  __syncthreads();
  // The log decay of each live token's gate input (one inlined copy of the gate forms: the
  // loop is rolled, as code size, not latency, bounds this phase), and its cumulative sum per
  // channel in token order, in blockDim / 128 groups of consecutive tokens: each group's running
  // sum, then the totals of the groups before it added.
  const int groups = static_cast<int>(blockDim.x) / kD;
  const int i = static_cast<int>(threadIdx.x) % kD, grp = static_cast<int>(threadIdx.x) / kD;
  const int per = kC / groups, first = grp * per;
  float off = 0.f;
  if (grp < groups) {
    const float expA = p.A_log != nullptr ? expf(p.A_log[hv * p.A_log_s]) : 1.f;
    const float bias = p.dt_bias != nullptr ? p.dt_bias[hv * p.dt_bias_s + i] : 0.f;
    float run = 0.f;
#pragma unroll 1
    for (int t = first; t < first + per; ++t) {
      if (t < c.L)
        run += detail::log_decay<float>(p.gate, G[t * kLd + i], expA, bias, p.lower_bound);
      G[t * kLd + i] = run;
    }
  }
  __syncthreads();
  if (grp < groups)
    for (int q = 0; q < grp; ++q) off += G[(q * per + per - 1) * kLd + i];
  __syncthreads();
  if (grp > 0 && grp < groups)
    for (int t = first; t < first + per; ++t) G[t * kLd + i] += off;
  __syncthreads();
}

// ---------------------------------------------------------------------------------------------
// 1. Records
// ---------------------------------------------------------------------------------------------

template <bool kSplit>
__global__ void __launch_bounds__(kPrepThreads, 1)
    bwd_prepare_kernel(const __grid_constant__ BwdParams P) {
  pdl_prologue();
  extern __shared__ __align__(128) uint8_t smem[];
  const Params& p = P.f;
  float* qh = reinterpret_cast<float*>(smem);  // [64][kPrepLd] (load_chunk)
  float* kh = qh + kC * kPrepLd;
  float* G = kh + kC * kPrepLd;
  float* Akk = G + kC * kPrepLd;  // [64][64]
  float* X = Akk + kC * kC;       // [64][64], swizzled (sw)
  float* T = X + kC * kC;         // [3][16][16] the inversion's block sums
  float* bv = T + 3 * 256;        // [64]
  uint8_t* tiles = align1024(reinterpret_cast<uint8_t*>(bv + kC));  // Kb^T, Vb^T (kPrepKbT ..)

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, cq = lane & 3;
  const int hv = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.HV));
  const int64_t slot = blockIdx.x / static_cast<unsigned>(p.HV);
  const ChunkTask c = chunk_task(p, slot);
  if (!c.valid) return;
  float* rec = P.rec + (slot * p.HV + hv) * static_cast<int64_t>(kRecFloats);

  prefetch_rows(p, c, hv, nullptr);  // for load_chunk and v
  load_chunk<kPrepLd, 4>(p, c, hv, qh, kh, G, bv);

  const float* GL = G + (kC - 1) * kPrepLd;  // rows >= L repeat G_{L-1}
  // Zeros of Aqk above the diagonal and of Akk at and above it, outside the diagonal pairs below.
  for (int e = tid; e < kC * kC; e += kPrepThreads) {
    const int t = e / kC, s = e % kC;
    if (s / 16 > t / 16 || (s / 16 == t / 16 && s > t)) {
      rec[kRecAqk + e] = 0.f;
      Akk[e] = 0.f;
    }
  }

  // Off the diagonal blocks, Aqk and Akk of row block J (rows r .. r + 15, columns s < r): the
  // products of exp(G_t - G_r) q^_t, k^_t and exp(G_r - G_s) k^_s (both factors <= 1), their
  // fragments formed from the tiles as they are read. A warp per (J, 8 columns): 12 units on
  // warps 0..11. The diagonal blocks per element, exp(G_t - G_s) (s <= t): four (t, s) pairs of
  // a block at once per warp, lanes over keys, on every warp.
  if (warp < 12) {
    const int J = warp < 2 ? 1 : warp < 6 ? 2 : 3;
    const int r = 16 * J, n0 = 8 * (warp - (J == 1 ? 0 : J == 2 ? 2 : 6)), s = n0 + g;
    const float* Gr = G + r * kPrepLd;
    float aq[4] = {0.f, 0.f, 0.f, 0.f}, ak[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 2
    for (int k0 = 0; k0 < kD; k0 += 8) {
      float fq[4], fk[4];
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const int t = r + g + 8 * (x & 1), i = k0 + cq + 4 * (x >> 1), f = t * kPrepLd + i;
        const float E = expf(G[f] - Gr[i]);
        fq[x] = qh[f] * E;
        fk[x] = kh[f] * E;
      }
      const int i0 = k0 + cq, i1 = i0 + 4;
      const float b0 = kh[s * kPrepLd + i0] * expf(Gr[i0] - G[s * kPrepLd + i0]);
      const float b1 = kh[s * kPrepLd + i1] * expf(Gr[i1] - G[s * kPrepLd + i1]);
      uint32_t ah[4], al[4];
      split_a(fq, ah, al);
      mma_split<kSplit>(aq, ah, al, b0, b1);
      split_a(fk, ah, al);
      mma_split<kSplit>(ak, ah, al, b0, b1);
    }
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const int e = (r + g + 8 * (x >> 1)) * kC + n0 + 2 * cq + (x & 1);
      rec[kRecAqk + e] = aq[x];
      Akk[e] = ak[x];
    }
  }
  // The diagonal blocks: a warp per row t (rows w, 31 - w, 32 + w, 63 - w: 34 pairs a warp),
  // lanes over keys, the row's pairs (t, s <= t) of its block with the row's q^, k^, G loaded
  // once; their Aqk and Akk sums reduced over the warp together (warp_sum32).
  static_assert(kPrepThreads / 32 == 16, "four rows a warp");
#pragma unroll 1
  for (int rr = 0; rr < 4; ++rr) {
    const int t = rr == 0 ? warp : rr == 1 ? 31 - warp : rr == 2 ? 32 + warp : 63 - warp;
    const int r = t & ~15, tt = t & 15;
    float qt[4], kt[4], gt[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int f = t * kPrepLd + lane + 32 * e;
      qt[e] = qh[f];
      kt[e] = kh[f];
      gt[e] = G[f];
    }
    float v[32];
#pragma unroll
    for (int ss = 0; ss < 16; ++ss) {
      float a = 0.f, b = 0.f;
      if (ss <= tt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int f = (r + ss) * kPrepLd + lane + 32 * e;
          const float x = expf(gt[e] - G[f]) * kh[f];
          a += qt[e] * x;
          b += kt[e] * x;
        }
      }
      v[2 * ss] = a;
      v[2 * ss + 1] = b;
    }
    warp_sum32(v);
    const int ss = lane >> 1, s = r + ss;
    if (ss <= tt) {
      if (lane & 1)
        Akk[t * kC + s] = ss < tt ? v[0] : 0.f;
      else
        rec[kRecAqk + t * kC + s] = v[0];
    }
  }
  __syncthreads();

  // X = (I + M)^-1, M = diag(b) Akk strictly lower triangular, by 16 x 16 blocks (fp32 FMA):
  // the diagonal blocks X_II = (I + M_II)^-1 by forward substitution (a warp per block, a lane per
  // column: X[t][j] = -b_t sum_{s < t} Akk[t][s] X[s][j], in s order), then by distance d = J - I
  // the blocks below, X_JI = -X_JJ diag(b_J) sum_{I <= L < J} Akk_JL X_LI: three levels, two
  // barriers each.
  if (warp < 4 && lane < 16) {
    const int o = 16 * warp, j = lane;
    float x[16];
#pragma unroll
    for (int t = 0; t < 16; ++t) {
      float sum = 0.f;
#pragma unroll
      for (int s2 = 0; s2 < t; ++s2) sum += Akk[(o + t) * kC + o + s2] * x[s2];
      x[t] = t == j ? 1.f : t > j ? -bv[o + t] * sum : 0.f;
    }
#pragma unroll
    for (int t = 0; t < 16; ++t) X[sw(o + t, o + j, kC)] = x[t];
  } else if (warp >= 4) {
    // Meanwhile, on the other 12 warps: zeros above X's diagonal blocks; Kb = b exp(G) k^ and
    // Vb = b v as the B tiles Kb^T, Vb^T of W and Ut (bf16 hi + lo; tile_store's units: a key and
    // 8 tokens, up to three a thread, the loads of v issued first); the record's exp(G) q^,
    // exp(G_L - G) k^ and exp(G_L).
    constexpr int kT = kPrepThreads - 128, kUnits = kD * kC / 8, kPer = (kUnits + kT - 1) / kT;
    const int st = tid - 128;
    for (int e = st; e < kC * kC; e += kT) {
      const int t = e / kC, s2 = e % kC;
      if (s2 / 16 > t / 16) X[sw(t, s2, kC)] = 0.f;
    }
    uint32_t xv[kPer][8];
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int unit = st + u * kT, n = unit % kD, t0 = 8 * (unit / kD);  // past the end: t >= L
#pragma unroll
      for (int l = 0; l < 8; ++l) xv[u][l] = token_bits(p.v, c, t0 + l, hv, n);
    }
    float xk[kPer][8], xb[kPer][8];
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int unit = st + u * kT, n = unit % kD, t0 = 8 * (unit / kD);
      if (unit >= kUnits) break;
#pragma unroll
      for (int l = 0; l < 8; ++l) {
        const int t = t0 + l, f = t * kPrepLd + n, e = t * kD + n;
        const float eg = expf(G[f]);
        xk[u][l] = bv[t] * eg * kh[f];
        rec[kRecQg + e] = eg * qh[f];
        rec[kRecKd + e] = expf(GL[n] - G[f]) * kh[f];
        xb[u][l] = bv[t] * token_value(xv[u][l], p.v, t < c.L);
      }
    }
    tile_store<kD, kC, false, kPer>(xk, tiles + kPrepKbT, st, kT);
    tile_store<kD, kC, false, kPer>(xb, tiles + kPrepVbT, st, kT);
    fence_proxy_async();  // the tiles, for the wgmma after the barriers below
    for (int i = st; i < kD; i += kT) rec[kRecGL + i] = expf(GL[i]);
  }
  __syncthreads();
  for (int d = 1; d < 4; ++d) {
    const int pairs = 4 - d;  // (J, I) = (I + d, I), I = 0 .. pairs - 1
    for (int e = tid; e < pairs * 256; e += kPrepThreads) {
      const int I = e / 256, u = (e / 16) % 16, j = e % 16, J = I + d;
      float sum = 0.f;
      for (int L = I; L < J; ++L)
#pragma unroll
        for (int s2 = 0; s2 < 16; ++s2)
          sum += Akk[(16 * J + u) * kC + 16 * L + s2] * X[sw(16 * L + s2, 16 * I + j, kC)];
      T[e] = bv[16 * J + u] * sum;
    }
    __syncthreads();
    for (int e = tid; e < pairs * 256; e += kPrepThreads) {
      const int I = e / 256, t = (e / 16) % 16, j = e % 16, J = I + d;
      float sum = 0.f;
#pragma unroll
      for (int u = 0; u < 16; ++u)
        sum += X[sw(16 * J + t, 16 * J + u, kC)] * T[I * 256 + u * 16 + j];
      X[sw(16 * J + t, 16 * I + j, kC)] = -sum;
    }
    __syncthreads();
  }

  // W = X (b exp(G) k^), Ut = X (b v) on wgmma, three bf16 terms (wg_product: ~fp32 products,
  // whatever kSplit says): warpgroup 0 W, warpgroup 1 Ut (M: 64 tokens, N: 128 keys / values,
  // K: 64 tokens), A = X from shared memory; warpgroups 2 and 3 write Akk and X meanwhile.
  if (tid < 2 * 128) {
    const int wgi = tid >> 7;
    float acc[16][4];
    wg_product_of<16, 1, 4>([&](int m, int k) { return X[sw(m, k, kC)]; }, acc,
                            wgmma_desc_lo(smem_addr(tiles)), wgi == 0 ? kPrepKbT : kPrepVbT, kD,
                            kC);
    float* out = rec + (wgi == 0 ? kRecW : kRecUt);
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) out[acc_row(e) * kD + acc_col(j, e)] = acc[j][e];
  } else {
    for (int e = tid - 2 * 128; e < kC * kC; e += kPrepThreads - 2 * 128) {
      rec[kRecAkk + e] = Akk[e];
      rec[kRecX + e] = X[sw(e / kC, e % kC, kC)];
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 2, 3. The state passes (one block per sequence, value head and 32 value columns)
// ---------------------------------------------------------------------------------------------

// Starts the copy of `floats` floats (a multiple of 4, 16-byte aligned both sides) global ->
// shared, into a swizzled tile of row stride R (see gemm_tf32; a single row, floats == R, lands
// unpermuted): one 16-byte cp.async per unit, all of a thread's in flight at once (a memory
// latency per copy, not per unit). Complete for the block after cp_async_wait_all() and a
// barrier.
__device__ __forceinline__ void copy_in(float* dst, const float* src, int floats, int R) {
  for (int e = 4 * static_cast<int>(threadIdx.x); e < floats; e += 4 * static_cast<int>(blockDim.x))
    cp_async_16(smem_addr(dst + sw(e / R, e % R, R)), src + e);
}

struct PassTask {
  int64_t n;
  int hv, j0;
  SeqSpan sp;
  int64_t chunks;
};
// The block's (sequence, value head, kCols value columns).
template <int kCols = kSlice>
__device__ __forceinline__ PassTask pass_task(const Params& p) {
  constexpr int kCount = kD / kCols;
  PassTask t;
  const int64_t x = blockIdx.x;
  t.j0 = static_cast<int>(x % kCount) * kCols;
  t.hv = static_cast<int>((x / kCount) % p.HV);
  t.n = x / kCount / p.HV;
  t.sp = pf::seq_span(p, t.n);
  t.chunks = (t.sp.len + kC - 1) / kC;
  return t;
}

// The pass block's state slice (all keys, its kSlice values) of a state tensor into the swizzled
// tile dst, zero where the tensor is absent: a thread's loads issued as a batch before their
// conversions.
__device__ __forceinline__ void load_state_slice(float* dst, const StateView& s, bool kfirst,
                                                 const PassTask& t) {
  constexpr int kBatch = 8, kN = kD * kSlice;
  const int n = static_cast<int>(blockDim.x);
  for (int e0 = static_cast<int>(threadIdx.x); e0 < kN; e0 += kBatch * n) {
    uint32_t b[kBatch] = {};
    if (s.data != nullptr)
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int e = e0 + u * n;
        if (e < kN)
          b[u] = load_bits_any(s.data, s.dtype,
                               state_off(s, kfirst, t.n, t.hv, e / kSlice, t.j0 + e % kSlice));
      }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = e0 + u * n;
      if (e < kN)
        dst[sw(e / kSlice, e % kSlice, kSlice)] =
            s.data != nullptr ? bits_to_f32(b[u], s.dtype) : 0.f;
    }
  }
}

// L2 prefetches of what a pass step reads from device memory at chunk ch (a hint; nothing past the
// sequence): the states pass, W and Ut (adjacent), Kd, exp(G_L); the reverse pass, Qg, Kd, Aqk
// (adjacent), W, exp(G_L) and the chunk's rows of dO (kCols columns from t.j0; a thread per row:
// the lanes of warps 1 and 2).
__device__ __forceinline__ void prefetch_states_step(const BwdParams& P, const PassTask& t,
                                                     int64_t ch) {
  if (ch >= t.chunks) return;
  const float* rec = P.rec + ((t.sp.base + ch) * P.f.HV + t.hv) * kRecFloats;
  prefetch_floats(rec + kRecW, 2 * kTile, 0);
  prefetch_floats(rec + kRecKd, kTile, 2);
  prefetch_floats(rec + kRecGL, kD, 3);
}
template <int kCols>
__device__ __forceinline__ void prefetch_dstates_step(const BwdParams& P, const PassTask& t,
                                                      int64_t ch) {
  if (ch < 0) return;
  const float* rec = P.rec + ((t.sp.base + ch) * P.f.HV + t.hv) * kRecFloats;
  prefetch_floats(rec + kRecQg, 2 * kTile + kC * kC, 0);
  prefetch_floats(rec + kRecW, kTile, 3);
  prefetch_floats(rec + kRecGL, kD, 4);
  const int r = static_cast<int>(threadIdx.x) - 32;
  if (P.d_out.data != nullptr && r >= 0 && r < kC && ch * kC + r < t.sp.len) {
    const int esize = P.d_out.dtype == kF32 ? 4 : 2;
    const uint8_t* row = static_cast<const uint8_t*>(P.d_out.data) +
                         (P.d_out.offset(t.sp.b, t.sp.bos + ch * kC + r, t.hv) + t.j0) * esize;
    prefetch_lines(row, kCols * esize);
  }
}

// Both passes: two blocks per SM fit in shared memory (2 x (112.5 + 1) KB of 228 KB), hence the
// launch bound's minimum of 2, which gives ptxas up to 255 registers (with the maximum alone it
// spilled at 72). Each step starts its record copies into shared memory as cp.async (all in
// flight at once) from L2, where the prefetch kPassPrefetch steps earlier put them.

// S at every chunk start: S <- diag(exp(G_L)) S + Kd^T (Ut - W S).
template <bool kSplit>
__global__ void __launch_bounds__(kPassThreads, 2)
    bwd_states_kernel(const __grid_constant__ BwdParams P) {
  pdl_prologue();
  extern __shared__ __align__(128) uint8_t smem[];
  const Params& p = P.f;
  // Swizzled tiles (gemm_tf32): S, Ws, Kds, U.
  float* S = reinterpret_cast<float*>(smem);  // [128][32]
  float* Ws = S + kD * kSlice;                // [64][128]
  float* Kds = Ws + kTile;                    // [64][128]
  float* U = Kds + kTile + kC * kC;           // [64][32]
  float* gl = U + 2 * kC * kSlice;            // [128]
  const PassTask t = pass_task(p);
  const int tid = threadIdx.x;
  for (int ch = 0; ch < kPassPrefetch; ++ch) prefetch_states_step(P, t, ch);
  load_state_slice(S, p.initial_state, p.kfirst, t);
  for (int64_t ch = 0; ch < t.chunks; ++ch) {
    const int64_t rs = (t.sp.base + ch) * p.HV + t.hv;
    const float* rec = P.rec + rs * kRecFloats;
    float* out = P.states + rs * kStateFloats;
    prefetch_states_step(P, t, ch + kPassPrefetch);  // into L2 while the steps before it compute
    __syncthreads();
    copy_in(Ws, rec + kRecW, kTile, kD);
    copy_in(Kds, rec + kRecKd, kTile, kD);
    copy_in(gl, rec + kRecGL, kD, kD);
    for (int e = tid; e < kD * kSlice; e += kPassThreads)
      out[(e / kSlice) * kD + t.j0 + e % kSlice] = S[sw(e / kSlice, e % kSlice, kSlice)];
    cp_async_wait_all();
    __syncthreads();
    gemm_tf32<kSplit, true, true>(
        kC, kSlice, kD, Ws, kD, 1, S, kSlice, 1,
        [&](int m, int n, float v) { U[sw(m, n, kSlice)] = rec[kRecUt + m * kD + t.j0 + n] - v; });
    __syncthreads();
    // Row scaling: the swizzle permutes within rows, so e / kSlice is still e's row.
    for (int e = tid; e < kD * kSlice; e += kPassThreads) S[e] *= gl[e / kSlice];
    __syncthreads();
    gemm_tf32<kSplit, true, true>(kD, kSlice, kC, Kds, 1, kD, U, kSlice, 1,
                                  [&](int m, int n, float v) { S[sw(m, n, kSlice)] += v; });
  }
}

// dS' of every chunk (stored before the chunk is reversed) and d_initial_state.
template <bool kSplit>
__global__ void __launch_bounds__(kPassThreads, 2)
    bwd_dstates_kernel(const __grid_constant__ BwdParams P) {
  pdl_prologue();
  extern __shared__ __align__(128) uint8_t smem[];
  const Params& p = P.f;
  // Swizzled tiles (gemm_tf32): all of them.
  float* D = reinterpret_cast<float*>(smem);  // [128][32]
  float* Qgs = D + kD * kSlice;               // [64][128]
  float* Kds = Qgs + kTile;                   // [64][128]
  float* Aqks = Kds + kTile;                  // [64][64]
  float* dO = Aqks + kC * kC;                 // [64][32]
  float* dU = dO + kC * kSlice;               // [64][32]
  float* gl = dU + kC * kSlice;               // [128]
  const PassTask t = pass_task(p);
  const int tid = threadIdx.x;
  const StateView& df = P.d_final_state;
  // dO's values are tf32 numbers unless it is fp32 (absent: zeros).
  const bool do_tf32 = P.d_out.data == nullptr || P.d_out.dtype != kF32;
  for (int ch = 0; ch < kPassPrefetch; ++ch) prefetch_dstates_step<kSlice>(P, t, t.chunks - 1 - ch);
  load_state_slice(D, df, p.kfirst, t);
  for (int64_t ch = t.chunks - 1; ch >= 0; --ch) {
    const int64_t rs = (t.sp.base + ch) * p.HV + t.hv;
    const float* rec = P.rec + rs * kRecFloats;
    float* out = P.dstates + rs * kStateFloats;
    const int64_t tok0 = t.sp.bos + ch * kC;
    const int64_t L = t.sp.len - ch * kC < kC ? t.sp.len - ch * kC : kC;
    prefetch_dstates_step<kSlice>(P, t, ch - kPassPrefetch);  // while the steps before it compute
    __syncthreads();
    copy_in(Qgs, rec + kRecQg, kTile, kD);
    copy_in(Kds, rec + kRecKd, kTile, kD);
    copy_in(Aqks, rec + kRecAqk, kC * kC, kC);
    copy_in(gl, rec + kRecGL, kD, kD);
    for (int e = tid; e < kD * kSlice; e += kPassThreads)
      out[(e / kSlice) * kD + t.j0 + e % kSlice] = D[sw(e / kSlice, e % kSlice, kSlice)];
    // dO: a thread's loads all issued before its stores.
    constexpr int kPer = kC * kSlice / kPassThreads;
    uint32_t x[kPer] = {};
    if (P.d_out.data != nullptr) {  // rows r >= L read row 0 (token_bits), stored as zero
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        const int e = tid + u * kPassThreads, r = e / kSlice, j = t.j0 + e % kSlice;
        x[u] = load_bits_any(P.d_out.data, P.d_out.dtype,
                             P.d_out.offset(t.sp.b, tok0 + (r < L ? r : 0), t.hv) + j);
      }
    }
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int e = tid + u * kPassThreads;
      dO[sw(e / kSlice, e % kSlice, kSlice)] =
          P.d_out.data != nullptr && e / kSlice < L ? bits_to_f32(x[u], P.d_out.dtype) : 0.f;
    }
    cp_async_wait_all();
    __syncthreads();
    // dU = Aqk^T dO + Kd dS'
    gemm_tf32_b<kSplit, true, true>(do_tf32, kC, kSlice, kC, Aqks, 1, kC, dO, kSlice, 1,
                                    [&](int m, int n, float v) { dU[sw(m, n, kSlice)] = v; });
    gemm_tf32<kSplit, true, true>(kC, kSlice, kD, Kds, kD, 1, D, kSlice, 1,
                                  [&](int m, int n, float v) { dU[sw(m, n, kSlice)] += v; });
    __syncthreads();
    // Kd is no longer read: W into its tile (from L2, where the step's prefetch put it) while
    // Qg^T dO runs.
    float* Ws = Kds;
    copy_in(Ws, rec + kRecW, kTile, kD);
    // dS = diag(exp(G_L)) dS' + Qg^T dO - W^T dU
    // Row scaling: the swizzle permutes within rows, so e / kSlice is still e's row.
    for (int e = tid; e < kD * kSlice; e += kPassThreads) D[e] *= gl[e / kSlice];
    __syncthreads();
    gemm_tf32_b<kSplit, true, true>(do_tf32, kD, kSlice, kC, Qgs, 1, kD, dO, kSlice, 1,
                                    [&](int m, int n, float v) { D[sw(m, n, kSlice)] += v; });
    cp_async_wait_all();
    __syncthreads();
    gemm_tf32<kSplit, true, true>(kD, kSlice, kC, Ws, 1, kD, dU, kSlice, 1,
                                  [&](int m, int n, float v) { D[sw(m, n, kSlice)] -= v; });
  }
  __syncthreads();
  const StateView& di = P.d_initial_state;
  if (di.data != nullptr)
    for (int e = tid; e < kD * kSlice; e += kPassThreads) {
      const int i = e / kSlice, j = t.j0 + e % kSlice;
      store_any(di.data, di.dtype, state_off(di, p.kfirst, t.n, t.hv, i, j),
                D[sw(i, e % kSlice, kSlice)]);
    }
}

// ---------------------------------------------------------------------------------------------
// 4. The chunk gradients
// ---------------------------------------------------------------------------------------------

// A fragments (tf32 hi and lo terms) of a warp's m16 k8 step from the swizzled 64 x 64 tiles dAqk
// and dAkk: rows m0 + g (+ 8), columns k0 + c (+ 4) of A = dA, or kT: A(m, k) = dA[k][m].
template <bool kT>
__device__ __forceinline__ void da_fragments(const float* dAqk, const float* dAkk, int m0, int k0,
                                             uint32_t (&qhi)[4], uint32_t (&qlo)[4],
                                             uint32_t (&khi)[4], uint32_t (&klo)[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  float fq[4], fk[4];
#pragma unroll
  for (int x = 0; x < 4; ++x) {
    const int m = m0 + g + 8 * (x & 1), k = k0 + c + 4 * (x >> 1);
    const int at = kT ? sw(k, m, kC) : sw(m, k, kC);
    fq[x] = dAqk[at];
    fk[x] = dAkk[at];
  }
  split_a(fq, qhi, qlo);
  split_a(fk, khi, klo);
}

// dX = dW Kb^T + dU Vb^T (64 x 64; K = 128 keys, 128 values) on wgmma, three bf16 terms
// (wg_product): warpgroup w takes one K half of one product (dW keys 0..63, 64..127, then dU's
// values), A = its 64 x 64 slice of dW or dU from device memory, B = the matching K half of the
// Kb or Vb tile at bt (hi + lo, rows 64 tokens s, K 128; [K block][rows][128 B]). The four
// partial products go over the tiles (swizzled, sw), then dX = ((P0 + P1) + P2) + P3 into the
// swizzled dX. Called by all threads; ends with a barrier.
__device__ __noinline__ void dx_wgmma(const float* dW, const float* dU, uint8_t* bt, float* dX) {
  const int tid = threadIdx.x, w = tid >> 7, half = w & 1;
  const float* A = (w < 2 ? dW : dU) + 64 * half;
  const int off = (w < 2 ? 0 : 2 * wg_tile_bytes(kC, kD)) + half * kC * 128;
  float acc[8][4];
  wg_product_of<8, 1, 4>([&](int m, int k) { return A[m * kD + k]; }, acc,
                         wgmma_desc_lo(smem_addr(bt)), off, kC, kD);
  __syncthreads();  // every warpgroup's wgmma done reading the tiles
  float* part = reinterpret_cast<float*>(bt) + w * kC * kC;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) part[sw(acc_row(e), acc_col(j, e), kC)] = acc[j][e];
  __syncthreads();
  const float* p0 = reinterpret_cast<const float*>(bt);
  for (int e = tid; e < kC * kC; e += kChunkThreads)
    dX[e] = ((p0[e] + p0[kC * kC + e]) + p0[2 * kC * kC + e]) + p0[3 * kC * kC + e];
  __syncthreads();
}

// Local derivatives of the gate (spec section 2) at one element: da/dg and da/dA_log.
__device__ __forceinline__ void gate_derivatives(const Params& p, float graw, float expA,
                                                 float bias, float* dadg, float* dadA) {
  const float x = graw + bias;
  if (p.gate == detail::kGateSoftplus) {
    const float sp = detail::softplus<float>(x);
    const float sg = x > 20.f ? 1.f : detail::sigmoid<float>(x);
    *dadg = -expA * sg;
    *dadA = -expA * sp;
  } else if (p.gate == detail::kGateLowerBound) {
    const float z = expA * x;
    const float s = detail::sigmoid<float>(z);
    const float dz = p.lower_bound * s * (1.f - s);
    *dadg = expA * dz;
    *dadA = dz * z;
  } else {
    *dadg = 1.f;
    *dadA = 0.f;
  }
}

// T1 = dX X^T, then dM = -X^T T1 (64 x 64 x 64 each) on wgmma, three bf16 terms (wg_product), on
// warpgroup 0: X (device memory, row-major) as T1's B tile at bt, T1 stored transposed as dM's
// B tile after it; A = dX (swizzled, sw) and X^T from its swizzled copy Xs. dM (swizzled) may be
// dX's storage. Called by all threads; ends with a barrier.
__device__ __noinline__ void t1_dm_wgmma(const float* Xg, const float* dX, const float* Xs,
                                         uint8_t* bt, float* dM) {
  const int tid = threadIdx.x;
  constexpr int kT1T = 2 * wg_tile_bytes(kC, kC);
  stage_tile<kC, kC, true>(bt, Xg, kC, 1);
  fence_proxy_async();
  __syncthreads();
  const uint32_t dlo = wgmma_desc_lo(smem_addr(bt));
  if (tid < 128) {
    float acc[8][4];
    wg_product_of<8, 1, 4>([&](int m, int k) { return dX[sw(m, k, kC)]; }, acc, dlo, 0, kC, kC);
    store_tile<kC, kC, true>(acc, bt + kT1T, 0);  // T1^T: rows u, K s
    fence_proxy_async();
  }
  __syncthreads();
  if (tid < 128) {
    float acc[8][4];  // A = X^T
    wg_product_of<8, -1, 4>([&](int m, int k) { return Xs[sw(k, m, kC)]; }, acc, dlo, kT1T, kC, kC);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) dM[sw(acc_row(e), acc_col(j, e), kC)] = acc[j][e];
  }
  __syncthreads();
}

// dq (is_q) or dk of one token from the gradient d of its q^ / k^ row (a warp: lane's elements
// lane + 32 e) and the input row x: the scale and the l2norm chained, stored at `off` of `out`.
__device__ __forceinline__ void qk_chain_store(const Params& p, bool is_q, const float (&x)[4],
                                               float (&d)[4], const StridedView& out, int64_t off) {
  const int lane = threadIdx.x & 31;
  float ss = 0.f;
#pragma unroll
  for (int e = 0; e < 4; ++e) ss += x[e] * x[e];
  ss = warp_sum(ss);
  const float sc = is_q ? p.scale : 1.f;
  if (p.use_qk_l2norm) {
    const float r = sqrtf(ss + static_cast<float>(detail::kL2NormEps)), ir = 1.f / r;
    float dot = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) dot += x[e] * ir * d[e] * sc;
    dot = warp_sum(dot);
#pragma unroll
    for (int e = 0; e < 4; ++e) d[e] = (d[e] * sc - x[e] * ir * dot) * ir;
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) d[e] *= sc;
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) store_any(out.data, out.dtype, off + lane + 32 * e, d[e]);
}

// Element (t, n) of bwd_chunk_kernel's [64][128] dq^ / dk^ tiles: columns permuted by the row so
// that the mma fragment layout's accesses (rows g, columns 2 c (+ 1) of a warp) fall on distinct
// banks but for pairs, and a warp's accesses along a row on 32.
__device__ __forceinline__ int ti(int t, int n) { return t * kD + (n ^ ((t & 7) << 2)); }

// Hands a warp's mma-layout terms (16 x 32 block: rows g + 8 (x >> 1), columns 8 j + 2 c + (x &
// 1); term(j, x) computes each once) to the lanes that own them by column (lane n, a register per
// row): dg[row] += kSign * term, eight rows at a time through the warp's staging rows `st`.
template <int kSign, typename Term>
__device__ __forceinline__ void stage_dg(Term&& term, float* st, float (&dg)[16]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    __syncwarp();
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int b = 0; b < 2; ++b) st[g * kStgLd + 8 * j + 2 * c + b] = term(j, 2 * h + b);
    __syncwarp();
#pragma unroll
    for (int l = 0; l < 8; ++l) {
      const float v = st[l * kStgLd + lane];
      if constexpr (kSign > 0)
        dg[8 * h + l] += v;
      else
        dg[8 * h + l] -= v;
    }
  }
}

// kWg: bwd_sprod_kernel ran (BwdParams::wg); dU, dW, dQg, dKd, dAqk, dKb, dVb and exp(G_L) *
// rowsum(S * dS') are read, not computed.
template <bool kSplit, bool kWg>
__global__ void __launch_bounds__(kChunkThreads, 1)
    bwd_chunk_kernel(const __grid_constant__ BwdParams P) {
  pdl_prologue();
  extern __shared__ __align__(128) uint8_t smem[];
  const Params& p = P.f;
  // q^, k^, G [64][kChunkLd] (padded rows: the intra-chunk products form their tf32 fragments
  // from them as they are read); then the intra-chunk phases' dq^ tile (ti).
  float* qh = reinterpret_cast<float*>(smem);
  float* kh = qh + kC * kChunkLd;
  float* G = kh + kC * kChunkLd;
  float* dqt = G + kC * kChunkLd;
  // Swizzled 64 x 64 tiles (sw): Xs, T1, dAqk, dAkk; Xs and T1 together are the intra-chunk
  // phases' dk^ tile (ti). Until dX is complete, dqt .. T1 hold dX's B tiles (bt: Kb, Vb as bf16
  // hi + lo, rows 64 tokens, K 128 keys / values), then its four partial products (dx_wgmma).
  float* Xs = dqt + kC * kChunkLd;  // [64][64]: X
  float* T1 = Xs + kC * kC;         // [64][64]
  float* dkt = Xs;
  uint8_t* bt = align1024(reinterpret_cast<uint8_t*>(dqt));
  static_assert(kC * kChunkLd * 4 + 2 * kC * kC * 4 >= 4 * wg_tile_bytes(kC, kD) + 1008,
                "dX's B tiles between dqt and the end of T1");
  static_assert(4 * wg_tile_bytes(kC, kC) + 1008 <= kC * kChunkLd * 4,
                "t1_dm_wgmma's tiles between dqt and Xs");
  float* dAqk = T1 + kC * kC;    // [64][64]
  float* dAkk = dAqk + kC * kC;  // [64][64]: dX first, then dM, then dAkk
  float* dX = dAkk;
  float* dgl = dAkk + kC * kC;               // [128] exp(G_L) * rowsum(S * dS')
  float* pgl = dgl + kD;                     // [row groups][128] partial sums of Kd * dKd over t
  float* misc = pgl + kChunkRowGroups * kD;  // [128]
  float* bv = misc + kD;                     // [64]
  float* db = bv + kC;                       // [64]
  float* stg = db + kC;                      // [16 warps][kStgWarp]: stage_dg

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float* scr = P.scratch + static_cast<int64_t>(blockIdx.x) * kScratchFloats;
  float* sdO = scr;            // dO
  float* sU = sdO + kTile;     // U
  float* sdU0 = sU + kTile;    // dU
  float* sdW0 = sdU0 + kTile;  // dW
  float* sKb = sdW0 + kTile;   // dKb (!kWg)
  float* sVb = sKb + kTile;    // dVb (!kWg)

  const int64_t tasks = p.num_slots * p.HV;
  for (int64_t task = blockIdx.x; task < tasks; task += gridDim.x) {
    const int hv = static_cast<int>(task % p.HV);
    const int64_t slot = task / p.HV;
    float* part = P.part + task * kPartFloats;
    const ChunkTask c = chunk_task(p, slot);
    __syncthreads();
    if (!c.valid) {
      for (int e = tid; e < kPartFloats; e += kChunkThreads) part[e] = 0.f;
      continue;
    }
    const float* rec = P.rec + task * kRecFloats;
    const float* S = P.states + task * kStateFloats;
    const float* D = P.dstates + task * kStateFloats;
    float* dqh = P.dqk + task * (2 * kTile);  // dq^ (first dQg)
    float* dkh = dqh + kTile;                 // dk^ (first dKd)
    // dU, dW: this task's part of uw when bwd_sprod_kernel computed them, else the scratch;
    // dKb, dVb: uw, else computed into the scratch.
    float* uw = P.uw + task * static_cast<int64_t>(kUwFloats);
    float* sdU = kWg ? uw + kUwDU : sdU0;
    float* sdW = kWg ? uw + kUwDW : sdW0;
    const float* dKbp = kWg ? uw + kUwDKb : sKb;
    const float* dVbp = kWg ? uw + kUwDVb : sVb;

    // L2 prefetch of what the task reads from the workspace, about in the order of use: the
    // record's W and Ut, S, the record's Kd .. exp(G_L), dS' (272 KB, the task's own footprint).
    // W, Ut and S were prefetched by the block's previous task (below): L2 hits then. kWg: of
    // the record only Akk .. exp(G_L) (the rest was bwd_sprod_kernel's), then bwd_sprod_kernel's
    // results (uw, 145 KB: dAqk and the row sums read first, dU, dW, dKb, dVb in dX and db).
    if constexpr (kWg) {
      prefetch_floats(rec + kRecAkk, kRecFloats - kRecAkk, 0);
      prefetch_floats(uw, kUwFloats, 2);
    } else {
      prefetch_floats(rec + kRecW, 2 * kTile, 0);
      prefetch_floats(S, kStateFloats, 2);
      prefetch_floats(rec + kRecKd, kRecFloats - kRecKd, 4);
      prefetch_floats(D, kStateFloats, 7);
    }
    load_chunk<kChunkLd>(p, c, hv, qh, kh, G, bv);
    // dX's B tiles Kb = b exp(G) k^, Vb = b v (tile_store's units: a token and 8 keys, two per
    // thread) and, !kWg, dO into the scratch (kWg: its products were bwd_sprod_kernel's), a
    // thread's loads issued before its stores.
    {
      static_assert(kTile / 8 == 2 * kChunkThreads, "two tile units a thread");
      const bool has_do = !kWg && P.d_out.data != nullptr;
      uint32_t bvv[2][8], bo[2][8];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int unit = tid + u * kChunkThreads, t = unit / (kD / 8), i0 = 8 * (unit % (kD / 8));
#pragma unroll
        for (int l = 0; l < 8; ++l) {
          bvv[u][l] = token_bits(p.v, c, t, hv, i0 + l);
          bo[u][l] = has_do ? token_bits(P.d_out, c, t, hv, i0 + l) : 0u;
        }
      }
      float xk[2][8], xb[2][8];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int unit = tid + u * kChunkThreads, t = unit / (kD / 8), i0 = 8 * (unit % (kD / 8));
        const bool live = t < c.L;
        float xv[8], xo[8];
#pragma unroll
        for (int l = 0; l < 8; ++l) {
          const int f = t * kChunkLd + i0 + l;
          xv[l] = token_value(bvv[u][l], p.v, live);
          xo[l] = token_value(bo[u][l], P.d_out, has_do && live);
          xb[u][l] = bv[t] * xv[l];
          xk[u][l] = bv[t] * expf(G[f]) * kh[f];
        }
        if constexpr (!kWg) {
          float4* dd = reinterpret_cast<float4*>(sdO + t * kD + i0);
          dd[0] = make_float4(xo[0], xo[1], xo[2], xo[3]);
          dd[1] = make_float4(xo[4], xo[5], xo[6], xo[7]);
        }
      }
      tile_store<kC, kD, true, 2>(xk, bt, tid, kChunkThreads);
      tile_store<kC, kD, true, 2>(xb, bt + 2 * wg_tile_bytes(kC, kD), tid, kChunkThreads);
      fence_proxy_async();  // the tiles, for dx_wgmma after the barriers below
    }
    for (int e = tid; e < kC; e += kChunkThreads) db[e] = 0.f;
    __syncthreads();

    if constexpr (kWg) {
      // The row sums and dAqk from bwd_sprod_kernel's results: a thread's loads all issued
      // before its first shared-memory store (which the compiler may not move them above).
      constexpr int kPer = kC * kC / kChunkThreads;
      static_assert(kPer * kChunkThreads == kC * kC && kD <= kChunkThreads, "dAqk elements");
      float xq[kPer];
      const float xg = uw[kUwDgl + (tid < kD ? tid : 0)];
#pragma unroll
      for (int u = 0; u < kPer; ++u) xq[u] = uw[kUwDAqk + tid + u * kChunkThreads];
      if (tid < kD) dgl[tid] = xg;
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        const int e = tid + u * kChunkThreads, m = e / kC, n = e % kC;
        dAqk[sw(m, n, kC)] = n <= m ? xq[u] : 0.f;
      }
    } else {
      // U = Ut - W S;  dU = Aqk^T dO + Kd dS'.
      gemm_tf32<kSplit>(kC, kD, kD, rec + kRecW, kD, 1, S, kD, 1, [&](int m, int n, float v) {
        sU[m * kD + n] = rec[kRecUt + m * kD + n] - v;
      });
      gemm_tf32<kSplit>(kC, kD, kC, rec + kRecAqk, 1, kC, sdO, kD, 1,
                        [&](int m, int n, float v) { sdU[m * kD + n] = v; });
      gemm_tf32<kSplit>(kC, kD, kD, rec + kRecKd, kD, 1, D, kD, 1,
                        [&](int m, int n, float v) { sdU[m * kD + n] += v; });
      // dQg = dO S^T.
      gemm_tf32<kSplit>(kC, kD, kD, sdO, kD, 1, S, 1, kD,
                        [&](int m, int n, float v) { dqh[m * kD + n] = v; });
      // exp(G_L) * rowsum(S * dS'): a warp per 16 key rows.
      for (int i = warp; i < kD; i += kChunkThreads / 32) {
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) s += S[i * kD + lane + 32 * e] * D[i * kD + lane + 32 * e];
        s = warp_sum(s);
        if (lane == 0) dgl[i] = s * rec[kRecGL + i];
      }
    }
    __syncthreads();
    if constexpr (!kWg) {
      // dAqk = dO U^T (s <= t);  dKd = U dS'^T;  dW = -dU S^T.
      gemm_tf32<kSplit>(kC, kC, kD, sdO, kD, 1, sU, 1, kD,
                        [&](int m, int n, float v) { dAqk[sw(m, n, kC)] = n <= m ? v : 0.f; });
      gemm_tf32<kSplit>(kC, kD, kD, sU, kD, 1, D, 1, kD,
                        [&](int m, int n, float v) { dkh[m * kD + n] = v; });
      gemm_tf32<kSplit>(kC, kD, kD, sdU, kD, 1, S, 1, kD,
                        [&](int m, int n, float v) { sdW[m * kD + n] = -v; });
    }
    __syncthreads();
    // dX = dW Kb^T + dU Vb^T on wgmma (its B tiles built above, in bt).
    dx_wgmma(sdW, sdU, bt, dX);
    // X from the record into Xs (swizzled) for T1 and dM; meanwhile (!kWg) dKb = X^T dW,
    // dVb = X^T dU into the scratch.
    copy_in(Xs, rec + kRecX, kC * kC, kC);
    if constexpr (!kWg) {
      gemm_tf32<kSplit>(kC, kD, kC, rec + kRecX, 1, kC, sdW, kD, 1,
                        [&](int m, int n, float v) { sKb[m * kD + n] = v; });
      gemm_tf32<kSplit>(kC, kD, kC, rec + kRecX, 1, kC, sdU, kD, 1,
                        [&](int m, int n, float v) { sVb[m * kD + n] = v; });
    }
    cp_async_wait_all();
    __syncthreads();
    // T1 = dX X^T, dM = -X^T T1 (strictly lower part used) over dX, on wgmma.
    t1_dm_wgmma(rec + kRecX, dX, Xs, bt, dAkk);
    // Per row t (a warp each): db_t = sum_s dM Akk + sum_j dVb v + sum_i dKb exp(G) k^; then
    // dAkk = b_t dM (s < t); dv = b_t dVb. Two rows at a time, their device-memory loads (Akk,
    // dVb, v, dKb) issued before either row's stores (which the compiler may not move them above).
    static_assert(kC % (2 * (kChunkThreads / 32)) == 0, "rows per warp");
#pragma unroll 1
    for (int t0 = warp; t0 < kC; t0 += 2 * (kChunkThreads / 32)) {
      float xa[2][2], xvb[2][4], xkb[2][4];
      uint32_t xv[2][4];  // v's raw bits (token_bits)
#pragma unroll
      for (int r2 = 0; r2 < 2; ++r2) {
        const int t = t0 + r2 * (kChunkThreads / 32);
#pragma unroll
        for (int e = 0; e < 2; ++e) xa[r2][e] = rec[kRecAkk + t * kC + lane + 32 * e];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = lane + 32 * e;
          xvb[r2][e] = dVbp[t * kD + i];
          xv[r2][e] = token_bits(p.v, c, t, hv, i);
          xkb[r2][e] = dKbp[t * kD + i];
        }
      }
#pragma unroll
      for (int r2 = 0; r2 < 2; ++r2) {
        const int t = t0 + r2 * (kChunkThreads / 32);
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int u = lane + 32 * e;
          s += u < t ? dAkk[sw(t, u, kC)] * xa[r2][e] : 0.f;
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = lane + 32 * e;
          s += xvb[r2][e] * token_value(xv[r2][e], p.v, t < c.L) +
               xkb[r2][e] * expf(G[t * kChunkLd + i]) * kh[t * kChunkLd + i];
        }
        s = warp_sum(s);
        if (lane == 0) db[t] = s;
        const float b = bv[t];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int u = lane + 32 * e;
          dAkk[sw(t, u, kC)] = u < t ? b * dAkk[sw(t, u, kC)] : 0.f;
        }
        if (P.dv.data != nullptr && t < c.L)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            store_any(P.dv.data, P.dv.dtype, P.dv.offset(c.b, c.t0 + t, hv) + lane + 32 * e,
                      b * xvb[r2][e]);
      }
    }
    // The record and states are no longer read: L2 prefetch of what the block's next task reads
    // first (its W, Ut and S, its token rows), so that its start does not wait on HBM. Not all of
    // it: a whole task's workspace part (272 KB) per block on top of the live scratch would
    // exceed the L2 (132 x (272 + 224) KB against the H200's 50 MB).
    if (task + gridDim.x < tasks) {
      const int64_t next = task + gridDim.x;
      const ChunkTask nc = chunk_task(p, next / p.HV);
      if (nc.valid) {
        if constexpr (!kWg) {
          prefetch_floats(P.rec + next * kRecFloats + kRecW, 2 * kTile, 0);
          prefetch_floats(P.states + next * kStateFloats, kStateFloats, 2);
        }
        prefetch_rows(p, nc, static_cast<int>(next % p.HV), &P.d_out);
      }
    }
    __syncthreads();
    // The intra-chunk phases below are warp-local: warp w owns the 16 x 32 block of rows
    // r = 16 (w / 4) .., keys n0 = 32 (w % 4) .. of dq^, dk^ (shared-memory tiles dqt, dkt) and of
    // dG (registers dg of lane n - n0, one per row), and every phase updates only that block:
    // no device-memory read-modify-write and no block barrier between them. Phases that
    // compute in the mma fragment layout add into the tiles at the fragment's elements and hand
    // their dG terms to the owning lanes through the warp's staging rows (stage_dg).
    static_assert(kChunkRowGroups == 4 && kChunkThreads == 16 * 32, "a warp per 16 x 32 block");
    const int i = tid & (kD - 1), J = tid >> 7, r = 16 * J;
    float* stw = stg + warp * kStgWarp;
    float dg[16];
    // Elementwise: dK~ = b dKb; dG = Qg dQg + K~ dK~ - Kd dKd; dq^ = exp(G) dQg;
    // dk^ = exp(G) dK~ + exp(G_L - G) dKd; sum_t Kd dKd for G_L. The block's device-memory
    // loads (dKb, dQg, dKd: one round trip) before its stores.
    {
      const float gLi = G[(kC - 1) * kChunkLd + i];
      float xb[16], xq[16], xk[16];
#pragma unroll
      for (int u = 0; u < 16; ++u) {
        const int e = (r + u) * kD + i;
        xb[u] = dKbp[e];
        xq[u] = dqh[e];
        xk[u] = dkh[e];
      }
      float acc = 0.f;
#pragma unroll
      for (int u = 0; u < 16; ++u) {
        const int t = r + u, f = t * kChunkLd + i;
        const float eg = expf(G[f]), el = expf(gLi - G[f]);
        const float dKt = bv[t] * xb[u];
        const float dQg = xq[u], dKd = xk[u];
        const float kdk = el * kh[f] * dKd;
        dg[u] = eg * qh[f] * dQg + eg * kh[f] * dKt - kdk;
        acc += kdk;
        dqt[ti(t, i)] = eg * dQg;
        dkt[ti(t, i)] = eg * dKt + el * dKd;
      }
      pgl[J * kD + i] = acc;
    }
    // Intra-chunk products, diagonal block J: a thread per key i, per element exp(G_t - G_s)
    // (t >= s). Row t's sums (aq, akp) are complete after its inner loop; column s's (akm) after
    // all rows. Rolled over the rows (code size: the unrolled triangle did not stay in the
    // instruction caches), the columns unrolled with a uniform exit so that akm stays in
    // registers; a row's dG term goes through the thread's own staging slot (dg is indexed
    // statically), added to dg after rows 7 and 15.
    {
      // The block's G and k^ of key i in registers (the columns' operands of every row).
      float akm[16], gs[16], kst[16];
#pragma unroll
      for (int l = 0; l < 16; ++l) {
        akm[l] = 0.f;
        gs[l] = G[(r + l) * kChunkLd + i];
        kst[l] = kh[(r + l) * kChunkLd + i];
      }
#pragma unroll 1
      for (int tt = 0; tt < 16; ++tt) {
        const int t = r + tt, f = t * kChunkLd + i;
        const float gt = G[f], qt = qh[f], kt = kh[f];
        float aq = 0.f, akp = 0.f;
#pragma unroll
        for (int ss = 0; ss < 16; ++ss) {
          if (ss > tt) break;
          const float E = expf(gt - gs[ss]);
          const float ks = kst[ss] * E;
          const float wq = dAqk[sw(t, r + ss, kC)];
          aq += wq * ks;
          akm[ss] += wq * qt * E;
          if (ss < tt) {
            const float wk = dAkk[sw(t, r + ss, kC)];
            akp += wk * ks;
            akm[ss] += wk * kt * E;
          }
        }
        dqt[ti(t, i)] += aq;
        dkt[ti(t, i)] += akp;
        stw[(tt & 7) * kStgLd + lane] = qt * aq + kt * akp;
        if (tt == 7) {
#pragma unroll
          for (int l = 0; l < 8; ++l) dg[l] += stw[l * kStgLd + lane];
        } else if (tt == 15) {
#pragma unroll
          for (int l = 0; l < 8; ++l) dg[8 + l] += stw[l * kStgLd + lane];
        }
      }
#pragma unroll
      for (int l = 0; l < 16; ++l) {
        const int t = r + l;
        dkt[ti(t, i)] += akm[l];
        dg[l] -= kh[t * kChunkLd + i] * akm[l];
      }
    }
    __syncwarp();
    // Off the diagonal blocks (docs/backward.md section 5), their tf32 fragments formed from the
    // tiles as they are read, every decay factor <= 1. Rows t of block J >= 1 (r = 16 J) against
    // the columns s < r:
    //   x_q = exp(G_t - G_r) (dAqk Kc), x_k = exp(G_t - G_r) (dAkk Kc), Kc_s = exp(G_r - G_s) k^_s;
    //   dq^ += x_q, dk^ += x_k, dG += q^ x_q + k^ x_k.
    const int g = lane >> 2, cq = lane & 3, n0 = 32 * (warp % 4);
    if (J >= 1) {
      const float* Gr = G + r * kChunkLd;
      float aq[4][4] = {}, ak[4][4] = {};
      for (int k0 = 0; k0 < r; k0 += 8) {
        uint32_t qhi[4], qlo[4], khi[4], klo[4];
        da_fragments<false>(dAqk, dAkk, r, k0, qhi, qlo, khi, klo);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int n = n0 + 8 * j + g, s0 = k0 + cq, s1 = s0 + 4;
          const float b0 = kh[s0 * kChunkLd + n] * expf(Gr[n] - G[s0 * kChunkLd + n]);
          const float b1 = kh[s1 * kChunkLd + n] * expf(Gr[n] - G[s1 * kChunkLd + n]);
          mma_split<kSplit>(aq[j], qhi, qlo, b0, b1);
          mma_split<kSplit>(ak[j], khi, klo, b0, b1);
        }
      }
      stage_dg<1>(
          [&](int j, int x) {
            const int t = r + g + 8 * (x >> 1), n = n0 + 8 * j + 2 * cq + (x & 1);
            const int f = t * kChunkLd + n;
            const float E = expf(G[f] - Gr[n]);
            const float xq = E * aq[j][x], xk = E * ak[j][x];
            dqt[ti(t, n)] += xq;
            dkt[ti(t, n)] += xk;
            return qh[f] * xq + kh[f] * xk;
          },
          stw, dg);
    }
    // Columns s of block I <= 2 against the row blocks J > I (r = 16 J):
    //   y = sum_J exp(G_r - G_s) (dAqk^T Qr + dAkk^T Kr), Qr_t, Kr_t = exp(G_t - G_r) q^_t, k^_t;
    //   dk^ += y, dG -= k^ y.
    if (J <= 2) {
      const int I = J;
      float y[4][4] = {};
      for (int Jr = I + 1; Jr < 4; ++Jr) {
        const int rr = 16 * Jr;
        const float* Gr = G + rr * kChunkLd;
        float acc[4][4] = {};
#pragma unroll
        for (int k0 = 0; k0 < 16; k0 += 8) {
          uint32_t qhi[4], qlo[4], khi[4], klo[4];
          da_fragments<true>(dAqk, dAkk, 16 * I, rr + k0, qhi, qlo, khi, klo);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int n = n0 + 8 * j + g, t0 = rr + k0 + cq, t1 = t0 + 4;
            const float e0 = expf(G[t0 * kChunkLd + n] - Gr[n]);
            const float e1 = expf(G[t1 * kChunkLd + n] - Gr[n]);
            mma_split<kSplit>(acc[j], qhi, qlo, qh[t0 * kChunkLd + n] * e0,
                              qh[t1 * kChunkLd + n] * e1);
            mma_split<kSplit>(acc[j], khi, klo, kh[t0 * kChunkLd + n] * e0,
                              kh[t1 * kChunkLd + n] * e1);
          }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int x = 0; x < 4; ++x) {
            const int s2 = 16 * I + g + 8 * (x >> 1), n = n0 + 8 * j + 2 * cq + (x & 1);
            y[j][x] += expf(Gr[n] - G[s2 * kChunkLd + n]) * acc[j][x];
          }
      }
      stage_dg<-1>(
          [&](int j, int x) {
            const int s2 = 16 * I + g + 8 * (x >> 1), n = n0 + 8 * j + 2 * cq + (x & 1);
            dkt[ti(s2, n)] += y[j][x];
            return kh[s2 * kChunkLd + n] * y[j][x];
          },
          stw, dg);
    }
    if (p.groups == 1) {
      // No group to sum: dq, dk here (bwd_qk_kernel's chain, qk_chain_store), a warp per token,
      // the loads of q and k for all of the warp's tokens issued first.
      __syncthreads();
      constexpr int kRowsPerWarp = kC / (kChunkThreads / 32);
      const bool want[2] = {P.dq.data != nullptr, P.dk.data != nullptr};
      float x[kRowsPerWarp][2][4];
#pragma unroll
      for (int u = 0; u < kRowsPerWarp; ++u) {
        const int t = warp + 16 * u;
        const int64_t tok = c.t0 + (t < c.L ? t : 0);
#pragma unroll
        for (int which = 0; which < 2; ++which) {
          const StridedView& in = which == 0 ? p.q : p.k;
#pragma unroll
          for (int e = 0; e < 4; ++e)
            x[u][which][e] =
                want[which] ? load_any(in.data, in.dtype, in.offset(c.b, tok, hv) + lane + 32 * e)
                            : 0.f;
        }
      }
#pragma unroll
      for (int u = 0; u < kRowsPerWarp; ++u) {
        const int t = warp + 16 * u;
        if (t >= c.L) break;
#pragma unroll
        for (int which = 0; which < 2; ++which) {
          if (!want[which]) continue;
          const float* tile = which == 0 ? dqt : dkt;
          float d[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) d[e] = tile[ti(t, lane + 32 * e)];
          const StridedView& out = which == 0 ? P.dq : P.dk;
          qk_chain_store(p, which == 0, x[u][which], d, out, out.offset(c.b, c.t0 + t, hv));
        }
      }
    } else {
      // The block's dq^, dk^ to the workspace (bwd_qk_kernel sums the group's value heads).
      __syncwarp();
#pragma unroll 4
      for (int u = 0; u < 16; ++u) {
        const int t = r + u;
        dqh[t * kD + i] = dqt[ti(t, i)];
        dkh[t * kD + i] = dkt[ti(t, i)];
      }
    }
    __syncthreads();

    // dbeta's beta input (a thread per token, used at the end), loaded with the gate chain's.
    const uint32_t beta_bits = token_bits(p.beta, c, tid & (kC - 1), hv, 0);
    // G_L's gradient enters at the last token; da_t = sum_{t' >= t} dG_t' (a reverse cumulative
    // sum: per group of 16 tokens its total, then each group from the totals after it, da_t
    // written to the k^ tile, free now); the gate chain. A thread per (channel i, token group),
    // the owner of that group's dG (dg); the groups' A_log / dt_bias partials summed in group
    // order. T1 (free now) holds the group totals and partials, the q^ tile the raw gate inputs.
    // The gate derivatives run in a rolled loop: the gate forms and the dtype's store inlined once,
    // not once per token (instruction fetch).
    {
      constexpr int kPer = kC / kChunkRowGroups;
      const int grp = J, t_lo = grp * kPer;
      const int last = c.L - 1;
      float* dat = kh;  // [64][kChunkLd]: da
      float kdk = 0.f;
#pragma unroll
      for (int q = 0; q < kChunkRowGroups; ++q) kdk += pgl[q * kD + i];
      const float extra = kdk + dgl[i];
      // The gate inputs, A_log and dt_bias loaded together, before the shared-memory stores below
      // (which the compiler may not move loads above).
      uint32_t gbits[kPer];
#pragma unroll
      for (int u = 0; u < kPer; ++u) gbits[u] = token_bits(p.g, c, t_lo + u, hv, i);
      const float alog = p.A_log != nullptr ? p.A_log[hv * p.A_log_s] : 0.f;
      const float bias = p.dt_bias != nullptr ? p.dt_bias[hv * p.dt_bias_s + i] : 0.f;
      float tot = 0.f;
#pragma unroll
      for (int u = kPer - 1; u >= 0; --u) {
        const int t = t_lo + u;
        if (t <= last) tot += dg[u] + (t == last ? extra : 0.f);
      }
      float* gtot = T1;                          // [groups][128]
      float* gpart = T1 + kChunkRowGroups * kD;  // [groups][2][128]
      gtot[grp * kD + i] = tot;
#pragma unroll
      for (int u = 0; u < kPer; ++u)
        qh[(t_lo + u) * kChunkLd + i] = bits_to_f32(gbits[u], p.g.dtype);
      __syncthreads();
      float run = 0.f;
      for (int q = kChunkRowGroups - 1; q > grp; --q) run += gtot[q * kD + i];
#pragma unroll
      for (int u = kPer - 1; u >= 0; --u) {
        const int f = (t_lo + u) * kChunkLd + i;
        if (t_lo + u > last) continue;
        run += dg[u] + (t_lo + u == last ? extra : 0.f);
        dat[f] = run;
      }
      const float expA = p.A_log != nullptr ? expf(alog) : 1.f;
      float ddt = 0.f, dA = 0.f;
      const int t_hi = t_lo + kPer - 1 < last ? t_lo + kPer - 1 : last;
#pragma unroll 1
      for (int t = t_hi; t >= t_lo; --t) {
        const int f = t * kChunkLd + i;
        const float da = dat[f];
        float dadg, dadA;
        gate_derivatives(p, qh[f], expA, bias, &dadg, &dadA);
        const float dgt = da * dadg;
        ddt += dgt;
        dA += da * dadA;
        if (P.dg.data != nullptr)
          store_any(P.dg.data, P.dg.dtype, P.dg.offset(c.b, c.t0 + t, hv) + i, dgt);
      }
      gpart[(2 * grp) * kD + i] = ddt;
      gpart[(2 * grp + 1) * kD + i] = dA;
      __syncthreads();
      if (tid < kD) {
        float sd = 0.f, sa = 0.f;
        for (int q = kChunkRowGroups - 1; q >= 0; --q) {
          sd += gpart[(2 * q) * kD + i];
          sa += gpart[(2 * q + 1) * kD + i];
        }
        part[i] = p.gate == detail::kGatePrecomputed ? 0.f : sd;
        misc[i] = sa;
      }
    }
    __syncthreads();
    if (warp == 0) {
      float s = 0.f;
#pragma unroll
      for (int e = 0; e < 4; ++e) s += misc[lane + 32 * e];
      s = warp_sum(s);
      if (lane == 0) part[kD] = s;
    }
    // dbeta through the beta form.
    if (P.dbeta.data != nullptr && tid < c.L) {
      const int t = tid;
      float f = 1.f;
      if (p.beta_logits) {
        const float s = detail::sigmoid<float>(bits_to_f32(beta_bits, p.beta.dtype));
        f = (p.allow_neg_eigval ? 2.f : 1.f) * s * (1.f - s);
      }
      store_any(P.dbeta.data, P.dbeta.dtype, P.dbeta.offset(c.b, c.t0 + t, hv), db[t] * f);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 5. dq, dk: the group sum, the scale and the l2norm chain (a warp per token)
// ---------------------------------------------------------------------------------------------

__global__ void __launch_bounds__(kQkThreads) bwd_qk_kernel(const __grid_constant__ BwdParams P) {
  pdl_prologue();
  const Params& p = P.f;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int h = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.H));
  const int64_t slot = blockIdx.x / static_cast<unsigned>(p.H);
  const ChunkTask c = chunk_task(p, slot);
  if (!c.valid) return;
  // Per token, both gradients' loads (the group's dq^ / dk^ rows, q and k) issued before either
  // gradient's stores (which the compiler may not move them above).
  for (int t = warp; t < c.L; t += kQkThreads / 32) {
    const int64_t tok = c.t0 + t;
    // A gradient not asked for (its output null) loads nothing.
    const bool want[2] = {P.dq.data != nullptr, P.dk.data != nullptr};
    float d[2][4] = {}, x[2][4] = {};
    for (int hv = h * p.groups; hv < (h + 1) * p.groups; ++hv) {
      const float* src = P.dqk + (slot * p.HV + hv) * (2 * kTile) + t * kD;
#pragma unroll
      for (int which = 0; which < 2; ++which)
        if (want[which])
#pragma unroll
          for (int e = 0; e < 4; ++e) d[which][e] += src[which * kTile + lane + 32 * e];
    }
#pragma unroll
    for (int which = 0; which < 2; ++which) {
      const StridedView& in = which == 0 ? p.q : p.k;
      if (want[which])
#pragma unroll
        for (int e = 0; e < 4; ++e)
          x[which][e] = load_any(in.data, in.dtype, in.offset(c.b, tok, h) + lane + 32 * e);
    }
#pragma unroll
    for (int which = 0; which < 2; ++which) {
      if (!want[which]) continue;
      const StridedView& out = which == 0 ? P.dq : P.dk;
      qk_chain_store(p, which == 0, x[which], d[which], out, out.offset(c.b, tok, h));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 6. dA_log, ddt_bias: the chunks' partials summed in slot order (deterministic)
// ---------------------------------------------------------------------------------------------

__global__ void __launch_bounds__(kParamThreads)
    bwd_params_kernel(const __grid_constant__ BwdParams P) {
  pdl_prologue();
  const Params& p = P.f;
  const int hv = static_cast<int>(blockIdx.x), i = threadIdx.x;
  float ddt = 0.f, dA = 0.f;
  for (int64_t slot = 0; P.part != nullptr && slot < p.num_slots; ++slot) {
    const float* part = P.part + (slot * p.HV + hv) * kPartFloats;
    ddt += part[i];
    if (i == 0) dA += part[kD];
  }
  if (P.ddt_bias != nullptr) P.ddt_bias[hv * P.ddt_bias_s + i] = ddt;
  if (P.dA_log != nullptr && i == 0) P.dA_log[hv * P.dA_log_s] = dA;
}

}  // namespace kda::cuda::bw
