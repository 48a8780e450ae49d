// check.h — the one CUDA error check of the library: a failed runtime call becomes a returned
// Status (StatusCode::kCudaError) that names the call, the CUDA error and file:line.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "core/problem.h"  // Status, KDA_RETURN_IF_ERROR

namespace kda::cuda {

inline Status cuda_status(cudaError_t e, const char* expr, const char* file, int line) {
  return {StatusCode::kCudaError, std::string(expr) + " failed: " + cudaGetErrorString(e) + " (" +
                                      file + ":" + std::to_string(line) + ")"};
}

}  // namespace kda::cuda

// Evaluates `expr` (a cudaError_t) once; on failure returns its Status from the enclosing function.
#define KDA_CUDA_CHECK(expr)                                                     \
  do {                                                                           \
    const cudaError_t kda_cuda_err_ = (expr);                                    \
    if (kda_cuda_err_ != cudaSuccess)                                            \
      return ::kda::cuda::cuda_status(kda_cuda_err_, #expr, __FILE__, __LINE__); \
  } while (0)
