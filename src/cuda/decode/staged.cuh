// staged.cuh — the staged tile kernel (decode_staged_kernel<StateT, kLatency>, 4
// instantiations): the default for V-first, K = V = 128 pools with 16-byte aligned rows (any T,
// dense or varlen, every index / state-output mode) except where the bulk kernel is chosen
// (heuristics/decode.h). The state tile goes global -> shared memory with 16-byte cp.async, the
// recurrence streams it from shared memory in two passes (smem_tile.cuh): 48 registers, 10
// blocks per SM. docs/perf_decode.md, "smem-staged tile kernel".
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/decode/smem_tile.cuh"

namespace kda::cuda::dec {

// kLatency: the variant for grids of at most a couple of blocks per SM (B = 1, 2 at HV = 32),
// where a call's time is its critical path (index -> state -> compute -> store), not the bytes in
// flight: no register bound (the compiler keeps every load in flight and unrolls the passes).
template <typename StateT, bool kLatency>
__global__ void __launch_bounds__(kStagedThreads, kLatency ? 1 : kStagedMinBlocks)
    decode_staged_kernel(const __grid_constant__ DecodeArgs a) {
  pdl_prologue();
  using Map = TileMap<kStagedK, StateT, false>;
  constexpr int kVt = Map::kVt, kRuns = Map::kRuns, kVec = Map::kVec;
  constexpr int kUnits = kVt * kRuns;  // 16-byte units per thread: 8 (fp32), 4 (bf16)
  constexpr bool kBf16State = sizeof(StateT) == 2;
  // Runs unrolled per step of the compute passes: the most that ptxas 13.0 fits in 48 registers
  // without spilling (fp32: 2 of 4 runs; bf16: 1 of 2, each run holds 8 elements).
  constexpr int kUnrollR = kLatency ? kRuns : (kBf16State ? 1 : 2);
  constexpr int kUnrollVt = kLatency ? kVt : 1;
  static_assert(Map::kThreads == kStagedThreads && Map::kKLanes == 8 && Map::kRun == kVec,
                "staged map");

  // ---- Block -> (sequence n, value head hv, tile of 32 value rows), as the tile kernel
  const TileBlock blk(a, Map::kTileV);
  const int64_t n = blk.n;
  const int hv = blk.hv, h = blk.h, tile_v0 = blk.tile_v0;
  const Map m(threadIdx.x, tile_v0);
  const bool out_lane = m.lane_k == 0;
  const bool prep_warp = threadIdx.x < 32;  // warp 0 preprocesses the tokens for the block

  __shared__ uint4 tile_sh[kUnits * kStagedThreads];  // 16 KB (fp32) / 8 KB (bf16)
  __shared__ PreparedToken tok_sh[2];                 // 2 x 1792 B, by token parity
  uint4* mine = tile_sh + threadIdx.x;                // this thread's unit u: mine[u * 128]

  // ---- Token 0's raw inputs of a dense row (b = n, bos = 0, len = T: known without index
  //      loads) are issued first, so they overlap the index loads of resolve_row.
  RawToken raw;
  if (prep_warp && !a.varlen && a.T > 0) load_raw_token(a, n, 0, h, hv, tile_v0, lane_id(), raw);

  // ---- Sequence span and read slot (padding rows: zero output, no state access)
  const SeqRow row = resolve_row(a, n);
  if (row.slot < 0) {  // uniform over the block: no barrier is skipped by part of it
    zero_padding_outputs(a, row, hv, m);
    return;
  }

  // ---- State tile -> shared memory: kUnits 16-byte cp.async per thread, all in flight at once
  if (a.use_initial_state) {
    const StateT* base =
        static_cast<const StateT*>(a.state.data) + row.slot * a.state.s0 + hv * a.state.s1;
#pragma unroll
    for (int vt = 0; vt < kVt; ++vt) {
      const StateT* p = base + static_cast<int64_t>(m.v_of(vt)) * a.state.s2;
#pragma unroll
      for (int r = 0; r < kRuns; ++r)
        cp_async_16(smem_addr(&mine[(vt * kRuns + r) * kStagedThreads]), p + m.k_of_run(r));
    }
    cp_async_commit();
  } else {
#pragma unroll
    for (int u = 0; u < kUnits; ++u)
      mine[u * kStagedThreads] = make_uint4(0u, 0u, 0u, 0u);  // +0.0 (fp32 and bf16)
  }
  if (prep_warp && row.len > 0) {
    if (a.varlen) load_raw_token(a, row.b, row.bos, h, hv, tile_v0, lane_id(), raw);
    prep_token(a, raw, lane_id(), tok_sh[0]);
  }
  prefetch_later_tokens(a, row, h, hv);
  cp_async_wait_all();  // this thread's copies: the only units it reads
  __syncthreads();      // token 0's stage

#pragma unroll 1
  for (int64_t t = 0; t < row.len; ++t) {
    const int64_t tok = row.bos + t;
    // Slot t & 1 was last read at token t - 2, before every thread passed token t - 1's barrier.
    if (t > 0) stage_next_token(a, row, t, h, hv, tile_v0, prep_warp, tok_sh[t & 1]);
    const PreparedToken& tk = tok_sh[t & 1];

    // ---- Where this token's state goes in global memory (at most one place per token)
    const TileDst<StateT> dst = token_dst<StateT>(a, row, n, hv, t);
    const bool keep = t + 1 < row.len;  // another token follows: s' back to shared memory

    // ---- The two passes; s' to global memory and, if another token follows, back to shared
    //      memory. (Loops over vt stay rolled in the throughput variant: unrolled, the compiler
    //      hoists every shared-memory load of the tile and runs out of the 48-register budget.)
    const int64_t o_off = a.out.offset(row.b, tok, hv);
    smem_tile_token<Map, StateT, kUnrollR, kUnrollVt>(
        m, tile_v0, tk,
        [&](int vt, int r) -> uint4& { return mine[(vt * kRuns + r) * kStagedThreads]; },
        [&](int vt, int r, uint4& un, const float* sv) {
          if (dst.data != nullptr) dst.store_unit(m, vt, r, sv);
          if (keep) un = pack_unit<StateT>(sv);
        },
        RowOutput<Map>{a, m, o_off, out_lane});
  }

  // ---- No tokens (an empty varlen sequence, T = 0): the final state is the initial one
  if (const TileDst<StateT> dst = empty_row_dst<StateT>(a, row, n, hv); dst.data != nullptr) {
#pragma unroll
    for (int vt = 0; vt < kVt; ++vt)
#pragma unroll
      for (int r = 0; r < kRuns; ++r) {
        float s[kVec];
        unpack_unit<StateT>(mine[(vt * kRuns + r) * kStagedThreads], s);
        dst.store_unit(m, vt, r, s);
      }
  }
}

}  // namespace kda::cuda::dec
