// warp.cuh — the warp kernel (decode_warp_kernel<kRows>, 3 instantiations): small fp32 batches,
// where a call is bound by its chain of dependent steps rather than by bytes
// (heuristics/decode.h). docs/perf_decode.md, "warp kernel".
//
// One warp owns kRows value rows (4, 8 or 16) of one (sequence n, value head hv), all 128 k, in
// registers: lane l holds k = 4 l .. 4 l + 3 of each row (one 16-byte vector per row, so a warp
// instruction reads or writes one whole 512-byte row). The lane preprocesses exactly the token
// inputs it holds (q, k, g, dt_bias at its 4 k: prep_lane), so there is no shared memory, no
// block barrier and no token stage: the four warps of a block are independent. Per token the
// chain is: inputs + index (one round trip) -> state rows (one round trip) -> pass 1 (decay,
// S^T k as a warp reduce-scatter of the kRows partial sums) -> u of each row (broadcast from the
// lane that holds it) -> pass 2 (s' = s + k u, S'^T q, reduce-scatter) -> stores from registers.
// A warp reduce-scatter needs kRows - 1 + log2(32 / kRows) shuffles for kRows sums (5 kRows as
// butterflies).
//
// PDL: the kernel parameters are read into the constant caches before griddepcontrol.wait
// (warm_params: legal, they are not written by any grid), so that the dependent loads after the
// wait do not each wait on a cold constant line; nothing in global memory is touched before the
// wait: the previous grid in the stream may write the same pool rows (the previous step in a CUDA
// graph of steps) or the token inputs (a projection), so q, k, v, g, beta, dt_bias and
// state_indices are all read after it.
//
// Same math per element as the other kernels (s * decay, then fmaf(k, u, .)); the k sums run in a
// different order (4-term chains per lane, then the shuffle tree), so results agree with them
// within reassociation (~1e-7 relative for fp32), bitwise deterministic run to run. fp32 V-first
// pools with 16-byte aligned rows, K = V = 128; any T, dense or varlen, every index and
// state-output mode.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/ptx.cuh"
#include "cuda/decode/smem_tile.cuh"
#include "cuda/decode/warp_step.cuh"

namespace kda::cuda::dec {

constexpr int kWarpK = 128;        // K = V
constexpr int kWarpThreads = 128;  // four independent warps per block
static_assert(kWarpK == kDecodeFastK, "heuristics/decode.h: the warp kernel's K");

// Register bound, the tightest that ptxas 13 meets without spilling: kRows = 4 / 8 in 96
// registers (5 blocks, 20 warps per SM), kRows = 16 (64 state values per lane) in 168 (3 blocks,
// 12 warps, 96 KB of state per SM in flight). A B = 8 grid (HV = 32) is 4096 / 2048 warps: ~1.5 /
// 1.3 waves on 132 SMs.
template <int kRows>
constexpr int warp_min_blocks() {
  return kRows == 16 ? 3 : 5;
}

// 4 fp32 state values at p (16-byte aligned when vec), with the streaming (evict-first) or the
// normal L2 policy.
__device__ __forceinline__ void load_state4(const float* p, bool stream, float* dst) {
  const float4 x = stream ? __ldcs(reinterpret_cast<const float4*>(p))
                          : __ldcg(reinterpret_cast<const float4*>(p));
  dst[0] = x.x, dst[1] = x.y, dst[2] = x.z, dst[3] = x.w;
}
__device__ __forceinline__ void store_state4(float* p, bool vec, bool stream, const float* src) {
  if (vec) {
    const float4 x = make_float4(src[0], src[1], src[2], src[3]);
    if (stream)
      __stcs(reinterpret_cast<float4*>(p), x);
    else
      __stcg(reinterpret_cast<float4*>(p), x);
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (stream)
        __stcs(p + e, src[e]);
      else
        __stcg(p + e, src[e]);
    }
  }
}

template <int kRows>
__global__ void __launch_bounds__(kWarpThreads, warp_min_blocks<kRows>())
    decode_warp_kernel(const __grid_constant__ DecodeArgs a) {
  static_assert(kRows == 4 || kRows == 8 || kRows == 16, "rows per warp");
  constexpr int kTiles = kWarpK / kRows;  // row tiles per (sequence, value head)
  constexpr int kRowLanes = 32 / kRows;   // lanes that end up holding one row's sums
  __shared__ uint32_t param_sink[kWarpThreads / 32];

  // ---- Before the wait: the parameters into the constant caches, the warp's place in the grid
  pdl_launch_dependents();
  warm_params<kWarpThreads / 32>(a, threadIdx.x / 32, &param_sink[threadIdx.x / 32]);
  const int lane = lane_id();
  const unsigned warp = blockIdx.x * (kWarpThreads / 32) + threadIdx.x / 32;  // < 2^31
  const unsigned head_blk = warp / kTiles;                                    // n * HV + hv
  const int v0 = static_cast<int>(warp % kTiles) * kRows;
  const int hv = static_cast<int>(head_blk % static_cast<unsigned>(a.HV));
  const int64_t n = head_blk / static_cast<unsigned>(a.HV);
  const int h = hv / a.groups;
  const int v_mine = v0 + lane / kRowLanes;  // the row whose v, beta and sums this lane holds
  const bool out_lane = lane % kRowLanes == 0;
  pdl_wait();
  if (n >= a.N) return;  // the grid's last block may have spare warps (uniform per warp)

  // ---- A dense row's index loads first (index -> state is the longest chain), then token 0's
  //      raw inputs (known without them), then the read slot
  RowRaw idx;
  if (!a.varlen) idx = load_row_raw(a, n);
  RawToken raw;
  if (!a.varlen && a.T > 0) load_raw_token_row(a, n, 0, h, hv, v_mine, lane, raw);
  const SeqRow row = a.varlen ? resolve_row(a, n) : SeqRow{n, 0, a.T, finish_row_slot(a, n, idx)};
  if (row.slot < 0) {  // padding row: zero output, no state access
    if (out_lane)
      for (int64_t t = 0; t < row.len; ++t)
        store_elem(a.out.data, a.out.dtype, a.out.offset(row.b, row.bos + t, hv) + v_mine, 0.f);
    return;
  }

  // ---- The warp's rows -> registers: kRows 16-byte loads per lane, all in flight at once
  //      (the pool's rows are 16-byte aligned: choose_kernel)
  const bool stream = a.state_stream;
  float s[kRows][4];
  if (a.use_initial_state) {
    const float* src = static_cast<const float*>(a.state.data) + row.slot * a.state.s0 +
                       hv * a.state.s1 + static_cast<int64_t>(v0) * a.state.s2 + 4 * lane;
#pragma unroll
    for (int r = 0; r < kRows; ++r) load_state4(src + r * a.state.s2, stream, s[r]);
  } else {
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[r][e] = 0.f;
  }
  // Stores the warp's rows to `dst` (rows v0.. of one head of a state tensor).
  auto store_rows = [&](const TileDst<float>& dst) {
    float* p = dst.data + static_cast<int64_t>(v0) * dst.s2 + 4 * lane;
#pragma unroll
    for (int r = 0; r < kRows; ++r) store_state4(p + r * dst.s2, dst.vec, stream, s[r]);
  };

#pragma unroll 1
  for (int64_t t = 0; t < row.len; ++t) {
    // The row's span, opaque to the compiler inside the loop: otherwise it hoists the
    // token-invariant part of every tensor offset out of the loop and keeps (spills) them all,
    // which a single-token call would pay for without using them.
    SeqRow rt = row;
    asm volatile("" : "+l"(rt.b), "+l"(rt.bos));
    const int64_t tok = rt.bos + t;
    if (t > 0 || a.varlen) load_raw_token_row(a, rt.b, tok, h, hv, v_mine, lane, raw);
    const LaneToken tk = prep_lane(a, raw, lane);  // while the state loads are in flight
    const float d[4] = {tk.decay.x, tk.decay.y, tk.decay.z, tk.decay.w};
    const float kv[4] = {tk.k.x, tk.k.y, tk.k.z, tk.k.w}, qv[4] = {tk.q.x, tk.q.y, tk.q.z, tk.q.w};

    // ---- The two passes (warp_rows_token), this token's state (at most one place), its output
    const float o_mine = warp_rows_token<kRows>(s, d, kv, qv, tk.beta, tk.v, lane);
    if (const TileDst<float> dst = token_dst<float>(a, rt, n, hv, t); dst.data != nullptr)
      store_rows(dst);
    if (out_lane) store_elem(a.out.data, a.out.dtype, a.out.offset(rt.b, tok, hv) + v_mine, o_mine);
  }

  // ---- No tokens (an empty varlen sequence, T = 0): the final state is the initial one
  if (const TileDst<float> dst = empty_row_dst<float>(a, row, n, hv); dst.data != nullptr)
    store_rows(dst);
}

}  // namespace kda::cuda::dec
