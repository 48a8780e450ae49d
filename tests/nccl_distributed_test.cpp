// kda::distributed_prefill over NCCL on several GPUs of one host (built with KDA_ENABLE_NCCL):
// one communicator per GPU (ncclCommInitAll), one thread per rank, each rank's slice on its own
// GPU, against the fp64 reference of the whole input. Skips without 2 (or 4) sm_90 GPUs.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <nccl.h>

#include <memory>
#include <numeric>
#include <thread>

#include "distributed_gpu_support.h"

namespace kda::test {
namespace {

int sm90_devices() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess || p.major != 9 || p.minor != 0) return 0;
  }
  return n;
}

class NcclDistributedPrefill : public ::testing::TestWithParam<DeviceSplit> {};

TEST_P(NcclDistributedPrefill, MatchesReference) {
  const DeviceSplit& sc = GetParam();
  const int world = static_cast<int>(sc.counts.size());
  if (sm90_devices() < world) GTEST_SKIP() << "needs " << world << " sm_90 GPUs";
  const PrefillCase c = case_of(sc);
  PrefillData d = make_prefill(c);
  ASSERT_EQ(std::accumulate(sc.counts.begin(), sc.counts.end(), int64_t{0}), d.T);
  const PrefillData ref = run_reference(d);

  std::vector<ncclComm_t> comms(world);
  std::vector<int> devices(world);
  std::iota(devices.begin(), devices.end(), 0);
  ASSERT_EQ(ncclCommInitAll(comms.data(), world, devices.data()), ncclSuccess);
  std::vector<HostTensor> outs(world), finals(world);
  std::vector<Status> status(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      const int64_t begin = std::accumulate(sc.counts.begin(), sc.counts.begin() + r, int64_t{0});
      DeviceCopies whole(d, r);
      HostTensor cu;
      PrefillParams p = slice_of(whole.p, d.cu_host, begin, sc.counts[r], &cu);
      if (sc.varlen) p.cu_seqlens = whole.add(cu);
      finals[r] = HostTensor(c.state_dtype, d.ht.shape);
      p.final_state = whole.add(finals[r]);
      const DeviceTensor* final_dev = whole.keep.back().get();
      cudaStream_t stream;
      KDA_TEST_CUDA(cudaSetDevice(r));
      KDA_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      std::unique_ptr<Communicator> comm;
      status[r] = make_nccl_communicator(comms[r], &comm);
      size_t bytes = 0;
      if (status[r].ok()) status[r] = distributed_prefill_workspace_size(p, world, &bytes);
      void* ws = nullptr;
      KDA_TEST_CUDA(cudaMalloc(&ws, bytes));
      p.exec.workspace = ws;
      p.exec.workspace_bytes = bytes;
      p.exec.stream = stream;
      if (status[r].ok()) status[r] = distributed_prefill(p, *comm);
      KDA_TEST_CUDA(cudaStreamSynchronize(stream));
      outs[r] = d.out;
      whole.out->download(outs[r]);
      final_dev->download(finals[r]);
      KDA_TEST_CUDA(cudaFree(ws));
      KDA_TEST_CUDA(cudaStreamDestroy(stream));
    });
  for (std::thread& t : threads) t.join();
  for (ncclComm_t comm : comms) ncclCommDestroy(comm);

  // Each rank's slice of the output, gathered into one tensor, and every rank's final states.
  HostTensor out = d.out;
  int64_t begin = 0;
  const int64_t per_token = d.out.numel() / (d.B * d.T);
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r].to_string();
    for (int64_t b = 0; b < d.B; ++b)
      for (int64_t t = begin; t < begin + sc.counts[r]; ++t)
        for (int64_t i = 0; i < per_token; ++i) {
          const int64_t flat = (b * d.T + t) * per_token + i;
          out.set(flat, outs[r].get(flat));
        }
    begin += sc.counts[r];
  }
  const double out_tol = tolerance_for(DType::kBFloat16), state_tol = 3e-3;  // the prefill's
  const Compare o = compare(out, ref.out, out_tol);
  EXPECT_TRUE(o.ok(out_tol)) << "out: rel L2 " << o.rel_l2 << o.first_mismatches;
  for (int r = 0; r < world; ++r) {
    const Compare f = compare(finals[r], ref.ht, state_tol);
    EXPECT_TRUE(f.ok(state_tol)) << "rank " << r << " final state: rel L2 " << f.rel_l2;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Nccl, NcclDistributedPrefill,
    ::testing::Values(
        DeviceSplit{"dense_2", {1500, 2596}, {4096}, false, GateForm::kLowerBound},
        DeviceSplit{"dense_weak_4", {1024, 1024, 0, 2048}, {4096}, false, GateForm::kPrecomputed},
        DeviceSplit{"varlen_spanning_4",
                    {700, 1300, 1000, 1096},
                    {300, 3000, 0, 796},
                    true,
                    GateForm::kSoftplus}),
    [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace kda::test
