// prefill.cu — CUDA prefill (sm_90a): host side. Two kernels per call, both on exec.stream,
// no allocation, no synchronization (CUDA-graph capturable):
//   A. prepare_kernel   (prefill/prepare.cuh): one block per (64-token chunk, value head); builds
//      the chunk's state-independent operands into a workspace record.
//   B. recurrence_kernel (prefill/recurrence.cuh): one block per (sequence, value head, value
//      slice); walks the chunks with the state slice in registers, writes outputs, checkpoints,
//      the final state and pool slots.
// The launch configuration is heuristics/prefill.h's (under the tuning struct, docs/tuning.md).
// Design, byte/FLOP model and measurements: docs/perf_notes.md, section "Prefill".
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/tuning.h"
#include "cuda/common/check.h"
#include "cuda/common/device.h"
#include "cuda/common/launch.cuh"
#include "cuda/cuda_backend.h"
#include "cuda/prefill/common.cuh"
#include "cuda/prefill/host.h"
#include "cuda/prefill/prepare.cuh"
#include "cuda/prefill/recurrence.cuh"

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

template <bool kFp16>
Status launch(const Params& p, int64_t prep_blocks, int64_t rec_blocks, DeviceAttributes& d,
              cudaStream_t stream) {
  using S = KernelSlot;
  if (prep_blocks > 0) {
    auto* prep = p.chunk16 ? pf::prepare_kernel<kFp16, true> : pf::prepare_kernel<kFp16, false>;
    const S slot = p.chunk16 ? slot_of(S::kPrepare16F16, S::kPrepare16Bf16, kFp16)
                             : slot_of(S::kPrepareF16, S::kPrepareBf16, kFp16);
    KDA_RETURN_IF_ERROR(allow_smem(d, slot, prep, pf::kPrepareSmemBytes));
    KDA_CUDA_CHECK(launch_kernel(prep, dim3(static_cast<unsigned>(prep_blocks)),
                                 dim3(pf::kPrepareThreads), pf::kPrepareSmemBytes, stream, p));
  }
  if (rec_blocks > 0 && p.chunk16) {
    auto* kernel = pf::recurrence_kernel<kFp16, false, true, true>;
    KDA_RETURN_IF_ERROR(allow_smem(d, slot_of(S::kRecurrence16F16, S::kRecurrence16Bf16, kFp16),
                                   kernel, pf::recurrence_smem_bytes16(pf::kHeadDim)));
    KDA_CUDA_CHECK(
        launch_kernel(kernel, dim3(static_cast<unsigned>(rec_blocks)),
                      dim3(static_cast<unsigned>(32 * pf::recurrence_warps(p.vs, false))),
                      pf::recurrence_smem_bytes16(p.vs), stream, p));
    return Status::Ok();
  }
  if (rec_blocks > 0) {
    // The limit is raised to the largest configuration (vs = 128; vs = 32 with the K split) once.
    auto* kernel = p.ksplit  ? pf::recurrence_kernel<kFp16, true, false>
                   : p.wgmma ? pf::recurrence_kernel<kFp16, false, true>
                             : pf::recurrence_kernel<kFp16, false, false>;
    const S slot = p.ksplit  ? slot_of(S::kRecurrenceKSplitF16, S::kRecurrenceKSplitBf16, kFp16)
                   : p.wgmma ? slot_of(S::kRecurrenceWgmmaF16, S::kRecurrenceWgmmaBf16, kFp16)
                             : slot_of(S::kRecurrenceMmaF16, S::kRecurrenceMmaBf16, kFp16);
    const int max_smem =
        p.ksplit ? pf::recurrence_smem_bytes(32, true) : pf::recurrence_smem_bytes(pf::kHeadDim);
    KDA_RETURN_IF_ERROR(allow_smem(d, slot, kernel, max_smem));
    KDA_CUDA_CHECK(
        launch_kernel(kernel, dim3(static_cast<unsigned>(rec_blocks)),
                      dim3(static_cast<unsigned>(32 * pf::recurrence_warps(p.vs, p.ksplit))),
                      pf::recurrence_smem_bytes(p.vs, p.ksplit), stream, p));
  }
  return Status::Ok();
}

}  // namespace

Status prefill_workspace_size(const detail::PrefillProblem& pr, size_t* bytes) {
  *bytes = 0;
  KDA_RETURN_IF_ERROR(pf::check_supported(pr));
  *bytes = pf::workspace_bytes(pr);
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

Status prefill(const detail::PrefillProblem& pr, const ExecOptions& exec) {
  KDA_RETURN_IF_ERROR(pf::check_supported(pr));

  // Workspace: caller memory, at least workspace_bytes(); records start 128-byte aligned.
  const size_t need = pf::workspace_bytes(pr);
  if (need > 0 && (exec.workspace == nullptr || exec.workspace_bytes < need))
    return {StatusCode::kInvalidArgument, "workspace",
            "expected at least " + std::to_string(need) +
                " bytes of device memory (kda::prefill_workspace_size), got " +
                (exec.workspace == nullptr ? std::string("nullptr")
                                           : std::to_string(exec.workspace_bytes) + " bytes")};

  DeviceGuard guard(pr.q.device_index);
  KDA_CUDA_CHECK(guard.status());
  DeviceAttributes* d = nullptr;
  KDA_RETURN_IF_ERROR(device_attributes(pr.q.device_index, &d));
  Params p;
  int64_t prep_blocks = 0, rec_blocks = 0;
  KDA_RETURN_IF_ERROR(
      pf::make_params(pr, exec.workspace, d->sms, detail::tuning(), &p, &prep_blocks, &rec_blocks));
  cudaStream_t stream = static_cast<cudaStream_t>(exec.stream);
  return pr.q.dtype == DType::kFloat16 ? launch<true>(p, prep_blocks, rec_blocks, *d, stream)
                                       : launch<false>(p, prep_blocks, rec_blocks, *d, stream);
}

}  // namespace kda::cuda
