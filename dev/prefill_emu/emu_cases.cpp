// emu_cases.cpp — quick cases of the emulated CUDA prefill against the fp64 reference (see
// engine.h for the build line). Usage: emu_cases [case index]
#include "engine.h"
#include "support.h"
using namespace kda;
using namespace kda::test;
using namespace kda::cuda::pf;
using emu_run::emu_prefill;
static int failures = 0;
static void check(const char* what, const HostTensor& got, const HostTensor& ref, double tol) {
  if (got.empty()) return;
  Compare c = compare(got, ref, tol);
  const bool ok = c.ok(tol);
  if (!ok) ++failures;
  std::printf("  %-6s rel_l2 %.3e max_abs %.3e nonfinite %lld %s%s\n", what, c.rel_l2, c.max_abs,
              (long long)c.nonfinite, ok ? "ok" : "FAIL", ok ? "" : c.first_mismatches.c_str());
}

static void run_case(const PrefillCase& c, int vs, double tol_out, double tol_state) {
  std::printf("%s vs=%d\n", c.name().c_str(), vs);
  PrefillData d = make_prefill(c);
  PrefillData ref = widen(d);
  PrefillParams rp = ref.params();
  rp.exec.backend = Backend::kCpuReference;
  Status s = prefill(rp);
  if (!s.ok()) {
    std::printf("  ref failed: %s\n", s.to_string().c_str());
    ++failures;
    return;
  }
  s = emu_prefill(d.params(), vs, c.dtype == DType::kFloat16);
  if (!s.ok()) {
    std::printf("  emu failed: %s\n", s.to_string().c_str());
    ++failures;
    return;
  }
  check("out", d.out, ref.out, tol_out);
  check("ht", d.ht, ref.ht, tol_state);
  check("pool", d.pool, ref.pool, tol_state);
  check("ckpt", d.ckpt, ref.ckpt, tol_state);
}

int main(int argc, char** argv) {
  const int which = argc > 1 ? std::atoi(argv[1]) : -1;
  std::vector<std::pair<PrefillCase, int>> cases;
  auto base = [] {
    PrefillCase c;
    c.K = 128;
    c.V = 128;
    c.H = 1;
    c.HV = 1;
    c.dtype = DType::kBFloat16;
    c.gate = GateForm::kLowerBound;
    c.seqlens = {100};
    return c;
  };
  {
    auto c = base();
    c.seqlens = {64};
    cases.push_back({c, 0});
  }  // 0 one chunk
  {
    auto c = base();
    c.seqlens = {150};
    cases.push_back({c, 0});
  }  // 1 three chunks
  {
    auto c = base();
    c.seqlens = {150};
    cases.push_back({c, 32});
  }  // 2 vs=32
  {
    auto c = base();
    c.seqlens = {70};
    c.gate = GateForm::kSoftplus;
    cases.push_back({c, 16});
  }  // 3
  {
    auto c = base();
    c.seqlens = {80};
    c.gate = GateForm::kPrecomputed;
    c.gate_extreme = -1000;
    cases.push_back({c, 64});
  }  // 4
  {
    auto c = base();
    c.varlen = true;
    c.seqlens = {0, 1, 15, 65};
    c.H = 1;
    c.HV = 2;
    cases.push_back({c, 0});
  }  // 5
  {
    auto c = base();
    c.seqlens = {70};
    c.layout = StateLayout::kKFirst;
    c.state_dtype = DType::kBFloat16;
    c.strided = true;
    cases.push_back({c, 0});
  }  // 6
  {
    auto c = base();
    c.varlen = true;
    c.seqlens = {130, 64, 3};
    c.pool = true;
    c.checkpoint_every = 64;
    c.dtype = DType::kFloat16;
    c.state_dtype = DType::kFloat16;
    cases.push_back({c, 0});
  }  // 7
  {
    auto c = base();
    c.seqlens = {40};
    c.l2norm = false;
    c.beta_logits = false;
    c.init = InitState::kNone;
    cases.push_back({c, 0});
  }  // 8
  {
    auto c = base();
    c.seqlens = {70};
    c.allow_neg_eigval = true;
    c.gate = GateForm::kPrecomputed;
    c.weak_decay = true;
    cases.push_back({c, 0});
  }  // 9
  {
    auto c = base();
    c.seqlens = {200, 200};
    c.H = 2;
    c.HV = 4;
    c.checkpoint_every = 128;
    cases.push_back({c, 0});
  }  // 10 GVA dense B=2
  {
    auto c = base();
    c.varlen = true;
    c.seqlens.clear();
    for (int i = 0; i < 45; ++i) c.seqlens.push_back((i * 37) % 90);
    cases.push_back({c, 0});
  }  // 11 many seqs
  {
    auto c = base();
    c.seqlens = {1000};
    cases.push_back({c, 0});
  }  // 12 long
  {
    auto c = base();
    c.varlen = true;
    c.seqlens = {63, 64, 65};
    c.final_state = false;
    c.init = InitState::kZero;
    c.gate = GateForm::kSoftplus;
    c.layout = StateLayout::kKFirst;
    cases.push_back({c, 32});
  }  // 13
  for (size_t i = 0; i < cases.size(); ++i) {
    if (which >= 0 && (int)i != which) continue;
    const auto& [c, vs] = cases[i];
    const double to = c.dtype == DType::kFloat16 ? 3e-3 : 4e-3;
    const double ts =
        c.state_dtype == DType::kBFloat16 ? 4e-3 : 3e-3;  // as tests/test_gpu_prefill.cpp
    run_case(c, vs, to, ts);
  }
  std::printf("%d failures\n", failures);
  return failures != 0;
}
