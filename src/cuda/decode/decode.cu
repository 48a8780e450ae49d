// decode.cu — CUDA decode on Hopper (spec section 5): one or a few tokens per sequence
// against a state pool, at memory speed.
//
// Design. Decode is memory bound: every call reads and writes the whole state of each active
// (sequence, value head) once, and the per-token inputs are tiny. One block owns a tile of 32 value
// rows of one (sequence n, value head hv); the grid is N x HV x V/32 blocks (B = 256, HV = 32,
// V = 128: 32768 blocks of 128 threads). The tile lives in registers, 32 state elements per thread,
// read with 16-byte loads that are all issued before the first use, then kept across the tokens of
// the sequence (T = 1..8 typical, any T works), and written with 16-byte stores.
//
//   V-first [.., HV, V, K]: each value row is K contiguous elements. kKLanes = K/16 consecutive
//     lanes share a row, each holding 16 k elements (fp32: four 16-byte vectors interleaved so a
//     warp instruction reads whole 128-byte lines); a thread holds 2 rows. The k reductions
//     (S^T k and S^T q) are xor butterflies over the row's lanes: no shared memory, no barrier.
//   K-first [.., HV, K, V]: threads along V: a thread holds one 16-byte vector of 4 (fp32) or
//     8 (bf16) value columns for 8 (or 4) consecutive k rows; the lanes of one column group cover
//     all of K and reduce with the same butterflies.
//
// Per-token preprocessing (l2norm of q and k, scale, gate -> decay, beta activation) is computed
// redundantly by every row group from L1/L2-resident inputs: each lane loads only the k elements
// it holds, and the l2 norms reuse the row butterflies. A bf16 state is widened to fp32 and
// rounded back to bf16 after every token, exactly as the reference does; the output of a token
// reads the state before that rounding (as the reference does).
//
// Staged tile kernel (decode/staged.cuh, the default for the hot shape: V-first, K = V = 128, fp32
// or bf16 pool with 16-byte aligned rows; any T, dense or varlen, every index / output mode, except
// the large fp32 batches the bulk kernel takes). The tile kernel's block and thread map, but the
// tile is staged through shared memory with 16-byte cp.async (each thread copies exactly the units
// it reads, so cp.async.wait_all + the token barrier is all the synchronization) and the recurrence
// streams it from shared memory in two passes, so 48 registers (no spills) and 19.5 KB (fp32) /
// 11.5 KB (bf16) of shared memory per block: 10 blocks (160 KB of state loads) in flight per SM
// instead of 6 (96 KB). Warp 0 preprocesses each token once per block (bitwise the same as the
// tile kernel's stage_token); token 0's input loads of a dense row are
// issued before the index loads are consumed. The k products are summed in four partial sums
// (k mod 4) to shorten the dependency chains, so results match the tile kernel up to
// reassociation. A latency variant (no register bound, unrolled passes) runs grids of at most
// two blocks per SM (B = 1, 2 at HV = 32). See docs/perf_decode.md, "smem-staged tile kernel" and
// "bulk-copy kernel". Unaligned pools, K-first and K != 128 run the tile kernel.
//
// Bulk kernel (decode/bulk.cuh, the default for fp32 pools when the grid has >= 64 blocks per SM,
// e.g. B >= 66 at HV = 32): the staged kernel's arithmetic (bitwise the same), but the copy engine
// moves the tile: one cp.async.bulk in (per row when rows are padded), s' written back in place in
// shared memory, one bulk copy out. Dense single-token calls use a one-slot token stage: 18.3 KB of
// shared memory and 40 registers, 12 blocks per SM. Its latency
// variant (no register bound, passes unrolled, s' stored from registers during pass 2 instead of
// the write-back, barrier and bulk store) is the default for dense single-token calls on grids
// of <= 2 blocks per SM and with every bf16 pool (docs/perf_decode.md, "a latency variant of the
// bulk kernel").
//
// Warp kernel (decode/warp.cuh, the default for dense single-token fp32 calls of at most 512 value
// rows per SM, B <= 16 at HV = 32 on 132 SMs): one warp per 4, 8 or 16 value rows of one head, the
// rows in registers (lane l holds k = 4 l .. 4 l + 3 of each), token preprocessing by every lane
// for its own k (no shared memory, no block barrier), the k sums as warp reduce-scatters; kernel
// parameters pulled into the constant caches before the PDL wait; the state through L2 with the
// normal policy when the call's rows fit in 24 MiB (a CUDA graph of steps then reads the previous
// step's state from L2), else streaming (heuristics/decode.h, choose_warp_config).
//
// Every kernel starts with pdl_prologue() (the warp kernel: its two halves, with parameter-only
// work between them) and is launched with programmatic dependent launch (common/launch.cuh): the
// next kernel's launch overlaps this one's tail.
//
// Byte model (what the benchmark counts): state 2 x B x HV x K x V x sizeof(state) (read once,
// written once; more writes with per-token states) + q, k, v, g, beta, out once each. The extra
// traffic of the redundant q/k/g reads (V/32 tiles per head, HV/H heads per q/k head) hits L2.
//
// Budget (ptxas 13.0, sm_90a): the tile kernel's V-first K = 128 tiles use 79 (fp32) / 80 (bf16)
// registers and 6 KB of shared memory per 128-thread block, so 6 blocks (24 warps, 96 KB of state
// loads in flight) fit on an SM. No kernel spills, except a few bytes in the bulk kernels (4-52 B
// outside the passes: -DKDA_PTXAS_VERBOSE=ON shows them).
//
// Kernels (one family per header of decode/): decode_bulk_kernel<StateT, kSlots, kLatency> (6
// instantiations), decode_staged_kernel<StateT, kLatency> (4), decode_warp_kernel<kRows> (3),
// decode_tile_kernel<kMaxK, StateT, kKFirst> (12), and decode_baseline_kernel, the tested
// reference. choose_kernel
// (heuristics/decode.h, host only, tested in the CPU build) is the one heuristic;
// Tuning::decode_kernel (KDA_CUDA_DECODE_KERNEL) overrides it where eligible (docs/tuning.md). A
// persistent, software-pipelined kernel was measured slower and removed (docs/perf_decode.md).
// Nothing is allocated on the device and nothing synchronizes, except check_indices, which copies
// the index tensors to the host and waits for them.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/problem.h"
#include "core/tuning.h"
#include "cuda/common/check.h"
#include "cuda/common/device.h"
#include "cuda/common/launch.cuh"
#include "cuda/cuda_backend.h"
#include "cuda/decode/baseline.cuh"
#include "cuda/decode/bulk.cuh"
#include "cuda/decode/single.cuh"
#include "cuda/decode/staged.cuh"
#include "cuda/decode/tile.cuh"
#include "cuda/decode/warp.cuh"
#include "cuda/heuristics/decode.h"

namespace kda::cuda {
namespace {

using namespace dec;

IndexTensor to_index(const TensorView& t) {
  IndexTensor r;
  if (!t.present()) return r;
  r.data = t.data;
  r.s0 = t.strides[0];
  r.s1 = t.ndim > 1 ? t.strides[1] : 0;
  r.is64 = t.dtype == DType::kInt64;
  return r;
}

DecodeArgs make_args(const detail::DecodeProblem& pr) {
  DecodeArgs a;
  a.q = strided_view(pr.q);
  a.k = strided_view(pr.k);
  a.v = strided_view(pr.v);
  a.g = strided_view(pr.g);
  a.beta = strided_view(pr.beta);
  a.out = strided_view(pr.out);
  a.dt_bias = strided_view(pr.dt_bias);
  if (pr.A_log.present()) {
    a.A_log = static_cast<const float*>(pr.A_log.data);
    a.A_log_s0 = pr.A_log.strides[0];
  }
  a.cu_seqlens = to_index(pr.cu_seqlens);
  a.state_indices = to_index(pr.state_indices);
  a.num_accepted_tokens = to_index(pr.num_accepted_tokens);
  a.state = strided_view(pr.state);
  a.final_state = strided_view(pr.final_state);
  a.intermediate_states = strided_view(pr.intermediate_states);
  a.N = pr.d.N;
  a.T = pr.d.T;
  a.Tmax = pr.Tmax;
  a.P = pr.state.shape[0];
  a.H = static_cast<int>(pr.d.H);
  a.HV = static_cast<int>(pr.d.HV);
  a.K = static_cast<int>(pr.d.K);
  a.V = static_cast<int>(pr.d.V);
  a.groups = static_cast<int>(pr.d.groups());
  a.gate = static_cast<int>(pr.math.gate);
  a.scale = static_cast<float>(pr.math.scale);
  a.lower_bound = pr.math.lower_bound;
  a.varlen = pr.d.varlen;
  a.has_indices = pr.state_indices.present();
  a.indices_2d = pr.indices_2d;
  a.has_num_accepted = pr.num_accepted_tokens.present();
  a.has_final_state = pr.final_state.present();
  a.has_intermediate = pr.intermediate_states.present();
  a.use_initial_state = pr.use_initial_state;
  a.store_final_state = pr.store_final_state;
  a.use_qk_l2norm = pr.math.use_qk_l2norm;
  a.beta_logits = pr.math.beta_logits;
  a.allow_neg_eigval = pr.math.allow_neg_eigval;
  a.beta_per_v = pr.beta_per_v;
  return a;
}

// check_indices: copies state_indices / num_accepted_tokens / cu_seqlens to the host (same
// strided layout), waits for them, and checks their values.
// The single-token kernel's parameters (single_ok(pr) holds: T = 1, dense, [N] indices or none).
SingleArgs make_single_args(const detail::DecodeProblem& pr) {
  SingleArgs a;
  a.q = pr.q.data, a.k = pr.k.data, a.v = pr.v.data, a.g = pr.g.data, a.beta = pr.beta.data;
  a.out = pr.out.data;
  a.q_s0 = pr.q.strides[0], a.q_s2 = pr.q.strides[2];
  a.k_s0 = pr.k.strides[0], a.k_s2 = pr.k.strides[2];
  a.v_s0 = pr.v.strides[0], a.v_s2 = pr.v.strides[2];
  a.g_s0 = pr.g.strides[0], a.g_s2 = pr.g.strides[2];
  a.beta_s0 = pr.beta.strides[0], a.beta_s2 = pr.beta.strides[2];
  a.out_s0 = pr.out.strides[0], a.out_s2 = pr.out.strides[2];
  if (pr.dt_bias.present()) {
    a.dt_bias = pr.dt_bias.data;
    a.dt_bias_s0 = pr.dt_bias.strides[0];
    a.bias_bf16 = pr.dt_bias.dtype == DType::kBFloat16;
  }
  if (pr.A_log.present()) {
    a.A_log = static_cast<const float*>(pr.A_log.data);
    a.A_log_s0 = pr.A_log.strides[0];
  }
  if (pr.state_indices.present()) {
    a.idx = pr.state_indices.data;
    a.idx_s0 = pr.state_indices.strides[0];
    a.idx64 = pr.state_indices.dtype == DType::kInt64;
  }
  a.state = static_cast<float*>(pr.state.data);
  a.state_s0 = pr.state.strides[0], a.state_s1 = pr.state.strides[1];
  a.state_s2 = pr.state.strides[2];
  if (pr.final_state.present()) {
    a.final_state = static_cast<float*>(pr.final_state.data);
    a.fs_s0 = pr.final_state.strides[0], a.fs_s1 = pr.final_state.strides[1];
    a.fs_s2 = pr.final_state.strides[2];
  }
  a.P = pr.state.shape[0];
  a.HV = static_cast<int>(pr.d.HV);
  a.groups = static_cast<int>(pr.d.groups());
  a.gate = static_cast<int>(pr.math.gate);
  a.scale = static_cast<float>(pr.math.scale);
  a.lower_bound = pr.math.lower_bound;
  a.g_f32 = pr.g.dtype == DType::kFloat32;
  a.beta_f32 = pr.beta.dtype == DType::kFloat32;
  a.out_f32 = pr.out.dtype == DType::kFloat32;
  a.beta_per_v = pr.beta_per_v;
  a.use_initial_state = pr.use_initial_state;
  a.store_state = pr.store_final_state;
  a.l2norm = pr.math.use_qk_l2norm;
  a.beta_logits = pr.math.beta_logits;
  a.allow_neg_eigval = pr.math.allow_neg_eigval;
  return a;
}

// The single-token kernel's kPlain case (decode/single.cuh).
bool single_plain(const detail::DecodeProblem& pr) {
  const DType in = pr.q.dtype;
  return pr.g.dtype == in && pr.beta.dtype == in && pr.out.dtype == in && pr.dt_bias.present() &&
         pr.dt_bias.dtype == DType::kFloat32 && pr.A_log.present() && pr.state_indices.present() &&
         pr.state_indices.dtype == DType::kInt32 && !pr.beta_per_v && pr.use_initial_state &&
         pr.store_final_state && !pr.final_state.present() && pr.math.use_qk_l2norm;
}

// Grid (HV x V / 32, N): single_ok keeps N within the grid's y limit.
Status launch_single(const detail::DecodeProblem& pr, cudaStream_t stream) {
  const SingleArgs a = make_single_args(pr);
  const bool bf16 = pr.q.dtype == DType::kBFloat16, plain = single_plain(pr);
  void (*kernel)(SingleArgs) =
      bf16 ? (plain ? decode_single_kernel<__nv_bfloat16, true>
                    : decode_single_kernel<__nv_bfloat16, false>)
           : (plain ? decode_single_kernel<__half, true> : decode_single_kernel<__half, false>);
  const dim3 grid(static_cast<unsigned>(pr.d.HV * (kSingleK / 32)), static_cast<unsigned>(pr.d.N));
  KDA_CUDA_CHECK(launch_kernel(kernel, grid, dim3(kSingleThreads), 0, stream, a));
  return Status::Ok();
}

Status check_index_values(const detail::DecodeProblem& pr, cudaStream_t stream) {
  std::vector<uint8_t> idx, nat, cu;
  KDA_RETURN_IF_ERROR(copy_to_host_async(pr.state_indices, stream, &idx));
  KDA_RETURN_IF_ERROR(copy_to_host_async(pr.num_accepted_tokens, stream, &nat));
  KDA_RETURN_IF_ERROR(copy_to_host_async(pr.cu_seqlens, stream, &cu));
  KDA_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (pr.d.varlen)
    KDA_RETURN_IF_ERROR(detail::check_cu_seqlens_values(host_view(pr.cu_seqlens, cu), pr.d.T));
  return detail::check_decode_index_values(pr, idx.empty() ? nullptr : idx.data(),
                                           nat.empty() ? nullptr : nat.data(),
                                           cu.empty() ? nullptr : cu.data());
}

template <int kMaxK, typename StateT, bool kKFirst>
Status launch_tile(const DecodeArgs& a, int64_t blocks, cudaStream_t stream) {
  using Map = TileMap<kMaxK, StateT, kKFirst>;
  KDA_CUDA_CHECK(launch_kernel(decode_tile_kernel<kMaxK, StateT, kKFirst>,
                               dim3(static_cast<unsigned>(blocks)), dim3(Map::kThreads), 0, stream,
                               a));
  return Status::Ok();
}

// The tile kernel's dispatch: K tile x state dtype x layout.
template <typename StateT>
Status dispatch_tile(const DecodeArgs& a, bool k_first, int64_t blocks, cudaStream_t stream) {
  if (a.K <= 64)
    return k_first ? launch_tile<64, StateT, true>(a, blocks, stream)
                   : launch_tile<64, StateT, false>(a, blocks, stream);
  if (a.K <= 128)
    return k_first ? launch_tile<128, StateT, true>(a, blocks, stream)
                   : launch_tile<128, StateT, false>(a, blocks, stream);
  if (a.K <= 256)
    return k_first ? launch_tile<256, StateT, true>(a, blocks, stream)
                   : launch_tile<256, StateT, false>(a, blocks, stream);
  return {StatusCode::kUnsupported, "q",
          "the CUDA decode supports K up to 256, got K = " + std::to_string(a.K)};
}

// Launches a 128-thread decode kernel with static shared memory, with the whole unified L1 /
// shared array as shared memory (set once per kernel and device).
Status launch_max_shared(void (*kernel)(DecodeArgs), DeviceAttributes& d, int slot_offset,
                         KernelSlot slot, int64_t blocks, cudaStream_t stream,
                         const DecodeArgs& a) {
  KDA_RETURN_IF_ERROR(configure_once(d, slot, slot_offset, [&] {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                cudaSharedmemCarveoutMaxShared);
  }));
  KDA_CUDA_CHECK(launch_kernel(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kStagedThreads), 0,
                               stream, a));
  return Status::Ok();
}

template <typename StateT>
Status launch_staged(const DecodeArgs& a, DeviceAttributes& d, int64_t blocks, bool latency,
                     cudaStream_t stream) {
  const int which = (sizeof(StateT) == 2 ? 1 : 0) + (latency ? 2 : 0);
  return launch_max_shared(
      latency ? decode_staged_kernel<StateT, true> : decode_staged_kernel<StateT, false>, d, which,
      KernelSlot::kStaged, blocks, stream, a);
}

template <typename StateT>
Status launch_bulk(const DecodeArgs& a, DeviceAttributes& d, int64_t blocks, bool latency,
                   cudaStream_t stream) {
  const bool one_token = !a.varlen && a.T == 1;
  latency = latency && one_token;  // the latency variant handles one token per row only
  const int which = (sizeof(StateT) == 2 ? 1 : 0) + (one_token ? 2 : 0) + (latency ? 4 : 0);
  return launch_max_shared(latency     ? decode_bulk_kernel<StateT, 1, true>
                           : one_token ? decode_bulk_kernel<StateT, 1>
                                       : decode_bulk_kernel<StateT, 2>,
                           d, which, KernelSlot::kBulk, blocks, stream, a);
}

// The warp kernel: kRows value rows per warp, four warps per block.
Status launch_warp(const DecodeArgs& a, const DecodeWarpConfig& c, cudaStream_t stream) {
  const int64_t warps = a.N * a.HV * (a.V / c.rows);
  const int64_t blocks = (warps + kWarpThreads / 32 - 1) / (kWarpThreads / 32);
  if (warps > INT32_MAX)
    return {StatusCode::kUnsupported, "q",
            "N x HV x V/" + std::to_string(c.rows) + " = " + std::to_string(warps) +
                " warps exceed the grid limit; split the batch"};
  DecodeArgs w = a;
  w.state_stream = c.stream;
  void (*kernel)(DecodeArgs) = c.rows == 4   ? decode_warp_kernel<4>
                               : c.rows == 8 ? decode_warp_kernel<8>
                                             : decode_warp_kernel<16>;
  KDA_CUDA_CHECK(
      launch_kernel(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kWarpThreads), 0, stream, w));
  return Status::Ok();
}

}  // namespace

Status decode(const detail::DecodeProblem& pr, const ExecOptions& exec, bool check_indices) {
  // ---- What the GPU path runs (everything else the contract allows runs on the CPU backends)
  if (pr.q.dtype != DType::kBFloat16 && pr.q.dtype != DType::kFloat16)
    return {StatusCode::kUnsupported, "q",
            std::string("the CUDA decode expects dtype bf16 or fp16, got ") +
                dtype_name(pr.q.dtype) + " (fp32 inputs run on the CPU backends)"};
  if (pr.state.dtype != DType::kFloat32 && pr.state.dtype != DType::kBFloat16)
    return {StatusCode::kUnsupported, "state",
            std::string("the CUDA decode expects dtype fp32 or bf16, got ") +
                dtype_name(pr.state.dtype)};
  if (pr.d.K != pr.d.V || pr.d.K % 32 != 0 || pr.d.K > 256)
    return {StatusCode::kUnsupported, "q",
            "the CUDA decode expects K == V, a multiple of 32 up to 256, got K = " +
                std::to_string(pr.d.K) + ", V = " + std::to_string(pr.d.V)};

  DeviceGuard guard(pr.q.device_index);
  KDA_CUDA_CHECK(guard.status());
  cudaStream_t stream = static_cast<cudaStream_t>(exec.stream);
  if (check_indices) KDA_RETURN_IF_ERROR(check_index_values(pr, stream));
  if (pr.d.N == 0) return Status::Ok();

  DeviceAttributes* info = nullptr;
  KDA_RETURN_IF_ERROR(device_attributes(pr.q.device_index, &info));
  const detail::Tuning& tuning = detail::tuning();
  const DecodeKernel kernel = choose_kernel(pr, info->sms, tuning);
  // The single-token kernel has its own, smaller parameter block.
  if (kernel == DecodeKernel::kSingle) return launch_single(pr, stream);
  const DecodeArgs a = make_args(pr);
  const bool k_first = pr.layout == StateLayout::kKFirst;
  const bool bf16_state = pr.state.dtype == DType::kBFloat16;
  if (kernel == DecodeKernel::kBaseline) {
    const int64_t blocks = pr.d.N * pr.d.HV;
    if (blocks > INT32_MAX)
      return {StatusCode::kUnsupported, "q",
              "N x HV = " + std::to_string(blocks) + " blocks exceed the grid limit"};
    KDA_CUDA_CHECK(launch_kernel(decode_baseline_kernel, dim3(static_cast<unsigned>(blocks)),
                                 dim3(static_cast<unsigned>(a.V)), 0, stream, a, k_first));
    return Status::Ok();
  }
  if (kernel == DecodeKernel::kWarp)
    return launch_warp(a, choose_warp_config(pr, info->sms, tuning), stream);
  const int64_t blocks = pr.d.N * pr.d.HV * (pr.d.V / 32);
  if (blocks > INT32_MAX)
    return {StatusCode::kUnsupported, "q",
            "N x HV x V/32 = " + std::to_string(blocks) +
                " blocks exceed the grid limit; split the batch"};
  if (kernel == DecodeKernel::kBulk || kernel == DecodeKernel::kBulkLatency) {
    const bool latency = kernel == DecodeKernel::kBulkLatency;
    return bf16_state ? launch_bulk<__nv_bfloat16>(a, *info, blocks, latency, stream)
                      : launch_bulk<float>(a, *info, blocks, latency, stream);
  }
  if (kernel == DecodeKernel::kStaged || kernel == DecodeKernel::kStagedLatency) {
    const bool latency = kernel == DecodeKernel::kStagedLatency;
    return bf16_state ? launch_staged<__nv_bfloat16>(a, *info, blocks, latency, stream)
                      : launch_staged<float>(a, *info, blocks, latency, stream);
  }
  if (bf16_state) return dispatch_tile<__nv_bfloat16>(a, k_first, blocks, stream);
  return dispatch_tile<float>(a, k_first, blocks, stream);
}

}  // namespace kda::cuda
