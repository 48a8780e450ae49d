// bulk.cuh — the bulk kernel (decode_bulk_kernel<StateT, kSlots, kLatency>, 6 instantiations):
// the default for fp32 pools with >= 64 blocks per SM, and its latency variant for dense
// single-token calls on small grids and for bf16 pools (heuristics/decode.h). The staged kernel's
// arithmetic (bitwise the same), but the copy engine moves the tile both ways.
// docs/perf_decode.md, "bulk-copy kernel" and "a latency variant of the bulk kernel".
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/decode/smem_tile.cuh"

namespace kda::cuda::dec {

// ---------------------------------------------------------------------------------------------
// The bulk kernel: the staged kernel's block, thread map,
// token staging and arithmetic, but the copy engine moves the tile both ways. One lane issues one
// 1-D bulk copy of the whole tile (32 rows of K contiguous elements; one copy per row, one lane
// each, when the rows are padded) completing on an mbarrier, instead of 8 (fp32) / 4 (bf16)
// 16-byte cp.async per thread; the tile stays in shared memory in the global row-major layout
// (a quarter warp reads one 128-byte run of one row: conflict-free), pass 2 writes s' back in
// place, and one bulk copy stores it (after fence.proxy.async and a block barrier) instead of 8
// (4) 16-byte stores per thread. Fewer memory instructions and shorter block lives: the bare
// pattern (bulk in, bulk out) measured 3.92 TB/s on the H200 against 3.85 for cp.async + stores
// (bench_gpu_mempattern). Needs 16-byte aligned rows in every state tensor it writes
// (choose_kernel). Same arithmetic in the same order as the staged and tile kernels.
// ---------------------------------------------------------------------------------------------
constexpr int kBulkMinBlocks = 10;  // 48 registers; smem 16 KB + 3.5 KB (fp32) per block

// kSlots: token stages (2 alternate by token parity; 1 for dense single-token calls, which frees
// 1.75 KB of shared memory per block: 12 blocks per SM instead of 10).
// kLatency (kSlots == 1 only): the variant for grids of at most a couple of blocks per SM, as the
// staged kernel's: no register bound, passes unrolled, and s' stored from registers during pass 2
// (no write-back, fence, barrier and bulk store at the end of the block's critical path).
template <typename StateT, int kSlots, bool kLatency = false>
__global__ void __launch_bounds__(kStagedThreads,
                                  kLatency ? 1 : (kSlots == 1 ? 12 : kBulkMinBlocks))
    decode_bulk_kernel(const __grid_constant__ DecodeArgs a) {
  static_assert(!kLatency || kSlots == 1, "the latency variant takes dense single-token calls");
  // The latency variant reads the parameters into the constant caches before the PDL wait
  // (warm_params), so that its loads after the wait do not each wait on a cold constant line.
  __shared__ uint32_t param_sink[kStagedThreads / 32];
  if constexpr (kLatency) {
    pdl_launch_dependents();
    warm_params<kStagedThreads / 32>(a, threadIdx.x / 32, &param_sink[threadIdx.x / 32]);
    pdl_wait();
  } else {
    pdl_prologue();
  }
  using Map = TileMap<kStagedK, StateT, false>;
  constexpr int kVt = Map::kVt, kRuns = Map::kRuns, kVec = Map::kVec;
  constexpr bool kBf16State = sizeof(StateT) == 2;
  constexpr int kUnrollR =
      kLatency ? kRuns : (kBf16State || kSlots == 1 ? 1 : 2);  // what fits the register bound
  constexpr int kUnrollVt = kLatency ? kVt : 1;
  constexpr uint32_t kRowBytes = kStagedK * sizeof(StateT);
  constexpr uint32_t kTileBytes = Map::kTileV * kRowBytes;
  static_assert(Map::kThreads == kStagedThreads && Map::kKLanes == 8 && Map::kRun == kVec,
                "bulk map");
  static_assert(kVt == 2, "two rows per thread");

  const TileBlock blk(a, Map::kTileV);
  const int64_t n = blk.n;
  const int hv = blk.hv, h = blk.h, tile_v0 = blk.tile_v0;
  const Map m(threadIdx.x, tile_v0);
  const bool out_lane = m.lane_k == 0;
  const bool prep_warp = threadIdx.x < 32;         // warp 0: token preprocessing
  const bool copy_warp = (threadIdx.x >> 5) == 1;  // warp 1: issues the bulk copies
  const int lane = lane_id();

  __shared__ __align__(128) uint8_t tile_sh[kTileBytes];  // rows of the tile, as in global memory
  __shared__ PreparedToken tok_sh[kSlots];                // by token parity
  __shared__ uint64_t full_bar;                           // the tile's bulk load
  // This thread's unit (vt, r): row v_of(vt) - tile_v0 = tid / 8 + 16 vt, bytes 16 (8 r + lane_k).
  static_assert(Map::kThreads / Map::kKLanes == 16, "rows vt = 0, 1 are 16 apart");
  const uint32_t my_units = (threadIdx.x / Map::kKLanes) * kRowBytes + m.lane_k * 16;
  auto unit = [my_units](int vt, int r) -> uint4& {
    return *reinterpret_cast<uint4*>(tile_sh + my_units + vt * 16 * kRowBytes + r * 128);
  };
  // Bulk store of the tile in shared memory to rows tile_v0.. of `dst` (issued by the copy warp;
  // the caller fenced and passed a block barrier). Waits until shared memory has been read, or,
  // with `complete`, until the global writes are done: [N, Tmax] write slots of one row may
  // repeat, and the later token's state must land last.
  auto store_tile = [&](const TileDst<StateT>& dst, bool complete) {
    if (!copy_warp) return;
    StateT* g = dst.data + static_cast<int64_t>(tile_v0) * dst.s2;
    if (dst.s2 == kStagedK) {
      if (lane == 0) bulk_store(g, smem_addr(tile_sh), kTileBytes);
    } else {
      bulk_store(g + lane * dst.s2, smem_addr(tile_sh + lane * kRowBytes), kRowBytes);
    }
    bulk_commit();
    if (complete)
      bulk_wait_all();
    else
      bulk_wait_read();
  };

  RawToken raw;
  if (prep_warp && !a.varlen && a.T > 0) load_raw_token(a, n, 0, h, hv, tile_v0, lane, raw);
  if (threadIdx.x == 32) {
    mbar_init(smem_addr(&full_bar), 1);
    fence_mbar_init();
  }

  SeqRow row = resolve_row(a, n);
  if constexpr (kSlots == 1) row.len = 1;  // launched for dense calls with T = 1 only
  if (row.slot < 0) {  // padding row: zero output, no state access (uniform over the block)
    zero_padding_outputs(a, row, hv, m);
    return;
  }

  if (a.use_initial_state) {
    if (copy_warp) {
      const StateT* src = static_cast<const StateT*>(a.state.data) + row.slot * a.state.s0 +
                          hv * a.state.s1 + static_cast<int64_t>(tile_v0) * a.state.s2;
      if (lane == 0) mbar_arrive_expect_tx(smem_addr(&full_bar), kTileBytes);
      __syncwarp();
      if (a.state.s2 == kStagedK) {
        if (lane == 0) bulk_copy_g2s(smem_addr(tile_sh), src, kTileBytes, smem_addr(&full_bar));
      } else {
        bulk_copy_g2s(smem_addr(tile_sh + lane * kRowBytes), src + lane * a.state.s2, kRowBytes,
                      smem_addr(&full_bar));
      }
    }
  } else {
#pragma unroll
    for (int vt = 0; vt < kVt; ++vt)
#pragma unroll
      for (int r = 0; r < kRuns; ++r)
        unit(vt, r) = make_uint4(0u, 0u, 0u, 0u);  // +0.0 (fp32 and bf16)
  }
  if (prep_warp && row.len > 0) {
    if (a.varlen) load_raw_token(a, row.b, row.bos, h, hv, tile_v0, lane, raw);
    prep_token(a, raw, lane, tok_sh[0]);
  }
  if constexpr (kSlots > 1) prefetch_later_tokens(a, row, h, hv);
  __syncthreads();  // token 0's stage; the barrier's initialization
  if (a.use_initial_state) mbar_wait_spin(smem_addr(&full_bar), 0);

#pragma unroll 1
  for (int64_t t = 0; t < row.len; ++t) {
    const int64_t tok = row.bos + t;
    // Slot t & 1 was last read at token t - 2; the previous token's bulk store (if any) has
    // finished reading the tile (the copy warp waited before this barrier).
    if (t > 0) stage_next_token(a, row, t, h, hv, tile_v0, prep_warp, tok_sh[(kSlots - 1) & t]);
    const PreparedToken& tk = tok_sh[(kSlots - 1) & t];

    const TileDst<StateT> dst = token_dst<StateT>(a, row, n, hv, t);  // uniform over the block
    const int64_t o_off = a.out.offset(row.b, tok, hv);
    if constexpr (kLatency) {  // one token: s' straight from registers to global memory
      smem_tile_token<Map, StateT, kUnrollR, kUnrollVt>(
          m, tile_v0, tk, unit,
          [&](int vt, int r, uint4&, const float* sv) {
            if (dst.data != nullptr) dst.store_unit(m, vt, r, sv);
          },
          RowOutput<Map>{a, m, o_off, out_lane});
      continue;
    }
    const bool write_back = dst.data != nullptr || t + 1 < row.len;

    // ---- The two passes; s' back in place in shared memory (for the bulk store or the next token)
    smem_tile_token<Map, StateT, kUnrollR, 1>(
        m, tile_v0, tk, unit,
        [&](int, int, uint4& un, const float* sv) {
          if (write_back) un = pack_unit<StateT>(sv);
        },
        RowOutput<Map>{a, m, o_off, out_lane});
    if (dst.data != nullptr) {
      fence_proxy_async();
      __syncthreads();
      store_tile(dst, a.indices_2d && t + 1 < row.len);
    }
  }

  // ---- No tokens (an empty varlen sequence, T = 0): the final state is the initial one
  if (const TileDst<StateT> dst = empty_row_dst<StateT>(a, row, n, hv); dst.data != nullptr) {
    fence_proxy_async();
    __syncthreads();
    store_tile(dst, false);
  }
}

}  // namespace kda::cuda::dec
