// cuda_backend.h — the CUDA backend as seen from the host dispatcher. No CUDA headers here: the
// dispatcher compiles without nvcc, and these functions exist only when KDA_WITH_CUDA is defined.
#pragma once

#include <vector>

#include "core/problem.h"

namespace kda::cuda {

std::vector<DeviceInfo> devices();

// Both take a validated problem whose tensors live on one CUDA device; they launch on
// exec.stream, allocate nothing on the device and never synchronize (except check_indices).
Status prefill(const detail::PrefillProblem& pr, const ExecOptions& exec);
Status prefill_workspace_size(const detail::PrefillProblem& pr, size_t* bytes);
// check_indices of prefill on CUDA tensors: copies state_indices and cu_seqlens to the host,
// synchronizes exec.stream and checks their values (detail::check_prefill_index_values).
Status check_prefill_indices(const detail::PrefillProblem& pr, const ExecOptions& exec);
// A testing hook: the fused prefill's warm-up walks on `device` since the process started:
// segments run [0] from the sequence's start, [1] from a zero state after a warm-up, [2] segments
// left to the exact passes (prefill/fused.cuh). Synchronizes with the device.
Status prefill_warm_counts(int device, unsigned long long counts[3]);

Status decode(const detail::DecodeProblem& pr, const ExecOptions& exec, bool check_indices);

// The prefill backward (backward/backward.cu): a validated problem on one CUDA device, launched
// on exec.stream with at least prefill_backward_workspace_size() bytes of exec.workspace.
Status prefill_backward(const detail::PrefillBackwardProblem& bp, const ExecOptions& exec);
Status prefill_backward_workspace_size(const detail::PrefillBackwardProblem& bp, size_t* bytes);

}  // namespace kda::cuda
