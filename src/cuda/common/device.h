// device.h — the CUDA device as the launchers see it: a guard that makes a tensor's device current
// for one call and restores the caller's, and the per-device facts read once (multiprocessor
// count, shared memory per SM) with the once-per-device kernel attribute settings.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <vector>

#include "cuda/common/check.h"
#include "kda/kda.h"

namespace kda::cuda {

// Makes `device` current for the guard's scope and restores the caller's current device after.
// status(): the cudaSetDevice error, if switching failed (the guard then restores nothing).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&saved_) != cudaSuccess) {
      cudaGetLastError();
      saved_ = -1;
    }
    if (saved_ != device) {
      status_ = cudaSetDevice(device);
      switched_ = status_ == cudaSuccess && saved_ >= 0;
    }
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(saved_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  cudaError_t status() const { return status_; }

 private:
  int saved_ = -1;
  bool switched_ = false;
  cudaError_t status_ = cudaSuccess;
};

// Kernel attributes set once per device (cudaFuncSetAttribute: dynamic shared-memory limit,
// carveout), one bit per kernel instantiation. The decode and prefill launchers own disjoint bits.
enum class KernelSlot : int {
  // prefill: prepare (fp16 / bf16) x (chunk 64 / 16); recurrence fp16 / bf16 x path
  kPrepareF16,
  kPrepareBf16,
  kPrepare16F16,
  kPrepare16Bf16,
  kRecurrenceMmaF16,
  kRecurrenceMmaBf16,
  kRecurrenceKSplitF16,
  kRecurrenceKSplitBf16,
  kRecurrenceWgmmaF16,
  kRecurrenceWgmmaBf16,
  kRecurrence16F16,
  kRecurrence16Bf16,
  kRecurrenceSeg,  // + 2 path + fp16: the segmented passes (path: mma, K split, wgmma, chunk 16)
  kSegmentScan = kRecurrenceSeg + 8,
  kFusedF16,
  kFusedBf16,
  kFusedSegF16,  // the fused kernel's segmented passes
  kFusedSegBf16,
  kSingleF16,  // the single-launch kernel (chunk 64 / 16)
  kSingleBf16,
  kSingle16F16,
  kSingle16Bf16,
  // decode: staged (state dtype x latency), bulk (state dtype x slots x latency)
  kStaged,
  kBulk = kStaged + 4,
  // prefill backward: records, state passes, chunk gradients (+ 4 with single tf32 products)
  kBwdPrepare = kBulk + 8,
  kBwdStates,
  kBwdDStates,
  kBwdChunk,
  // on wgmma: + 0 states pass, + 1 / + 5 reverse pass and + 2 / + 6 state products (dO's lo
  // terms zero / not), + 3 / + 4 the chunk kernel that reads them (split / single tf32)
  kBwdWg = kBwdPrepare + 8,
  kCount = kBwdWg + 7,
};
static_assert(static_cast<int>(KernelSlot::kCount) <= 64, "one 64-bit mask per device");

// Facts of one device, read on its first use, never again.
struct DeviceAttributes {
  int sms = 0;                          // multiprocessors
  int smem_per_sm = 0;                  // bytes of shared memory per SM
  int smem_reserved = 0;                // bytes the runtime reserves per resident block
  bool cooperative = false;             // cooperative launches (a grid-wide barrier) supported
  std::atomic<uint64_t> configured{0};  // KernelSlot bits whose attributes are set
};

// The attributes of `device` (cached: only the first call per device queries the runtime).
Status device_attributes(int device, DeviceAttributes** out);

// Runs `set` (returning a cudaError_t) unless `slot` is already configured on this device; racing
// callers may both run it (they set the same values).
template <typename Set>
Status configure_once(DeviceAttributes& d, KernelSlot slot, int slot_offset, Set&& set) {
  const uint64_t bit = uint64_t{1} << (static_cast<int>(slot) + slot_offset);
  if (d.configured.load(std::memory_order_acquire) & bit) return Status::Ok();
  KDA_CUDA_CHECK(set());
  d.configured.fetch_or(bit, std::memory_order_acq_rel);
  return Status::Ok();
}

// A driver function by name, at the CUDA 12.0 ABI (nullptr when unavailable;
// the runtime's error state is left clear).
void* driver_entry_point(const char* symbol);

// The driver's launch (cuLaunchKernelEx, through the runtime's entry-point query: no libcuda link)
// and the CUfunction of `kernel` on the current device, both looked up once (the function per
// host thread and device: no lock). A launch through them skips the runtime's per-launch work:
// 2.50 against 2.87 us of host time per launch on the H200 host (bench_host_cost). nullptr when
// unavailable; forget_driver_functions() drops the calling thread's functions after a failed
// launch (e.g. a reset device), so that the next launch looks them up again.
using DriverLaunch = CUresult (*)(const CUlaunchConfig*, CUfunction, void**, void**);
DriverLaunch driver_launch();
CUfunction driver_function(const void* kernel);
CUfunction driver_function(const void* kernel, int device);  // `device`: the current device
void forget_driver_functions();

// check_indices: starts copying the memory of index tensor `t` (its strided extent; nothing for
// an absent or empty tensor) to `host` on `stream`; the caller synchronizes the stream before
// reading it. host_view(t, host) is `t` over that copy.
Status copy_to_host_async(const TensorView& t, cudaStream_t stream, std::vector<uint8_t>* host);
TensorView host_view(const TensorView& t, std::vector<uint8_t>& host);

}  // namespace kda::cuda
