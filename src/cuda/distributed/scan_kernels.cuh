// scan_kernels.cuh — the kernels of the context-parallel prefill's device side (launched by
// distributed/scan.cu, and run on the CPU by the kernel emulator of dev/prefill_emu): the
// identity, zeros and piece lengths before the passes, the parts' layout with checkpoints, and
// the scan over ranks.
//
// The scan is a serial chain of `world * parts` steps h <- M_j h + S_j per (sequence, value
// head), each a K x K by K x C product (2 MFLOP for K = V = 128): one block per (sequence, value
// head), the state in fp64 in the workspace (two buffers, one per step parity), every thread a
// strided set of the R x C elements (scan::step_element, the host scan's arithmetic).
// Performance is not critical: a few steps, next to three prefill passes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/state_scan.h"

namespace kda::cuda::dist {

inline constexpr int kThreads = 256;  // threads per block of every kernel

// The grids (blocks of kThreads), for the launchers and the CPU emulator alike.
inline constexpr int kPrepareBlocks = 16;
inline int64_t layout_blocks(const scan::Buffers& b) {
  const int64_t blocks = (b.N + kThreads - 1) / kThreads;
  return blocks < 1 ? 1 : (blocks > 64 ? 64 : blocks);
}
// The scan: one block per (sequence, value head), N * HV; not record.N * HV, which counts the
// records' parts (N * parts).
inline int64_t scan_blocks(const scan::Buffers& b) { return b.N * b.record.HV; }

__device__ inline double load_state(const TensorView& t, int64_t n, int64_t hv, int64_t a,
                                    int64_t b) {
  const int64_t off = n * t.strides[0] + hv * t.strides[1] + a * t.strides[2] + b;
  switch (t.dtype) {
    case DType::kBFloat16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(t.data)[off]);
    case DType::kFloat16:
      return __half2float(static_cast<const __half*>(t.data)[off]);
    default:
      return static_cast<const float*>(t.data)[off];
  }
}

__device__ inline void store_state(const TensorView& t, int64_t n, int64_t hv, int64_t a, int64_t b,
                                   double x) {
  const int64_t off = n * t.strides[0] + hv * t.strides[1] + a * t.strides[2] + b;
  const float f = static_cast<float>(x);
  switch (t.dtype) {
    case DType::kBFloat16:
      static_cast<__nv_bfloat16*>(t.data)[off] = __float2bfloat16_rn(f);
      break;
    case DType::kFloat16:
      static_cast<__half*>(t.data)[off] = __float2half_rn(f);
      break;
    default:
      static_cast<float*>(t.data)[off] = f;
  }
}

// Grid: any; fills the [K, K] identity and the zero bytes.
__global__ void prepare_kernel(const scan::Buffers b) {
  const int64_t K = b.record.K;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < K * K; i += stride)
    b.identity[i] = i / K == i % K ? 1.0f : 0.0f;
  unsigned char* zeros = static_cast<unsigned char*>(b.zeros);
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < static_cast<int64_t>(b.zero_bytes);
       i += stride)
    zeros[i] = 0;
  if (b.lengths != nullptr)
    for (int64_t n = blockIdx.x * blockDim.x + threadIdx.x; n < b.N; n += stride)
      b.lengths[n] = scan::local_length(b, n);
}

// Grid: any; the parts' layout, one sequence per thread (N = 0: the one entry of each array).
__global__ void layout_kernel(const scan::Buffers b) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * blockDim.x + threadIdx.x;
  if (b.N == 0 && first == 0) scan::write_part_layout(b, -1);
  for (int64_t n = first; n < b.N; n += stride) scan::write_part_layout(b, n);
}

// Grid: scan_blocks(b) = N * HV blocks of kThreads, block (n, hv).
__global__ void scan_kernel(const scan::Buffers b) {
  const scan::Record& r = b.record;
  const int64_t pair = blockIdx.x;
  const int64_t n = pair / r.HV, hv = pair % r.HV;
  if (n >= b.N) return;  // a grid larger than scan_blocks(b) must not touch another block's state
  const int64_t RC = r.R * r.C;
  double* h = b.h + pair * RC;
  double* next = b.h + (b.N * r.HV + pair) * RC;
  const bool pool = b.state_pool.ndim != 0;
  const int64_t slot =
      pool ? rules::pool_slot(scan::index_at(b.state_indices, n), b.state_pool.shape[0])
           : rules::kNoSlot;
  const bool holds_last = b.lengths != nullptr && scan::piece_of(b, n).holds_last();
  const int64_t boundary = b.parts == 2 ? scan::piece_rows_of(b, n).boundary : -1;

  // Load: the initial state, or the pool slot's (zero when absent / no slot), widened to fp64.
  const TensorView& t0 = pool ? b.state_pool : b.initial_state;
  const int64_t row0 = pool ? slot : n;
  for (int64_t e = threadIdx.x; e < RC; e += blockDim.x)
    h[e] = t0.ndim != 0 && row0 >= 0 ? load_state(t0, row0, hv, e / r.C, e % r.C) : 0.0;
  __syncthreads();

  // Scan: every rank's parts in order; this rank's start states when its turn comes, and the
  // checkpoint at its head's end.
  for (int j = 0; j < b.world; ++j) {
    const float* rec = b.records + j * r.floats();
    for (int part = 0; part < b.parts; ++part) {
      const int64_t pi = n * b.parts + part;  // the part's row in the records and `start`
      if (j == b.rank)
        for (int64_t e = threadIdx.x; e < RC; e += blockDim.x)
          b.start[(pi * r.HV + hv) * RC + e] = static_cast<float>(h[e]);
      for (int64_t e = threadIdx.x; e < RC; e += blockDim.x)
        next[e] = scan::step_element(h, rec + r.m(pi, hv), rec + r.s(pi, hv), e / r.C, e % r.C, r.K,
                                     r.C, b.v_first);
      __syncthreads();
      double* t = h;
      h = next;
      next = t;
      if (j == b.rank && part == 0 && boundary >= 0)
        for (int64_t e = threadIdx.x; e < RC; e += blockDim.x)
          store_state(b.checkpoints, boundary, hv, e / r.C, e % r.C, h[e]);
    }
  }

  // Store: the final state, rounded to its dtype; the pool slot, by the rank holding the
  // sequence's last token.
  const TensorView& t = pool ? b.state_pool : b.final_state;
  const int64_t row = pool ? (holds_last ? slot : rules::kNoSlot) : n;
  if (t.ndim != 0 && row >= 0)
    for (int64_t e = threadIdx.x; e < RC; e += blockDim.x)
      store_state(t, row, hv, e / r.C, e % r.C, h[e]);
}

}  // namespace kda::cuda::dist
