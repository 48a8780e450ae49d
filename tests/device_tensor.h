// device_tensor.h — the CUDA check of the GPU tests and benchmarks and a device copy of a
// HostTensor (header-only, no GoogleTest; include only from targets that link the CUDA runtime).
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

#include "support.h"

// A failed CUDA runtime call throws std::runtime_error naming the call, the error and file:line.
#define KDA_TEST_CUDA(expr)                                                                \
  do {                                                                                     \
    cudaError_t _e = (expr);                                                               \
    if (_e != cudaSuccess)                                                                 \
      throw std::runtime_error(std::string(#expr) + " failed: " + cudaGetErrorString(_e) + \
                               " at " + __FILE__ + ":" + std::to_string(__LINE__));        \
  } while (0)

namespace kda::test {

// Device copy of a HostTensor's whole storage (same strides), freed on destruction.
struct DeviceTensor {
  const HostTensor* host = nullptr;
  void* ptr = nullptr;
  size_t bytes = 0;
  DeviceTensor() = default;
  explicit DeviceTensor(const HostTensor& h) : host(&h), bytes(h.storage.size()) {
    if (bytes) {
      KDA_TEST_CUDA(cudaMalloc(&ptr, bytes));
      KDA_TEST_CUDA(cudaMemcpy(ptr, h.storage.data(), bytes, cudaMemcpyHostToDevice));
    }
  }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  ~DeviceTensor() {
    if (ptr) cudaFree(ptr);
  }
  TensorView view() const {
    if (!host || host->empty()) return TensorView{};
    TensorView t = host->view();
    t.data = ptr;
    t.device = Device::kCUDA;
    t.device_index = 0;
    return t;
  }
  // Copies the device data back into `out` (a HostTensor of the same layout as host).
  void download(HostTensor& out) const {
    if (bytes) KDA_TEST_CUDA(cudaMemcpy(out.storage.data(), ptr, bytes, cudaMemcpyDeviceToHost));
  }
};

}  // namespace kda::test
