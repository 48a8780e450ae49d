// bench_gpu_backward.cpp — forward + backward of the CUDA prefill on the training shapes of
// targets.md ("Training"): T1 = 1 x 8192 tokens, H = 64 and T2 = 4 x 4096, H = 32; bf16 inputs
// (randn), softplus gate with A_log, dt_bias ~ U(0, 1), beta logits, l2norm, fp32 initial state
// (0.1 randn) and final state, upstream gradients on the output (randn) and the final state.
// Per case: the median of CUDA-event timings (L2 flushed before each call) of kda::prefill and of
// kda::prefill_backward, their sum, and the ratio to FLA's forward + backward in targets.md (the
// bar: at most 1/3). The tensors come from the tests' generator (tests/support.h).
//   usage: bench_gpu_backward [--case T1,T2] [--iters N]
// KDA_CUDA_BACKWARD_SPLIT=0 times the single-tf32 products. Per-kernel times: run it under
// `nsys` or `ncu -k regex:bwd_`.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench_cuda.h"
#include "device_tensor.h"
#include "kda/kda.h"
#include "support.h"

namespace {

using namespace kda;
using kda::test::DeviceTensor;
using kda::test::HostTensor;

struct TrainCase {
  const char* name;
  int64_t B, T, H;
  double fla_ms;  // FLA forward + backward, targets.md
};

// Median ms of `iters` calls of `call` after two warm-up calls, L2 flushed before each; -1 when a
// call fails.
double time_ms(const std::function<Status()>& call, int iters, cudaStream_t stream, void* flush,
               size_t flush_bytes) {
  for (int i = 0; i < 2; ++i)
    if (!call().ok()) return -1;
  return time_events(
             [&] {
               const Status s = call();
               if (!s.ok()) std::fprintf(stderr, "call failed: %s\n", s.to_string().c_str());
               return s.ok();
             },
             iters, stream, flush, flush_bytes)
      .median_ms;
}

}  // namespace

int main(int argc, char** argv) {
  std::string only = "T1,T2";
  int iters = 10;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--case" && i + 1 < argc)
      only = argv[++i];
    else if (a == "--iters" && i + 1 < argc)
      iters = std::max(3, std::atoi(argv[++i]));
    else {
      std::fprintf(stderr, "usage: %s [--case T1,T2] [--iters N>=3]\n", argv[0]);
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    std::printf("bench_gpu_backward: no CUDA device, nothing to do\n");
    return 0;
  }
  const size_t flush_bytes = 256u << 20;
  void* flush = nullptr;
  BENCH_CUDA(cudaMalloc(&flush, flush_bytes));
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const TrainCase cases[] = {{"T1", 1, 8192, 64, 10.82}, {"T2", 4, 4096, 32, 10.77}};
  std::printf("%-4s %-14s %10s %10s %10s %10s %8s\n", "case", "shape", "fwd ms", "bwd ms", "f+b ms",
              "FLA f+b", "ratio");
  int rc = 0;
  for (const TrainCase& c : cases) {
    if (("," + only + ",").find(std::string(",") + c.name + ",") == std::string::npos) continue;
    const int64_t K = 128, B = c.B, T = c.T, H = c.H;
    std::mt19937_64 rng(7);
    auto normal = [&](DType dt, std::vector<int64_t> shape, double sd) {
      HostTensor t(dt, std::move(shape));
      t.fill_normal(rng, sd);
      return t;
    };
    const HostTensor q = normal(DType::kBFloat16, {B, T, H, K}, 1),
                     k = normal(DType::kBFloat16, {B, T, H, K}, 1),
                     v = normal(DType::kBFloat16, {B, T, H, K}, 1),
                     g = normal(DType::kBFloat16, {B, T, H, K}, 1),
                     beta = normal(DType::kBFloat16, {B, T, H}, 1),
                     h0 = normal(DType::kFloat32, {B, H, K, K}, 0.1),
                     d_out = normal(DType::kBFloat16, {B, T, H, K}, 1),
                     d_final = normal(DType::kFloat32, {B, H, K, K}, 0.5);
    HostTensor A_log(DType::kFloat32, {H}), dt_bias(DType::kFloat32, {H, K});
    A_log.fill_uniform(rng, 0, 1);
    dt_bias.fill_uniform(rng, 0, 1);
    const HostTensor out(DType::kBFloat16, {B, T, H, K}), ht(DType::kFloat32, {B, H, K, K}),
        dq = q, dk = k, dv = v, dg = g, dbeta = beta, dA = A_log, ddt = dt_bias, dh0 = h0;
    std::vector<std::unique_ptr<DeviceTensor>> keep;
    auto dev = [&](const HostTensor& h) {
      keep.push_back(std::make_unique<DeviceTensor>(h));
      return keep.back()->view();
    };
    PrefillParams p;
    p.q = dev(q);
    p.k = dev(k);
    p.v = dev(v);
    p.g = dev(g);
    p.beta = dev(beta);
    p.A_log = dev(A_log);
    p.dt_bias = dev(dt_bias);
    p.initial_state = dev(h0);
    p.math.gate = GateForm::kSoftplus;
    p.math.beta_logits = true;
    p.math.use_qk_l2norm = true;
    p.exec.backend = Backend::kCuda;
    p.exec.stream = stream;
    PrefillBackwardParams b;
    b.forward = p;
    b.d_out = dev(d_out);
    b.d_final_state = dev(d_final);
    b.dq = dev(dq);
    b.dk = dev(dk);
    b.dv = dev(dv);
    b.dg = dev(dg);
    b.dbeta = dev(dbeta);
    b.dA_log = dev(dA);
    b.ddt_bias = dev(ddt);
    b.d_initial_state = dev(dh0);
    p.out = dev(out);
    p.final_state = dev(ht);
    size_t fb = 0, bb = 0;
    if (!prefill_workspace_size(p, &fb).ok() || !prefill_backward_workspace_size(b, &bb).ok()) {
      std::fprintf(stderr, "%s: workspace size query failed\n", c.name);
      return 2;
    }
    void *fws = nullptr, *bws = nullptr;
    BENCH_CUDA(cudaMalloc(&fws, std::max<size_t>(fb, 1)));
    BENCH_CUDA(cudaMalloc(&bws, std::max<size_t>(bb, 1)));
    p.exec.workspace = fws;
    p.exec.workspace_bytes = fb;
    b.exec = p.exec;
    b.exec.workspace = bws;
    b.exec.workspace_bytes = bb;
    const double f = time_ms([&] { return prefill(p); }, iters, stream, flush, flush_bytes);
    const double w =
        time_ms([&] { return prefill_backward(b); }, iters, stream, flush, flush_bytes);
    if (f < 0 || w < 0) rc = 1;
    std::printf(
        "%-4s %-14s %10.3f %10.3f %10.3f %10.2f %7.2fx\n", c.name,
        (std::to_string(B) + " x " + std::to_string(T) + ", H=" + std::to_string(H)).c_str(), f, w,
        f + w, c.fla_ms, (f + w) / c.fla_ms);
    std::fflush(stdout);
    cudaFree(fws);
    cudaFree(bws);
  }
  cudaStreamDestroy(stream);
  cudaFree(flush);
  return rc;
}
