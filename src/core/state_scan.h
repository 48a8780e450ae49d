// state_scan.h — one step of the context-parallel scan over ranks (spec section 9), per element,
// for the host and the CUDA code alike: the state after a rank's piece from the state before it,
// through the piece's affine map, S_end = M S_start + S_local.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/index_rules.h"  // KDA_HOST_DEVICE
#include "kda/kda.h"

namespace kda::scan {

// Element (a, b) of the next state of one (sequence, value head), in the stored layout, rows of
// C elements. h: the current state (fp64, row-major); m: the rank's M as the prefill from the
// identity stores it ([K, K], row-major: M^T in the V-first layout, M in the K-first layout);
// s: the rank's S_local (as h).
//   V-first (h = S^T, [V, K], C = K):  h' = h m + s    h'[a][b] = s[a][b] + sum_c h[a][c] m[c][b]
//   K-first (h = S,   [K, V], C = V):  h' = m h + s    h'[a][b] = s[a][b] + sum_c m[a][c] h[c][b]
KDA_HOST_DEVICE inline double step_element(const double* h, const float* m, const float* s,
                                           int64_t a, int64_t b, int64_t K, int64_t C,
                                           bool v_first) {
  double acc = s[a * C + b];
  if (v_first) {
    for (int64_t c = 0; c < K; ++c) acc += h[a * C + c] * static_cast<double>(m[c * K + b]);
  } else {
    for (int64_t c = 0; c < K; ++c) acc += static_cast<double>(m[a * K + c]) * h[c * C + b];
  }
  return acc;
}

// Where one rank's gathered record keeps M and S_local of sequence n, value head hv: the record
// is [M: N x HV x K x K | S_local: N x HV x R x C] fp32 (R x C the stored state).
struct Record {
  int64_t N, HV, K, R, C;
  KDA_HOST_DEVICE int64_t floats() const { return N * HV * (K * K + R * C); }
  KDA_HOST_DEVICE int64_t m(int64_t n, int64_t hv) const { return (n * HV + hv) * K * K; }
  KDA_HOST_DEVICE int64_t s(int64_t n, int64_t hv) const {
    return N * HV * K * K + (n * HV + hv) * R * C;
  }
};

// The buffers of one context-parallel call on one device (in the caller's workspace, but the
// two state tensors).
struct Buffers {
  scan::Record record;   // the layout of one rank's gathered [M | S_local] record
  const float* records;  // [world] records, rank order (the gather's output)
  int world = 0, rank = 0;
  bool v_first = true;
  TensorView initial_state;  // [N, HV, R, C], any state dtype, or absent (zero)
  TensorView final_state;    // [N, HV, R, C], any state dtype, or absent
  float* start;              // [N, HV, R, C] fp32 contiguous: this rank's start states
  double* h;                 // [2, N, HV, R, C] fp64: the scan's states
  float* identity;           // [K, K] fp32: the M pass's initial state (broadcast)
  void* zeros;               // `zero_bytes` bytes: the M pass's v (broadcast)
  size_t zero_bytes = 0;
};

}  // namespace kda::scan
