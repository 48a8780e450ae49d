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
// One block per (sequence, value head, kScanRows = 16 rows of S^T). A step's product x Mt is split
// over k: warp w multiplies the 16 rows' k in [16 w, 16 w + 16) into all 128 columns (lane l:
// columns 4 l .. 4 l + 3, 64 accumulators), so each Mt element is read from shared memory once
// per block (reading all of Mt in every warp made the step bound by shared-memory bandwidth,
// ~4 us); the 8 partial products are summed through shared memory with the local rows (loaded
// from global memory at the step's start). Mt (64 KB, contiguous) arrives by bulk copies into
// one of two stages one step ahead. The start rows sit in shared memory transposed (x^T[k][row],
// row stride 20 floats: 16 rows of a k as four broadcast float4 loads, conflict-free stores).
#pragma once

#include "cuda/prefill/common.cuh"

namespace kda::cuda::pf {

__device__ __forceinline__ float* seg_row(const StateView& v, int64_t slot, int hv, int row) {
  return static_cast<float*>(v.data) + slot * v.s0 + hv * v.s1 + row * v.s2;
}

// Warm-up segments (fused.cuh, seg_pass = 3) leave each sequence's final state in seg_local at its
// last segment slot, so that no final state or pool slot is written before every warm-up CTA has
// read its initial state (they may share memory) and before the exact passes have read theirs.
// For the pairs the exact passes skip, the scan's blocks copy it (16 rows of S^T each) to the
// final state or the sequence's pool slot, in their layout and dtype.
__device__ __forceinline__ void warm_final_copy(const Params& p, int64_t n, const SegRange& r,
                                                int hv, int row0) {
  StateView dst;
  int64_t row = -1;
  if (p.has_state_pool) {
    const int64_t slot = rules::pool_slot(p.state_indices.load(n), p.state_pool.rows);
    if (slot >= 0) {
      dst = p.state_pool;
      row = slot;
    }
  } else if (p.final_state.data != nullptr) {
    dst = p.final_state;
    row = n;
  }
  const int64_t last = r.first + r.count - 1;
  if (row < 0 || last >= p.seg_slots) return;
  for (int i = static_cast<int>(threadIdx.x); i < kScanRows * kHeadDim; i += kScanThreads) {
    const int v = row0 + i / kHeadDim, k = i % kHeadDim;
    const int64_t off =
        row * dst.s0 + hv * dst.s1 +
        (p.kfirst ? static_cast<int64_t>(k) * dst.s2 + v : static_cast<int64_t>(v) * dst.s2 + k);
    store_any(dst.data, dst.dtype, off, seg_row(p.seg_local, last, hv, v)[k]);
  }
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
  if (p.warm_flags != nullptr && !exact_pass_needed(p, r, hv)) {
    warm_final_copy(p, n, r, hv, row0);
    return;
  }
  if (r.count <= 2 || !exact_pass_needed(p, r, hv)) return;
  constexpr int kMt = kHeadDim * kHeadDim;          // floats of a stage
  float* const xt = scan_smem + kScanStages * kMt;  // x_start^T [128][kScanXStride]
  float* const red = xt + kHeadDim * kScanXStride;  // partials [8][16][kScanRedStride]
  const uint32_t bar0 = smem_addr(red + (kScanThreads / 32) * kScanRows * kScanRedStride);
  // Step j (1 .. last) uses stage (j - 1) % 2 for the ((j - 1) / 2)-th time.
  auto slot_of = [](int64_t j) { return static_cast<uint32_t>((j - 1) % kScanStages); };
  const int64_t last =
      r.first + r.count - 1 < p.seg_slots ? r.count - 2 : p.seg_slots - r.first - 2;
  if (last < 1) return;
  if (tid == 0) {
    for (int i = 0; i < kScanStages; ++i) mbar_init(bar0 + 8 * i, 1);
    fence_mbar_init();
  }
  for (int i = tid; i < kScanRows * kHeadDim; i += kScanThreads)  // x^T[k][row] = x[row][k]
    xt[(i % kHeadDim) * kScanXStride + i / kHeadDim] =
        seg_row(p.seg_start, r.first + 1, hv, row0 + i / kHeadDim)[i % kHeadDim];
  __syncthreads();               // the barriers initialized, x^T written
  auto issue = [&](int64_t j) {  // thread 0
    if (j > last) return;
    const uint32_t mt = smem_addr(scan_smem + slot_of(j) * kMt), bar = bar0 + 8 * slot_of(j);
    const uint8_t* gm = reinterpret_cast<const uint8_t*>(seg_row(p.seg_trans, r.first + j, hv, 0));
    fence_proxy_async();  // the stage's earlier generic reads before the copy that refills it
    mbar_arrive_expect_tx(bar, kMt * 4);
    for (int off = 0; off < kMt * 4; off += 32768) bulk_copy_g2s(mt + off, gm + off, 32768, bar);
  };
  if (tid == 0) issue(1);
  // The sum phase's outputs of this thread: row sr, column groups sc and sc + 16 (4 columns each).
  const int sr = tid % kScanRows, sc = tid / kScanRows;
  for (int64_t j = 1; j <= last; ++j) {
    const int64_t s = r.first + j;
    const float* gl = seg_row(p.seg_local, s, hv, row0 + sr);
    const float4 l0 = *reinterpret_cast<const float4*>(gl + 4 * sc);
    const float4 l1 = *reinterpret_cast<const float4*>(gl + 4 * (sc + 16));
    if (tid == 0) issue(j + 1);  // into the stage step j - 1 read
    mbar_wait(bar0 + 8 * slot_of(j), static_cast<uint32_t>(((j - 1) / kScanStages) & 1));
    const float* mk = scan_smem + slot_of(j) * kMt + (16 * warp) * kHeadDim + 4 * lane;
    const float* xk = xt + (16 * warp) * kScanXStride;
    float acc[kScanRows][4];
#pragma unroll
    for (int q = 0; q < kScanRows; ++q) acc[q][0] = acc[q][1] = acc[q][2] = acc[q][3] = 0.f;
#pragma unroll 4
    for (int kk = 0; kk < 16; ++kk) {
      const float4 m = *reinterpret_cast<const float4*>(mk + kk * kHeadDim);
      float xr[kScanRows];
#pragma unroll
      for (int q = 0; q < kScanRows / 4; ++q) {
        const float4 v = *reinterpret_cast<const float4*>(xk + kk * kScanXStride + 4 * q);
        xr[4 * q] = v.x;
        xr[4 * q + 1] = v.y;
        xr[4 * q + 2] = v.z;
        xr[4 * q + 3] = v.w;
      }
#pragma unroll
      for (int q = 0; q < kScanRows; ++q) {
        acc[q][0] = fmaf(xr[q], m.x, acc[q][0]);
        acc[q][1] = fmaf(xr[q], m.y, acc[q][1]);
        acc[q][2] = fmaf(xr[q], m.z, acc[q][2]);
        acc[q][3] = fmaf(xr[q], m.w, acc[q][3]);
      }
    }
    float* const mine = red + warp * kScanRows * kScanRedStride + 4 * lane;
#pragma unroll
    for (int q = 0; q < kScanRows; ++q)
      *reinterpret_cast<float4*>(mine + q * kScanRedStride) =
          make_float4(acc[q][0], acc[q][1], acc[q][2], acc[q][3]);
    __syncthreads();  // the partials written; every read of x^T and of this stage done
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int c4 = sc + 16 * half;
      float4 v = half == 0 ? l0 : l1;
#pragma unroll
      for (int w = 0; w < kScanThreads / 32; ++w) {
        const float4 t =
            *reinterpret_cast<const float4*>(red + (w * kScanRows + sr) * kScanRedStride + 4 * c4);
        v.x += t.x;
        v.y += t.y;
        v.z += t.z;
        v.w += t.w;
      }
      xt[(4 * c4) * kScanXStride + sr] = v.x;
      xt[(4 * c4 + 1) * kScanXStride + sr] = v.y;
      xt[(4 * c4 + 2) * kScanXStride + sr] = v.z;
      xt[(4 * c4 + 3) * kScanXStride + sr] = v.w;
      *reinterpret_cast<float4*>(seg_row(p.seg_start, s + 1, hv, row0 + sr) + 4 * c4) = v;
    }
    __syncthreads();  // x^T updated for the next step; every read of the partials done
  }
}

}  // namespace kda::cuda::pf
