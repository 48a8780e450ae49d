// segments.cuh — the scan of the segmented prefill (heuristics/prefill.h prefill_plan;
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
//
// One block per (sequence, value head, kScanRows = 16 rows of S^T): warp w owns rows 2w, 2w + 1,
// lane l their columns 4 l .. 4 l + 3. Each step's Mt (64 KB) and local rows (8 KB) arrive by
// cp.async into one of three shared-memory stages, two steps ahead; x_start rows sit in shared
// memory (read as broadcasts). A step is 1,024 FMA per thread.
#pragma once

#include "cuda/prefill/common.cuh"

namespace kda::cuda::pf {

__device__ __forceinline__ float* seg_row(const StateView& v, int64_t slot, int hv, int row) {
  return static_cast<float*>(v.data) + slot * v.s0 + hv * v.s1 + row * v.s2;
}

__global__ void __launch_bounds__(kScanThreads)
    segment_scan_kernel(const __grid_constant__ Params p) {
  pdl_prologue();
  extern __shared__ __align__(128) uint8_t smem_raw[];
  float* const scan_smem = reinterpret_cast<float*>(smem_raw);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int rb = static_cast<int>(blockIdx.x % kScanBlocksPerHead);
  const int64_t pair = blockIdx.x / kScanBlocksPerHead;
  const int hv = static_cast<int>(pair % p.HV);
  const int64_t n = pair / p.HV;
  const int row0 = rb * kScanRows;
  const SegRange r = seg_range(p, n, seq_span(p, n));
  if (r.count <= 2) return;
  constexpr int kMt = kHeadDim * kHeadDim, kRows = kScanRows * kHeadDim;  // floats per stage part
  float* const x = scan_smem + kScanStages * (kMt + kRows);               // x_start [16][128]
  // Stage j % 3 of step j: Mt[first + j] and the local rows of this block.
  auto stage = [&](int64_t j) { return scan_smem + (j % kScanStages) * (kMt + kRows); };
  const int64_t last =
      r.first + r.count - 1 < p.seg_slots ? r.count - 2 : p.seg_slots - r.first - 2;
  if (last < 1) return;
  auto issue = [&](int64_t j) {
    if (j <= last) {
      const int64_t s = r.first + j;
      float* const mt = stage(j);
      const float* gm = seg_row(p.seg_trans, s, hv, 0);
      const float* gl = seg_row(p.seg_local, s, hv, row0);
      for (int i = tid; i < kMt / 4; i += kScanThreads)
        cp_async_16(smem_addr(mt + 4 * i), gm + 4 * i);
      for (int i = tid; i < kRows / 4; i += kScanThreads)
        cp_async_16(smem_addr(mt + kMt + 4 * i), gl + 4 * i);
    }
    cp_async_commit();  // a group per step, empty past the last
  };
  for (int i = tid; i < kRows / 4; i += kScanThreads)
    *reinterpret_cast<float4*>(x + 4 * i) =
        *reinterpret_cast<const float4*>(seg_row(p.seg_start, r.first + 1, hv, row0) + 4 * i);
  issue(1);
  issue(2);
  for (int64_t j = 1; j <= last; ++j) {
    issue(j + 2);
    cp_async_wait<kScanStages - 1>();
    __syncthreads();  // step j's stage and the previous step's x rows visible to every thread
    const float* mt = stage(j);
    const float* x0 = x + (2 * warp) * kHeadDim;
    float4 a0 = *reinterpret_cast<const float4*>(mt + kMt + (2 * warp) * kHeadDim + 4 * lane);
    float4 a1 = *reinterpret_cast<const float4*>(mt + kMt + (2 * warp + 1) * kHeadDim + 4 * lane);
#pragma unroll 8
    for (int k = 0; k < kHeadDim; ++k) {
      const float4 m = *reinterpret_cast<const float4*>(mt + k * kHeadDim + 4 * lane);
      const float u = x0[k], w = x0[kHeadDim + k];
      a0.x = fmaf(u, m.x, a0.x);
      a0.y = fmaf(u, m.y, a0.y);
      a0.z = fmaf(u, m.z, a0.z);
      a0.w = fmaf(u, m.w, a0.w);
      a1.x = fmaf(w, m.x, a1.x);
      a1.y = fmaf(w, m.y, a1.y);
      a1.z = fmaf(w, m.z, a1.z);
      a1.w = fmaf(w, m.w, a1.w);
    }
    __syncthreads();  // every read of x and of this stage done
    *reinterpret_cast<float4*>(x + (2 * warp) * kHeadDim + 4 * lane) = a0;
    *reinterpret_cast<float4*>(x + (2 * warp + 1) * kHeadDim + 4 * lane) = a1;
    const int64_t s = r.first + j;
    *reinterpret_cast<float4*>(seg_row(p.seg_start, s + 1, hv, row0 + 2 * warp) + 4 * lane) = a0;
    *reinterpret_cast<float4*>(seg_row(p.seg_start, s + 1, hv, row0 + 2 * warp + 1) + 4 * lane) =
        a1;
  }
}

}  // namespace kda::cuda::pf
