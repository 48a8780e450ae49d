// device.cpp — CUDA device discovery (`kda info`, backend checks) and the per-device cache.
#include "cuda/common/device.h"

#include <mutex>

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

Status device_attributes(int device, DeviceAttributes** out) {
  constexpr int kMaxDevices = 64;
  static DeviceAttributes cache[kMaxDevices];
  static std::atomic<bool> ready[kMaxDevices];
  static std::mutex mu;
  if (device < 0 || device >= kMaxDevices)
    return {StatusCode::kUnsupported, "q",
            "CUDA device index " + std::to_string(device) + " out of range (at most " +
                std::to_string(kMaxDevices) + " devices)"};
  DeviceAttributes& d = cache[device];
  if (!ready[device].load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(mu);
    if (!ready[device].load(std::memory_order_relaxed)) {
      KDA_CUDA_CHECK(cudaDeviceGetAttribute(&d.smem_per_sm,
                                            cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
      KDA_CUDA_CHECK(cudaDeviceGetAttribute(&d.smem_reserved,
                                            cudaDevAttrReservedSharedMemoryPerBlock, device));
      KDA_CUDA_CHECK(cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, device));
      int coop = 0;
      KDA_CUDA_CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, device));
      d.cooperative = coop != 0;
      ready[device].store(true, std::memory_order_release);
    }
  }
  *out = &d;
  return Status::Ok();
}

Status copy_to_host_async(const TensorView& t, cudaStream_t stream, std::vector<uint8_t>* host) {
  host->clear();
  if (!t.present() || t.numel() <= 0) return Status::Ok();
  int64_t last = 0;
  for (int i = 0; i < t.ndim; ++i) last += (t.shape[i] - 1) * t.strides[i];
  host->resize(static_cast<size_t>(last + 1) * dtype_size(t.dtype));
  KDA_CUDA_CHECK(
      cudaMemcpyAsync(host->data(), t.data, host->size(), cudaMemcpyDeviceToHost, stream));
  return Status::Ok();
}

TensorView host_view(const TensorView& t, std::vector<uint8_t>& host) {
  TensorView h = t;
  h.data = host.empty() ? nullptr : host.data();
  h.device = Device::kCPU;
  return h;
}

void* driver_entry_point(const char* symbol) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(symbol, &fn, 12000, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return fn;
}

DriverLaunch driver_launch() {
  static const DriverLaunch launch =
      reinterpret_cast<DriverLaunch>(driver_entry_point("cuLaunchKernelEx"));
  return launch;
}

namespace {
// The calling thread's kernel functions, per device (a few dozen kernels at most).
struct DriverFunction {
  const void* kernel;
  int device;
  CUfunction function;
};
thread_local std::vector<DriverFunction> t_functions;
}  // namespace

CUfunction driver_function(const void* kernel) {
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return driver_function(kernel, device);
}

CUfunction driver_function(const void* kernel, int device) {
  for (const DriverFunction& f : t_functions)
    if (f.kernel == kernel && f.device == device) return f.function;
  cudaFunction_t f = nullptr;
  if (cudaGetFuncBySymbol(&f, kernel) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  t_functions.push_back({kernel, device, reinterpret_cast<CUfunction>(f)});
  return reinterpret_cast<CUfunction>(f);
}

void forget_driver_functions() { t_functions.clear(); }

}  // namespace kda::cuda
