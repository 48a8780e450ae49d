// decode_floor.cu — where the time of a small decode call goes inside a CUDA graph of 20 calls
// (targets.md's decode setup: H = HV = 32, K = V = 128, bf16 inputs and output, fp32 V-first pool
// of 2B slots updated in place through B random state_indices, softplus gate, beta logits,
// l2norm), and the library's own kernels launched on the same buffers. A standalone experiment, not
// part of the library: a decode kernel specialized to exactly that case (no runtime dtype or layout
// branches) with the warp kernel's organisation (one warp per kRows value rows of one head, the
// rows in registers), its stripped forms (no arithmetic, no index), and a %globaltimer trace of
// every warp's phases in every call of the graph. Checked against an fp32 CPU step before it is
// timed.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -I src -I include -o decode_floor
//   dev/decode_floor.cu && ./decode_floor
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/decode/bulk.cuh"
#include "cuda/decode/single.cuh"
#include "cuda/decode/staged.cuh"
#include "cuda/decode/warp.cuh"
#include "cuda/decode/warp_step.cuh"

#define CK(x)                                                                                 \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

namespace {

constexpr int kH = 32, kK = 128, kV = 128;

struct Args {
  const __nv_bfloat16 *q, *k, *v, *g, *beta;
  const float *A_log, *dt_bias;
  const int* idx;
  float* pool;
  __nv_bfloat16* out;
  unsigned long long* trace;  // [calls][warps][8] (trace kernels)
  int B, call;
};

__device__ __forceinline__ unsigned long long gtime() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
  return t;
}
// A stamp taken only once `x` is available (the asm consumes it).
__device__ __forceinline__ unsigned long long gtime_after(float x) {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) : "f"(x) : "memory");
  return t;
}

__device__ __forceinline__ float bf(uint16_t b) { return __uint_as_float(uint32_t{b} << 16); }

// kMode: 0 the full step; 1 loads and stores only (s' = s, o = v); 2 the full step without the
// index load (slot = n).
template <int kRows, int kMode, bool kTrace, bool kStream, int kWarps>
__global__ void __launch_bounds__(32 * kWarps) decode_kernel(const __grid_constant__ Args a) {
  constexpr int kTiles = kV / kRows, kRowLanes = 32 / kRows;
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  unsigned long long t[8] = {};
  if constexpr (kTrace) t[0] = gtime();
  const int lane = threadIdx.x & 31;
  const int warp = blockIdx.x * kWarps + threadIdx.x / 32;
  const int head = warp / kTiles, v0 = (warp % kTiles) * kRows;
  const int hv = head % kH, n = head / kH;
  const int v_mine = v0 + lane / kRowLanes;
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if constexpr (kTrace) t[1] = gtime();
  if (n >= a.B) return;
  const int slot = kMode == 2 ? n : __ldcg(a.idx + n);
  const int64_t tok = static_cast<int64_t>(n) * kH + hv;  // (n, 0, h = hv): H = HV
  const uint2 qr = __ldcg(reinterpret_cast<const uint2*>(a.q + tok * kK) + lane);
  const uint2 kr = __ldcg(reinterpret_cast<const uint2*>(a.k + tok * kK) + lane);
  const uint2 gr = __ldcg(reinterpret_cast<const uint2*>(a.g + tok * kK) + lane);
  const float4 bias = __ldg(reinterpret_cast<const float4*>(a.dt_bias + hv * kK) + lane);
  const float A_log = __ldg(a.A_log + hv);
  const uint16_t vr = __ldcg(reinterpret_cast<const unsigned short*>(a.v + tok * kV + v_mine));
  const uint16_t br = __ldcg(reinterpret_cast<const unsigned short*>(a.beta + tok));
  float* row = a.pool + ((static_cast<int64_t>(slot) * kH + hv) * kV + v0) * kK + 4 * lane;
  if constexpr (kTrace) t[2] = gtime_after(__int_as_float(slot));
  float s[kRows][4];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float4 x = kStream ? __ldcs(reinterpret_cast<const float4*>(row + r * kK))
                             : __ldcg(reinterpret_cast<const float4*>(row + r * kK));
    s[r][0] = x.x, s[r][1] = x.y, s[r][2] = x.z, s[r][3] = x.w;
  }
  // Token preprocessing while the rows are in flight.
  const float qv0[4] = {bf(qr.x & 0xffff), bf(qr.x >> 16), bf(qr.y & 0xffff), bf(qr.y >> 16)};
  const float kv0[4] = {bf(kr.x & 0xffff), bf(kr.x >> 16), bf(kr.y & 0xffff), bf(kr.y >> 16)};
  const float gv[4] = {bf(gr.x & 0xffff), bf(gr.x >> 16), bf(gr.y & 0xffff), bf(gr.y >> 16)};
  const float bv[4] = {bias.x, bias.y, bias.z, bias.w};
  float qq = 0.f, kq = 0.f;
#pragma unroll
  for (int e = 0; e < 4; ++e) qq = fmaf(qv0[e], qv0[e], qq), kq = fmaf(kv0[e], kv0[e], kq);
#pragma unroll
  for (int m = 16; m >= 1; m /= 2) {
    qq += __shfl_xor_sync(0xffffffffu, qq, m);
    kq += __shfl_xor_sync(0xffffffffu, kq, m);
  }
  const float qn = rsqrtf(qq + 1e-6f) * rsqrtf(static_cast<float>(kK)), kn = rsqrtf(kq + 1e-6f);
  const float exp_A = expf(A_log);
  float d[4], qv[4], kv[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float x = gv[e] + bv[e];
    const float sp = x > 20.f ? x : log1pf(expf(x));
    d[e] = expf(-exp_A * sp);
    qv[e] = qv0[e] * qn;
    kv[e] = kv0[e] * kn;
  }
  const float beta = 1.f / (1.f + expf(-bf(br)));
  const float v_in = bf(vr);
  if constexpr (kTrace) t[3] = gtime_after(d[0] + qv[0] + kv[0] + beta);
  if constexpr (kTrace) t[4] = gtime_after(s[kRows - 1][3] + s[0][0]);
  float o_mine;
  if constexpr (kMode == 1) {
    o_mine = v_in;
  } else {
    o_mine = kda::cuda::dec::warp_rows_token<kRows>(s, d, kv, qv, beta, v_in, lane);
  }
  if constexpr (kTrace) t[5] = gtime_after(o_mine + s[0][0]);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float4 x = make_float4(s[r][0], s[r][1], s[r][2], s[r][3]);
    if (kStream)
      __stcs(reinterpret_cast<float4*>(row + r * kK), x);
    else
      __stcg(reinterpret_cast<float4*>(row + r * kK), x);
  }
  if (lane % kRowLanes == 0) a.out[tok * kV + v_mine] = __float2bfloat16(o_mine);
  if constexpr (kTrace) {
    t[6] = gtime();
    if (lane == 0) {
      const int warps = gridDim.x * kWarps;
      unsigned long long* dst = a.trace + (static_cast<int64_t>(a.call) * warps + warp) * 8;
#pragma unroll
      for (int i = 0; i < 7; ++i) dst[i] = t[i];
    }
  }
}

// The bare chain as bench_gpu_mempattern's: index -> state rows -> stores, nothing else.
template <int kRows, bool kStream>
__global__ void __launch_bounds__(128) chain_kernel(const __grid_constant__ Args a) {
  constexpr int kTiles = kV / kRows;
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int lane = threadIdx.x & 31;
  const int warp = blockIdx.x * 4 + threadIdx.x / 32;
  const int head = warp / kTiles, v0 = (warp % kTiles) * kRows;
  const int hv = head % kH, n = head / kH;
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (n >= a.B) return;
  const int slot = __ldcg(a.idx + n);
  float* row = a.pool + ((static_cast<int64_t>(slot) * kH + hv) * kV + v0) * kK + 4 * lane;
  float4 s[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
    s[r] = kStream ? __ldcs(reinterpret_cast<const float4*>(row + r * kK))
                   : __ldcg(reinterpret_cast<const float4*>(row + r * kK));
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    s[r].x *= 0.999f;
    if (kStream)
      __stcs(reinterpret_cast<float4*>(row + r * kK), s[r]);
    else
      __stcg(reinterpret_cast<float4*>(row + r * kK), s[r]);
  }
}

__global__ void empty_kernel(const __grid_constant__ Args) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

struct Problem {
  int B;
  std::vector<uint16_t> q, k, v, g, beta;
  std::vector<float> A_log, dt_bias, pool;
  std::vector<int> idx;
  Args dev{};
};

uint16_t to_bf(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}
float from_bf(uint16_t b) {
  uint32_t u = uint32_t{b} << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

template <class T>
T* upload(const std::vector<T>& h) {
  T* d = nullptr;
  CK(cudaMalloc(&d, h.size() * sizeof(T) + 16));
  CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

Problem make_problem(int B, unsigned seed) {
  Problem p;
  p.B = B;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::uniform_real_distribution<float> ud(0.f, 1.f);
  auto fill = [&](std::vector<uint16_t>& x, size_t n) {
    x.resize(n);
    for (auto& e : x) e = to_bf(nd(rng));
  };
  fill(p.q, size_t(B) * kH * kK);
  fill(p.k, size_t(B) * kH * kK);
  fill(p.v, size_t(B) * kH * kV);
  fill(p.g, size_t(B) * kH * kK);
  fill(p.beta, size_t(B) * kH);
  p.A_log.resize(kH);
  for (auto& e : p.A_log) e = ud(rng);
  p.dt_bias.resize(kH * kK);
  for (auto& e : p.dt_bias) e = ud(rng);
  p.pool.resize(size_t(2 * B) * kH * kV * kK);
  for (auto& e : p.pool) e = 0.05f * nd(rng);
  std::vector<int> slots(2 * B);
  for (int i = 0; i < 2 * B; ++i) slots[i] = i;
  std::shuffle(slots.begin(), slots.end(), rng);
  p.idx.assign(slots.begin(), slots.begin() + B);
  Args& a = p.dev;
  a.q = reinterpret_cast<const __nv_bfloat16*>(upload(p.q));
  a.k = reinterpret_cast<const __nv_bfloat16*>(upload(p.k));
  a.v = reinterpret_cast<const __nv_bfloat16*>(upload(p.v));
  a.g = reinterpret_cast<const __nv_bfloat16*>(upload(p.g));
  a.beta = reinterpret_cast<const __nv_bfloat16*>(upload(p.beta));
  a.A_log = upload(p.A_log);
  a.dt_bias = upload(p.dt_bias);
  a.idx = upload(p.idx);
  a.pool = upload(p.pool);
  __nv_bfloat16* out = nullptr;
  CK(cudaMalloc(&out, size_t(B) * kH * kV * 2));
  a.out = out;
  a.B = B;
  return p;
}

// One fp32 CPU step; returns the largest relative error (of out, of the new state rows).
void check(const Problem& p, const std::vector<uint16_t>& out, const std::vector<float>& pool,
           double* err_out, double* err_state) {
  double eo = 0, no = 0, es = 0, ns = 0;
  for (int n = 0; n < p.B; ++n)
    for (int hv = 0; hv < kH; ++hv) {
      const size_t tok = size_t(n) * kH + hv;
      double qq = 0, kq = 0;
      for (int i = 0; i < kK; ++i)
        qq += double(from_bf(p.q[tok * kK + i])) * from_bf(p.q[tok * kK + i]),
            kq += double(from_bf(p.k[tok * kK + i])) * from_bf(p.k[tok * kK + i]);
      const double qn = 1 / std::sqrt(qq + 1e-6) / std::sqrt(double(kK)),
                   kn = 1 / std::sqrt(kq + 1e-6);
      const double eA = std::exp(double(p.A_log[hv]));
      const double beta = 1 / (1 + std::exp(-double(from_bf(p.beta[tok]))));
      const size_t base = (size_t(p.idx[n]) * kH + hv) * kV * kK;
      for (int vr = 0; vr < kV; ++vr) {
        double sk = 0;
        std::vector<double> s(kK);
        for (int i = 0; i < kK; ++i) {
          const double x = double(from_bf(p.g[tok * kK + i])) + p.dt_bias[hv * kK + i];
          const double sp = x > 20 ? x : std::log1p(std::exp(x));
          s[i] = p.pool[base + size_t(vr) * kK + i] * std::exp(-eA * sp);
          sk += s[i] * from_bf(p.k[tok * kK + i]) * kn;
        }
        const double u = beta * (from_bf(p.v[tok * kV + vr]) - sk);
        double o = 0;
        for (int i = 0; i < kK; ++i) {
          s[i] += from_bf(p.k[tok * kK + i]) * kn * u;
          o += s[i] * from_bf(p.q[tok * kK + i]) * qn;
          const double dv = pool[base + size_t(vr) * kK + i] - s[i];
          es += dv * dv, ns += s[i] * s[i];
        }
        const double dv = from_bf(out[tok * kV + vr]) - o;
        eo += dv * dv, no += o * o;
      }
    }
  *err_out = std::sqrt(eo / no);
  *err_state = std::sqrt(es / ns);
}

using Kernel = void (*)(Args);

// Median microseconds per launch of a CUDA graph of `calls` launches of k (PDL attribute when
// `pdl`; `set_call(a, i)` before launch i), over 22 replays (3 with `once`) after warm-up.
template <class A, class SetCall>
double graph_of(void (*k)(A), dim3 blocks, int threads, A a, bool pdl, int calls, cudaStream_t s,
                bool once, SetCall set_call) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(threads);
  cfg.stream = s;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at;
  cfg.numAttrs = pdl ? 1 : 0;
  cudaGraph_t g;
  cudaGraphExec_t e;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < calls; ++i) {
    set_call(a, i);
    CK(cudaLaunchKernelEx(&cfg, k, a));
  }
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&e, g, 0));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<double> us;
  const int reps = once ? 4 : 25;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(e0, s));
    CK(cudaGraphLaunch(e, s));
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= 3) us.push_back(1e3 * ms / calls);
  }
  CK(cudaGraphExecDestroy(e));
  CK(cudaGraphDestroy(g));
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

double graph_us(Kernel k, int blocks, int threads, Args a, bool pdl, int calls, cudaStream_t s,
                bool once = false) {
  return graph_of(k, dim3(blocks), threads, a, pdl, calls, s, once,
                  [](Args& x, int i) { x.call = i; });
}

template <int kRows, int kMode, bool kStream, int kWarps>
void run_variant(const char* name, Problem& p, cudaStream_t s, bool do_check, bool trace) {
  const int warps = p.B * kH * (kV / kRows);
  const int blocks = (warps + kWarps - 1) / kWarps;
  Args a = p.dev;
  if (do_check) {
    CK(cudaMemcpy(a.pool, p.pool.data(), p.pool.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaDeviceSynchronize());
    decode_kernel<kRows, kMode, false, kStream, kWarps><<<blocks, 32 * kWarps, 0, s>>>(a);
    CK(cudaGetLastError());
    CK(cudaStreamSynchronize(s));
    std::vector<uint16_t> out(size_t(p.B) * kH * kV);
    std::vector<float> pool(p.pool.size());
    CK(cudaMemcpy(out.data(), a.out, out.size() * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(pool.data(), a.pool, pool.size() * 4, cudaMemcpyDeviceToHost));
    double eo, es;
    check(p, out, pool, &eo, &es);
    std::printf("  check %-28s B=%-4d out %.2e state %.2e %s\n", name, p.B, eo, es,
                eo < 1e-2 && es < 1e-5 ? "ok" : "FAILED");
  }
  const double us = graph_us(decode_kernel<kRows, kMode, false, kStream, kWarps>, blocks,
                             32 * kWarps, a, true, 20, s);
  const double bytes = 2.0 * p.B * kH * kV * kK * 4;
  std::printf("%-30s B=%-4d %8.2f us/call %6.2f TB/s\n", name, p.B, us, bytes / us * 1e-6);
  if (!trace) return;
  constexpr int kCalls = 20;
  unsigned long long* tr = nullptr;
  CK(cudaMalloc(&tr, size_t(kCalls) * warps * 8 * 8));
  a.trace = tr;
  graph_us(decode_kernel<kRows, kMode, true, kStream, kWarps>, blocks, 32 * kWarps, a, true, kCalls,
           s, true);
  std::vector<unsigned long long> h(size_t(kCalls) * warps * 8);
  CK(cudaMemcpy(h.data(), tr, h.size() * 8, cudaMemcpyDeviceToHost));
  CK(cudaFree(tr));
  // Per call: the wait release (first warp past the wait), each phase's median over warps
  // (relative to that warp's release), the last warp's end, the gap to the next call's release.
  double ph[7] = {}, span = 0, gap = 0, pre = 0;
  int cnt = 0;
  for (int c = 2; c + 1 < kCalls - 1; ++c) {
    auto at = [&](int cc, int w, int i) { return h[(size_t(cc) * warps + w) * 8 + i]; };
    unsigned long long rel = ~0ull, end = 0, rel_next = ~0ull, start_min = ~0ull;
    for (int w = 0; w < warps; ++w) {
      rel = std::min(rel, at(c, w, 1));
      end = std::max(end, at(c, w, 6));
      rel_next = std::min(rel_next, at(c + 1, w, 1));
      start_min = std::min(start_min, at(c, w, 0));
    }
    for (int i = 2; i <= 6; ++i) {
      std::vector<double> d(warps);
      for (int w = 0; w < warps; ++w) d[w] = double(at(c, w, i)) - double(at(c, w, 1));
      std::nth_element(d.begin(), d.begin() + warps / 2, d.end());
      ph[i] += d[warps / 2];
    }
    {
      std::vector<double> d(warps);
      for (int w = 0; w < warps; ++w) d[w] = double(at(c, w, 1)) - double(rel);
      std::nth_element(d.begin(), d.begin() + warps / 2, d.end());
      ph[1] += d[warps / 2];
    }
    span += double(end - rel);
    gap += double(rel_next) - double(end);
    pre += double(rel) - double(start_min);
    ++cnt;
  }
  std::printf(
      "   trace (ns, medians over warps from each warp's release; averaged over calls): release "
      "skew %.0f, slot %.0f, token %.0f, state %.0f, computed %.0f, stored %.0f; first release to "
      "last end %.0f, last end to next release %.0f, first start to first release %.0f\n",
      ph[1] / cnt, ph[2] / cnt, ph[3] / cnt, ph[4] / cnt, ph[5] / cnt, ph[6] / cnt, span / cnt,
      gap / cnt, pre / cnt);
}

template <int kRows, bool kStream>
void run_chain(const char* name, Problem& p, cudaStream_t s) {
  const int warps = p.B * kH * (kV / kRows);
  const double us =
      graph_us(chain_kernel<kRows, kStream>, (warps + 3) / 4, 128, p.dev, true, 20, s);
  const double bytes = 2.0 * p.B * kH * kV * kK * 4;
  std::printf("%-30s B=%-4d %8.2f us/call %6.2f TB/s\n", name, p.B, us, bytes / us * 1e-6);
}

// The library's kernels on the same buffers, with DecodeArgs as the library's launcher fills them.
kda::cuda::dec::DecodeArgs library_args(const Problem& p) {
  using namespace kda::cuda;
  dec::DecodeArgs a;
  const Args& d = p.dev;
  auto view = [](const void* ptr, int64_t s0, int64_t s1, int64_t s2, int dtype) {
    StridedView v;
    v.data = const_cast<void*>(ptr);
    v.s0 = s0, v.s1 = s1, v.s2 = s2, v.dtype = dtype, v.vec = true;
    return v;
  };
  a.q = view(d.q, kH * kK, kH * kK, kK, kBF16);
  a.k = view(d.k, kH * kK, kH * kK, kK, kBF16);
  a.v = view(d.v, kH * kV, kH * kV, kV, kBF16);
  a.g = view(d.g, kH * kK, kH * kK, kK, kBF16);
  a.beta = view(d.beta, kH, kH, 1, kBF16);
  a.beta.vec = false;
  a.out = view(d.out, kH * kV, kH * kV, kV, kBF16);
  a.dt_bias = view(d.dt_bias, kK, 0, 0, kF32);
  a.A_log = d.A_log;
  a.A_log_s0 = 1;
  a.state_indices.data = d.idx;
  a.state_indices.s0 = 1;
  a.state = view(d.pool, int64_t{kH} * kV * kK, int64_t{kV} * kK, kK, kF32);
  a.N = p.B, a.T = 1, a.Tmax = 1, a.P = 2 * p.B;
  a.H = kH, a.HV = kH, a.K = kK, a.V = kV, a.groups = 1;
  a.gate = kda::detail::kGateSoftplus;
  a.scale = 1.f / std::sqrt(float(kK));
  a.has_indices = true;
  a.use_qk_l2norm = true, a.beta_logits = true;
  a.state_stream = false;
  return a;
}

kda::cuda::dec::SingleArgs single_args(const Problem& p) {
  kda::cuda::dec::SingleArgs a;
  const Args& d = p.dev;
  a.q = d.q, a.k = d.k, a.v = d.v, a.g = d.g, a.beta = d.beta, a.out = d.out;
  a.q_s0 = a.k_s0 = a.g_s0 = kH * kK, a.q_s2 = a.k_s2 = a.g_s2 = kK;
  a.v_s0 = a.out_s0 = kH * kV, a.v_s2 = a.out_s2 = kV;
  a.beta_s0 = kH, a.beta_s2 = 1;
  a.dt_bias = d.dt_bias, a.dt_bias_s0 = kK;
  a.A_log = d.A_log, a.A_log_s0 = 1;
  a.idx = d.idx, a.idx_s0 = 1;
  a.state = d.pool, a.state_s0 = int64_t{kH} * kV * kK, a.state_s1 = int64_t{kV} * kK;
  a.state_s2 = kK;
  a.P = 2 * p.B, a.HV = kH, a.groups = 1;
  a.gate = kda::detail::kGateSoftplus;
  a.scale = 1.f / std::sqrt(float(kK));
  a.beta_logits = true;
  return a;
}

template <class A>
void run_library(const char* name, Problem& p, cudaStream_t s, void (*k)(A), dim3 blocks, A la) {
  // Correctness of the hand-filled arguments: one call against the CPU step.
  CK(cudaMemcpy(p.dev.pool, p.pool.data(), p.pool.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaDeviceSynchronize());
  k<<<blocks, 128, 0, s>>>(la);
  CK(cudaGetLastError());
  CK(cudaStreamSynchronize(s));
  std::vector<uint16_t> out(size_t(p.B) * kH * kV);
  std::vector<float> pool(p.pool.size());
  CK(cudaMemcpy(out.data(), p.dev.out, out.size() * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(pool.data(), p.dev.pool, pool.size() * 4, cudaMemcpyDeviceToHost));
  double eo, es;
  check(p, out, pool, &eo, &es);
  const double us = graph_of(k, blocks, 128, la, true, 20, s, false, [](A&, int) {});
  const double bytes = 2.0 * p.B * kH * kV * kK * 4;
  std::printf("%-30s B=%-4d %8.2f us/call %6.2f TB/s   (check out %.2e state %.2e %s)\n", name, p.B,
              us, bytes / us * 1e-6, eo, es, eo < 1e-2 && es < 1e-5 ? "ok" : "FAILED");
}

void run_library_all(Problem& p, cudaStream_t s) {
  using namespace kda::cuda::dec;
  DecodeArgs la = library_args(p);
  const int tiles32 = p.B * kH * (kV / 32);
  run_library<DecodeArgs>("lib bulk latency", p, s, decode_bulk_kernel<float, 1, true>, tiles32,
                          la);
  run_library<DecodeArgs>("lib staged", p, s, decode_staged_kernel<float, false>, tiles32, la);
  run_library<DecodeArgs>("lib warp rows8", p, s, decode_warp_kernel<8>, p.B * kH * (kV / 8) / 4,
                          la);
  run_library<DecodeArgs>("lib warp rows16", p, s, decode_warp_kernel<16>, p.B * kH * (kV / 16) / 4,
                          la);
  la.state_stream = true;
  run_library<DecodeArgs>("lib warp rows8 stream", p, s, decode_warp_kernel<8>,
                          p.B * kH * (kV / 8) / 4, la);
  const dim3 single_blocks(kH * (kV / 32), p.B);
  run_library<SingleArgs>("lib single", p, s, decode_single_kernel<__nv_bfloat16, false>,
                          single_blocks, single_args(p));
  run_library<SingleArgs>("lib single plain", p, s, decode_single_kernel<__nv_bfloat16, true>,
                          single_blocks, single_args(p));
}

}  // namespace

int main() {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int B : {1, 8, 32, 64, 256}) {
    Problem p = make_problem(B, 1234 + B);
    std::printf("== B = %d\n", B);
    std::printf("%-30s B=%-4d %8.2f us/call\n", "empty kernel (128 blocks)", B,
                graph_us(empty_kernel, 128, 128, p.dev, true, 20, s));
    run_chain<8, false>("chain rows8 normal", p, s);
    run_chain<8, true>("chain rows8 stream", p, s);
    run_library_all(p, s);
    run_variant<8, 1, false, 4>("copy rows8 normal", p, s, false, B <= 8);
    run_variant<8, 0, false, 4>("full rows8 normal", p, s, true, B <= 8);
    run_variant<8, 0, true, 4>("full rows8 stream", p, s, false, B == 8);
    run_variant<8, 2, false, 4>("full rows8 no-index", p, s, false, B == 1);
    run_variant<4, 0, false, 4>("full rows4 normal", p, s, true, B == 1);
    run_variant<16, 0, false, 4>("full rows16 normal", p, s, true, B == 8);
    run_variant<8, 0, false, 1>("full rows8 1-warp blocks", p, s, false, B == 1);
    run_variant<4, 0, false, 2>("full rows4 2-warp blocks", p, s, false, false);
  }
  return 0;
}
