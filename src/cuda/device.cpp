// device.cpp — CUDA device discovery for `kda info` and backend checks.
#include <cuda_runtime_api.h>

#include "cuda/cuda_backend.h"

namespace kda::cuda {

std::vector<DeviceInfo> devices() {
  std::vector<DeviceInfo> out;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver / no device" error
    return out;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    DeviceInfo d;
    d.index = i;
    d.name = prop.name;
    d.sm_major = prop.major;
    d.sm_minor = prop.minor;
    d.multiprocessors = prop.multiProcessorCount;
    d.global_memory_bytes = prop.totalGlobalMem;
    d.supported = prop.major == 9 && prop.minor == 0;
    out.push_back(d);
  }
  return out;
}

}  // namespace kda::cuda
