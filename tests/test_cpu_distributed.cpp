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

std::vector<SplitCase> cases() {
  const auto P = GateForm::kPrecomputed, S = GateForm::kSoftplus, L = GateForm::kLowerBound;
  const auto V = StateLayout::kVFirst, K = StateLayout::kKFirst;
  const auto R = InitState::kRandom, Z = InitState::kNone;
  return {
      {"dense_uneven_2", {37, 113}, case_of({150}, false, S, R, V)},
      {"dense_batch_2", {90, 60}, case_of({150, 150}, false, P, Z, K)},
      {"varlen_spanning_2", {61, 139}, case_of({20, 70, 0, 45, 65}, true, L, R, V)},
      {"varlen_empty_slice_2", {0, 150}, case_of({50, 100}, true, S, Z, K, DType::kFloat32, 2)},
      {"dense_bf16_state_2", {70, 58}, case_of({128}, false, S, R, V, DType::kBFloat16)},
      {"dense_weak_2", {60, 68}, case_of({128}, false, P, R, V)},
      {"varlen_weak_2", {100, 100}, case_of({30, 150, 20}, true, P, R, V, DType::kBFloat16)},
      {"dense_uneven_4", {10, 70, 0, 120}, case_of({200}, false, L, R, K)},
      {"varlen_one_spans_all_4", {30, 0, 80, 90}, case_of({5, 180, 15}, true, S, R, V)},
      {"varlen_spanning_4", {64, 64, 64, 8}, case_of({1, 99, 0, 33, 67}, true, P, Z, K)},
      {"dense_weak_4", {50, 20, 0, 58}, case_of({128, 128}, false, P, R, K)},
      {"varlen_weak_4", {40, 60, 60, 40}, case_of({190, 10}, true, P, R, V)},
  };
}

class DistributedPrefill : public ::testing::TestWithParam<SplitCase> {};

TEST_P(DistributedPrefill, MatchesOneProcessPrefill) {
  const SplitCase& sc = GetParam();
  const int world = static_cast<int>(sc.counts.size());
  PrefillData ref = make_prefill(sc.c);
  PrefillParams rp = ref.params();
  rp.exec.backend = Backend::kCpu;
  rp.exec.num_threads = 1;
  ASSERT_TRUE(prefill(rp).ok());

  PrefillData d = make_prefill(sc.c);  // the same inputs (same seed), fresh outputs
  ASSERT_EQ(std::accumulate(sc.counts.begin(), sc.counts.end(), int64_t{0}), d.T);
  ThreadGroup group(world);
  std::vector<HostTensor> finals(world), cus(world);
  std::vector<std::vector<uint8_t>> workspaces(world);
  std::vector<Status> status(world);
  std::vector<int> gathers(world);
  std::vector<PrefillParams> locals(world);
  int64_t begin = 0;
  for (int r = 0; r < world; ++r) {
    const int64_t count = sc.counts[r];
    PrefillParams p = slice_of(d.params(), d.cu_host, begin, count, &cus[r]);
    p.exec.backend = Backend::kCpu;
    p.exec.num_threads = 1;
    finals[r] = HostTensor(sc.c.state_dtype, d.ht.shape);
    finals[r].fill_bytes(0xff);
    p.final_state = finals[r].view();
    size_t bytes = 0;
    ASSERT_TRUE(distributed_prefill_workspace_size(p, world, &bytes).ok());
    workspaces[r].resize(bytes);
    p.exec.workspace = workspaces[r].data();
    p.exec.workspace_bytes = bytes;
    locals[r] = p;
    begin += count;
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      GroupCommunicator comm = host_rank(&group, r);
      status[r] = distributed_prefill(locals[r], comm);
      gathers[r] = comm.calls;
    });
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r].to_string();
    EXPECT_EQ(gathers[r], 1) << "rank " << r;
  }
  const double tol = tolerance_for(DType::kFloat32);
  const Compare out = compare(d.out, ref.out, tol);
  EXPECT_TRUE(out.ok(tol)) << "out: rel L2 " << out.rel_l2 << " " << out.first_mismatches;
  for (int r = 0; r < world; ++r) {
    const double st = tolerance_for(sc.c.state_dtype);
    const Compare fin = compare(finals[r], ref.ht, st);
    EXPECT_TRUE(fin.ok(st)) << "rank " << r << " final state: rel L2 " << fin.rel_l2 << " "
                            << fin.first_mismatches;
  }
}

INSTANTIATE_TEST_SUITE_P(Cpu, DistributedPrefill, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

// One rank: the same as kda::prefill; the refusals and the workspace rule, nothing written.
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

  auto expect_refused = [&](const PrefillParams& bad, StatusCode code, const char* argument) {
    const Status s = distributed_prefill(bad, comm);
    EXPECT_EQ(s.code(), code) << s.to_string();
    EXPECT_EQ(s.argument(), argument) << s.to_string();
    EXPECT_TRUE(untouched()) << argument;
  };
  PrefillParams bad = p;
  bad.exec.workspace_bytes = bytes;
  bad.checkpoint_every = kChunkSize;
  HostTensor ckpt(DType::kFloat32, {1, c.HV, c.V, c.K});
  HostTensor off(DType::kInt64, {2});
  off.set(1, 1);
  bad.checkpoints = ckpt.view();
  bad.checkpoint_offsets = off.view();
  expect_refused(bad, StatusCode::kUnsupported, "checkpoints");

  bad = p;
  bad.exec.workspace_bytes = bytes;
  HostTensor pool(DType::kFloat32, {2, c.HV, c.V, c.K}), idx(DType::kInt32, {1});
  bad.initial_state = bad.final_state = {};
  bad.state_pool = pool.view();
  bad.state_indices = idx.view();
  expect_refused(bad, StatusCode::kUnsupported, "state_pool");

  bad = p;
  bad.exec.workspace_bytes = bytes;
  bad.k.dtype = DType::kFloat16;
  expect_refused(bad, StatusCode::kInvalidArgument, "k");

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
  const double tol = tolerance_for(DType::kFloat32);
  EXPECT_TRUE(compare(d.out, ref.out, tol).ok(tol));
  EXPECT_TRUE(compare(d.ht, ref.ht, tol).ok(tol));

  EXPECT_EQ(local_cu_seqlens({0, 5, 20, 20, 31}, 10, 25), (std::vector<int64_t>{0, 0, 10, 10, 15}));
  std::unique_ptr<Communicator> nccl;
  EXPECT_FALSE(make_nccl_communicator(nullptr, &nccl).ok());  // no NCCL, or no communicator
}

}  // namespace
}  // namespace kda::test
