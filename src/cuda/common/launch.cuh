// launch.cuh — kernel launches with programmatic dependent launch (PDL), shared by every kernel.
//
// Every kernel starts with pdl_prologue() (common/ptx.cuh). Launched with the PDL attribute, the
// next kernel's launch latency and block scheduling overlap the tail of this one, which is most
// of a small decode call inside a CUDA graph. Tuning::pdl = false (KDA_CUDA_PDL=0) launches
// without the attribute, for measuring the difference.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "core/tuning.h"
#include "cuda/common/ptx.cuh"

namespace kda::cuda {

// cudaLaunchKernelEx with the PDL attribute (unless disabled); returns the launch's error.
template <typename... KArgs, typename... Args>
cudaError_t launch_kernel(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                          cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = detail::tuning().pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace kda::cuda
