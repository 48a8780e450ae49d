// bench_cuda.h — the CUDA error check of the benchmarks: a failed runtime call prints the call,
// the CUDA error and file:line and exits with status 2 (a benchmark has no caller to report to).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>

#define BENCH_CUDA(expr)                                                                     \
  do {                                                                                       \
    const cudaError_t bench_err_ = (expr);                                                   \
    if (bench_err_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s failed: %s (%s:%d)\n", #expr, cudaGetErrorString(bench_err_), \
                   __FILE__, __LINE__);                                                      \
      std::exit(2);                                                                          \
    }                                                                                        \
  } while (0)
