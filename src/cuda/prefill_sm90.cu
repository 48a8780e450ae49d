// prefill_sm90.cu — CUDA prefill (sm_90a): host side. Two kernels per call, both on exec.stream,
// no allocation, no synchronization (CUDA-graph capturable):
//   A. prepare_kernel   (prefill/prepare.cuh): one block per (64-token chunk, value head); builds
//      the chunk's state-independent operands into a workspace record.
//   B. recurrence_kernel (prefill/recurrence.cuh): one block per (sequence, value head, value
//      slice); walks the chunks with the state slice in registers, writes outputs, checkpoints,
//      the final state and pool slots.
// Design, byte/FLOP model and measurements: docs/perf_notes.md, section "Prefill".
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/cuda_backend.h"
#include "cuda/prefill/common.cuh"
#include "cuda/prefill/host.h"
#include "cuda/prefill/prepare.cuh"
#include "cuda/prefill/recurrence.cuh"

namespace kda::cuda {
namespace {

using pf::Params;
using pf::check_supported;
using pf::workspace_bytes;

Status cuda_error(const char* what, cudaError_t e) {
  return {StatusCode::kCudaError, std::string(what) + ": " + cudaGetErrorString(e)};
}

#define KDA_PF_CUDA(expr)                              \
  do {                                                 \
    const cudaError_t _e = (expr);                     \
    if (_e != cudaSuccess) return cuda_error(#expr, _e); \
  } while (0)

// Restores the caller's current device on scope exit.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
    if (prev_ != device) status_ = cudaSetDevice(device);
  }
  ~DeviceGuard() {
    if (prev_ >= 0) cudaSetDevice(prev_);
  }
  cudaError_t status() const { return status_; }

 private:
  int prev_ = -1;
  cudaError_t status_ = cudaSuccess;
};

int multiprocessors(int device) {
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0) {
    cudaGetLastError();
    sms = 132;
  }
  return sms;
}

template <bool kFp16>
Status launch(const Params& p, int64_t prep_blocks, int64_t rec_blocks, cudaStream_t stream) {
  if (prep_blocks > 0) {
    KDA_PF_CUDA(cudaFuncSetAttribute(pf::prepare_kernel<kFp16>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     pf::kPrepareSmemBytes));
    pf::prepare_kernel<kFp16><<<static_cast<unsigned>(prep_blocks), pf::kPrepareThreads, pf::kPrepareSmemBytes, stream>>>(p);
    KDA_PF_CUDA(cudaGetLastError());
  }
  if (rec_blocks > 0) {
    const int smem = pf::recurrence_smem_bytes(p.vs);
    KDA_PF_CUDA(cudaFuncSetAttribute(pf::recurrence_kernel<kFp16>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    pf::recurrence_kernel<kFp16><<<static_cast<unsigned>(rec_blocks), 2 * p.vs, smem, stream>>>(p);
    KDA_PF_CUDA(cudaGetLastError());
  }
  return Status::Ok();
}

}  // namespace

Status prefill_workspace_size(const detail::PrefillProblem& pr, size_t* bytes) {
  *bytes = 0;
  Status s = check_supported(pr);
  if (!s.ok()) return s;
  *bytes = workspace_bytes(pr);
  return Status::Ok();
}

Status prefill(const detail::PrefillProblem& pr, const ExecOptions& exec) {
  Status s = check_supported(pr);
  if (!s.ok()) return s;

  // Workspace: caller memory, at least workspace_bytes(); records start 128-byte aligned.
  const size_t need = workspace_bytes(pr);
  if (need > 0 && (exec.workspace == nullptr || exec.workspace_bytes < need))
    return {StatusCode::kInvalidArgument,
            "argument 'exec.workspace': expected at least " + std::to_string(need) +
                " bytes of device memory (kda::prefill_workspace_size), got " +
                (exec.workspace == nullptr ? std::string("nullptr") : std::to_string(exec.workspace_bytes) + " bytes")};

  DeviceGuard guard(pr.q.device_index);
  if (guard.status() != cudaSuccess) return cuda_error("cudaSetDevice", guard.status());
  Params p;
  int64_t prep_blocks = 0, rec_blocks = 0;
  s = pf::make_params(pr, exec.workspace, multiprocessors(pr.q.device_index), &p, &prep_blocks, &rec_blocks);
  if (!s.ok()) return s;
  cudaStream_t stream = static_cast<cudaStream_t>(exec.stream);
  return pr.q.dtype == DType::kFloat16 ? launch<true>(p, prep_blocks, rec_blocks, stream)
                                       : launch<false>(p, prep_blocks, rec_blocks, stream);
}

}  // namespace kda::cuda
