// scan.h — the device side of the context-parallel prefill (include/kda/distributed.h), as the
// host code sees it. No CUDA headers here; these functions exist only when KDA_WITH_CUDA is
// defined. All three launch on `stream` of device `device`, allocate nothing and never
// synchronize.
#pragma once

#include <cstddef>

#include "core/problem.h"
#include "core/state_scan.h"

namespace kda::cuda {

// Before the M pass: the identity and the zeros, and this rank's piece lengths (when gathered).
Status distributed_prepare(const scan::Buffers& b, int device, void* stream);
// With checkpoints, after the gather of the piece lengths: the parts' cu_seqlens and
// checkpoint_offsets (scan::write_part_layout).
Status distributed_layout(const scan::Buffers& b, int device, void* stream);
// The scan over ranks after the gather of the records: `start`, `final_state`, the pool slots
// this rank writes and the checkpoints at its heads' ends, one block per (sequence, value head).
Status distributed_scan(const scan::Buffers& b, int device, void* stream);

}  // namespace kda::cuda
