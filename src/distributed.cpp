// distributed.cpp — the context-parallel prefill (include/kda/distributed.h) over kda::prefill:
// three prefill passes per rank (S_local from zero; M from the identity with v = 0 of width K;
// the outputs from the scanned start states), one all-gather of the [M | S_local] records, and
// the fp64 scan over ranks (on the host for CPU tensors, small kernels for CUDA tensors). With
// a pool or checkpoints, a first all-gather of the ranks' piece lengths places each piece in its
// sequence; with checkpoints every piece runs as two parts, its head up to its first checkpoint
// boundary and the rest (scan::Buffers::parts), so that the last pass writes the rest's
// checkpoints as kda::prefill's own and the scan writes the one at the head's end.
#include "kda/distributed.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "core/problem.h"
#include "core/state_scan.h"
#include "cpu/access.h"
#ifdef KDA_WITH_CUDA
#include "cuda/cuda_backend.h"
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
// the prefill calls of the three passes that use them: one call per pass, or with checkpoints in
// dense mode one per batch row (a row is a varlen call of its two parts).
struct Plan {
  scan::Record record{};
  int world = 0;
  int64_t N = 0, tokens = 0;
  int parts = 1;
  bool checkpoints = false;  // parts == 2
  bool exchange = false;     // the piece lengths are gathered (pool or checkpoints)
  size_t zeros = 0, identity = 0, send = 0, recv = 0, start = 0, h = 0, out_m = 0, lengths = 0;
  size_t part_cu = 0, part_offsets = 0, inner = 0;
  size_t zero_bytes = 0, record_bytes = 0, length_bytes = 0, inner_bytes = 0, total = 0;
  // CPU tensors: part_cu and part_offsets live here, not in the workspace, holding a valid
  // stand-in layout ({0, .., 0, T_r} and zeros) until the layout step writes the real one:
  // validation of a CPU call reads their values, before the gather that gives them.
  std::vector<int64_t> host_part_cu, host_part_offsets;
  std::vector<PrefillParams> local_pass, m_pass, out_pass;

  Plan() = default;
  Plan(const Plan&) = delete;  // the passes' views point into the vectors
  Plan& operator=(const Plan&) = delete;
};

TensorView contiguous(uint8_t* base, size_t offset, DType dtype, std::vector<int64_t> shape,
                      Device device, int32_t index) {
  return make_view(base + offset, dtype, std::move(shape), device, index);
}

// Batch row b of a dense per-token view [B, T, ...], as [1, T, ...].
TensorView row_of(TensorView t, int64_t b) {
  t.data =
      static_cast<uint8_t*>(t.data) + b * t.strides[0] * static_cast<int64_t>(dtype_size(t.dtype));
  t.shape[0] = 1;
  return t;
}

// The plan of `local` on `world` ranks with buffers at `base` (kAlign-aligned; any such address
// when only sizing: the prefill passes' workspace depends on shapes and alignment only, and CPU
// validation reads only the plan's own vectors).
Status make_plan(const PrefillParams& local, int world, uint8_t* base, Plan* plan) {
  KDA_RETURN_IF_ERROR(validate(local));
  if (world < 1) return invalid("world_size", "at least 1, got " + std::to_string(world));
  const TensorView& q = local.q;
  const TensorView& v = local.v;
  const bool varlen = local.cu_seqlens.present();
  const int64_t N = varlen ? local.cu_seqlens.shape[0] - 1 : q.shape[0];
  const int64_t K = q.size(-1), HV = v.size(-2), V = v.size(-1);
  const bool v_first = local.state_layout == StateLayout::kVFirst;
  const int64_t R = v_first ? V : K, C = v_first ? K : V;
  const Device dev = q.device;
  const int32_t index = q.device_index;
  Plan& p = *plan;
  p.world = world;
  p.N = N;
  p.tokens = q.size(-3);
  p.checkpoints = local.checkpoint_every > 0;
  p.parts = p.checkpoints ? 2 : 1;
  p.exchange = p.checkpoints || local.state_pool.present();
  const int64_t parts = N * p.parts;
  p.record = {parts, HV, K, R, C};
  p.zero_bytes = static_cast<size_t>(K) * dtype_size(q.dtype);
  p.record_bytes = static_cast<size_t>(p.record.floats()) * sizeof(float);
  p.length_bytes = p.exchange ? static_cast<size_t>(N) * sizeof(int64_t) : 0;
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
  take(&p.start, states * static_cast<size_t>(p.parts) * sizeof(float));
  take(&p.h, 2 * states * sizeof(double));
  // The M pass writes an output of width K: the caller's out when V == K, else its own.
  std::vector<int64_t> out_shape(v.shape, v.shape + v.ndim);
  out_shape.back() = K;
  int64_t out_numel = 1;
  for (int64_t x : out_shape) out_numel *= x;
  take(&p.out_m, V == K ? 0 : static_cast<size_t>(out_numel) * dtype_size(q.dtype));
  take(&p.lengths, p.length_bytes * static_cast<size_t>(1 + world));
  // The parts' layout: [2N + 1] entries (dense cu_seqlens: 3).
  const int64_t layout_entries = std::max<int64_t>(2 * N + 1, 3);
  const bool on_host = dev == Device::kCPU;
  const size_t layout_bytes =
      p.checkpoints && !on_host ? static_cast<size_t>(layout_entries) * sizeof(int64_t) : 0;
  take(&p.part_cu, layout_bytes);
  take(&p.part_offsets, layout_bytes);
  int64_t* part_cu = reinterpret_cast<int64_t*>(base + p.part_cu);
  int64_t* part_offsets = reinterpret_cast<int64_t*>(base + p.part_offsets);
  if (p.checkpoints && on_host) {
    p.host_part_cu.assign(layout_entries, 0);
    p.host_part_cu[varlen ? 2 * N : 2] = p.tokens;
    p.host_part_offsets.assign(layout_entries, 0);
    part_cu = p.host_part_cu.data();
    part_offsets = p.host_part_offsets.data();
  }

  // The calls: one per pass over all parts, or per dense row over its two parts.
  PrefillParams common = local;
  common.initial_state = common.final_state = common.state_pool = common.state_indices = {};
  common.checkpoint_every = 0;
  common.checkpoints = common.checkpoint_offsets = {};
  common.check_indices = false;
  const bool per_row = p.checkpoints && !varlen;
  const int64_t calls = per_row ? N : 1;
  const int64_t call_parts = per_row ? 2 : parts;
  const size_t m_bytes = static_cast<size_t>(parts * HV * K * K) * sizeof(float);
  p.local_pass.assign(calls, common);
  p.m_pass.assign(calls, common);
  p.out_pass.assign(calls, common);
  for (int64_t c = 0; c < calls; ++c) {
    const int64_t part0 = per_row ? 2 * c : 0;
    PrefillParams& s_call = p.local_pass[c];
    PrefillParams& m_call = p.m_pass[c];
    PrefillParams& o_call = p.out_pass[c];
    if (per_row) {
      for (PrefillParams* call : {&s_call, &m_call, &o_call})
        for (TensorView* t : {&call->q, &call->k, &call->v, &call->g, &call->beta, &call->out})
          *t = row_of(*t, c);
    }
    if (p.checkpoints) {
      const TensorView cu =
          make_view(part_cu, DType::kInt64, {per_row ? 3 : 2 * N + 1}, dev, index);
      for (PrefillParams* call : {&s_call, &m_call, &o_call}) call->cu_seqlens = cu;
    }
    // Pass 1: S_local, from a zero state.
    s_call.final_state =
        contiguous(base, p.send + m_bytes + static_cast<size_t>(part0 * HV * R * C) * sizeof(float),
                   DType::kFloat32, {call_parts, HV, R, C}, dev, index);
    // Pass 2: M, from the identity (one K x K matrix, broadcast) with v = 0 of width K (K zeros,
    // broadcast).
    std::vector<int64_t> m_shape(m_call.v.shape, m_call.v.shape + m_call.v.ndim);
    m_shape.back() = K;
    std::vector<int64_t> broadcast(m_call.v.ndim, 0);
    broadcast.back() = 1;
    m_call.v = make_strided_view(base + p.zeros, q.dtype, m_shape, broadcast, dev, index);
    if (V != K) {
      const TensorView own = contiguous(base, p.out_m, q.dtype, out_shape, dev, index);
      m_call.out = per_row ? row_of(own, c) : own;
    }
    m_call.initial_state = make_strided_view(base + p.identity, DType::kFloat32,
                                             {call_parts, HV, K, K}, {0, 0, K, 1}, dev, index);
    m_call.final_state =
        contiguous(base, p.send + static_cast<size_t>(part0 * HV * K * K) * sizeof(float),
                   DType::kFloat32, {call_parts, HV, K, K}, dev, index);
    // Pass 3: the outputs (and the checkpoints of the parts' rest), from this rank's start
    // states (the scan writes the final states and pool slots).
    o_call.initial_state =
        contiguous(base, p.start + static_cast<size_t>(part0 * HV * R * C) * sizeof(float),
                   DType::kFloat32, {call_parts, HV, R, C}, dev, index);
    if (p.checkpoints) {
      o_call.checkpoint_every = local.checkpoint_every;
      o_call.checkpoints = local.checkpoints;
      o_call.checkpoint_offsets =
          make_view(part_offsets + part0, DType::kInt64, {call_parts + 1}, dev, index);
    }
  }

  size_t inner = 0;
  for (const auto* pass : {&p.local_pass, &p.m_pass, &p.out_pass})
    for (const PrefillParams& call : *pass) {
      size_t bytes = 0;
      KDA_RETURN_IF_ERROR(prefill_workspace_size(call, &bytes));
      inner = std::max(inner, bytes);
    }
  take(&p.inner, inner);
  p.inner_bytes = inner;
  p.total = at + kAlign;  // + the alignment of the caller's workspace
  for (auto* pass : {&p.local_pass, &p.m_pass, &p.out_pass})
    for (PrefillParams& call : *pass) {
      call.exec.workspace = inner > 0 ? base + p.inner : nullptr;
      call.exec.workspace_bytes = inner;
      call.exec.allocate_workspace = nullptr;
    }
  return Status::Ok();
}

// An address for sizing only: the plan's views are built but never dereferenced.
uint8_t* sizing_base() { return reinterpret_cast<uint8_t*>(uintptr_t{1} << 20); }

scan::Buffers buffers_of(Plan& p, const PrefillParams& local, uint8_t* base, int rank) {
  scan::Buffers b;
  b.record = p.record;
  b.records = reinterpret_cast<const float*>(base + p.recv);
  b.world = p.world;
  b.rank = rank;
  b.v_first = local.state_layout == StateLayout::kVFirst;
  b.N = p.N;
  b.parts = p.parts;
  b.cu_seqlens = local.cu_seqlens;
  b.tokens = p.tokens;
  if (p.exchange) b.lengths = reinterpret_cast<int64_t*>(base + p.lengths);
  if (p.checkpoints) {
    const bool on_host = local.q.device == Device::kCPU;
    b.part_cu = on_host ? p.host_part_cu.data() : reinterpret_cast<int64_t*>(base + p.part_cu);
    b.part_offsets =
        on_host ? p.host_part_offsets.data() : reinterpret_cast<int64_t*>(base + p.part_offsets);
    b.checkpoints = local.checkpoints;
    b.checkpoint_offsets = local.checkpoint_offsets;
    b.checkpoint_every = local.checkpoint_every;
  }
  b.initial_state = local.initial_state;
  b.final_state = local.final_state;
  b.state_pool = local.state_pool;
  b.state_indices = local.state_indices;
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
  if (b.lengths != nullptr)
    for (int64_t n = 0; n < b.N; ++n) b.lengths[n] = scan::local_length(b, n);
}

void layout_host(const scan::Buffers& b) {
  if (b.N == 0) scan::write_part_layout(b, -1);
  for (int64_t n = 0; n < b.N; ++n) scan::write_part_layout(b, n);
}

// The scan on the host: the kernel of src/cuda/distributed/scan.cu, one (sequence, value head)
// at a time.
void scan_host(const scan::Buffers& b) {
  const scan::Record& r = b.record;
  const int64_t RC = r.R * r.C;
  const bool pool = b.state_pool.present();
  for (int64_t n = 0; n < b.N; ++n) {
    const int64_t slot =
        pool ? rules::pool_slot(scan::index_at(b.state_indices, n), b.state_pool.shape[0])
             : rules::kNoSlot;
    const scan::Piece piece = b.lengths != nullptr ? scan::piece_of(b, n) : scan::Piece{};
    const int64_t boundary = b.parts == 2 ? scan::piece_rows_of(b, n).boundary : -1;
    for (int64_t hv = 0; hv < r.HV; ++hv) {
      const int64_t pair = n * r.HV + hv;
      double* h = b.h + pair * RC;
      double* next = b.h + (b.N * r.HV + pair) * RC;
      // Load: the initial state, or the pool slot's (zero when absent / no slot).
      const TensorView& t0 = pool ? b.state_pool : b.initial_state;
      const int64_t row0 = pool ? slot : n;
      for (int64_t e = 0; e < RC; ++e)
        h[e] =
            t0.present() && row0 >= 0
                ? cpu::load_scalar(t0.data, t0.dtype, cpu::offset4(t0, row0, hv, e / r.C, e % r.C))
                : 0.0;
      // Scan: every rank's parts in order; this rank's start states when its turn comes.
      for (int j = 0; j < b.world; ++j) {
        const float* rec = b.records + j * r.floats();
        for (int part = 0; part < b.parts; ++part) {
          const int64_t pi = n * b.parts + part;  // the part's row in the records and `start`
          if (j == b.rank)
            for (int64_t e = 0; e < RC; ++e)
              b.start[(pi * r.HV + hv) * RC + e] = static_cast<float>(h[e]);
          for (int64_t e = 0; e < RC; ++e)
            next[e] = scan::step_element(h, rec + r.m(pi, hv), rec + r.s(pi, hv), e / r.C, e % r.C,
                                         r.K, r.C, b.v_first);
          std::swap(h, next);
          if (j == b.rank && part == 0 && boundary >= 0) {  // the head's end: a checkpoint
            const TensorView& t = b.checkpoints;
            for (int64_t e = 0; e < RC; ++e)
              cpu::store_scalar(t.data, t.dtype, cpu::offset4(t, boundary, hv, e / r.C, e % r.C),
                                h[e]);
          }
        }
      }
      // Store: the final state, rounded to its dtype; the pool slot, by the rank holding the
      // sequence's last token.
      const TensorView& t = pool ? b.state_pool : b.final_state;
      const int64_t row = pool ? (piece.holds_last() ? slot : rules::kNoSlot) : n;
      if (t.present() && row >= 0)
        for (int64_t e = 0; e < RC; ++e)
          cpu::store_scalar(t.data, t.dtype, cpu::offset4(t, row, hv, e / r.C, e % r.C), h[e]);
    }
  }
}

// check_indices of a pool call, before any gather (every rank checks the same indices).
Status check_indices(const PrefillParams& local) {
  if (!local.check_indices || !local.state_pool.present()) return Status::Ok();
  detail::PrefillProblem pr;
  KDA_RETURN_IF_ERROR(detail::validate_prefill(local, &pr));
#ifdef KDA_WITH_CUDA
  if (pr.device == Device::kCUDA) return cuda::check_prefill_indices(pr, local.exec);
#endif
  return detail::check_prefill_index_values(pr, pr.state_indices.data);
}

Status run_calls(const std::vector<PrefillParams>& calls) {
  for (const PrefillParams& call : calls) KDA_RETURN_IF_ERROR(prefill(call));
  return Status::Ok();
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
  size_t total = 0;
  {
    Plan sized;
    KDA_RETURN_IF_ERROR(make_plan(local, world, sizing_base(), &sized));
    total = sized.total;
  }
  KDA_RETURN_IF_ERROR(check_indices(local));
  const ExecOptions& exec = local.exec;
  void* memory = exec.workspace;
  if (exec.workspace_bytes < total) {
    if (exec.allocate_workspace == nullptr)
      return invalid("workspace", "at least " + std::to_string(total) +
                                      " bytes (distributed_prefill_workspace_size), got " +
                                      std::to_string(exec.workspace_bytes));
    memory = exec.allocate_workspace(total, exec.allocate_context);
    if (memory == nullptr)
      return {StatusCode::kInternal, "workspace",
              "allocating " + std::to_string(total) + " bytes failed"};
  }
  uint8_t* base = reinterpret_cast<uint8_t*>(align_up(reinterpret_cast<uintptr_t>(memory)));
  Plan plan;
  KDA_RETURN_IF_ERROR(make_plan(local, world, base, &plan));
  const scan::Buffers buffers = buffers_of(plan, local, base, rank);
  const Device device = local.q.device;
  const bool on_cuda = device == Device::kCUDA;
  [[maybe_unused]] const int index = local.q.device_index;
#ifdef KDA_WITH_CUDA
  if (on_cuda) KDA_RETURN_IF_ERROR(cuda::distributed_prepare(buffers, index, exec.stream));
#else
  if (on_cuda) return unsupported("backend", "this build has no CUDA backend");
#endif
  if (!on_cuda) prepare_host(buffers);
  if (plan.exchange)
    KDA_RETURN_IF_ERROR(communicator.all_gather(buffers.lengths, buffers.lengths + plan.N,
                                                plan.length_bytes, device, exec.stream));
  if (plan.checkpoints) {
#ifdef KDA_WITH_CUDA
    if (on_cuda) KDA_RETURN_IF_ERROR(cuda::distributed_layout(buffers, index, exec.stream));
#endif
    if (!on_cuda) layout_host(buffers);
  }
  KDA_RETURN_IF_ERROR(run_calls(plan.local_pass));
  KDA_RETURN_IF_ERROR(run_calls(plan.m_pass));
  KDA_RETURN_IF_ERROR(communicator.all_gather(base + plan.send, base + plan.recv, plan.record_bytes,
                                              device, exec.stream));
#ifdef KDA_WITH_CUDA
  if (on_cuda) KDA_RETURN_IF_ERROR(cuda::distributed_scan(buffers, index, exec.stream));
#endif
  if (!on_cuda) scan_host(buffers);
  return run_calls(plan.out_pass);
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
