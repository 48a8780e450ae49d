// graph_launch.cpp — see graph_launch.h.
#include "cuda/common/graph_launch.h"

#include <cuda.h>

#include <cstddef>
#include <vector>

#include "core/tuning.h"
#include "cuda/common/device.h"

namespace kda::cuda {
namespace {

// The driver's parameter update and graph launch (no libcuda link: the runtime's entry-point
// query), looked up once; both null when either is unavailable (the runtime's calls are used).
using SetParamsFn = CUresult (*)(CUgraphExec, CUgraphNode, const CUDA_KERNEL_NODE_PARAMS_v2*);
using GraphLaunchFn = CUresult (*)(CUgraphExec, CUstream);
struct DriverGraph {
  SetParamsFn set = nullptr;
  GraphLaunchFn launch = nullptr;
};

const DriverGraph& driver_graph() {
  static const DriverGraph fns = [] {
    DriverGraph g;
    void* set = driver_entry_point("cuGraphExecKernelNodeSetParams");
    void* launch = driver_entry_point("cuGraphLaunch");
    if (set == nullptr || launch == nullptr) return g;
    g.set = reinterpret_cast<SetParamsFn>(set);
    g.launch = reinterpret_cast<GraphLaunchFn>(launch);
    return g;
  }();
  return fns;
}

struct Chain {
  int device = -1;
  cudaStream_t stream = nullptr;
  int n = 0;
  bool pdl = false;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cudaGraphNode_t nodes[kMaxChainSteps] = {};
};

void destroy(Chain& c) {
  if (c.exec != nullptr) (void)cudaGraphExecDestroy(c.exec);
  if (c.graph != nullptr) (void)cudaGraphDestroy(c.graph);
  c.exec = nullptr;
  c.graph = nullptr;
}

// The calling thread's graphs, most recently built last; at most kMaxChains (the oldest goes).
constexpr size_t kMaxChains = 8;
struct Chains {
  std::vector<Chain> list;
  ~Chains() {
    for (Chain& c : list) destroy(c);
  }
};
thread_local Chains t_chains;
thread_local unsigned long long t_launched = 0;

cudaKernelNodeParams node_params(const ChainStep& s, void** args) {
  cudaKernelNodeParams kp = {};
  kp.func = const_cast<void*>(s.kernel);
  kp.gridDim = s.grid;
  kp.blockDim = s.block;
  kp.sharedMemBytes = s.smem;
  kp.kernelParams = args;
  kp.extra = nullptr;
  return kp;
}

// Builds the graph of `steps` (their values as the nodes' first parameters) and instantiates it.
bool build(const ChainStep* steps, int n, bool pdl, Chain* c) {
  if (cudaGraphCreate(&c->graph, 0) != cudaSuccess) return false;
  for (int i = 0; i < n; ++i) {
    void* args[1] = {steps[i].param};
    const cudaKernelNodeParams kp = node_params(steps[i], args);
    if (cudaGraphAddKernelNode(&c->nodes[i], c->graph, nullptr, 0, &kp) != cudaSuccess)
      return false;
    if (i == 0) continue;
    cudaGraphEdgeData edge = {};
    if (pdl) {
      edge.from_port = cudaGraphKernelNodePortProgrammatic;
      edge.type = cudaGraphDependencyTypeProgrammatic;
    }
    if (cudaGraphAddDependencies(c->graph, &c->nodes[i - 1], &c->nodes[i], &edge, 1) != cudaSuccess)
      return false;
  }
  return cudaGraphInstantiate(&c->exec, c->graph, 0) == cudaSuccess;
}

Chain* find_or_build(const ChainStep* steps, int n, bool pdl, int device, cudaStream_t stream) {
  std::vector<Chain>& list = t_chains.list;
  for (Chain& c : list)
    if (c.device == device && c.stream == stream && c.n == n && c.pdl == pdl) return &c;
  Chain c;
  c.device = device;
  c.stream = stream;
  c.n = n;
  c.pdl = pdl;
  // Relaxed capture interaction while building: instantiating a graph may allocate, which a
  // global-mode capture of another stream (this thread's or any) could count as unsafe.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  const bool exchanged = cudaThreadExchangeStreamCaptureMode(&mode) == cudaSuccess;
  const bool built = build(steps, n, pdl, &c);
  if (exchanged) (void)cudaThreadExchangeStreamCaptureMode(&mode);
  if (!built) {
    destroy(c);
    return nullptr;
  }
  if (list.size() >= kMaxChains) {
    destroy(list.front());
    list.erase(list.begin());
  }
  list.push_back(c);
  return &list.back();
}

void drop(Chain* c) {
  std::vector<Chain>& list = t_chains.list;
  destroy(*c);
  list.erase(list.begin() + (c - list.data()));
}

}  // namespace

bool launch_chain(const ChainStep* steps, int n, bool pdl, int device, cudaStream_t stream) {
  if (n < 2 || n > kMaxChainSteps) return false;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  if (capture != cudaStreamCaptureStatusNone) return false;
  Chain* c = find_or_build(steps, n, pdl, device, stream);
  if (c == nullptr) {
    (void)cudaGetLastError();
    return false;
  }
  const DriverGraph& drv = detail::tuning().driver_launch ? driver_graph() : DriverGraph{};
  bool ok = true;
  for (int i = 0; i < n && ok; ++i) {
    void* args[1] = {steps[i].param};
    const CUfunction f = drv.set != nullptr ? driver_function(steps[i].kernel, device) : nullptr;
    if (f != nullptr) {
      CUDA_KERNEL_NODE_PARAMS_v2 kp = {};
      kp.func = f;
      kp.gridDimX = steps[i].grid.x;
      kp.gridDimY = steps[i].grid.y;
      kp.gridDimZ = steps[i].grid.z;
      kp.blockDimX = steps[i].block.x;
      kp.blockDimY = steps[i].block.y;
      kp.blockDimZ = steps[i].block.z;
      kp.sharedMemBytes = steps[i].smem;
      kp.kernelParams = args;
      ok = drv.set(reinterpret_cast<CUgraphExec>(c->exec),
                   reinterpret_cast<CUgraphNode>(c->nodes[i]), &kp) == CUDA_SUCCESS;
    } else {
      const cudaKernelNodeParams kp = node_params(steps[i], args);
      ok = cudaGraphExecKernelNodeSetParams(c->exec, c->nodes[i], &kp) == cudaSuccess;
    }
  }
  if (ok)
    ok = drv.launch != nullptr ? drv.launch(reinterpret_cast<CUgraphExec>(c->exec),
                                            reinterpret_cast<CUstream>(stream)) == CUDA_SUCCESS
                               : cudaGraphLaunch(c->exec, stream) == cudaSuccess;
  if (ok) {
    ++t_launched;
    return true;
  }
  // Nothing ran: the graph is dropped (a reset device, a kernel the graph cannot take) and the
  // caller launches the steps itself.
  (void)cudaGetLastError();
  drop(c);
  return false;
}

unsigned long long chain_launch_count() { return t_launched; }

}  // namespace kda::cuda
