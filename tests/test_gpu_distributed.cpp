// kda::distributed_prefill on CUDA tensors of one GPU: 2 and 4 ranks as threads, each on its
// own stream (a Communicator of device copies), against the fp64 reference of the whole input.
// The same code runs over NCCL across GPUs (make_nccl_communicator).
#include <gtest/gtest.h>

#include <memory>
#include <numeric>
#include <thread>

#include "distributed_gpu_support.h"

namespace kda::test {
namespace {

// A rank on its own stream: its record complete before the gather, device copies after.
GroupCommunicator device_rank(ThreadGroup* group, int rank) {
  return GroupCommunicator(
      group, rank, Device::kCUDA,
      [](void* stream) { KDA_TEST_CUDA(cudaStreamSynchronize(static_cast<cudaStream_t>(stream))); },
      [](void* dst, const void* src, size_t n, void* stream) {
        const cudaStream_t s = static_cast<cudaStream_t>(stream);
        KDA_TEST_CUDA(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, s));
        KDA_TEST_CUDA(cudaStreamSynchronize(s));
      });
}

class GpuDistributedPrefill : public ::testing::TestWithParam<DeviceSplit> {};

// Every rank has its own pool (the same contents) and checkpoints (poisoned): a rank writes the
// checkpoint rows whose tokens it holds and the slots of the sequences whose last token it
// holds, and nothing else.
TEST_P(GpuDistributedPrefill, MatchesReference) {
  KDA_SKIP_WITHOUT_SM90();
  const DeviceSplit& sc = GetParam();
  const PrefillCase c = case_of(sc);
  const int world = static_cast<int>(sc.counts.size());
  PrefillData d = make_split_prefill(c);
  ASSERT_EQ(std::accumulate(sc.counts.begin(), sc.counts.end(), int64_t{0}), d.T);
  if (c.checkpoint_every > 0) ASSERT_GT(d.ckpt_off.get(d.N), 0) << "no checkpoint to compare";
  const PrefillData ref = run_reference(d);
  DeviceCopies whole(d, 0);
  HostTensor poison;
  if (c.checkpoint_every > 0) {
    poison = HostTensor(c.state_dtype, d.ckpt.shape);
    poison.fill_bytes(0xff);
  }

  ThreadGroup group(world);
  std::vector<HostTensor> cus(world), states(world), ckpts(world);
  std::vector<DeviceTensor*> state_dev(world), ckpt_dev(world);
  std::vector<PrefillParams> locals(world);
  std::vector<cudaStream_t> streams(world);
  std::vector<void*> workspaces(world, nullptr);
  std::vector<int64_t> begins(world + 1, 0);
  for (int r = 0; r < world; ++r) {
    begins[r + 1] = begins[r] + sc.counts[r];
    PrefillParams p = slice_of(whole.p, d.cu_host, begins[r], sc.counts[r], &cus[r]);
    if (sc.varlen) p.cu_seqlens = whole.add(cus[r]);
    if (c.pool) {
      states[r] = d.pool;
      p.state_pool = whole.add(states[r]);
      state_dev[r] = whole.keep.back().get();
      p.state_indices = whole.add(d.idx);
      p.check_indices = d.N < 4;  // no slot >= P (the check copies the indices and syncs)
    } else {
      states[r] = HostTensor(c.state_dtype, d.ht.shape);
      p.final_state = whole.add(states[r]);
      state_dev[r] = whole.keep.back().get();
    }
    if (c.checkpoint_every > 0) {
      ckpts[r] = poison;
      p.checkpoints = whole.add(ckpts[r]);
      ckpt_dev[r] = whole.keep.back().get();
      p.checkpoint_offsets = whole.add(d.ckpt_off);
    }
    KDA_TEST_CUDA(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking));
    size_t bytes = 0;
    const Status s = distributed_prefill_workspace_size(p, world, &bytes);
    ASSERT_TRUE(s.ok()) << s.to_string();
    KDA_TEST_CUDA(cudaMalloc(&workspaces[r], bytes));
    p.exec.workspace = workspaces[r];
    p.exec.workspace_bytes = bytes;
    p.exec.stream = streams[r];
    locals[r] = p;
  }
  std::vector<Status> status(world);
  std::vector<int> gathers(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      GroupCommunicator comm = device_rank(&group, r);
      status[r] = distributed_prefill(locals[r], comm);
      gathers[r] = comm.calls;
      KDA_TEST_CUDA(cudaStreamSynchronize(streams[r]));
    });
  for (std::thread& t : threads) t.join();
  const bool exchange = c.pool || c.checkpoint_every > 0;  // the piece lengths, then the records
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r].to_string();
    EXPECT_EQ(gathers[r], exchange ? 2 : 1) << "rank " << r;
    KDA_TEST_CUDA(cudaFree(workspaces[r]));
    KDA_TEST_CUDA(cudaStreamDestroy(streams[r]));
  }
  whole.out->download(d.out);
  const double out_tol = tolerance_for(DType::kBFloat16), state_tol = 3e-3;  // as the prefill's
  const Compare o = compare(d.out, ref.out, out_tol);
  EXPECT_TRUE(o.ok(out_tol)) << "out: rel L2 " << o.rel_l2 << o.first_mismatches;
  int64_t rows_written = 0;
  for (int r = 0; r < world; ++r) {
    state_dev[r]->download(states[r]);
    if (!c.pool) {
      const Compare f = compare(states[r], ref.ht, state_tol);
      EXPECT_TRUE(f.ok(state_tol))
          << "rank " << r << " final state: rel L2 " << f.rel_l2 << f.first_mismatches;
    } else {
      const std::vector<int64_t> mine = pool_slots_of(d, begins[r], begins[r + 1]);
      const std::vector<int64_t> others = other_rows(d.pool.shape[0], mine);
      if (!mine.empty()) {
        const Compare f = compare(rows_of(states[r], mine), rows_of(ref.pool, mine), state_tol);
        EXPECT_TRUE(f.ok(state_tol))
            << "rank " << r << " pool slots: rel L2 " << f.rel_l2 << f.first_mismatches;
      }
      EXPECT_TRUE(bitwise_equal(rows_of(states[r], others), rows_of(d.pool, others)))
          << "rank " << r << ": a slot it does not write changed";
    }
    if (c.checkpoint_every > 0) {
      ckpt_dev[r]->download(ckpts[r]);
      const std::vector<int64_t> mine = checkpoint_rows_of(d, begins[r], begins[r + 1]);
      const std::vector<int64_t> others = other_rows(d.ckpt.shape[0], mine);
      rows_written += static_cast<int64_t>(mine.size());
      if (!mine.empty()) {
        const Compare f = compare(rows_of(ckpts[r], mine), rows_of(ref.ckpt, mine), state_tol);
        EXPECT_TRUE(f.ok(state_tol))
            << "rank " << r << " checkpoints: rel L2 " << f.rel_l2 << f.first_mismatches;
      }
      EXPECT_TRUE(bitwise_equal(rows_of(ckpts[r], others), rows_of(poison, others)))
          << "rank " << r << ": a checkpoint row of another rank written";
    }
  }
  if (c.checkpoint_every > 0) EXPECT_EQ(rows_written, d.ckpt_off.get(d.N));
}

INSTANTIATE_TEST_SUITE_P(Gpu, GpuDistributedPrefill,
                         ::testing::Values(DeviceSplit{"dense_2",
                                                       {700, 1348},
                                                       {2048},
                                                       false,
                                                       GateForm::kLowerBound,
                                                       StateLayout::kVFirst},
                                           DeviceSplit{"dense_weak_4",
                                                       {512, 300, 0, 1236},
                                                       {2048},
                                                       false,
                                                       GateForm::kPrecomputed,
                                                       StateLayout::kKFirst},
                                           DeviceSplit{"varlen_spanning_4",
                                                       {400, 400, 400, 300},
                                                       {100, 1000, 0, 400},
                                                       true,
                                                       GateForm::kSoftplus,
                                                       StateLayout::kVFirst},
                                           DeviceSplit{"varlen_weak_2",
                                                       {1000, 500},
                                                       {1200, 300},
                                                       true,
                                                       GateForm::kPrecomputed,
                                                       StateLayout::kVFirst},
                                           // Checkpoints: a cut off a boundary (a 68-token
                                           // head), on one, a head that is a whole slice (12
                                           // tokens up to a boundary), rows in every rank.
                                           DeviceSplit{"ckpt_dense_2",
                                                       {700, 1348},
                                                       {2048},
                                                       false,
                                                       GateForm::kLowerBound,
                                                       StateLayout::kVFirst,
                                                       128},
                                           DeviceSplit{"ckpt_dense_batch_weak_4",
                                                       {500, 12, 0, 1536},
                                                       {2048, 2048},
                                                       false,
                                                       GateForm::kPrecomputed,
                                                       StateLayout::kKFirst,
                                                       64},
                                           DeviceSplit{"ckpt_varlen_spanning_4",
                                                       {400, 400, 400, 300},
                                                       {100, 1000, 0, 400},
                                                       true,
                                                       GateForm::kSoftplus,
                                                       StateLayout::kVFirst,
                                                       64},
                                           // Pools: a -1 slot and a slot >= P (4 sequences), and
                                           // with check_indices and checkpoints (2 sequences).
                                           DeviceSplit{"pool_varlen_4",
                                                       {400, 400, 400, 300},
                                                       {100, 1000, 0, 400},
                                                       true,
                                                       GateForm::kSoftplus,
                                                       StateLayout::kKFirst,
                                                       0,
                                                       true},
                                           DeviceSplit{"pool_ckpt_weak_2",
                                                       {1000, 500},
                                                       {1200, 300},
                                                       true,
                                                       GateForm::kPrecomputed,
                                                       StateLayout::kVFirst,
                                                       64,
                                                       true}),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace kda::test
