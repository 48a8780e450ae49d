// prefill_sm90.cu — CUDA prefill (sm_90a): host side. Two kernels per call, both on exec.stream,
// no allocation, no synchronization (CUDA-graph capturable):
//   A. prepare_kernel   (prefill/prepare.cuh): one block per (64-token chunk, value head); builds
//      the chunk's state-independent operands into a workspace record.
//   B. recurrence_kernel (prefill/recurrence.cuh): one block per (sequence, value head, value
//      slice); walks the chunks with the state slice in registers, writes outputs, checkpoints,
//      the final state and pool slots.
// Design, byte/FLOP model and measurements: docs/perf_notes.md, section "Prefill".
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "cuda/cuda_backend.h"
#include "cuda/prefill/common.cuh"
#include "cuda/launch.cuh"
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
    if (prev_ != device) {
      status_ = cudaSetDevice(device);
      changed_ = status_ == cudaSuccess && prev_ >= 0;
    }
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(prev_);
  }
  cudaError_t status() const { return status_; }

 private:
  int prev_ = -1;
  bool changed_ = false;
  cudaError_t status_ = cudaSuccess;
};

// Per-device facts read once (no synchronization either way): multiprocessor count, and whether
// the kernels' dynamic shared-memory limits were raised on that device.
constexpr int kMaxDevices = 64;
std::atomic<int> g_sms[kMaxDevices];
std::atomic<uint32_t> g_smem_ready[kMaxDevices];  // bit per kernel instantiation

int multiprocessors(int device) {
  if (device >= 0 && device < kMaxDevices && g_sms[device].load(std::memory_order_relaxed) > 0)
    return g_sms[device].load(std::memory_order_relaxed);
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0) {
    cudaGetLastError();
    return 132;
  }
  if (device >= 0 && device < kMaxDevices) g_sms[device].store(sms, std::memory_order_relaxed);
  return sms;
}

// Raises a kernel's dynamic shared-memory limit to the most it may use (once per device).
template <typename Kernel>
cudaError_t allow_smem(Kernel kernel, int bytes, int device, uint32_t bit) {
  const bool cached = device >= 0 && device < kMaxDevices;
  if (cached && (g_smem_ready[device].load(std::memory_order_acquire) & bit)) return cudaSuccess;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  // All of the unified L1/shared array as shared memory: two prepare blocks per SM need 2 x 109 KB.
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  if (e == cudaSuccess && cached) g_smem_ready[device].fetch_or(bit, std::memory_order_acq_rel);
  return e;
}

template <bool kFp16>
Status launch(const Params& p, int64_t prep_blocks, int64_t rec_blocks, int device, cudaStream_t stream) {
  const uint32_t bit = kFp16 ? 1u : 4u;
  if (prep_blocks > 0) {
    // Instantiation bits of the chunk-16 path: prepare 4096 / 16384, recurrence 8192 / 32768.
    auto* prep = p.chunk16 ? pf::prepare_kernel<kFp16, true> : pf::prepare_kernel<kFp16, false>;
    KDA_PF_CUDA(allow_smem(prep, pf::kPrepareSmemBytes, device, bit << (p.chunk16 ? 12 : 0)));
    KDA_PF_CUDA(launch_kernel(prep, dim3(static_cast<unsigned>(prep_blocks)), dim3(pf::kPrepareThreads),
                              pf::kPrepareSmemBytes, stream, p));
  }
  if (rec_blocks > 0 && p.chunk16) {
    auto* kernel = pf::recurrence_kernel<kFp16, false, true, true>;
    KDA_PF_CUDA(allow_smem(kernel, pf::recurrence_smem_bytes16(pf::kHeadDim), device, bit << 13));
    KDA_PF_CUDA(launch_kernel(kernel, dim3(static_cast<unsigned>(rec_blocks)),
                              dim3(static_cast<unsigned>(32 * pf::recurrence_warps(p.vs, false))),
                              pf::recurrence_smem_bytes16(p.vs), stream, p));
    return Status::Ok();
  }
  if (rec_blocks > 0) {
    // The limit is raised to the largest configuration (vs = 128; vs = 32 with the K split) once.
    // Instantiation bits: prepare 1 (fp16) / 4 (bf16); recurrence mma 2 / 8, K split 16 / 64, wgmma 256 / 1024.
    auto* kernel = p.ksplit  ? pf::recurrence_kernel<kFp16, true, false>
                   : p.wgmma ? pf::recurrence_kernel<kFp16, false, true>
                             : pf::recurrence_kernel<kFp16, false, false>;
    const int max_smem = p.ksplit ? pf::recurrence_smem_bytes(32, true) : pf::recurrence_smem_bytes(pf::kHeadDim);
    KDA_PF_CUDA(allow_smem(kernel, max_smem, device, bit << (p.ksplit ? 4 : (p.wgmma ? 8 : 1))));
    KDA_PF_CUDA(launch_kernel(kernel, dim3(static_cast<unsigned>(rec_blocks)),
                              dim3(static_cast<unsigned>(32 * pf::recurrence_warps(p.vs, p.ksplit))),
                              pf::recurrence_smem_bytes(p.vs, p.ksplit), stream, p));
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
  const int device = pr.q.device_index;
  return pr.q.dtype == DType::kFloat16 ? launch<true>(p, prep_blocks, rec_blocks, device, stream)
                                       : launch<false>(p, prep_blocks, rec_blocks, device, stream);
}

#ifdef KDA_PREFILL_TRACE
Status prefill_trace_fetch(std::vector<unsigned long long>* clocks, bool reset) {
  clocks->assign(pf::kPrepareTracePhases + 1, 0ull);
  KDA_PF_CUDA(cudaDeviceSynchronize());
  KDA_PF_CUDA(cudaMemcpyFromSymbol(clocks->data(), pf::g_prepare_phase_clocks, clocks->size() * 8));
  if (reset) {
    const std::vector<unsigned long long> z(clocks->size(), 0ull);
    KDA_PF_CUDA(cudaMemcpyToSymbol(pf::g_prepare_phase_clocks, z.data(), z.size() * 8));
  }
  return Status::Ok();
}
#endif

}  // namespace kda::cuda
