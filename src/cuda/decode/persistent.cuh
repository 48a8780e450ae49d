// persistent.cuh — the persistent kernel (decode_persistent_kernel<StateT>, 2 instantiations):
// V-first, K = V = 128, fp32 or bf16 pool with 16-byte aligned rows, dense tokens, T <= 8. Runs
// only when asked for (Tuning::decode_kernel): measured slower than the tile kernel on the H200
// (docs/perf_decode.md, "persistent, software-pipelined kernel"). grid = min(items, 3 x SMs)
// blocks of 4 consumer warps + 1 producer warp; work items (n, hv, 32-row tile) are dealt round
// robin; the producer keeps a ring of S stages in shared memory filled with 1-D bulk copies and
// preprocesses the item's tokens into the stage; the consumers run recurrence_token on the tile
// from shared memory and store the new state from registers.
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
// The persistent kernel (V-first, K = V = 128, fp32 or bf16 state, dense tokens, T <= 8)
// ---------------------------------------------------------------------------------------------
//
// Work item = (sequence n, value head hv, tile of 32 value rows), item j = (n * HV + hv) * 4 +
// tile; block b handles items b, b + G, b + 2G, ... (G = gridDim.x <= 3 blocks per SM). Each block
// is 4 consumer warps (the tile kernel's thread map, 128 threads, 32 state elements per thread)
// and 1 producer warp, around a ring of S stages in dynamic shared memory (S = 2..8, chosen by the
// host from T and the state dtype so that 3 blocks fit an SM). Stage layout:
//   state tile   32 rows x 128 k of StateT (16 KB fp32 / 8 KB bf16), a bulk copy of global memory
//   tokens[T]    per token: q (l2-normalized, scaled), k (l2-normalized), decay = exp(a_t) over k,
//                v and activated beta of the tile's 32 rows (1792 bytes), written by the producer
//   ItemDesc     the read slot (-1: padding row) and the [N, Tmax] write slots of every token
// Barriers: full[s] (33 producer arrivals: lane 0's expect_tx one and, after the stage writes,
// one per lane; + the state tile's bytes), empty[s] (128 consumer
// arrivals). For item i the producer waits for empty[s], issues the state copy (its read slot
// came from loads issued one item earlier), issues item i + 1's index and token-0 input loads,
// preprocesses item i's tokens into the stage and arrives; so up to S state tiles per block (S x 16
// KB) are in flight while the consumers compute from shared memory and store the new state from
// registers with 16-byte streaming stores.
constexpr int kPersistMaxStages = 8;
constexpr int kPersistMaxT = 8;
constexpr int kPersistBlocksPerSM = 3;
constexpr int kPersistConsumers = 128;  // threads: 4 warps, TileMap<128, *, false>
constexpr int kPersistThreads = kPersistConsumers + 32;
constexpr int kPersistBarrierBytes = 2 * kPersistMaxStages * 8;  // full[8], empty[8]

struct __align__(16) PersistDesc {
  long long slot;                 // read slot (-1: padding row)
  long long wslot[kPersistMaxT];  // [N, Tmax] indices: slot written after token t (-1: none)
};

// Bytes of one stage (a multiple of 128) for T tokens per item.
__host__ __device__ constexpr int persist_stage_bytes(int state_elem_bytes, int T) {
  return (kPersistTileV * kPersistK * state_elem_bytes +
          T * static_cast<int>(sizeof(PreparedToken)) + static_cast<int>(sizeof(PersistDesc)) +
          127) /
         128 * 128;
}

struct PersistItem {
  int64_t n;
  int hv, h, tile_v0;
};

__device__ __forceinline__ PersistItem persist_item(const DecodeArgs& a, int64_t j) {
  constexpr int kTiles = kPersistK / kPersistTileV;  // V = K = 128: 4 tiles per head
  const int64_t head = j / kTiles;
  PersistItem it;
  it.tile_v0 = static_cast<int>(j - head * kTiles) * kPersistTileV;
  it.n = head / a.HV;
  it.hv = static_cast<int>(head - it.n * a.HV);
  it.h = it.hv / a.groups;
  return it;
}

template <typename StateT>
__global__ void __launch_bounds__(kPersistThreads, kPersistBlocksPerSM)
    decode_persistent_kernel(const __grid_constant__ DecodeArgs a, int64_t items, int stages,
                             int stage_bytes) {
  pdl_prologue();
  using Map = TileMap<kPersistK, StateT, false>;
  static_assert(Map::kThreads == kPersistConsumers && Map::kTileV == kPersistTileV, "consumer map");
  constexpr int kVt = Map::kVt, kVec = Map::kVec;
  constexpr bool kBf16State = sizeof(StateT) == 2;
  constexpr uint32_t kStateBytes = kPersistTileV * kPersistK * sizeof(StateT);
  constexpr int kRowBytes = kPersistK * static_cast<int>(sizeof(StateT));

  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + kPersistMaxStages;
  unsigned char* ring = smem + kPersistBarrierBytes;
  const int T = static_cast<int>(a.T);  // dense: every row has T tokens (T <= kPersistMaxT)
  auto stage_tokens = [&](int s) {
    return reinterpret_cast<PreparedToken*>(ring + s * stage_bytes + kStateBytes);
  };
  auto stage_desc = [&](int s) {
    return reinterpret_cast<PersistDesc*>(ring + s * stage_bytes + kStateBytes +
                                          T * sizeof(PreparedToken));
  };

  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(smem_addr(&full[s]),
                33);  // lane 0's arrive.expect_tx + the 32 producer lanes' arrivals
      mbar_init(smem_addr(&empty[s]), kPersistConsumers);
    }
    fence_mbar_init();
  }
  __syncthreads();  // the only block barrier: the roles never meet again except through mbarriers

  if (threadIdx.x >= kPersistConsumers) {
    // ================= Producer warp
    const int lane = lane_id();
    const uint64_t policy = l2_evict_first_policy();
    const bool rows_contiguous = a.state.s2 == kPersistK;  // the tile is one 16 KB (8 KB) run
    int64_t j = blockIdx.x;
    PersistItem it = persist_item(a, j);
    RowRaw rr = load_row_raw(a, it.n);
    RawToken tk;
    if (T > 0) load_raw_token(a, it.n, 0, it.h, it.hv, it.tile_v0, lane, tk);
    int s = 0;
    uint32_t phase = 0;
#pragma unroll 1
    for (;;) {
      const int64_t slot = finish_row_slot(a, it.n, rr);  // rr was loaded one item ago

      mbar_wait_spin(smem_addr(&empty[s]),
                     phase ^ 1u);  // the consumers are done with this stage's last use
      // Generic-proxy accesses of this stage (the consumers' reads, this warp's token writes)
      // before the bulk copy's async-proxy writes. The copy only ever overwrites the state region,
      // which no thread writes with generic stores, so this is belt and braces; it is placed
      // before the next item's loads are issued, because it compiles to MEMBAR.CTA, which may
      // wait for this thread's outstanding loads.
      fence_proxy_async();
      unsigned char* st = ring + s * stage_bytes;
      PreparedToken* toks = stage_tokens(s);
      PersistDesc* desc = stage_desc(s);
      const uint32_t bytes = (slot >= 0 && a.use_initial_state) ? kStateBytes : 0u;
      if (lane == 0)
        mbar_arrive_expect_tx(smem_addr(&full[s]), bytes);  // before any copy completes on it
      __syncwarp();
      if (bytes != 0) {
        const StateT* src = static_cast<const StateT*>(a.state.data) + slot * a.state.s0 +
                            it.hv * a.state.s1 + static_cast<int64_t>(it.tile_v0) * a.state.s2;
        if (rows_contiguous) {
          if (lane == 0)
            bulk_copy_g2s_hint(smem_addr(st), src, kStateBytes, smem_addr(&full[s]), policy);
        } else {  // one row per lane (rows are 16-byte aligned: state.vec)
          bulk_copy_g2s_hint(smem_addr(st + lane * kRowBytes),
                             src + static_cast<int64_t>(lane) * a.state.s2, kRowBytes,
                             smem_addr(&full[s]), policy);
        }
      }
      // Prefetch the next item's index loads and token-0 inputs (consumed next iteration).
      const int64_t jn = j + gridDim.x;
      const bool has_next = jn < items;
      PersistItem itn = it;
      RowRaw rrn = rr;
      RawToken tkn = tk;
      if (has_next) {
        itn = persist_item(a, jn);
        rrn = load_row_raw(a, itn.n);
        if (T > 0) load_raw_token(a, itn.n, 0, itn.h, itn.hv, itn.tile_v0, lane, tkn);
      }
      if (slot >= 0) {
        RawToken cur = tk;
#pragma unroll 1
        for (int t = 0; t < T; ++t) {
          RawToken nxt = cur;
          if (t + 1 < T) load_raw_token(a, it.n, t + 1, it.h, it.hv, it.tile_v0, lane, nxt);
          prep_token(a, cur, lane, toks[t]);
          cur = nxt;
        }
        if (a.indices_2d && a.store_final_state && !a.has_intermediate && lane < T)
          desc->wslot[lane] = token_slot(a, it.n, lane);
      }
      if (lane == 0) desc->slot = slot;
      mbar_arrive(smem_addr(&full[s]));  // all 32 lanes: releases each lane's stage writes
      if (!has_next) break;
      j = jn;
      it = itn;
      rr = rrn;
      tk = tkn;
      if (++s == stages) s = 0, phase ^= 1u;
    }
    return;
  }

  // ================= Consumer warps
  const int tid = threadIdx.x;
  int s = 0;
  uint32_t phase = 0;
#pragma unroll 1
  for (int64_t j = blockIdx.x; j < items; j += gridDim.x) {
    const PersistItem it = persist_item(a, j);
    const Map m(tid, it.tile_v0);
    const bool out_lane = m.lane_k == 0;
    mbar_wait_spin(smem_addr(&full[s]), phase);
    const unsigned char* st = ring + s * stage_bytes;
    const PreparedToken* toks = stage_tokens(s);
    const PersistDesc* desc = stage_desc(s);
    const int64_t slot = desc->slot;

    if (slot < 0) {  // padding row: zero output, no state access
      mbar_arrive(smem_addr(&empty[s]));
      if (out_lane)
        for (int t = 0; t < T; ++t) {
          const int64_t o_off = a.out.offset(it.n, t, it.hv);
#pragma unroll
          for (int vt = 0; vt < kVt; ++vt)
            store_elem(a.out.data, a.out.dtype, o_off + m.v_of(vt), 0.f);
        }
    } else {
      // ---- State tile: shared memory -> registers (each quarter warp reads one 128-byte run of a
      // row)
      float sreg[kVt][Map::kKt];
      if (a.use_initial_state) {
#pragma unroll
        for (int vt = 0; vt < kVt; ++vt) {
          const StateT* row =
              reinterpret_cast<const StateT*>(st) + (m.v_of(vt) - it.tile_v0) * kPersistK;
#pragma unroll
          for (int r = 0; r < Map::kRuns; ++r) {
            const int k0 = m.k_of_run(r);
            if constexpr (kBf16State) {
              const uint4 x = *reinterpret_cast<const uint4*>(row + k0);
              const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
              for (int q = 0; q < 4; ++q) {
                sreg[vt][r * kVec + 2 * q] = __uint_as_float(w[q] << 16);
                sreg[vt][r * kVec + 2 * q + 1] = __uint_as_float(w[q] & 0xffff0000u);
              }
            } else {
              const float4 x = *reinterpret_cast<const float4*>(row + k0);
              sreg[vt][r * kVec] = x.x, sreg[vt][r * kVec + 1] = x.y, sreg[vt][r * kVec + 2] = x.z,
                           sreg[vt][r * kVec + 3] = x.w;
            }
          }
        }
      } else {
#pragma unroll
        for (int vt = 0; vt < kVt; ++vt)
#pragma unroll
          for (int kt = 0; kt < Map::kKt; ++kt) sreg[vt][kt] = 0.f;
      }

#pragma unroll 1
      for (int t = 0; t < T; ++t) {
        const PreparedToken& tok = toks[t];
        float vv[kVt], bt[kVt], o[kVt];
#pragma unroll
        for (int vt = 0; vt < kVt; ++vt) {
          const int lr = m.v_of(vt) - it.tile_v0;
          vv[vt] = tok.v[lr];
          bt[vt] = tok.beta[lr];
        }
        recurrence_token<Map, kBf16State>(m, sreg, tok.q, tok.k, tok.decay, vv, bt, o);
        if (out_lane) {
          const int64_t o_off = a.out.offset(it.n, t, it.hv);
#pragma unroll
          for (int vt = 0; vt < kVt; ++vt)
            store_elem(a.out.data, a.out.dtype, o_off + m.v_of(vt), o[vt]);
        }
        if (a.store_final_state) {
          if (a.has_intermediate) {
            store_state_tile<Map, StateT, false>(m, a.intermediate_states, it.n * a.T + t, it.hv,
                                                 a.K, sreg);
          } else if (a.indices_2d) {
            const int64_t ws = desc->wslot[t];
            if (ws >= 0) store_state_tile<Map, StateT, false>(m, a.state, ws, it.hv, a.K, sreg);
          }
        }
      }
      mbar_arrive(
          smem_addr(&empty[s]));  // every read of this stage is done (values are in registers)

      // ---- Final state: separate output, or in place to the read slot
      if (a.store_final_state && !a.has_intermediate && !a.indices_2d) {
        if (a.has_final_state)
          store_state_tile<Map, StateT, false>(m, a.final_state, it.n, it.hv, a.K, sreg);
        else
          store_state_tile<Map, StateT, false>(m, a.state, slot, it.hv, a.K, sreg);
      }
    }
    if (++s == stages) s = 0, phase ^= 1u;
  }
}

}  // namespace kda::cuda::dec
