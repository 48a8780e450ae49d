// host_cost_kernels.cu — empty kernels for bench_host_cost: the host cost of a bare launch, by
// launch API, with and without the PDL attribute and with a parameter block of the size of the
// library's kernel parameters (the prefill Params struct is 848 bytes, decode's 592).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include "host_cost_kernels.h"

namespace host_cost {
namespace {

struct Block {
  unsigned char bytes[kParamBytes];
};

__global__ void empty_kernel() {}

__global__ void empty_kernel_params(const __grid_constant__ Block) {}

cudaError_t launch_ex(cudaStream_t stream, bool pdl, bool params) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(1);
  cfg.blockDim = dim3(32);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  if (params) return cudaLaunchKernelEx(&cfg, empty_kernel_params, Block{});
  return cudaLaunchKernelEx(&cfg, empty_kernel);
}

// cuLaunchKernelEx (driver API, through the runtime's entry-point query: no libcuda link) with the
// PDL attribute on the kernel's CUfunction, both looked up once: what a launch costs without the
// runtime's per-launch work.
cudaError_t launch_driver(cudaStream_t stream) {
  static PFN_cuLaunchKernelEx_v11060 launch = nullptr;
  static CUfunction function = nullptr;
  if (launch == nullptr) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    cudaError_t e =
        cudaGetDriverEntryPointByVersion("cuLaunchKernelEx", &fn, 12000, cudaEnableDefault, &found);
    if (e != cudaSuccess) return e;
    if (found != cudaDriverEntryPointSuccess) return cudaErrorNotSupported;
    cudaFunction_t f = nullptr;
    e = cudaGetFuncBySymbol(&f, reinterpret_cast<const void*>(empty_kernel));
    if (e != cudaSuccess) return e;
    function = reinterpret_cast<CUfunction>(f);
    launch = reinterpret_cast<PFN_cuLaunchKernelEx_v11060>(fn);
  }
  CUlaunchConfig cfg = {};
  cfg.gridDimX = cfg.gridDimY = cfg.gridDimZ = 1;
  cfg.blockDimX = 32;
  cfg.blockDimY = cfg.blockDimZ = 1;
  cfg.hStream = reinterpret_cast<CUstream>(stream);
  CUlaunchAttribute attr[1];
  attr[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  attr[0].value.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return launch(&cfg, function, nullptr, nullptr) == CUDA_SUCCESS ? cudaSuccess
                                                                  : cudaErrorLaunchFailure;
}

}  // namespace

cudaError_t launch_empty(Launch how, cudaStream_t stream) {
  switch (how) {
    case Launch::kChevron:
      empty_kernel<<<1, 32, 0, stream>>>();
      return cudaGetLastError();
    case Launch::kEx:
      return launch_ex(stream, false, false);
    case Launch::kExPdl:
      return launch_ex(stream, true, false);
    case Launch::kExPdlParams:
      return launch_ex(stream, true, true);
    case Launch::kDriverPdl:
      return launch_driver(stream);
  }
  return cudaErrorInvalidValue;
}

const char* launch_name(Launch how) {
  switch (how) {
    case Launch::kChevron:
      return "empty kernel <<<>>>";
    case Launch::kEx:
      return "empty kernel LaunchKernelEx";
    case Launch::kExPdl:
      return "empty kernel LaunchKernelEx+PDL";
    case Launch::kExPdlParams:
      return "empty kernel Ex+PDL, 848 B param";
    case Launch::kDriverPdl:
      return "empty kernel cuLaunchKernelEx+PDL";
  }
  return "unknown";
}

}  // namespace host_cost
