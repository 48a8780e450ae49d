// prepare_smem.cuh — the shared-memory layout of the prepare kernel (prepare.cuh): byte offsets
// and pitches of q^, k^, G, the row factors, beta, M = I + diag(b) Akk, X = M^-1 and the inverse's
// partial sums.
#pragma once

#include "cuda/prefill/common.cuh"

namespace kda::cuda::pf {

// Shared memory of the prepare kernel. Pitches are chosen for conflict-free fragment reads.
// G is kept in log2 units (G * log2 e) so that every exp() below is one MUFU.EX2.
inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr int kQkPitch = 136;  // f16 per row of q^, k^ (272 B)
inline constexpr int kGPitch = 136;   // fp32 per row of G (544 B)
inline constexpr int kMPitch = 72;    // fp32 per row of M = I + diag(b) Akk and X = M^-1 (288 B)
inline constexpr int kSmQr = 0;       // q^ [64][136] f16, then kg
inline constexpr int kSmKr = kSmQr + kChunk * kQkPitch * 2;  // k^ [64][136] f16
inline constexpr int kSmG = kSmKr + kChunk * kQkPitch * 2;   // G      [64][136] fp32
inline constexpr int kSmFq = kSmG + kChunk * kGPitch * 4;    // q_t = q^_t fq_t  [64]
inline constexpr int kSmFk = kSmFq + kChunk * 4;             // k_t = k^_t fk_t  [64]
inline constexpr int kSmBeta = kSmFk + kChunk * 4;           // b_t              [64]
inline constexpr int kSmM = kSmBeta + kChunk * 4;         // M [64][72] fp32, then W's Tm fragments
inline constexpr int kSmX = kSmM + kChunk * kMPitch * 4;  // X = M^-1 [64][72] fp32
inline constexpr int kSmP = kSmX + kChunk * kMPitch * 4;  // inverse partial sums [3][16][16]
inline constexpr int kPrepareSmemBytes = kSmP + 3 * 256 * 4;  // 110,336
inline constexpr int kPrepareThreads = 256;
// Slot of lane (g, c)'s fragment among the four of group g in the Tm fragment copy (W's A operand).
__device__ __forceinline__ int tfrag_slot(int g, int c) { return (c + (g >> 1)) & 3; }

}  // namespace kda::cuda::pf
