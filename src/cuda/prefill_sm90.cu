// prefill_sm90.cu — CUDA prefill (not yet implemented: reports kUnsupported).
#include "cuda/cuda_backend.h"

namespace kda::cuda {

Status prefill(const detail::PrefillProblem&, const ExecOptions&) {
  return {StatusCode::kUnsupported, "argument 'exec.backend': the CUDA prefill kernel is not implemented yet"};
}

Status prefill_workspace_size(const detail::PrefillProblem&, size_t* bytes) {
  *bytes = 0;
  return Status::Ok();
}

}  // namespace kda::cuda
