// engine.h — CPU emulation of the CUDA prefill kernels, for development without a GPU. Not part
// of the library: a tool that runs the real kernel source (src/cuda/prefill/: prepare.cuh,
// recurrence.cuh, their *_steps.cuh, common.cuh, host.h; the backward's kernels.cuh; the
// context-parallel prefill's distributed/scan_kernels.cuh) on the host.
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
// "cuda/common/ptx.cuh"; it must come first on the include path. Built by CMake with
// -DKDA_BUILD_EMULATOR=ON (dev/prefill_emu/CMakeLists.txt; no CUDA toolkit needed):
//   cmake -S . -B build-emu -DKDA_ENABLE_CUDA=OFF -DKDA_BUILD_EMULATOR=ON && cmake --build
//   build-emu ctest --test-dir build-emu -L emu      # wgmma and 16-token record self-tests, quick
//   cases,
//                                          # tests/test_gpu_prefill.cpp without the long accuracy
//                                          cases
//   build-emu/dev/prefill_emu/kda_emu_tests --gtest_filter='*CaseA*'   # the accuracy cases (~10
//   min)
// EMU_VS (16, 32, 64, 128) forces the value split of the emulated backend (kda_emu_tests).
// -DKDA_EMU_TSAN=ON builds the ThreadSanitizer mode (tsan.h: the kernels' accesses checked against
// the CUDA synchronizations they use); dev/emu_race.sh builds it and runs the race check.
#pragma once
#include <ucontext.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/backward/host.h"
#include "cuda/prefill/host.h"
#include "cuda/prefill/prepare.cuh"
#include "cuda/prefill/recurrence.cuh"
#include "cuda/prefill/segments.cuh"
#include "cuda/prefill/single.cuh"
#include "fibers.h"

namespace kda::cuda::pf {
alignas(1024) uint8_t emu_smem_alias[240000];
extern uint8_t emu_smem_raw[240000] __attribute__((alias("_ZN3kda4cuda2pf14emu_smem_aliasE")));
}  // namespace kda::cuda::pf
namespace kda::cuda::bw {  // the backward kernels' `smem` and `smem_raw`: the same array
extern uint8_t emu_smem_alias[240000] __attribute__((alias("_ZN3kda4cuda2pf14emu_smem_aliasE")));
extern uint8_t emu_smem_raw[240000] __attribute__((alias("_ZN3kda4cuda2pf14emu_smem_aliasE")));
}  // namespace kda::cuda::bw

namespace emu_run {
using namespace kda;
using namespace kda::cuda::pf;
namespace bw = kda::cuda::bw;

// The emulation's state (emu::threadIdx_ and the other fiber globals, the shared-memory array) is
// process-wide: launches from several host threads (the ranks of the distributed tests) run one
// at a time. A launch is synchronous, so holding the lock for its duration is enough.
static std::mutex& launch_mutex() {
  static std::mutex m;
  return m;
}

template <typename K, typename P = Params>
static void launch(K kernel, int64_t blocks, int threads, int smem_bytes, const P& p) {
  const std::lock_guard<std::mutex> lock(launch_mutex());
  emu::smem_base = emu_smem_alias;
  emu::smem_size = smem_bytes;
  if (smem_bytes > (int)sizeof(emu_smem_alias)) {
    std::fprintf(stderr, "smem too big\n");
    std::abort();
  }
  for (int64_t b = 0; b < blocks; ++b) {
    std::memset(emu_smem_alias, 0xff, smem_bytes);  // uninitialized shared memory reads as NaN
    emu::run_block(threads, (unsigned)b, (unsigned)blocks, [&] { kernel(p); });
  }
}

// The single kernel's two phases as two launches, the grid barrier as the launch boundary.
template <bool kFp16, bool kC16>
static void launch_single(const Launch& l, const Params& p) {
  launch([](const Params& q) { single_prepare_phase<kFp16, kC16>(q, blockIdx.x); }, l.blocks,
         l.threads, l.smem, p);
  launch([](const Params& q) { single_recurrence_phase<kFp16, kC16>(q, blockIdx.x); }, l.blocks,
         l.threads, l.smem, p);
}

// The value split forced to vs_override (0: the heuristic's), then the kernels as the host
// launches them (plan_launches).
template <bool kFp16>
static void run_kernels(Params& p, int64_t pb, int64_t rb, const detail::PrefillProblem& pr,
                        int vs_override) {
  if (vs_override && !p.fused) {
    const RecurrenceChoice rc = recurrence_choice_for_split(vs_override, detail::tuning());
    p.vs = rc.vs;
    p.nslices = 128 / p.vs;
    rb = pr.d.N * pr.d.HV * p.nslices;
    p.ksplit = rc.ksplit;
    p.wgmma = rc.wgmma;
    p.chunk16 = rc.chunk16;
    PrefillPlan forced;
    forced.rec = rc;
    p.single = p.single && single_launch(forced, pb, rb, 132, detail::tuning());
  }
  Launch plan[4];
  const int count = plan_launches(p, pb, rb, plan);
  for (int i = 0; i < count; ++i) {
    const Launch& l = plan[i];
    Params pass = p;
    switch (l.kernel) {
      case PrefillKernel::kPrepare:
        launch(p.chunk16 ? prepare_kernel<kFp16, true> : prepare_kernel<kFp16, false>, l.blocks,
               l.threads, l.smem, p);
        break;
      case PrefillKernel::kRecurrence:
        launch(recurrence_kernel_of<kFp16, false>(recurrence_path(p)), l.blocks, l.threads, l.smem,
               p);
        break;
      case PrefillKernel::kSegmentWarm:
      case PrefillKernel::kSegmentPass1:
      case PrefillKernel::kSegmentPass2:
        pass.seg_pass = seg_pass_of(l.kernel);
        if (p.fused)
          launch(fused_kernel<kFp16, true>, l.blocks, l.threads, l.smem, pass);
        else
          launch(recurrence_kernel_of<kFp16, true>(recurrence_path(p)), l.blocks, l.threads, l.smem,
                 pass);
        break;
      case PrefillKernel::kSegmentScan:
        launch(segment_scan_kernel, l.blocks, l.threads, l.smem, p);
        break;
      case PrefillKernel::kFused:
        launch(fused_kernel<kFp16, false>, l.blocks, l.threads, l.smem, p);
        break;
      case PrefillKernel::kSingle:
        if (p.chunk16)
          launch_single<kFp16, true>(l, p);
        else
          launch_single<kFp16, false>(l, p);
        break;
    }
  }
}
static void run_kernels(Params& p, int64_t pb, int64_t rb, const detail::PrefillProblem& pr,
                        int vs_override, bool fp16) {
  if (fp16)
    run_kernels<true>(p, pb, rb, pr, vs_override);
  else
    run_kernels<false>(p, pb, rb, pr, vs_override);
}
// Runs the emulated CUDA prefill on host tensors (params: CPU views). vs_override: 0 = heuristic.
static Status emu_problem(const detail::PrefillProblem& pr, void* wsp, int vs_override) {
  Params p;
  int64_t pb = 0, rb = 0;
  size_t need = 0;
  Status s = make_params(pr, wsp, 132, detail::tuning(), &p, &pb, &rb, &need);
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
  const size_t need = workspace_bytes(pr, 132, detail::tuning());
  std::vector<uint8_t> ws(need + 256, 0xff);
  Params p;
  int64_t pb = 0, rb = 0;
  size_t need_p = 0;
  s = make_params(pr, need ? ws.data() : nullptr, 132, detail::tuning(), &p, &pb, &rb, &need_p);
  if (!s.ok()) return s;
  run_kernels(p, pb, rb, pr, vs_override, fp16);
  return Status::Ok();
}

// SMs of the emulated GPU for the backward's persistent kernels (EMU_SMS, default 132): fewer
// than the tasks make their blocks take several tasks each.
inline int emu_sms() {
  const char* s = std::getenv("EMU_SMS");
  const int v = s != nullptr ? std::atoi(s) : 0;
  return v > 0 ? v : 132;
}

// Runs the emulated CUDA prefill backward (kernels of cuda/backward/kernels.cuh in the launch
// order of bw::plan_launches) on host tensors, with the workspace at `wsp`.
template <bool kSplit>
static void emu_backward(const detail::PrefillBackwardProblem& bp, void* wsp) {
  bw::BwdParams P;
  bw::make_params(bp, wsp, emu_sms(), detail::tuning(), &P);
  bw::BwdLaunch plan[bw::kMaxBwdLaunches];
  const int count = bw::plan_launches(P, plan);
  for (int i = 0; i < count; ++i) {
    const bw::BwdLaunch& l = plan[i];
    switch (l.kernel) {
      case bw::BwdKernel::kPrepare:
        launch(bw::bwd_prepare_kernel<kSplit>, l.blocks, l.threads, l.smem, P);
        break;
      case bw::BwdKernel::kStates:
        launch(bw::bwd_states_kernel<kSplit>, l.blocks, l.threads, l.smem, P);
        break;
      case bw::BwdKernel::kDStates:
        launch(bw::bwd_dstates_kernel<kSplit>, l.blocks, l.threads, l.smem, P);
        break;
      case bw::BwdKernel::kStatesWg:
        launch(bw::bwd_states_wg_kernel, l.blocks, l.threads, l.smem, P);
        break;
      case bw::BwdKernel::kDStatesWg:
        if (bw::do_lo_zero(P))
          launch(bw::bwd_dstates_wg_kernel<true>, l.blocks, l.threads, l.smem, P);
        else
          launch(bw::bwd_dstates_wg_kernel<false>, l.blocks, l.threads, l.smem, P);
        break;
      case bw::BwdKernel::kSProd:
        if (bw::do_lo_zero(P))
          launch(bw::bwd_sprod_kernel<true>, l.blocks, l.threads, l.smem, P);
        else
          launch(bw::bwd_sprod_kernel<false>, l.blocks, l.threads, l.smem, P);
        break;
      case bw::BwdKernel::kChunk:
        if (P.wg)
          launch(bw::bwd_chunk_kernel<kSplit, true>, l.blocks, l.threads, l.smem, P);
        else
          launch(bw::bwd_chunk_kernel<kSplit, false>, l.blocks, l.threads, l.smem, P);
        break;
      case bw::BwdKernel::kQk:
        launch(bw::bwd_qk_kernel, l.blocks, l.threads, l.smem, P);
        break;
      case bw::BwdKernel::kParams:
        launch(bw::bwd_params_kernel, l.blocks, l.threads, l.smem, P);
        break;
    }
  }
}

}  // namespace emu_run
