// single.cuh — the single-token kernel (decode_single_kernel<InT, kPlain>, 4 instantiations): the
// default for dense one-token calls on fp32 V-first pools with K = V = 128 below the bulk kernel's
// batch sizes (heuristics/decode.h), where a call is bound by its chain of dependent steps.
// docs/perf_decode.md, "Small batches".
//
// The warp kernel's organisation (one warp per 8 value rows of one (sequence n, value head hv),
// the rows in registers, lane l holding k = 4 l .. 4 l + 3 of each row; no shared memory, no
// barrier), specialized to what a dense single-token call can ask for: the input dtype is a
// template parameter (bf16 or fp16 q, k, v), the parameter block holds only what such a call uses
// (under 300 bytes instead of DecodeArgs' 700, read into the constant caches before the PDL
// wait), the grid is (HV x V / 32, N) (no integer division), and there is no token loop, no
// [N, Tmax] index rule and no per-token state output. What stays a uniform runtime choice: the
// gate form, the l2 norm, beta's form, GVA, fp32 g / beta / output, bf16 dt_bias, per-V beta, [N]
// int32 / int64 indices or none, padding rows, a separate final state, no initial state, no state
// write; kPlain fixes the serving engines' choices of these at compile time.
//
// Per call the chain is: index and token loads together (one round trip) -> state rows (one round
// trip) -> pass 1 (decay, S^T k as a warp reduce-scatter) -> u of each row -> pass 2 (s' = s + k
// u, S'^T q) -> stores from registers, all through L2 (the rows a small call touches stay there
// for the next step of a graph). Measured on the H200 in targets.md's 20-call CUDA graph: B = 1
// 2.95 us, B = 8 7.19 us per call, where the generic kernels took 3.95-5.3 and 9.9-11.7 us and a
// kernel with every choice fixed (dev/decode_floor.cu) 2.4 / 6.7 us.
//
// Same math per element as the warp kernel, in the same order (its results are bitwise the warp
// kernel's with 8 rows per warp), and the index rule of spec section 5 for [N] indices
// (rules::decode_read_slot: a negative slot or one >= P makes a padding row: zero output, no state
// access).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "core/kda_math.h"
#include "cuda/common/ptx.cuh"
#include "cuda/decode/load.cuh"
#include "cuda/decode/warp_step.cuh"

namespace kda::cuda::dec {

constexpr int kSingleK = 128;        // K = V
constexpr int kSingleRows = 8;       // value rows per warp
constexpr int kSingleThreads = 128;  // four independent warps: 32 value rows of one head

// The parameters of a dense single-token call. Token tensors are [N, 1, heads, dim] views
// (element strides s0 of the batch row, s2 of the head; the last dimension contiguous); q, k
// and g rows are 16-byte aligned, as are dt_bias rows and the rows of both state tensors
// (heuristics/decode.h: single_ok).
struct SingleArgs {
  const void *q = nullptr, *k = nullptr, *v = nullptr, *g = nullptr, *beta = nullptr;
  void* out = nullptr;
  const void* dt_bias = nullptr;  // [HV, K] fp32 or bf16; nullptr: 0
  const float* A_log = nullptr;   // [HV] fp32; nullptr: exp(A) = 1
  const void* idx = nullptr;      // [N] int32 / int64 state_indices; nullptr: row n reads slot n
  float* state = nullptr;         // [P, HV, V, K]
  float* final_state = nullptr;   // [N, HV, V, K]; nullptr: the new state goes to the read slot
  int64_t q_s0 = 0, q_s2 = 0, k_s0 = 0, k_s2 = 0, v_s0 = 0, v_s2 = 0, g_s0 = 0, g_s2 = 0;
  int64_t beta_s0 = 0, beta_s2 = 0, out_s0 = 0, out_s2 = 0;
  int64_t dt_bias_s0 = 0, A_log_s0 = 0, idx_s0 = 0;
  int64_t state_s0 = 0, state_s1 = 0, state_s2 = 0, fs_s0 = 0, fs_s1 = 0, fs_s2 = 0;
  int64_t P = 0;  // pool slots
  int HV = 0, groups = 1, gate = 0;
  float scale = 1.f, lower_bound = -5.f;
  bool idx64 = false, g_f32 = false, beta_f32 = false, out_f32 = false, bias_bf16 = false;
  bool beta_per_v = false, use_initial_state = true, store_state = true;
  bool l2norm = true, beta_logits = false, allow_neg_eigval = false;
};

// 16 bits of an InT (bf16 or fp16) as fp32.
template <typename InT>
__device__ __forceinline__ float in_to_float(uint32_t bits) {
  if constexpr (std::is_same_v<InT, __nv_bfloat16>)
    return bf16_bits_to_float(static_cast<uint16_t>(bits));
  else
    return half_bits_to_float(static_cast<uint16_t>(bits));
}

// kPlain: the serving engines' call, with everything but the gate and beta forms fixed at compile
// time: g, beta and out in the input dtype, fp32 dt_bias and A_log present, [N] int32 indices,
// per-head beta, an initial state, the new state in place in the pool, the l2 norm
// (single_plain: the host's test).
template <typename InT, bool kPlain>
__global__ void __launch_bounds__(kSingleThreads)
    decode_single_kernel(const __grid_constant__ SingleArgs a) {
  constexpr int kRows = kSingleRows, kRowLanes = 32 / kRows;
  constexpr bool kBf16 = std::is_same_v<InT, __nv_bfloat16>;
  __shared__ uint32_t param_sink[kSingleThreads / 32];

  // ---- Before the wait: the parameters into the constant caches and every address. Nothing in
  //      global memory is touched before it: the previous grid in the stream may write the pool
  //      rows (the previous step in a graph of steps) or the token inputs.
  pdl_launch_dependents();
  warm_params<kSingleThreads / 32>(a, threadIdx.x / 32, &param_sink[threadIdx.x / 32]);
  const int lane = lane_id();
  // Grid (HV x V / 32, N): block x = 4 hv + (row tile of 32), warp w of it has rows 8 w.. of that.
  const int64_t n = blockIdx.y;
  const int hv = static_cast<int>(blockIdx.x / (kSingleK / 32));
  const int v0 = static_cast<int>(blockIdx.x % (kSingleK / 32)) * 32 + (threadIdx.x / 32) * kRows;
  const int h = a.groups == 1 ? hv : hv / a.groups;
  const int v_mine = v0 + lane / kRowLanes;  // the row whose v, beta and sums this lane holds
  const bool out_lane = lane % kRowLanes == 0;
  const int k0 = 4 * lane;
  const bool idx64 = !kPlain && a.idx64, g_f32 = !kPlain && a.g_f32;
  const bool has_bias = kPlain || a.dt_bias != nullptr, bias_bf16 = !kPlain && a.bias_bf16;
  const bool has_A = kPlain || a.A_log != nullptr, has_idx = kPlain || a.idx != nullptr;
  const bool beta_f32 = !kPlain && a.beta_f32, out_f32 = !kPlain && a.out_f32;
  const bool l2norm = kPlain || a.l2norm, initial = kPlain || a.use_initial_state;
  const bool store = kPlain || a.store_state, to_final = !kPlain && a.final_state != nullptr;
  const uint32_t* idx_p = static_cast<const uint32_t*>(a.idx) + (idx64 ? 2 : 1) * n * a.idx_s0;
  const uint2* q_p = reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(a.q) + n * a.q_s0 +
                                                    h * a.q_s2 + k0);
  const uint2* k_p = reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(a.k) + n * a.k_s0 +
                                                    h * a.k_s2 + k0);
  const int64_t g_off = n * a.g_s0 + hv * a.g_s2 + k0;
  const int64_t bias_off = hv * a.dt_bias_s0 + k0;
  const float* A_p = a.A_log + hv * a.A_log_s0;
  const uint16_t* v_p = static_cast<const uint16_t*>(a.v) + n * a.v_s0 + hv * a.v_s2 + v_mine;
  const int64_t beta_off = n * a.beta_s0 + hv * a.beta_s2 + (!kPlain && a.beta_per_v ? v_mine : 0);
  const int64_t out_off = n * a.out_s0 + hv * a.out_s2 + v_mine;
  const int64_t row_off = hv * a.state_s1 + v0 * a.state_s2 + k0;  // + slot * state_s0
  const int64_t rs = a.state_s2;
  pdl_wait();

  // ---- The index load first (index -> state is the longest chain), then every token input
  //      (raw bits, converted at their first use so that all of them are in flight together)
  uint32_t idx_lo = 0, idx_hi = 0;
  if (has_idx) {  // volatile: issued before the address arithmetic of the token loads
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(idx_lo) : "l"(idx_p));
    if (idx64) asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(idx_hi) : "l"(idx_p + 1));
  }
  const uint2 q_raw = __ldcg(q_p), k_raw = __ldcg(k_p);
  uint4 g_raw, bias_raw = make_uint4(0u, 0u, 0u, 0u);
  if (g_f32) {
    g_raw = __ldcg(reinterpret_cast<const uint4*>(static_cast<const float*>(a.g) + g_off));
  } else {
    const uint2 x =
        __ldcg(reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(a.g) + g_off));
    g_raw = make_uint4(x.x, x.y, 0u, 0u);
  }
  if (has_bias) {
    if (bias_bf16) {
      const uint2 x = __ldcg(
          reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(a.dt_bias) + bias_off));
      bias_raw = make_uint4(x.x, x.y, 0u, 0u);
    } else {
      bias_raw =
          __ldcg(reinterpret_cast<const uint4*>(static_cast<const float*>(a.dt_bias) + bias_off));
    }
  }
  const float A_log = has_A ? __ldcg(A_p) : 0.f;
  const uint32_t v_raw = __ldcg(v_p);
  const uint32_t beta_raw = beta_f32 ? __ldcg(static_cast<const uint32_t*>(a.beta) + beta_off)
                                     : __ldcg(static_cast<const uint16_t*>(a.beta) + beta_off);

  // ---- The read slot (rules::decode_read_slot for [N] indices or none)
  int64_t slot = n;
  if (has_idx)
    slot = idx64 ? static_cast<int64_t>((static_cast<uint64_t>(idx_hi) << 32) | idx_lo)
                 : static_cast<int64_t>(static_cast<int32_t>(idx_lo));
  if (slot < 0 || slot >= a.P) {  // padding row: zero output, no state access (uniform per warp)
    if (out_lane) {
      if (out_f32)
        static_cast<float*>(a.out)[out_off] = 0.f;
      else
        static_cast<uint16_t*>(a.out)[out_off] = 0;
    }
    return;
  }

  // ---- The warp's rows -> registers: eight 16-byte loads per lane, all in flight at once
  float* const row = a.state + slot * a.state_s0 + row_off;
  float s[kRows][4];
  if (initial) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float4* p = reinterpret_cast<const float4*>(row + r * rs);
      const float4 x = __ldcg(p);
      s[r][0] = x.x, s[r][1] = x.y, s[r][2] = x.z, s[r][3] = x.w;
    }
  } else {
#pragma unroll
    for (int r = 0; r < kRows; ++r) s[r][0] = s[r][1] = s[r][2] = s[r][3] = 0.f;
  }

  // ---- The token, while the rows are in flight (prep_token_to's arithmetic)
  const float exp_A = has_A ? expf(A_log) : 1.f;
  const uint32_t qw[4] = {q_raw.x & 0xffffu, q_raw.x >> 16, q_raw.y & 0xffffu, q_raw.y >> 16};
  const uint32_t kw[4] = {k_raw.x & 0xffffu, k_raw.x >> 16, k_raw.y & 0xffffu, k_raw.y >> 16};
  const uint32_t gw[4] = {g_raw.x & 0xffffu, g_raw.x >> 16, g_raw.y & 0xffffu, g_raw.y >> 16};
  const uint32_t gf[4] = {g_raw.x, g_raw.y, g_raw.z, g_raw.w};
  const uint32_t bw[4] = {bias_raw.x & 0xffffu, bias_raw.x >> 16, bias_raw.y & 0xffffu,
                          bias_raw.y >> 16};
  const uint32_t bf[4] = {bias_raw.x, bias_raw.y, bias_raw.z, bias_raw.w};
  float q[4], kk[4], d[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    q[e] = in_to_float<InT>(qw[e]);
    kk[e] = in_to_float<InT>(kw[e]);
    const float g = g_f32 ? __uint_as_float(gf[e]) : in_to_float<InT>(gw[e]);
    const float bias =
        bias_bf16 ? bf16_bits_to_float(static_cast<uint16_t>(bw[e])) : __uint_as_float(bf[e]);
    d[e] = expf(detail::log_decay<float>(a.gate, g, exp_A, bias, a.lower_bound));
  }
  normalize_qk4(q, kk, l2norm, a.scale);
  const float v_in = in_to_float<InT>(v_raw);
  const float beta = detail::activate_beta<float>(
      a.beta_logits, a.allow_neg_eigval,
      beta_f32 ? __uint_as_float(beta_raw) : in_to_float<InT>(beta_raw));

  // ---- The two passes: s <- s * decay + k u, o = s^T q of the lane's row
  const float o_mine = warp_rows_token<kRows>(s, d, kk, q, beta, v_in, lane);

  // ---- The new state (the final state tensor, or the read slot), then the output row
  if (store) {
    float* dst = to_final ? a.final_state + n * a.fs_s0 + hv * a.fs_s1 + v0 * a.fs_s2 + k0 : row;
    const int64_t ds = to_final ? a.fs_s2 : rs;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float4* p4 = reinterpret_cast<float4*>(dst + r * ds);
      const float4 x = make_float4(s[r][0], s[r][1], s[r][2], s[r][3]);
      __stcg(p4, x);
    }
  }
  if (out_lane) {
    if (out_f32)
      static_cast<float*>(a.out)[out_off] = o_mine;
    else if constexpr (kBf16)
      static_cast<uint16_t*>(a.out)[out_off] = float_to_bf16_bits(o_mine);
    else
      static_cast<uint16_t*>(a.out)[out_off] = __half_as_ushort(__float2half_rn(o_mine));
  }
}

}  // namespace kda::cuda::dec
