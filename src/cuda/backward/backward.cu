// backward.cu — CUDA prefill backward (sm_90a): host side. Six kernels on exec.stream
// (backward/kernels.cuh), no allocation, no synchronization (CUDA-graph capturable); the workspace
// is the caller's (kda::prefill_backward_workspace_size).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/tuning.h"
#include "cuda/backward/host.h"
#include "cuda/backward/kernels.cuh"
#include "cuda/common/check.h"
#include "cuda/common/device.h"
#include "cuda/common/launch.cuh"
#include "cuda/cuda_backend.h"

namespace kda::cuda {
namespace {

template <typename Kernel>
Status allow_smem(DeviceAttributes& d, KernelSlot slot, int offset, Kernel kernel, int bytes) {
  return configure_once(d, slot, offset, [&] {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  });
}

template <bool kSplit>
Status launch(const bw::BwdParams& P, DeviceAttributes& d, cudaStream_t stream) {
  using S = KernelSlot;
  const int off = kSplit ? 0 : 4;
  bw::BwdLaunch plan[bw::kMaxBwdLaunches];
  const int count = bw::plan_launches(P, plan);
  for (int i = 0; i < count; ++i) {
    const bw::BwdLaunch& l = plan[i];
    void (*kernel)(bw::BwdParams) = nullptr;
    switch (l.kernel) {
      case bw::BwdKernel::kPrepare:
        kernel = bw::bwd_prepare_kernel<kSplit>;
        KDA_RETURN_IF_ERROR(allow_smem(d, S::kBwdPrepare, off, kernel, l.smem));
        break;
      case bw::BwdKernel::kStates:
        kernel = bw::bwd_states_kernel<kSplit>;
        KDA_RETURN_IF_ERROR(allow_smem(d, S::kBwdStates, off, kernel, l.smem));
        break;
      case bw::BwdKernel::kDStates:
        kernel = bw::bwd_dstates_kernel<kSplit>;
        KDA_RETURN_IF_ERROR(allow_smem(d, S::kBwdDStates, off, kernel, l.smem));
        break;
      case bw::BwdKernel::kStatesWg:
        kernel = bw::bwd_states_wg_kernel;
        KDA_RETURN_IF_ERROR(allow_smem(d, S::kBwdWg, 0, kernel, l.smem));
        break;
      case bw::BwdKernel::kDStatesWg:
        kernel =
            bw::do_lo_zero(P) ? bw::bwd_dstates_wg_kernel<true> : bw::bwd_dstates_wg_kernel<false>;
        KDA_RETURN_IF_ERROR(allow_smem(d, S::kBwdWg, bw::do_lo_zero(P) ? 1 : 5, kernel, l.smem));
        break;
      case bw::BwdKernel::kSProd:
        kernel = bw::do_lo_zero(P) ? bw::bwd_sprod_kernel<true> : bw::bwd_sprod_kernel<false>;
        KDA_RETURN_IF_ERROR(allow_smem(d, S::kBwdWg, bw::do_lo_zero(P) ? 2 : 6, kernel, l.smem));
        break;
      case bw::BwdKernel::kChunk:
        kernel = P.wg ? bw::bwd_chunk_kernel<kSplit, true> : bw::bwd_chunk_kernel<kSplit, false>;
        KDA_RETURN_IF_ERROR(allow_smem(d, P.wg ? S::kBwdWg : S::kBwdChunk,
                                       P.wg ? 3 + (kSplit ? 0 : 1) : off, kernel, l.smem));
        break;
      case bw::BwdKernel::kQk:
        kernel = bw::bwd_qk_kernel;
        break;
      case bw::BwdKernel::kParams:
        kernel = bw::bwd_params_kernel;
        break;
    }
    KDA_CUDA_CHECK(launch_kernel(kernel, dim3(static_cast<unsigned>(l.blocks)),
                                 dim3(static_cast<unsigned>(l.threads)),
                                 static_cast<size_t>(l.smem), stream, P));
  }
  return Status::Ok();
}

}  // namespace

Status prefill_backward_workspace_size(const detail::PrefillBackwardProblem& bp, size_t* bytes) {
  *bytes = 0;
  KDA_RETURN_IF_ERROR(bw::check_supported(bp));
  DeviceAttributes* d = nullptr;
  KDA_RETURN_IF_ERROR(device_attributes(bp.fwd.q.device_index, &d));
  *bytes = bw::workspace_layout(bp.fwd, d->sms).total;
  return Status::Ok();
}

Status prefill_backward(const detail::PrefillBackwardProblem& bp, const ExecOptions& exec) {
  KDA_RETURN_IF_ERROR(bw::check_supported(bp));
  DeviceGuard guard(bp.fwd.q.device_index);
  KDA_CUDA_CHECK(guard.status());
  DeviceAttributes* d = nullptr;
  KDA_RETURN_IF_ERROR(device_attributes(bp.fwd.q.device_index, &d));
  const size_t need = bw::workspace_layout(bp.fwd, d->sms).total;
  if (need > 0 && (exec.workspace == nullptr || exec.workspace_bytes < need))
    return {StatusCode::kInvalidArgument, "workspace",
            "expected at least " + std::to_string(need) +
                " bytes of device memory (kda::prefill_backward_workspace_size), got " +
                (exec.workspace == nullptr ? std::string("nullptr")
                                           : std::to_string(exec.workspace_bytes) + " bytes")};
  bw::BwdParams P;
  bw::make_params(bp, exec.workspace, d->sms, detail::tuning(), &P);
  const cudaStream_t stream = static_cast<cudaStream_t>(exec.stream);
  return detail::tuning().backward_split ? launch<true>(P, *d, stream)
                                         : launch<false>(P, *d, stream);
}

}  // namespace kda::cuda
