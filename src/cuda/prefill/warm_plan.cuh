// warm_plan.cuh — warm-up segments sized per (sequence, value head) (docs/design.md 6.10,
// "Segments sized per head"; heuristics/prefill.h warm_sized_applies).
//
// With uniform segments every CTA of a call pays the warm-up of the head that needs the longest,
// though most heads need a few chunks. Here a first kernel reads the gates once and gives, for
// every chunk c0 of every (sequence, value head) pair, where a warm-up for a segment starting at
// c0 must start (the same bound as fused_warm_start: the first chunk w0 at which the sum of the
// tokens' largest log2 decays over [w0, c0) reaches -warm_log2_bound; 0 when the sequence's start
// comes first; -1 past warm_max_chunks chunks), and each pair's longest warm-up. A one-CTA kernel
// then sizes each pair's segments (the least time t, in chunks, at which segments of t - need_p
// chunks for every pair p fit the grid) and writes each warm-up CTA's task; the warm-up pass
// (fused.cuh, seg_pass = 3 with Params::warm_tasks) reads its own and no CTA walks the gates. Dense
// batches only (a pair's chunk count is the same for all), at most one CTA per SM per pair.
#pragma once

#include "cuda/prefill/common.cuh"

namespace kda::cuda::pf {

// kWarmSizedMaxBudget, kWarmSizedMaxPairs: heuristics/prefill.h (warm_sized_applies).
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }

inline constexpr int kWarmPlanThreads = 512;
inline constexpr int kWarmPlanStarts = 64;  // chunk starts per plan CTA
// Shared memory: four partial sums per chunk read (the starts' chunks, the budget before them,
// and the last 64-token pass's chunks past them), the warps' longest warm-ups.
inline constexpr int kWarmPlanChunksRead = kWarmPlanStarts + kWarmSizedMaxBudget + 4;
inline constexpr int kWarmPlanSmemBytes = kWarmPlanChunksRead * 16 + (kWarmPlanThreads / 32) * 4;

// Chunk starts of one pair, and the plan CTAs per pair.
__host__ __device__ inline int64_t warm_plan_blocks_per_pair(int64_t chunks) {
  return (chunks + kWarmPlanStarts - 1) / kWarmPlanStarts;
}

// One CTA per (pair, kWarmPlanStarts chunk starts): the tokens' largest log2 decay over the
// starts' chunks and the warm_max_chunks chunks before them (8 threads a token, 16 key channels
// each), the chunk sums in shared memory (four partial sums a chunk, added in order), then a
// thread per start walks back over them. Writes warm_start[pair][c0], warm_need[pair][block]
// (the block's longest warm-up, in chunks: c0 - w0 for a start that runs a warm-up or from the
// sequence's start; 0 for one past the budget, whose CTA exits at once), and, in each pair's
// first block, zeroes the pair's warm_flags (the warm-up pass sets those it leaves).
static __global__ void __launch_bounds__(kWarmPlanThreads)
    warm_plan_kernel(const __grid_constant__ Params p) {
  pdl_prologue();
  extern __shared__ __align__(16) uint8_t smem_raw[];
  float(*const part)[4] = reinterpret_cast<float(*)[4]>(smem_raw);  // [kWarmPlanChunksRead][4]
  int* const need_s = reinterpret_cast<int*>(smem_raw + kWarmPlanChunksRead * 16);
  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int64_t L = p.warm_chunks_per_seq, nb = warm_plan_blocks_per_pair(L);
  const int64_t pair = blockIdx.x / nb, cb = blockIdx.x % nb;
  const int64_t n = pair / p.HV;
  const int hv = static_cast<int>(pair % p.HV);
  const SeqSpan seq = seq_span(p, n);
  const int64_t c_lo = cb * kWarmPlanStarts;
  const int64_t c_hi = c_lo + kWarmPlanStarts < L ? c_lo + kWarmPlanStarts : L;
  const int64_t budget = p.warm_max_chunks;
  const int64_t a_lo = c_lo - budget > 0 ? c_lo - budget : 0;  // first chunk read
  if (cb == 0 && p.warm_flags != nullptr) {
    const SegRange r = seg_range(p, n, seq);
    for (int64_t s = r.first + tid; s < r.first + r.count && s < p.seg_slots; s += blockDim.x)
      p.warm_flags[s * p.HV + hv] = 0;
  }
  // The gate's per-key constants, as fused_warm_start: thread tid & 7 owns keys 16 (tid & 7) + e.
  const int cg = tid & 7;
  const float exp_a = p.A_log ? expf(p.A_log[hv * p.A_log_s]) : 1.f;
  const float ca = -exp_a * kLog2e, lb2 = p.lower_bound * kLog2e;
  float cbk[16];
#pragma unroll
  for (int e = 0; e < 16; ++e)
    cbk[e] = p.dt_bias ? ca * p.dt_bias[hv * p.dt_bias_s + 16 * cg + e] : 0.f;
  // 64 tokens a pass: warp w the 4 tokens 4 w .. 4 w + 3 of the pass (chunk w / 4 of its 4).
  for (int64_t t0 = a_lo * kChunk16; t0 < c_hi * kChunk16; t0 += 64) {
    const int64_t t = t0 + (tid >> 3);
    float y = -INFINITY;
    if (t < seq.len) {
      const int64_t off = p.g.offset(seq.b, seq.bos + t, hv) + 16 * cg;
      if (p.g.vec && p.g.dtype != kF32) {  // 16-bit gates in 16-byte rows: two vector loads
        const uint4* const src =
            reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.g.data) + off);
        const uint4 v[2] = {src[0], src[1]};
        const uint32_t* const w = reinterpret_cast<const uint32_t*>(v);
#pragma unroll
        for (int e = 0; e < 16; ++e)
          y = fmaxf(
              y, fmaf(ca, bits_to_f32((w[e / 2] >> (16 * (e & 1))) & 0xffffu, p.g.dtype), cbk[e]));
      } else {
#pragma unroll
        for (int e = 0; e < 16; ++e)
          y = fmaxf(y, fmaf(ca, load_any(p.g.data, p.g.dtype, off + e), cbk[e]));
      }
    }
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) y = fmaxf(y, __shfl_xor_sync(0xffffffffu, y, o));
    float a = t < seq.len ? lb2 * __fdividef(1.f, 1.f + fast_exp2(fminf(y, 80.f * kLog2e))) : 0.f;
    if (cg != 0) a = 0.f;
    a += __shfl_xor_sync(0xffffffffu, a, 8);
    a += __shfl_xor_sync(0xffffffffu, a, 16);
    if (lane == 0) part[(t0 / kChunk16 - a_lo) + (warp >> 2)][warp & 3] = a;
  }
  __syncthreads();
  // A thread per start: where its warm-up starts.
  int need = 0;
  if (tid < kWarmPlanStarts && c_lo + tid < c_hi) {
    const int64_t c0 = c_lo + tid;
    int64_t w0 = 0;
    if (c0 > 0) {
      float sum = 0.f;
      for (int64_t c = c0 - 1;; --c) {
        const float* q4 = part[c - a_lo];
        sum += ((q4[0] + q4[1]) + q4[2]) + q4[3];
        if (sum <= -p.warm_log2_bound || c <= 0) {
          w0 = c;
          break;
        }
        if (c0 - c >= budget) {
          w0 = -1;
          break;
        }
      }
    }
    p.warm_start[pair * L + c0] = static_cast<int32_t>(w0);
    need = w0 >= 0 ? static_cast<int>(c0 - w0) : 0;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) need = imax(need, __shfl_xor_sync(0xffffffffu, need, o));
  if (lane == 0) need_s[warp] = need;
  __syncthreads();
  if (tid == 0) {
    int m = 0;
    for (int w = 0; w < kWarmPlanThreads / 32; ++w) m = imax(m, need_s[w]);
    p.warm_need[pair * nb + cb] = m;
  }
}

// The sized plan's schedule (warm_schedule_kernel, one CTA of kWarmPlanThreads threads): pair p's
// longest warm-up need_p (the max of its plan blocks'), then the least t such that segments of
// s_p = clamp(t - need_p, 1, L) chunks need at most warm_grid CTAs, the pairs' CTAs in pair order.
// Writes warm_tasks[b] = {pair, c0, c1, w0} for each warm-up CTA b: the chunks [c0, c1) whose
// outputs it writes, where its warm-up starts (w0; -1: past the budget); pair -1 for a CTA the
// plan does not need.
inline constexpr int kWarmScheduleSmemBytes = kWarmSizedMaxPairs * 4;
struct WarmTask {
  int64_t pair, c0, c1, w0;
};
static __global__ void __launch_bounds__(kWarmPlanThreads)
    warm_schedule_kernel(const __grid_constant__ Params p) {
  pdl_prologue();
  extern __shared__ __align__(16) uint8_t smem_raw[];
  int* const need = reinterpret_cast<int*>(smem_raw);  // [P]
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31;
  const int64_t L = p.warm_chunks_per_seq, nb = warm_plan_blocks_per_pair(L);
  const int P = static_cast<int>(p.N * p.HV);
  for (int i = tid; i < P; i += blockDim.x) need[i] = 0;
  __syncthreads();
  const int64_t entries = P * nb;  // a load per thread and round, the loads of a thread unrolled
#pragma unroll 4
  for (int64_t e = tid; e < entries; e += blockDim.x) atomicMax(&need[e / nb], p.warm_need[e]);
  __syncthreads();
  if (tid >= 32) return;
  const int64_t grid = p.warm_grid;
  auto seg_of = [&](int64_t t, int i) {
    const int64_t s = t - need[i];
    return s < 1 ? int64_t{1} : (s > L ? L : s);
  };
  auto count = [&](int64_t t) {  // CTAs the plan of time t needs
    int64_t c = 0;
    for (int i = lane; i < P; i += 32) c += (L + seg_of(t, i) - 1) / seg_of(t, i);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
    return c;
  };
  int maxneed = 0;
  for (int i = lane; i < P; i += 32) maxneed = imax(maxneed, need[i]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    maxneed = imax(maxneed, __shfl_xor_sync(0xffffffffu, maxneed, o));
  int64_t lo = 1, hi = L + maxneed;  // count(hi) = P <= grid
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (count(mid) <= grid)
      hi = mid;
    else
      lo = mid + 1;
  }
  // Lane l takes pairs [l per, (l + 1) per): their CTA counts, a scan over the lanes, the tasks.
  const int per = (P + 31) / 32;
  int64_t mine = 0;
  for (int i = lane * per; i < P && i < (lane + 1) * per; ++i)
    mine += (L + seg_of(lo, i) - 1) / seg_of(lo, i);
  int64_t incl = mine;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int64_t x = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += x;
  }
  const int64_t total = __shfl_sync(0xffffffffu, incl, 31);
  int64_t b = incl - mine;
  for (int i = lane * per; i < P && i < (lane + 1) * per; ++i) {
    const int64_t s = seg_of(lo, i);
    for (int64_t c0 = 0; c0 < L; c0 += s, ++b) {
      int32_t* const t = p.warm_tasks + 4 * b;
      t[0] = i;
      t[1] = static_cast<int32_t>(c0);
      t[2] = static_cast<int32_t>(c0 + s < L ? c0 + s : L);
      t[3] = c0 > 0 ? p.warm_start[i * L + c0] : 0;
    }
  }
  for (int64_t e = total + lane; e < grid; e += 32) p.warm_tasks[4 * e] = -1;
}

}  // namespace kda::cuda::pf
