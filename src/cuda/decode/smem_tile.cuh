// smem_tile.cuh — what the staged and bulk kernels share: a 32-row state tile in shared
// memory, streamed in two passes per token (smem_tile_token), token staging once per block
// (stage_next_token), where each token's state goes (token_dst, empty_row_dst), padding rows.
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
// The staged tile kernel (V-first, K = V = 128, fp32 or bf16 pool with 16-byte aligned rows)
// ---------------------------------------------------------------------------------------------
//
// The tile kernel's block (n, hv, 32 value rows; 128 threads; TileMap<128, StateT, false>: the
// same thread <-> element map; the k products go to four partial sums instead of one chain), but
// the state tile goes global -> shared memory with 16-byte cp.async instead of into registers.
// Every thread copies exactly the 16-byte units it later reads (unit u of thread i at
// tile_sh[u * 128 + i]: a warp's accesses are 512 contiguous bytes, no bank conflicts), so its
// own cp.async.wait_all is the only wait its state reads need. The compute streams the tile from
// shared memory in two passes per token (pass 1: S^T k of the decayed state; pass 2: s' = s *
// decay + k u, S'^T q, then s' to global memory with 16-byte streaming stores and, if another
// token follows, back to shared memory), so only a few values per thread are live: ~40 registers
// instead of 79, 10 blocks (160 KB of state loads) resident per SM instead of 6 (96 KB).
// Token preprocessing is done once per block by warp 0 (load_raw_token / prep_token, as the
// tile kernel's stage_token: bitwise the same) into one of two PreparedToken slots
// (alternating by token parity, so one block barrier per token suffices). Token 0's input loads
// of a dense row are issued before the index loads are consumed, and preprocessed while the
// state copies are in flight.
constexpr int kStagedK = 128;
static_assert(kStagedK == kDecodeFastK, "heuristics/decode.h: the staged / bulk kernels' K");
constexpr int kStagedThreads = 128;
constexpr int kStagedMinBlocks = 10;  // registers <= 48: 10 x 128 x 48 = 61440 <= 64 K

// 16 bytes of state (StateT) <-> fp32 (the StateVec<StateT>::load / store element order).
template <typename StateT>
__device__ __forceinline__ void unpack_unit(const uint4& x, float* dst) {
  if constexpr (sizeof(StateT) == 4) {
    dst[0] = __uint_as_float(x.x), dst[1] = __uint_as_float(x.y), dst[2] = __uint_as_float(x.z),
    dst[3] = __uint_as_float(x.w);
  } else {
    const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      dst[2 * j] = __uint_as_float(w[j] << 16);
      dst[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
  }
}

template <typename StateT>
__device__ __forceinline__ uint4 pack_unit(const float* src) {
  if constexpr (sizeof(StateT) == 4) {
    return make_uint4(__float_as_uint(src[0]), __float_as_uint(src[1]), __float_as_uint(src[2]),
                      __float_as_uint(src[3]));
  } else {
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      w[j] = static_cast<uint32_t>(float_to_bf16_bits(src[2 * j])) |
             (static_cast<uint32_t>(float_to_bf16_bits(src[2 * j + 1])) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// Where a state tile goes in global memory: row `r` of tensor `t`, head hv (data == nullptr:
// nowhere).
template <typename StateT>
struct TileDst {
  StateT* data = nullptr;
  int64_t s2 = 0;
  bool vec = false;
  __device__ __forceinline__ void set(const StridedView& t, int64_t r, int hv) {
    data = static_cast<StateT*>(t.data) + r * t.s0 + hv * t.s1;
    s2 = t.s2;
    vec = t.vec;
  }
  // Stores the kVec values of unit (vt, r) of a smem-staged tile's thread (TileMap layout).
  template <class Map>
  __device__ __forceinline__ void store_unit(const Map& m, int vt, int r, const float* v) const {
    StateVec<StateT>::store(data + static_cast<int64_t>(m.v_of(vt)) * s2 + m.k_of_run(r), vec, v);
  }
};

// The emit callback of smem_tile_token: row vt's output, stored by the row's output lane.
template <class Map>
struct RowOutput {
  const DecodeArgs& a;
  const Map& m;
  int64_t off;
  bool lane;
  __device__ __forceinline__ void operator()(int vt, float o) const {
    if (lane) store_elem(a.out.data, a.out.dtype, off + m.v_of(vt), o);
  }
};

// A padding row (no read slot): zero output for its tokens, no state access. The lane of each
// row group that stores outputs writes its rows (columns) of every token.
template <class Map>
__device__ __forceinline__ void zero_padding_outputs(const DecodeArgs& a, const SeqRow& row, int hv,
                                                     const Map& m) {
  if (m.lane_k != 0) return;
  for (int64_t t = 0; t < row.len; ++t) {
    const int64_t o_off = a.out.offset(row.b, row.bos + t, hv);
#pragma unroll
    for (int vt = 0; vt < Map::kVt; ++vt)
      store_elem(a.out.data, a.out.dtype, o_off + m.v_of(vt), 0.f);
  }
}

// Where the state after token t of row n goes (at most one place; data == nullptr: nowhere):
// per-token states, [N, Tmax] write slots, or after the last token the final state / read slot.
template <typename StateT>
__device__ __forceinline__ TileDst<StateT> token_dst(const DecodeArgs& a, const SeqRow& row,
                                                     int64_t n, int hv, int64_t t) {
  TileDst<StateT> dst;
  if (!a.store_final_state) return dst;
  if (a.has_intermediate) {
    dst.set(a.intermediate_states, row.b * a.T + row.bos + t, hv);
  } else if (a.indices_2d) {
    const int64_t ws = token_slot(a, n, t);
    if (ws >= 0) dst.set(a.state, ws, hv);
  } else if (t + 1 == row.len) {
    if (a.has_final_state)
      dst.set(a.final_state, n, hv);
    else
      dst.set(a.state, row.slot, hv);
  }
  return dst;
}

// A row without tokens (an empty varlen sequence, T = 0) passes its initial state through to the
// final state or its read slot, unless states go per token (data == nullptr: nothing to store).
template <typename StateT>
__device__ __forceinline__ TileDst<StateT> empty_row_dst(const DecodeArgs& a, const SeqRow& row,
                                                         int64_t n, int hv) {
  TileDst<StateT> dst;
  if (row.len != 0 || !a.store_final_state || a.has_intermediate || a.indices_2d) return dst;
  if (a.has_final_state)
    dst.set(a.final_state, n, hv);
  else
    dst.set(a.state, row.slot, hv);
  return dst;
}

// Token t > 0 of a shared-memory tile kernel: warp 0 preprocesses it into `slot`, then the block
// barrier publishes it (uniform over the block).
__device__ __forceinline__ void stage_next_token(const DecodeArgs& a, const SeqRow& row, int64_t t,
                                                 int h, int hv, int tile_v0, bool prep_warp,
                                                 PreparedToken& slot) {
  if (prep_warp) {
    RawToken r;
    load_raw_token(a, row.b, row.bos + t, h, hv, tile_v0, lane_id(), r);
    prep_token(a, r, lane_id(), slot);
  }
  __syncthreads();
}

// Block -> (sequence n, value head hv, first value row tile_v0 of its tile of kTileV rows), for a
// grid of N x HV x V / kTileV blocks.
struct TileBlock {
  int64_t n;
  int hv, h, tile_v0;
  __device__ __forceinline__ TileBlock(const DecodeArgs& a, int tile_rows) {
    const unsigned vtiles = static_cast<unsigned>(a.V) / tile_rows;
    const unsigned head_blk = blockIdx.x / vtiles;
    tile_v0 = static_cast<int>(blockIdx.x - head_blk * vtiles) * tile_rows;
    hv = static_cast<int>(head_blk % static_cast<unsigned>(a.HV));
    n = head_blk / static_cast<unsigned>(a.HV);
    h = hv / a.groups;
  }
};

// One token over this thread's two rows of a tile in shared memory (the staged and bulk kernels):
//   pass 1: u = beta (v - (diag(decay) S)^T k) per row, over the row's kKLanes lanes;
//   pass 2: s' = s * decay + k u (rounded to bf16 for a bf16 state), o = S'^T q (before the
//           rounding).
// The k products go to four partial sums (k mod 4): 16-deep FMA chains per row instead of 64.
// unit(vt, r) is the thread's 16-byte unit of row vt, run r; sink(vt, r, unit, s) receives s' of
// each unit (kVec fp32 values); emit(vt, o) the row's output (every lane of the row holds it).
template <class Map, typename StateT, int kUnrollR, int kUnrollVt, class Unit, class Sink,
          class Emit>
__device__ __forceinline__ void smem_tile_token(const Map& m, int tile_v0, const PreparedToken& tk,
                                                Unit unit, Sink sink, Emit emit) {
  constexpr int kVt = Map::kVt, kRuns = Map::kRuns, kVec = Map::kVec;
  constexpr bool kBf16State = sizeof(StateT) == 2;
  static_assert(kVt == 2, "two rows per thread");
  float u0 = 0.f, u1 = 0.f;
#pragma unroll(kUnrollVt)
  for (int vt = 0; vt < kVt; ++vt) {
    float sk4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll(kUnrollR)
    for (int r = 0; r < kRuns; ++r) {
      float s[kVec];
      unpack_unit<StateT>(unit(vt, r), s);
#pragma unroll
      for (int e4 = 0; e4 < kVec; e4 += 4) {
        const int kx = m.k_of_run(r) + e4;
        const float4 d4 = *reinterpret_cast<const float4*>(&tk.decay[kx]);
        const float4 kv4 = *reinterpret_cast<const float4*>(&tk.k[kx]);
        const float d[4] = {d4.x, d4.y, d4.z, d4.w}, kv[4] = {kv4.x, kv4.y, kv4.z, kv4.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) sk4[e] = fmaf(s[e4 + e] * d[e], kv[e], sk4[e]);
      }
    }
    const int vr = m.v_of(vt) - tile_v0;
    const float sk = (sk4[0] + sk4[1]) + (sk4[2] + sk4[3]);
    const float uv = tk.beta[vr] * (tk.v[vr] - lane_group_sum<Map::kKLanes>(sk));
    if (vt == 0)
      u0 = uv;
    else
      u1 = uv;
  }
#pragma unroll(kUnrollVt)
  for (int vt = 0; vt < kVt; ++vt) {
    const float uv = vt == 0 ? u0 : u1;
    float acc4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll(kUnrollR)
    for (int r = 0; r < kRuns; ++r) {
      uint4& un = unit(vt, r);
      float s[kVec];
      unpack_unit<StateT>(un, s);
#pragma unroll
      for (int e4 = 0; e4 < kVec; e4 += 4) {
        const int kx = m.k_of_run(r) + e4;
        const float4 d4 = *reinterpret_cast<const float4*>(&tk.decay[kx]);
        const float4 kv4 = *reinterpret_cast<const float4*>(&tk.k[kx]);
        const float4 q4 = *reinterpret_cast<const float4*>(&tk.q[kx]);
        const float d[4] = {d4.x, d4.y, d4.z, d4.w}, kv[4] = {kv4.x, kv4.y, kv4.z, kv4.w};
        const float qv[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = fmaf(kv[e], uv, s[e4 + e] * d[e]);
          acc4[e] = fmaf(x, qv[e], acc4[e]);
          if (kBf16State) x = round_bf16(x);
          s[e4 + e] = x;
        }
      }
      sink(vt, r, un, s);
    }
    emit(vt, lane_group_sum<Map::kKLanes>((acc4[0] + acc4[1]) + (acc4[2] + acc4[3])));
  }
}

}  // namespace kda::cuda::dec
