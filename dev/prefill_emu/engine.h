// engine.h — CPU emulation of the CUDA prefill kernels, for development without a GPU. Not
// built by CMake and not part of the library: a tool that runs the real kernel source
// (prepare.cuh, recurrence.cuh, common.cuh, host.h) on the host.
//
// Every CUDA thread of a block is a ucontext fiber (fibers.h), scheduled round-robin on one OS
// thread; __syncthreads, named barriers and the warp collectives (shuffles, ballot, mma.sync,
// wgmma, ldmatrix, stmatrix) yield until all participants arrive, then compute what the hardware
// does (PTX ISA fragment layouts). Copies (cp.async, bulk copies) complete at once, so the
// emulation checks the kernels' math, indexing, fragment layouts and swizzles and their barrier
// protocol (mbarriers keep counts, transaction bytes and phases; a wait that can never complete
// aborts), not the copies' timing. Shared memory of every block starts as 0xff bytes (NaN), and
// so does the workspace: reads of unwritten data show up.
//
// shim/ replaces <cuda_runtime.h>, <cuda_runtime_api.h>, <cuda_bf16.h>, <cuda_fp16.h> and
// "cuda/prefill/ptx.cuh"; it must come first on the include path. From the repository root:
//   E=dev/prefill_emu
//   # quick cases against the fp64 reference (after a normal build in build/)
//   g++ -O1 -g -std=c++20 -I$E/shim -Isrc -Iinclude -Itests $E/emu_cases.cpp tests/support.cpp \
//       build/libkda.a -L/usr/local/cuda/lib64 -lcudart_static -ldl -lrt -lpthread -o /tmp/emu_cases
//   # tests/test_gpu_prefill.cpp on the emulated backend (kda::cuda::prefill -> emulation)
//   g++ -O2 -g -std=c++20 -DKDA_WITH_CUDA -I$E/shim -Isrc -Iinclude -Itests src/api.cpp \
//       src/core/validate.cpp src/cpu/parallel.cpp src/cpu/reference.cpp src/cpu/prefill_chunked.cpp \
//       src/cpu/decode_fast.cpp tests/support.cpp tests/test_gpu_prefill.cpp $E/emu_backend.cpp \
//       -lgtest -lgtest_main -lpthread -o /tmp/emu_tests
//   /tmp/emu_tests --gtest_filter='-*CaseA*:*ErrorFlat*'   # ~1.5 min; the accuracy cases ~10 min
#pragma once
#include <ucontext.h>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>
#include <string>
#include "cuda/prefill/host.h"
#include "cuda/prefill/prepare.cuh"
#include "cuda/prefill/recurrence.cuh"
#include "fibers.h"

namespace kda::cuda::pf {
alignas(1024) uint8_t emu_smem_alias[240000];
extern uint8_t emu_smem_raw[240000] __attribute__((alias("_ZN3kda4cuda2pf14emu_smem_aliasE")));
}

namespace emu_run {
using namespace kda; using namespace kda::cuda::pf;

template <typename K>
static void launch(K kernel, int64_t blocks, int threads, int smem_bytes, const Params& p) {
  emu::smem_base = emu_smem_alias; emu::smem_size = smem_bytes;
  if (smem_bytes > (int)sizeof(emu_smem_alias)) { std::fprintf(stderr, "smem too big\n"); std::abort(); }
  for (int64_t b = 0; b < blocks; ++b) {
    std::memset(emu_smem_alias, 0xff, smem_bytes);  // uninitialized shared memory reads as NaN
    emu::run_block(threads, (unsigned)b, (unsigned)blocks, [&] { kernel(p); });
  }
}

// The value split forced to vs_override (0: the heuristic's), then both kernels as the host
// launches them (K split included).
static void run_kernels(Params& p, int64_t pb, int64_t rb, const detail::PrefillProblem& pr, int vs_override,
                        bool fp16) {
  if (vs_override) {
    const RecurrenceChoice rc = recurrence_choice_for_split(vs_override);
    p.vs = rc.vs; p.nslices = 128 / p.vs; rb = pr.d.N * pr.d.HV * p.nslices;
    p.ksplit = rc.ksplit; p.wgmma = rc.wgmma; p.chunk16 = rc.chunk16;
  }
  if (p.chunk16) {  // the chunk-16 path
    const int t16 = 32 * recurrence_warps(p.vs, false), s16 = recurrence_smem_bytes16(p.vs);
    if (fp16) {
      launch(prepare_kernel<true, true>, pb, kPrepareThreads, kPrepareSmemBytes, p);
      launch(recurrence_kernel<true, false, true, true>, rb, t16, s16, p);
    } else {
      launch(prepare_kernel<false, true>, pb, kPrepareThreads, kPrepareSmemBytes, p);
      launch(recurrence_kernel<false, false, true, true>, rb, t16, s16, p);
    }
    return;
  }
  const int threads = 32 * recurrence_warps(p.vs, p.ksplit), smem = recurrence_smem_bytes(p.vs, p.ksplit);
  if (fp16) {
    launch(prepare_kernel<true>, pb, kPrepareThreads, kPrepareSmemBytes, p);
    if (p.ksplit) launch(recurrence_kernel<true, true, false>, rb, threads, smem, p);
    else if (p.wgmma) launch(recurrence_kernel<true, false, true>, rb, threads, smem, p);
    else launch(recurrence_kernel<true, false, false>, rb, threads, smem, p);
  } else {
    launch(prepare_kernel<false>, pb, kPrepareThreads, kPrepareSmemBytes, p);
    if (p.ksplit) launch(recurrence_kernel<false, true, false>, rb, threads, smem, p);
    else if (p.wgmma) launch(recurrence_kernel<false, false, true>, rb, threads, smem, p);
    else launch(recurrence_kernel<false, false, false>, rb, threads, smem, p);
  }
}

// Runs the emulated CUDA prefill on host tensors (params: CPU views). vs_override: 0 = heuristic.
static Status emu_problem(const detail::PrefillProblem& pr, void* wsp, int vs_override) {
  Params p; int64_t pb = 0, rb = 0;
  Status s = make_params(pr, wsp, 132, &p, &pb, &rb);
  if (!s.ok()) return s;
  run_kernels(p, pb, rb, pr, vs_override, pr.q.dtype == DType::kFloat16);
  return Status::Ok();
}
static Status emu_prefill(const PrefillParams& prm, int vs_override, bool fp16) {
  detail::PrefillProblem pr;
  Status s = detail::validate_prefill(prm, &pr);
  if (!s.ok()) return s;
  s = check_supported(pr);
  if (!s.ok()) return s;
  const size_t need = workspace_bytes(pr);
  std::vector<uint8_t> ws(need + 256, 0xff);
  Params p; int64_t pb = 0, rb = 0;
  s = make_params(pr, need ? ws.data() : nullptr, 132, &p, &pb, &rb);
  if (!s.ok()) return s;
  run_kernels(p, pb, rb, pr, vs_override, fp16);
  return Status::Ok();
}

}  // namespace emu_run
