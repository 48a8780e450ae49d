// scan.h — the device side of the context-parallel prefill (include/kda/distributed.h), as the
// host code sees it. No CUDA headers here; these functions exist only when KDA_WITH_CUDA is
// defined.
#pragma once

#include <cstddef>

#include "core/problem.h"
#include "core/state_scan.h"

namespace kda::cuda {

// Writes the identity and the zeros (before the M pass), on `stream` of device `device`.
Status distributed_prepare(const scan::Buffers& b, int device, void* stream);
// The scan over ranks after the gather: `start` and `final_state`, one block per (sequence,
// value head), on `stream` of device `device`.
Status distributed_scan(const scan::Buffers& b, int device, void* stream);

}  // namespace kda::cuda
