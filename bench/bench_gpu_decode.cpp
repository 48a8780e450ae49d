// bench_gpu_decode — CUDA decode speed on the targets.md decode setup.
//
// Setup (targets.md, "Decode"): H = HV = 32, K = V = 128, bf16 q/k/v/g/beta/out, gate in kernel
// with lower bound -5 (A_log, dt_bias ~ U(0, 1)), beta logits, l2norm in kernel; the state pool is
// updated in place through [B] state_indices (fp32 V-first unless the case says otherwise).
//
// Protocol: for every case, (1) correctness first: one GPU call is checked against the fp64 CPU
// reference on a sample of sequences; (2) warm-up; (3) timed calls with CUDA events, rotating
// among several disjoint sets of pool slots and inputs so that L2 (60 MB) does not serve the state;
// (4) the median of >= 50 calls. Effective bandwidth = (2 x B x HV x K x V x state_bytes + bytes of
// q, k, v, g, beta, out) / time. Graph cases capture 1 call (or 20 calls) in a CUDA graph and time
// the replay (divided by the number of calls).
//
// The G20_B* cases are the targets.md decode table as measured against FLA: softplus gate, a pool
// of 2B slots of which B random distinct ones are used, one set of inputs and slots for all 20
// calls of the graph (so each call reads the state the previous one wrote: from L2 when it fits).
//
// Kernel: the library's choice (heuristics/decode.h); --kernels (or KDA_CUDA_DECODE_KERNEL=tile,
// staged, bulk, bulklat, warp, baseline in the environment) times the others on the same cases.
// A --kernels item is a kernel name (or "auto": the library's choice) with optional settings of
// the tuning struct: rows=4|8|16 (KDA_CUDA_DECODE_WARP_ROWS), cache=normal|stream
// (KDA_CUDA_DECODE_WARP_CACHE), pdl=0|1 (KDA_CUDA_PDL), e.g. warp:rows=16:cache=stream.
//
// usage: bench_gpu_decode [--csv PATH] [--iters N] [--warmup N] [--filter S1,S2,..] [--no-check]
//                         [--kernels K1,K2,..]   (--filter: cases whose name contains any of the
//                         substrings, or ends in one that ends in '$'; --kernels: also time each
//                         case with kernel K forced)
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench_cuda.h"
#include "core/tuning.h"  // the testing hook: kernels forced through the tuning struct
#include "kda/kda.h"
#include "support.h"

namespace {

using namespace kda;
using kda::test::HostTensor;

struct Options {
  std::string csv;
  int iters = 100;
  int warmup = 10;
  std::vector<std::string> filters;  // --filter: any of these substrings (empty: every case)
  bool check = true;
  std::vector<std::string>
      kernels;  // --kernels: also time each case with kernel k forced (docs/tuning.md)
};

struct Case {
  std::string name;
  int64_t B = 1, T = 1;
  DType state_dtype = DType::kFloat32;
  int graph_calls = 0;  // 0: plain calls; n: n calls captured in one CUDA graph
  std::string target;   // the targets.md bar, for the table
  double target_tbps = 0, target_us = 0;
  bool pool2B = false;  // targets.md's graph setup: softplus gate, one set of B slots out of 2B
};

constexpr int64_t kH = 32, kHV = 32, kK = 128, kV = 128;

// Device buffer freed on destruction.
struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DevBuf(size_t n) : bytes(n) { BENCH_CUDA(cudaMalloc(&p, std::max<size_t>(n, 16))); }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
};

std::unique_ptr<DevBuf> upload(const HostTensor& h) {
  auto d = std::make_unique<DevBuf>(h.storage.size());
  BENCH_CUDA(cudaMemcpy(d->p, h.storage.data(), h.storage.size(), cudaMemcpyHostToDevice));
  return d;
}

TensorView dev_view(const HostTensor& h, const DevBuf& d) {
  TensorView t = h.view();
  t.data = d.p;
  t.device = Device::kCUDA;
  return t;
}

// One rotation set: inputs and the [B] indices of its own slots of the shared pool.
struct InputSet {
  HostTensor q, k, v, g, beta, out, idx;
  std::unique_ptr<DevBuf> dq, dk, dv, dg, dbeta, dout, didx;
};

struct Problem {
  Case c;
  int64_t P = 0;  // pool slots
  int sets = 1;
  HostTensor A_log, dt_bias;
  std::unique_ptr<DevBuf> dA_log, ddt_bias, pool;
  std::vector<InputSet> in;
  size_t state_row_bytes = 0;  // one slot: HV x V x K elements

  DecodeParams params(int s, cudaStream_t stream) const {
    const InputSet& x = in[s];
    DecodeParams p;
    p.q = dev_view(x.q, *x.dq);
    p.k = dev_view(x.k, *x.dk);
    p.v = dev_view(x.v, *x.dv);
    p.g = dev_view(x.g, *x.dg);
    p.beta = dev_view(x.beta, *x.dbeta);
    p.out = dev_view(x.out, *x.dout);
    p.A_log = dev_view(A_log, *dA_log);
    p.dt_bias = dev_view(dt_bias, *ddt_bias);
    p.state = make_view(pool->p, c.state_dtype, {P, kHV, kV, kK}, Device::kCUDA);
    p.state_indices = dev_view(x.idx, *x.didx);
    p.math.gate = gate();
    p.math.lower_bound = -5.0f;
    p.math.beta_logits = true;
    p.math.use_qk_l2norm = true;
    p.exec.backend = Backend::kCuda;
    p.exec.stream = stream;
    return p;
  }

  GateForm gate() const { return c.pool2B ? GateForm::kSoftplus : GateForm::kLowerBound; }

  double bytes_per_call() const {
    const double B = static_cast<double>(c.B), T = static_cast<double>(c.T);
    const double state = 2.0 * B * kHV * kK * kV * dtype_size(c.state_dtype);
    const double tok = B * T * (2.0 * kH * kK + kHV * kV + kHV * kK + kHV + kHV * kV) * 2.0;
    return state + tok;
  }
};

Problem make_problem(const Case& c, std::mt19937_64& rng) {
  Problem pr;
  pr.c = c;
  const size_t es = dtype_size(c.state_dtype);
  pr.state_row_bytes = static_cast<size_t>(kHV * kV * kK) * es;
  // Enough disjoint sets that the state touched by one rotation (sets x B slots) is >= 4x L2; or
  // (pool2B) one set of B random slots out of 2B.
  const double touched = static_cast<double>(c.B) * static_cast<double>(pr.state_row_bytes);
  pr.sets = c.pool2B ? 1 : static_cast<int>(std::clamp(std::ceil(240e6 / touched), 1.0, 64.0));
  pr.P = c.pool2B ? 2 * c.B : pr.sets * c.B + 8;  // slots no row uses: B, or 8
  // Pool: a 16 MB random block tiled over the pool.
  pr.pool = std::make_unique<DevBuf>(static_cast<size_t>(pr.P) * pr.state_row_bytes);
  {
    HostTensor block(c.state_dtype, {static_cast<int64_t>((16u << 20) / es)});
    block.fill_normal(rng, 0.1);
    for (size_t off = 0; off < pr.pool->bytes; off += block.storage.size()) {
      const size_t n = std::min(block.storage.size(), pr.pool->bytes - off);
      BENCH_CUDA(cudaMemcpy(static_cast<char*>(pr.pool->p) + off, block.storage.data(), n,
                            cudaMemcpyHostToDevice));
    }
  }
  pr.A_log = HostTensor(DType::kFloat32, {kHV});
  pr.A_log.fill_uniform(rng, 0.0, 1.0);
  pr.dt_bias = HostTensor(DType::kFloat32, {kHV, kK});
  pr.dt_bias.fill_uniform(rng, 0.0, 1.0);
  pr.dA_log = upload(pr.A_log);
  pr.ddt_bias = upload(pr.dt_bias);
  std::vector<int64_t> perm(c.pool2B ? pr.P : pr.sets * c.B);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  pr.in.resize(pr.sets);
  for (int s = 0; s < pr.sets; ++s) {
    InputSet& x = pr.in[s];
    x.q = HostTensor(DType::kBFloat16, {c.B, c.T, kH, kK});
    x.k = HostTensor(DType::kBFloat16, {c.B, c.T, kH, kK});
    x.v = HostTensor(DType::kBFloat16, {c.B, c.T, kHV, kV});
    x.g = HostTensor(DType::kBFloat16, {c.B, c.T, kHV, kK});
    x.beta = HostTensor(DType::kBFloat16, {c.B, c.T, kHV});
    x.out = HostTensor(DType::kBFloat16, {c.B, c.T, kHV, kV});
    for (HostTensor* t : {&x.q, &x.k, &x.v, &x.g, &x.beta}) t->fill_normal(rng, 1.0);
    x.idx = HostTensor(DType::kInt32, {c.B});
    for (int64_t n = 0; n < c.B; ++n) x.idx.set(n, static_cast<double>(perm[s * c.B + n]));
    x.dq = upload(x.q);
    x.dk = upload(x.k);
    x.dv = upload(x.v);
    x.dg = upload(x.g);
    x.dbeta = upload(x.beta);
    x.dout = upload(x.out);
    x.didx = upload(x.idx);
  }
  return pr;
}

// Correctness first: one GPU call on set 0, then the fp64 reference on a sample of sequences
// (their inputs and their slots' initial states, copied from the device before the call).
bool check_case(const Problem& pr, cudaStream_t stream) {
  const Case& c = pr.c;
  const int64_t S = std::min<int64_t>(c.B, 3);
  const InputSet& x = pr.in[0];
  // The pool slots of the sampled sequences, as rows 0..S-1 of a host tensor.
  auto read_slots = [&](HostTensor& dst) {
    for (int64_t n = 0; n < S; ++n) {
      const int64_t slot = static_cast<int64_t>(x.idx.get(n));
      BENCH_CUDA(cudaMemcpy(dst.storage.data() + n * pr.state_row_bytes,
                            static_cast<const char*>(pr.pool->p) + slot * pr.state_row_bytes,
                            pr.state_row_bytes, cudaMemcpyDeviceToHost));
    }
  };
  HostTensor st0(c.state_dtype, {S, kHV, kV, kK});
  read_slots(st0);
  const Status s = decode(pr.params(0, stream));
  if (!s.ok()) {
    std::printf("  %s: decode failed: %s\n", c.name.c_str(), s.to_string().c_str());
    return false;
  }
  BENCH_CUDA(cudaStreamSynchronize(stream));
  HostTensor out_gpu = x.out;
  BENCH_CUDA(cudaMemcpy(out_gpu.storage.data(), x.dout->p, out_gpu.storage.size(),
                        cudaMemcpyDeviceToHost));
  HostTensor st_gpu(c.state_dtype, {S, kHV, kV, kK});
  read_slots(st_gpu);
  // The sample as a host problem: the first S sequences, their states as slots 0..S-1.
  auto first_rows = [&](const HostTensor& t) {
    std::vector<int64_t> shape = t.shape;
    shape[0] = S;
    HostTensor r(t.dtype, shape);
    std::memcpy(r.storage.data(), t.storage.data(), r.storage.size());
    return r;
  };
  HostTensor q = first_rows(x.q), k = first_rows(x.k), v = first_rows(x.v), g = first_rows(x.g),
             beta = first_rows(x.beta), out_ref = first_rows(x.out), out_got = first_rows(out_gpu);
  DecodeParams p;
  p.q = q.view();
  p.k = k.view();
  p.v = v.view();
  p.g = g.view();
  p.beta = beta.view();
  p.out = out_ref.view();
  p.A_log = pr.A_log.view();
  p.dt_bias = pr.dt_bias.view();
  p.state = st0.view();
  p.math.gate = pr.gate();
  p.math.lower_bound = -5.0f;
  p.math.beta_logits = true;
  p.exec.backend = Backend::kCpuReference;
  const Status rs = decode(p);
  if (!rs.ok()) {
    std::printf("  %s: reference failed: %s\n", c.name.c_str(), rs.to_string().c_str());
    return false;
  }
  const double tol_state = kda::test::tolerance_for(c.state_dtype);
  const double tol_out = std::max(kda::test::tolerance_for(DType::kBFloat16), tol_state);
  const auto co = kda::test::compare(out_got, out_ref, tol_out);
  const auto cs = kda::test::compare(st_gpu, st0, tol_state);
  const bool ok = co.ok(tol_out) && cs.ok(tol_state);
  std::printf("  check %-22s out rel_l2 %.2e (tol %.1e)  state rel_l2 %.2e (tol %.1e)  %s\n",
              c.name.c_str(), co.rel_l2, tol_out, cs.rel_l2, tol_state, ok ? "ok" : "FAILED");
  if (!ok) std::printf("    %s%s\n", co.first_mismatches.c_str(), cs.first_mismatches.c_str());
  return ok;
}

struct Result {
  Case c;
  double us_median = 0, us_min = 0, us_host = 0, tbps = 0;
  bool ok = true;
  std::string kernel;  // forced kernel of a --kernels sweep ("" = the library's choice)
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty()
             ? 0
             : (v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]));
}

Result time_case(const Problem& pr, const Options& o, cudaStream_t stream) {
  Result r;
  r.c = pr.c;
  const int iters = std::max(o.iters, 50);
  std::vector<DecodeParams> params;
  for (int s = 0; s < pr.sets; ++s) params.push_back(pr.params(s, stream));
  auto call = [&](int i) {
    const Status s = decode(params[i % pr.sets]);
    if (!s.ok()) {
      std::fprintf(stderr, "decode failed: %s\n", s.to_string().c_str());
      std::exit(2);
    }
  };
  std::vector<cudaEvent_t> ev(2 * iters);
  for (auto& e : ev) BENCH_CUDA(cudaEventCreate(&e));
  std::vector<double> us(iters);

  if (pr.c.graph_calls == 0) {
    for (int i = 0; i < o.warmup; ++i) call(i);
    BENCH_CUDA(cudaStreamSynchronize(stream));
    for (int i = 0; i < iters; ++i) {
      BENCH_CUDA(cudaEventRecord(ev[2 * i], stream));
      call(i);
      BENCH_CUDA(cudaEventRecord(ev[2 * i + 1], stream));
    }
    BENCH_CUDA(cudaStreamSynchronize(stream));
    // Host cost per call: back-to-back calls, wall clock.
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) call(i);
    BENCH_CUDA(cudaStreamSynchronize(stream));
    r.us_host =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
        iters;
  } else {
    // Capture graph_calls calls (rotating sets), replay, divide.
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    BENCH_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < pr.c.graph_calls; ++i) call(i);
    BENCH_CUDA(cudaStreamEndCapture(stream, &graph));
    BENCH_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < o.warmup; ++i) BENCH_CUDA(cudaGraphLaunch(exec, stream));
    BENCH_CUDA(cudaStreamSynchronize(stream));
    for (int i = 0; i < iters; ++i) {
      BENCH_CUDA(cudaEventRecord(ev[2 * i], stream));
      BENCH_CUDA(cudaGraphLaunch(exec, stream));
      BENCH_CUDA(cudaEventRecord(ev[2 * i + 1], stream));
    }
    BENCH_CUDA(cudaStreamSynchronize(stream));
    BENCH_CUDA(cudaGraphExecDestroy(exec));
    BENCH_CUDA(cudaGraphDestroy(graph));
  }
  const double per = pr.c.graph_calls > 0 ? pr.c.graph_calls : 1;
  for (int i = 0; i < iters; ++i) {
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
    us[i] = 1e3 * ms / per;
  }
  for (auto& e : ev) BENCH_CUDA(cudaEventDestroy(e));
  r.us_median = median(us);
  r.us_min = *std::min_element(us.begin(), us.end());
  r.tbps = pr.bytes_per_call() / (r.us_median * 1e-6) / 1e12;
  return r;
}

// "a,b,,c" -> {"a", "b", "c"} (empty items dropped).
std::vector<std::string> split(const std::string& list, char sep) {
  std::vector<std::string> r;
  for (size_t p = 0; p <= list.size();) {
    const size_t q = std::min(list.find(sep, p), list.size());
    if (q > p) r.push_back(list.substr(p, q - p));
    p = q + 1;
  }
  return r;
}

// The tuning struct for a --kernels item, NAME[:rows=R][:cache=C][:pdl=P], as the library would
// read it from the environment with those variables set (the others as in the environment).
// Returns false for an item with an unknown setting.
bool item_tuning(const std::string& item, kda::detail::Tuning* out) {
  const std::vector<std::string> parts = split(item, ':');
  std::map<std::string, std::string> env;
  if (!parts.empty()) env["KDA_CUDA_DECODE_KERNEL"] = parts[0];  // "auto": not a kernel name
  for (size_t i = 1; i < parts.size(); ++i) {
    const size_t eq = parts[i].find('=');
    const std::string key = parts[i].substr(0, eq);
    const std::string value = eq == std::string::npos ? "" : parts[i].substr(eq + 1);
    if (key == "rows")
      env["KDA_CUDA_DECODE_WARP_ROWS"] = value;
    else if (key == "cache")
      env["KDA_CUDA_DECODE_WARP_CACHE"] = value;
    else if (key == "pdl")
      env["KDA_CUDA_PDL"] = value;
    else
      return false;
  }
  *out = kda::detail::parse_tuning([&](const char* name) -> const char* {
    const auto it = env.find(name);
    return it != env.end() ? it->second.c_str() : std::getenv(name);
  });
  return true;
}

// --filter: a case runs if its name contains one of the filters; a filter ending in '$' must end
// the name ("G20_B1$" selects G20_B1, not G20_B1024).
bool selected(const Options& o, const std::string& name) {
  if (o.filters.empty()) return true;
  for (const std::string& f : o.filters) {
    if (!f.empty() && f.back() == '$') {
      const std::string tail = f.substr(0, f.size() - 1);
      if (name.size() >= tail.size() &&
          name.compare(name.size() - tail.size(), tail.size(), tail) == 0)
        return true;
    } else if (name.find(f) != std::string::npos) {
      return true;
    }
  }
  return false;
}

std::string verdict(const Result& r) {
  if (r.c.target_tbps > 0) return r.tbps >= r.c.target_tbps ? "meets" : "below";
  if (r.c.target_us > 0) return r.us_median <= r.c.target_us ? "meets" : "above";
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "missing value for %s\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--csv")
      o.csv = next();
    else if (a == "--iters")
      o.iters = std::atoi(next().c_str());
    else if (a == "--warmup")
      o.warmup = std::atoi(next().c_str());
    else if (a == "--filter")
      o.filters = split(next(), ',');
    else if (a == "--no-check")
      o.check = false;
    else if (a == "--kernels") {
      o.kernels = split(next(), ',');
      for (const std::string& k : o.kernels) {
        kda::detail::Tuning t;
        if (!item_tuning(k, &t)) {
          std::fprintf(stderr, "--kernels: unknown setting in '%s' (rows=, cache=, pdl=)\n",
                       k.c_str());
          return 2;
        }
      }
    } else {
      std::fprintf(stderr,
                   "usage: %s [--csv PATH] [--iters N] [--warmup N] [--filter S1,S2,..] "
                   "[--no-check] [--kernels K1[:rows=R][:cache=C][:pdl=P],..]\n",
                   argv[0]);
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  const auto devs = cuda_devices();
  if (devs.empty() || !devs[0].supported) {
    std::printf("bench_gpu_decode: no sm_90 GPU (%s); nothing to measure\n",
                devs.empty() ? "no CUDA device" : devs[0].name.c_str());
    return 0;
  }
  std::printf("device: %s (%d SMs)\n", devs[0].name.c_str(), devs[0].multiprocessors);
  std::printf(
      "setup: H = HV = %lld, K = V = %lld, bf16 inputs, lower-bound gate (G20_*: softplus), beta "
      "logits, l2norm, pool in place via [B] indices\n",
      static_cast<long long>(kH), static_cast<long long>(kK));

  std::vector<Case> cases = {
      {"T1_B1", 1, 1, DType::kFloat32, 0, "<= 10 us per call", 0, 10},
      {"T1_B32", 32, 1, DType::kFloat32, 0, ">= 3.0 TB/s", 3.0, 0},
      {"T1_B64", 64, 1, DType::kFloat32, 0, "", 0, 0},
      {"T1_B128", 128, 1, DType::kFloat32, 0, "", 0, 0},
      {"T1_B256", 256, 1, DType::kFloat32, 0, ">= 3.6 TB/s", 3.6, 0},
      {"T1_B1024", 1024, 1, DType::kFloat32, 0, ">= 3.6 TB/s", 3.6, 0},
      {"T1_B256_bf16state", 256, 1, DType::kBFloat16, 0, "", 0, 0},
      {"T4_B256", 256, 4, DType::kFloat32, 0, "", 0, 0},
      {"T1_B1_graph1", 1, 1, DType::kFloat32, 1, "<= 5 us in a graph", 0, 5},
      {"T1_B1_graph20", 1, 1, DType::kFloat32, 20, "<= 5 us in a graph", 0, 5},
      {"G20_B1", 1, 1, DType::kFloat32, 20, "<= 3.0 us per call", 0, 3.0, true},
      {"G20_B8", 8, 1, DType::kFloat32, 20, "<= 8.0 us per call", 0, 8.0, true},
      {"G20_B32", 32, 1, DType::kFloat32, 20, ">= 3.8 TB/s", 3.8, 0, true},
      {"G20_B64", 64, 1, DType::kFloat32, 20, "", 0, 0, true},
      {"G20_B128", 128, 1, DType::kFloat32, 20, "", 0, 0, true},
      {"G20_B256", 256, 1, DType::kFloat32, 20, ">= 4.0 TB/s", 4.0, 0, true},
      {"G20_B1024", 1024, 1, DType::kFloat32, 20, ">= 4.0 TB/s", 4.0, 0, true},
  };
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::mt19937_64 rng(2026);
  std::vector<Result> results, sweep;
  bool all_ok = true;
  for (const Case& c : cases) {
    if (!selected(o, c.name)) continue;
    Problem pr = make_problem(c, rng);
    bool ok = true;
    if (o.check) ok = check_case(pr, stream);
    all_ok = all_ok && ok;
    Result r = time_case(pr, o, stream);
    r.ok = ok;
    std::printf("  ran   %-22s %9.2f us (min %.2f)  %.3f TB/s  [%d rotation sets]\n",
                c.name.c_str(), r.us_median, r.us_min, r.tbps, pr.sets);
    results.push_back(r);
    // Kernel sweep: the same case with each forced kernel and setting (where eligible; otherwise
    // the library's default choice runs), checked and timed the same way.
    for (const std::string& k : o.kernels) {
      kda::detail::Tuning t;
      item_tuning(k, &t);  // validated with the arguments
      const kda::detail::ScopedTuning forced(t);
      const bool kok = !o.check || check_case(pr, stream);
      all_ok = all_ok && kok;
      Result kr = time_case(pr, o, stream);
      kr.ok = kok;
      kr.kernel = k;
      std::printf("  ran   %-22s %9.2f us (min %.2f)  %.3f TB/s  [kernel %s]\n", c.name.c_str(),
                  kr.us_median, kr.us_min, kr.tbps, k.c_str());
      sweep.push_back(kr);
    }
  }
  // Ceiling for the state stream: a device-to-device copy of the B = 256 fp32 pool (same bytes
  // read and written as one decode call at B = 256).
  if (selected(o, "copy")) {
    const size_t n = size_t{256} * kHV * kK * kV * sizeof(float);
    void *a = nullptr, *b = nullptr;
    BENCH_CUDA(cudaMalloc(&a, n));
    BENCH_CUDA(cudaMalloc(&b, n));
    BENCH_CUDA(cudaMemsetAsync(a, 0, n, stream));
    cudaEvent_t e0, e1;
    BENCH_CUDA(cudaEventCreate(&e0));
    BENCH_CUDA(cudaEventCreate(&e1));
    std::vector<double> us;
    for (int i = 0; i < 25; ++i) {
      BENCH_CUDA(cudaEventRecord(e0, stream));
      BENCH_CUDA(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, stream));
      BENCH_CUDA(cudaEventRecord(e1, stream));
      BENCH_CUDA(cudaEventSynchronize(e1));
      float ms = 0;
      BENCH_CUDA(cudaEventElapsedTime(&ms, e0, e1));
      if (i >= 5) us.push_back(1e3 * ms);
    }
    const double m = median(us);
    std::printf(
        "  ceiling: D2D copy of the B256 fp32 pool (%.0f MB): %.2f us, %.3f TB/s read + write\n",
        n / 1e6, m, 2.0 * n / (m * 1e-6) / 1e12);
    BENCH_CUDA(cudaEventDestroy(e0));
    BENCH_CUDA(cudaEventDestroy(e1));
    BENCH_CUDA(cudaFree(a));
    BENCH_CUDA(cudaFree(b));
  }
  BENCH_CUDA(cudaStreamDestroy(stream));

  std::printf("\n%-22s %6s %3s %6s %6s %11s %11s %9s %20s %7s %6s\n", "case", "B", "T", "state",
              "graph", "median_us", "host_us", "TB/s", "target", "", "check");
  for (const Result& r : results)
    std::printf("%-22s %6lld %3lld %6s %6d %11.2f %11.2f %9.3f %20s %7s %6s\n", r.c.name.c_str(),
                static_cast<long long>(r.c.B), static_cast<long long>(r.c.T),
                dtype_name(r.c.state_dtype), r.c.graph_calls, r.us_median, r.us_host, r.tbps,
                r.c.target.c_str(), verdict(r).c_str(), r.ok ? "ok" : "FAIL");
  if (!sweep.empty()) {
    std::printf(
        "\nkernel sweep (KDA_CUDA_DECODE_KERNEL, where eligible)\n%-22s %26s %11s %9s %7s %6s\n",
        "case", "kernel", "median_us", "TB/s", "", "check");
    for (const Result& r : sweep)
      std::printf("%-22s %26s %11.2f %9.3f %7s %6s\n", r.c.name.c_str(), r.kernel.c_str(),
                  r.us_median, r.tbps, verdict(r).c_str(), r.ok ? "ok" : "FAIL");
  }
  if (!o.csv.empty()) {
    FILE* f = std::fopen(o.csv.c_str(), "w");
    if (!f) {
      std::fprintf(stderr, "cannot write %s\n", o.csv.c_str());
      return 2;
    }
    std::fprintf(f,
                 "case,B,T,H,HV,K,V,state_dtype,graph_calls,median_us,min_us,host_us,effective_"
                 "TBps,target,verdict,check,kernel\n");
    // The library's choice ("auto"), then the --kernels items.
    for (const std::vector<Result>* rows : {&results, &sweep})
      for (const Result& r : *rows)
        std::fprintf(f, "%s,%lld,%lld,%lld,%lld,%lld,%lld,%s,%d,%.3f,%.3f,%.3f,%.4f,%s,%s,%s,%s\n",
                     r.c.name.c_str(), static_cast<long long>(r.c.B), static_cast<long long>(r.c.T),
                     static_cast<long long>(kH), static_cast<long long>(kHV),
                     static_cast<long long>(kK), static_cast<long long>(kV),
                     dtype_name(r.c.state_dtype), r.c.graph_calls, r.us_median, r.us_min, r.us_host,
                     r.tbps, r.c.target.c_str(), verdict(r).c_str(), r.ok ? "ok" : "FAIL",
                     r.kernel.empty() ? "auto" : r.kernel.c_str());
    std::fclose(f);
    std::printf("wrote %s\n", o.csv.c_str());
  }
  return all_ok ? 0 : 1;
}
