// phase_timing.cuh — per-phase cycle counts of the fused kernel's warps, a development aid that
// is compiled out unless the build defines KDA_FUSED_PHASE_TIMING (e.g. CMAKE_CUDA_FLAGS=
// -DKDA_FUSED_PHASE_TIMING). Lane 0 of each warp adds the cycles since its previous mark to slot k
// of its warp's row in shared memory (the row also keeps the last mark, so no register is held
// between marks); CTA 0 prints each warp's row, in cycles per chunk, when the warp is done.
#pragma once

#include <cstdint>
#include <cstdio>

namespace kda::cuda::pf {

inline constexpr int kPhaseSlots = 12;
#ifdef KDA_FUSED_PHASE_TIMING
inline constexpr bool kPhaseTiming = true;
#else
inline constexpr bool kPhaseTiming = false;
#endif
// Bytes of the rows of `warps` warps (slots, then the last mark).
__host__ __device__ constexpr int phase_timing_bytes(int warps) {
  return kPhaseTiming ? warps * (kPhaseSlots + 1) * 8 : 0;
}

struct PhaseClock {
  unsigned long long* row;  // this warp's row in shared memory
  // The rows of all the CTA's warps start at `base`; this warp's is row threadIdx.x / 32.
  __device__ __forceinline__ void start(uint8_t* base) {
    if constexpr (kPhaseTiming) {
      row = reinterpret_cast<unsigned long long*>(base) + (threadIdx.x >> 5) * (kPhaseSlots + 1);
      if ((threadIdx.x & 31) == 0) {
        for (int k = 0; k < kPhaseSlots; ++k) row[k] = 0;
        row[kPhaseSlots] = clock64();
      }
    }
  }
  __device__ __forceinline__ void mark(int k) {
    if constexpr (kPhaseTiming) {
      if ((threadIdx.x & 31) == 0) {
        const unsigned long long now = clock64();
        row[k] += now - row[kPhaseSlots];
        row[kPhaseSlots] = now;
      }
    }
  }
  // CTA 0 only: the warp's slots divided by `chunks`.
  __device__ __forceinline__ void report(const char* role, long long chunks) {
    if constexpr (kPhaseTiming) {
      if (blockIdx.x == 0 && (threadIdx.x & 31) == 0 && chunks > 0) {
        double v[kPhaseSlots];
        for (int k = 0; k < kPhaseSlots; ++k) v[k] = static_cast<double>(row[k]) / chunks;
        printf(
            "phase %s warp %2d chunks %lld: %.0f %.0f %.0f %.0f %.0f %.0f %.0f %.0f %.0f %.0f %.0f "
            "%.0f\n",
            role, static_cast<int>(threadIdx.x >> 5), chunks, v[0], v[1], v[2], v[3], v[4], v[5],
            v[6], v[7], v[8], v[9], v[10], v[11]);
      }
    }
  }
};

}  // namespace kda::cuda::pf
