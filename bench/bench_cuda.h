// bench_cuda.h — the CUDA error check and the CUDA-event timing loop of the benchmarks: a failed
// runtime call prints the call, the CUDA error and file:line and exits with status 2 (a benchmark
// has no caller to report to).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define BENCH_CUDA(expr)                                                                     \
  do {                                                                                       \
    const cudaError_t bench_err_ = (expr);                                                   \
    if (bench_err_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s failed: %s (%s:%d)\n", #expr, cudaGetErrorString(bench_err_), \
                   __FILE__, __LINE__);                                                      \
      std::exit(2);                                                                          \
    }                                                                                        \
  } while (0)

// Median and fastest ms of `iters` calls of call() (true: the call succeeded), CUDA events around
// each on `stream`, the L2 flushed before each by a memset of `flush_bytes` at `flush`; {-1, -1}
// as soon as a call fails.
struct EventTiming {
  double median_ms = -1, min_ms = -1;
};
template <class Call>
EventTiming time_events(Call&& call, int iters, cudaStream_t stream, void* flush,
                        size_t flush_bytes) {
  cudaEvent_t e0, e1;
  BENCH_CUDA(cudaEventCreate(&e0));
  BENCH_CUDA(cudaEventCreate(&e1));
  std::vector<float> ms;
  bool ok = true;
  for (int i = 0; i < iters && ok; ++i) {
    BENCH_CUDA(cudaMemsetAsync(flush, i & 0xff, flush_bytes, stream));
    BENCH_CUDA(cudaEventRecord(e0, stream));
    ok = call();
    BENCH_CUDA(cudaEventRecord(e1, stream));
    BENCH_CUDA(cudaEventSynchronize(e1));
    float t = 0;
    BENCH_CUDA(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  if (!ok || ms.empty()) return {};
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], ms.front()};
}
