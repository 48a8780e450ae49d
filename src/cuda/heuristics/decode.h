// decode.h — the CUDA decode's kernel choice, as a pure host function of the problem, the device's
// size and the tuning struct (no CUDA headers, no environment reads; tested in the CPU build,
// tests/test_heuristics.cpp). The kernels are in src/cuda/decode/.
#pragma once

#include <cstdint>

#include "core/problem.h"
#include "core/tuning.h"
#include "cuda/common/alignment.h"

namespace kda::cuda {

// K = V of the staged and bulk kernels (their headers assert it).
inline constexpr int64_t kDecodeFastK = 128;

// kStagedLatency / kBulkLatency: the staged / bulk kernel's variant for grids of <= 2 blocks per
// SM. kWarp: the warp kernel (kRows value rows per warp, state in registers). kSingle: the
// single-token kernel (the warp kernel's organisation specialized to dense one-token calls).
enum class DecodeKernel {
  kBaseline,
  kTile,
  kStaged,
  kStagedLatency,
  kBulk,
  kBulkLatency,
  kWarp,
  kSingle
};

// The single-token kernel's grid is (HV x V / 32, N): N within the grid's y limit.
inline constexpr int64_t kSingleMaxN = 65535;

// What the single-token kernel (decode/single.cuh) takes: dense calls with T = 1 on an fp32
// V-first pool with K = V = 128, N <= kSingleMaxN; [N] indices or none (no speculative columns); no
// per-token state output; 16-bit q / k / v (g, beta and out in their dtype or fp32); q, k, g,
// dt_bias and every state tensor with 16-byte aligned rows (its vector loads and stores).
inline bool single_ok(const detail::DecodeProblem& pr) {
  const DType in = pr.q.dtype;
  auto in_or_f32 = [in](const TensorView& t) {
    return t.dtype == in || t.dtype == DType::kFloat32;
  };
  return !pr.d.varlen && pr.d.T == 1 && pr.d.N <= kSingleMaxN &&
         pr.layout == StateLayout::kVFirst && pr.d.K == kDecodeFastK && pr.d.V == kDecodeFastK &&
         pr.state.dtype == DType::kFloat32 && (in == DType::kBFloat16 || in == DType::kFloat16) &&
         pr.k.dtype == in && pr.v.dtype == in && in_or_f32(pr.g) && in_or_f32(pr.beta) &&
         in_or_f32(pr.out) && !pr.indices_2d && !pr.num_accepted_tokens.present() &&
         !pr.intermediate_states.present() && rows_aligned16(pr.state) && rows_aligned16(pr.q) &&
         rows_aligned16(pr.k) && rows_aligned16(pr.g) &&
         (!pr.dt_bias.present() || rows_aligned16(pr.dt_bias)) &&
         (!pr.final_state.present() || rows_aligned16(pr.final_state));
}

// The one kernel heuristic. `sms`: the device's multiprocessors. Blocks = N x HV x V / 32.
//   V-first, K = V = 128, pool rows 16-byte aligned (and every state tensor the bulk kernels
//   write):
//     fp32 pool, >= 64 blocks per SM                                    -> kBulk
//     dense single-token calls the single-token kernel takes (single_ok)  -> kSingle
//     dense single-token calls on <= 2 blocks per SM, or any bf16 pool  -> kBulkLatency
//     other grids of <= 2 blocks per SM                                 -> kStagedLatency
//     otherwise (any T, dense or varlen, every index / output mode)     -> kStaged
//   everything else (K-first, K != 128, unaligned pools)                -> kTile
// Worked example on 132 SMs, HV = 32, V = K = 128, fp32 pool, bf16 inputs, T = 1: B = 1 (128
// blocks), 8 and 32 -> kSingle; B = 256 is 32768 blocks (>= 64 x 132 = 8448) -> kBulk; with a
// bf16 pool every dense T = 1 call -> kBulkLatency. In a 20-call graph the single-token kernel
// measured B = 1 2.95 us and B = 8 7.19 us per call against the bulk latency variant's 3.95 / 9.9
// and the warp kernel's 5.0 / 10.6 (dev/decode_floor.cu, docs/perf_decode.md). The warp kernel runs
// only when Tuning::decode_kernel asks for it (any T, dense or varlen; tested): in a 20-call graph
// it measured slower than the bulk latency kernel at B = 1, 8 and 32 (4.66-5.13 vs 4.13 us, 10.6
// vs 10.27 us, 38.0 vs 36.9 us; docs/perf_decode.md). Measured on the H200 (docs/perf_decode.md):
// the bulk kernel streams faster once there are many waves of blocks (fp32 B = 256: 314 vs 336 us;
// B = 1024: 1212 vs 1307 us), but one 16 KB bulk copy has a longer latency than 128 threads'
// cp.async (B = 1: 10.5 vs 9.7 us); the bulk latency variant (bulk copy in, s' stored from
// registers) at B = 1 in a 20-call graph 4.53 us against 5.06 for the staged latency variant, bf16
// state at B = 256 193 vs 233 us. The baseline kernel runs only when Tuning::decode_kernel asks for
// it; any override applies where the kernel is eligible (otherwise the default choice).
inline DecodeKernel choose_kernel(const detail::DecodeProblem& pr, int sms,
                                  const detail::Tuning& tuning) {
  using Override = detail::DecodeKernelOverride;
  const Override want = tuning.decode_kernel;
  if (want == Override::kBaseline) return DecodeKernel::kBaseline;
  if (want == Override::kTile) return DecodeKernel::kTile;
  const bool staged_ok = pr.layout == StateLayout::kVFirst && pr.d.K == kDecodeFastK &&
                         pr.d.V == kDecodeFastK && rows_aligned16(pr.state);
  if (!staged_ok) return DecodeKernel::kTile;
  if (want == Override::kStaged) return DecodeKernel::kStaged;
  // The bulk kernel stores whole rows with the copy engine: every state tensor it may write needs
  // 16-byte aligned rows (the pool was checked above).
  const bool bulk_ok =
      (!pr.final_state.present() || rows_aligned16(pr.final_state)) &&
      (!pr.intermediate_states.present() || rows_aligned16(pr.intermediate_states));
  if (want == Override::kBulk && bulk_ok) return DecodeKernel::kBulk;
  const bool one_token = !pr.d.varlen && pr.d.T == 1;
  if (want == Override::kBulkLatency && bulk_ok && one_token) return DecodeKernel::kBulkLatency;
  const bool warp_ok = pr.state.dtype == DType::kFloat32;
  if (want == Override::kWarp && warp_ok) return DecodeKernel::kWarp;
  const bool single = single_ok(pr);
  if (want == Override::kSingle && single) return DecodeKernel::kSingle;
  const int64_t blocks = pr.d.N * pr.d.HV * (pr.d.V / 32);
  const bool small_grid = blocks <= int64_t{2} * sms;
  const bool bulk_batch = blocks >= int64_t{64} * sms;
  if (single && !(bulk_ok && bulk_batch)) return DecodeKernel::kSingle;
  if (bulk_ok && one_token && (small_grid || pr.state.dtype == DType::kBFloat16))
    return DecodeKernel::kBulkLatency;
  if (bulk_ok && bulk_batch && pr.state.dtype == DType::kFloat32) return DecodeKernel::kBulk;
  return small_grid ? DecodeKernel::kStagedLatency : DecodeKernel::kStaged;
}

// The warp kernel's launch: value rows per warp and the L2 policy of its state accesses.
struct DecodeWarpConfig {
  int rows = 8;         // 4, 8 or 16 value rows per warp
  bool stream = false;  // state loads / stores with the streaming (evict-first) hint
};

// The warp kernel's rows are 8 while the call has <= 64 value rows per SM (B <= 2 at HV = 32 on
// 132 SMs: ~4-8 warps per SM, the shortest per-warp chain that fills the SMs), else 16 (half the
// redundant token preprocessing per row; a B = 8 grid is 2048 warps, 12 resident per SM at 168
// registers: 1.3 waves, 96 KB of state in flight per SM). The state goes through L2 with the
// normal policy while the rows the call touches fit in kDecodeWarpL2Bytes (B <= 12 at HV = 32),
// so that a state written by one call is still in L2 when the next call (the next step of the
// same layer in a CUDA graph of steps) reads it; larger calls stream it (evict-first), as the
// other kernels do. Tuning::decode_warp_rows / decode_warp_cache override either.
inline constexpr int64_t kDecodeWarpL2Bytes = int64_t{24} << 20;

inline DecodeWarpConfig choose_warp_config(const detail::DecodeProblem& pr, int sms,
                                           const detail::Tuning& tuning) {
  DecodeWarpConfig c;
  const int64_t rows = pr.d.N * pr.d.HV * pr.d.V;
  c.rows = rows <= int64_t{64} * sms ? 8 : 16;
  if (tuning.decode_warp_rows == 4 || tuning.decode_warp_rows == 8 || tuning.decode_warp_rows == 16)
    c.rows = tuning.decode_warp_rows;
  const int64_t state_bytes = rows * pr.d.K * static_cast<int64_t>(dtype_size(pr.state.dtype));
  c.stream = state_bytes > kDecodeWarpL2Bytes;
  if (tuning.decode_warp_cache == detail::DecodeStateCache::kNormal) c.stream = false;
  if (tuning.decode_warp_cache == detail::DecodeStateCache::kStream) c.stream = true;
  return c;
}

}  // namespace kda::cuda
