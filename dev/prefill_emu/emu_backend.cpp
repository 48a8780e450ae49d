// emu_backend.cpp — emulated CUDA backend: kda::cuda::prefill, its backward and the
// context-parallel prefill's device side (kda::cuda::distributed_*) run the real kernel source on
// the CPU (engine.h). Linked instead of the CUDA objects when building the GPU tests for
// emulation.
#include "cpu/backends.h"
#include "cuda/cuda_backend.h"
#include "cuda/distributed/scan.h"
#include "cuda/distributed/scan_kernels.cuh"
#include "engine.h"
namespace kda::cuda {
std::vector<DeviceInfo> devices() {
  DeviceInfo d;
  d.name = "emulated H200";
  d.sm_major = 9;
  d.multiprocessors = 132;
  d.supported = true;
  return {d};
}
Status prefill_workspace_size(const detail::PrefillProblem& pr, size_t* bytes) {
  *bytes = 0;
  Status s = pf::check_supported(pr);
  if (!s.ok()) return s;
  *bytes = pf::workspace_bytes(pr, 132, detail::tuning());
  return Status::Ok();
}
// Emulated device memory is host memory: the indices are checked where they are.
Status check_prefill_indices(const detail::PrefillProblem& pr, const ExecOptions&) {
  return detail::check_prefill_index_values(pr, pr.state_indices.data);
}
// Emulated calls launch their kernels one by one (no graph: GpuPrefillGraph is not run here).
unsigned long long chain_launch_count() { return 0; }
Status prefill_warm_counts(int, unsigned long long counts[3]) {
  for (int i = 0; i < 3; ++i) counts[i] = pf::g_fused_warm_walks[i];
  return Status::Ok();
}
Status prefill(const detail::PrefillProblem& pr, const ExecOptions& exec) {
  Status s = pf::check_supported(pr);
  if (!s.ok()) return s;
  const size_t need = pf::workspace_bytes(pr, 132, detail::tuning());
  if (need > 0 && (exec.workspace == nullptr || exec.workspace_bytes < need))
    return {StatusCode::kInvalidArgument, "workspace", "too small (emulated)"};
  if (need)
    std::memset(exec.workspace, 0xff,
                exec.workspace_bytes);  // poison: unwritten records read as NaN
  const char* vs = std::getenv("EMU_VS");
  return emu_run::emu_problem(pr, exec.workspace, vs ? std::atoi(vs) : 0);
}
Status prefill_backward_workspace_size(const detail::PrefillBackwardProblem& bp, size_t* bytes) {
  *bytes = 0;
  Status s = bw::check_supported(bp);
  if (!s.ok()) return s;
  *bytes = bw::workspace_layout(bp.fwd, emu_run::emu_sms()).total;
  return Status::Ok();
}
Status prefill_backward(const detail::PrefillBackwardProblem& bp, const ExecOptions& exec) {
  Status s = bw::check_supported(bp);
  if (!s.ok()) return s;
  const size_t need = bw::workspace_layout(bp.fwd, emu_run::emu_sms()).total;
  if (need > 0 && (exec.workspace == nullptr || exec.workspace_bytes < need))
    return {StatusCode::kInvalidArgument, "workspace", "too small (emulated)"};
  if (need) std::memset(exec.workspace, 0xff, exec.workspace_bytes);  // unwritten parts are NaN
  if (detail::tuning().backward_split)
    emu_run::emu_backward<true>(bp, exec.workspace);
  else
    emu_run::emu_backward<false>(bp, exec.workspace);
  return Status::Ok();
}
// Decode is not emulated: the CPU fast backend stands in (the same fp32 recurrence), so that tests
// that chain prefill and decode check their own logic here.
Status decode(const detail::DecodeProblem& pr, const ExecOptions&, bool) {
  cpu::fast_decode(pr, 1);
  return Status::Ok();
}
// The context-parallel prefill's kernels (distributed/scan_kernels.cuh) on the grids of
// distributed/scan.cu.
Status distributed_prepare(const scan::Buffers& b, int, void*) {
  emu_run::launch(dist::prepare_kernel, dist::kPrepareBlocks, dist::kThreads, 0, b);
  return Status::Ok();
}
Status distributed_layout(const scan::Buffers& b, int, void*) {
  emu_run::launch(dist::layout_kernel, dist::layout_blocks(b), dist::kThreads, 0, b);
  return Status::Ok();
}
Status distributed_scan(const scan::Buffers& b, int, void*) {
  const int64_t blocks = dist::scan_blocks(b);
  if (blocks > 0) emu_run::launch(dist::scan_kernel, blocks, dist::kThreads, 0, b);
  return Status::Ok();
}
}  // namespace kda::cuda
