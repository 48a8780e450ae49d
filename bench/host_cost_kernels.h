// host_cost_kernels.h — bare launches of empty kernels for bench_host_cost (CUDA builds only).
#pragma once

#include <cuda_runtime_api.h>

namespace host_cost {

constexpr int kParamBytes = 848;  // sizeof the prefill kernels' Params

enum class Launch {
  kChevron,      // empty_kernel<<<1, 32, 0, stream>>>() and cudaGetLastError()
  kEx,           // cudaLaunchKernelEx, no attribute
  kExPdl,        // cudaLaunchKernelEx with the PDL attribute (the library's launch helper)
  kExPdlParams,  // the same with a kParamBytes parameter passed by value
  kDriverPdl,    // cuLaunchKernelEx (driver API) with the PDL attribute, CUfunction looked up once
};
constexpr int kNumLaunches = 5;

// One launch of 1 block x 32 threads on `stream`; returns the launch's error.
cudaError_t launch_empty(Launch how, cudaStream_t stream);
const char* launch_name(Launch how);

}  // namespace host_cost
