// host.h — host side of the CUDA prefill backward shared by the launcher (backward/backward.cu)
// and the kernels' CPU emulation (dev/prefill_emu): workspace layout, kernel parameters and the
// launch sequence.
#pragma once

#include <cstdint>
#include <string>

#include "core/problem.h"
#include "core/tuning.h"
#include "cuda/backward/kernels.cuh"
#include "cuda/backward/passes_wg.cuh"
#include "cuda/prefill/host.h"

namespace kda::cuda::bw {

// Workspace: [records][states][dstates][dq^ dk^][partials][uw][scratch], each part 256-byte
// aligned. The uw part (kUwFloats, ~145 KB per chunk slot and value head) holds bwd_sprod_kernel's
// results (Tuning::backward_wgmma); it is part of the size either way, so that the size does not
// depend on the tuning.
struct WorkspaceLayout {
  size_t rec = 0, states = 0, dstates = 0, dqk = 0, part = 0, uw = 0, scratch = 0, total = 0;
  int64_t chunk_blocks = 0;
};
inline size_t align256(size_t x) { return (x + 255) & ~static_cast<size_t>(255); }

// Blocks of bwd_chunk_kernel: one per SM (its shared memory allows no second), at most one per
// (chunk slot, value head).
inline int64_t chunk_blocks(int64_t tasks, int num_sms) {
  const int64_t b = num_sms > 0 ? num_sms : 1;
  return tasks < b ? tasks : b;
}

inline WorkspaceLayout workspace_layout(const detail::PrefillProblem& pr, int num_sms) {
  WorkspaceLayout w;
  const int64_t tasks = pf::chunk_slots(pr) * pr.d.HV;
  if (tasks <= 0 || pr.d.N <= 0) return w;
  const size_t t = static_cast<size_t>(tasks);
  w.chunk_blocks = chunk_blocks(tasks, num_sms);
  w.rec = 0;
  w.states = align256(w.rec + t * kRecFloats * 4);
  w.dstates = align256(w.states + t * kStateFloats * 4);
  w.dqk = align256(w.dstates + t * kStateFloats * 4);
  w.part = align256(w.dqk + t * 2 * kTile * 4);
  w.uw = align256(w.part + t * kPartFloats * 4);
  w.scratch = align256(w.uw + t * kUwFloats * 4);
  w.total = align256(w.scratch + static_cast<size_t>(w.chunk_blocks) * kScratchFloats * 4) + 256;
  return w;
}

inline Status check_supported(const detail::PrefillBackwardProblem& bp) {
  KDA_RETURN_IF_ERROR(pf::check_supported(bp.fwd));
  const int64_t tasks = pf::chunk_slots(bp.fwd) * bp.fwd.d.HV;
  if (tasks > INT32_MAX || bp.fwd.d.N * bp.fwd.d.HV * kSlices > INT32_MAX)
    return {StatusCode::kUnsupported, "q",
            "problem too large for one CUDA prefill backward launch (" + std::to_string(tasks) +
                " chunk blocks)"};
  return Status::Ok();
}

inline StridedView grad_view(const TensorView& t) { return strided_view(t); }

// Kernel parameters of a validated, supported problem with its workspace at `workspace` (at
// least workspace_layout(...).total bytes; the pointers only point into it). The wgmma kernels
// of passes_wg.cuh as the tuning says: the state products (Tuning::backward_wgmma), the state
// passes (Tuning::backward_wg_passes).
inline void make_params(const detail::PrefillBackwardProblem& bp, void* workspace, int num_sms,
                        const detail::Tuning& tuning, BwdParams* out) {
  const detail::PrefillProblem& pr = bp.fwd;
  BwdParams& P = *out;
  P = BwdParams{};
  Params& p = P.f;
  pf::input_params(pr, &p);
  p.initial_state = pf::state_view(pr.initial_state);
  p.kfirst = pr.layout == StateLayout::kKFirst;

  P.d_out = strided_view(bp.d_out);
  P.d_final_state = pf::state_view(bp.d_final_state);
  P.dq = grad_view(bp.dq);
  P.dk = grad_view(bp.dk);
  P.dv = grad_view(bp.dv);
  P.dg = grad_view(bp.dg);
  P.dbeta = grad_view(bp.dbeta);
  if (bp.dA_log.present()) {
    P.dA_log = static_cast<float*>(bp.dA_log.data);
    P.dA_log_s = bp.dA_log.strides[0];
  }
  if (bp.ddt_bias.present()) {
    P.ddt_bias = static_cast<float*>(bp.ddt_bias.data);
    P.ddt_bias_s = bp.ddt_bias.strides[0];
  }
  P.d_initial_state = pf::state_view(bp.d_initial_state);

  const WorkspaceLayout w = workspace_layout(pr, num_sms);
  if (w.total == 0 || workspace == nullptr) return;
  const uintptr_t a = reinterpret_cast<uintptr_t>(workspace);
  uint8_t* base = reinterpret_cast<uint8_t*>((a + 255) & ~static_cast<uintptr_t>(255));
  P.rec = reinterpret_cast<float*>(base + w.rec);
  P.states = reinterpret_cast<float*>(base + w.states);
  P.dstates = reinterpret_cast<float*>(base + w.dstates);
  P.dqk = reinterpret_cast<float*>(base + w.dqk);
  P.part = reinterpret_cast<float*>(base + w.part);
  P.uw = reinterpret_cast<float*>(base + w.uw);
  P.wg = tuning.backward_wgmma;
  P.wg_passes = tuning.backward_wg_passes;
  P.scratch = reinterpret_cast<float*>(base + w.scratch);
  P.chunk_blocks = w.chunk_blocks;
}

// The launches of a call, in stream order (kernels.cuh). `N == 0` or no chunk slot: only the
// parameter kernel (zero dA_log / ddt_bias) and, for d_initial_state, the reverse pass. P.wg: the
// state products on wgmma, P.wg_passes: the state passes on wgmma (passes_wg.cuh).
enum class BwdKernel {
  kPrepare,
  kStates,
  kDStates,
  kStatesWg,
  kDStatesWg,
  kSProd,
  kChunk,
  kQk,
  kParams
};
inline constexpr int kMaxBwdLaunches = 7;
struct BwdLaunch {
  BwdKernel kernel;
  int64_t blocks;
  int threads, smem;
};
inline int plan_launches(const BwdParams& P, BwdLaunch (&out)[kMaxBwdLaunches]) {
  const Params& p = P.f;
  const bool wg = P.wg_passes;
  int n = 0;
  // No workspace (no sequence or no chunk slot): no chunk to process.
  const int64_t tasks = P.rec != nullptr ? p.num_slots * p.HV : 0;
  const int64_t pass_blocks = p.N * p.HV * (wg ? kWgSlices : kSlices);
  const BwdLaunch states =
      wg ? BwdLaunch{BwdKernel::kStatesWg, pass_blocks, kWgThreads, kWgStatesSmem}
         : BwdLaunch{BwdKernel::kStates, pass_blocks, kPassThreads, kPassSmemBytes};
  const BwdLaunch dstates =
      wg ? BwdLaunch{BwdKernel::kDStatesWg, pass_blocks, kWgThreads, kWgDStatesSmem}
         : BwdLaunch{BwdKernel::kDStates, pass_blocks, kPassThreads, kPassSmemBytes};
  if (tasks > 0) {
    out[n++] = {BwdKernel::kPrepare, tasks, kPrepThreads, kPrepSmemBytes};
    out[n++] = states;
  }
  if (pass_blocks > 0) out[n++] = dstates;
  if (tasks > 0) {
    if (P.wg) out[n++] = {BwdKernel::kSProd, tasks, kSpThreads, kSprodSmem};
    out[n++] = {BwdKernel::kChunk, P.chunk_blocks, kChunkThreads, kChunkSmemBytes};
    // One value head per q/k head: bwd_chunk_kernel writes dq and dk itself.
    if ((P.dq.data != nullptr || P.dk.data != nullptr) && p.groups > 1)
      out[n++] = {BwdKernel::kQk, p.num_slots * p.H, kQkThreads, 0};
  }
  if ((P.dA_log != nullptr || P.ddt_bias != nullptr) && p.HV > 0)
    out[n++] = {BwdKernel::kParams, p.HV, kParamThreads, 0};
  return n;
}

}  // namespace kda::cuda::bw
