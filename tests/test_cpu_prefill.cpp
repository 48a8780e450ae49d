// test_cpu_prefill.cpp — the fast CPU prefill against the fp64 reference over the feature matrix,
// plus accuracy-bar, determinism, pool and prefill/decode consistency checks.
#include <gtest/gtest.h>

#include <cstring>

#include "support.h"

namespace kda::test {
namespace {

// Runs the backend on `d` (in place) and the reference on widen(d); returns the reference data.
PrefillData run_both(PrefillData& d, Backend backend = Backend::kCpu) {
  PrefillData ref = widen(d);
  PrefillParams p = d.params();
  p.exec.backend = backend;
  Status s = prefill(p);
  EXPECT_TRUE(s.ok()) << s.to_string();
  PrefillParams pr = ref.params();
  pr.exec.backend = Backend::kCpuReference;
  s = prefill(pr);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return ref;
}

void expect_close(const char* what, const HostTensor& got, const HostTensor& ref, double tol) {
  if (got.empty()) return;
  const Compare c = compare(got, ref, tol);
  EXPECT_EQ(c.nonfinite, 0) << what << ":" << c.first_mismatches;
  EXPECT_LE(c.rel_l2, tol) << what << " rel_l2 " << c.rel_l2 << ":" << c.first_mismatches;
}

class PrefillSweep : public ::testing::TestWithParam<PrefillCase> {};

TEST_P(PrefillSweep, FastMatchesReference) {
  PrefillData d = make_prefill(GetParam());
  const HostTensor pool_before = d.pool;
  PrefillData ref = run_both(d);
  expect_close("out", d.out, ref.out, tolerance_for(d.out.dtype));
  expect_close("final_state", d.ht, ref.ht, tolerance_for(d.c.state_dtype));
  expect_close("checkpoints", d.ckpt, ref.ckpt, tolerance_for(d.c.state_dtype));
  if (!d.pool.empty()) {
    expect_close("state_pool", d.pool, ref.pool, tolerance_for(d.c.state_dtype));
    // Slots no sequence maps to, and the sequence with slot -1, leave the pool bit-identical.
    std::vector<bool> used(d.pool.shape[0], false);
    for (int64_t n = 0; n < d.N; ++n) {
      const int64_t s = static_cast<int64_t>(d.idx.get(n));
      if (s >= 0) used[s] = true;
    }
    const int64_t per_slot = d.pool.numel() / d.pool.shape[0];
    for (int64_t s = 0; s < d.pool.shape[0]; ++s) {
      if (used[s]) continue;
      for (int64_t i = s * per_slot; i < (s + 1) * per_slot; ++i)
        ASSERT_EQ(d.pool.get(i), pool_before.get(i)) << "unused slot " << s << " changed";
    }
  }
}

std::vector<PrefillCase> sweep_cases() {
  std::vector<PrefillCase> cs;
  auto add = [&](auto mutate) {
    PrefillCase c;
    mutate(c);
    cs.push_back(c);
  };
  // Lengths around the chunk (64) and sub-chunk (16) sizes, dense and varlen.
  for (int64_t T : {1, 15, 16, 17, 63, 64, 65, 200})
    add([&](PrefillCase& c) { c.seqlens = {T, T}; });
  add([](PrefillCase& c) {
    c.varlen = true;
    c.seqlens = {0, 1, 130, 0, 64, 7, 300};
  });
  add([](PrefillCase& c) {
    c.varlen = true;
    c.seqlens = {2500, 3};
    c.H = 1;
    c.HV = 1;
  });  // long
  add([](PrefillCase& c) {
    c.varlen = true;
    c.seqlens = {0};
  });
  // Heads: H = 1, GVA.
  add([](PrefillCase& c) {
    c.H = 1;
    c.HV = 1;
    c.seqlens = {70};
  });
  add([](PrefillCase& c) {
    c.H = 2;
    c.HV = 6;
    c.seqlens = {90, 90};
  });
  // Gate and beta forms.
  for (GateForm g : {GateForm::kPrecomputed, GateForm::kSoftplus, GateForm::kLowerBound})
    for (bool b : {false, true})
      add([&](PrefillCase& c) {
        c.gate = g;
        c.beta_logits = b;
        c.seqlens = {150};
      });
  add([](PrefillCase& c) {
    c.allow_neg_eigval = true;
    c.seqlens = {150};
  });
  add([](PrefillCase& c) {
    c.gate = GateForm::kPrecomputed;
    c.gate_extreme = -1000;
    c.seqlens = {300};
  });
  add([](PrefillCase& c) {
    c.gate = GateForm::kPrecomputed;
    c.weak_decay = true;
    c.seqlens = {300};
  });
  add([](PrefillCase& c) {
    c.gate = GateForm::kLowerBound;
    c.lower_bound = -0.05;
    c.seqlens = {300};
  });
  add([](PrefillCase& c) {
    c.l2norm = false;
    c.seqlens = {100};
  });
  // States.
  add([](PrefillCase& c) { c.init = InitState::kNone; });
  add([](PrefillCase& c) { c.init = InitState::kZero; });
  add([](PrefillCase& c) { c.final_state = false; });
  add([](PrefillCase& c) {
    c.layout = StateLayout::kKFirst;
    c.seqlens = {100, 3};
  });
  add([](PrefillCase& c) { c.state_dtype = DType::kBFloat16; });
  add([](PrefillCase& c) {
    c.state_dtype = DType::kFloat16;
    c.layout = StateLayout::kKFirst;
  });
  add([](PrefillCase& c) {
    c.pool = true;
    c.varlen = true;
    c.seqlens = {50, 0, 129, 64};
  });
  add([](PrefillCase& c) {
    c.pool = true;
    c.seqlens = {70, 70, 70};
    c.state_dtype = DType::kBFloat16;
  });
  add([](PrefillCase& c) {
    c.checkpoint_every = 64;
    c.varlen = true;
    c.seqlens = {200, 64, 10, 129};
  });
  add([](PrefillCase& c) {
    c.checkpoint_every = 128;
    c.seqlens = {300, 300};
    c.layout = StateLayout::kKFirst;
  });
  // Input dtypes, strides, other head dims.
  add([](PrefillCase& c) {
    c.dtype = DType::kBFloat16;
    c.seqlens = {200};
  });
  add([](PrefillCase& c) {
    c.dtype = DType::kFloat16;
    c.seqlens = {200};
  });
  add([](PrefillCase& c) {
    c.strided = true;
    c.varlen = true;
    c.seqlens = {33, 100};
  });
  add([](PrefillCase& c) {
    c.strided = true;
    c.dtype = DType::kBFloat16;
    c.seqlens = {80, 80};
  });
  add([](PrefillCase& c) {
    c.K = 128;
    c.V = 128;
    c.seqlens = {130};
    c.H = 1;
    c.HV = 2;
  });
  add([](PrefillCase& c) {
    c.K = 20;
    c.V = 12;
    c.seqlens = {70};
  });  // not multiples of 8
  add([](PrefillCase& c) {
    c.K = 64;
    c.V = 256;
    c.seqlens = {65};
    c.H = 1;
    c.HV = 1;
  });
  return cs;
}

INSTANTIATE_TEST_SUITE_P(Cpu, PrefillSweep, ::testing::ValuesIn(sweep_cases()),
                         [](const auto& info) { return test_name(info.param.name()); });

TEST(PrefillSmoke, ReferenceBackendMatchesItselfWidened) {
  // The reference on bf16 storage equals the reference on the fp32 widening up to output rounding.
  PrefillCase c;
  c.dtype = DType::kBFloat16;
  c.seqlens = {40};
  PrefillData d = make_prefill(c);
  PrefillData ref = run_both(d, Backend::kCpuReference);
  expect_close("out", d.out, ref.out, tolerance_for(DType::kBFloat16));
}

// The accuracy bar of targets.md on a case-A-shaped problem (shorter, fewer heads for CPU time).
TEST(PrefillAccuracy, BarOnCaseAShape) {
  for (GateForm gate : {GateForm::kLowerBound, GateForm::kSoftplus}) {
    PrefillCase c;
    c.seqlens = {2048};
    c.H = c.HV = 2;
    c.K = c.V = 128;
    c.dtype = DType::kBFloat16;
    c.gate = gate;
    c.init = InitState::kRandom;
    PrefillData d = make_prefill(c);
    for (int64_t i = 0; i < d.h0.numel(); ++i) d.h0.set(i, d.h0.get(i) * 0.5);  // 0.05 randn
    PrefillData ref = run_both(d);
    const Compare co = compare(d.out, ref.out, 4.5e-3), cs = compare(d.ht, ref.ht, 3.5e-3);
    EXPECT_TRUE(co.ok(4.5e-3)) << "gate " << static_cast<int>(gate) << " out " << co.rel_l2;
    EXPECT_TRUE(cs.ok(3.5e-3)) << "gate " << static_cast<int>(gate) << " state " << cs.rel_l2;
  }
}

TEST(PrefillAccuracy, ErrorDoesNotGrowWithLength) {
  double err[2];
  int i = 0;
  for (int64_t T : {256, 4096}) {
    PrefillCase c;
    c.seqlens = {T};
    c.H = c.HV = 1;
    c.gate = GateForm::kLowerBound;
    c.lower_bound = -0.05;  // weak decay: the state remembers the whole sequence
    PrefillData d = make_prefill(c);
    PrefillData ref = run_both(d);
    err[i++] = compare(d.out, ref.out, 1).rel_l2;
  }
  EXPECT_LE(err[1], std::max(4 * err[0], 2e-5)) << err[0] << " -> " << err[1];
}

TEST(PrefillSmoke, ExtremeDecaysStayFinite) {
  PrefillCase c;
  c.gate = GateForm::kPrecomputed;
  c.gate_extreme = -1000;
  c.seqlens = {200};
  c.dtype = DType::kBFloat16;
  PrefillData d = make_prefill(c);
  for (int64_t i = 0; i < d.g.numel(); i += 3) d.g.set(i, -1000);
  PrefillData ref = run_both(d);
  expect_close("out", d.out, ref.out, tolerance_for(DType::kBFloat16));
  expect_close("final", d.ht, ref.ht, tolerance_for(DType::kFloat32));
}

TEST(PrefillDeterminism, BitwiseAcrossRunsAndThreadCounts) {
  PrefillCase c;
  c.varlen = true;
  c.seqlens = {100, 64, 0, 250};
  c.HV = 4;
  PrefillData a = make_prefill(c), b = make_prefill(c);
  PrefillParams pa = a.params(), pb = b.params();
  pa.exec.backend = pb.exec.backend = Backend::kCpu;
  pa.exec.num_threads = 1;
  pb.exec.num_threads = 3;
  ASSERT_TRUE(prefill(pa).ok());
  ASSERT_TRUE(prefill(pb).ok());
  EXPECT_TRUE(bitwise_equal(a.out, b.out));
  EXPECT_TRUE(bitwise_equal(a.ht, b.ht));
}

// Prefill over T then one decode step equals prefill over T + 1 (fast backends on both sides).
TEST(PrefillDecode, DecodeAfterPrefillEqualsLongerPrefill) {
  for (int64_t T : {1, 64, 100}) {
    PrefillCase c;
    c.seqlens = {T + 1, T + 1};
    c.HV = 4;
    c.K = c.V = 32;
    PrefillData full = make_prefill(c);
    PrefillParams pf = full.params();
    pf.exec.backend = Backend::kCpu;
    ASSERT_TRUE(prefill(pf).ok());

    // Prefix: the first T tokens of every input (views into the same storage).
    PrefillParams pp = full.params();
    for (TensorView* t : {&pp.q, &pp.k, &pp.v, &pp.g, &pp.beta}) t->shape[1] = T;
    HostTensor out_prefix(DType::kFloat32, {2, T, c.HV, c.V});
    HostTensor state(DType::kFloat32, full.ht.shape);
    pp.out = out_prefix.view();
    pp.final_state = state.view();
    pp.exec.backend = Backend::kCpu;
    ASSERT_TRUE(prefill(pp).ok());

    // Decode token T from the prefix's final state (pool of 2 slots, in place).
    DecodeParams dp = decode_inputs_of_token(pf, T);
    HostTensor out1(DType::kFloat32, {2, 1, c.HV, c.V});
    dp.out = out1.view();
    dp.state = state.view();
    dp.exec.backend = Backend::kCpu;
    Status s = decode(dp);
    ASSERT_TRUE(s.ok()) << s.to_string();

    HostTensor out_last(DType::kFloat32, {2, 1, c.HV, c.V});
    for (int64_t n = 0; n < 2; ++n)
      for (int64_t i = 0; i < c.HV * c.V; ++i)
        out_last.set(n * c.HV * c.V + i, full.out.get((n * (T + 1) + T) * c.HV * c.V + i));
    expect_close("decode out", out1, out_last, 2e-5);
    expect_close("decode state", state, full.ht, 2e-5);
  }
}

}  // namespace
}  // namespace kda::test
