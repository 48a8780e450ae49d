// gpu_support.h — the GPU tests' helpers: tuning edits, the sm_90 check, graph capture, device
// mirrors of a whole problem and poisoned workspaces (header-only; include only from targets that
// link the CUDA runtime and GoogleTest).
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/tuning.h"
#include "device_tensor.h"
#include "support.h"

namespace kda::test {

// The tuning in effect with `edit` applied, for a detail::ScopedTuning (tests steer kernels through
// the tuning struct, never the environment):
//   const detail::ScopedTuning scope(tuned([](detail::Tuning& t) { t.prefill_chunk = 16; }));
template <typename Edit>
detail::Tuning tuned(Edit&& edit) {
  detail::Tuning t = detail::tuning();
  edit(t);
  return t;
}

// True when device 0 is an sm_90 GPU the CUDA kernels run on.
inline bool have_sm90() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    return false;
  }
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, 0) != cudaSuccess) return false;
  return p.major == 9 && p.minor == 0;
}

#define KDA_SKIP_WITHOUT_SM90()                                    \
  do {                                                             \
    if (!::kda::test::have_sm90()) GTEST_SKIP() << "no sm_90 GPU"; \
  } while (0)

// Captures call() (one library call on `stream`) into a CUDA graph, replays it once and waits;
// returns the call's status (a failed call is not replayed).
template <class Call>
Status capture_and_replay(cudaStream_t stream, Call call) {
  cudaGraph_t graph;
  KDA_TEST_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const Status s = call();
  KDA_TEST_CUDA(cudaStreamEndCapture(stream, &graph));
  if (s.ok()) {
    cudaGraphExec_t exec;
    KDA_TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    KDA_TEST_CUDA(cudaGraphLaunch(exec, stream));
    KDA_TEST_CUDA(cudaStreamSynchronize(stream));
    KDA_TEST_CUDA(cudaGraphExecDestroy(exec));
  }
  KDA_TEST_CUDA(cudaGraphDestroy(graph));
  return s;
}

// The fp64 reference of a prefill on the widened inputs.
inline PrefillData run_reference(const PrefillData& d) {
  PrefillData ref = widen(d);
  PrefillParams p = ref.params();
  p.exec.backend = Backend::kCpuReference;
  const Status s = prefill(p);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return ref;
}

// Device mirrors of every tensor of `d`.
struct DeviceData {
  std::vector<std::unique_ptr<DeviceTensor>> keep;
  PrefillParams p;
  DeviceTensor *out = nullptr, *ht = nullptr, *pool = nullptr, *ckpt = nullptr;

  explicit DeviceData(const PrefillData& d) {
    p = d.params();
    auto dev = [&](const HostTensor& h) -> DeviceTensor* {
      keep.push_back(std::make_unique<DeviceTensor>(h));
      return keep.back().get();
    };
    p.q = dev(d.q)->view();
    p.k = dev(d.k)->view();
    p.v = dev(d.v)->view();
    p.g = dev(d.g)->view();
    p.beta = dev(d.beta)->view();
    p.A_log = dev(d.A_log)->view();
    p.dt_bias = dev(d.dt_bias)->view();
    p.cu_seqlens = dev(d.cu)->view();
    out = dev(d.out);
    p.out = out->view();
    p.initial_state = dev(d.h0)->view();
    ht = dev(d.ht);
    p.final_state = ht->view();
    pool = dev(d.pool);
    p.state_pool = pool->view();
    p.state_indices = dev(d.idx)->view();
    ckpt = dev(d.ckpt);
    p.checkpoints = ckpt->view();
    p.checkpoint_offsets = dev(d.ckpt_off)->view();
    p.exec.backend = Backend::kCuda;
  }
};

// Device workspace of `bytes` (freed on destruction), poisoned with 0xff bytes (NaN as fp32 and
// bf16): a kernel that read a part of the workspace that no kernel of the call wrote (the records'
// zero parts, common.cuh) would put NaN into the results.
struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) {
    if (bytes) {
      KDA_TEST_CUDA(cudaMalloc(&ptr, bytes));
      KDA_TEST_CUDA(cudaMemset(ptr, 0xff, bytes));
    }
  }
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
};

}  // namespace kda::test
