// api.cpp — public entry points: validation, backend choice, dispatch, discovery.
#include <climits>
#include <exception>
#include <new>
#include <string>

#include "core/problem.h"
#include "cpu/backends.h"
#include "kda/version.h"
#ifdef KDA_WITH_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace kda {

TensorView make_strided_view(void* data, DType dtype, std::vector<int64_t> shape,
                             std::vector<int64_t> strides, Device device, int32_t device_index) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.device_index = device_index;
  // More than kMaxDims dimensions: the rank is recorded and nothing else (validation rejects it).
  t.ndim = static_cast<int32_t>(std::min<size_t>(shape.size(), INT32_MAX));
  if (t.ndim > kMaxDims) return t;
  for (int i = 0; i < t.ndim; ++i) {
    t.shape[i] = shape[i];
    t.strides[i] = i < static_cast<int>(strides.size()) ? strides[i] : 0;
  }
  return t;
}

TensorView make_view(void* data, DType dtype, std::vector<int64_t> shape, Device device,
                     int32_t device_index) {
  // Row-major strides, saturated at INT64_MAX where the product overflows (validation then
  // rejects the view, unless it has no element).
  std::vector<int64_t> strides(shape.size(), 1);
  for (int i = static_cast<int>(shape.size()) - 2; i >= 0; --i)
    if (__builtin_mul_overflow(strides[i + 1], shape[i + 1], &strides[i])) strides[i] = INT64_MAX;
  return make_strided_view(data, dtype, std::move(shape), std::move(strides), device, device_index);
}

bool cuda_compiled() {
#ifdef KDA_WITH_CUDA
  return true;
#else
  return false;
#endif
}

std::vector<DeviceInfo> cuda_devices() {
#ifdef KDA_WITH_CUDA
  return cuda::devices();
#else
  return {};
#endif
}

Backend resolve_backend(Backend requested, Device tensors_device) {
  if (requested != Backend::kAuto) return requested;
  return tensors_device == Device::kCUDA ? Backend::kCuda : Backend::kCpu;
}

const char* backend_name(Backend backend) {
  switch (backend) {
    case Backend::kAuto:
      return "auto";
    case Backend::kCpu:
      return "cpu";
    case Backend::kCuda:
      return "cuda";
    case Backend::kCpuReference:
      return "reference";
  }
  return "unknown";
}

const char* gate_name(GateForm gate) {
  switch (gate) {
    case GateForm::kPrecomputed:
      return "precomputed";
    case GateForm::kSoftplus:
      return "softplus";
    case GateForm::kLowerBound:
      return "lower_bound";
  }
  return "unknown";
}

const char* state_layout_name(StateLayout layout) {
  switch (layout) {
    case StateLayout::kVFirst:
      return "v_first";
    case StateLayout::kKFirst:
      return "k_first";
  }
  return "unknown";
}

const char* version() { return KDA_VERSION_STRING; }

std::vector<int64_t> checkpoint_offsets(const std::vector<int64_t>& cu_seqlens, int64_t every) {
  std::vector<int64_t> off(cu_seqlens.empty() ? 1 : cu_seqlens.size(), 0);
  for (size_t i = 1; i < cu_seqlens.size(); ++i) {
    const int64_t len = cu_seqlens[i] - cu_seqlens[i - 1];
    off[i] = off[i - 1] + (every > 0 && len > 0 ? len / every : 0);
  }
  return off;
}

namespace {

Status invalid(const char* argument, const std::string& what) {
  return {StatusCode::kInvalidArgument, argument, what};
}

// Picks the backend for tensors on `device` and checks that it can reach them.
Status choose_backend(const ExecOptions& exec, Device device, Backend* out) {
  const int b = static_cast<int>(exec.backend);
  if (b < 0 || b >= kNumBackends)
    return invalid("backend",
                   "expected 'auto', 'cpu', 'cuda' or 'reference', got code " + std::to_string(b));
  const Backend be = resolve_backend(exec.backend, device);
  if ((be == Backend::kCpu || be == Backend::kCpuReference) && device != Device::kCPU)
    return invalid(
        "backend",
        std::string("expected a backend that reads CUDA tensors ('auto' or 'cuda'), got '") +
            backend_name(be) + "'");
  if (be == Backend::kCuda && device != Device::kCUDA)
    return invalid("backend",
                   "expected tensors on a CUDA device for the 'cuda' backend, got cpu tensors");
  if (be == Backend::kCuda && !cuda_compiled())
    return {StatusCode::kUnsupported, "backend",
            "expected a build with the CUDA backend for CUDA tensors or 'cuda', but this build "
            "has none"};
  if (exec.num_threads < 0 || exec.num_threads > kMaxNumThreads)
    return invalid("num_threads", "expected 0 (all hardware threads) to " +
                                      std::to_string(kMaxNumThreads) + ", got " +
                                      std::to_string(exec.num_threads));
  *out = be;
  return Status::Ok();
}

#ifdef KDA_WITH_CUDA
// The caller's workspace, or one from exec.allocate_workspace when the call needs more than
// exec.workspace_bytes: `size(&need)` gives the call's need.
template <typename Size>
Status cuda_workspace(ExecOptions* exec, Size&& size) {
  if (exec->allocate_workspace == nullptr) return Status::Ok();
  size_t need = 0;
  Status s = size(&need);
  if (!s.ok() || need == 0) return s;
  if (exec->workspace != nullptr && exec->workspace_bytes >= need) return Status::Ok();
  void* w = exec->allocate_workspace(need, exec->allocate_context);
  if (w == nullptr)
    return {StatusCode::kInternal, "workspace",
            "allocating " + std::to_string(need) + " bytes of device workspace failed"};
  exec->workspace = w;
  exec->workspace_bytes = need;
  return Status::Ok();
}
#endif

template <typename Fn>
Status guarded(Fn&& fn) {
  try {
    return fn();
  } catch (const std::bad_alloc&) {
    return {StatusCode::kInternal, "host memory allocation failed"};
  } catch (const std::exception& e) {
    return {StatusCode::kInternal, e.what()};
  }
}

// Validates, picks the backend, then runs `body(problem, backend)`.
template <typename Params, typename Problem, typename Validate, typename Body>
Status run_op(const Params& p, Validate&& validate_fn, Body&& body) {
  return guarded([&]() -> Status {
    Problem pr;
    Status s = validate_fn(p, &pr);
    if (!s.ok()) return s;
    Backend be;
    s = choose_backend(p.exec, pr.device, &be);
    if (!s.ok()) return s;
    return body(pr, be);
  });
}

Status not_available() { return {StatusCode::kUnsupported, "backend", "backend not available"}; }

}  // namespace

Status validate(const PrefillParams& p) {
  detail::PrefillProblem pr;
  return guarded([&] { return detail::validate_prefill(p, &pr); });
}

Status validate(const DecodeParams& p) {
  detail::DecodeProblem pr;
  return guarded([&] { return detail::validate_decode(p, &pr); });
}

Status prefill(const PrefillParams& p) {
  return run_op<PrefillParams, detail::PrefillProblem>(
      p, detail::validate_prefill, [&](const auto& pr, Backend be) -> Status {
        if (p.check_indices) {
#ifdef KDA_WITH_CUDA
          if (pr.device == Device::kCUDA)
            KDA_RETURN_IF_ERROR(cuda::check_prefill_indices(pr, p.exec));
#endif
          if (pr.device == Device::kCPU)
            KDA_RETURN_IF_ERROR(detail::check_prefill_index_values(pr, pr.state_indices.data));
        }
        switch (be) {
          case Backend::kCpuReference:
            cpu::reference_prefill(pr);
            return Status::Ok();
          case Backend::kCpu:
            return cpu::fast_prefill(pr, p.exec.num_threads);
#ifdef KDA_WITH_CUDA
          case Backend::kCuda: {
            ExecOptions exec = p.exec;
            Status s = cuda_workspace(
                &exec, [&](size_t* need) { return cuda::prefill_workspace_size(pr, need); });
            return s.ok() ? cuda::prefill(pr, exec) : s;
          }
#endif
          default:
            return not_available();
        }
      });
}

Status decode(const DecodeParams& p) {
  return run_op<DecodeParams, detail::DecodeProblem>(
      p, detail::validate_decode, [&](const auto& pr, Backend be) -> Status {
        if (p.check_indices && pr.device == Device::kCPU) {
          Status s = detail::check_decode_index_values(
              pr, pr.state_indices.data, pr.num_accepted_tokens.data, pr.cu_seqlens.data);
          if (!s.ok()) return s;
        }
        switch (be) {
          case Backend::kCpuReference:
            cpu::reference_decode(pr);
            return Status::Ok();
          case Backend::kCpu:
            return cpu::fast_decode(pr, p.exec.num_threads);
#ifdef KDA_WITH_CUDA
          case Backend::kCuda:
            return cuda::decode(pr, p.exec, p.check_indices);
#endif
          default:
            return not_available();
        }
      });
}

Status validate(const PrefillBackwardParams& p) {
  detail::PrefillBackwardProblem pr;
  return guarded([&] { return detail::validate_prefill_backward(p, &pr); });
}

// The CPU backends both run the fp64 reference backward; CUDA tensors run the CUDA backward
// (backward/backward.cu) with the caller's or an allocated workspace.
Status prefill_backward(const PrefillBackwardParams& p) {
  return guarded([&]() -> Status {
    detail::PrefillBackwardProblem pr;
    Status s = detail::validate_prefill_backward(p, &pr);
    if (!s.ok()) return s;
    Backend be;
    s = choose_backend(p.exec, pr.fwd.device, &be);
    if (!s.ok()) return s;
#ifdef KDA_WITH_CUDA
    if (be == Backend::kCuda) {
      ExecOptions exec = p.exec;
      s = cuda_workspace(
          &exec, [&](size_t* need) { return cuda::prefill_backward_workspace_size(pr, need); });
      if (!s.ok()) return s;
      return cuda::prefill_backward(pr, exec);
    }
#endif
    if (be != Backend::kCpu && be != Backend::kCpuReference) return not_available();
    cpu::reference_prefill_backward(pr);
    return Status::Ok();
  });
}

Status prefill_backward_workspace_size(const PrefillBackwardParams& p, size_t* bytes) {
  if (bytes == nullptr) return invalid("bytes", "expected a pointer, got nullptr");
  *bytes = 0;
  return guarded([&]() -> Status {
    detail::PrefillBackwardProblem pr;
    Status s = detail::validate_prefill_backward(p, &pr);
    if (!s.ok()) return s;
    Backend be;
    s = choose_backend(p.exec, pr.fwd.device, &be);
    if (!s.ok()) return s;
#ifdef KDA_WITH_CUDA
    if (be == Backend::kCuda) return cuda::prefill_backward_workspace_size(pr, bytes);
#endif
    return Status::Ok();
  });
}

Status prefill_workspace_size(const PrefillParams& p, size_t* bytes) {
  if (bytes == nullptr) return invalid("bytes", "expected a pointer, got nullptr");
  *bytes = 0;
  return run_op<PrefillParams, detail::PrefillProblem>(
      p, detail::validate_prefill, [&](const auto& pr, Backend be) -> Status {
#ifdef KDA_WITH_CUDA
        if (be == Backend::kCuda) return cuda::prefill_workspace_size(pr, bytes);
#endif
        return Status::Ok();
      });
}

Status decode_workspace_size(const DecodeParams& p, size_t* bytes) {
  if (bytes == nullptr) return invalid("bytes", "expected a pointer, got nullptr");
  *bytes = 0;  // decode needs no workspace on any backend
  return run_op<DecodeParams, detail::DecodeProblem>(
      p, detail::validate_decode, [](const auto&, Backend) { return Status::Ok(); });
}

}  // namespace kda
