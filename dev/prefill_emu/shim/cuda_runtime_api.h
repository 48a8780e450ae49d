// Emulation shim of the CUDA runtime API used by tests/gpu_support.h and the GPU tests.
#pragma once
#include <cstddef>
#include <cstdlib>
#include <cstring>
typedef int cudaError_t;
enum { cudaSuccess = 0, cudaErrorMemoryAllocation = 2 };
enum cudaMemcpyKind { cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice };
typedef struct CUstream_st* cudaStream_t;
typedef struct CUgraph_st* cudaGraph_t;
typedef struct CUgraphExec_st* cudaGraphExec_t;
enum { cudaStreamNonBlocking = 1 };
enum cudaStreamCaptureMode {
  cudaStreamCaptureModeGlobal,
  cudaStreamCaptureModeThreadLocal,
  cudaStreamCaptureModeRelaxed
};
struct cudaDeviceProp {
  char name[256];
  int major, minor, multiProcessorCount;
  size_t totalGlobalMem;
};
inline const char* cudaGetErrorString(cudaError_t) { return "emulated error"; }
// Fresh device memory reads as 0xff bytes (NaN as fp32 / bf16, -1 as an index): a kernel that
// reads what nothing wrote shows up.
inline cudaError_t cudaMalloc(void** p, size_t n) {
  const size_t bytes = (n + 255) / 256 * 256;
  *p = std::aligned_alloc(256, bytes > 0 ? bytes : 256);
  if (*p == nullptr) return 2;
  std::memset(*p, 0xff, bytes);
  return 0;
}
inline cudaError_t cudaFree(void* p) {
  std::free(p);
  return 0;
}
inline cudaError_t cudaMemset(void* p, int v, size_t n) {
  std::memset(p, v, n);
  return 0;
}
inline cudaError_t cudaMemcpy(void* d, const void* s, size_t n, cudaMemcpyKind) {
  std::memcpy(d, s, n);
  return 0;
}
inline cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, cudaMemcpyKind, cudaStream_t) {
  std::memcpy(d, s, n);
  return 0;
}
inline cudaError_t cudaSetDevice(int) { return 0; }
inline cudaError_t cudaGetDevice(int* d) {
  *d = 0;
  return 0;
}
inline cudaError_t cudaGetDeviceCount(int* n) {
  *n = 1;
  return 0;
}
inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int) {
  std::memset(p, 0, sizeof(*p));
  p->major = 9;
  p->minor = 0;
  p->multiProcessorCount = 132;
  return 0;
}
inline cudaError_t cudaGetLastError() { return 0; }
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return 0; }
inline cudaError_t cudaDeviceSynchronize() { return 0; }
inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  *s = nullptr;
  return 0;
}
inline cudaError_t cudaStreamDestroy(cudaStream_t) { return 0; }
inline cudaError_t cudaStreamBeginCapture(cudaStream_t, cudaStreamCaptureMode) { return 0; }
inline cudaError_t cudaStreamEndCapture(cudaStream_t, cudaGraph_t* g) {
  *g = nullptr;
  return 0;
}
inline cudaError_t cudaGraphInstantiate(cudaGraphExec_t* e, cudaGraph_t, unsigned long long) {
  *e = nullptr;
  return 0;
}
inline cudaError_t cudaGraphLaunch(cudaGraphExec_t, cudaStream_t) { return 0; }
inline cudaError_t cudaGraphExecDestroy(cudaGraphExec_t) { return 0; }
inline cudaError_t cudaGraphDestroy(cudaGraph_t) { return 0; }
