// scan.cu — the device side of the context-parallel prefill (include/kda/distributed.h): the
// identity and zeros of the M pass, and the scan over ranks.
//
// The scan is a serial chain of `world` steps h <- M_j h + S_j per (sequence, value head), each
// a K x K by K x C product (2 MFLOP for K = V = 128): one block per (sequence, value head), the
// state in fp64 in the workspace (two buffers, one per step parity), every thread a strided set
// of the R x C elements (scan::step_element, the host scan's arithmetic). Performance is not
// critical: a few steps, next to three prefill passes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda/common/check.h"
#include "cuda/common/device.h"
#include "cuda/distributed/scan.h"

namespace kda::cuda {
namespace {

constexpr int kThreads = 256;

__device__ double load_state(const TensorView& t, int64_t n, int64_t hv, int64_t a, int64_t b) {
  const int64_t off = n * t.strides[0] + hv * t.strides[1] + a * t.strides[2] + b;
  switch (t.dtype) {
    case DType::kBFloat16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(t.data)[off]);
    case DType::kFloat16:
      return __half2float(static_cast<const __half*>(t.data)[off]);
    default:
      return static_cast<const float*>(t.data)[off];
  }
}

__device__ void store_state(const TensorView& t, int64_t n, int64_t hv, int64_t a, int64_t b,
                            double x) {
  const int64_t off = n * t.strides[0] + hv * t.strides[1] + a * t.strides[2] + b;
  const float f = static_cast<float>(x);
  switch (t.dtype) {
    case DType::kBFloat16:
      static_cast<__nv_bfloat16*>(t.data)[off] = __float2bfloat16_rn(f);
      break;
    case DType::kFloat16:
      static_cast<__half*>(t.data)[off] = __float2half_rn(f);
      break;
    default:
      static_cast<float*>(t.data)[off] = f;
  }
}

// Grid: any; fills the [K, K] identity and the zero bytes.
__global__ void prepare_kernel(const scan::Buffers b) {
  const int64_t K = b.record.K;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < K * K; i += stride)
    b.identity[i] = i / K == i % K ? 1.0f : 0.0f;
  unsigned char* zeros = static_cast<unsigned char*>(b.zeros);
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < static_cast<int64_t>(b.zero_bytes);
       i += stride)
    zeros[i] = 0;
}

// Grid: N * HV blocks of kThreads, block (n, hv).
__global__ void scan_kernel(const scan::Buffers b) {
  const scan::Record& r = b.record;
  const int64_t pair = blockIdx.x;
  const int64_t n = pair / r.HV, hv = pair % r.HV;
  const int64_t RC = r.R * r.C;
  double* h = b.h + pair * RC;
  double* next = b.h + (r.N * r.HV + pair) * RC;

  // Load: the initial state (zero when absent), widened to fp64.
  for (int64_t e = threadIdx.x; e < RC; e += blockDim.x)
    h[e] = b.initial_state.ndim != 0 ? load_state(b.initial_state, n, hv, e / r.C, e % r.C) : 0.0;
  __syncthreads();

  // Scan: this rank's start state when its turn comes, then through every rank's map.
  for (int j = 0; j < b.world; ++j) {
    if (j == b.rank)
      for (int64_t e = threadIdx.x; e < RC; e += blockDim.x)
        b.start[pair * RC + e] = static_cast<float>(h[e]);
    const float* rec = b.records + j * r.floats();
    for (int64_t e = threadIdx.x; e < RC; e += blockDim.x)
      next[e] = scan::step_element(h, rec + r.m(n, hv), rec + r.s(n, hv), e / r.C, e % r.C, r.K,
                                   r.C, b.v_first);
    __syncthreads();
    double* t = h;
    h = next;
    next = t;
  }

  // Store: the final state, rounded to its dtype.
  if (b.final_state.ndim != 0)
    for (int64_t e = threadIdx.x; e < RC; e += blockDim.x)
      store_state(b.final_state, n, hv, e / r.C, e % r.C, h[e]);
}

}  // namespace

Status distributed_prepare(const scan::Buffers& b, int device, void* stream) {
  DeviceGuard guard(device);
  KDA_CUDA_CHECK(guard.status());
  prepare_kernel<<<16, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(b);
  KDA_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

Status distributed_scan(const scan::Buffers& b, int device, void* stream) {
  const int64_t blocks = b.record.N * b.record.HV;
  if (blocks == 0) return Status::Ok();
  DeviceGuard guard(device);
  KDA_CUDA_CHECK(guard.status());
  scan_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(b);
  KDA_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

}  // namespace kda::cuda
