// distributed.cpp — the context-parallel prefill (include/kda/distributed.h) over kda::prefill:
// three prefill passes per rank (S_local from zero; M from the identity with v = 0 of width K;
// the outputs from the scanned start states), one all-gather of the [M | S_local] records, and
// the fp64 scan over ranks (on the host for CPU tensors, a small kernel for CUDA tensors).
#include "kda/distributed.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "core/problem.h"
#include "core/state_scan.h"
#include "cpu/access.h"
#ifdef KDA_WITH_CUDA
#include "cuda/distributed/scan.h"
#endif

namespace kda {
namespace {

Status invalid(const char* argument, const std::string& what) {
  return {StatusCode::kInvalidArgument, argument, what};
}

Status unsupported(const char* argument, const std::string& what) {
  return {StatusCode::kUnsupported, argument, what};
}

constexpr size_t kAlign = 256;
size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Where the call's buffers lie in the workspace (byte offsets from a kAlign-aligned base), and
// the three prefill calls that use them.
struct Plan {
  scan::Record record{};
  int world = 0;
  size_t zeros = 0, identity = 0, send = 0, recv = 0, start = 0, h = 0, out_m = 0, inner = 0;
  size_t zero_bytes = 0, record_bytes = 0, inner_bytes = 0, total = 0;
  PrefillParams local_pass, m_pass, out_pass;
};

TensorView contiguous(uint8_t* base, size_t offset, DType dtype, std::vector<int64_t> shape,
                      Device device, int32_t index) {
  return make_view(base + offset, dtype, std::move(shape), device, index);
}

// The plan of `local` on `world` ranks with buffers at `base` (kAlign-aligned; any such address
// when only sizing: the prefill passes' workspace depends on shapes and alignment only).
Status make_plan(const PrefillParams& local, int world, uint8_t* base, Plan* plan) {
  KDA_RETURN_IF_ERROR(validate(local));
  if (local.state_pool.present() || local.state_indices.present())
    return unsupported("state_pool", "pool mode is not supported by distributed_prefill");
  if (local.checkpoint_every != 0 || local.checkpoints.present())
    return unsupported("checkpoints", "checkpoints are not supported by distributed_prefill");
  if (world < 1) return invalid("world_size", "at least 1, got " + std::to_string(world));
  const TensorView& q = local.q;
  const TensorView& v = local.v;
  const bool varlen = local.cu_seqlens.present();
  const int64_t N = varlen ? local.cu_seqlens.shape[0] - 1 : q.shape[0];
  const int64_t K = q.size(-1), HV = v.size(-2), V = v.size(-1);
  const bool v_first = local.state_layout == StateLayout::kVFirst;
  const int64_t R = v_first ? V : K, C = v_first ? K : V;
  Plan& p = *plan;
  p.record = {N, HV, K, R, C};
  p.world = world;
  p.zero_bytes = static_cast<size_t>(K) * dtype_size(q.dtype);
  p.record_bytes = static_cast<size_t>(p.record.floats()) * sizeof(float);
  const size_t states = static_cast<size_t>(N * HV * R * C);
  size_t at = 0;
  auto take = [&](size_t* offset, size_t bytes) {
    *offset = at;
    at += align_up(bytes);
  };
  take(&p.zeros, p.zero_bytes);
  take(&p.identity, static_cast<size_t>(K * K) * sizeof(float));
  take(&p.send, p.record_bytes);
  take(&p.recv, p.record_bytes * static_cast<size_t>(world));
  take(&p.start, states * sizeof(float));
  take(&p.h, 2 * states * sizeof(double));
  // The M pass writes an output of width K: the caller's out when V == K, else its own.
  std::vector<int64_t> out_shape(v.shape, v.shape + v.ndim);
  out_shape.back() = K;
  int64_t out_numel = 1;
  for (int64_t x : out_shape) out_numel *= x;
  take(&p.out_m, V == K ? 0 : static_cast<size_t>(out_numel) * dtype_size(q.dtype));

  const Device dev = q.device;
  const int32_t index = q.device_index;
  const TensorView m_states = contiguous(base, p.send, DType::kFloat32, {N, HV, K, K}, dev, index);
  const TensorView s_states = contiguous(base, p.send + static_cast<size_t>(N * HV * K * K) * 4,
                                         DType::kFloat32, {N, HV, R, C}, dev, index);
  // Pass 1: S_local, from a zero state.
  p.local_pass = local;
  p.local_pass.initial_state = {};
  p.local_pass.final_state = s_states;
  // Pass 2: M, from the identity (one K x K matrix, broadcast) with v = 0 of width K (K zeros,
  // broadcast).
  p.m_pass = p.local_pass;
  std::vector<int64_t> broadcast(v.ndim, 0);
  broadcast.back() = 1;
  p.m_pass.v = make_strided_view(base + p.zeros, q.dtype, out_shape, broadcast, dev, index);
  p.m_pass.out = V == K ? local.out : contiguous(base, p.out_m, q.dtype, out_shape, dev, index);
  p.m_pass.initial_state = make_strided_view(base + p.identity, DType::kFloat32, {N, HV, K, K},
                                             {0, 0, K, 1}, dev, index);
  p.m_pass.final_state = m_states;
  p.m_pass.state_layout = local.state_layout;
  // Pass 3: the outputs, from this rank's start states (the scan writes the final states).
  p.out_pass = local;
  p.out_pass.initial_state = contiguous(base, p.start, DType::kFloat32, {N, HV, R, C}, dev, index);
  p.out_pass.final_state = {};

  size_t inner = 0;
  for (const PrefillParams* pass : {&p.local_pass, &p.m_pass, &p.out_pass}) {
    size_t bytes = 0;
    KDA_RETURN_IF_ERROR(prefill_workspace_size(*pass, &bytes));
    inner = std::max(inner, bytes);
  }
  take(&p.inner, inner);
  p.inner_bytes = inner;
  p.total = at + kAlign;  // + the alignment of the caller's workspace
  for (PrefillParams* pass : {&p.local_pass, &p.m_pass, &p.out_pass}) {
    pass->exec.workspace = inner > 0 ? base + p.inner : nullptr;
    pass->exec.workspace_bytes = inner;
    pass->exec.allocate_workspace = nullptr;
  }
  return Status::Ok();
}

// An address for sizing only: the plan's views are built but never dereferenced.
uint8_t* sizing_base() { return reinterpret_cast<uint8_t*>(uintptr_t{1} << 20); }

scan::Buffers buffers_of(const Plan& p, const PrefillParams& local, uint8_t* base, int rank) {
  scan::Buffers b;
  b.record = p.record;
  b.records = reinterpret_cast<const float*>(base + p.recv);
  b.world = p.world;
  b.rank = rank;
  b.v_first = local.state_layout == StateLayout::kVFirst;
  b.initial_state = local.initial_state;
  b.final_state = local.final_state;
  b.start = reinterpret_cast<float*>(base + p.start);
  b.h = reinterpret_cast<double*>(base + p.h);
  b.identity = reinterpret_cast<float*>(base + p.identity);
  b.zeros = base + p.zeros;
  b.zero_bytes = p.zero_bytes;
  return b;
}

void prepare_host(const scan::Buffers& b) {
  const int64_t K = b.record.K;
  for (int64_t i = 0; i < K * K; ++i) b.identity[i] = i / K == i % K ? 1.0f : 0.0f;
  std::memset(b.zeros, 0, b.zero_bytes);
}

// The scan on the host: the kernel of src/cuda/distributed/scan.cu, one (sequence, value head)
// at a time.
void scan_host(const scan::Buffers& b) {
  const scan::Record& r = b.record;
  const int64_t RC = r.R * r.C;
  for (int64_t n = 0; n < r.N; ++n) {
    for (int64_t hv = 0; hv < r.HV; ++hv) {
      const int64_t pair = n * r.HV + hv;
      double* h = b.h + pair * RC;
      double* next = b.h + (r.N * r.HV + pair) * RC;
      for (int64_t e = 0; e < RC; ++e) {
        const TensorView& t = b.initial_state;
        h[e] = t.present()
                   ? cpu::load_scalar(t.data, t.dtype, cpu::offset4(t, n, hv, e / r.C, e % r.C))
                   : 0.0;
      }
      for (int j = 0; j < b.world; ++j) {
        if (j == b.rank)
          for (int64_t e = 0; e < RC; ++e) b.start[pair * RC + e] = static_cast<float>(h[e]);
        const float* rec = b.records + j * r.floats();
        for (int64_t e = 0; e < RC; ++e)
          next[e] = scan::step_element(h, rec + r.m(n, hv), rec + r.s(n, hv), e / r.C, e % r.C, r.K,
                                       r.C, b.v_first);
        std::swap(h, next);
      }
      if (b.final_state.present()) {
        const TensorView& t = b.final_state;
        for (int64_t e = 0; e < RC; ++e)
          cpu::store_scalar(t.data, t.dtype, cpu::offset4(t, n, hv, e / r.C, e % r.C), h[e]);
      }
    }
  }
}

}  // namespace

Status distributed_prefill_workspace_size(const PrefillParams& local, int world_size,
                                          size_t* bytes) {
  if (bytes == nullptr) return invalid("bytes", "expected a pointer, got nullptr");
  *bytes = 0;
  Plan plan;
  KDA_RETURN_IF_ERROR(make_plan(local, world_size, sizing_base(), &plan));
  *bytes = plan.total;
  return Status::Ok();
}

Status distributed_prefill(const PrefillParams& local, Communicator& communicator) {
  const int world = communicator.size();
  const int rank = communicator.rank();
  if (rank < 0 || rank >= world)
    return invalid("communicator", "rank() in [0, size() = " + std::to_string(world) + "), got " +
                                       std::to_string(rank));
  Plan sized;
  KDA_RETURN_IF_ERROR(make_plan(local, world, sizing_base(), &sized));
  const ExecOptions& exec = local.exec;
  void* memory = exec.workspace;
  if (exec.workspace_bytes < sized.total) {
    if (exec.allocate_workspace == nullptr)
      return invalid("workspace", "at least " + std::to_string(sized.total) +
                                      " bytes (distributed_prefill_workspace_size), got " +
                                      std::to_string(exec.workspace_bytes));
    memory = exec.allocate_workspace(sized.total, exec.allocate_context);
    if (memory == nullptr)
      return {StatusCode::kInternal, "workspace",
              "allocating " + std::to_string(sized.total) + " bytes failed"};
  }
  uint8_t* base = reinterpret_cast<uint8_t*>(align_up(reinterpret_cast<uintptr_t>(memory)));
  Plan plan;
  KDA_RETURN_IF_ERROR(make_plan(local, world, base, &plan));
  const scan::Buffers buffers = buffers_of(plan, local, base, rank);
  const bool on_cuda = local.q.device == Device::kCUDA;
  [[maybe_unused]] const int device = local.q.device_index;
#ifdef KDA_WITH_CUDA
  if (on_cuda) KDA_RETURN_IF_ERROR(cuda::distributed_prepare(buffers, device, exec.stream));
#else
  if (on_cuda) return unsupported("backend", "this build has no CUDA backend");
#endif
  if (!on_cuda) prepare_host(buffers);
  KDA_RETURN_IF_ERROR(prefill(plan.local_pass));
  KDA_RETURN_IF_ERROR(prefill(plan.m_pass));
  KDA_RETURN_IF_ERROR(communicator.all_gather(base + plan.send, base + plan.recv, plan.record_bytes,
                                              local.q.device, exec.stream));
#ifdef KDA_WITH_CUDA
  if (on_cuda) KDA_RETURN_IF_ERROR(cuda::distributed_scan(buffers, device, exec.stream));
#endif
  if (!on_cuda) scan_host(buffers);
  return prefill(plan.out_pass);
}

std::vector<int64_t> local_cu_seqlens(const std::vector<int64_t>& cu_seqlens, int64_t begin,
                                      int64_t end) {
  std::vector<int64_t> local(cu_seqlens.size());
  for (size_t i = 0; i < cu_seqlens.size(); ++i)
    local[i] = std::min(std::max(cu_seqlens[i] - begin, int64_t{0}), end - begin);
  return local;
}

#ifndef KDA_WITH_NCCL
Status make_nccl_communicator(void* nccl_comm, std::unique_ptr<Communicator>* communicator) {
  return unsupported("nccl_comm", "this build has no NCCL (CMake option KDA_ENABLE_NCCL)");
}
#endif

}  // namespace kda
