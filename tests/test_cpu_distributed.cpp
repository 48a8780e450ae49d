// kda::distributed_prefill on CPU tensors: 2 and 4 ranks as threads (a Communicator over shared
// memory), each with its token slice, against the one-process kda::prefill of the whole input.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <thread>

#include "distributed_support.h"

namespace kda::test {
namespace {

GroupCommunicator host_rank(ThreadGroup* group, int rank) {
  return GroupCommunicator(
      group, rank, Device::kCPU, nullptr,
      [](void* dst, const void* src, size_t n, void*) { std::memcpy(dst, src, n); });
}

struct SplitCase {
  std::string name;
  std::vector<int64_t> counts;  // tokens per rank
  PrefillCase c;
};

// A precomputed gate is drawn weak (near 0) so that M carries the start state across a slice:
// with the other gates' decays the start state fades within a few dozen tokens.
PrefillCase case_of(std::vector<int64_t> seqlens, bool varlen, GateForm gate, InitState init,
                    StateLayout layout, DType state_dtype = DType::kFloat32, int64_t HV = 4) {
  PrefillCase c;
  c.seqlens = std::move(seqlens);
  c.varlen = varlen;
  c.H = 2;
  c.HV = HV;
  c.gate = gate;
  c.init = init;
  c.layout = layout;
  c.state_dtype = state_dtype;
  c.weak_decay = gate == GateForm::kPrecomputed;
  c.seed = 7;
  return c;
}

// The case with checkpoints every `every` tokens (global rows, global offsets).
PrefillCase checkpointed(PrefillCase c, int64_t every) {
  c.checkpoint_every = every;
  return c;
}

// The case in pool mode: N + 3 slots, shuffled indices, sequence 1 without a pooled state (-1)
// when N >= 3, and the last sequence with a slot >= P when N >= 4 (make_split_prefill).
PrefillCase pooled(PrefillCase c) {
  c.pool = true;
  return c;
}

// Checkpoint cases put rank cuts on and off checkpoint boundaries, with the tokens before a
// slice's first boundary longer and shorter than its first piece, and ending at the slice's end.
std::vector<SplitCase> cases() {
  const auto P = GateForm::kPrecomputed, S = GateForm::kSoftplus, L = GateForm::kLowerBound;
  const auto V = StateLayout::kVFirst, K = StateLayout::kKFirst;
  const auto R = InitState::kRandom, Z = InitState::kNone;
  const auto bf16 = DType::kBFloat16, fp32 = DType::kFloat32;
  return {
      {"dense_uneven_2", {37, 113}, case_of({150}, false, S, R, V)},
      {"dense_batch_2", {90, 60}, case_of({150, 150}, false, P, Z, K)},
      {"varlen_spanning_2", {61, 139}, case_of({20, 70, 0, 45, 65}, true, L, R, V)},
      {"varlen_empty_slice_2", {0, 150}, case_of({50, 100}, true, S, Z, K, fp32, 2)},
      {"dense_bf16_state_2", {70, 58}, case_of({128}, false, S, R, V, bf16)},
      {"dense_weak_2", {60, 68}, case_of({128}, false, P, R, V)},
      {"varlen_weak_2", {100, 100}, case_of({30, 150, 20}, true, P, R, V, bf16)},
      {"ckpt_dense_off_boundary_2", {37, 113}, checkpointed(case_of({150}, false, S, R, V), 64)},
      {"ckpt_dense_on_boundary_2", {64, 136}, checkpointed(case_of({200}, false, P, Z, K), 64)},
      {"ckpt_dense_batch_bf16_2",
       {90, 60},
       checkpointed(case_of({150, 150}, false, L, R, V, bf16), 64)},
      {"ckpt_varlen_spanning_2",
       {150, 140},
       checkpointed(case_of({70, 150, 0, 70}, true, L, R, V), 64)},
      {"ckpt_varlen_every128_2", {70, 200}, checkpointed(case_of({270}, true, S, R, K), 128)},
      {"pool_varlen_2", {61, 139}, pooled(case_of({20, 70, 0, 45, 65}, true, L, R, K))},
      {"pool_ckpt_varlen_2",
       {100, 190},
       pooled(checkpointed(case_of({70, 150, 0, 70}, true, S, R, V), 64))},
      {"dense_uneven_4", {10, 70, 0, 120}, case_of({200}, false, L, R, K)},
      {"varlen_one_spans_all_4", {30, 0, 80, 90}, case_of({5, 180, 15}, true, S, R, V)},
      {"varlen_spanning_4", {64, 64, 64, 8}, case_of({1, 99, 0, 33, 67}, true, P, Z, K)},
      {"dense_weak_4", {50, 20, 0, 58}, case_of({128, 128}, false, P, R, K)},
      {"varlen_weak_4", {40, 60, 60, 40}, case_of({190, 10}, true, P, R, V)},
      {"ckpt_dense_head_is_slice_4",
       {37, 27, 0, 136},
       checkpointed(case_of({200}, false, S, R, V), 64)},
      {"ckpt_dense_batch_4",
       {20, 0, 33, 115},
       checkpointed(case_of({168, 168, 168}, false, P, R, K), 64)},
      {"ckpt_varlen_short_heads_4",
       {30, 20, 80, 126},
       checkpointed(case_of({5, 200, 51}, true, P, R, V), 64)},
      {"ckpt_varlen_bf16_4",
       {64, 100, 28, 64},
       checkpointed(case_of({64, 100, 28, 64}, true, S, R, K, bf16), 64)},
      {"pool_dense_4", {10, 70, 0, 120}, pooled(case_of({200, 200, 200, 200}, false, S, R, V))},
      {"pool_bf16_4", {40, 41, 42, 77}, pooled(case_of({100, 100}, true, L, R, V, bf16))},
      {"pool_ckpt_weak_4",
       {64, 64, 64, 8},
       pooled(checkpointed(case_of({1, 99, 0, 33, 67}, true, P, R, K), 64))},
  };
}

void PrintTo(const SplitCase& sc, std::ostream* os) { *os << sc.name; }

class DistributedPrefill : public ::testing::TestWithParam<SplitCase> {};

// Every rank has its own pool (the same contents) and checkpoints (poisoned): a rank writes the
// checkpoint rows whose tokens it holds and the slots of the sequences whose last token it
// holds, and nothing else.
TEST_P(DistributedPrefill, MatchesOneProcessPrefill) {
  const SplitCase& sc = GetParam();
  const PrefillCase& c = sc.c;
  const int world = static_cast<int>(sc.counts.size());
  PrefillData ref = make_split_prefill(c);
  PrefillParams rp = ref.params();
  rp.exec.backend = Backend::kCpu;
  rp.exec.num_threads = 1;
  ASSERT_TRUE(prefill(rp).ok());

  PrefillData d = make_split_prefill(c);  // the same inputs (same seed), fresh outputs
  ASSERT_EQ(std::accumulate(sc.counts.begin(), sc.counts.end(), int64_t{0}), d.T);
  if (c.checkpoint_every > 0) ASSERT_GT(d.ckpt_off.get(d.N), 0) << "no checkpoint to compare";
  ThreadGroup group(world);
  std::vector<HostTensor> finals(world), pools(world), ckpts(world), cus(world);
  std::vector<std::vector<uint8_t>> workspaces(world);
  std::vector<Status> status(world);
  std::vector<int> gathers(world);
  std::vector<PrefillParams> locals(world);
  std::vector<int64_t> begins(world + 1, 0);
  for (int r = 0; r < world; ++r) {
    begins[r + 1] = begins[r] + sc.counts[r];
    PrefillParams p = slice_of(d.params(), d.cu_host, begins[r], sc.counts[r], &cus[r]);
    p.exec.backend = Backend::kCpu;
    p.exec.num_threads = 1;
    if (c.pool) {
      pools[r] = d.pool;
      p.state_pool = pools[r].view();
      p.check_indices = d.N < 4;  // no slot >= P
    } else {
      finals[r] = HostTensor(c.state_dtype, d.ht.shape);
      finals[r].fill_bytes(0xff);
      p.final_state = finals[r].view();
    }
    if (c.checkpoint_every > 0) {
      ckpts[r] = HostTensor(c.state_dtype, d.ckpt.shape);
      ckpts[r].fill_bytes(0xff);
      p.checkpoints = ckpts[r].view();
    }
    size_t bytes = 0;
    const Status s = distributed_prefill_workspace_size(p, world, &bytes);
    ASSERT_TRUE(s.ok()) << s.to_string();
    workspaces[r].resize(bytes);
    p.exec.workspace = workspaces[r].data();
    p.exec.workspace_bytes = bytes;
    locals[r] = p;
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      GroupCommunicator comm = host_rank(&group, r);
      status[r] = distributed_prefill(locals[r], comm);
      gathers[r] = comm.calls;
    });
  for (std::thread& t : threads) t.join();
  const bool exchange = c.pool || c.checkpoint_every > 0;  // the piece lengths, then the records
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r].to_string();
    EXPECT_EQ(gathers[r], exchange ? 2 : 1) << "rank " << r;
  }
  const double tol = tolerance_for(DType::kFloat32), st = tolerance_for(c.state_dtype);
  const Compare out = compare(d.out, ref.out, tol);
  EXPECT_TRUE(out.ok(tol)) << "out: rel L2 " << out.rel_l2 << " " << out.first_mismatches;
  int64_t rows_written = 0, slots_written = 0;
  for (int r = 0; r < world; ++r) {
    if (!c.pool) {
      const Compare fin = compare(finals[r], ref.ht, st);
      EXPECT_TRUE(fin.ok(st)) << "rank " << r << " final state: rel L2 " << fin.rel_l2 << " "
                              << fin.first_mismatches;
    } else {
      const std::vector<int64_t> mine = pool_slots_of(d, begins[r], begins[r + 1]);
      const std::vector<int64_t> others = other_rows(d.pool.shape[0], mine);
      slots_written += static_cast<int64_t>(mine.size());
      if (!mine.empty()) {
        const Compare pc = compare(rows_of(pools[r], mine), rows_of(ref.pool, mine), st);
        EXPECT_TRUE(pc.ok(st)) << "rank " << r << " pool slots: rel L2 " << pc.rel_l2 << " "
                               << pc.first_mismatches;
      }
      EXPECT_TRUE(bitwise_equal(rows_of(pools[r], others), rows_of(d.pool, others)))
          << "rank " << r << ": a slot it does not write changed";
    }
    if (c.checkpoint_every > 0) {
      const std::vector<int64_t> mine = checkpoint_rows_of(d, begins[r], begins[r + 1]);
      const std::vector<int64_t> others = other_rows(d.ckpt.shape[0], mine);
      rows_written += static_cast<int64_t>(mine.size());
      if (!mine.empty()) {
        const Compare cc = compare(rows_of(ckpts[r], mine), rows_of(ref.ckpt, mine), st);
        EXPECT_TRUE(cc.ok(st)) << "rank " << r << " checkpoints: rel L2 " << cc.rel_l2 << " "
                               << cc.first_mismatches;
      }
      HostTensor poison(c.state_dtype, d.ckpt.shape);
      poison.fill_bytes(0xff);
      EXPECT_TRUE(bitwise_equal(rows_of(ckpts[r], others), rows_of(poison, others)))
          << "rank " << r << ": a checkpoint row of another rank written";
    }
  }
  // Every checkpoint row has one writer; the pool slots written are those of the one-process
  // call, each by one rank.
  if (c.checkpoint_every > 0) EXPECT_EQ(rows_written, d.ckpt_off.get(d.N));
  if (c.pool) {
    int64_t live = 0;
    for (int64_t n = 0; n < d.N; ++n)
      live +=
          d.idx.get(n) >= 0 && d.idx.get(n) < d.pool.shape[0] && d.cu_host[n + 1] > d.cu_host[n];
    EXPECT_EQ(slots_written, live);
    EXPECT_GT(live, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Cpu, DistributedPrefill, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

// One rank: the same as kda::prefill; the validation and the workspace rule, nothing written.
class OneRank final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  Status all_gather(const void* send, void* recv, size_t bytes, Device, void*) override {
    std::memcpy(recv, send, bytes);
    return Status::Ok();
  }
};

TEST(DistributedPrefillErrors, RefusedBeforeAnyWrite) {
  PrefillCase c =
      case_of({70}, false, GateForm::kSoftplus, InitState::kRandom, StateLayout::kVFirst);
  PrefillData d = make_prefill(c);
  OneRank comm;
  PrefillParams p = d.params();
  p.exec.backend = Backend::kCpu;
  const HostTensor out0 = d.out, ht0 = d.ht;
  auto untouched = [&] { return bitwise_equal(d.out, out0) && bitwise_equal(d.ht, ht0); };

  size_t bytes = 0;
  ASSERT_TRUE(distributed_prefill_workspace_size(p, 1, &bytes).ok());
  EXPECT_GT(bytes, 0u);
  std::vector<uint8_t> ws(bytes);
  p.exec.workspace = ws.data();
  p.exec.workspace_bytes = bytes - 1;
  Status s = distributed_prefill(p, comm);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.argument(), "workspace") << s.to_string();
  EXPECT_TRUE(untouched());

  auto expect_refused = [&](const PrefillParams& bad, const char* argument) {
    size_t sized = 0;
    const Status q = distributed_prefill_workspace_size(bad, 1, &sized);
    EXPECT_EQ(q.code(), StatusCode::kInvalidArgument) << q.to_string();
    EXPECT_EQ(q.argument(), argument) << q.to_string();
    const Status s = distributed_prefill(bad, comm);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
    EXPECT_EQ(s.argument(), argument) << s.to_string();
    EXPECT_TRUE(untouched()) << argument;
  };
  PrefillParams bad = p;
  bad.exec.workspace_bytes = bytes;
  bad.k.dtype = DType::kFloat16;
  expect_refused(bad, "k");

  // Checkpoints: kda::prefill's rules, on the global layout.
  HostTensor ckpt(DType::kFloat32, {1, c.HV, c.V, c.K}), off(DType::kInt64, {2});
  off.set(1, 1);
  ckpt.fill_bytes(0xff);
  const HostTensor ckpt0 = ckpt;
  PrefillParams with_ckpt = p;
  with_ckpt.exec.workspace_bytes = bytes;
  with_ckpt.checkpoint_every = kChunkSize;
  with_ckpt.checkpoints = ckpt.view();
  with_ckpt.checkpoint_offsets = off.view();
  bad = with_ckpt;
  bad.checkpoint_every = kChunkSize / 2;
  expect_refused(bad, "checkpoint_every");
  HostTensor wide(DType::kFloat32, {1, c.HV, c.V, c.K + 1});
  bad = with_ckpt;
  bad.checkpoints = wide.view();
  expect_refused(bad, "checkpoints");
  HostTensor off3(DType::kInt64, {3}), off_past(DType::kInt64, {2});
  bad = with_ckpt;
  bad.checkpoint_offsets = off3.view();
  expect_refused(bad, "checkpoint_offsets");
  off_past.set(1, 2);  // past the one row
  bad.checkpoint_offsets = off_past.view();
  expect_refused(bad, "checkpoint_offsets");
  bad = with_ckpt;
  bad.checkpoint_offsets = {};
  expect_refused(bad, "checkpoint_offsets");
  EXPECT_TRUE(bitwise_equal(ckpt, ckpt0));
  // The checkpoint call needs more workspace than the plain one.
  size_t ckpt_bytes = 0;
  ASSERT_TRUE(distributed_prefill_workspace_size(with_ckpt, 1, &ckpt_bytes).ok());
  EXPECT_GT(ckpt_bytes, bytes);
  s = distributed_prefill(with_ckpt, comm);
  EXPECT_EQ(s.argument(), "workspace") << s.to_string();
  EXPECT_TRUE(untouched() && bitwise_equal(ckpt, ckpt0));

  // Pool mode: no initial/final state; check_indices reports bad slots on every rank.
  HostTensor pool(DType::kFloat32, {2, c.HV, c.V, c.K}), idx(DType::kInt32, {1});
  pool.fill_bytes(0x3f);
  const HostTensor pool0 = pool;
  PrefillParams with_pool = p;
  with_pool.exec.workspace_bytes = bytes;
  with_pool.initial_state = {};
  with_pool.final_state = {};
  with_pool.state_pool = pool.view();
  with_pool.state_indices = idx.view();
  bad = with_pool;
  bad.final_state = d.ht.view();
  expect_refused(bad, "final_state");
  bad = with_pool;
  bad.initial_state = d.h0.view();
  expect_refused(bad, "initial_state");
  bad = with_pool;
  bad.state_indices = {};
  expect_refused(bad, "state_indices");
  bad = with_pool;
  bad.state_pool = {};
  expect_refused(bad, "state_pool");
  size_t pool_bytes = 0;
  ASSERT_TRUE(distributed_prefill_workspace_size(with_pool, 1, &pool_bytes).ok());
  std::vector<uint8_t> pool_ws(pool_bytes);
  with_pool.exec.workspace = pool_ws.data();
  with_pool.exec.workspace_bytes = pool_bytes;
  bad = with_pool;
  bad.check_indices = true;
  idx.set(0, 2);  // >= P
  s = distributed_prefill(bad, comm);
  EXPECT_EQ(s.argument(), "state_indices") << s.to_string();
  EXPECT_NE(s.message().find("slot 2 for sequence 0"), std::string::npos) << s.to_string();
  EXPECT_TRUE(untouched() && bitwise_equal(pool, pool0));
  // Two sequences of one slot (varlen, the second spanning the rest).
  HostTensor cu(DType::kInt64, {3}), idx2(DType::kInt64, {2});
  cu.set(1, 30);
  cu.set(2, 70);
  idx2.set(0, 1);
  idx2.set(1, 1);
  bad = with_pool;
  bad.check_indices = true;
  bad.cu_seqlens = cu.view();
  bad.state_indices = idx2.view();
  s = distributed_prefill(bad, comm);
  EXPECT_EQ(s.argument(), "state_indices") << s.to_string();
  EXPECT_NE(s.message().find("sequences 0 and 1"), std::string::npos) << s.to_string();
  EXPECT_TRUE(untouched() && bitwise_equal(pool, pool0));

  // A slot >= P without check_indices: no pooled state (start from zero, the slot not written),
  // as kda::prefill.
  PrefillData z = make_prefill(c);
  PrefillParams zp = z.params();
  zp.final_state = {};
  zp.initial_state = {};
  zp.exec.backend = Backend::kCpu;
  ASSERT_TRUE(prefill(zp).ok());
  s = distributed_prefill(with_pool, comm);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_TRUE(bitwise_equal(pool, pool0));
  const double tol = tolerance_for(DType::kFloat32);
  EXPECT_TRUE(compare(d.out, z.out, tol).ok(tol));
  d.out = out0;

  // The allocator is called once, for the whole workspace.
  struct Arena {
    std::vector<uint8_t> memory;
    int calls = 0;
  } arena;
  p.exec.workspace = nullptr;
  p.exec.workspace_bytes = 0;
  p.exec.allocate_context = &arena;
  p.exec.allocate_workspace = [](size_t n, void* context) -> void* {
    Arena* a = static_cast<Arena*>(context);
    ++a->calls;
    a->memory.resize(n);
    return a->memory.data();
  };
  ASSERT_TRUE(distributed_prefill(p, comm).ok());
  EXPECT_EQ(arena.calls, 1);
  PrefillData ref = make_prefill(c);
  PrefillParams rp = ref.params();
  rp.exec.backend = Backend::kCpu;
  ASSERT_TRUE(prefill(rp).ok());
  EXPECT_TRUE(compare(d.out, ref.out, tol).ok(tol));
  EXPECT_TRUE(compare(d.ht, ref.ht, tol).ok(tol));

  EXPECT_EQ(local_cu_seqlens({0, 5, 20, 20, 31}, 10, 25), (std::vector<int64_t>{0, 0, 10, 10, 15}));
  std::unique_ptr<Communicator> nccl;
  EXPECT_FALSE(make_nccl_communicator(nullptr, &nccl).ok());  // no NCCL, or no communicator
}

}  // namespace
}  // namespace kda::test
