// tile.cuh — the tile kernel (decode_tile_kernel<kMaxK, StateT, kKFirst>): every shape the
// other kernels do not take (K-first, K != 128, unaligned pools; kMaxK in {64, 128, 256}: K is
// padded up to it with masked lanes; 12 instantiations). One block per (sequence, value head, 32
// value rows); the tile lives in registers across the tokens (tile_map.cuh); every warp stages
// its own copy of each token (stage_token). docs/perf_decode.md, "tile kernel".
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/ptx.cuh"
#include "cuda/decode/rows.cuh"
#include "cuda/decode/tile_map.cuh"
#include "cuda/decode/token.cuh"

namespace kda::cuda::dec {

// ---------------------------------------------------------------------------------------------
// The fast kernel
// ---------------------------------------------------------------------------------------------

template <int kMaxK, typename StateT, bool kKFirst>
__global__ void __launch_bounds__(TileMap<kMaxK, StateT, kKFirst>::kThreads,
                                  TileMap<kMaxK, StateT, kKFirst>::kMinBlocks)
    decode_tile_kernel(const __grid_constant__ DecodeArgs a) {
  pdl_prologue();
  using Map = TileMap<kMaxK, StateT, kKFirst>;
  constexpr int kVt = Map::kVt, kKt = Map::kKt;
  constexpr bool kBf16State = sizeof(StateT) == 2;

  // ---- Block -> (sequence n, value head hv, tile of 32 value rows / columns)
  const unsigned vtiles = static_cast<unsigned>(a.V) / Map::kTileV;
  const unsigned head_blk = blockIdx.x / vtiles;  // n * HV + hv (the grid is < 2^31 blocks)
  const int tile = static_cast<int>(blockIdx.x - head_blk * vtiles);
  const int hv = static_cast<int>(head_blk % static_cast<unsigned>(a.HV));
  const int64_t n = head_blk / static_cast<unsigned>(a.HV);
  const int h = hv / a.groups;
  const Map m(threadIdx.x, tile * Map::kTileV);
  const bool out_lane = m.lane_k == 0;  // the lane that stores its rows' (columns') outputs
  __shared__ TokenStage<kMaxK> stage[Map::kThreads / 32];
  TokenStage<kMaxK>& sh = stage[threadIdx.x / 32];

  // ---- Sequence span and read slot (padding rows: zero output, no state access)
  const SeqRow row = resolve_row(a, n);
  if (row.slot < 0) {
    zero_padding_outputs(a, row, hv, m);
    return;
  }

  // ---- State tile -> registers: kVt x kKt fp32 (32 for K <= 128), every load in flight at once
  float s[kVt][kKt];
  if (a.use_initial_state) {
    load_state_tile<Map, StateT, kKFirst>(m, a.state, row.slot, hv, a.K, s);
  } else {
#pragma unroll
    for (int vt = 0; vt < kVt; ++vt)
#pragma unroll
      for (int kt = 0; kt < kKt; ++kt) s[vt][kt] = 0.f;
  }
  prefetch_later_tokens(a, row, h, hv);
  const float exp_A = head_exp_A(a, hv);

#pragma unroll 1
  for (int64_t t = 0; t < row.len; ++t) {
    const int64_t tok = row.bos + t;

    // ---- Token inputs, preprocessed once per warp into its shared slice: q (l2norm, scale),
    //      k (l2norm), decay = exp(a_t); v and b_t of this thread's rows (columns)
    stage_token<kMaxK>(a, row.b, tok, h, hv, exp_A, sh);
    float vv[kVt], bt[kVt];
    const int64_t v_off = a.v.offset(row.b, tok, hv);
#pragma unroll
    for (int vt = 0; vt < kVt; ++vt) {
      vv[vt] = load_elem(a.v.data, a.v.dtype, v_off + m.v_of(vt));
      bt[vt] = activated_beta(a, row.b, tok, hv, m.v_of(vt));
    }
    __syncwarp();

    // ---- Recurrence: S <- diag(exp a) S;  u = b (v - S^T k);  S <- S + k u^T;  o = S^T q
    float o[kVt];
    recurrence_token<Map, kBf16State>(m, s, sh.q, sh.k, sh.decay, vv, bt, o);
    __syncwarp();  // the slice is free for the next token

    // ---- Output row of this token
    if (out_lane) {
      const int64_t o_off = a.out.offset(row.b, tok, hv);
#pragma unroll
      for (int vt = 0; vt < kVt; ++vt)
        store_elem(a.out.data, a.out.dtype, o_off + m.v_of(vt), o[vt]);
    }

    // ---- Per-token states: intermediate buffer, or in place through [N, Tmax] indices
    if (a.store_final_state) {
      if (a.has_intermediate) {
        store_state_tile<Map, StateT, kKFirst>(m, a.intermediate_states, row.b * a.T + tok, hv, a.K,
                                               s);
      } else if (a.indices_2d) {
        const int64_t ws = token_slot(a, n, t);
        if (ws >= 0) store_state_tile<Map, StateT, kKFirst>(m, a.state, ws, hv, a.K, s);
      }
    }
  }

  // ---- Final state: separate output, or in place to the read slot
  if (a.store_final_state && !a.has_intermediate && !a.indices_2d) {
    if (a.has_final_state)
      store_state_tile<Map, StateT, kKFirst>(m, a.final_state, n, hv, a.K, s);
    else
      store_state_tile<Map, StateT, kKFirst>(m, a.state, row.slot, hv, a.K, s);
  }
}

}  // namespace kda::cuda::dec
