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
// lane l their columns 4 l .. 4 l + 3. Each step's Mt (64 KB) and local rows (8 KB, contiguous)
// arrive by bulk copies (one thread, an mbarrier per stage) into one of three shared-memory
// stages, two steps ahead: the copy engine, not per-thread cp.async requests, keeps the bytes in
// flight (per-thread cp.async measured ~4 us per step, bound by the requests an SM keeps in
// flight). x_start rows sit in shared memory (read as broadcasts). A step is 1,024 FMA per thread.
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
  const uint32_t bar0 = smem_addr(x + kRows);                             // kScanStages mbarriers
  // Step j (1 .. last) uses stage (j - 1) % 3 for the ((j - 1) / 3)-th time: Mt[first + j] and the
  // local rows of this block.
  auto slot_of = [](int64_t j) { return static_cast<uint32_t>((j - 1) % kScanStages); };
  auto stage = [&](int64_t j) { return scan_smem + slot_of(j) * (kMt + kRows); };
  const int64_t last =
      r.first + r.count - 1 < p.seg_slots ? r.count - 2 : p.seg_slots - r.first - 2;
  if (last < 1) return;
  if (tid == 0) {
    for (int i = 0; i < kScanStages; ++i) mbar_init(bar0 + 8 * i, 1);
    fence_mbar_init();
  }
  for (int i = tid; i < kRows / 4; i += kScanThreads)
    *reinterpret_cast<float4*>(x + 4 * i) =
        *reinterpret_cast<const float4*>(seg_row(p.seg_start, r.first + 1, hv, row0) + 4 * i);
  __syncthreads();               // the barriers initialized
  auto issue = [&](int64_t j) {  // thread 0
    if (j > last) return;
    const int64_t s = r.first + j;
    const uint32_t mt = smem_addr(stage(j)), bar = bar0 + 8 * slot_of(j);
    const uint8_t* gm = reinterpret_cast<const uint8_t*>(seg_row(p.seg_trans, s, hv, 0));
    fence_proxy_async();  // the stage's earlier generic reads before the copy that refills it
    mbar_arrive_expect_tx(bar, (kMt + kRows) * 4);
    for (int off = 0; off < kMt * 4; off += 32768) bulk_copy_g2s(mt + off, gm + off, 32768, bar);
    bulk_copy_g2s(mt + kMt * 4, seg_row(p.seg_local, s, hv, row0), kRows * 4, bar);
  };
  if (tid == 0)
    for (int64_t j = 1; j <= kScanStages; ++j) issue(j);
  for (int64_t j = 1; j <= last; ++j) {
    mbar_wait(bar0 + 8 * slot_of(j), static_cast<uint32_t>(((j - 1) / kScanStages) & 1));
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
    __syncthreads();                       // every read of x and of this stage done
    if (tid == 0) issue(j + kScanStages);  // into this step's stage
    *reinterpret_cast<float4*>(x + (2 * warp) * kHeadDim + 4 * lane) = a0;
    *reinterpret_cast<float4*>(x + (2 * warp + 1) * kHeadDim + 4 * lane) = a1;
    const int64_t s = r.first + j;
    *reinterpret_cast<float4*>(seg_row(p.seg_start, s + 1, hv, row0 + 2 * warp) + 4 * lane) = a0;
    *reinterpret_cast<float4*>(seg_row(p.seg_start, s + 1, hv, row0 + 2 * warp + 1) + 4 * lane) =
        a1;
    __syncthreads();  // this step's x rows written for the next step's reads
  }
}

}  // namespace kda::cuda::pf
