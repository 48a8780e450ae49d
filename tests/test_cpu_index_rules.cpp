// test_cpu_index_rules.cpp — the index rules of core/index_rules.h (varlen span, decode read
// slot and its padding reasons, pool slot), their host loaders on int32 and int64 tensors, and
// the check_indices messages built on them.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "core/index_rules.h"
#include "core/problem.h"
#include "cpu/access.h"
#include "cpu/backends.h"
#include "support.h"

namespace kda::test {
namespace {

using rules::RowState;

constexpr int64_t kI64Min = std::numeric_limits<int64_t>::min();
constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kI32Min = std::numeric_limits<int32_t>::min();
constexpr int64_t kI32Max = std::numeric_limits<int32_t>::max();

void expect_span(const rules::SeqSpan& s, int64_t b, int64_t bos, int64_t len) {
  EXPECT_EQ(s.b, b);
  EXPECT_EQ(s.bos, bos);
  EXPECT_EQ(s.len, len);
}

TEST(IndexRulesSmoke, SpansOfValidSequences) {
  expect_span(rules::dense_span(3, 7), 3, 0, 7);
  expect_span(rules::clamp_span(0, 10, 30), 0, 0, 10);
  expect_span(rules::clamp_span(10, 30, 30), 0, 10, 20);
  expect_span(rules::clamp_span(12, 12, 30), 0, 12, 0);  // an empty sequence
}

TEST(IndexRules, ClampSpanKeepsBadCuSeqlensInBounds) {
  expect_span(rules::clamp_span(-5, 4, 30), 0, 0, 4);    // bos < 0
  expect_span(rules::clamp_span(25, 40, 30), 0, 25, 5);  // eos > total
  expect_span(rules::clamp_span(20, 10, 30), 0, 20, 0);  // decreasing: empty
  expect_span(rules::clamp_span(35, 50, 30), 0, 30, 0);  // bos > total
  expect_span(rules::clamp_span(-9, -3, 30), 0, 0, 0);   // both negative
  expect_span(rules::clamp_span(0, 10, 0), 0, 0, 0);     // no tokens at all
  // Extremes of both index dtypes never overflow: the span stays within [0, total].
  expect_span(rules::clamp_span(kI32Min, kI32Max, 30), 0, 0, 30);
  expect_span(rules::clamp_span(kI32Max, kI32Min, 30), 0, 30, 0);
  expect_span(rules::clamp_span(kI64Min, kI64Max, 30), 0, 0, 30);
  expect_span(rules::clamp_span(kI64Max, kI64Min, 30), 0, 30, 0);
  expect_span(rules::clamp_span(kI64Min, kI64Min, kI64Max), 0, 0, 0);
}

TEST(IndexRules, PoolSlot) {
  EXPECT_EQ(rules::pool_slot(0, 4), 0);
  EXPECT_EQ(rules::pool_slot(3, 4), 3);
  EXPECT_EQ(rules::pool_slot(4, 4), rules::kNoSlot);
  EXPECT_EQ(rules::pool_slot(-1, 4), rules::kNoSlot);
  EXPECT_EQ(rules::pool_slot(kI32Min, 4), rules::kNoSlot);
  EXPECT_EQ(rules::pool_slot(kI64Max, 4), rules::kNoSlot);
  EXPECT_EQ(rules::pool_slot(kI64Min, 4), rules::kNoSlot);
  EXPECT_EQ(rules::pool_slot(0, 0), rules::kNoSlot);  // an empty pool has no slot
}

// Calls decode_read_slot with a loader over `row` (state_indices[n, :]) that records its calls.
struct Loader {
  std::vector<int64_t> row;
  std::vector<int64_t> cols;  // columns loaded
  rules::ReadSlot operator()(const rules::DecodeIndexing& ix, int64_t n, int64_t len,
                             int64_t accepted) {
    return rules::decode_read_slot(ix, n, len, accepted, [&](int64_t col) {
      cols.push_back(col);
      return row.at(static_cast<size_t>(col));
    });
  }
};

void expect_row(const rules::ReadSlot& r, RowState state, int64_t slot, int64_t value) {
  EXPECT_EQ(r.state, state);
  EXPECT_EQ(r.slot, slot);
  EXPECT_EQ(r.value, value);
  EXPECT_EQ(r.live(), state == RowState::kLive);
}

TEST(IndexRules, ReadSlotWithoutIndicesIsTheRow) {
  rules::DecodeIndexing ix;
  ix.P = 3;
  Loader l;
  expect_row(l(ix, 0, 1, 1), RowState::kLive, 0, 0);
  expect_row(l(ix, 2, 1, 1), RowState::kLive, 2, 2);
  expect_row(l(ix, 3, 1, 1), RowState::kNoSlotForRow, rules::kNoSlot, 3);
  EXPECT_TRUE(l.cols.empty());  // nothing to load
}

TEST(IndexRules, ReadSlotOfOneDimensionalIndices) {
  rules::DecodeIndexing ix;
  ix.P = 5;
  ix.has_indices = true;
  for (int64_t v : {int64_t{0}, int64_t{4}}) {
    Loader l{{v}};
    expect_row(l(ix, 0, 2, 1), RowState::kLive, v, v);
    EXPECT_EQ(l.cols, std::vector<int64_t>{0});
  }
  for (int64_t v : {int64_t{-1}, kI32Min, kI64Min}) {
    Loader l{{v}};
    expect_row(l(ix, 0, 2, 1), RowState::kNegativeSlot, rules::kNoSlot, v);
  }
  for (int64_t v : {int64_t{5}, kI32Max, kI64Max}) {
    Loader l{{v}};
    expect_row(l(ix, 0, 2, 1), RowState::kSlotOutOfRange, rules::kNoSlot, v);
  }
  // T_n = 0 with [N] indices is a live row (its state passes through).
  Loader l{{2}};
  expect_row(l(ix, 0, 0, 1), RowState::kLive, 2, 2);
}

TEST(IndexRules, ReadSlotOfSpeculativeIndices) {
  rules::DecodeIndexing ix;
  ix.P = 10;
  ix.Tmax = 4;
  ix.has_indices = ix.indices_2d = ix.has_num_accepted = true;
  const std::vector<int64_t> row = {7, 8, -1, 12};
  {
    Loader l{row};
    expect_row(l(ix, 1, 3, 2), RowState::kLive, 8, 8);  // column accepted - 1
    EXPECT_EQ(l.cols, std::vector<int64_t>{1});
  }
  {
    Loader l{row};
    expect_row(l(ix, 1, 3, 3), RowState::kNegativeSlot, rules::kNoSlot, -1);
  }
  {
    Loader l{row};
    expect_row(l(ix, 1, 4, 4), RowState::kSlotOutOfRange, rules::kNoSlot, 12);
  }
  for (int64_t accepted : {int64_t{0}, int64_t{-3}, int64_t{4}, kI64Max, kI64Min}) {
    Loader l{row};
    expect_row(l(ix, 1, 3, accepted), RowState::kAcceptedOutOfRange, rules::kNoSlot, accepted);
    EXPECT_TRUE(l.cols.empty()) << "no load for a row without a column";
  }
  {  // varlen: a sequence longer than the index columns
    Loader l{row};
    expect_row(l(ix, 1, 5, 2), RowState::kLongerThanIndexColumns, rules::kNoSlot, 5);
    EXPECT_TRUE(l.cols.empty());
  }
  {  // T_n = 0 has no accepted token
    Loader l{row};
    expect_row(l(ix, 1, 0, 1), RowState::kAcceptedOutOfRange, rules::kNoSlot, 1);
  }
  // Without num_accepted_tokens the read column is 0 whatever `accepted` says.
  ix.has_num_accepted = false;
  Loader l{row};
  expect_row(l(ix, 1, 3, 99), RowState::kLive, 7, 7);
  EXPECT_EQ(l.cols, std::vector<int64_t>{0});
  // [N, 0] indices: no column at all (the load is never issued).
  ix.Tmax = 0;
  Loader l0{{}};
  expect_row(l0(ix, 0, 0, 1), RowState::kLongerThanIndexColumns, rules::kNoSlot, 0);
}

TEST(IndexRules, ReadColumn) {
  rules::DecodeIndexing ix;
  ix.P = 10;
  ix.Tmax = 4;
  ix.has_indices = ix.indices_2d = ix.has_num_accepted = true;
  EXPECT_EQ(rules::read_column(ix, 4, 4).state, RowState::kLive);
  EXPECT_EQ(rules::read_column(ix, 4, 4).col, 3);
  EXPECT_EQ(rules::read_column(ix, 4, 5).state, RowState::kAcceptedOutOfRange);
  EXPECT_EQ(rules::read_column(ix, 5, 5).state, RowState::kLongerThanIndexColumns);
}

TEST(IndexRules, OnlyUnintendedPaddingIsAnIndexError) {
  EXPECT_FALSE(rules::is_index_error(RowState::kLive));
  EXPECT_FALSE(rules::is_index_error(RowState::kNegativeSlot));
  EXPECT_TRUE(rules::is_index_error(RowState::kAcceptedOutOfRange));
  EXPECT_TRUE(rules::is_index_error(RowState::kLongerThanIndexColumns));
  EXPECT_TRUE(rules::is_index_error(RowState::kSlotOutOfRange));
  EXPECT_TRUE(rules::is_index_error(RowState::kNoSlotForRow));
}

// The host loaders read int32 and int64 tensors of rank 1 and 2 with any strides, from the
// tensor's memory or from a host copy.
TEST(IndexRules, HostLoadersReadBothIndexDtypes) {
  for (DType dt : {DType::kInt32, DType::kInt64}) {
    HostTensor t(dt, {3, 4}, /*padded=*/true);  // row stride > 4
    ASSERT_GT(t.strides[0], 4);
    for (int64_t i = 0; i < 12; ++i) t.set(i, i % 2 ? -i : i * 1000);
    const TensorView v = t.view();
    for (int64_t i = 0; i < 3; ++i)
      for (int64_t j = 0; j < 4; ++j) {
        const int64_t want = (i * 4 + j) % 2 ? -(i * 4 + j) : (i * 4 + j) * 1000;
        EXPECT_EQ(detail::load_index(v, i, j), want);
        EXPECT_EQ(detail::load_index_at(v, t.storage.data(), i, j), want);
      }
    HostTensor big(dt, {2});
    big.set(0, dt == DType::kInt32 ? static_cast<double>(kI32Min) : -9.0e15);
    big.set(1, dt == DType::kInt32 ? static_cast<double>(kI32Max) : 9.0e15);
    EXPECT_EQ(detail::load_index(big.view(), 0), dt == DType::kInt32 ? kI32Min : -9000000000000000);
    EXPECT_EQ(detail::load_index(big.view(), 1), dt == DType::kInt32 ? kI32Max : 9000000000000000);
  }
}

// Varlen spans from cu_seqlens tensors of both dtypes, bad values clamped.
TEST(IndexRules, SeqSpanOfCuSeqlensTensors) {
  for (DType dt : {DType::kInt32, DType::kInt64}) {
    HostTensor cu(dt, {5});
    const std::vector<double> vals = {0, 4, -2, 9, 40};
    for (int i = 0; i < 5; ++i) cu.set(i, vals[i]);
    detail::Dims d;
    d.varlen = true;
    d.T = 12;
    const TensorView v = cu.view();
    expect_span(detail::seq_span_at(d, v, v.data, 0), 0, 0, 4);
    expect_span(detail::seq_span_at(d, v, v.data, 1), 0, 4, 0);  // decreasing: empty
    expect_span(detail::seq_span_at(d, v, v.data, 2), 0, 0, 9);  // negative bos: 0
    expect_span(detail::seq_span_at(d, v, v.data, 3), 0, 9, 3);  // eos past T: T
    expect_span(cpu::seq_span(d, v, 3), 0, 9, 3);
  }
}

// One decode problem per row state; decode_row_slot and the CPU backends agree with the rule,
// and check_indices names the argument, the row and the value.
struct RowCase {
  const char* name;
  RowState state;
  const char* argument;  // in the check_indices message ("" for the states it accepts)
  const char* detail;
};

TEST(IndexRules, EveryRowStateThroughTheBackendsAndTheCheck) {
  const RowCase cases[] = {
      {"live", RowState::kLive, "", ""},
      {"negative", RowState::kNegativeSlot, "", ""},
      {"accepted", RowState::kAcceptedOutOfRange, "'num_accepted_tokens'",
       "num_accepted_tokens[1] = 0"},
      {"columns", RowState::kLongerThanIndexColumns, "'state_indices'",
       "at least T_n = 3 columns for sequence 1, got 2 columns"},
      {"slot", RowState::kSlotOutOfRange, "'state_indices'", "slot 99 for sequence 1"},
      {"no_indices", RowState::kNoSlotForRow, "'state'", "got P = 1"},
  };
  for (const RowCase& rc : cases) {
    for (DType idt : {DType::kInt32, DType::kInt64}) {
      SCOPED_TRACE(std::string(rc.name) + (idt == DType::kInt32 ? " int32" : " int64"));
      DecodeCase c;
      c.N = 3;
      c.dtype = c.out_dtype = DType::kFloat32;
      c.index_dtype = idt;
      c.pool_extra = 2;
      if (rc.state == RowState::kAcceptedOutOfRange ||
          rc.state == RowState::kLongerThanIndexColumns) {
        c.seqlens = {2, 2, 1};
        c.indices = 2;
        c.num_accepted = true;
      }
      if (rc.state == RowState::kNoSlotForRow) c.indices = 0;
      DecodeData d = make_decode(c);
      if (rc.state == RowState::kNegativeSlot) d.idx.set(1, -7);
      if (rc.state == RowState::kSlotOutOfRange) d.idx.set(1, 99);
      if (rc.state == RowState::kAcceptedOutOfRange) d.nat.set(1, 0);
      if (rc.state == RowState::kLongerThanIndexColumns) {  // sequence 1 gets 3 tokens, Tmax 2
        d.cu.set(1, 1);
        d.nat.set(0, 1);
      }
      if (rc.state == RowState::kNoSlotForRow) {  // a pool of one slot for three rows
        d.state = HostTensor(DType::kFloat32, {1, c.HV, c.K, c.K});
        d.state.fill(0.25);
      }
      DecodeParams p = d.params();
      detail::DecodeProblem pr;
      ASSERT_TRUE(detail::validate_decode(p, &pr).ok());
      const rules::SeqSpan span = cpu::seq_span(pr.d, pr.cu_seqlens, 1);
      const rules::ReadSlot r =
          detail::decode_row_slot(pr, detail::own_index_data(pr), 1, span.len);
      EXPECT_EQ(r.state, rc.state);
      EXPECT_EQ(cpu::decode_read_slot(pr, 1, span.len), r.slot);
      if (rc.state == RowState::kNoSlotForRow) {  // row 0 has slot 0; rows 1 and 2 have none
        EXPECT_EQ(detail::decode_row_slot(pr, detail::own_index_data(pr), 0, span.len).state,
                  RowState::kLive);
      }

      const HostTensor out0 = d.out, state0 = d.state;
      p.check_indices = true;
      p.exec.backend = Backend::kCpu;
      const Status s = decode(p);
      if (!rules::is_index_error(rc.state)) {
        EXPECT_TRUE(s.ok()) << s.to_string();
      } else {
        EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
        EXPECT_NE(s.message().find(std::string("argument ") + rc.argument), std::string::npos)
            << s.message();
        EXPECT_NE(s.message().find(rc.detail), std::string::npos) << s.message();
        EXPECT_TRUE(bitwise_equal(d.out, out0));
        EXPECT_TRUE(bitwise_equal(d.state, state0));
      }
      // Without the check, every backend treats a non-live row as padding: zero output.
      for (Backend be : {Backend::kCpu, Backend::kCpuReference}) {
        DecodeData run = d;
        run.out.fill(5.0);
        DecodeParams q = run.params();
        q.exec.backend = be;
        ASSERT_TRUE(decode(q).ok());
        const rules::SeqSpan sp = cpu::seq_span(pr.d, pr.cu_seqlens, 1);
        const int64_t row_elems = c.HV * c.K;
        bool zero = true, untouched_marker = false;
        for (int64_t t = 0; t < sp.len; ++t)
          for (int64_t e = 0; e < row_elems; ++e) {
            const double x = run.out.get(((sp.b * pr.d.T) + sp.bos + t) * row_elems + e);
            zero = zero && x == 0.0;
            untouched_marker = untouched_marker || x == 5.0;
          }
        EXPECT_FALSE(untouched_marker) << "every token of row 1 is written";
        EXPECT_EQ(zero, !r.live()) << backend_name(be);
      }
    }
  }
}

}  // namespace
}  // namespace kda::test
