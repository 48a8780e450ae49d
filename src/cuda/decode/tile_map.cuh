// tile_map.cuh — the thread <-> state-element map of the register-tile decode kernels (TileMap),
// the tile loads and stores, and one token of the recurrence on a tile (recurrence_token).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/ptx.cuh"
#include "cuda/decode/params.cuh"

namespace kda::cuda::dec {

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
  static constexpr int kVec = StateVec<StateT>::kElems;  // elements per 16-byte vector
  static constexpr int kTileV = 32;                      // value rows (columns) per block
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
  static constexpr int kBlocksOf128 = !kKFirst ? (kMaxK == 128  ? 6
                                                  : kMaxK == 64 ? 5
                                                                : 4)
                                               : (kVt * kKt > 32                ? 0
                                                  : (kMaxK == 128 && kVec == 4) ? 4
                                                                                : 5);
  static constexpr int kMinBlocks =
      kBlocksOf128 * 128 / kThreads > 1 ? kBlocksOf128 * 128 / kThreads : 1;
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
__device__ __forceinline__ void load_state_tile(const Map& m, const StridedView& st, int64_t row,
                                                int hv, int K, float (&s)[Map::kVt][Map::kKt]) {
  using Vec = StateVec<StateT>;
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
__device__ __forceinline__ void store_state_tile(const Map& m, const StridedView& st, int64_t row,
                                                 int hv, int K,
                                                 const float (&s)[Map::kVt][Map::kKt]) {
  using Vec = StateVec<StateT>;
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

// One token of the recurrence on the thread's tile s (Map layout), the preprocessed token in
// shared memory (q: l2-normalized and scaled, k: l2-normalized, decay = exp(a_t); all indexed by
// k), vv / bt: v and the activated beta of the thread's rows (columns). o: the outputs of the
// thread's rows, summed over the row's lanes (every lane of a group holds the same bits).
//   S <- diag(exp a) S;  u = b (v - S^T k);  S <- S + k u^T;  o = S^T q
template <class Map, bool kBf16State>
__device__ __forceinline__ void recurrence_token(
    const Map& m, float (&s)[Map::kVt][Map::kKt], const float* __restrict__ q_sh,
    const float* __restrict__ k_sh, const float* __restrict__ d_sh, const float (&vv)[Map::kVt],
    const float (&bt)[Map::kVt], float (&o)[Map::kVt]) {
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
  for (int vt = 0; vt < kVt; ++vt) u[vt] = bt[vt] * (vv[vt] - lane_group_sum<kKLanes>(sk[vt]));
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
        if (kBf16State) s[vt][k4 + e] = round_bf16(s[vt][k4 + e]);
      }
  }
#pragma unroll
  for (int vt = 0; vt < kVt; ++vt) o[vt] = lane_group_sum<kKLanes>(o[vt]);
}

}  // namespace kda::cuda::dec
