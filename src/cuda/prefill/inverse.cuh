// inverse.cuh — X = M^-1 for the prepare kernel's unit lower triangular M = I + diag(b) Akk
// (invert_m): the diagonal 16 x 16 blocks by forward substitution, the off-diagonal blocks from
// them by 3xTF32 tensor-core products (inv_partial, inv_tile), so that X stays ~fp32 accurate.
#pragma once

#include "cuda/common/ptx.cuh"
#include "cuda/prefill/common.cuh"
#include "cuda/prefill/prepare_smem.cuh"

namespace kda::cuda::pf {

// ---- Off-diagonal blocks of X = M^-1 on the tensor cores, 3xTF32: x = hi + lo with hi = tf32(x),
// lo = tf32(x - hi), and a b ~ a_hi b_hi + a_hi b_lo + a_lo b_hi with fp32 accumulation (the
// dropped a_lo b_lo and the rounding of lo are ~2^-22 relative): X stays ~fp32 accurate, its error
// far below the tf32 rounding of Tm. Operands are 16x16 blocks of M and X (pitch kMPitch) in the
// paired k mapping (common.cuh): A fragments are float2 reads along a row.
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = f32_to_tf32(x);
  lo = f32_to_tf32(x - __uint_as_float(hi));
}
// A fragment: rows 0..15, k columns 0..7 at a.
__device__ __forceinline__ void load_a3(const float* a, int g, int c, uint32_t (&hi)[4],
                                        uint32_t (&lo)[4]) {
  const float2 x0 = *reinterpret_cast<const float2*>(a + g * kMPitch + 2 * c);
  const float2 x1 = *reinterpret_cast<const float2*>(a + (g + 8) * kMPitch + 2 * c);
  const float v[4] = {x0.x, x1.x, x0.y, x1.y};
#pragma unroll
  for (int e = 0; e < 4; ++e) split_tf32(v[e], hi[e], lo[e]);
}
// B fragment: k rows 0..7, columns 0..7 at b (column g, rows 2c and 2c + 1).
__device__ __forceinline__ void load_b3(const float* b, int g, int c, uint32_t (&hi)[2],
                                        uint32_t (&lo)[2]) {
  split_tf32(b[2 * c * kMPitch + g], hi[0], lo[0]);
  split_tf32(b[(2 * c + 1) * kMPitch + g], hi[1], lo[1]);
}
__device__ __forceinline__ void mma3_tf32(float (&d)[4], const uint32_t (&ah)[4],
                                          const uint32_t (&al)[4], const uint32_t (&bh)[2],
                                          const uint32_t (&bl)[2]) {
  mma_tf32(d, al, bh[0], bh[1]);  // small terms first
  mma_tf32(d, ah, bl[0], bl[1]);
  mma_tf32(d, ah, bh[0], bh[1]);
}

// Partial sums of the inverse, kept in P as accumulator fragments (slot s, n-tile nt: 32 lanes x
// float4 at P + 128 (2s + nt)): Q_s += M_{i_s k} X_kj over one k block, for MT row blocks i_s and
// both n-tiles of block column j (one warp: the X_kj fragments serve all MT rows, the M
// fragments both n-tiles). add = false starts from zero.
template <int MT>
__device__ __forceinline__ void inv_partial(const float* M, const float* X, float* P,
                                            const int (&rows)[MT], const int (&slots)[MT], int k,
                                            int j, bool add, int g, int c, int lane) {
  float acc[MT][2][4];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const float4 v =
          add ? *reinterpret_cast<const float4*>(P + 128 * (2 * slots[m] + nt) + 4 * lane)
              : make_float4(0.f, 0.f, 0.f, 0.f);
      acc[m][nt][0] = v.x;
      acc[m][nt][1] = v.y;
      acc[m][nt][2] = v.z;
      acc[m][nt][3] = v.w;
    }
#pragma unroll
  for (int ks = 0; ks < 2; ++ks) {
    uint32_t ah[MT][4], al[MT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
      load_a3(M + (16 * rows[m]) * kMPitch + 16 * k + 8 * ks, g, c, ah[m], al[m]);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      if (k == j && ks == 0 && nt == 1) continue;  // upper right 8x8 of X_jj: zero
      uint32_t bh[2], bl[2];
      load_b3(X + (16 * k + 8 * ks) * kMPitch + 16 * j + 8 * nt, g, c, bh, bl);
#pragma unroll
      for (int m = 0; m < MT; ++m) mma3_tf32(acc[m][nt], ah[m], al[m], bh, bl);
    }
  }
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
      *reinterpret_cast<float4*>(P + 128 * (2 * slots[m] + nt) + 4 * lane) =
          make_float4(acc[m][nt][0], acc[m][nt][1], acc[m][nt][2], acc[m][nt][3]);
}

// Columns 8nt..8nt+7 of the off-diagonal block X_ij (i > j), one warp: the last term of the block
// sum, S = Q + M_{i,i-1} X_{i-1,j} (Q: the terms k < i - 1 from inv_partial, slot qs; none when
// i - j = 1), then X_ij = -X_ii S. S is the B operand of the second product: it takes the round
// trip through the tile's own place in X, which nothing else reads in this phase. Each product
// keeps one accumulator per k-step: two chains of 3 dependent mma instead of one of 6.
__device__ __forceinline__ void inv_tile(const float* M, float* X, const float* P, int qs, int i,
                                         int j, int nt, int g, int c, int lane) {
  float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  if (qs >= 0) {
    const float4 v = *reinterpret_cast<const float4*>(P + 128 * (2 * qs + nt) + 4 * lane);
    acc[1][0] = v.x;
    acc[1][1] = v.y;
    acc[1][2] = v.z;
    acc[1][3] = v.w;
  }
  const int k = i - 1;
#pragma unroll
  for (int ks = 0; ks < 2; ++ks) {
    if (k == j && ks == 0 && nt == 1) continue;  // upper right 8x8 of X_jj: zero
    uint32_t ah[4], al[4], bh[2], bl[2];
    load_a3(M + (16 * i) * kMPitch + 16 * k + 8 * ks, g, c, ah, al);
    load_b3(X + (16 * k + 8 * ks) * kMPitch + 16 * j + 8 * nt, g, c, bh, bl);
    mma3_tf32(acc[ks], ah, al, bh, bl);
  }
  float* t = X + (16 * i) * kMPitch + 16 * j + 8 * nt;
  *reinterpret_cast<float2*>(t + g * kMPitch + 2 * c) =
      make_float2(acc[0][0] + acc[1][0], acc[0][1] + acc[1][1]);
  *reinterpret_cast<float2*>(t + (g + 8) * kMPitch + 2 * c) =
      make_float2(acc[0][2] + acc[1][2], acc[0][3] + acc[1][3]);
  __syncwarp();
  float x[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
  for (int ks = 0; ks < 2; ++ks) {
    uint32_t ah[4], al[4], bh[2], bl[2];
    load_a3(X + (16 * i) * kMPitch + 16 * i + 8 * ks, g, c, ah, al);
    load_b3(t + (8 * ks) * kMPitch, g, c, bh, bl);
    mma3_tf32(x[ks], ah, al, bh, bl);
  }
  __syncwarp();  // S read by every lane before it is overwritten
  *reinterpret_cast<float2*>(t + g * kMPitch + 2 * c) =
      make_float2(-x[0][0] - x[1][0], -x[0][1] - x[1][1]);
  *reinterpret_cast<float2*>(t + (g + 8) * kMPitch + 2 * c) =
      make_float2(-x[0][2] - x[1][2], -x[0][3] - x[1][3]);
}

// X = M^-1 for the unit lower triangular M (strictly lower part in M; X gets the lower blocks,
// upper triangles of the diagonal blocks zero), all 256 threads; P: scratch. Ends with a barrier.
// kDiagOnly (16-token records): the four diagonal blocks' inverses only.
template <bool kDiagOnly = false>
__device__ __forceinline__ void invert_m(const float* M, float* X, float* P, int warp, int lane) {
  const int g = lane >> 2, c = lane & 3;
  // Diagonal 16x16 blocks by forward substitution: warp i, lane = column.
  if (warp < 4) {
    const int i = warp, jj = lane & 15;
    float x[16];
#pragma unroll
    for (int t = 0; t < 16; ++t) {
      float acc = (t == jj) ? 1.f : 0.f;
#pragma unroll
      for (int s = 0; s < t; ++s) acc = fmaf(-M[(16 * i + t) * kMPitch + 16 * i + s], x[s], acc);
      x[t] = acc;
    }
    if (lane < 16) {
#pragma unroll
      for (int t = 0; t < 16; ++t) X[(16 * i + t) * kMPitch + 16 * i + jj] = x[t];
    }
  }
  __syncthreads();
  if constexpr (kDiagOnly) return;
  // Off-diagonal blocks: X_ij = -X_ii sum_{k=j}^{i-1} M_ik X_kj, in three phases by distance
  // d = i - j, one barrier each (block columns are independent, so a warp takes 8 columns of a
  // block and chains both of its products). The terms that need only X_jj (M_20 X_00, M_30 X_00,
  // M_31 X_11) and M_31 X_10 go into P from otherwise idle warps ahead of the phase that needs
  // them: every tile then has one k block left before its X_ii product.
  //   d = 1: warps 0-5: X_10, X_21, X_32 (two warps each)   warp 6: Q_20, Q_30   warp 7: Q_31
  //   d = 2: warps 0-3: X_20 (Q_20), X_31 (Q_31)            warp 4: Q_30 += M_31 X_10
  //   d = 3: warps 0-1: X_30 (Q_30)
  if (warp < 6) {
    inv_tile(M, X, P, -1, warp / 2 + 1, warp / 2, warp & 1, g, c, lane);
  } else if (warp == 6) {
    inv_partial<2>(M, X, P, {2, 3}, {0, 1}, 0, 0, false, g, c, lane);
  } else {
    inv_partial<1>(M, X, P, {3}, {2}, 1, 1, false, g, c, lane);
  }
  __syncthreads();
  if (warp < 4) {
    const int i = 2 + (warp >> 1);
    inv_tile(M, X, P, i == 2 ? 0 : 2, i, i - 2, warp & 1, g, c, lane);
  } else if (warp == 4) {
    inv_partial<1>(M, X, P, {3}, {1}, 1, 0, true, g, c, lane);
  }
  __syncthreads();
  if (warp < 2) inv_tile(M, X, P, 1, 3, 0, warp, g, c, lane);
  __syncthreads();
}

}  // namespace kda::cuda::pf
