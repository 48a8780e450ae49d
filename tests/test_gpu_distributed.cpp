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

TEST_P(GpuDistributedPrefill, MatchesReference) {
  KDA_SKIP_WITHOUT_SM90();
  const DeviceSplit& sc = GetParam();
  const PrefillCase c = case_of(sc);
  const int world = static_cast<int>(sc.counts.size());
  PrefillData d = make_prefill(c);
  ASSERT_EQ(std::accumulate(sc.counts.begin(), sc.counts.end(), int64_t{0}), d.T);
  const PrefillData ref = run_reference(d);
  DeviceCopies whole(d, 0);

  ThreadGroup group(world);
  std::vector<HostTensor> cus(world), finals(world);
  std::vector<DeviceTensor*> final_dev(world);
  std::vector<PrefillParams> locals(world);
  std::vector<cudaStream_t> streams(world);
  std::vector<void*> workspaces(world, nullptr);
  int64_t begin = 0;
  for (int r = 0; r < world; ++r) {
    PrefillParams p = slice_of(whole.p, d.cu_host, begin, sc.counts[r], &cus[r]);
    if (sc.varlen) p.cu_seqlens = whole.add(cus[r]);
    finals[r] = HostTensor(c.state_dtype, d.ht.shape);
    p.final_state = whole.add(finals[r]);
    final_dev[r] = whole.keep.back().get();
    KDA_TEST_CUDA(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking));
    size_t bytes = 0;
    const Status s = distributed_prefill_workspace_size(p, world, &bytes);
    ASSERT_TRUE(s.ok()) << s.to_string();
    KDA_TEST_CUDA(cudaMalloc(&workspaces[r], bytes));
    p.exec.workspace = workspaces[r];
    p.exec.workspace_bytes = bytes;
    p.exec.stream = streams[r];
    locals[r] = p;
    begin += sc.counts[r];
  }
  std::vector<Status> status(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      GroupCommunicator comm = device_rank(&group, r);
      status[r] = distributed_prefill(locals[r], comm);
      KDA_TEST_CUDA(cudaStreamSynchronize(streams[r]));
    });
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r].to_string();
    KDA_TEST_CUDA(cudaFree(workspaces[r]));
    KDA_TEST_CUDA(cudaStreamDestroy(streams[r]));
  }
  whole.out->download(d.out);
  const double out_tol = tolerance_for(DType::kBFloat16), state_tol = 3e-3;  // as the prefill's
  const Compare o = compare(d.out, ref.out, out_tol);
  EXPECT_TRUE(o.ok(out_tol)) << "out: rel L2 " << o.rel_l2 << o.first_mismatches;
  for (int r = 0; r < world; ++r) {
    final_dev[r]->download(finals[r]);
    const Compare f = compare(finals[r], ref.ht, state_tol);
    EXPECT_TRUE(f.ok(state_tol)) << "rank " << r << " final state: rel L2 " << f.rel_l2
                                 << f.first_mismatches;
  }
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
                                                       StateLayout::kVFirst}),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace kda::test
