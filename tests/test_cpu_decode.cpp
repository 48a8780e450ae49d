// test_cpu_decode.cpp — the fast CPU decode against the fp64 reference over the serving contract:
// index modes, speculative decode, padding rows, untouched slots, state dtypes and layouts.
#include <gtest/gtest.h>

#include <cctype>
#include <cstring>
#include <set>

#include "support.h"

namespace kda::test {
namespace {

// Slots that some row of `d` reads or writes (by the spec's rules), from the host index data.
std::set<int64_t> touched_slots(const DecodeData& d) {
  std::set<int64_t> s;
  if (d.idx.empty()) {
    for (int64_t n = 0; n < std::min(d.N, d.P); ++n) s.insert(n);
    return s;
  }
  for (int64_t i = 0; i < d.idx.numel(); ++i) {
    const int64_t slot = static_cast<int64_t>(d.idx.get(i));
    if (slot >= 0 && slot < d.P) s.insert(slot);
  }
  return s;
}

class DecodeSweep : public ::testing::TestWithParam<DecodeCase> {};

TEST_P(DecodeSweep, FastMatchesReference) {
  DecodeData d = make_decode(GetParam());
  DecodeData ref = d;  // same inputs; the reference writes fp32 output
  ref.out = HostTensor(DType::kFloat32, d.out.shape);
  const HostTensor state_before = d.state;

  DecodeParams p = d.params();
  p.exec.backend = Backend::kCpu;
  Status s = decode(p);
  ASSERT_TRUE(s.ok()) << s.to_string();
  DecodeParams pr = ref.params();
  pr.exec.backend = Backend::kCpuReference;
  s = decode(pr);
  ASSERT_TRUE(s.ok()) << s.to_string();

  const double tol_out = tolerance_for(d.out.dtype);
  const double tol_state = tolerance_for(d.state.dtype);
  Compare c = compare(d.out, ref.out, tol_out);
  EXPECT_TRUE(c.ok(tol_out)) << "out " << c.rel_l2 << c.first_mismatches;
  c = compare(d.state, ref.state, tol_state);
  EXPECT_TRUE(c.ok(tol_state)) << "state " << c.rel_l2 << c.first_mismatches;
  if (!d.final_state.empty()) {
    c = compare(d.final_state, ref.final_state, tol_state);
    EXPECT_TRUE(c.ok(tol_state)) << "final_state " << c.rel_l2 << c.first_mismatches;
  }
  if (!d.inter.empty()) {
    c = compare(d.inter, ref.inter, tol_state);
    EXPECT_TRUE(c.ok(tol_state)) << "intermediate " << c.rel_l2 << c.first_mismatches;
  }
  // Slots no row reads or writes stay bit-identical.
  const auto touched = touched_slots(d);
  const int64_t per_slot = d.state.numel() / d.P;
  for (int64_t slot = 0; slot < d.P; ++slot) {
    if (touched.count(slot)) continue;
    for (int64_t i = slot * per_slot; i < (slot + 1) * per_slot; ++i)
      ASSERT_EQ(
          std::memcmp(&d.state.storage[d.state.offset(i) * dtype_size(d.state.dtype)],
                      &state_before.storage[state_before.offset(i) * dtype_size(d.state.dtype)],
                      dtype_size(d.state.dtype)),
          0)
          << "untouched slot " << slot << " changed";
  }
}

std::vector<DecodeCase> decode_cases() {
  std::vector<DecodeCase> cs;
  auto add = [&](auto mutate) {
    DecodeCase c;
    mutate(c);
    cs.push_back(c);
  };
  add([](DecodeCase&) {});
  add([](DecodeCase& c) { c.indices = 0; });
  add([](DecodeCase& c) {
    c.indices = 0;
    c.final_state_separate = true;
  });
  add([](DecodeCase& c) {
    c.index_dtype = DType::kInt64;
    c.padding = true;
  });
  add([](DecodeCase& c) { c.T = 3; });
  add([](DecodeCase& c) {
    c.T = 4;
    c.indices = 2;
  });
  add([](DecodeCase& c) {
    c.T = 4;
    c.indices = 2;
    c.num_accepted = true;
  });
  add([](DecodeCase& c) {
    c.T = 4;
    c.indices = 2;
    c.num_accepted = true;
    c.padding = true;
  });
  add([](DecodeCase& c) {
    c.T = 3;
    c.indices = 2;
    c.padding = true;
  });
  add([](DecodeCase& c) {
    c.T = 2;
    c.intermediate = true;
  });
  add([](DecodeCase& c) {
    c.T = 2;
    c.indices = 2;
    c.intermediate = true;
    c.num_accepted = true;
  });
  add([](DecodeCase& c) { c.seqlens = {1, 3, 0, 2}; });
  add([](DecodeCase& c) {
    c.seqlens = {2, 4, 1};
    c.indices = 2;
    c.num_accepted = true;
    c.index_dtype = DType::kInt64;
  });
  add([](DecodeCase& c) {
    c.state_dtype = DType::kBFloat16;
    c.T = 4;
  });
  add([](DecodeCase& c) {
    c.state_dtype = DType::kBFloat16;
    c.layout = StateLayout::kKFirst;
    c.T = 2;
    c.indices = 2;
  });
  add([](DecodeCase& c) { c.layout = StateLayout::kKFirst; });
  add([](DecodeCase& c) {
    c.K = 64;
    c.H = 1;
    c.HV = 1;
  });
  add([](DecodeCase& c) {
    c.K = 256;
    c.N = 2;
    c.HV = 2;
    c.H = 1;
  });
  add([](DecodeCase& c) {
    c.K = 96;
    c.T = 2;
  });
  for (GateForm g : {GateForm::kPrecomputed, GateForm::kSoftplus, GateForm::kLowerBound})
    for (bool b : {false, true})
      add([&](DecodeCase& c) {
        c.gate = g;
        c.beta_logits = b;
        c.T = 2;
      });
  add([](DecodeCase& c) { c.allow_neg_eigval = true; });
  add([](DecodeCase& c) {
    c.beta_per_v = true;
    c.T = 2;
  });
  add([](DecodeCase& c) { c.out_dtype = DType::kFloat32; });
  add([](DecodeCase& c) {
    c.dtype = DType::kFloat16;
    c.out_dtype = DType::kFloat16;
  });
  add([](DecodeCase& c) {
    c.dtype = DType::kFloat32;
    c.out_dtype = DType::kFloat32;
  });
  add([](DecodeCase& c) { c.use_initial_state = false; });
  add([](DecodeCase& c) {
    c.store_final_state = false;
    c.T = 2;
    c.indices = 2;
  });
  return cs;
}

INSTANTIATE_TEST_SUITE_P(Cpu, DecodeSweep, ::testing::ValuesIn(decode_cases()),
                         [](const auto& info) { return test_name(info.param.name()); });

TEST(DecodeSmoke, PaddingRowsHaveZeroOutputAndNoStateAccess) {
  DecodeCase c;
  c.padding = true;
  c.N = 3;
  DecodeData d = make_decode(c);
  const HostTensor before = d.state;
  DecodeParams p = d.params();
  p.exec.backend = Backend::kCpu;
  ASSERT_TRUE(decode(p).ok());
  const int64_t row = c.HV * c.K;  // elements of one token's output
  for (int64_t n : {int64_t{0}, d.N - 1})
    for (int64_t i = 0; i < row; ++i) ASSERT_EQ(d.out.get(n * row + i), 0.0) << "padding row " << n;
  // Only the one valid row's slot changed.
  const int64_t slot = static_cast<int64_t>(d.idx.get(1));
  const int64_t per_slot = d.state.numel() / d.P;
  for (int64_t i = 0; i < d.state.numel(); ++i)
    if (i / per_slot != slot) ASSERT_EQ(d.state.get(i), before.get(i));
}

// Every num_accepted_tokens value selects the slot state_indices[n, a - 1].
TEST(DecodeSpeculative, EveryAcceptedCountReadsItsSlot) {
  for (int64_t a = 1; a <= 4; ++a) {
    DecodeCase c;
    c.T = 4;
    c.N = 1;
    c.indices = 2;
    c.num_accepted = true;
    c.out_dtype = DType::kFloat32;
    DecodeData d = make_decode(c);
    d.nat.set(0, a);
    // Expected: the reference run from a pool whose slot idx[0][a-1] is what a plain [N] decode
    // would read.
    DecodeData plain = d;
    plain.idx = HostTensor(d.idx.dtype, {1});
    plain.idx.set(0, d.idx.get(a - 1));
    plain.nat = HostTensor();
    DecodeParams p = d.params(), pp = plain.params();
    p.exec.backend = Backend::kCpu;
    pp.exec.backend = Backend::kCpuReference;
    pp.store_final_state = false;
    ASSERT_TRUE(decode(p).ok());
    ASSERT_TRUE(decode(pp).ok());
    const Compare cmp = compare(d.out, plain.out, 2e-5);
    EXPECT_TRUE(cmp.ok(2e-5)) << "a=" << a << " " << cmp.rel_l2;
  }
}

TEST(DecodeChecking, ReportsOutOfRangeRowsAndWritesNothing) {
  for (int variant = 0; variant < 3; ++variant) {
    DecodeCase c;
    c.T = 2;
    c.indices = variant == 0 ? 1 : 2;
    c.num_accepted = variant == 2;
    DecodeData d = make_decode(c);
    if (variant == 0) d.idx.set(1, d.P);               // slot >= P
    if (variant == 1) d.idx.set(1 * 2 + 0, d.P + 10);  // read slot of row 1 out of range
    if (variant == 2) d.nat.set(2, 3);                 // num_accepted_tokens > T
    const HostTensor out_before = d.out, state_before = d.state;
    DecodeParams p = d.params();
    p.check_indices = true;
    p.exec.backend = Backend::kCpu;
    const Status s = decode(p);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << variant;
    EXPECT_NE(s.message().find(variant == 2 ? "num_accepted_tokens" : "state_indices"),
              std::string::npos)
        << s.message();
    EXPECT_TRUE(bitwise_equal(d.out, out_before));
    EXPECT_TRUE(bitwise_equal(d.state, state_before));
    // Without checking the same call succeeds and treats the row as padding.
    p.check_indices = false;
    EXPECT_TRUE(decode(p).ok());
  }
}

TEST(DecodeDeterminism, BitwiseAcrossRuns) {
  DecodeCase c;
  c.N = 6;
  c.T = 3;
  DecodeData a = make_decode(c), b = make_decode(c);
  DecodeParams pa = a.params(), pb = b.params();
  pa.exec.backend = pb.exec.backend = Backend::kCpu;
  pb.exec.num_threads = 1;
  ASSERT_TRUE(decode(pa).ok());
  ASSERT_TRUE(decode(pb).ok());
  EXPECT_TRUE(bitwise_equal(a.out, b.out));
  EXPECT_TRUE(bitwise_equal(a.state, b.state));
}

}  // namespace
}  // namespace kda::test
