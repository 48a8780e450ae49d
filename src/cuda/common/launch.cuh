// launch.cuh — kernel launches with programmatic dependent launch (PDL), shared by every kernel.
//
// Every kernel starts with pdl_prologue() (common/ptx.cuh). Launched with the PDL attribute, the
// next kernel's launch latency and block scheduling overlap the tail of this one, which is most
// of a small decode call inside a CUDA graph. Tuning::pdl = false (KDA_CUDA_PDL=0) launches
// without the attribute, for measuring the difference.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <tuple>
#include <type_traits>
#include <utility>

#include "core/tuning.h"
#include "cuda/common/device.h"
#include "cuda/common/ptx.cuh"

namespace kda::cuda {

// Set once a driver refused a cooperative launch with the PDL attribute that it then ran without
// it: later cooperative launches go without PDL (their blocks then wait for the previous kernel
// to end before they start, as without the attribute).
inline std::atomic<bool>& cooperative_pdl_refused() {
  static std::atomic<bool> refused{false};
  return refused;
}

// One launch with the given attributes: through the driver when it is available, else, or when
// the driver launch fails, cudaLaunchKernelEx (whose error is returned: a launch the driver
// refuses is refused with the runtime's error code). `values`: the kernel's arguments.
template <typename... KArgs>
cudaError_t launch_once(bool cooperative, bool pdl, void (*kernel)(KArgs...), dim3 grid, dim3 block,
                        size_t smem, cudaStream_t stream,
                        std::tuple<std::decay_t<KArgs>...>& values) {
  if (const DriverLaunch launch = detail::tuning().driver_launch ? driver_launch() : nullptr) {
    if (const CUfunction f = driver_function(reinterpret_cast<const void*>(kernel))) {
      CUlaunchConfig cfg = {};
      cfg.gridDimX = grid.x;
      cfg.gridDimY = grid.y;
      cfg.gridDimZ = grid.z;
      cfg.blockDimX = block.x;
      cfg.blockDimY = block.y;
      cfg.blockDimZ = block.z;
      cfg.sharedMemBytes = static_cast<unsigned>(smem);
      cfg.hStream = reinterpret_cast<CUstream>(stream);
      CUlaunchAttribute attr[2];
      unsigned n = 0;
      if (cooperative) {
        attr[n].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
        attr[n++].value.cooperative = 1;
      }
      if (pdl) {
        attr[n].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr[n++].value.programmaticStreamSerializationAllowed = 1;
      }
      cfg.attrs = attr;
      cfg.numAttrs = n;
      void* ptrs[sizeof...(KArgs) + 1] = {};
      std::apply(
          [&ptrs](auto&... v) {
            int i = 0;
            ((ptrs[i++] = static_cast<void*>(&v)), ...);
          },
          values);
      if (launch(&cfg, f, ptrs, nullptr) == CUDA_SUCCESS) return cudaSuccess;
      forget_driver_functions();
    }
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (cooperative) {
    attr[n].id = cudaLaunchAttributeCooperative;
    attr[n++].val.cooperative = 1;
  }
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  return std::apply([&](auto&... v) { return cudaLaunchKernelEx(&cfg, kernel, v...); }, values);
}

// A launch with the PDL attribute (unless disabled), and the cooperative attribute when
// `cooperative` (every block resident at once; the kernel may synchronize its grid). A cooperative
// launch that fails with PDL and runs without it is the driver refusing the combination: later
// cooperative launches go without PDL.
template <typename... KArgs, typename... Args>
cudaError_t launch_kernel_with(bool cooperative, void (*kernel)(KArgs...), dim3 grid, dim3 block,
                               size_t smem, cudaStream_t stream, Args&&... args) {
  static_assert(sizeof...(KArgs) == sizeof...(Args), "one argument per kernel parameter");
  const bool pdl = detail::tuning().pdl &&
                   !(cooperative && cooperative_pdl_refused().load(std::memory_order_relaxed));
  // The arguments as the kernel's parameter types.
  std::tuple<std::decay_t<KArgs>...> values(std::forward<Args>(args)...);
  const cudaError_t e = launch_once(cooperative, pdl, kernel, grid, block, smem, stream, values);
  if (e == cudaSuccess || !(cooperative && pdl)) return e;
  if (launch_once(true, false, kernel, grid, block, smem, stream, values) != cudaSuccess) return e;
  (void)cudaGetLastError();  // the refused combination's error: the launch without PDL ran
  cooperative_pdl_refused().store(true, std::memory_order_relaxed);
  return cudaSuccess;
}
template <typename... KArgs, typename... Args>
cudaError_t launch_kernel(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                          cudaStream_t stream, Args&&... args) {
  return launch_kernel_with(false, kernel, grid, block, smem, stream, std::forward<Args>(args)...);
}

}  // namespace kda::cuda
