// warp_sums.cuh — a warp's row sums as a reduce-scatter, shared by the decode's warp kernel
// (decode/warp.cuh) and the fused prefill (prefill/fused.cuh).
#pragma once

#include <cuda_runtime.h>

namespace kda::cuda {

// Sums x[r] over the 32 lanes for every r < kRows, and returns in each lane the sum of row
// lane / (32 / kRows) (a reduce-scatter: at each step a lane keeps half of its partial sums and
// receives its partner's partials of that half; the last steps are butterflies). Every lane that
// returns a row's sum returns the same bits.
template <int kCount, int kMask, int kRows>
__device__ __forceinline__ void row_sums_step(float (&x)[kRows], int lane) {
  if constexpr (kCount > 1) {
    constexpr int kHalf = kCount / 2;
    const bool upper = (lane & kMask) != 0;
#pragma unroll
    for (int j = 0; j < kHalf; ++j) {
      const float send = upper ? x[j] : x[j + kHalf];
      const float keep = upper ? x[j + kHalf] : x[j];
      x[j] = keep + __shfl_xor_sync(0xffffffffu, send, kMask);
    }
    row_sums_step<kHalf, kMask / 2>(x, lane);
  }
}
template <int kRows>
__device__ __forceinline__ float warp_row_sums(float (&x)[kRows], int lane) {
  row_sums_step<kRows, 16>(x, lane);
  float s = x[0];
#pragma unroll
  for (int m = 32 / kRows / 2; m >= 1; m /= 2) s += __shfl_xor_sync(0xffffffffu, s, m);
  return s;
}

}  // namespace kda::cuda
