// gpu_late_copy.cu — see gpu_late_copy.h.
#include <cstdint>

#include "gpu_late_copy.h"

namespace kda::test {
namespace {

__global__ void late_copy_kernel(uint8_t* dst, const uint8_t* src, size_t bytes,
                                 unsigned long long spin_ns) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < spin_ns);
  for (size_t i = threadIdx.x; i < bytes; i += blockDim.x) dst[i] = src[i];
}

}  // namespace

cudaError_t launch_late_copy(void* dst, const void* src, size_t bytes, unsigned long long spin_ns,
                             cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(1);
  cfg.blockDim = dim3(128);
  cfg.stream = stream;
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, late_copy_kernel, static_cast<uint8_t*>(dst),
                            static_cast<const uint8_t*>(src), bytes, spin_ns);
}

}  // namespace kda::test
