// test_cpu_safety.cpp — no silent wrong result and no crash (spec sections 5 and 6): duplicate
// live slots under check_indices, outputs whose elements share memory, thread creation failure,
// element counts and ranks a view cannot hold, num_threads out of range, and dtype messages
// that list only what the argument allows. Every error leaves every output and pool untouched.
#include <gtest/gtest.h>

#include <climits>
#include <functional>
#include <random>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/problem.h"
#include "cpu/backends.h"
#include "support.h"

namespace kda::test {
namespace {

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Elements [row * per_row, (row + 1) * per_row) of a tensor whose leading dimension is `row`.
bool rows_equal(const HostTensor& a, const HostTensor& b, int64_t row) {
  const int64_t per_row = a.numel() / a.shape[0];
  for (int64_t i = row * per_row; i < (row + 1) * per_row; ++i)
    if (a.get(i) != b.get(i) && !(a.get(i) != a.get(i) && b.get(i) != b.get(i))) return false;
  return true;
}

// Tokens [bos, bos + len) of a [1, T, HV, V] (varlen) or [B, T, HV, V] output.
bool tokens_equal(const HostTensor& a, const HostTensor& b, int64_t first_token, int64_t len) {
  const int64_t per_token = a.shape[2] * a.shape[3];
  for (int64_t i = first_token * per_token; i < (first_token + len) * per_token; ++i)
    if (a.get(i) != b.get(i)) return false;
  return true;
}

// `s` is kInvalidArgument and its message names `argument` and contains `detail`.
void expect_invalid(const Status& s, const std::string& argument, const std::string& detail) {
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_TRUE(contains(s.message(), "argument " + argument)) << s.message();
  EXPECT_TRUE(contains(s.message(), detail)) << s.message();
}

// Every tensor a call may write is bit-identical in `a` and `b`.
void expect_same_outputs(const PrefillData& a, const PrefillData& b) {
  EXPECT_TRUE(bitwise_equal(a.out, b.out));
  EXPECT_TRUE(bitwise_equal(a.ht, b.ht));
  EXPECT_TRUE(bitwise_equal(a.pool, b.pool));
  EXPECT_TRUE(bitwise_equal(a.ckpt, b.ckpt));
}
void expect_same_outputs(const DecodeData& a, const DecodeData& b) {
  EXPECT_TRUE(bitwise_equal(a.out, b.out));
  EXPECT_TRUE(bitwise_equal(a.state, b.state));
  EXPECT_TRUE(bitwise_equal(a.final_state, b.final_state));
  EXPECT_TRUE(bitwise_equal(a.inter, b.inter));
}

Status run(const PrefillParams& p) { return prefill(p); }
Status run(const DecodeParams& p) { return decode(p); }

// The call of `d` with check_indices on both CPU backends: the error, and nothing written.
template <typename Data>
void expect_check_rejects(const Data& d, const std::string& detail) {
  Data x = d;
  auto p = x.params();
  p.check_indices = true;
  for (Backend be : {Backend::kCpu, Backend::kCpuReference}) {
    p.exec.backend = be;
    expect_invalid(run(p), "'state_indices'", detail);
    expect_same_outputs(x, d);
  }
}

// The call of `d` on the fast CPU backend without the check; returns the data it wrote.
template <typename Data>
Data run_unchecked(const Data& d) {
  Data x = d;
  auto p = x.params();
  p.exec.backend = Backend::kCpu;
  EXPECT_TRUE(run(p).ok());
  return x;
}

// The call of `d` on the fast CPU backend after mutate(params): valid when `argument` is empty,
// else kInvalidArgument naming it (and `detail`) with nothing written.
template <typename Data, typename Mutate>
void expect_outcome(const Data& d, Mutate&& mutate, const std::string& argument,
                    const std::string& detail) {
  Data x = d;
  auto p = x.params();
  p.exec.backend = Backend::kCpu;
  mutate(p);
  const Status s = run(p);
  if (argument.empty()) {
    EXPECT_TRUE(s.ok()) << s.to_string();
    return;
  }
  expect_invalid(s, argument, detail);
  EXPECT_EQ(validate(p).message(), s.message());
  expect_same_outputs(x, d);
}

// `d` (rows 0 and 2 on one slot) run without the check, and `d` with rows 0 and 2 given slot -1
// (padding / no pooled state).
template <typename Data>
std::pair<Data, Data> run_shared_and_unshared(const Data& d) {
  Data pad = d;
  pad.idx.set(0, -1);
  pad.idx.set(2, -1);
  return {run_unchecked(d), run_unchecked(pad)};
}

DecodeCase fp32_decode(int64_t N, int64_t T) {
  DecodeCase c;
  c.N = N;
  c.T = T;
  c.dtype = c.out_dtype = DType::kFloat32;
  return c;
}

// ---------------------------------------------------------------------------------------------
// 1. Duplicate live slots
// ---------------------------------------------------------------------------------------------

TEST(DuplicateSlots, DecodeInPlaceSharedSlotIsReportedNamingBothRows) {
  DecodeData d = make_decode(fp32_decode(4, 2));
  const int64_t s0 = static_cast<int64_t>(d.idx.get(0));
  d.idx.set(2, static_cast<double>(s0));
  expect_check_rejects(d, "slot " + std::to_string(s0) + " for sequences 0 and 2");
  // Without the check the call runs; rows 1 and 3 and every slot but s0 are exactly what they are
  // when rows 0 and 2 are padding.
  const auto [dup, pad] = run_shared_and_unshared(d);
  for (int64_t n : {1, 3}) EXPECT_TRUE(rows_equal(dup.out, pad.out, n)) << n;
  for (int64_t slot = 0; slot < d.P; ++slot)
    if (slot != s0) EXPECT_TRUE(rows_equal(dup.state, pad.state, slot)) << slot;
}

TEST(DuplicateSlots, DecodeRowsMayShareASlotTheyOnlyRead) {
  DecodeCase c = fp32_decode(3, 1);
  c.final_state_separate = true;  // the pool is only read
  DecodeData d = make_decode(c);
  d.idx.set(2, d.idx.get(0));
  DecodeData checked = d;
  DecodeParams p = checked.params();
  p.exec.backend = Backend::kCpu;
  p.check_indices = true;
  ASSERT_TRUE(decode(p).ok()) << decode(p).to_string();
  DecodeParams q = d.params();
  q.exec.backend = Backend::kCpu;
  ASSERT_TRUE(decode(q).ok());
  expect_same_outputs(checked, d);
  // The same indices writing in place are a conflict.
  DecodeData in_place = make_decode(fp32_decode(3, 1));
  in_place.idx.set(2, in_place.idx.get(0));
  DecodeParams r = in_place.params();
  r.check_indices = true;
  EXPECT_EQ(decode(r).code(), StatusCode::kInvalidArgument);
  // With use_initial_state off and a separate final state the pool is not touched at all.
  DecodeData fresh = d;
  DecodeParams f = fresh.params();
  f.check_indices = true;
  f.use_initial_state = false;
  EXPECT_TRUE(decode(f).ok()) << decode(f).to_string();
}

TEST(DuplicateSlots, DecodeSpeculativeWriteSlotReadByAnotherRow) {
  DecodeCase c = fp32_decode(3, 2);
  c.indices = 2;
  DecodeData d = make_decode(c);
  const int64_t s0 = static_cast<int64_t>(d.idx.get(0));  // row 0 reads (and writes) it
  d.idx.set(1 * 2 + 1, static_cast<double>(s0));          // row 1 writes it after token 1
  expect_check_rejects(d, "slot " + std::to_string(s0) + " for sequences 0 and 1");
  // With the states going to intermediate_states the pool is only read: no conflict.
  DecodeCase ci = c;
  ci.intermediate = true;
  DecodeData di = make_decode(ci);
  di.idx.set(1 * 2 + 0, di.idx.get(0));  // rows 0 and 1 read one slot
  DecodeParams pi = di.params();
  pi.check_indices = true;
  EXPECT_TRUE(decode(pi).ok()) << decode(pi).to_string();
}

PrefillCase pool_prefill() {
  PrefillCase c;
  c.varlen = true;
  c.seqlens = {10, 20, 15, 7};
  c.pool = true;  // P = N + 3, sequence 1 without a pooled state (slot -1)
  return c;
}

TEST(DuplicateSlots, PrefillSharedPoolSlotIsReportedNamingBothSequences) {
  PrefillData d = make_prefill(pool_prefill());
  const int64_t s0 = static_cast<int64_t>(d.idx.get(0));
  d.idx.set(2, static_cast<double>(s0));
  expect_check_rejects(d, "slot " + std::to_string(s0) + " for sequences 0 and 2");
  // Without the check: sequence 3 and every slot but s0 are exact (as with 0 and 2 unpooled).
  const auto [dup, pad] = run_shared_and_unshared(d);
  EXPECT_TRUE(tokens_equal(dup.out, pad.out, d.cu_host[3], 7));
  EXPECT_TRUE(tokens_equal(dup.out, pad.out, d.cu_host[1], 20));
  for (int64_t slot = 0; slot < d.pool.shape[0]; ++slot)
    if (slot != s0) EXPECT_TRUE(rows_equal(dup.pool, pad.pool, slot)) << slot;
}

TEST(DuplicateSlots, PrefillCheckRejectsSlotsPastThePoolAndAcceptsValidOnes) {
  PrefillData d = make_prefill(pool_prefill());
  const int64_t P = d.pool.shape[0];
  PrefillData valid = d;
  PrefillParams p = valid.params();
  p.check_indices = true;
  p.exec.backend = Backend::kCpu;
  ASSERT_TRUE(prefill(p).ok()) << prefill(p).to_string();
  PrefillParams q = d.params();
  q.exec.backend = Backend::kCpu;
  ASSERT_TRUE(prefill(q).ok());
  expect_same_outputs(valid, d);  // the check changes nothing else

  PrefillData bad = make_prefill(pool_prefill());
  bad.idx.set(3, static_cast<double>(P + 1));
  expect_check_rejects(bad, "slot " + std::to_string(P + 1) + " for sequence 3");
  run_unchecked(bad);  // without the check: no pooled state for sequence 3
}

// ---------------------------------------------------------------------------------------------
// 2. Outputs whose elements share memory
// ---------------------------------------------------------------------------------------------

TensorView raw_view(std::vector<int64_t> shape, std::vector<int64_t> strides) {
  static float dummy;
  return make_strided_view(&dummy, DType::kFloat32, shape, strides);
}

// Brute force: do two index tuples map to the same offset?
bool brute_overlap(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  std::set<int64_t> seen;
  for (int64_t flat = 0; flat < n; ++flat) {
    int64_t off = 0, f = flat;
    for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
      off += (f % shape[i]) * strides[i];
      f /= shape[i];
    }
    if (!seen.insert(off).second) return true;
  }
  return false;
}

TEST(OutputOverlap, ExactAgainstBruteForce) {
  std::mt19937_64 rng(7);
  int64_t overlapping = 0, irregular = 0;
  for (int trial = 0; trial < 4000; ++trial) {
    const int nd = 1 + static_cast<int>(rng() % 5);
    std::vector<int64_t> shape(nd), strides(nd);
    for (int i = 0; i < nd; ++i) {
      shape[i] = static_cast<int64_t>(rng() % 5);
      strides[i] = static_cast<int64_t>(rng() % 13);
    }
    if (trial % 4 == 0)
      for (int64_t& s : shape) s = std::max<int64_t>(s, 1);
    const detail::Overlap o = detail::internal_overlap(raw_view(shape, strides));
    ASSERT_NE(o, detail::Overlap::kUnknown);
    const bool want = brute_overlap(shape, strides);
    ASSERT_EQ(o == detail::Overlap::kYes, want)
        << "trial " << trial << " shape " << testing::PrintToString(shape) << " strides "
        << testing::PrintToString(strides);
    overlapping += want;
    // Non-overlapping layouts that are not nested (not a permuted dense layout) exist too.
    int64_t span = 0;
    bool nested = true;
    std::vector<std::pair<int64_t, int64_t>> ds;
    for (int i = 0; i < nd; ++i)
      if (shape[i] > 1) ds.push_back({strides[i], shape[i]});
    std::sort(ds.begin(), ds.end());
    for (auto [st, sz] : ds) {
      nested = nested && st > span;
      span += (sz - 1) * st;
    }
    for (int64_t s : shape) nested = nested || s == 0;
    irregular += !want && !nested;
  }
  EXPECT_GT(overlapping, 500);
  EXPECT_GT(irregular, 20);  // the exact search decided these
}

TEST(OutputOverlap, Layouts) {
  using detail::internal_overlap;
  using detail::Overlap;
  EXPECT_EQ(internal_overlap(raw_view({4, 8, 16}, {128, 16, 1})), Overlap::kNo);  // dense
  EXPECT_EQ(internal_overlap(raw_view({4, 8, 16}, {16, 64, 1})), Overlap::kNo);   // permuted
  EXPECT_EQ(internal_overlap(raw_view({4, 8, 16}, {300, 20, 1})), Overlap::kNo);  // padded
  EXPECT_EQ(internal_overlap(raw_view({4, 8, 16}, {0, 16, 1})), Overlap::kYes);   // broadcast
  EXPECT_EQ(internal_overlap(raw_view({4, 8, 16}, {128, 8, 1})), Overlap::kYes);  // rows overlap
  EXPECT_EQ(internal_overlap(raw_view({1, 8, 16}, {0, 16, 1})), Overlap::kNo);    // size 1
  EXPECT_EQ(internal_overlap(raw_view({0, 8, 16}, {0, 0, 0})), Overlap::kNo);     // empty
  EXPECT_EQ(internal_overlap(raw_view({2, 3, 2}, {1, 4, 6})), Overlap::kNo);      // irregular
  EXPECT_EQ(internal_overlap(raw_view({2, 4, 3}, {1, 4, 6})), Overlap::kYes);     // 3*4 = 2*6
  EXPECT_EQ(internal_overlap(raw_view({2, 3, 3}, {1, 4, 6})), Overlap::kNo);      // it needs 3
  // Large dense shapes are decided at once.
  EXPECT_EQ(internal_overlap(raw_view({1 << 20, 1 << 20, 4}, {int64_t{4} << 20, 4, 1})),
            Overlap::kNo);
  EXPECT_EQ(internal_overlap(raw_view({1 << 20, 1 << 20, 4}, {(int64_t{4} << 20) - 1, 4, 1})),
            Overlap::kYes);
}

struct OutputCase {
  std::string name;
  std::function<void(PrefillParams&)> mutate;
  std::string argument;  // empty: the call is valid
};

PrefillCase ckpt_prefill() {
  PrefillCase c;
  c.varlen = true;
  c.seqlens = {130, 70};  // 2 + 1 checkpoints of 64 tokens
  c.checkpoint_every = 64;
  return c;
}

TEST(OutputOverlap, PrefillRefusesOverlappingOutputsAndAcceptsBroadcastInputs) {
  const std::vector<OutputCase> cases = {
      {"out_tokens", [](PrefillParams& p) { p.out.strides[1] = 0; }, "'out'"},
      {"out_heads", [](PrefillParams& p) { p.out.strides[2] = 1; }, "'out'"},
      {"final_state_rows", [](PrefillParams& p) { p.final_state.strides[0] = 0; }, "'final_state'"},
      {"checkpoints_rows", [](PrefillParams& p) { p.checkpoints.strides[0] = 0; }, "'checkpoints'"},
      {"q_broadcast_tokens", [](PrefillParams& p) { p.q.strides[1] = 0; }, ""},
      {"k_broadcast_heads", [](PrefillParams& p) { p.k.strides[2] = 0; }, ""},
      {"initial_state_broadcast", [](PrefillParams& p) { p.initial_state.strides[0] = 0; }, ""},
  };
  for (const OutputCase& oc : cases) {
    SCOPED_TRACE(oc.name);
    expect_outcome(make_prefill(ckpt_prefill()), oc.mutate, oc.argument, "do not share memory");
  }
  // A pool whose heads overlap.
  expect_outcome(
      make_prefill(pool_prefill()), [](PrefillParams& p) { p.state_pool.strides[1] = 0; },
      "'state_pool'", "do not share memory");
  // A dimension of size 1 never overlaps, whatever its stride (one checkpoint row here).
  PrefillCase one = ckpt_prefill();
  one.seqlens = {10, 20};
  PrefillData e = make_prefill(one);
  PrefillParams pe = e.params();
  ASSERT_EQ(pe.checkpoints.shape[0], 1);
  pe.checkpoints.strides[0] = 0;
  EXPECT_TRUE(prefill(pe).ok()) << prefill(pe).to_string();
  // Neither does a tensor without elements: an empty varlen call with broadcast output strides.
  PrefillCase empty;
  empty.varlen = true;
  empty.seqlens = {0, 0};
  PrefillData z = make_prefill(empty);
  PrefillParams pz = z.params();
  ASSERT_EQ(pz.out.shape[1], 0);
  pz.out.strides[0] = pz.out.strides[1] = pz.out.strides[2] = 0;
  EXPECT_TRUE(prefill(pz).ok()) << prefill(pz).to_string();
}

TEST(OutputOverlap, DecodeRefusesOverlappingOutputsItWrites) {
  struct Case {
    std::string name;
    std::function<void(DecodeCase&)> setup;
    std::function<void(DecodeParams&)> mutate;
    std::string argument;
  };
  const std::vector<Case> cases = {
      {"out_rows", [](DecodeCase&) {}, [](DecodeParams& p) { p.out.strides[0] = 0; }, "'out'"},
      {"pool_in_place", [](DecodeCase&) {}, [](DecodeParams& p) { p.state.strides[0] = 0; },
       "'state'"},
      {"pool_read_only", [](DecodeCase&) {},
       [](DecodeParams& p) {
         p.state.strides[0] = 0;
         p.store_final_state = false;
       },
       ""},
      {"pool_beside_final_state", [](DecodeCase& c) { c.final_state_separate = true; },
       [](DecodeParams& p) { p.state.strides[1] = 0; }, ""},
      {"final_state_rows", [](DecodeCase& c) { c.final_state_separate = true; },
       [](DecodeParams& p) { p.final_state.strides[0] = 0; }, "'final_state'"},
      {"intermediate_rows", [](DecodeCase& c) { c.intermediate = true; },
       [](DecodeParams& p) { p.intermediate_states.strides[0] = 0; }, "'intermediate_states'"},
      {"k_broadcast", [](DecodeCase&) {}, [](DecodeParams& p) { p.k.strides[0] = 0; }, ""},
  };
  for (const Case& tc : cases) {
    SCOPED_TRACE(tc.name);
    DecodeCase c = fp32_decode(4, 2);
    tc.setup(c);
    expect_outcome(make_decode(c), tc.mutate, tc.argument, "do not share memory");
  }
}

// ---------------------------------------------------------------------------------------------
// 3. Thread creation failure
// ---------------------------------------------------------------------------------------------

// Makes thread creation fail after `limit` threads of each call while alive.
struct ThreadLimit {
  explicit ThreadLimit(int limit) { cpu::testing::set_thread_creation_limit(limit); }
  ~ThreadLimit() { cpu::testing::set_thread_creation_limit(-1); }
};

TEST(ThreadFailure, PrefillAndDecodeReturnAnErrorAndWriteNothing) {
  for (int limit : {0, 2}) {
    SCOPED_TRACE(limit);
    PrefillCase pc;
    pc.seqlens = {40, 40, 40};  // N * HV = 6 tasks
    PrefillData d = make_prefill(pc);
    PrefillParams p = d.params();
    p.exec.backend = Backend::kCpu;
    p.exec.num_threads = 6;
    DecodeData dd = make_decode(fp32_decode(4, 1));  // 16 tasks
    DecodeParams dp = dd.params();
    dp.exec.backend = Backend::kCpu;
    dp.exec.num_threads = 6;
    const PrefillData d0 = d;
    const DecodeData dd0 = dd;
    {
      ThreadLimit guard(limit);
      for (const Status& s : {prefill(p), decode(dp)}) {
        EXPECT_EQ(s.code(), StatusCode::kInternal);
        EXPECT_TRUE(contains(
            s.message(), "could not create worker thread " + std::to_string(limit + 1) + " of 5"))
            << s.message();
        EXPECT_TRUE(contains(s.message(), "exec.num_threads")) << s.message();
      }
      expect_same_outputs(d, d0);
      expect_same_outputs(dd, dd0);
      // One thread needs no new thread.
      PrefillParams p1 = p;
      p1.exec.num_threads = 1;
      EXPECT_TRUE(prefill(p1).ok());
    }
    // Once threads can be created again the same calls run, with the single-thread result.
    PrefillData again = make_prefill(pc);
    PrefillParams pa = again.params();
    pa.exec.backend = Backend::kCpu;
    pa.exec.num_threads = 6;
    ASSERT_TRUE(prefill(pa).ok());
    EXPECT_TRUE(bitwise_equal(again.out, d.out));
    EXPECT_TRUE(decode(dp).ok());
  }
}

// ---------------------------------------------------------------------------------------------
// 4. Element counts and ranks a view cannot hold
// ---------------------------------------------------------------------------------------------

TEST(ViewLimits, NumelOverflowAndInvalidViews) {
  TensorView t;
  EXPECT_EQ(t.numel(), 0);  // absent
  t = raw_view({int64_t{1} << 32, int64_t{1} << 32}, {0, 0});
  EXPECT_EQ(t.numel(), -1);
  t = raw_view({int64_t{1} << 31, (int64_t{1} << 32) - 1}, {0, 0});
  EXPECT_EQ(t.numel(), INT64_MAX - ((int64_t{1} << 31) - 1));  // 2^63 - 2^31 fits
  t = raw_view({int64_t{1} << 40, 0, int64_t{1} << 40}, {0, 0, 0});
  EXPECT_EQ(t.numel(), 0);  // an empty view never overflows
  t = raw_view({3, -2}, {0, 0});
  EXPECT_EQ(t.numel(), -1);
  t.ndim = -1;
  EXPECT_TRUE(t.present());
  EXPECT_EQ(t.numel(), -1);
  // make_view's row-major strides saturate instead of overflowing.
  float x = 0;
  t = make_view(&x, DType::kFloat32, {int64_t{1} << 40, int64_t{1} << 40, int64_t{1} << 40});
  EXPECT_EQ(t.numel(), -1);
  EXPECT_EQ(t.strides[0], INT64_MAX);
  EXPECT_EQ(t.strides[1], int64_t{1} << 40);
  EXPECT_EQ(t.strides[2], 1);
}

TEST(ViewLimits, MoreThanSixDimensionsRecordOnlyTheRank) {
  float x = 0;
  for (const TensorView& t :
       {make_view(&x, DType::kFloat32, {1, 1, 1, 1, 1, 1, 2}),
        make_strided_view(&x, DType::kFloat32, {1, 1, 1, 1, 1, 1, 2}, {7, 7, 7, 7, 7, 7, 1})}) {
    EXPECT_EQ(t.ndim, 7);
    EXPECT_TRUE(t.present());
    EXPECT_EQ(t.numel(), -1);
    for (int i = 0; i < kMaxDims; ++i) {
      EXPECT_EQ(t.shape[i], 0);
      EXPECT_EQ(t.strides[i], 0);
    }
  }
  EXPECT_EQ(make_view(&x, DType::kFloat32, std::vector<int64_t>(100, 1)).ndim, 100);
}

TEST(ViewLimits, EntryPointsRejectThemNamingTheArgument) {
  float x = 0;
  const TensorView rank7 = make_view(&x, DType::kFloat32, {1, 1, 1, 1, 1, 1, 2});
  struct Case {
    std::string name;
    std::function<void(PrefillParams&)> mutate;
    std::string argument, got;
  };
  const std::vector<Case> cases = {
      {"q_rank7", [&](PrefillParams& p) { p.q = rank7; }, "'q'", "got rank 7"},
      {"A_log_rank7", [&](PrefillParams& p) { p.A_log = rank7; }, "'A_log'", "got rank 7"},
      {"out_rank7", [&](PrefillParams& p) { p.out = rank7; }, "'out'", "got rank 7"},
      {"dt_bias_rank_negative", [](PrefillParams& p) { p.dt_bias.ndim = -1; }, "'dt_bias'",
       "got rank -1"},
      {"q_numel_overflow", [](PrefillParams& p) { p.q.shape[0] = p.q.shape[1] = int64_t{1} << 40; },
       "'q'", "expected an element count that fits in int64"},
      {"g_offsets_overflow", [](PrefillParams& p) { p.g.strides[1] = int64_t{1} << 62; }, "'g'",
       "expected element offsets that fit in int64"},
  };
  PrefillCase c;
  c.seqlens = {20, 20};
  const PrefillData d = make_prefill(c);
  for (const Case& tc : cases) {
    SCOPED_TRACE(tc.name);
    expect_outcome(d, tc.mutate, tc.argument, tc.got);
  }
  // The same for decode's optional tensors.
  expect_outcome(
      make_decode(fp32_decode(4, 1)), [&](DecodeParams& p) { p.num_accepted_tokens = rank7; },
      "'num_accepted_tokens'", "got rank 7");
}

// ---------------------------------------------------------------------------------------------
// 5. num_threads out of range
// ---------------------------------------------------------------------------------------------

TEST(NumThreads, OutOfRangeIsAnErrorNamingIt) {
  for (int n : {-1, kMaxNumThreads + 1, INT_MAX, INT_MIN}) {
    SCOPED_TRACE(n);
    PrefillData d = make_prefill(PrefillCase{});
    DecodeData dd = make_decode(fp32_decode(2, 1));
    const PrefillData d0 = d;
    const DecodeData dd0 = dd;
    PrefillParams p = d.params();
    DecodeParams dp = dd.params();
    p.exec.num_threads = dp.exec.num_threads = n;
    for (const Status& s : {prefill(p), decode(dp)})
      expect_invalid(s, "'num_threads'", std::to_string(kMaxNumThreads));
    expect_same_outputs(d, d0);
    expect_same_outputs(dd, dd0);
  }
  PrefillData d = make_prefill(PrefillCase{});
  PrefillParams p = d.params();
  p.exec.num_threads = kMaxNumThreads;  // the largest allowed: threads = min(it, tasks)
  EXPECT_TRUE(prefill(p).ok());
  EXPECT_EQ(cpu::worker_count(kMaxNumThreads, 3), 3);
  EXPECT_EQ(cpu::worker_count(kMaxNumThreads, 1 << 20), kMaxNumThreads);
  EXPECT_EQ(cpu::worker_count(4, 0), 1);
}

// ---------------------------------------------------------------------------------------------
// 6. Dtype messages list only what the argument allows
// ---------------------------------------------------------------------------------------------

TEST(DtypeMessages, ExactMessages) {
  PrefillData d = make_prefill(PrefillCase{});
  PrefillParams p = d.params();
  p.A_log.dtype = DType::kBFloat16;
  EXPECT_EQ(validate(p).message(), "argument 'A_log': expected dtype fp32, got dtype bf16");
  p = d.params();
  p.A_log.dtype = static_cast<DType>(9);
  EXPECT_EQ(validate(p).message(), "argument 'A_log': expected dtype fp32, got dtype unknown");
  p = d.params();
  p.q.dtype = static_cast<DType>(-3);
  EXPECT_EQ(validate(p).message(),
            "argument 'q': expected dtype bf16, fp16 or fp32, got dtype unknown");
  DecodeData dd = make_decode(DecodeCase{});
  DecodeParams dp = dd.params();
  dp.dt_bias.dtype = DType::kFloat16;
  EXPECT_EQ(validate(dp).message(),
            "argument 'dt_bias': expected dtype fp32 or bf16, got dtype fp16");
}

// Every tensor argument given an invalid dtype code: the message names it and lists what it
// allows, never the whole dtype list.
TEST(DtypeMessages, InvalidDtypeCodesGetTheArgumentsOwnList) {
  PrefillCase pc = ckpt_prefill();
  pc.pool = true;
  PrefillData d = make_prefill(pc);
  const std::vector<std::pair<std::string, TensorView PrefillParams::*>> prefill_args = {
      {"q", &PrefillParams::q},
      {"k", &PrefillParams::k},
      {"v", &PrefillParams::v},
      {"g", &PrefillParams::g},
      {"beta", &PrefillParams::beta},
      {"A_log", &PrefillParams::A_log},
      {"dt_bias", &PrefillParams::dt_bias},
      {"cu_seqlens", &PrefillParams::cu_seqlens},
      {"out", &PrefillParams::out},
      {"state_pool", &PrefillParams::state_pool},
      {"state_indices", &PrefillParams::state_indices},
      {"checkpoints", &PrefillParams::checkpoints},
      {"checkpoint_offsets", &PrefillParams::checkpoint_offsets},
  };
  for (const auto& [name, field] : prefill_args) {
    PrefillParams p = d.params();
    ASSERT_TRUE(validate(p).ok()) << validate(p).to_string();
    (p.*field).dtype = static_cast<DType>(11);
    const std::string m = validate(p).message();
    EXPECT_TRUE(contains(m, "argument '" + name + "': expected dtype ")) << m;
    EXPECT_TRUE(contains(m, "got dtype unknown")) << m;
    int listed = 0;
    for (const char* dt : {"fp32", "fp16", "bf16", "int32", "int64"}) listed += contains(m, dt);
    EXPECT_LE(listed, 3) << m;
  }
  DecodeCase dc;
  dc.indices = 2;
  dc.num_accepted = true;
  dc.T = 2;
  DecodeData dd = make_decode(dc);
  for (auto field :
       {&DecodeParams::state, &DecodeParams::state_indices, &DecodeParams::num_accepted_tokens}) {
    DecodeParams p = dd.params();
    (p.*field).dtype = static_cast<DType>(11);
    const std::string m = validate(p).message();
    EXPECT_TRUE(contains(m, "expected dtype ")) << m;
    EXPECT_FALSE(contains(m, "fp16, bf16, int32")) << m;
  }
}

}  // namespace
}  // namespace kda::test
