// segments.cuh — the scan of the segmented prefill (heuristics/prefill.h prefill_plan;
// docs/design.md section 6.2).
//
// Pass 1 (recurrence_kernel<..., kSeg = true>, Params::seg_pass... launched with twice the value
// slices) leaves, per segment slot s and value head: seg_start[s + 1] = the true end state of a
// sequence's first segment; seg_local[s] = the end state of segment s from a zero start;
// seg_trans[s] = Mt, the end state of 128 rows started from the identity with zero values. Every
// row of S^T then maps as x_end = x_start Mt + x_local. This kernel walks a sequence's segments,
// seg_start[s + 1] = seg_start[s] Mt[s] + seg_local[s] for its segments 1 .. count - 2, the
// product on the tensor cores in 3xTF32 (split_tf32 of inverse.cuh: the dropped terms are ~2^-22
// relative), the large terms summed in fp32 outside the mma accumulators (the main loop), so that
// the state stays ~fp32 accurate over many segments. Pass 2 runs segments 1 .. count - 1 from
// seg_start.
//
// One block per (sequence, value head, kScanRows = 16 rows of S^T); x = the 16 start rows. Warp
// w = 4 h + q multiplies x's k in [64 h, 64 h + 64) (8 k-steps of m16n8k8) into the columns
// [32 q, 32 q + 32) (4 n-tiles), so each Mt element is read and split once per block; the warp
// pair (q, q + 4) then exchanges half of its accumulators (h = 0 keeps the rows 0..7, h = 1 the
// rows 8..15) through shared memory under a named barrier, adds the local rows (loaded from global
// memory at the step's start) and writes the new rows, to global memory and, split into hi and lo,
// into the other of two x buffers for the next step: one block barrier per step.
//
// Fragment layout (lane = 4 g + c). k: the paired mapping of inverse.cuh, mma k slot c <-> k 2c,
// slot c + 4 <-> k 2c + 1 of a k-step, so that A is a 64-bit pair per row. n: tile t's column g is
// Mt's column 32 q + 4 g + t, so that one float4 of an Mt row is the B element of all 4 tiles; a
// lane's accumulators then hold the columns 32 q + 8 c + (0..7) of the rows g and g + 8. Mt (64 KB)
// arrives by one bulk copy per row (issued by warp 0's lanes) into one of two stages one step
// ahead, with row pitch kScanMtStride = 132; x is kept as hi and lo tf32 rows of pitch
// kScanXStride = 136. Banks (4-byte words; a 128-bit access is served per 8 lanes, a 64-bit one
// per 16 lanes):
//   Mt float4 at row 64 h + 8 ks + 2 c + e, column 32 q + 4 g: 16-byte chunk (33 (2 c + e) + g)
//     mod 8 = (2 c + g + e) mod 8, distinct over the 8 lanes g in {2i, 2i + 1}, c in 0..3.
//   x pair at row g (+ 8), k 64 h + 8 ks + 2 c: 8-byte slot (68 g + 4 ks + c) mod 16 =
//     (4 g + c + 4 ks) mod 16, distinct over the 16 lanes g in 4i..4i + 3, c in 0..3.
//   x float4 stores at row r = g + 8 h, columns 32 q + 8 c + 4 e: chunk (34 r + 2 c + e) mod 8 =
//     (2 g + 2 c + e) mod 8; the lanes of odd g store their e = 1 half first, so that the chunks
//     (2 g + 2 c + (g & 1)) mod 8 of each store are distinct over the 8 lanes.
//   exchange: float4 per lane, lane-contiguous.
#pragma once

#include "cuda/prefill/common.cuh"
#include "cuda/prefill/inverse.cuh"

namespace kda::cuda::pf {

__device__ __forceinline__ float* seg_row(const StateView& v, int64_t slot, int hv, int row) {
  return static_cast<float*>(v.data) + slot * v.s0 + hv * v.s1 + row * v.s2;
}

// Row r of x, columns col .. col + 7 (v[0..7]), split into hi and lo at xr (hi) and xr + kX (lo),
// xr = buffer + r * kScanXStride + col; `odd` stores the upper half first (the bank note above).
__device__ __forceinline__ void scan_store_x(uint32_t* xr, const float (&v)[8], bool odd) {
  constexpr int kX = kScanRows * kScanXStride;
  uint32_t hi[8], lo[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) split_tf32(v[i], hi[i], lo[i]);
  const uint4 h0 = make_uint4(hi[0], hi[1], hi[2], hi[3]),
              h1 = make_uint4(hi[4], hi[5], hi[6], hi[7]);
  const uint4 l0 = make_uint4(lo[0], lo[1], lo[2], lo[3]),
              l1 = make_uint4(lo[4], lo[5], lo[6], lo[7]);
  const int o = odd ? 4 : 0;
  *reinterpret_cast<uint4*>(xr + o) = odd ? h1 : h0;
  *reinterpret_cast<uint4*>(xr + kX + o) = odd ? l1 : l0;
  *reinterpret_cast<uint4*>(xr + 4 - o) = odd ? h0 : h1;
  *reinterpret_cast<uint4*>(xr + kX + 4 - o) = odd ? l0 : l1;
}

__global__ void __launch_bounds__(kScanThreads)
    segment_scan_kernel(const __grid_constant__ Params p) {
  pdl_prologue();
  extern __shared__ __align__(128) uint8_t smem_raw[];
  float* const scan_smem = reinterpret_cast<float*>(smem_raw);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, c = lane & 3, h = warp >> 2, q = warp & 3;
  const int rb = static_cast<int>(blockIdx.x % kScanBlocksPerHead);
  const int64_t pair = blockIdx.x / kScanBlocksPerHead;
  const int hv = static_cast<int>(pair % p.HV);
  const int64_t n = pair / p.HV;
  const int row0 = rb * kScanRows;
  const SegRange r = seg_range(p, n, seq_span(p, n));
  if (r.count <= 2) return;
  constexpr int kMt = kHeadDim * kScanMtStride;  // floats of a stage
  constexpr int kX = kScanRows * kScanXStride;   // words of a hi or lo array
  uint32_t* const xs = reinterpret_cast<uint32_t*>(scan_smem + kScanStages * kMt);  // [2][2][kX]
  float* const red = scan_smem + kScanStages * kMt + 4 * kX;  // [warp][2][32][4]
  const uint32_t bar0 = smem_addr(red + kScanThreads * 8);
  // Step j (1 .. last) uses stage (j - 1) % 2 for the ((j - 1) / 2)-th time.
  auto slot_of = [](int64_t j) { return static_cast<uint32_t>((j - 1) % kScanStages); };
  const int64_t last =
      r.first + r.count - 1 < p.seg_slots ? r.count - 2 : p.seg_slots - r.first - 2;
  if (last < 1) return;
  if (tid == 0) {
    for (int i = 0; i < kScanStages; ++i) mbar_init(bar0 + 8 * i, 1);
    fence_mbar_init();
  }
  // This thread's rows of the sum phase: row xr_row, columns xcol .. xcol + 7.
  const int xr_row = g + 8 * h, xcol = 32 * q + 8 * c;
  {
    const float* gs = seg_row(p.seg_start, r.first + 1, hv, row0 + xr_row) + xcol;
    const float4 a = *reinterpret_cast<const float4*>(gs);
    const float4 b = *reinterpret_cast<const float4*>(gs + 4);
    const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    scan_store_x(xs + xr_row * kScanXStride + xcol, v, (g & 1) != 0);  // buffer 0
  }
  __syncthreads();               // the barriers initialized, x written
  auto issue = [&](int64_t j) {  // warp 0
    if (j > last) return;
    const uint32_t mt = smem_addr(scan_smem + slot_of(j) * kMt), bar = bar0 + 8 * slot_of(j);
    if (lane == 0) mbar_arrive_expect_tx(bar, kHeadDim * kHeadDim * 4);
    __syncwarp();         // the bytes expected before any copy lands
    fence_proxy_async();  // the stage's earlier generic reads before the copies that refill it
    for (int k = lane; k < kHeadDim; k += 32)
      bulk_copy_g2s(mt + k * kScanMtStride * 4, seg_row(p.seg_trans, r.first + j, hv, k),
                    kHeadDim * 4, bar);
  };
  if (warp == 0) issue(1);
  for (int64_t j = 1; j <= last; ++j) {
    const int64_t s = r.first + j;
    const float* gl = seg_row(p.seg_local, s, hv, row0 + xr_row) + xcol;
    const float4 l0 = *reinterpret_cast<const float4*>(gl);
    const float4 l1 = *reinterpret_cast<const float4*>(gl + 4);
    if (warp == 0) issue(j + 1);  // into the stage step j - 1 read
    mbar_wait(bar0 + 8 * slot_of(j), static_cast<uint32_t>(((j - 1) / kScanStages) & 1));
    const float* mk =
        scan_smem + slot_of(j) * kMt + (64 * h + 2 * c) * kScanMtStride + 32 * q + 4 * g;
    const uint32_t* xk = xs + ((j - 1) & 1) * 2 * kX + g * kScanXStride + 64 * h + 2 * c;
    // [n-tile][fragment]: sum = the products a_hi b_hi, each k-step's from a zeroed accumulator,
    // added in fp32 (round to nearest); low = the small terms a_lo b_hi + a_hi b_lo, one mma chain.
    // The tensor cores' fp32 adder truncates: a large running sum in an mma accumulator would be
    // cut toward zero at every k-step, a bias that compounds over a sequence's steps.
    float sum[4][4], low[4][4];
#pragma unroll
    for (int t = 0; t < 4; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) sum[t][i] = low[t][i] = 0.f;
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
      const float4 m0 = *reinterpret_cast<const float4*>(mk + (8 * ks) * kScanMtStride);
      const float4 m1 = *reinterpret_cast<const float4*>(mk + (8 * ks + 1) * kScanMtStride);
      const float b0[4] = {m0.x, m0.y, m0.z, m0.w}, b1[4] = {m1.x, m1.y, m1.z, m1.w};
      const uint2 h0 = *reinterpret_cast<const uint2*>(xk + 8 * ks);
      const uint2 h1 = *reinterpret_cast<const uint2*>(xk + 8 * kScanXStride + 8 * ks);
      const uint2 o0 = *reinterpret_cast<const uint2*>(xk + kX + 8 * ks);
      const uint2 o1 = *reinterpret_cast<const uint2*>(xk + kX + 8 * kScanXStride + 8 * ks);
      const uint32_t ah[4] = {h0.x, h1.x, h0.y, h1.y}, al[4] = {o0.x, o1.x, o0.y, o1.y};
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        uint32_t bh[2], bl[2];
        split_tf32(b0[t], bh[0], bl[0]);
        split_tf32(b1[t], bh[1], bl[1]);
        float d[4] = {0.f, 0.f, 0.f, 0.f};
        mma_tf32(d, ah, bh[0], bh[1]);
        mma_tf32(low[t], al, bh[0], bh[1]);
        mma_tf32(low[t], ah, bl[0], bl[1]);
#pragma unroll
        for (int i = 0; i < 4; ++i) sum[t][i] += d[i];
      }
    }
    // Row g: columns xcol + t (d0 of tile t), xcol + 4 + t (d1); row g + 8: d2, d3.
    float keep[8], give[8];
#pragma unroll
    for (int t = 0; t < 4; ++t)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float top = sum[t][e] + low[t][e], bot = sum[t][2 + e] + low[t][2 + e];
        keep[4 * e + t] = h == 0 ? top : bot;
        give[4 * e + t] = h == 0 ? bot : top;
      }
    float* const mine = red + warp * 256 + 4 * lane;
    *reinterpret_cast<float4*>(mine) = make_float4(give[0], give[1], give[2], give[3]);
    *reinterpret_cast<float4*>(mine + 128) = make_float4(give[4], give[5], give[6], give[7]);
    named_barrier_sync(1 + q, 64);  // the pair's halves written
    const float* theirs = red + (warp ^ 4) * 256 + 4 * lane;
    const float4 t0 = *reinterpret_cast<const float4*>(theirs);
    const float4 t1 = *reinterpret_cast<const float4*>(theirs + 128);
    const float v[8] = {keep[0] + t0.x + l0.x, keep[1] + t0.y + l0.y, keep[2] + t0.z + l0.z,
                        keep[3] + t0.w + l0.w, keep[4] + t1.x + l1.x, keep[5] + t1.y + l1.y,
                        keep[6] + t1.z + l1.z, keep[7] + t1.w + l1.w};
    float* const out = seg_row(p.seg_start, s + 1, hv, row0 + xr_row) + xcol;
    *reinterpret_cast<float4*>(out) = make_float4(v[0], v[1], v[2], v[3]);
    *reinterpret_cast<float4*>(out + 4) = make_float4(v[4], v[5], v[6], v[7]);
    scan_store_x(xs + (j & 1) * 2 * kX + xr_row * kScanXStride + xcol, v, (g & 1) != 0);
    __syncthreads();  // x written for the next step; every read of this stage, of the other x
                      // buffer and of the exchange done
  }
}

}  // namespace kda::cuda::pf
