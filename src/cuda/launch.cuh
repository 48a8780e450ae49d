// launch.cuh — kernel launches with programmatic dependent launch (PDL), shared by every kernel.
//
// Every kernel of the library starts with pdl_prologue(): it lets the next kernel in the stream
// (if that one was launched with PDL) be scheduled while this grid finishes, then waits until
// every grid this one depends on has completed and its memory is visible. Nothing is read or
// written in global memory before the wait, so a PDL launch is exactly as ordered as a plain one:
// what it saves is the launch latency and block scheduling of the next kernel (it overlaps the
// tail of this one), which is most of a small decode call inside a CUDA graph. Without the
// launch attribute both instructions do nothing. KDA_CUDA_PDL=0 launches without the attribute
// (for measuring the difference).
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <utility>

namespace kda::cuda {

__device__ __forceinline__ void pdl_prologue() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

inline bool pdl_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("KDA_CUDA_PDL");
    return e == nullptr || std::strcmp(e, "0") != 0;
  }();
  return on;
}

// cudaLaunchKernelEx with the PDL attribute (unless disabled); returns the launch's error.
template <typename... KArgs, typename... Args>
cudaError_t launch_kernel(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_enabled() ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace kda::cuda
