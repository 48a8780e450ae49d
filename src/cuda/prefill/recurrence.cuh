// recurrence.cuh — kernel B of the CUDA prefill: the sequential walk over the chunks of one
// (sequence, value head, value slice), with the state slice in registers (fp32).
//
// Per chunk (math of src/cpu/prefill_chunked.cpp, written transposed so that the state S^T
// [V][K] is the accumulator of every product that updates it; S^T rows = value columns):
//   U^T  = v^T Tm^T - S^T W^T                    (bf16 S^T W^T; tf32 v^T Tm^T)
//   O^T  = S^T qg^T + U^T Aqk^T                  (bf16; tf32, Aqk lower triangular)
//   S^T <- S^T diag(exp(G_L)) + U^T kb           (tf32; on wgmma U^T as bf16 hi + lo)
// Warp w owns 16 value rows of S^T: accumulators S^T 16x128 (64 fp32 per thread), U^T and O^T
// 16x64 (32 each). Warps never exchange data (except the pairs of the K split below); they share
// the chunk's operands in shared memory. Blocks of vs >= 64 run the products on wgmma (one
// warpgroup per 64 value rows; chunk_wgmma), the others on mma.sync.
//
// Pipeline: two stages, each = the chunk's workspace record (one bulk copy, "full" mbarrier) + the
// v tile [64][vs] (cp.async 16 B, or plain loads when v is not 16-byte aligned); chunk c+1 is in
// flight while chunk c computes. The mma.sync path without K split: one block barrier per chunk.
// wgmma and K split paths: none; each group (warpgroup; pair of the K split) loads its own v
// columns behind its own named barrier, and the last warp done with a stage (a counter per stage)
// refills its record at once (chunk-16 path: four stages of 16-token records, refilled at the next
// step's start), so the groups wait for each other only through the data. Each warp
// stages its output columns in its own 2 KB tile (stmatrix.trans) and stores them, 32 bytes per
// token row.
// Shared memory: 1024 (alignment slack) + 2 x round1024(record + 128 vs) + 128 vs + 32 bytes
// (216,096 at vs = 128): one block per SM.
//
// K split (kKSplit, Params::ksplit; vs <= 32, the few-head cases P5 / P7 whose blocks have only
// 2 warps on 4 schedulers): two warps per 16 value rows, warp (rg, kh) holding key columns
// [64 kh, 64 kh + 64) of S^T (32 fp32 per thread). Per chunk each computes the partial S^T W^T
// and S^T qg^T over its half of K, the pair adds the partner's partials through shared memory
// (one extra barrier of the pair; a + b in both warps, so both hold the same U^T bit for bit), both
// add v^T Tm^T (redundant: 36 mma), each does half of the U^T Aqk^T tiles (token pairs {0, 3} /
// {1, 2} of 16: 18 mma each) and stores those outputs, and each updates its own half of S^T.
// Per warp and chunk 182 mma instead of 328; shared memory + 8 KB per warp (exchange) and 2 KB
// per warp (output tile): 216,096 bytes at vs = 32.
#pragma once

#include "cuda/prefill/common.cuh"
#include "cuda/prefill/recurrence_steps.cuh"

namespace kda::cuda::pf {

// kC16: the chunk-16 path: 16-token steps over 16-token records (wgmma only). kSeg: a pass of the
// segmented prefill (Params::seg_pass; segments.cuh), one block per (segment slot, value head,
// value slice), pass 1 with twice the value slices (the second half: the transition's rows).
// One block's work (recurrence_kernel's block `block`, or a block of the single-launch kernel,
// single.cuh): threads [0, nthreads) of the block, nthreads = 32 recurrence_warps(vs); the block's
// other threads (single.cuh) take no part, its barriers count nthreads.
template <bool kFp16, bool kKSplit, bool kWgmma, bool kC16, bool kSeg>
__device__ __forceinline__ void recurrence_block(const Params& p, unsigned block, int nthreads) {
  static_assert(!(kKSplit && kWgmma), "the K split is an mma.sync variant");
  static_assert(!kC16 || kWgmma, "16-token steps run on wgmma");
  constexpr int kLc = kC16 ? kChunk16 : kChunk;                // tokens per step
  constexpr int kRecB = kC16 ? kRecord16Bytes : kRecordBytes;  // the record's bytes in a stage
  constexpr int kS = kC16 ? kStages16 : 2;                     // stages (a power of two)
  constexpr int kSLog = kC16 ? 2 : 1;                          // log2(kS)
  static_assert((1 << kSLog) == kS, "stages");
  constexpr int kCnt = kC16 ? 8 * kStages16 : 16;  // the counters' offset from bar0
  extern __shared__ __align__(128) uint8_t smem_raw[];
  // The stages start at the first 1024-byte aligned address (the record's swizzle period).
  uint8_t* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c = lane & 3;
  const int vs = p.vs;
  constexpr int kNJ = kKSplit ? 8 : 16;       // 8-column key tiles of S^T held by this warp
  const int rg = kKSplit ? warp >> 1 : warp;  // 16-row group of S^T
  const int kh = kKSplit ? warp & 1 : 0;      // key half (K split)
  const int k0 = kh * (kNJ * 8);              // first key column held
  const unsigned nsl = static_cast<unsigned>(kSeg && p.seg_pass == 1 ? 2 * p.nslices : p.nslices);
  const int vslice = static_cast<int>(block % nsl);
  const int slice = vslice % p.nslices;
  const int64_t pair = block / nsl;
  const int hv = static_cast<int>(pair % p.HV);
  SegRole role;  // one segment per sequence unless kSeg
  int64_t n;
  SeqSpan sp;
  if constexpr (kSeg) {
    const SegTask task = seg_task(p, pair / p.HV);
    role = segment_role(p, task, pair / p.HV, vslice >= p.nslices);
    if (role.idle) return;
    n = task.n;
    sp = segment_span(p, task.seq, task.j);
  } else {
    n = p.order != nullptr ? p.order[pair / p.HV] : pair / p.HV;  // longest first (varlen)
    sp = seq_span(p, n);
  }
  const int64_t nchunks = (sp.len + kLc - 1) / kLc;
  const int vcol0 = slice * vs;    // first value column of this block
  const int vw = vcol0 + 16 * rg;  // first value row of S^T owned by this warp
  const int sbytes = kC16 ? recurrence_stage_bytes16(vs) : recurrence_stage_bytes(vs);
  const int nwarps = recurrence_warps(vs, kKSplit);
  const uint32_t smem0 = smem_addr(smem);
  uint8_t* otile = smem + kS * sbytes + warp * (kLc * 32);  // this warp's output tile
  // mbarriers: bar0 + 8 st = stage st full (record bytes arrived); then (wgmma path) one counter
  // per stage of the warps done with it (kS = 2 stages; 4 on the chunk-16 path).
  const uint32_t bar0 = smem0 + kS * sbytes + nwarps * kLc * 32;
  const int wg = warp >> 2;  // warpgroup (wgmma path)
  // Grouped paths (wgmma, K split): no block barrier per chunk. A group (the warpgroup; the pair of
  // the K split) loads its own v columns and syncs on its own named barrier.
  constexpr bool kGrouped = kWgmma || kKSplit;
  const int grp = kWgmma ? wg : rg, grp_threads = kWgmma ? 128 : 64;
  // K split: this warp's and its partner's partial U^T, O^T ([32 values][32 lanes] fp32 each).
  float* xch_mine = reinterpret_cast<float*>(smem + 2 * sbytes + nwarps * kChunk * 32 + kBarBytes +
                                             warp * kXchWarpBytes);
  const float* xch_partner = reinterpret_cast<const float*>(
      smem + 2 * sbytes + nwarps * kChunk * 32 + kBarBytes + (warp ^ 1) * kXchWarpBytes);

  // ---- Initial state (pool slot, initial_state row n, or zero).
  float accS[kNJ][4];
  int64_t slot = rules::kNoSlot;
  if (p.has_state_pool) slot = rules::pool_slot(p.state_indices.load(n), p.state_pool.rows);
  if (!role.first) {
    if (role.from_start)
      load_state(accS, p.seg_start, false, role.slot, hv, vw, k0, g, c);
    else
      init_segment_state(accS, role.trans, vw, k0, g, c);
  } else if (slot >= 0) {
    load_state(accS, p.state_pool, p.kfirst, slot, hv, vw, k0, g, c);
  } else if (!p.has_state_pool && p.initial_state.data != nullptr) {
    load_state(accS, p.initial_state, p.kfirst, n, hv, vw, k0, g, c);
  } else {
#pragma unroll
    for (int j = 0; j < kNJ; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) accS[j][e] = 0.f;
  }
  int64_t ck_lo = 0, ck_hi = 0;
  if (role.outputs && p.checkpoint_every > 0) {
    ck_lo = p.checkpoint_offsets.load(n);
    const int64_t hi = p.checkpoint_offsets.load(n + 1);
    ck_hi = hi < p.checkpoints.rows ? hi : p.checkpoints.rows;
  }

  // The record's zero parts in both stages (never copied: common.cuh), before the barrier below;
  // the tensor cores read them through the async proxy.
  for (int i = tid; i < (kC16 ? 0 : 4 * kHoleBytes / 16);
       i += nthreads) {  // 16-token records: none
    const int part = i / (kHoleBytes / 16), st = part >> 1;
    *reinterpret_cast<uint4*>(smem + st * sbytes + ((part & 1) ? kHoleTm : kHoleAqk) +
                              16 * (i % (kHoleBytes / 16))) = make_uint4(0u, 0u, 0u, 0u);
  }
  fence_proxy_async();
  if (tid == 0) {
    if constexpr (kC16) {
#pragma unroll
      for (int i = 0; i < kS; ++i) mbar_init(bar0 + 8 * i, 1);
#pragma unroll
      for (int i = 0; i < kS; ++i)  // warps done with stage i
        reinterpret_cast<unsigned*>(smem + kS * sbytes + nwarps * kLc * 32 + kCnt)[i] = 0u;
    } else {
      mbar_init(bar0, 1);
      mbar_init(bar0 + 8, 1);
      reinterpret_cast<unsigned*>(smem + 2 * sbytes + nwarps * kChunk * 32 + 16)[0] =
          0u;  // wgmma: warps done
      reinterpret_cast<unsigned*>(smem + 2 * sbytes + nwarps * kChunk * 32 + 16)[1] =
          0u;  // with stage 0 / 1
    }
    fence_mbar_init();
  }
  named_barrier_sync(0, nthreads);

  // ---- Loads of chunk ci into stage ci & 1: the record (bulk copy, one thread) and the v tile.
  // The wgmma path has no block barrier: each warpgroup loads its own 64 v columns and syncs on
  // its own named barrier, and the last warp to finish with a stage (a counter per stage in
  // shared memory) refills its record with chunk ci + 2 at once, so that neither warpgroup waits
  // for the other except through the data and their waits on the tensor cores interleave.
  auto issue_record = [&](int64_t ci) {
    const int st = static_cast<int>(ci & (kS - 1));
    const uint32_t sdst = smem0 + st * sbytes;
    const uint32_t bar = bar0 + 8 * st;
    if constexpr (kC16) {  // the 16-token record ci % 4 of chunk slot ci / 4
      const uint8_t* rec = p.ws +
                           ((sp.base + ci / 4) * p.HV + hv) * static_cast<int64_t>(kRecordBytes) +
                           (ci % 4) * kRecord16Bytes;
      mbar_arrive_expect_tx(bar, kRecord16CopyBytes);
      bulk_copy_g2s(sdst, rec, kRecord16CopyBytes, bar);
      return;
    }
    const uint8_t* rec = p.ws + ((sp.base + ci) * p.HV + hv) * static_cast<int64_t>(kRecordBytes);
    mbar_arrive_expect_tx(bar, kRecordCopyBytes);
    constexpr int kSpans[3][2] = {
        {0, kHoleAqk}, {kHoleAqk + kHoleBytes, kHoleTm}, {kHoleTm + kHoleBytes, kRecordBytes}};
#pragma unroll
    for (int part = 0; part < 3; ++part)  // the record less its two zero parts (common.cuh)
      for (int off = kSpans[part][0]; off < kSpans[part][1]; off += 32768) {
        const int bytes = kSpans[part][1] - off < 32768 ? kSpans[part][1] - off : 32768;
        bulk_copy_g2s(sdst + off, rec + off, bytes, bar);
      }
  };
  // This thread's v tasks: 16-byte chunk vch of rows vr0, vr0 + vrs, ... (vtstep is a multiple of
  // vnch in every configuration, so the column chunk is fixed; vrs = 16, or 32 on the K split); the
  // chunk-invariant part of their offsets once, outside the chunk loop.
  const int vnch = kWgmma ? 8 : (kKSplit ? 2 : (vs >> 3));  // this group's 16-byte chunks per row
  const int vt0 = kGrouped ? tid % grp_threads : tid, vtstep = kGrouped ? grp_threads : nthreads;
  const int vr0 = vt0 / vnch, vrs = vtstep / vnch, vch = (kGrouped ? vnch * grp : 0) + vt0 % vnch;
  const int64_t voff0 =
      p.v.offset(sp.b, sp.bos + vr0, hv) + vcol0 + 8 * vch;  // token vr0 of chunk 0
  const int vsoff0 = kRecB + swizzle_vtile(vr0, vch, vs);    // rows vr0 + 8 m: same XOR, + 8 m rows
  auto issue = [&](int64_t ci) {
    const int st = static_cast<int>(ci & (kS - 1));
    const uint32_t sdst = smem0 + st * sbytes;
    if (!kGrouped && tid == 0) issue_record(ci);
    const uint16_t* vbase = static_cast<const uint16_t*>(p.v.data);
    for (int r = vr0; r < kLc; r += vrs) {
      const int64_t tl = ci * kLc + r;
      const bool valid = tl < sp.len && !role.trans;  // the transition's rows: zero values
      const int soff = vsoff0 + (r - vr0) * (vs * 2);
      const int64_t goff = valid ? voff0 + (tl - vr0) * p.v.s1 : 0;
      if (p.v.vec) {
        cp_async_16_zfill(sdst + soff, vbase + goff, valid ? 16 : 0);
      } else {
        uint32_t w[4] = {0, 0, 0, 0};
        if (valid)
#pragma unroll
          for (int i = 0; i < 4; ++i)
            w[i] = static_cast<uint32_t>(vbase[goff + 2 * i]) |
                   (static_cast<uint32_t>(vbase[goff + 2 * i + 1]) << 16);
        *reinterpret_cast<uint4*>(smem + st * sbytes + soff) = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
    cp_async_commit();
  };

  if constexpr (kGrouped) {  // both stages are free: chunks 0 and 1 at once
    if (tid == 0)
      for (int64_t ci = 0; ci < kS && ci < nchunks; ++ci) issue_record(ci);
  }
  // v tiles kS - 1 steps ahead; kC16: one cp.async group per step, empty past the end, so that
  // waiting for all but the newest kS - 2 groups completes step ci's.
  if constexpr (kC16) {
    for (int64_t ci = 0; ci < kS - 1; ++ci) {
      if (ci < nchunks)
        issue(ci);
      else
        cp_async_commit();
    }
  } else if (nchunks > 0) {
    issue(0);
  }
  // kC16: this thread's output offset (token row lane / 2, 16-byte chunk lane & 1 of its warp's 16
  // value columns) at step 0; per step + 16 token rows.
  const int64_t ooff0 = p.out.offset(sp.b, sp.bos + (lane >> 1), hv) + vw + 8 * (lane & 1);
  unsigned* const done0 =
      reinterpret_cast<unsigned*>(smem + kS * sbytes + nwarps * kLc * 32 + kCnt);
  bool last = false;  // kC16, lane 0: this warp was the last to release the previous step's stage
  for (int64_t ci = 0; ci < nchunks; ++ci) {
    const int st = static_cast<int>(ci & (kS - 1));
    uint8_t* sb = smem + st * sbytes;
    cp_async_wait<kS - 2>();
    if constexpr (kGrouped) {
      named_barrier_sync(1 + grp, grp_threads);  // this group's v columns of chunk ci in; its reads
                                                 // of stage (ci - 1) % kS done
      if constexpr (kC16) {
        if (ci + kS - 1 < nchunks)
          issue(ci + kS - 1);
        else
          cp_async_commit();
        if (last) {  // refill the previous step's stage (its counter's atomic has long returned)
          const int64_t cp = ci - 1;
          done0[cp & (kS - 1)] = 0u;
          __threadfence_block();
          if (cp + kS < nchunks) issue_record(cp + kS);
          last = false;
        }
      } else if (ci + 1 < nchunks) {
        issue(ci + 1);
      }
      mbar_wait(bar0 + 8 * st, static_cast<uint32_t>((ci >> kSLog) & 1));
    } else {
      mbar_wait(bar0 + 8 * st, static_cast<uint32_t>((ci >> kSLog) & 1));
      // Stage st complete for every thread; stage st^1 no longer read (chunk ci - 1).
      named_barrier_sync(0, nthreads);
      if (ci + 1 < nchunks) issue(ci + 1);
    }
    const int L = static_cast<int>(sp.len - ci * kLc < kLc ? sp.len - ci * kLc : kLc);

    float accO[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) accO[j][e] = 0.f;
    if constexpr (kWgmma) {
      if constexpr (kC16)
        step_wgmma16<kFp16>(accS, accO, sb, smem0 + st * sbytes,
                            smem0 + st * sbytes + kRecord16Bytes, rg, lane, vs);
      else
        chunk_wgmma<kFp16>(accS, accO, sb, smem0 + st * sbytes, rg, lane, vs);
    } else {
      // ---- U^T = -S^T W^T and O^T = S^T qg^T (bf16 m16n8k16; S^T from the accumulators; with
      // the K split, partial sums over this warp's key half).
      float accU[8][4];
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) accU[j][e] = 0.f;
      {
        const uint32_t w_base = smem_addr(sb + kOffW), q_base = smem_addr(sb + kOffQg);
#pragma unroll
        for (int kq = 0; kq < kNJ / 2; ++kq) {
          const uint32_t a[4] = {pack_bf16(accS[2 * kq][0], accS[2 * kq][1]),
                                 pack_bf16(accS[2 * kq][2], accS[2 * kq][3]),
                                 pack_bf16(accS[2 * kq + 1][0], accS[2 * kq + 1][1]),
                                 pack_bf16(accS[2 * kq + 1][2], accS[2 * kq + 1][3])};
#pragma unroll
          for (int pp = 0; pp < 4; ++pp) {
            // matrices: (tokens 16pp.., k lo), (tokens 16pp.., k hi), (tokens 16pp+8.., k lo), (..,
            // k hi)
            const int row = 16 * pp + ((lane >> 4) << 3) + (lane & 7);
            const int col = k0 + (2 * kq + ((lane >> 3) & 1)) * 8;
            const uint32_t off = static_cast<uint32_t>(rec_b16(row, col)) * 2;
            uint32_t bw[4], bq[4];
            ldmatrix_x4(bw, w_base + off);
            ldmatrix_x4(bq, q_base + off);
            mma_bf16(accU[2 * pp], a, bw[0], bw[1]);
            mma_bf16(accU[2 * pp + 1], a, bw[2], bw[3]);
            mma_bf16(accO[2 * pp], a, bq[0], bq[1]);
            mma_bf16(accO[2 * pp + 1], a, bq[2], bq[3]);
          }
        }
      }
      if constexpr (kKSplit) {
        // The pair's partial sums: a + b in both warps (the same U^T bit for bit in both). Both
        // areas were last read in the previous chunk, before this chunk's first block barrier.
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            xch_mine[(j * 4 + e) * 32 + lane] = accU[j][e];
            xch_mine[1024 + (j * 4 + e) * 32 + lane] = accO[j][e];
          }
        named_barrier_sync(1 + rg, 64);  // the pair's partials written
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            accU[j][e] += xch_partner[(j * 4 + e) * 32 + lane];
            if (owns_token_pair(j >> 1, kh))
              accO[j][e] += xch_partner[1024 + (j * 4 + e) * 32 + lane];
          }
      }
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) accU[j][e] = -accU[j][e];

      // ---- U^T += v^T Tm^T (tf32, Tm lower triangular: t-tile j needs s-steps sj <= j). v^T comes
      // from the v tile by ldmatrix.trans: 16-bit pairs (s = 2c, 2c+1) are the k-slots c, c+4.
      {
        const uint32_t v_base = smem_addr(sb + kRecordBytes);
        const uint32_t tm_base = smem_addr(sb + kOffTm);
#pragma unroll
        for (int hh = 0; hh < 4; ++hh) {
          const int row = 16 * hh + ((lane >> 4) << 3) + (lane & 7);
          const int chunk = 2 * rg + ((lane >> 3) & 1);
          uint32_t va[4];
          ldmatrix_x4_trans(va, v_base + swizzle_vtile(row, chunk, vs));
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int sj = 2 * hh + half;
            const uint32_t a[4] = {__float_as_uint(lo_f32<kFp16>(va[2 * half])),
                                   __float_as_uint(lo_f32<kFp16>(va[2 * half + 1])),
                                   __float_as_uint(hi_f32<kFp16>(va[2 * half])),
                                   __float_as_uint(hi_f32<kFp16>(va[2 * half + 1]))};
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              if (j >= sj) {
                uint32_t b[2];
                ldmatrix_x2(b, tm_base + rec_f32_block_offset(8 * j, 8 * sj, lane));
                mma_tf32(accU[j], a, b[0], b[1]);
              }
            }
          }
        }
      }

      // ---- U^T as tf32 A operands.
      uint32_t ua[8][4];
      u_tf32_operands(accU, ua);

      // ---- O^T += U^T Aqk^T (tf32, lower triangular incl. the diagonal). s-step outer, t-tile
      // inner: consecutive mma go to different accumulators (no back-to-back dependency).
      {
        const uint32_t aqk_base = smem_addr(sb + kOffAqk);
#pragma unroll
        for (int sj = 0; sj < 8; ++sj)
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            if (j >= sj && (!kKSplit || owns_token_pair(j >> 1, kh))) {
              uint32_t b[2];
              ldmatrix_x2(b, aqk_base + rec_f32_block_offset(8 * j, 8 * sj, lane));
              mma_tf32(accO[j], ua[sj], b[0], b[1]);
            }
          }
      }

      // ---- S^T <- S^T diag(exp(G_L)) + U^T kb (tf32).
      {
        const float* gl = reinterpret_cast<const float*>(sb + kOffGL);
#pragma unroll
        for (int j = 0; j < kNJ; ++j) {
          const float2 d = *reinterpret_cast<const float2*>(gl + k0 + 8 * j + 2 * c);
          accS[j][0] *= d.x;
          accS[j][1] *= d.y;
          accS[j][2] *= d.x;
          accS[j][3] *= d.y;
        }
        // s-step outer, key tile inner: 16 independent accumulators between dependent mma.
#pragma unroll
        for (int sj = 0; sj < 8; ++sj) {
#pragma unroll
          for (int j = 0; j < kNJ; ++j) {
            const uint16_t* kbt = reinterpret_cast<const uint16_t*>(
                sb + kOffKbT);  // bf16 pair (s, s+1) -> two tf32 (exact)
            const uint32_t b =
                *reinterpret_cast<const uint32_t*>(kbt + rec_kbt(k0 + 8 * j + g, 8 * sj + 2 * c));
            mma_tf32(accS[j], ua[sj], b << 16, b & 0xffff0000u);
          }
        }
      }
    }

    // The K split's generic reads of the record (ldmatrix, LDS) are all done here: its proxy
    // fence before the output stores, whose drain the fence's MEMBAR would otherwise wait for.
    if constexpr (kKSplit) fence_proxy_async();

    // ---- Output: O^T -> this warp's tile [t][16] (stmatrix.trans) -> out, 32 bytes per token row.
    if (role.outputs) {
      __syncwarp();  // the previous chunk's copy-out of this tile is done
      const uint32_t o_base = smem_addr(otile);
#pragma unroll
      for (int jj = 0; jj < kLc / 16; ++jj) {
        if (kKSplit && !owns_token_pair(jj, kh)) continue;
        const int row = 16 * jj + ((lane >> 4) << 3) + (lane & 7);
        stmatrix_x4_trans(o_base + out_tile_offset(row, (lane >> 3) & 1),
                          pack_out<kFp16>(accO[2 * jj][0], accO[2 * jj][1]),
                          pack_out<kFp16>(accO[2 * jj][2], accO[2 * jj][3]),
                          pack_out<kFp16>(accO[2 * jj + 1][0], accO[2 * jj + 1][1]),
                          pack_out<kFp16>(accO[2 * jj + 1][2], accO[2 * jj + 1][3]));
      }
      __syncwarp();
      uint16_t* obase = static_cast<uint16_t*>(p.out.data);
#pragma unroll
      for (int pass = 0; pass < kLc / 16; ++pass) {
        const int r = 16 * pass + (lane >> 1), ch = lane & 1;
        if (r < L && (!kKSplit || owns_token_pair(pass, kh))) {
          const uint4 x = *reinterpret_cast<const uint4*>(otile + out_tile_offset(r, ch));
          const int64_t goff = kC16 ? ooff0 + ci * kLc * p.out.s1
                                    : p.out.offset(sp.b, sp.bos + ci * kLc + r, hv) + vw + 8 * ch;
          store_out16(obase, goff, x, p.out.vec);
        }
      }
    }
    if constexpr (kC16) step16_done(accS);
    if constexpr (kGrouped) {
      // This warp is done with stage st (wgmma: its products waited for, its only generic reads
      // of the record, gL, consumed long before, no proxy fence: like the consumer release of
      // CUTLASS's TMA pipelines; K split: fenced above); the last of the block's warps refills the
      // stage with chunk ci + 2.
      __syncwarp();
      if (kC16 && lane == 0) {  // the refill at the next step's start, off this step's serial path
        __threadfence_block();
        last = atomicAdd(done0 + st, 1u) == static_cast<unsigned>(nwarps - 1);
      } else if (lane == 0) {
        unsigned* done = done0 + st;
        __threadfence_block();
        if (atomicAdd(done, 1u) == static_cast<unsigned>(nwarps - 1)) {
          *done = 0u;
          __threadfence_block();
          if (ci + kS < nchunks) issue_record(ci + kS);
        }
      }
    } else {
      fence_proxy_async();  // generic accesses of this stage before the bulk copy that refills it
    }

    // ---- Checkpoint: state after every ckpt_every tokens (only at full chunks).
    if (role.outputs && p.checkpoint_every > 0 && L == kLc) {
      const int64_t done = role.tok0 + (ci + 1) * kLc;
      if (done % p.checkpoint_every == 0) {
        const int64_t row = ck_lo + done / p.checkpoint_every - 1;
        if (row >= 0 && row < ck_hi)
          store_state(accS, p.checkpoints, p.kfirst, row, hv, vw, k0, g, c);
      }
    }
  }

  // ---- Final state (a segment's end state that is not the sequence's: to the workspace).
  if (role.last) {
    if (!p.has_state_pool && p.final_state.data != nullptr)
      store_state(accS, p.final_state, p.kfirst, n, hv, vw, k0, g, c);
    if (slot >= 0) store_state(accS, p.state_pool, p.kfirst, slot, hv, vw, k0, g, c);
  } else if (role.end_row >= 0) {
    store_state(accS, role.trans ? p.seg_trans : (role.first ? p.seg_start : p.seg_local), false,
                role.end_row, hv, vw, k0, g, c);
  }
}

template <bool kFp16, bool kKSplit, bool kWgmma, bool kC16 = false, bool kSeg = false>
__global__ void __launch_bounds__(256, 1) recurrence_kernel(const __grid_constant__ Params p) {
  pdl_prologue();
  recurrence_block<kFp16, kKSplit, kWgmma, kC16, kSeg>(p, blockIdx.x, blockDim.x);
}

// The recurrence path of a call and its kernel instantiation, for the CUDA launcher (prefill.cu,
// which keys the kernels' attributes by path) and the CPU emulator (dev/prefill_emu).
enum class RecurrencePath { kMma, kKSplit, kWgmma, kChunk16 };
inline RecurrencePath recurrence_path(const Params& p) {
  if (p.chunk16) return RecurrencePath::kChunk16;
  if (p.ksplit) return RecurrencePath::kKSplit;
  return p.wgmma ? RecurrencePath::kWgmma : RecurrencePath::kMma;
}
template <bool kFp16, bool kSeg>
void (*recurrence_kernel_of(RecurrencePath path))(Params) {
  switch (path) {
    case RecurrencePath::kChunk16:
      return recurrence_kernel<kFp16, false, true, true, kSeg>;
    case RecurrencePath::kKSplit:
      return recurrence_kernel<kFp16, true, false, false, kSeg>;
    case RecurrencePath::kWgmma:
      return recurrence_kernel<kFp16, false, true, false, kSeg>;
    case RecurrencePath::kMma:
      break;
  }
  return recurrence_kernel<kFp16, false, false, false, kSeg>;
}

}  // namespace kda::cuda::pf
