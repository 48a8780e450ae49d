// scan.cu — the launchers of the context-parallel prefill's device side
// (distributed/scan_kernels.cuh), on the caller's stream.
#include <cuda_runtime.h>

#include "cuda/common/check.h"
#include "cuda/common/device.h"
#include "cuda/distributed/scan.h"
#include "cuda/distributed/scan_kernels.cuh"

namespace kda::cuda {

using dist::kThreads;

Status distributed_prepare(const scan::Buffers& b, int device, void* stream) {
  DeviceGuard guard(device);
  KDA_CUDA_CHECK(guard.status());
  dist::prepare_kernel<<<dist::kPrepareBlocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(b);
  KDA_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

Status distributed_layout(const scan::Buffers& b, int device, void* stream) {
  DeviceGuard guard(device);
  KDA_CUDA_CHECK(guard.status());
  dist::layout_kernel<<<static_cast<unsigned>(dist::layout_blocks(b)), kThreads, 0,
                        static_cast<cudaStream_t>(stream)>>>(b);
  KDA_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

Status distributed_scan(const scan::Buffers& b, int device, void* stream) {
  const int64_t blocks = dist::scan_blocks(b);
  if (blocks == 0) return Status::Ok();
  DeviceGuard guard(device);
  KDA_CUDA_CHECK(guard.status());
  dist::scan_kernel<<<static_cast<unsigned>(blocks), kThreads, 0,
                      static_cast<cudaStream_t>(stream)>>>(b);
  KDA_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

}  // namespace kda::cuda
