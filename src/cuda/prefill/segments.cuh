// segments.cuh — the scan of the segmented prefill (heuristics/prefill.h prefill_segments;
// docs/design.md section 6.2).
//
// Pass 1 (recurrence_kernel<..., kSeg = true>, Params::seg_pass... launched with twice the value
// slices) leaves, per segment slot s and value head: seg_start[s + 1] = the true end state of a
// sequence's first segment; seg_local[s] = the end state of segment s from a zero start;
// seg_trans[s] = Mt, the end state of 128 rows started from the identity with zero values. Every
// row of S^T then maps as x_end = x_start Mt + x_local. This kernel walks a sequence's segments,
// seg_start[s + 1] = seg_start[s] Mt[s] + seg_local[s] for its segments 1 .. count - 2, in fp32 FMA
// (no rounding of the operands). Pass 2 runs segments 1 .. count - 1 from seg_start.
//
// One block per (sequence, value head, 8 rows of S^T): warp w owns row 8 b + w, lane l its columns
// 4 l .. 4 l + 3 (a float4); x_start[k] comes from lane k / 4 by shuffle, Mt rows by float4 loads
// (the block's 8 warps read the same Mt rows: L1).
#pragma once

#include "cuda/prefill/common.cuh"

namespace kda::cuda::pf {

__device__ __forceinline__ float* seg_row(const StateView& v, int64_t slot, int hv, int row) {
  return static_cast<float*>(v.data) + slot * v.s0 + hv * v.s1 + row * v.s2;
}

__global__ void __launch_bounds__(kScanThreads) segment_scan_kernel(const __grid_constant__ Params p) {
  pdl_prologue();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rb = static_cast<int>(blockIdx.x % kScanBlocksPerHead);
  const int64_t pair = blockIdx.x / kScanBlocksPerHead;
  const int hv = static_cast<int>(pair % p.HV);
  const int64_t n = pair / p.HV;
  const int row = rb * (kScanThreads / 32) + warp;
  const SegRange r = seg_range(p, n, seq_span(p, n));
  if (r.count <= 2) return;
  float4 x = *reinterpret_cast<const float4*>(seg_row(p.seg_start, r.first + 1, hv, row) + 4 * lane);
  for (int64_t j = 1; j + 1 < r.count; ++j) {
    const int64_t s = r.first + j;
    if (s + 1 >= p.seg_slots) break;
    const float* mt = seg_row(p.seg_trans, s, hv, 0) + 4 * lane;
    float4 acc = *reinterpret_cast<const float4*>(seg_row(p.seg_local, s, hv, row) + 4 * lane);
#pragma unroll 4
    for (int kq = 0; kq < 32; ++kq) {
      const float xs[4] = {__shfl_sync(0xffffffffu, x.x, kq), __shfl_sync(0xffffffffu, x.y, kq),
                           __shfl_sync(0xffffffffu, x.z, kq), __shfl_sync(0xffffffffu, x.w, kq)};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float4 m = __ldg(reinterpret_cast<const float4*>(mt + (4 * kq + e) * p.seg_trans.s2));
        acc.x = fmaf(xs[e], m.x, acc.x);
        acc.y = fmaf(xs[e], m.y, acc.y);
        acc.z = fmaf(xs[e], m.z, acc.z);
        acc.w = fmaf(xs[e], m.w, acc.w);
      }
    }
    x = acc;
    *reinterpret_cast<float4*>(seg_row(p.seg_start, s + 1, hv, row) + 4 * lane) = x;
  }
}

}  // namespace kda::cuda::pf
