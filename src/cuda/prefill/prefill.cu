// prefill.cu — CUDA prefill (sm_90a): host side. Two kernels per call (four with segments; one for
// small calls with Tuning::prefill_single), all on exec.stream, no allocation, no synchronization
// (CUDA-graph capturable):
//   A. prepare_kernel   (prefill/prepare.cuh): one block per (64-token chunk, value head); builds
//      the chunk's state-independent operands into a workspace record.
//   B. recurrence_kernel (prefill/recurrence.cuh): one block per (sequence, value head, value
//      slice); walks the chunks with the state slice in registers, writes outputs, checkpoints,
//      the final state and pool slots.
//   With segments (heuristics/prefill.h prefill_plan), B is pass 1 over (segment, value head,
//   value or transition slice), then segment_scan_kernel (prefill/segments.cuh) and pass 2.
//   The fused kernel (prefill/fused.cuh) replaces A and B where the plan takes it (its passes
//   likewise with segments); with Tuning::prefill_single small unsegmented calls run A and B in
//   one cooperative launch (prefill/single.cuh).
// With Tuning::prefill_graph (the default) and outside stream capture, a call's two or four
// kernels go as one graph launch (common/graph_launch.h): one launch's host time instead of two or
// four.
// The launch configuration is heuristics/prefill.h's (under the tuning struct, docs/tuning.md).
// Design, byte/FLOP model and measurements: docs/perf_notes.md, section "Prefill".
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/tuning.h"
#include "cuda/common/check.h"
#include "cuda/common/device.h"
#include "cuda/common/graph_launch.h"
#include "cuda/common/launch.cuh"
#include "cuda/cuda_backend.h"
#include "cuda/prefill/common.cuh"
#include "cuda/prefill/host.h"
#include "cuda/prefill/prepare.cuh"
#include "cuda/prefill/recurrence.cuh"
#include "cuda/prefill/segments.cuh"
#include "cuda/prefill/single.cuh"

namespace kda::cuda {
namespace {

using pf::Params;

// Raises a kernel's dynamic shared-memory limit to the most it may use and takes all of the
// unified L1 / shared array as shared memory (two prepare blocks per SM need 2 x 109 KB); once per
// kernel instantiation and device.
template <typename Kernel>
Status allow_smem(DeviceAttributes& d, KernelSlot slot, Kernel kernel, int bytes) {
  return configure_once(d, slot, 0, [&] {
    cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                               cudaSharedmemCarveoutMaxShared);
    return e;
  });
}

KernelSlot slot_of(KernelSlot f16, KernelSlot bf16, bool fp16) { return fp16 ? f16 : bf16; }

// The recurrence kernel of the call's path and pass kind (recurrence_kernel_of), its shared-memory
// limit raised once per path to the path's largest configuration.
template <bool kFp16, bool kSeg>
Status recurrence_for(const Params& p, DeviceAttributes& d, void (**kernel)(Params)) {
  using S = KernelSlot;
  using Path = pf::RecurrencePath;
  const Path path = pf::recurrence_path(p);
  *kernel = pf::recurrence_kernel_of<kFp16, kSeg>(path);
  static constexpr S kSlots[4][2] = {{S::kRecurrenceMmaBf16, S::kRecurrenceMmaF16},
                                     {S::kRecurrenceKSplitBf16, S::kRecurrenceKSplitF16},
                                     {S::kRecurrenceWgmmaBf16, S::kRecurrenceWgmmaF16},
                                     {S::kRecurrence16Bf16, S::kRecurrence16F16}};
  const int i = static_cast<int>(path);
  const S slot = kSeg
                     ? static_cast<S>(static_cast<int>(S::kRecurrenceSeg) + 2 * i + (kFp16 ? 1 : 0))
                     : kSlots[i][kFp16 ? 1 : 0];
  const int max_smem = path == Path::kChunk16  ? pf::recurrence_smem_bytes16(pf::kHeadDim)
                       : path == Path::kKSplit ? pf::recurrence_smem_bytes(32, true)
                                               : pf::recurrence_smem_bytes(pf::kHeadDim);
  return allow_smem(d, slot, *kernel, max_smem);
}

template <bool kFp16>
Status launch(const Params& p, int64_t prep_blocks, int64_t rec_blocks, DeviceAttributes& d,
              int device, cudaStream_t stream) {
  using S = KernelSlot;
  pf::Launch plan[4];
  const int count = pf::plan_launches(p, prep_blocks, rec_blocks, plan);
  void (*kernels[4])(Params) = {};
  Params pass[4];
  ChainStep steps[4];  // each launch's kernel, grid, block, shared memory and parameters
  for (int i = 0; i < count; ++i) {
    const pf::Launch& l = plan[i];
    void (*&kernel)(Params) = kernels[i];
    pass[i] = p;
    switch (l.kernel) {
      case pf::PrefillKernel::kPrepare:
        kernel = p.chunk16 ? pf::prepare_kernel<kFp16, true> : pf::prepare_kernel<kFp16, false>;
        KDA_RETURN_IF_ERROR(allow_smem(d,
                                       p.chunk16
                                           ? slot_of(S::kPrepare16F16, S::kPrepare16Bf16, kFp16)
                                           : slot_of(S::kPrepareF16, S::kPrepareBf16, kFp16),
                                       kernel, pf::kPrepareSmemBytes));
        break;
      case pf::PrefillKernel::kRecurrence:
        KDA_RETURN_IF_ERROR((recurrence_for<kFp16, false>(p, d, &kernel)));
        break;
      case pf::PrefillKernel::kSegmentWarm:
      case pf::PrefillKernel::kSegmentPass1:
      case pf::PrefillKernel::kSegmentPass2:
        pass[i].seg_pass = pf::seg_pass_of(l.kernel);
        if (p.fused) {
          kernel = pf::fused_kernel<kFp16, true>;
          KDA_RETURN_IF_ERROR(allow_smem(d, slot_of(S::kFusedSegF16, S::kFusedSegBf16, kFp16),
                                         kernel, pf::kFusedSmemBytes));
        } else {
          KDA_RETURN_IF_ERROR((recurrence_for<kFp16, true>(p, d, &kernel)));
        }
        break;
      case pf::PrefillKernel::kSegmentScan:
        kernel = pf::segment_scan_kernel;
        KDA_RETURN_IF_ERROR(allow_smem(d, S::kSegmentScan, kernel, pf::kScanSmemBytes));
        break;
      case pf::PrefillKernel::kFused:
        kernel = pf::fused_kernel<kFp16, false>;
        KDA_RETURN_IF_ERROR(allow_smem(d, slot_of(S::kFusedF16, S::kFusedBf16, kFp16), kernel,
                                       pf::kFusedSmemBytes));
        break;
      case pf::PrefillKernel::kSingle:  // the largest configuration of its path: vs = 128
        kernel = p.chunk16 ? pf::single_kernel<kFp16, true> : pf::single_kernel<kFp16, false>;
        KDA_RETURN_IF_ERROR(allow_smem(d,
                                       p.chunk16 ? slot_of(S::kSingle16F16, S::kSingle16Bf16, kFp16)
                                                 : slot_of(S::kSingleF16, S::kSingleBf16, kFp16),
                                       kernel, pf::single_smem_bytes(p.chunk16, pf::kHeadDim)));
        break;
    }
    steps[i] = {reinterpret_cast<const void*>(kernel), dim3(static_cast<unsigned>(l.blocks)),
                dim3(static_cast<unsigned>(l.threads)), static_cast<unsigned>(l.smem), &pass[i]};
  }
  // Two or four kernels: one graph launch of the chain where Tuning::prefill_graph allows (not
  // while the stream is captured: then, or when the graph cannot be used, one launch each).
  if (count >= 2 && detail::tuning().prefill_graph &&
      launch_chain(steps, count, detail::tuning().pdl, device, stream))
    return Status::Ok();
  for (int i = 0; i < count; ++i) {
    const bool single = plan[i].kernel == pf::PrefillKernel::kSingle;
    const cudaError_t e = launch_kernel_with(single, kernels[i], steps[i].grid, steps[i].block,
                                             steps[i].smem, stream, pass[i]);
    if (single && e == cudaErrorCooperativeLaunchTooLarge) {
      // Fewer SMs at hand than the device has (MPS, a partition): nothing ran, two launches.
      (void)cudaGetLastError();
      Params two = p;
      two.single = false;
      return launch<kFp16>(two, prep_blocks, rec_blocks, d, device, stream);
    }
    KDA_CUDA_CHECK(e);
  }
  return Status::Ok();
}

}  // namespace

Status prefill_workspace_size(const detail::PrefillProblem& pr, size_t* bytes) {
  *bytes = 0;
  KDA_RETURN_IF_ERROR(pf::check_supported(pr));
  DeviceAttributes* d = nullptr;
  KDA_RETURN_IF_ERROR(device_attributes(pr.q.device_index, &d));
  *bytes = pf::workspace_bytes(pr, d->sms, detail::tuning());
  return Status::Ok();
}

Status check_prefill_indices(const detail::PrefillProblem& pr, const ExecOptions& exec) {
  DeviceGuard guard(pr.q.device_index);
  KDA_CUDA_CHECK(guard.status());
  cudaStream_t stream = static_cast<cudaStream_t>(exec.stream);
  std::vector<uint8_t> idx, cu;
  KDA_RETURN_IF_ERROR(copy_to_host_async(pr.state_indices, stream, &idx));
  KDA_RETURN_IF_ERROR(copy_to_host_async(pr.cu_seqlens, stream, &cu));
  KDA_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (pr.d.varlen)
    KDA_RETURN_IF_ERROR(detail::check_cu_seqlens_values(host_view(pr.cu_seqlens, cu), pr.d.T));
  if (!pr.state_indices.present()) return Status::Ok();
  return detail::check_prefill_index_values(pr, idx.empty() ? nullptr : idx.data());
}

Status prefill_warm_counts(int device, unsigned long long counts[3]) {
  DeviceGuard guard(device);
  KDA_CUDA_CHECK(guard.status());
  unsigned c[3] = {};
  KDA_CUDA_CHECK(cudaMemcpyFromSymbol(c, pf::g_fused_warm_walks, sizeof(c)));
  for (int i = 0; i < 3; ++i) counts[i] = c[i];
  return Status::Ok();
}

Status prefill(const detail::PrefillProblem& pr, const ExecOptions& exec) {
  KDA_RETURN_IF_ERROR(pf::check_supported(pr));

  DeviceGuard guard(pr.q.device_index);
  KDA_CUDA_CHECK(guard.status());
  DeviceAttributes* d = nullptr;
  KDA_RETURN_IF_ERROR(device_attributes(pr.q.device_index, &d));
  Params p;
  int64_t prep_blocks = 0, rec_blocks = 0;
  size_t need = 0;
  KDA_RETURN_IF_ERROR(pf::make_params(pr, exec.workspace, d->sms, detail::tuning(), &p,
                                      &prep_blocks, &rec_blocks, &need));
  // Workspace: caller memory, at least workspace_bytes(); records start 128-byte aligned.
  if (need > 0 && (exec.workspace == nullptr || exec.workspace_bytes < need))
    return {StatusCode::kInvalidArgument, "workspace",
            "expected at least " + std::to_string(need) +
                " bytes of device memory (kda::prefill_workspace_size), got " +
                (exec.workspace == nullptr ? std::string("nullptr")
                                           : std::to_string(exec.workspace_bytes) + " bytes")};
  if (!d->cooperative) p.single = false;  // the two launches (same workspace)
  cudaStream_t stream = static_cast<cudaStream_t>(exec.stream);
  const int dev = pr.q.device_index;
  return pr.q.dtype == DType::kFloat16 ? launch<true>(p, prep_blocks, rec_blocks, *d, dev, stream)
                                       : launch<false>(p, prep_blocks, rec_blocks, *d, dev, stream);
}

}  // namespace kda::cuda
