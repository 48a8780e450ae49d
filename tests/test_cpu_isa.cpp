// test_cpu_isa.cpp — every compiled instruction-set level of the fast CPU kernels (cpu/isa.h)
// that this CPU supports computes the function: prefill and decode against the fp64 reference,
// and against the baseline level to fp32 rounding.
#include <gtest/gtest.h>

#include "core/problem.h"
#include "cpu/isa.h"
#include "support.h"

namespace kda::test {
namespace {

// Runs `level`'s kernels on a copy of `d` (prefill) and returns the copy.
PrefillData prefill_with(const cpu::FastKernels& level, const PrefillData& d) {
  PrefillData r = d;
  detail::PrefillProblem pr;
  const Status s = detail::validate_prefill(r.params(), &pr);
  EXPECT_TRUE(s.ok()) << s.to_string();
  const Status run = level.prefill(pr, 2);
  EXPECT_TRUE(run.ok()) << run.to_string();
  return r;
}

DecodeData decode_with(const cpu::FastKernels& level, const DecodeData& d) {
  DecodeData r = d;
  detail::DecodeProblem pr;
  const Status s = detail::validate_decode(r.params(), &pr);
  EXPECT_TRUE(s.ok()) << s.to_string();
  const Status run = level.decode(pr, 2);
  EXPECT_TRUE(run.ok()) << run.to_string();
  return r;
}

void expect_close(const std::string& what, const HostTensor& got, const HostTensor& ref,
                  double tol) {
  const Compare c = compare(got, ref, tol);
  EXPECT_TRUE(c.ok(tol)) << what << ": rel_l2 " << c.rel_l2 << " (tolerance " << tol << "), "
                         << c.nonfinite << " non-finite:" << c.first_mismatches;
}

// fp32 results of two levels differ only by the order and fusion (FMA) of fp32 operations.
constexpr double kLevelTolerance = 1e-5;

TEST(CpuIsa, BaselineFirstAndChosenLevelSupported) {
  const auto& levels = cpu::fast_kernel_levels();
  ASSERT_FALSE(levels.empty());
  EXPECT_TRUE(levels.front().supported) << levels.front().level;
  EXPECT_TRUE(cpu::fast_kernels().supported);
  // The chosen level is the last supported one.
  const cpu::FastKernels* best = nullptr;
  for (const auto& k : levels)
    if (k.supported) best = &k;
  EXPECT_STREQ(cpu::fast_kernels().level, best->level);
  for (const auto& k : levels) std::printf("level %s: %s\n", k.level, k.supported ? "yes" : "no");
}

TEST(CpuIsa, EveryLevelPrefillMatchesReference) {
  PrefillCase c;
  c.varlen = true;
  c.seqlens = {1, 130, 64, 17};
  c.H = 2;
  c.HV = 4;
  c.K = 64;
  c.V = 32;
  c.gate = GateForm::kLowerBound;
  c.pool = true;
  c.checkpoint_every = 64;
  const PrefillData d = make_prefill(c);
  PrefillData ref = widen(d);
  PrefillParams rp = ref.params();
  rp.exec.backend = Backend::kCpuReference;
  ASSERT_TRUE(prefill(rp).ok());
  const auto& levels = cpu::fast_kernel_levels();
  const PrefillData base = prefill_with(levels.front(), d);
  for (const auto& level : levels) {
    if (!level.supported) continue;
    const PrefillData r = prefill_with(level, d);
    const std::string l = level.level;
    expect_close(l + " out", r.out, ref.out, tolerance_for(r.out.dtype));
    expect_close(l + " state_pool", r.pool, ref.pool, tolerance_for(c.state_dtype));
    expect_close(l + " checkpoints", r.ckpt, ref.ckpt, tolerance_for(c.state_dtype));
    expect_close(l + " out vs " + levels.front().level, r.out, base.out, kLevelTolerance);
    expect_close(l + " pool vs " + levels.front().level, r.pool, base.pool, kLevelTolerance);
  }
}

TEST(CpuIsa, EveryLevelDecodeMatchesReference) {
  DecodeCase c;
  c.N = 5;
  c.T = 3;
  c.K = 64;
  c.dtype = DType::kFloat32;
  c.out_dtype = DType::kFloat32;
  c.padding = true;
  const DecodeData d = make_decode(c);
  DecodeData ref = d;
  DecodeParams rp = ref.params();
  rp.exec.backend = Backend::kCpuReference;
  ASSERT_TRUE(decode(rp).ok());
  const auto& levels = cpu::fast_kernel_levels();
  const DecodeData base = decode_with(levels.front(), d);
  for (const auto& level : levels) {
    if (!level.supported) continue;
    const DecodeData r = decode_with(level, d);
    const std::string l = level.level;
    expect_close(l + " out", r.out, ref.out, tolerance_for(DType::kFloat32));
    expect_close(l + " state", r.state, ref.state, tolerance_for(DType::kFloat32));
    expect_close(l + " out vs " + levels.front().level, r.out, base.out, kLevelTolerance);
    expect_close(l + " state vs " + levels.front().level, r.state, base.state, kLevelTolerance);
  }
}

}  // namespace
}  // namespace kda::test
