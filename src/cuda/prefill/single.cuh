// single.cuh — the single-launch prefill: the prepare kernel's blocks and the recurrence kernel's
// blocks of one unsegmented two-kernel plan in one cooperative launch (heuristics/prefill.h
// single_launch: both fit one block per SM at once), a grid barrier between the two phases.
// Block b runs prepare block b (b < chunk slots x value heads), waits at the grid barrier, then
// runs recurrence block b (b < sequences x value heads x value slices) on its first
// 32 recurrence_warps(vs) threads. One launch's host time instead of two, and no kernel boundary:
// the records still pass through the workspace (L2 at these sizes). Off by default
// (Tuning::prefill_single, KDA_CUDA_PREFILL_SINGLE=1): compiled into one kernel with the prepare
// phase, the recurrence step is scheduled differently by ptxas and runs slower than in
// recurrence_kernel (docs/design.md, "Launches").
//
// The records are written with generic stores and read by the recurrence's bulk copies (async
// proxy) in other blocks: each side fences between the proxies around the grid barrier, which
// orders the memory of the blocks as a kernel boundary does.
#pragma once

#include <cooperative_groups.h>

#include "cuda/prefill/prepare.cuh"
#include "cuda/prefill/recurrence.cuh"

namespace kda::cuda::pf {

// Threads per block: the prepare block's 256, at least the recurrence's 32 recurrence_warps(vs)
// for vs <= 128 without the K split.
inline constexpr int kSingleThreads = kPrepareThreads;
static_assert(kSingleThreads >= 32 * recurrence_warps(kHeadDim, false), "recurrence warps");
// Shared memory: the larger of the two phases' (they use it one after the other).
__host__ __device__ constexpr int single_smem_bytes(bool chunk16, int vs) {
  const int rec = chunk16 ? recurrence_smem_bytes16(vs) : recurrence_smem_bytes(vs);
  return rec > kPrepareSmemBytes ? rec : kPrepareSmemBytes;
}

// The two phases of block `block` (the CPU emulator runs them as two launches: it runs a grid's
// blocks one after another and cannot hold them at a grid barrier).
template <bool kFp16, bool kC16>
__device__ __forceinline__ void single_prepare_phase(const Params& p, unsigned block) {
  if (block < static_cast<uint64_t>(p.num_slots) * p.HV) prepare_block<kFp16, kC16>(p, block);
}
template <bool kFp16, bool kC16>
__device__ __forceinline__ void single_recurrence_phase(const Params& p, unsigned block) {
  const int nthreads = 32 * recurrence_warps(p.vs, false);
  if (block < static_cast<uint64_t>(p.N) * p.HV * p.nslices &&
      static_cast<int>(threadIdx.x) < nthreads)
    recurrence_block<kFp16, false, true, kC16, false>(p, block, nthreads);
}

template <bool kFp16, bool kC16>
__global__ void __launch_bounds__(kSingleThreads, 1)
    single_kernel(const __grid_constant__ Params p) {
  pdl_prologue();
  single_prepare_phase<kFp16, kC16>(p, blockIdx.x);
  fence_proxy_async_global();  // this block's record stores, before the barrier
  fence_proxy_async();  // the prepare phase's shared-memory accesses, before the stages' copies
  cooperative_groups::this_grid().sync();
  fence_proxy_async_global();  // every block's record stores, before this block's bulk copies
  // An aligned block barrier after the grid barrier (whose block barriers are not aligned): without
  // it ptxas keeps the recurrence's descriptor arithmetic off the uniform datapath (a register
  // move per wgmma descriptor, a slower step).
  __syncthreads();
  single_recurrence_phase<kFp16, kC16>(p, blockIdx.x);
}

}  // namespace kda::cuda::pf
