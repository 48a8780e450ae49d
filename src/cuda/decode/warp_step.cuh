// warp_step.cuh — one token's update of a warp's value rows held in registers, shared by the warp
// kernel (decode/warp.cuh) and the single-token kernel (decode/single.cuh).
#pragma once

#include <cuda_runtime.h>

#include "cuda/common/warp_sums.cuh"

namespace kda::cuda::dec {

// s[r][e]: value row r of the warp's kRows rows at k = 4 lane + e. d, kv, qv: the token's decay,
// l2-normalized k and scaled q at the lane's 4 k; beta and v: the activated beta and the v of the
// lane's row (row lane / (32 / kRows)). Pass 1: s <- s * decay, u = beta (v - s^T k) of each row
// (a warp reduce-scatter); pass 2: s <- s + k u, o = s^T q. Returns o of the lane's row.
template <int kRows>
__device__ __forceinline__ float warp_rows_token(float (&s)[kRows][4], const float (&d)[4],
                                                 const float (&kv)[4], const float (&qv)[4],
                                                 float beta, float v, int lane) {
  constexpr int kRowLanes = 32 / kRows;  // lanes that end up holding one row's sums
  float p[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s[r][e] *= d[e];
    p[r] = fmaf(s[r][3], kv[3], fmaf(s[r][2], kv[2], fmaf(s[r][1], kv[1], s[r][0] * kv[0])));
  }
  const float u_mine = beta * (v - warp_row_sums<kRows>(p, lane));
  float o[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float u = __shfl_sync(0xffffffffu, u_mine, r * kRowLanes);
#pragma unroll
    for (int e = 0; e < 4; ++e) s[r][e] = fmaf(kv[e], u, s[r][e]);
    o[r] = fmaf(s[r][3], qv[3], fmaf(s[r][2], qv[2], fmaf(s[r][1], qv[1], s[r][0] * qv[0])));
  }
  return warp_row_sums<kRows>(o, lane);
}

}  // namespace kda::cuda::dec
