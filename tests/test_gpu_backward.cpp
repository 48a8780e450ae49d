// test_gpu_backward.cpp — the CUDA prefill backward (src/cuda/backward/) against the fp64
// reference backward.
//
// Every test starts with KDA_SKIP_WITHOUT_SM90(). The reference is kda::prefill_backward with
// Backend::kCpuReference on widen(data) and the upstream gradients widened to fp32. Tolerances
// (relative L2 over the whole tensor) come from where the CUDA backward rounds:
//   * every product runs on tf32 operands (11 significant bits, relative rounding <= 2^-11 =
//     4.9e-4 per operand) with fp32 accumulation: ~1e-3 on a gradient that is a sum of products;
//   * bf16 gradients add their own storage rounding (~1.7e-3 relative L2, tolerance_for(bf16));
//   * dg and dbeta are differences of such sums (the reverse cumulative sum of dG and the gate
//     chain; dbeta sums four terms of both signs), which loses up to ~3x relative accuracy;
// so dq, dk, dv, d_initial_state, dA_log, ddt_bias: 4e-3; dg, dbeta: 8e-3 (each also reported).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gpu_support.h"
#include "support.h"

namespace kda::test {
namespace {

// Gradient tensors of a backward call (in the forward's layouts) and the upstream gradients.
struct Grads {
  HostTensor d_out, d_final, dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0;
};

// Upstream gradients (random) and poisoned gradient outputs of `d`'s shapes; `dtype` for the
// token gradients of q, k, v, `gdt` / `bdt` those of g and beta, `sdt` the state gradients.
Grads make_grads(const PrefillData& d, DType dtype, DType gdt, DType bdt, DType sdt, bool d_final,
                 uint64_t seed) {
  Grads g;
  std::mt19937_64 rng(seed);
  g.d_out = HostTensor(dtype, d.out.shape);
  g.d_out.fill_normal(rng, 1.0);
  if (d_final && !d.ht.empty()) {
    g.d_final = HostTensor(sdt, d.ht.shape);
    g.d_final.fill_normal(rng, 0.5);
  }
  g.dq = HostTensor(dtype, d.q.shape);
  g.dk = HostTensor(dtype, d.k.shape);
  g.dv = HostTensor(dtype, d.v.shape);
  g.dg = HostTensor(gdt, d.g.shape);
  g.dbeta = HostTensor(bdt, d.beta.shape);
  const int64_t HV = d.v.shape[d.v.shape.size() - 2], K = d.q.shape.back();
  g.dA_log = HostTensor(DType::kFloat32, {HV});
  g.ddt_bias = HostTensor(DType::kFloat32, {HV, K});
  if (!d.ht.empty()) g.dh0 = HostTensor(d.h0.empty() ? sdt : d.h0.dtype, d.ht.shape);
  for (HostTensor* t : {&g.dq, &g.dk, &g.dv, &g.dg, &g.dbeta, &g.dA_log, &g.ddt_bias, &g.dh0})
    if (!t->empty()) t->fill_bytes(0xff);
  return g;
}

PrefillBackwardParams backward_params(const PrefillParams& fwd, const Grads& g) {
  PrefillBackwardParams b;
  b.forward = fwd;
  b.forward.out = TensorView{};
  b.forward.final_state = TensorView{};
  b.d_out = g.d_out.view();
  b.d_final_state = g.d_final.view();
  b.dq = g.dq.view();
  b.dk = g.dk.view();
  b.dv = g.dv.view();
  b.dg = g.dg.view();
  b.dbeta = g.dbeta.view();
  b.dA_log = g.dA_log.view();
  b.ddt_bias = g.ddt_bias.view();
  b.d_initial_state = g.dh0.view();
  return b;
}

// The fp64 reference gradients of `d` with upstream gradients `up`.
Grads reference_grads(const PrefillData& d, const Grads& up) {
  const PrefillData w = widen(d);
  Grads r = make_grads(d, DType::kFloat32, DType::kFloat32, DType::kFloat32, DType::kFloat32,
                       false, 0);
  r.d_out = up.d_out.to(DType::kFloat32);
  if (!up.d_final.empty()) r.d_final = up.d_final.to(DType::kFloat32);
  if (!r.dh0.empty() && !w.h0.empty()) r.dh0 = HostTensor(w.h0.dtype, w.h0.shape);
  PrefillBackwardParams b = backward_params(w.params(), r);
  b.exec.backend = Backend::kCpuReference;
  const Status s = prefill_backward(b);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return r;
}

// The CUDA gradients of `d` with upstream gradients `g` (outputs downloaded into g).
Status cuda_grads(const PrefillData& d, Grads* g, cudaStream_t stream = nullptr,
                  bool graph = false) {
  DeviceData dd(d);
  std::vector<std::unique_ptr<DeviceTensor>> keep;
  auto dev = [&](const HostTensor& h) -> DeviceTensor* {
    keep.push_back(std::make_unique<DeviceTensor>(h));
    return keep.back().get();
  };
  PrefillBackwardParams b;
  b.forward = dd.p;
  b.forward.out = TensorView{};
  b.forward.final_state = TensorView{};
  b.forward.state_pool = b.forward.state_indices = TensorView{};
  b.forward.checkpoints = b.forward.checkpoint_offsets = TensorView{};
  b.forward.checkpoint_every = 0;
  b.d_out = dev(g->d_out)->view();
  b.d_final_state = dev(g->d_final)->view();
  HostTensor* outs[] = {&g->dq, &g->dk, &g->dv, &g->dg, &g->dbeta, &g->dA_log, &g->ddt_bias,
                        &g->dh0};
  DeviceTensor* douts[8];
  for (int i = 0; i < 8; ++i) douts[i] = dev(*outs[i]);
  b.dq = douts[0]->view();
  b.dk = douts[1]->view();
  b.dv = douts[2]->view();
  b.dg = douts[3]->view();
  b.dbeta = douts[4]->view();
  b.dA_log = douts[5]->view();
  b.ddt_bias = douts[6]->view();
  b.d_initial_state = douts[7]->view();
  b.exec.backend = Backend::kCuda;
  b.exec.stream = stream;
  size_t bytes = 0;
  Status s = prefill_backward_workspace_size(b, &bytes);
  if (!s.ok()) return s;
  DeviceBuffer ws(bytes);
  b.exec.workspace = ws.ptr;
  b.exec.workspace_bytes = bytes;
  s = graph ? capture_and_replay(stream, [&] { return prefill_backward(b); })
            : prefill_backward(b);
  KDA_TEST_CUDA(cudaStreamSynchronize(stream));
  KDA_TEST_CUDA(cudaGetLastError());
  for (int i = 0; i < 8; ++i) douts[i]->download(*outs[i]);
  return s;
}

struct Tol {
  double main = 4e-3, chain = 8e-3;
};

void expect_grads(const Grads& got, const Grads& ref, const Tol& tol, const std::string& what,
                  bool in_kernel_gate) {
  struct Item {
    const char* name;
    const HostTensor *g, *r;
    double tol;
  } items[] = {{"dq", &got.dq, &ref.dq, tol.main},
               {"dk", &got.dk, &ref.dk, tol.main},
               {"dv", &got.dv, &ref.dv, tol.main},
               {"dg", &got.dg, &ref.dg, tol.chain},
               {"dbeta", &got.dbeta, &ref.dbeta, tol.chain},
               {"dA_log", &got.dA_log, &ref.dA_log, tol.main},
               {"ddt_bias", &got.ddt_bias, &ref.ddt_bias, tol.main},
               {"d_initial_state", &got.dh0, &ref.dh0, tol.main}};
  for (const Item& it : items) {
    if (it.g->empty()) continue;
    const bool zero = !in_kernel_gate && (std::string(it.name) == "dA_log" ||
                                          std::string(it.name) == "ddt_bias");
    if (zero) {
      for (int64_t i = 0; i < it.g->numel(); ++i)
        ASSERT_EQ(it.g->get(i), 0.0) << what << " " << it.name << "[" << i << "]";
      continue;
    }
    const Compare c = compare(*it.g, *it.r, it.tol);
    EXPECT_TRUE(c.ok(it.tol)) << what << " " << it.name << ": rel_l2 " << c.rel_l2 << " (tol "
                              << it.tol << "), nonfinite " << c.nonfinite << ", "
                              << c.first_mismatches;
    std::printf("[ %s ] %-16s rel_l2 %.3e\n", what.c_str(), it.name, c.rel_l2);
  }
}

PrefillCase base_case() {
  PrefillCase c;
  c.seqlens = {100};
  c.H = 1;
  c.HV = 1;
  c.K = c.V = 128;
  c.dtype = DType::kBFloat16;
  c.gate = GateForm::kSoftplus;
  c.final_state = true;
  c.init = InitState::kRandom;
  return c;
}

void check_case(const PrefillCase& c, bool d_final = true, const Tol& tol = Tol{}) {
  const PrefillData d = make_prefill(c);
  const DType gdt = d.g.dtype, bdt = d.beta.dtype;
  const DType sdt = d.h0.empty() ? DType::kFloat32 : d.h0.dtype;
  Grads g = make_grads(d, c.dtype, gdt, bdt, sdt, d_final, c.seed + 17);
  const Grads ref = reference_grads(d, g);
  const Status s = cuda_grads(d, &g);
  ASSERT_TRUE(s.ok()) << s.to_string();
  expect_grads(g, ref, tol, c.name(), c.gate != GateForm::kPrecomputed);
}

TEST(GpuBackward, SoftplusOneChunkTail) {
  KDA_SKIP_WITHOUT_SM90();
  PrefillCase c = base_case();
  c.seqlens = {37};
  check_case(c);
}

TEST(GpuBackward, SoftplusTwoChunks) {
  KDA_SKIP_WITHOUT_SM90();
  check_case(base_case());
}

TEST(GpuBackward, LowerBoundGvaLogits) {
  KDA_SKIP_WITHOUT_SM90();
  PrefillCase c = base_case();
  c.gate = GateForm::kLowerBound;
  c.H = 1;
  c.HV = 2;
  c.seqlens = {70};
  c.allow_neg_eigval = true;
  check_case(c);
}

TEST(GpuBackward, PrecomputedExtremeGatesNoL2Norm) {
  KDA_SKIP_WITHOUT_SM90();
  PrefillCase c = base_case();
  c.gate = GateForm::kPrecomputed;
  c.gate_extreme = -1000.0;
  c.l2norm = false;
  c.beta_logits = false;
  c.init = InitState::kNone;
  c.seqlens = {80};
  check_case(c);
}

TEST(GpuBackward, VarlenKFirstFp16) {
  KDA_SKIP_WITHOUT_SM90();
  PrefillCase c = base_case();
  c.varlen = true;
  c.seqlens = {0, 65, 3, 64};
  c.dtype = DType::kFloat16;
  c.layout = StateLayout::kKFirst;
  c.strided = true;
  check_case(c);
}

TEST(GpuBackward, DenseBatchNoUpstreamState) {
  KDA_SKIP_WITHOUT_SM90();
  PrefillCase c = base_case();
  c.seqlens = {50};
  c.varlen = false;
  c.HV = 2;
  c.H = 2;
  c.gate_beta_fp32 = true;
  c.state_dtype = DType::kBFloat16;
  check_case(c, /*d_final=*/false);
}

// Captured into a CUDA graph and replayed: the same gradients as the direct call.
TEST(GpuBackward, GraphCaptureMatchesDirect) {
  KDA_SKIP_WITHOUT_SM90();
  PrefillCase c = base_case();
  c.seqlens = {90};
  const PrefillData d = make_prefill(c);
  Grads a = make_grads(d, c.dtype, d.g.dtype, d.beta.dtype, DType::kFloat32, true, 5);
  Grads b = a;
  cudaStream_t stream;
  KDA_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ASSERT_TRUE(cuda_grads(d, &a, stream, false).ok());
  ASSERT_TRUE(cuda_grads(d, &b, stream, true).ok());
  KDA_TEST_CUDA(cudaStreamDestroy(stream));
  for (auto [x, y] : {std::pair{&a.dq, &b.dq}, {&a.dk, &b.dk}, {&a.dv, &b.dv}, {&a.dg, &b.dg},
                      {&a.dbeta, &b.dbeta}, {&a.dA_log, &b.dA_log}, {&a.ddt_bias, &b.ddt_bias},
                      {&a.dh0, &b.dh0}})
    EXPECT_TRUE(bitwise_equal(*x, *y));
}

// A workspace smaller than the query is refused naming it, and nothing is written.
TEST(GpuBackward, SmallWorkspaceRefused) {
  KDA_SKIP_WITHOUT_SM90();
  PrefillCase c = base_case();
  c.seqlens = {20};
  const PrefillData d = make_prefill(c);
  DeviceData dd(d);
  PrefillBackwardParams b;
  b.forward = dd.p;
  b.forward.out = b.forward.final_state = TensorView{};
  b.forward.state_pool = b.forward.state_indices = TensorView{};
  b.forward.checkpoints = b.forward.checkpoint_offsets = TensorView{};
  HostTensor dv(c.dtype, d.v.shape);
  dv.fill_bytes(0x5a);
  DeviceTensor ddv(dv);
  b.dv = ddv.view();
  size_t bytes = 0;
  ASSERT_TRUE(prefill_backward_workspace_size(b, &bytes).ok());
  ASSERT_GT(bytes, 0u);
  DeviceBuffer ws(bytes);
  b.exec.workspace = ws.ptr;
  b.exec.workspace_bytes = bytes - 1;
  const Status s = prefill_backward(b);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.to_string().find("workspace"), std::string::npos) << s.to_string();
  HostTensor back = dv;
  ddv.download(back);
  EXPECT_TRUE(bitwise_equal(back, dv));
}

}  // namespace
}  // namespace kda::test
