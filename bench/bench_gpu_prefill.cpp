// bench_gpu_prefill.cpp — CUDA prefill on the cases P1..P7 of targets.md.
//
// Protocol: inputs as targets.md (bf16 q, k, v, g, beta ~ randn; A_log, dt_bias ~ U(0, 1); gate
// in kernel with lower bound -5; beta logits; l2norm in kernel; fp32 initial and final state
// V-first, h0 ~ 0.1 randn). For each case: correctness first (value head 0 of the full run
// against the fp64 reference on that head alone; long cases on a prefix of whole sequences),
// warm-up, then the median of >= 20 timed calls (CUDA events around each call; L2 flushed by a
// 256 MB memset before each). Effective bandwidth counts q, k, v, g, out at 2 bytes per element,
// beta at 2 bytes per (token, head), and the initial + final state (fp32) once each.
//
// Usage: bench_gpu_prefill [--csv PATH] [--iters N] [--case P3] [--no-check]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <numeric>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/kda_math.h"
#include "kda/kda.h"
#ifdef KDA_PREFILL_TRACE
#include "cuda/cuda_backend.h"
#endif
#include "support.h"

namespace {

using namespace kda;

#define BENCH_CUDA(expr)                                                                   \
  do {                                                                                     \
    cudaError_t _e = (expr);                                                               \
    if (_e != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s failed: %s (%s:%d)\n", #expr, cudaGetErrorString(_e), __FILE__, __LINE__); \
      std::exit(2);                                                                        \
    }                                                                                      \
  } while (0)

struct Case {
  const char* name;
  std::vector<int64_t> lens;  // dense: B sequences of lens[0] (all equal); varlen: these lengths
  bool varlen;
  int64_t H;
  double fla_ms, flashkda_ms, moonshot_ms;  // targets.md
};

const std::vector<Case>& cases() {
  static const std::vector<Case> c = {
      {"P1", {8192}, false, 96, 2.669, 1.405, 0.70},
      {"P2", {8192}, false, 64, 1.771, 1.200, 0.60},
      {"P3", {1300, 547, 2048, 963, 271, 3063}, true, 96, 2.668, 1.401, 0.70},
      {"P4", {1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024}, true, 96, 2.635, 1.194, 0.60},
      {"P5", {32768}, false, 32, 3.706, 3.830, 1.00},
      {"P6", std::vector<int64_t>(16, 4096), false, 32, 7.418, 3.024, 1.50},
      {"P7", {2048}, false, 32, 0.984, 0.274, 0.14},
  };
  return c;
}

// Fast deterministic normal / uniform generator (splitmix64 + Box-Muller).
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return (next() >> 11) * (1.0 / 9007199254740992.0); }
  void normal2(float* out) {
    const double u1 = std::max(uniform(), 1e-300), u2 = uniform();
    const double r = std::sqrt(-2.0 * std::log(u1));
    out[0] = static_cast<float>(r * std::cos(6.283185307179586 * u2));
    out[1] = static_cast<float>(r * std::sin(6.283185307179586 * u2));
  }
};

std::vector<uint16_t> randn_bf16(size_t n, uint64_t seed) {
  std::vector<uint16_t> v(n);
  Rng r(seed);
  float x[2];
  for (size_t i = 0; i < n; i += 2) {
    r.normal2(x);
    v[i] = detail::float_to_bf16_bits(x[0]);
    if (i + 1 < n) v[i + 1] = detail::float_to_bf16_bits(x[1]);
  }
  return v;
}

template <typename T>
T* to_device(const std::vector<T>& h) {
  T* d = nullptr;
  BENCH_CUDA(cudaMalloc(reinterpret_cast<void**>(&d), std::max<size_t>(h.size(), 1) * sizeof(T)));
  if (!h.empty()) BENCH_CUDA(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

struct Result {
  double median_ms = 0, min_ms = 0, gbps = 0, err_out = -1, err_state = -1;
  bool ok = true;
};

// Value head 0 of the GPU run against the fp64 reference run on that head alone, over the first
// sequences whose tokens total at most `max_tokens`.
void check_head0(const Case& c, int64_t N, int64_t T_total, const std::vector<int64_t>& starts,
                 const std::vector<uint16_t>& q, const std::vector<uint16_t>& k, const std::vector<uint16_t>& v,
                 const std::vector<uint16_t>& g, const std::vector<uint16_t>& beta, const std::vector<float>& A_log,
                 const std::vector<float>& dt_bias, const std::vector<float>& h0, const std::vector<uint16_t>& out_gpu,
                 const std::vector<float>& ht_gpu, int64_t max_tokens, Result* res) {
  const int64_t H = c.H, K = 128, V = 128;
  int64_t nsel = 0, tsel = 0;
  while (nsel < N && tsel + c.lens[nsel] <= max_tokens) tsel += c.lens[nsel++];
  if (nsel == 0) {  // a single long sequence: a prefix of it (outputs only)
    nsel = 1;
    tsel = max_tokens;
  }
  const bool whole = tsel == std::accumulate(c.lens.begin(), c.lens.begin() + nsel, int64_t{0});
  auto bf = [](uint16_t b) { return detail::bf16_bits_to_float(b); };
  std::vector<float> rq(tsel * K), rk(tsel * K), rv(tsel * V), rg(tsel * K), rb(tsel), rout(tsel * V);
  std::vector<float> rh0(nsel * V * K), rht(nsel * V * K);
  std::vector<int64_t> cu = {0};
  int64_t t = 0;
  for (int64_t n = 0; n < nsel; ++n) {
    const int64_t len = std::min<int64_t>(c.lens[n], tsel - t);
    for (int64_t i = 0; i < len; ++i, ++t) {
      const int64_t row = starts[n] + i;  // token row in the [B*T] / varlen layout
      for (int64_t x = 0; x < K; ++x) {
        rq[t * K + x] = bf(q[(row * H + 0) * K + x]);
        rk[t * K + x] = bf(k[(row * H + 0) * K + x]);
        rg[t * K + x] = bf(g[(row * H + 0) * K + x]);
      }
      for (int64_t x = 0; x < V; ++x) rv[t * V + x] = bf(v[(row * H + 0) * V + x]);
      rb[t] = bf(beta[row * H + 0]);
    }
    cu.push_back(t);
    std::copy(h0.begin() + (n * H + 0) * V * K, h0.begin() + (n * H + 1) * V * K, rh0.begin() + n * V * K);
  }
  (void)T_total;
  PrefillParams p;
  p.q = make_view(rq.data(), DType::kFloat32, {1, tsel, 1, K});
  p.k = make_view(rk.data(), DType::kFloat32, {1, tsel, 1, K});
  p.v = make_view(rv.data(), DType::kFloat32, {1, tsel, 1, V});
  p.g = make_view(rg.data(), DType::kFloat32, {1, tsel, 1, K});
  p.beta = make_view(rb.data(), DType::kFloat32, {1, tsel, 1});
  std::vector<float> a0 = {A_log[0]}, db0(dt_bias.begin(), dt_bias.begin() + K);
  p.A_log = make_view(a0.data(), DType::kFloat32, {1});
  p.dt_bias = make_view(db0.data(), DType::kFloat32, {1, K});
  p.cu_seqlens = make_view(cu.data(), DType::kInt64, {nsel + 1});
  p.out = make_view(rout.data(), DType::kFloat32, {1, tsel, 1, V});
  p.initial_state = make_view(rh0.data(), DType::kFloat32, {nsel, 1, V, K});
  p.final_state = make_view(rht.data(), DType::kFloat32, {nsel, 1, V, K});
  p.gate.gate_form = GateForm::kLowerBound;
  p.gate.lower_bound = -5.0f;
  p.gate.beta_form = BetaForm::kLogits;
  p.gate.use_qk_l2norm = true;
  p.exec.backend = Backend::kCpuReference;
  const Status s = prefill(p);
  if (!s.ok()) {
    std::fprintf(stderr, "%s: reference failed: %s\n", c.name, s.to_string().c_str());
    res->ok = false;
    return;
  }
  double num = 0, den = 0;
  t = 0;
  for (int64_t n = 0; n < nsel; ++n) {
    const int64_t len = std::min<int64_t>(c.lens[n], tsel - t);
    for (int64_t i = 0; i < len; ++i, ++t) {
      const int64_t row = starts[n] + i;
      for (int64_t x = 0; x < V; ++x) {
        const double a = bf(out_gpu[(row * H + 0) * V + x]), b = rout[t * V + x];
        if (!std::isfinite(a)) num += 1e30;
        num += (a - b) * (a - b);
        den += b * b;
      }
    }
  }
  res->err_out = std::sqrt(num / std::max(den, 1e-300));
  if (whole) {
    num = den = 0;
    for (int64_t n = 0; n < nsel; ++n)
      for (int64_t e = 0; e < V * K; ++e) {
        const double a = ht_gpu[(n * H + 0) * V * K + e], b = rht[n * V * K + e];
        if (!std::isfinite(a)) num += 1e30;
        num += (a - b) * (a - b);
        den += b * b;
      }
    res->err_state = std::sqrt(num / std::max(den, 1e-300));
  }
  res->ok = res->err_out <= 4.5e-3 && (res->err_state < 0 || res->err_state <= 3.5e-3);
}

Result run_case(const Case& c, int iters, bool check, void* flush_buf, size_t flush_bytes) {
  const int64_t H = c.H, HV = c.H, K = 128, V = 128;
  const int64_t N = static_cast<int64_t>(c.lens.size());
  int64_t T_total = 0;
  std::vector<int64_t> starts;
  for (int64_t l : c.lens) {
    starts.push_back(T_total);
    T_total += l;
  }
  const int64_t B = c.varlen ? 1 : N, T = c.varlen ? T_total : c.lens[0];
  const size_t ntok = static_cast<size_t>(T_total);

  // Inputs (host), as targets.md.
  const std::vector<uint16_t> q = randn_bf16(ntok * H * K, 1), k = randn_bf16(ntok * H * K, 2),
                              v = randn_bf16(ntok * HV * V, 3), g = randn_bf16(ntok * HV * K, 4),
                              beta = randn_bf16(ntok * HV, 5);
  std::vector<float> A_log(HV), dt_bias(HV * K), h0(N * HV * V * K);
  {
    Rng r(6);
    for (auto& x : A_log) x = static_cast<float>(r.uniform());
    for (auto& x : dt_bias) x = static_cast<float>(r.uniform());
    float z[2];
    for (size_t i = 0; i < h0.size(); i += 2) {
      r.normal2(z);
      h0[i] = 0.1f * z[0];
      if (i + 1 < h0.size()) h0[i + 1] = 0.1f * z[1];
    }
  }
  std::vector<int32_t> cu;
  for (int64_t s : starts) cu.push_back(static_cast<int32_t>(s));
  cu.push_back(static_cast<int32_t>(T_total));

  // Device copies.
  uint16_t *dq = to_device(q), *dk = to_device(k), *dv = to_device(v), *dg = to_device(g), *db = to_device(beta);
  float *dA = to_device(A_log), *ddt = to_device(dt_bias), *dh0 = to_device(h0);
  int32_t* dcu = c.varlen ? to_device(cu) : nullptr;
  uint16_t* dout = nullptr;
  float* dht = nullptr;
  BENCH_CUDA(cudaMalloc(reinterpret_cast<void**>(&dout), ntok * HV * V * 2));
  BENCH_CUDA(cudaMalloc(reinterpret_cast<void**>(&dht), N * HV * V * K * 4));

  PrefillParams p;
  const Device dev = Device::kCUDA;
  p.q = make_view(dq, DType::kBFloat16, {B, T, H, K}, dev);
  p.k = make_view(dk, DType::kBFloat16, {B, T, H, K}, dev);
  p.v = make_view(dv, DType::kBFloat16, {B, T, HV, V}, dev);
  p.g = make_view(dg, DType::kBFloat16, {B, T, HV, K}, dev);
  p.beta = make_view(db, DType::kBFloat16, {B, T, HV}, dev);
  p.A_log = make_view(dA, DType::kFloat32, {HV}, dev);
  p.dt_bias = make_view(ddt, DType::kFloat32, {HV, K}, dev);
  if (c.varlen) p.cu_seqlens = make_view(dcu, DType::kInt32, {N + 1}, dev);
  p.out = make_view(dout, DType::kBFloat16, {B, T, HV, V}, dev);
  p.initial_state = make_view(dh0, DType::kFloat32, {N, HV, V, K}, dev);
  p.final_state = make_view(dht, DType::kFloat32, {N, HV, V, K}, dev);
  p.state_layout = StateLayout::kVFirst;
  p.gate.gate_form = GateForm::kLowerBound;
  p.gate.lower_bound = -5.0f;
  p.gate.beta_form = BetaForm::kLogits;
  p.gate.use_qk_l2norm = true;
  p.exec.backend = Backend::kCuda;
  size_t ws_bytes = 0;
  Status s = prefill_workspace_size(p, &ws_bytes);
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", c.name, s.to_string().c_str());
    std::exit(2);
  }
  void* ws = nullptr;
  BENCH_CUDA(cudaMalloc(&ws, std::max<size_t>(ws_bytes, 1)));
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  p.exec.workspace = ws;
  p.exec.workspace_bytes = ws_bytes;
  p.exec.stream = stream;

  Result res;
  // Correctness first.
  s = prefill(p);
  BENCH_CUDA(cudaStreamSynchronize(stream));
  if (!s.ok()) {
    std::fprintf(stderr, "%s: prefill failed: %s\n", c.name, s.to_string().c_str());
    std::exit(2);
  }
  if (check) {
    std::vector<uint16_t> out_h(ntok * HV * V);
    std::vector<float> ht_h(N * HV * V * K);
    BENCH_CUDA(cudaMemcpy(out_h.data(), dout, out_h.size() * 2, cudaMemcpyDeviceToHost));
    BENCH_CUDA(cudaMemcpy(ht_h.data(), dht, ht_h.size() * 4, cudaMemcpyDeviceToHost));
    check_head0(c, N, T_total, starts, q, k, v, g, beta, A_log, dt_bias, h0, out_h, ht_h, 8192, &res);
  }

  // Warm-up, then timed calls.
  for (int i = 0; i < 3; ++i) (void)prefill(p);
  cudaEvent_t e0, e1;
  BENCH_CUDA(cudaEventCreate(&e0));
  BENCH_CUDA(cudaEventCreate(&e1));
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    BENCH_CUDA(cudaMemsetAsync(flush_buf, i & 0xff, flush_bytes, stream));  // flush L2
    BENCH_CUDA(cudaEventRecord(e0, stream));
    s = prefill(p);
    BENCH_CUDA(cudaEventRecord(e1, stream));
    BENCH_CUDA(cudaEventSynchronize(e1));
    if (!s.ok()) {
      std::fprintf(stderr, "%s: prefill failed: %s\n", c.name, s.to_string().c_str());
      std::exit(2);
    }
    float t = 0;
    BENCH_CUDA(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  res.median_ms = ms[ms.size() / 2];
  res.min_ms = ms.front();
  const double bytes = static_cast<double>(ntok) * (2.0 * H * K + 2.0 * HV * V + 2.0 * HV * K + 2.0 * HV * V + 2.0 * HV) +
                       2.0 * N * HV * V * K * 4;
  res.gbps = bytes / (res.median_ms * 1e-3) / 1e9;

  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaStreamDestroy(stream);
  for (void* ptr : {static_cast<void*>(dq), static_cast<void*>(dk), static_cast<void*>(dv), static_cast<void*>(dg),
                    static_cast<void*>(db), static_cast<void*>(dA), static_cast<void*>(ddt), static_cast<void*>(dh0),
                    static_cast<void*>(dcu), static_cast<void*>(dout), static_cast<void*>(dht), ws})
    if (ptr) cudaFree(ptr);
  return res;
}

}  // namespace

int main(int argc, char** argv) {
  std::string csv, only;
  int iters = 30;
  bool check = true;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--csv" && i + 1 < argc) csv = argv[++i];
    else if (a == "--iters" && i + 1 < argc) iters = std::max(20, std::atoi(argv[++i]));
    else if (a == "--case" && i + 1 < argc) only = argv[++i];
    else if (a == "--no-check") check = false;
    else {
      std::fprintf(stderr, "usage: %s [--csv PATH] [--iters N>=20] [--case P1..P7] [--no-check]\n", argv[0]);
      return 2;
    }
  }
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    std::printf("bench_gpu_prefill: no CUDA device, nothing to do\n");
    return 0;
  }
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, sm_%d%d; %d timed calls per case (median), L2 flushed before each\n", prop.name,
              prop.multiProcessorCount, prop.major, prop.minor, iters);
  const size_t flush_bytes = 256u << 20;
  void* flush = nullptr;
  BENCH_CUDA(cudaMalloc(&flush, flush_bytes));

  FILE* f = csv.empty() ? nullptr : std::fopen(csv.c_str(), "w");
  if (f) std::fprintf(f, "case,sequences,H,median_ms,min_ms,gbps,err_out,err_state,flashkda_ms,fla_ms,speedup_vs_flashkda\n");
  std::printf("%-4s %-34s %4s %9s %9s %8s %9s %9s %10s %10s %8s %s\n", "case", "sequences", "H", "ms", "min ms", "GB/s",
              "err out", "err state", "FlashKDA", "FLA(tgt)", "speedup", "");
  bool all_ok = true;
  for (const Case& c : cases()) {
    if (!only.empty() && only != c.name) continue;
    std::string seqs;
    if (c.varlen) {
      seqs = "varlen";
      for (size_t i = 0; i < c.lens.size() && i < 6; ++i) seqs += (i ? "," : " ") + std::to_string(c.lens[i]);
      if (c.lens.size() > 6) seqs += ",...";
    } else {
      seqs = std::to_string(c.lens.size()) + " x " + std::to_string(c.lens[0]);
    }
#ifdef KDA_PREFILL_TRACE
    std::vector<unsigned long long> clocks;
    (void)kda::cuda::prefill_trace_fetch(&clocks, true);
#endif
    const Result r = run_case(c, iters, check, flush, flush_bytes);
#ifdef KDA_PREFILL_TRACE
    if (kda::cuda::prefill_trace_fetch(&clocks, false).ok() && clocks.back() > 0) {
      static const char* names[] = {"locate", "load", "cumsum", "Akk/Aqk", "inverse", "Tm", "W", "qg/kbT"};
      const double nb = static_cast<double>(clocks.back());
      double total = 0;
      for (size_t i = 0; i + 1 < clocks.size(); ++i) total += clocks[i] / nb;
      std::printf("  prepare phases (SM clocks per block, thread 0): ");
      for (size_t i = 0; i + 1 < clocks.size(); ++i) std::printf("%s %.0f (%.0f%%)  ", names[i], clocks[i] / nb, 100.0 * clocks[i] / nb / total);
      std::printf(" total %.0f\n", total);
    }
#endif
    const double speedup = c.flashkda_ms / r.median_ms;
    const bool beat = r.median_ms < c.flashkda_ms && r.median_ms < c.fla_ms;
    all_ok = all_ok && r.ok;
    std::printf("%-4s %-34s %4lld %9.3f %9.3f %8.0f %9.2e %9.2e %10.3f %10.3f %7.2fx %s%s\n", c.name, seqs.c_str(),
                static_cast<long long>(c.H), r.median_ms, r.min_ms, r.gbps, r.err_out, r.err_state, c.flashkda_ms,
                c.fla_ms, speedup, beat ? "" : "SLOWER ", r.ok ? "" : "INACCURATE");
    std::fflush(stdout);
    if (f)
      std::fprintf(f, "%s,\"%s\",%lld,%.4f,%.4f,%.1f,%.3e,%.3e,%.3f,%.3f,%.3f\n", c.name, seqs.c_str(),
                   static_cast<long long>(c.H), r.median_ms, r.min_ms, r.gbps, r.err_out, r.err_state, c.flashkda_ms,
                   c.fla_ms, speedup);
  }
  if (f) std::fclose(f);
  cudaFree(flush);
  std::printf("speedup = FlashKDA ms (targets.md) / ours; FLA(tgt) is targets.md's FLA time (scripts/fla_prefill_bench.py\n"
              "measures FLA on the same inputs in the same session). err: rel L2 of value head 0 vs the fp64 reference.\n");
  return all_ok ? 0 : 1;
}
