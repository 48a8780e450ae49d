// graph_launch.h — a chain of kernel launches run as one CUDA graph launch, for the host cost of
// multi-kernel calls (the prefill's two or four kernels).
//
// A launch costs 2.5-3.5 us of host time; a graph of the same kernels is one launch plus one
// parameter update per kernel. Each host thread keeps one executable graph per (device, stream,
// chain length) (a graph's launches are ordered behind its own earlier launches, so one per stream
// keeps streams independent), built on first use with the chain's dependencies (programmatic when
// PDL is on, as between stream launches) and updated in place for each call: kernel, grid, block,
// shared memory and parameters may all change between calls. Not used while the stream is being
// captured (the caller launches directly into the capture). Nothing is allocated on the device.
#pragma once

#include <cuda_runtime.h>

namespace kda::cuda {

struct ChainStep {
  const void* kernel;  // a __global__ function taking one parameter
  dim3 grid, block;
  unsigned smem;  // dynamic shared memory; the kernel's limit already raised to it
  void* param;    // that parameter's value (copied by the call)
};

// Runs steps[0..n) in order on `stream` as one graph launch (n in [2, kMaxChainSteps]), each step
// dependent on the one before (through programmatic dependencies when `pdl`). Returns true when
// launched; false when nothing was launched (the stream is capturing, graphs are unavailable, or
// building or updating the graph failed; the runtime's error state is left clear): the caller then
// launches the steps itself.
inline constexpr int kMaxChainSteps = 4;
bool launch_chain(const ChainStep* steps, int n, bool pdl, int device, cudaStream_t stream);

// Testing hook: how many chains the calling thread has launched as graphs (launch_chain returned
// true), so that a test can tell the graph launch from the direct launches it falls back to.
unsigned long long chain_launch_count();

}  // namespace kda::cuda
