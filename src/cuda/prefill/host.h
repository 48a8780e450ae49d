// host.h — host side of the CUDA prefill shared by the launcher (prefill/prefill.cu) and the
// kernels' CPU emulation used in development: support checks, workspace size, kernel parameters.
#pragma once

#include <cstdint>
#include <string>

#include "core/problem.h"
#include "core/tuning.h"
#include "cuda/heuristics/prefill.h"
#include "cuda/prefill/common.cuh"
#include "cuda/prefill/fused.cuh"
#include "cuda/prefill/prepare_smem.cuh"
#include "cuda/prefill/recurrence_steps.cuh"
#include "cuda/prefill/single.cuh"

namespace kda::cuda::pf {

inline StateView state_view(const TensorView& t) {
  StateView s;
  if (!t.present()) return s;
  s.data = t.data;
  s.rows = t.shape[0];
  s.s0 = t.strides[0];
  s.s1 = t.strides[1];
  s.s2 = t.strides[2];
  s.dtype = static_cast<int>(t.dtype);
  return s;
}

inline IndexView index_view(const TensorView& t) {
  IndexView v;
  if (!t.present()) return v;
  v.data = t.data;
  v.stride = t.strides[0];
  v.is64 = t.dtype == DType::kInt64;
  return v;
}

inline Status check_supported(const detail::PrefillProblem& pr) {
  const auto& d = pr.d;
  if (pr.q.dtype != DType::kBFloat16 && pr.q.dtype != DType::kFloat16)
    return {
        StatusCode::kUnsupported, "q",
        std::string("the CUDA prefill takes bf16 or fp16 q/k/v, got ") + dtype_name(pr.q.dtype)};
  if (d.K != kHeadDim)
    return {StatusCode::kUnsupported, "q",
            "the CUDA prefill supports head dim K = 128, got K = " + std::to_string(d.K)};
  if (d.V != kHeadDim)
    return {StatusCode::kUnsupported, "v",
            "the CUDA prefill supports head dim V = 128, got V = " + std::to_string(d.V)};
  return Status::Ok();
}

inline int64_t chunk_slots(const detail::PrefillProblem& pr) {
  return prefill_chunk_slots(pr.d.varlen, pr.d.B, pr.d.T, pr.d.N);
}

// Varlen batches of several sequences also keep the recurrence's sequence order (int32 [N]) after
// the records: blocks of the longest sequences start first, so that a long sequence does not run
// alone at the end of the grid (prepare_kernel builds it; recurrence_kernel reads it).
inline bool uses_sequence_order(const detail::PrefillProblem& pr) {
  return pr.d.varlen && pr.d.N > 1;
}
// The conditions of warm-up segments (heuristics/prefill.h fused_choice) other than the gate's:
// |k| <= 1 and beta in (0, 2), which the bound needs.
inline bool warm_applies(const detail::PrefillProblem& pr) {
  return pr.math.use_qk_l2norm && pr.math.beta_logits;
}
// The launch plan of a call (heuristics/prefill.h), on `num_sms` multiprocessors.
inline PrefillPlan launch_plan(const detail::PrefillProblem& pr, int num_sms,
                               const detail::Tuning& tuning) {
  const bool lb = pr.math.gate == GateForm::kLowerBound;
  const bool weak = weak_decay_gate(lb, pr.math.lower_bound);
  PrefillPlan plan = prefill_plan(pr.d.varlen, pr.d.T, pr.d.N, pr.d.HV, num_sms, tuning, weak);
  const int64_t len = pr.d.varlen ? ceil_div(pr.d.T, pr.d.N > 0 ? pr.d.N : 1) : pr.d.T;
  const FusedChoice f = fused_choice(plan, len, pr.d.N, pr.d.HV, num_sms, tuning,
                                     fused_applies(lb, pr.math.lower_bound), weak, warm_applies(pr),
                                     pr.math.lower_bound);
  if (f.take) {
    plan.fused = true;
    plan.warm = f.warm;
    plan.segment_tokens = f.segment_tokens;
    plan.predicted_us = f.predicted_us;
  }
  return plan;
}
// One segment state (fp32 S^T, 128 x 128) and the three per (segment slot, value head).
inline constexpr size_t kSegStateBytes = size_t{kHeadDim} * kHeadDim * 4;
inline int64_t segment_slots(const detail::PrefillProblem& pr, int64_t segment_tokens) {
  return prefill_segment_slots(pr.d.varlen, pr.d.B, pr.d.T, pr.d.N, segment_tokens);
}

// Workspace: [records][sequence order][segment states], each part 128-byte aligned.
// Fused plans: [segment states][warm-up flags (int32 [segment slots][HV]) with warm-up segments].
struct WorkspaceLayout {
  size_t records = 0, order = 0, segments = 0, flags = 0, total = 0;  // byte offsets; total
};
inline WorkspaceLayout workspace_layout(const detail::PrefillProblem& pr, int64_t segment_tokens,
                                        bool fused = false, bool warm = false) {
  WorkspaceLayout w;
  if (fused) {  // records in shared memory: the segment states (and flags) only
    const int64_t slots = segment_slots(pr, segment_tokens);
    if (slots > 0 && pr.d.N > 0) {
      w.flags = static_cast<size_t>(slots) * pr.d.HV * 3 * kSegStateBytes;
      w.total = w.flags + (warm ? static_cast<size_t>(slots) * pr.d.HV * 4 : 0) + 128;
    }
    return w;
  }
  const int64_t records = chunk_slots(pr) * pr.d.HV;
  if (records <= 0 || pr.d.N <= 0) return w;
  w.order = static_cast<size_t>(records) * kRecordBytes;
  const size_t order = uses_sequence_order(pr)
                           ? (static_cast<size_t>(pr.d.N) * 4 + 127) & ~static_cast<size_t>(127)
                           : 0;
  w.segments = w.order + order;
  const size_t segs =
      static_cast<size_t>(segment_slots(pr, segment_tokens)) * pr.d.HV * 3 * kSegStateBytes;
  w.total = w.segments + segs + 128;  // + alignment slack
  return w;
}
inline size_t workspace_bytes(const detail::PrefillProblem& pr, int num_sms,
                              const detail::Tuning& tuning) {
  const PrefillPlan lp = launch_plan(pr, num_sms, tuning);
  return workspace_layout(pr, lp.segment_tokens, lp.fused, lp.warm).total;
}

// The parameters of the forward's inputs, shapes and math (no outputs, workspace or states):
// what the prefill and its backward (cuda/backward/host.h) read alike.
inline void input_params(const detail::PrefillProblem& pr, Params* out) {
  const auto& d = pr.d;
  Params& p = *out;
  p = Params{};
  p.q = strided_view(pr.q);
  p.k = strided_view(pr.k);
  p.v = strided_view(pr.v);
  p.g = strided_view(pr.g);
  p.beta = strided_view(pr.beta);
  if (pr.A_log.present()) {
    p.A_log = static_cast<const float*>(pr.A_log.data);
    p.A_log_s = pr.A_log.strides[0];
  }
  if (pr.dt_bias.present()) {
    p.dt_bias = static_cast<const float*>(pr.dt_bias.data);
    p.dt_bias_s = pr.dt_bias.strides[0];
  }
  p.varlen = d.varlen;
  p.cu_seqlens = index_view(pr.cu_seqlens);
  p.B = d.B;
  p.T = d.T;
  p.N = d.N;
  p.H = static_cast<int>(d.H);
  p.HV = static_cast<int>(d.HV);
  p.groups = static_cast<int>(d.groups());
  p.chunks_per_seq = (d.T + kChunk - 1) / kChunk;
  p.num_slots = chunk_slots(pr);
  p.gate = static_cast<int>(pr.math.gate);
  p.beta_logits = pr.math.beta_logits;
  p.allow_neg_eigval = pr.math.allow_neg_eigval;
  p.use_qk_l2norm = pr.math.use_qk_l2norm;
  p.scale = static_cast<float>(pr.math.scale);
  p.lower_bound = pr.math.lower_bound;
}

// Kernel parameters of a validated, supported problem, and the workspace bytes they need
// (workspace_bytes(); the caller checks `workspace` against them before any launch: the
// parameters only point into it). Returns the block counts of both kernels.
inline Status make_params(const detail::PrefillProblem& pr, void* workspace, int num_sms,
                          const detail::Tuning& tuning, Params* out, int64_t* prep_blocks_out,
                          int64_t* rec_blocks_out, size_t* workspace_need_out) {
  const auto& d = pr.d;
  const PrefillPlan lp = launch_plan(pr, num_sms, tuning);
  const WorkspaceLayout layout = workspace_layout(pr, lp.segment_tokens, lp.fused, lp.warm);
  *workspace_need_out = layout.total;
  const int64_t slots = chunk_slots(pr);
  const int64_t prep_blocks = d.N > 0 && !lp.fused ? slots * d.HV : 0;
  const int64_t pairs = d.N * d.HV;
  const int64_t seg_slots = segment_slots(pr, lp.segment_tokens);
  if (prep_blocks > INT32_MAX || pairs * 8 > INT32_MAX || seg_slots * d.HV * 16 > INT32_MAX)
    return {StatusCode::kUnsupported, "q",
            "problem too large for one CUDA prefill launch (" + std::to_string(prep_blocks) +
                " chunk blocks)"};

  Params& p = *out;
  input_params(pr, &p);
  p.out = strided_view(pr.out);
  if (layout.total > 0 && workspace != nullptr) {
    const uintptr_t w = reinterpret_cast<uintptr_t>(workspace);
    p.ws = reinterpret_cast<uint8_t*>((w + 127) & ~static_cast<uintptr_t>(127));
    if (uses_sequence_order(pr)) p.order = reinterpret_cast<int32_t*>(p.ws + layout.order);
  }
  if (seg_slots > 0 && p.ws != nullptr) {
    p.seg_tokens = lp.segment_tokens;
    p.segs_per_seq = d.varlen ? 0 : seg_slots / d.B;
    p.seg_slots = seg_slots;
    StateView* views[3] = {&p.seg_start, &p.seg_local, &p.seg_trans};
    for (int i = 0; i < 3; ++i) {
      StateView& v = *views[i];
      v.data = p.ws + layout.segments + static_cast<size_t>(i) * seg_slots * d.HV * kSegStateBytes;
      v.rows = seg_slots;
      v.s0 = d.HV * kHeadDim * kHeadDim;
      v.s1 = kHeadDim * kHeadDim;
      v.s2 = kHeadDim;
      v.dtype = kF32;
    }
    if (lp.warm) {
      p.warm_flags = reinterpret_cast<int32_t*>(p.ws + layout.flags);
      p.warm_max_chunks = tuning.prefill_warm_chunks;
      p.warm_log2_bound = static_cast<float>(tuning.prefill_warm_bits);
    }
  }
  p.initial_state = state_view(pr.initial_state);
  p.final_state = state_view(pr.final_state);
  p.state_pool = state_view(pr.state_pool);
  p.has_state_pool = pr.state_pool.present();
  p.state_indices = index_view(pr.state_indices);
  p.checkpoints = state_view(pr.checkpoints);
  p.checkpoint_offsets = index_view(pr.checkpoint_offsets);
  p.checkpoint_every = pr.checkpoint_every;
  p.kfirst = pr.layout == StateLayout::kKFirst;
  const RecurrenceChoice& rc = lp.rec;
  p.vs = rc.vs;
  p.nslices = kHeadDim / p.vs;
  p.ksplit = rc.ksplit;
  p.wgmma = rc.wgmma;
  p.chunk16 = rc.chunk16;
  p.fused = lp.fused;
  if (p.fused) {  // one CTA per (sequence, value head), the whole state
    p.vs = kHeadDim;
    p.nslices = 1;
  }
  p.prefetch_blocks = prepare_prefetch_blocks(num_sms, tuning);
  p.single = single_launch(lp, prep_blocks, pairs * p.nslices, num_sms, tuning);

  *prep_blocks_out = prep_blocks;
  *rec_blocks_out = pairs * p.nslices;
  return Status::Ok();
}

// The launches of a call, in stream order: the prepare kernel, then either the recurrence (one
// segment per sequence) or pass 1, the segment scan and pass 2 (segments.cuh); fused plans have no
// prepare kernel, and with warm-up segments the warm-up pass comes before pass 1. The kernels are
// named by their role so that the CUDA launcher and the CPU emulator launch the same sequence.
enum class PrefillKernel {
  kPrepare,
  kRecurrence,
  kSegmentPass1,
  kSegmentScan,
  kSegmentPass2,
  kSegmentWarm,
  kFused,
  kSingle
};
// Params::seg_pass of a segmented pass's launch (0 for the other kernels).
inline int seg_pass_of(PrefillKernel k) {
  return k == PrefillKernel::kSegmentPass1   ? 1
         : k == PrefillKernel::kSegmentPass2 ? 2
         : k == PrefillKernel::kSegmentWarm  ? 3
                                             : 0;
}
struct Launch {
  PrefillKernel kernel;
  int64_t blocks;
  int threads, smem;
};
inline int plan_launches(const Params& p, int64_t prep_blocks, int64_t rec_blocks,
                         Launch (&out)[4]) {
  int n = 0;
  if (p.fused) {
    if (rec_blocks <= 0) return n;
    if (p.seg_tokens <= 0) {
      out[n++] = {PrefillKernel::kFused, rec_blocks, kFusedThreads, kFusedSmemBytes};
      return n;
    }
    const int64_t seg_blocks = p.seg_slots * p.HV;
    if (p.warm_flags != nullptr)  // then the exact passes, for the pairs it leaves
      out[n++] = {PrefillKernel::kSegmentWarm, seg_blocks, kFusedThreads, kFusedSmemBytes};
    out[n++] = {PrefillKernel::kSegmentPass1, 2 * seg_blocks, kFusedThreads, kFusedSmemBytes};
    out[n++] = {PrefillKernel::kSegmentScan, p.N * p.HV * kScanBlocksPerHead, kScanThreads,
                kScanSmemBytes};
    out[n++] = {PrefillKernel::kSegmentPass2, seg_blocks, kFusedThreads, kFusedSmemBytes};
    return n;
  }
  if (p.single) {
    out[n++] = {PrefillKernel::kSingle, prep_blocks > rec_blocks ? prep_blocks : rec_blocks,
                kSingleThreads, single_smem_bytes(p.chunk16, p.vs)};
    return n;
  }
  if (prep_blocks > 0)
    out[n++] = {PrefillKernel::kPrepare, prep_blocks, kPrepareThreads, kPrepareSmemBytes};
  if (rec_blocks <= 0) return n;
  const int threads = 32 * recurrence_warps(p.vs, p.ksplit);
  const int smem =
      p.chunk16 ? recurrence_smem_bytes16(p.vs) : recurrence_smem_bytes(p.vs, p.ksplit);
  if (p.seg_tokens <= 0) {
    out[n++] = {PrefillKernel::kRecurrence, rec_blocks, threads, smem};
    return n;
  }
  const int64_t seg_blocks = p.seg_slots * p.HV * p.nslices;
  out[n++] = {PrefillKernel::kSegmentPass1, 2 * seg_blocks, threads, smem};
  out[n++] = {PrefillKernel::kSegmentScan, p.N * p.HV * kScanBlocksPerHead, kScanThreads,
              kScanSmemBytes};
  out[n++] = {PrefillKernel::kSegmentPass2, seg_blocks, threads, smem};
  return n;
}

}  // namespace kda::cuda::pf
