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

#ifdef KDA_PREFILL_TRACE
// Development builds only (-DKDA_PREFILL_TRACE): SM clocks per phase of the prepare kernel summed
// over blocks (phases 0..7 of prepare.cuh), then the number of blocks; optionally resets them.
Status prefill_trace_fetch(std::vector<unsigned long long>* clocks, bool reset);
#endif
Status decode(const detail::DecodeProblem& pr, const ExecOptions& exec, bool check_indices);

#ifdef KDA_DECODE_TRACE
// Development builds only (-DKDA_DECODE_TRACE): %globaltimer stamps of the staged decode kernel,
// [kTraceCalls][kTracePoints][kTraceBlocks] (points: 0 entry, 1 after the PDL wait, 2 read slot
// known, 3 token 0 staged, 4 state tile in shared memory, 5 computed and stored, 6 end), per call
// modulo kTraceCalls since the last reset; then optionally resets stamps and the call index.
inline constexpr int kTraceCalls = 64, kTracePoints = 7, kTraceBlocks = 128;
Status decode_trace_fetch(std::vector<unsigned long long>* stamps, bool reset);
#endif

}  // namespace kda::cuda
