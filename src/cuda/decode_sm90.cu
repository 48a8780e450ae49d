// decode_sm90.cu — CUDA decode (not yet implemented: reports kUnsupported).
#include "cuda/cuda_backend.h"

namespace kda::cuda {

Status decode(const detail::DecodeProblem&, const ExecOptions&, bool) {
  return {StatusCode::kUnsupported, "argument 'exec.backend': the CUDA decode kernel is not implemented yet"};
}

}  // namespace kda::cuda
