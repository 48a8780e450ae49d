// test_gpu_backward.cpp — the CUDA prefill backward (src/cuda/backward/) against the fp64
// reference backward.
//
// Every test starts with KDA_SKIP_WITHOUT_SM90(). The reference is kda::prefill_backward with
// Backend::kCpuReference on widen(data) and the upstream gradients widened to fp32. Each
// gradient's tolerance (relative L2 over the whole tensor) is derived from where the CUDA
// backward rounds: the storage rounding of the reference itself to the gradient's dtype (measured
// per tensor: ~1.7e-3 for bf16, ~2e-4 for fp16, 0 for fp32), plus 2.5e-3 for the kernels' own
// arithmetic. Every product is 3xTF32 (an fp32-accurate split, kernels.cuh) or, on wgmma
// (passes_wg.cuh), bf16 hi + lo on both sides, which measure 1e-7..4e-5 in emulation on
// l2-normalized inputs; the allowance covers the ill-conditioned case (no l2norm, |k|^2 ~ 128:
// 1.2e-3 on d_initial_state, 1.5e-3 above storage on dbeta) and a plain tf32 product (up to
// 3.5e-3 on dA_log / ddt_bias would fail it: they sum dG with cancellation).
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
  Grads r =
      make_grads(d, DType::kFloat32, DType::kFloat32, DType::kFloat32, DType::kFloat32, false, 0);
  r.d_out = up.d_out.empty() ? HostTensor{} : up.d_out.to(DType::kFloat32);
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
  HostTensor* outs[] = {&g->dq,    &g->dk,     &g->dv,       &g->dg,
                        &g->dbeta, &g->dA_log, &g->ddt_bias, &g->dh0};
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
  s = graph ? capture_and_replay(stream, [&] { return prefill_backward(b); }) : prefill_backward(b);
  KDA_TEST_CUDA(cudaStreamSynchronize(stream));
  KDA_TEST_CUDA(cudaGetLastError());
  for (int i = 0; i < 8; ++i) douts[i]->download(*outs[i]);
  return s;
}

// The kernels' allowance on top of the storage rounding (header).
constexpr double kKernelAllowance = 2.5e-3;

void expect_grads(const Grads& got, const Grads& ref, const std::string& what, bool in_kernel_gate,
                  double allowance = kKernelAllowance) {
  struct Item {
    const char* name;
    const HostTensor *g, *r;
  } items[] = {{"dq", &got.dq, &ref.dq},
               {"dk", &got.dk, &ref.dk},
               {"dv", &got.dv, &ref.dv},
               {"dg", &got.dg, &ref.dg},
               {"dbeta", &got.dbeta, &ref.dbeta},
               {"dA_log", &got.dA_log, &ref.dA_log},
               {"ddt_bias", &got.ddt_bias, &ref.ddt_bias},
               {"d_initial_state", &got.dh0, &ref.dh0}};
  for (const Item& it : items) {
    if (it.g->empty()) continue;
    const bool zero =
        !in_kernel_gate && (std::string(it.name) == "dA_log" || std::string(it.name) == "ddt_bias");
    if (zero) {
      for (int64_t i = 0; i < it.g->numel(); ++i)
        ASSERT_EQ(it.g->get(i), 0.0) << what << " " << it.name << "[" << i << "]";
      continue;
    }
    const double floor = compare(it.r->to(it.g->dtype), *it.r, 1.0).rel_l2;
    const double tol = floor + allowance;
    const Compare c = compare(*it.g, *it.r, tol);
    EXPECT_TRUE(c.ok(tol)) << what << " " << it.name << ": rel_l2 " << c.rel_l2 << " (tol " << tol
                           << "), nonfinite " << c.nonfinite << ", " << c.first_mismatches;
    std::printf("[ %s ] %-16s rel_l2 %.3e (storage rounding %.3e)\n", what.c_str(), it.name,
                c.rel_l2, floor);
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

void check_case(const PrefillCase& c, bool d_final = true, double allowance = kKernelAllowance) {
  const PrefillData d = make_prefill(c);
  const DType gdt = d.g.dtype, bdt = d.beta.dtype;
  const DType sdt = d.h0.empty() ? DType::kFloat32 : d.h0.dtype;
  Grads g = make_grads(d, c.dtype, gdt, bdt, sdt, d_final, c.seed + 17);
  const Grads ref = reference_grads(d, g);
  const Status s = cuda_grads(d, &g);
  ASSERT_TRUE(s.ok()) << s.to_string();
  expect_grads(g, ref, c.name(), c.gate != GateForm::kPrecomputed, allowance);
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

// Five chunks per sequence through both state passes, GVA of 2, two q/k heads.
TEST(GpuBackward, LongerSequencesGva) {
  KDA_SKIP_WITHOUT_SM90();
  PrefillCase c = base_case();
  c.seqlens = {300};
  c.H = 2;
  c.HV = 4;
  c.gate = GateForm::kLowerBound;
  c.lower_bound = -2.0;
  check_case(c);
}

// Weak decay (precomputed gates near 0: long memory), only d_final_state upstream.
TEST(GpuBackward, WeakDecayFinalStateOnly) {
  KDA_SKIP_WITHOUT_SM90();
  PrefillCase c = base_case();
  c.gate = GateForm::kPrecomputed;
  c.weak_decay = true;
  c.seqlens = {200};
  const PrefillData d = make_prefill(c);
  Grads g = make_grads(d, c.dtype, d.g.dtype, d.beta.dtype, DType::kFloat32, true, 9);
  g.d_out = HostTensor{};
  const Grads ref = reference_grads(d, g);
  ASSERT_TRUE(cuda_grads(d, &g).ok());
  expect_grads(g, ref, c.name(), false);
}

// The mma.sync state passes and chunk products (KDA_CUDA_BACKWARD_WG_PASSES=0,
// KDA_CUDA_BACKWARD_WGMMA=0), on a varlen, grouped case with an upstream final-state gradient:
// the same tolerances as the wgmma kernels.
TEST(GpuBackward, MmaSyncPassesAndProducts) {
  KDA_SKIP_WITHOUT_SM90();
  const detail::ScopedTuning scope(tuned([](detail::Tuning& t) {
    t.backward_wgmma = false;
    t.backward_wg_passes = false;
  }));
  PrefillCase c = base_case();
  c.gate = GateForm::kLowerBound;
  c.H = 1;
  c.HV = 2;
  c.seqlens = {70, 0, 130};
  c.varlen = true;
  check_case(c);
}

// The state passes on wgmma (the default; set here so that the case keeps them): a varlen,
// grouped case with several chunks per sequence.
TEST(GpuBackward, WgmmaPasses) {
  KDA_SKIP_WITHOUT_SM90();
  const detail::ScopedTuning scope(tuned([](detail::Tuning& t) { t.backward_wg_passes = true; }));
  PrefillCase c = base_case();
  c.H = 1;
  c.HV = 2;
  c.seqlens = {330, 1, 64};  // six steps: both buffers of the passes reused
  c.varlen = true;
  check_case(c);
}

// Single tf32 products (KDA_CUDA_BACKWARD_SPLIT=0): the same gradients within the error of one
// tf32 rounding per operand, summed with cancellation into dA_log / ddt_bias (measured up to
// 3.5e-3 in emulation): an allowance of 8e-3.
TEST(GpuBackward, SingleTf32Products) {
  KDA_SKIP_WITHOUT_SM90();
  const detail::ScopedTuning scope(tuned([](detail::Tuning& t) { t.backward_split = false; }));
  PrefillCase c = base_case();
  c.H = 2;
  c.HV = 2;
  c.seqlens = {50};
  c.state_dtype = DType::kBFloat16;
  check_case(c, true, 8e-3);
}

// Only empty sequences: d_initial_state is d_final_state, the parameter gradients are zero.
TEST(GpuBackward, EmptySequences) {
  KDA_SKIP_WITHOUT_SM90();
  PrefillCase c = base_case();
  c.varlen = true;
  c.seqlens = {0, 0, 0};
  check_case(c);
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
  for (auto [x, y] : {std::pair{&a.dq, &b.dq},
                      {&a.dk, &b.dk},
                      {&a.dv, &b.dv},
                      {&a.dg, &b.dg},
                      {&a.dbeta, &b.dbeta},
                      {&a.dA_log, &b.dA_log},
                      {&a.ddt_bias, &b.ddt_bias},
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
