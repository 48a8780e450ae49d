// check.h — the one CUDA error check of the library: a failed runtime call becomes a returned
// Status (StatusCode::kCudaError) that names the call, the CUDA error and file:line.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "kda/kda.h"

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

// Returns a failed Status from the enclosing function.
#ifndef KDA_RETURN_IF_ERROR
#define KDA_RETURN_IF_ERROR(expr)              \
  do {                                         \
    const ::kda::Status kda_status_ = (expr);  \
    if (!kda_status_.ok()) return kda_status_; \
  } while (0)
#endif
