// kda — command-line front end: `kda demo` runs a Kimi-Linear-shaped layer (prefill into a state
// pool, then decode steps from it) and checks a sample against the fp64 reference; `kda info`
// lists backends and devices.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "host_tensor.h"
#include "kda/kda.h"

#ifdef KDA_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace {

using namespace kda;
using kda::tools::HostTensor;

const char* kUsage =
    "usage: kda <command> [flags]\n"
    "commands:\n"
    "  info                      list backends and CUDA devices\n"
    "  demo                      prefill a few sequences into a state pool, decode from it,\n"
    "                            check a sample against the fp64 reference\n"
    "demo flags:\n"
    "  --backend auto|cpu|cuda|reference   (default auto: cuda when a supported GPU is present)\n"
    "  --dtype bf16|fp16|fp32              input/output dtype (default bf16; fp32 on CPU only)\n"
    "  --heads H                           q/k heads (default 32)\n"
    "  --value-heads HV                    value heads, a multiple of H (default H)\n"
    "  --head-dim D                        K = V (default 128)\n"
    "  --seqlens a,b,c                     prompt lengths (default 512,1000,256,2048)\n"
    "  --decode-steps S                    decode steps after the prefill (default 16)\n"
    "  --gate softplus|lower_bound|precomputed   (default softplus, Kimi-Linear)\n"
    "  --threads N                         CPU threads (default all)\n"
    "  --seed N                            input seed (default 1)\n";

int usage_error(const std::string& msg) {
  std::fprintf(stderr, "kda: %s\n\n%s", msg.c_str(), kUsage);
  return 2;
}

struct DemoOptions {
  std::string backend = "auto", dtype = "bf16", gate = "softplus";
  int64_t H = 32, HV = 0, D = 128, steps = 16;
  std::vector<int64_t> seqlens = {512, 1000, 256, 2048};
  int threads = 0;
  uint64_t seed = 1;
};

bool parse_int(const std::string& s, int64_t lo, int64_t hi, int64_t* out) {
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (end == s.c_str() || *end != '\0' || v < lo || v > hi) return false;
  *out = v;
  return true;
}

// Parses demo flags; returns an error message or "".
// The code of an enum value named `v` (kda's *_name() spelling), or -1.
template <typename Enum>
int enum_code(const std::string& v, const char* (*name)(Enum), int count) {
  for (int i = 0; i < count; ++i)
    if (v == name(static_cast<Enum>(i))) return i;
  return -1;
}

std::string parse_demo(int argc, char** argv, DemoOptions* o) {
  for (int i = 2; i < argc; ++i) {
    const std::string f = argv[i];
    if (f == "-h" || f == "--help") return "help";
    if (i + 1 >= argc) return "flag " + f + " needs a value";
    const std::string v = argv[++i];
    int64_t x = 0;
    if (f == "--backend") {
      if (enum_code(v, backend_name, kNumBackends) < 0)
        return "--backend: expected auto, cpu, cuda or reference, got " + v;
      o->backend = v;
    } else if (f == "--dtype") {
      if (v != "bf16" && v != "fp16" && v != "fp32")
        return "--dtype: expected bf16, fp16 or fp32, got " + v;
      o->dtype = v;
    } else if (f == "--gate") {
      if (enum_code(v, gate_name, kNumGateForms) < 0)
        return "--gate: expected softplus, lower_bound or precomputed, got " + v;
      o->gate = v;
    } else if (f == "--heads") {
      if (!parse_int(v, 1, 1024, &o->H))
        return "--heads: expected an integer in [1, 1024], got " + v;
    } else if (f == "--value-heads") {
      if (!parse_int(v, 1, 4096, &o->HV))
        return "--value-heads: expected an integer in [1, 4096], got " + v;
    } else if (f == "--head-dim") {
      if (!parse_int(v, 32, 256, &o->D) || o->D % 32)
        return "--head-dim: expected a multiple of 32 in [32, 256], got " + v;
    } else if (f == "--decode-steps") {
      if (!parse_int(v, 0, 100000, &o->steps))
        return "--decode-steps: expected an integer in [0, 100000], got " + v;
    } else if (f == "--threads") {
      if (!parse_int(v, 0, 4096, &x)) return "--threads: expected an integer >= 0, got " + v;
      o->threads = static_cast<int>(x);
    } else if (f == "--seed") {
      if (!parse_int(v, 0, INT64_MAX, &x))
        return "--seed: expected a non-negative integer, got " + v;
      o->seed = static_cast<uint64_t>(x);
    } else if (f == "--seqlens") {
      o->seqlens.clear();
      std::stringstream ss(v);
      std::string item;
      while (std::getline(ss, item, ',')) {
        if (!parse_int(item, 0, int64_t{1} << 24, &x))
          return "--seqlens: expected comma-separated lengths >= 0, got " + v;
        o->seqlens.push_back(x);
      }
      if (o->seqlens.empty()) return "--seqlens: expected at least one length";
    } else {
      return "unknown flag " + f;
    }
  }
  if (o->HV == 0) o->HV = o->H;
  if (o->HV % o->H) return "--value-heads must be a multiple of --heads";
  return "";
}

int cmd_info() {
  std::printf("kda %s\n", version());
  std::printf("backends:\n");
  std::printf(
      "  cpu            fast fp32 backend (chunked prefill, chunk %d), %u hardware threads\n",
      kChunkSize, std::thread::hardware_concurrency());
  std::printf("  cpu-reference  fp64 token-by-token reference\n");
  std::printf("  cuda           %s\n",
              cuda_compiled() ? "compiled (sm_90a)" : "not compiled in this build");
  const auto devs = cuda_devices();
  if (cuda_compiled()) {
    if (devs.empty()) std::printf("cuda devices: none found\n");
    for (const auto& d : devs)
      std::printf("  cuda:%d %s  sm_%d%d  %d SMs  %.1f GiB  %s\n", d.index, d.name.c_str(),
                  d.sm_major, d.sm_minor, d.multiprocessors,
                  d.global_memory_bytes / double(1 << 30),
                  d.supported ? "supported" : "not supported by these kernels (needs sm_90)");
  }
  return 0;
}

// Device buffers mirroring host tensors (CUDA backend only).
struct Mirror {
  std::vector<void*> ptrs;
  bool on_device = false;
  Status err;
  TensorView place(const HostTensor& h) {
    TensorView t = h.view();
    if (!on_device || h.empty()) return t;
#ifdef KDA_WITH_CUDA
    void* p = nullptr;
    if (cudaMalloc(&p, h.storage.size()) != cudaSuccess ||
        cudaMemcpy(p, h.storage.data(), h.storage.size(), cudaMemcpyHostToDevice) != cudaSuccess) {
      err = Status(StatusCode::kCudaError, "device allocation/copy failed");
      return t;
    }
    ptrs.push_back(p);
    t.data = p;
    t.device = Device::kCUDA;
#endif
    return t;
  }
  void fetch([[maybe_unused]] const TensorView& t, [[maybe_unused]] HostTensor& h) {
#ifdef KDA_WITH_CUDA
    if (on_device && !h.empty() &&
        cudaMemcpy(h.storage.data(), t.data, h.storage.size(), cudaMemcpyDeviceToHost) !=
            cudaSuccess)
      err = Status(StatusCode::kCudaError, "device-to-host copy failed");
#endif
  }
  void sync() {
#ifdef KDA_WITH_CUDA
    if (on_device && cudaDeviceSynchronize() != cudaSuccess)
      err = Status(StatusCode::kCudaError, "cudaDeviceSynchronize failed");
#endif
  }
  ~Mirror() {
#ifdef KDA_WITH_CUDA
    for (void* p : ptrs) cudaFree(p);
#endif
  }
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int cmd_demo(const DemoOptions& o) {
  // Backend choice: auto = CUDA when a supported device is present.
  Backend backend = static_cast<Backend>(enum_code(o.backend, backend_name, kNumBackends));
  if (backend == Backend::kAuto) {
    backend = Backend::kCpu;
    for (const auto& d : cuda_devices())
      if (d.supported) backend = Backend::kCuda;
  }
  const DType dt = o.dtype == "bf16"   ? DType::kBFloat16
                   : o.dtype == "fp16" ? DType::kFloat16
                                       : DType::kFloat32;
  const GateForm gate = static_cast<GateForm>(enum_code(o.gate, gate_name, kNumGateForms));
  const int64_t N = static_cast<int64_t>(o.seqlens.size()), H = o.H, HV = o.HV, K = o.D, V = o.D,
                S = o.steps;
  std::vector<int64_t> cu = {0};
  for (int64_t l : o.seqlens) cu.push_back(cu.back() + l);
  const int64_t T = cu.back();
  std::mt19937_64 rng(o.seed);

  std::printf(
      "kda demo: backend %s, dtype %s, H=%lld HV=%lld K=V=%lld, gate %s, beta logits, l2norm\n",
      backend_name(backend), o.dtype.c_str(), (long long)H, (long long)HV, (long long)K,
      o.gate.c_str());
  // Inputs: the prompts (varlen) and S decode tokens per sequence.
  HostTensor q(dt, {1, T, H, K}), k(dt, {1, T, H, K}), v(dt, {1, T, HV, V}), g(dt, {1, T, HV, K}),
      beta(dt, {1, T, HV});
  HostTensor dq(dt, {N, S, H, K}), dk(dt, {N, S, H, K}), dv(dt, {N, S, HV, V}),
      dg(dt, {N, S, HV, K}), dbeta(dt, {N, S, HV});
  for (HostTensor* t : {&q, &k, &v, &g, &beta, &dq, &dk, &dv, &dg, &dbeta})
    t->fill_normal(rng, 1.0);
  if (gate == GateForm::kPrecomputed) {
    for (HostTensor* t : {&g, &dg})
      for (int64_t i = 0; i < t->numel(); ++i) t->set(i, -std::exp(t->get(i) - 1.5));
  }
  HostTensor A_log(DType::kFloat32, {HV}), dt_bias(DType::kFloat32, {HV, K});
  A_log.fill_uniform(rng, 0, 1);
  dt_bias.fill_uniform(rng, 0, 1);
  // State pool: N sequences in shuffled slots of a pool with spare slots.
  const int64_t P = N + 4;
  HostTensor pool(DType::kFloat32, {P, HV, V, K}), idx(DType::kInt32, {N}),
      cut(DType::kInt32, {N + 1});
  pool.fill(0.0);
  for (int64_t n = 0; n < N; ++n) idx.set(n, (n * 3 + 1) % P);
  for (int64_t n = 0; n <= N; ++n) cut.set(n, cu[n]);
  HostTensor out(dt, {1, T, HV, V}), dout(dt, {N, S, HV, V});

  Mirror m;
  m.on_device = backend == Backend::kCuda;
  PrefillParams pp;
  pp.q = m.place(q);
  pp.k = m.place(k);
  pp.v = m.place(v);
  pp.g = m.place(g);
  pp.beta = m.place(beta);
  pp.A_log = m.place(A_log);
  pp.dt_bias = m.place(dt_bias);
  pp.cu_seqlens = m.place(cut);
  pp.out = m.place(out);
  pp.state_pool = m.place(pool);
  pp.state_indices = m.place(idx);
  pp.math.gate = gate;
  pp.math.beta_logits = true;
  pp.exec.backend = backend;
  pp.exec.num_threads = o.threads;
  if (!m.err.ok()) return std::fprintf(stderr, "kda: %s\n", m.err.to_string().c_str()), 1;
  size_t ws_bytes = 0;
  Status s = prefill_workspace_size(pp, &ws_bytes);
  if (!s.ok()) return std::fprintf(stderr, "kda: prefill: %s\n", s.to_string().c_str()), 1;
  HostTensor ws(DType::kInt32, {static_cast<int64_t>((ws_bytes + 3) / 4)});
  if (ws_bytes) {
    pp.exec.workspace = m.place(ws).data;
    pp.exec.workspace_bytes = ws_bytes;
  }

  std::printf("prefill: %lld sequences (", (long long)N);
  for (int64_t n = 0; n < N; ++n) std::printf("%s%lld", n ? ", " : "", (long long)o.seqlens[n]);
  std::printf(" = %lld tokens) into a pool of %lld slots ...\n", (long long)T, (long long)P);
  std::fflush(stdout);
  auto t0 = std::chrono::steady_clock::now();
  s = prefill(pp);
  m.sync();
  const double t_prefill = seconds_since(t0);
  if (!s.ok()) return std::fprintf(stderr, "kda: prefill: %s\n", s.to_string().c_str()), 1;
  std::printf("  %.3f s, %.0f tokens/s (%.0f token-heads/s)\n", t_prefill, T / t_prefill,
              T * HV / t_prefill);

  // Decode steps: every sequence advances one token per step, reading and writing its pool slot.
  DecodeParams dp;
  dp.A_log = pp.A_log;
  dp.dt_bias = pp.dt_bias;
  dp.state = pp.state_pool;
  dp.state_indices = pp.state_indices;
  dp.math = pp.math;
  dp.exec = pp.exec;
  TensorView vq = m.place(dq), vk = m.place(dk), vv = m.place(dv), vg = m.place(dg),
             vb = m.place(dbeta), vo = m.place(dout);
  auto step_view = [](TensorView t, int64_t step) {
    t.data = static_cast<char*>(t.data) + step * t.strides[1] * dtype_size(t.dtype);
    t.shape[1] = 1;
    return t;
  };
  t0 = std::chrono::steady_clock::now();
  for (int64_t st = 0; st < S; ++st) {
    dp.q = step_view(vq, st);
    dp.k = step_view(vk, st);
    dp.v = step_view(vv, st);
    dp.g = step_view(vg, st);
    dp.beta = step_view(vb, st);
    dp.out = step_view(vo, st);
    s = decode(dp);
    if (!s.ok()) return std::fprintf(stderr, "kda: decode: %s\n", s.to_string().c_str()), 1;
    if (S >= 50 && (st + 1) % (S / 10) == 0)
      std::printf("  decode step %lld/%lld\n", (long long)st + 1, (long long)S),
          std::fflush(stdout);
  }
  m.sync();
  const double t_decode = seconds_since(t0);
  if (S > 0)
    std::printf("decode: %lld steps x %lld sequences: %.3f s, %.3f ms/step, %.0f tokens/s\n",
                (long long)S, (long long)N, t_decode, 1e3 * t_decode / S, N * S / t_decode);
  m.fetch(pp.out, out);
  m.fetch(vo, dout);
  m.fetch(pp.state_pool, pool);
  if (!m.err.ok()) return std::fprintf(stderr, "kda: %s\n", m.err.to_string().c_str()), 1;

  // Check: the shortest non-empty sequence, two value heads, prompt + decode tokens as one fp64
  // reference prefill; compares prefill outputs, decode outputs and the final pool slot.
  int64_t ns = -1;
  for (int64_t n = 0; n < N; ++n)
    if (o.seqlens[n] > 0 && (ns < 0 || o.seqlens[n] < o.seqlens[ns])) ns = n;
  if (ns < 0) {
    std::printf("check: skipped (no non-empty sequence)\n");
    return 0;
  }
  // Value heads 0..hvs-1 read q/k heads 0..h_n-1 with the same grouping as the full problem.
  const int64_t L = o.seqlens[ns], LT = L + S, hvs = std::min<int64_t>(2, HV),
                h_n = (hvs - 1) / (HV / H) + 1;
  HostTensor rq(DType::kFloat32, {1, LT, h_n, K}), rk(DType::kFloat32, {1, LT, h_n, K}),
      rv(DType::kFloat32, {1, LT, hvs, V}), rg(DType::kFloat32, {1, LT, hvs, K}),
      rb(DType::kFloat32, {1, LT, hvs}), ro(DType::kFloat32, {1, LT, hvs, V}),
      rs(DType::kFloat32, {1, hvs, V, K}), ra(DType::kFloat32, {hvs}),
      rd(DType::kFloat32, {hvs, K});
  auto copy_tok = [&](const HostTensor& src, int64_t src_tok, HostTensor& dst, int64_t dst_tok,
                      int64_t heads, int64_t dim) {
    const int64_t src_heads = src.shape[2], dst_heads = dst.shape[2];
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t c = 0; c < dim; ++c)
        dst.set((dst_tok * dst_heads + h) * dim + c, src.get((src_tok * src_heads + h) * dim + c));
  };
  for (int64_t t = 0; t < LT; ++t) {
    const bool pre = t < L;
    const int64_t st = pre ? cu[ns] + t : ns * S + (t - L);
    copy_tok(pre ? q : dq, st, rq, t, h_n, K);
    copy_tok(pre ? k : dk, st, rk, t, h_n, K);
    copy_tok(pre ? v : dv, st, rv, t, hvs, V);
    copy_tok(pre ? g : dg, st, rg, t, hvs, K);
    for (int64_t h = 0; h < hvs; ++h) rb.set(t * hvs + h, (pre ? beta : dbeta).get(st * HV + h));
  }
  for (int64_t h = 0; h < hvs; ++h) {
    ra.set(h, A_log.get(h));
    for (int64_t c = 0; c < K; ++c) rd.set(h * K + c, dt_bias.get(h * K + c));
  }
  PrefillParams rp;
  rp.q = rq.view();
  rp.k = rk.view();
  rp.v = rv.view();
  rp.g = rg.view();
  rp.beta = rb.view();
  rp.A_log = ra.view();
  rp.dt_bias = rd.view();
  rp.out = ro.view();
  rp.final_state = rs.view();
  rp.math = pp.math;
  rp.exec.backend = Backend::kCpuReference;
  t0 = std::chrono::steady_clock::now();
  s = prefill(rp);
  if (!s.ok()) return std::fprintf(stderr, "kda: reference: %s\n", s.to_string().c_str()), 1;
  // Gather the backend's results for the same sequence and heads.
  HostTensor go(DType::kFloat32, ro.shape), gs(DType::kFloat32, rs.shape);
  for (int64_t t = 0; t < LT; ++t) {
    const bool pre = t < L;
    copy_tok(pre ? out : dout, pre ? cu[ns] + t : ns * S + (t - L), go, t, hvs, V);
  }
  const int64_t slot = static_cast<int64_t>(idx.get(ns));
  for (int64_t i = 0; i < hvs * V * K; ++i) gs.set(i, pool.get(slot * HV * V * K + i));
  const double eo = kda::tools::rel_l2_error(go, ro), es = kda::tools::rel_l2_error(gs, rs);
  const bool ok = eo <= 4.5e-3 && es <= 3.5e-3;
  std::printf(
      "check: sequence %lld (%lld prompt + %lld decode tokens), value heads 0-%lld vs the fp64 "
      "reference (%.1f s):\n",
      (long long)ns, (long long)L, (long long)S, (long long)hvs - 1, seconds_since(t0));
  std::printf("  output rel L2 error %.3g (bar 4.5e-3), state rel L2 error %.3g (bar 3.5e-3): %s\n",
              eo, es, ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return usage_error("missing command");
  const std::string cmd = argv[1];
  if (cmd == "-h" || cmd == "--help" || cmd == "help") {
    std::printf("%s", kUsage);
    return 0;
  }
  if (cmd == "info") {
    if (argc > 2) return usage_error("info takes no flags");
    return cmd_info();
  }
  if (cmd == "demo") {
    DemoOptions o;
    const std::string err = parse_demo(argc, argv, &o);
    if (err == "help") {
      std::printf("%s", kUsage);
      return 0;
    }
    if (!err.empty()) return usage_error(err);
    if (o.dtype == "fp32" && (o.backend == "cuda"))
      return usage_error("--dtype fp32 runs on the CPU backends only");
    return cmd_demo(o);
  }
  return usage_error("unknown command '" + cmd + "'");
}
