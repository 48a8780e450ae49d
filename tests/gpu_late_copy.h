// gpu_late_copy.h — a test kernel that rewrites memory late: it lets the next kernel in the stream
// start (programmatic dependent launch), spins for `spin_ns`, then copies `bytes` from src to dst.
// The next kernel, launched with PDL, runs its code before griddepcontrol.wait while the copy is
// pending, as behind a model's kernel that writes the call's inputs.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace kda::test {

cudaError_t launch_late_copy(void* dst, const void* src, size_t bytes, unsigned long long spin_ns,
                             cudaStream_t stream);

}  // namespace kda::test
