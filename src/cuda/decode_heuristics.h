// decode_heuristics.h — the CUDA decode's kernel choice, as pure host functions (no CUDA headers;
// tested on the CPU in tests/test_gpu_decode.cpp, DecodeHeuristics.*). The kernels are in
// decode_sm90.cu.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/problem.h"

namespace kda::cuda {

// K = V of the staged, bulk and persistent kernels (decode_sm90.cu asserts it).
inline constexpr int64_t kDecodeFastK = 128;

// kStagedLatency / kBulkLatency: the staged / bulk kernel's variant for grids of <= 2 blocks per SM.
enum class DecodeKernel { kBaseline, kTile, kPersistent, kStaged, kStagedLatency, kBulk, kBulkLatency };

// 16-byte aligned data and row strides (every dimension but the last): 16-byte vector and bulk
// copies of whole rows.
inline bool rows_aligned16(const TensorView& t) {
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0) return false;
  const int64_t es = static_cast<int64_t>(dtype_size(t.dtype));
  for (int i = 0; i + 1 < t.ndim; ++i)
    if (t.shape[i] > 1 && (t.strides[i] * es) % 16 != 0) return false;
  return true;
}

// The one kernel heuristic (pure host function). For V-first, K = V = 128 and a pool with 16-byte
// aligned rows (and every state tensor the bulk kernels write with aligned rows): the bulk kernel's
// latency variant for dense single-token calls with <= 2 blocks per SM or a bf16 pool, the bulk
// kernel ("v4") for fp32 pools with >= 64 blocks per SM, the staged kernel's latency variant for
// other grids of <= 2 blocks per SM, the staged kernel ("v3") otherwise (any token count, dense or
// varlen, every index / state-output mode). Everything else (K-first, K != 128, unaligned pools) runs the tile kernel. The persistent
// kernel takes V-first K = V = 128, an aligned pool, dense tokens, T <= 8, >= 2 ring stages, and
// runs only when asked for: measured on the H200 (docs/perf_decode.md) it was slower than the tile
// kernel (B = 256: 398 us vs 363 us; B = 1024: 2087 vs 1550; T = 4: 1273 vs 816). The baseline
// kernel runs only on request. KDA_CUDA_DECODE_KERNEL = baseline | tile | staged (the throughput
// variant) | bulk | bulklat (the bulk latency variant) | persistent overrides (where eligible;
// otherwise the default choice).
inline DecodeKernel choose_kernel(const detail::DecodeProblem& pr, int stages, int sms, const char* env) {
  auto is = [env](const char* name) { return env != nullptr && std::strcmp(env, name) == 0; };
  if (is("baseline")) return DecodeKernel::kBaseline;
  if (is("tile")) return DecodeKernel::kTile;
  const bool staged_ok = pr.layout == StateLayout::kVFirst && pr.d.K == kDecodeFastK && pr.d.V == kDecodeFastK &&
                         rows_aligned16(pr.state);
  const bool persistent_ok = staged_ok && !pr.d.varlen && stages >= 2;
  if (is("persistent") && persistent_ok) return DecodeKernel::kPersistent;
  if (!staged_ok) return DecodeKernel::kTile;
  if (is("staged")) return DecodeKernel::kStaged;
  // The bulk kernel stores whole rows with the copy engine: every state tensor it may write needs
  // 16-byte aligned rows (the pool was checked above).
  const bool bulk_ok = (!pr.final_state.present() || rows_aligned16(pr.final_state)) &&
                       (!pr.intermediate_states.present() || rows_aligned16(pr.intermediate_states));
  if (is("bulk") && bulk_ok) return DecodeKernel::kBulk;
  const bool one_token = !pr.d.varlen && pr.d.T == 1;
  if (is("bulklat") && bulk_ok && one_token) return DecodeKernel::kBulkLatency;
  // Measured on the H200 (docs/perf_decode.md, v4): the bulk kernel streams faster once there
  // are many waves of blocks (fp32 B = 256: 314 vs 336 us; B = 1024: 1212 vs 1307 us), but one
  // 16 KB bulk copy has a longer latency than 128 threads' cp.async (B = 1: 10.5 vs 9.7 us; B =
  // 32: 53.5 vs 52.2 us) and the bf16 state's 8 KB tiles were slower (310 vs 268 us at B = 256).
  // Grids of at most 2 blocks per SM (B = 1, 2 at HV = 32) run a latency variant: their time is
  // the critical path, not the bytes in flight. Dense single-token calls take the bulk kernel's
  // (bulk copy in, s' stored from registers), also for every bf16 pool: measured on the H200
  // (session 4, docs/perf_decode.md v8), B = 1 in a 20-call graph 4.53 us against 5.06 for the
  // staged latency variant, one call 7.4 vs 8.0 us, bf16 state at B = 256 193 vs 233 us; fp32
  // at B = 256 / 1024 it is slower than the bulk kernel (287 vs 279 us, 1128 vs 1097 us).
  const int64_t blocks = pr.d.N * pr.d.HV * (pr.d.V / 32);
  const bool small_grid = blocks <= int64_t{2} * sms;
  if (bulk_ok && one_token && (small_grid || pr.state.dtype == DType::kBFloat16)) return DecodeKernel::kBulkLatency;
  if (bulk_ok && blocks >= int64_t{64} * sms && pr.state.dtype == DType::kFloat32) return DecodeKernel::kBulk;
  return small_grid ? DecodeKernel::kStagedLatency : DecodeKernel::kStaged;
}

}  // namespace kda::cuda
