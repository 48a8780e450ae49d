// api.cpp — public entry points: validation, backend choice, dispatch, discovery.
#include <exception>
#include <new>
#include <string>

#include "core/problem.h"
#include "cpu/backends.h"
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
  t.ndim = static_cast<int32_t>(std::min<size_t>(shape.size(), kMaxDims));
  for (int i = 0; i < t.ndim; ++i) {
    t.shape[i] = shape[i];
    t.strides[i] = i < static_cast<int>(strides.size()) ? strides[i] : 0;
  }
  return t;
}

TensorView make_view(void* data, DType dtype, std::vector<int64_t> shape, Device device,
                     int32_t device_index) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (int i = static_cast<int>(shape.size()) - 2; i >= 0; --i) strides[i] = strides[i + 1] * shape[i + 1];
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
    case Backend::kAuto: return "auto";
    case Backend::kCpu: return "cpu";
    case Backend::kCuda: return "cuda";
    case Backend::kCpuReference: return "cpu-reference";
  }
  return "unknown";
}

const char* version() { return "0.1.0"; }

std::vector<int64_t> checkpoint_offsets(const std::vector<int64_t>& cu_seqlens, int64_t every) {
  std::vector<int64_t> off(cu_seqlens.empty() ? 1 : cu_seqlens.size(), 0);
  for (size_t i = 1; i < cu_seqlens.size(); ++i) {
    const int64_t len = cu_seqlens[i] - cu_seqlens[i - 1];
    off[i] = off[i - 1] + (every > 0 && len > 0 ? len / every : 0);
  }
  return off;
}

namespace {

// Picks the backend for tensors on `device` and checks that it can reach them.
Status choose_backend(const ExecOptions& exec, Device device, Backend* out) {
  const int b = static_cast<int>(exec.backend);
  if (b < 0 || b > 3)
    return {StatusCode::kInvalidArgument, "argument 'exec.backend': expected kAuto, kCpu, kCuda or kCpuReference, got code " + std::to_string(b)};
  const Backend be = resolve_backend(exec.backend, device);
  if ((be == Backend::kCpu || be == Backend::kCpuReference) && device != Device::kCPU)
    return {StatusCode::kInvalidArgument, std::string("argument 'exec.backend': expected a backend that reads CUDA tensors (auto or cuda), got ") + backend_name(be)};
  if (be == Backend::kCuda && device != Device::kCUDA)
    return {StatusCode::kInvalidArgument, "argument 'exec.backend': expected tensors on a CUDA device for the cuda backend, got cpu tensors"};
  if (be == Backend::kCuda && !cuda_compiled())
    return {StatusCode::kUnsupported, "argument 'exec.backend': cuda requested, but this build has no CUDA backend"};
  if (exec.num_threads < 0)
    return {StatusCode::kInvalidArgument, "argument 'exec.num_threads': expected >= 0, got " + std::to_string(exec.num_threads)};
  *out = be;
  return Status::Ok();
}

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

Status not_available() { return {StatusCode::kUnsupported, "argument 'exec.backend': backend not available"}; }

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
  return run_op<PrefillParams, detail::PrefillProblem>(p, detail::validate_prefill, [&](const auto& pr, Backend be) -> Status {
    switch (be) {
      case Backend::kCpuReference: cpu::reference_prefill(pr); return Status::Ok();
      case Backend::kCpu: cpu::fast_prefill(pr, p.exec.num_threads); return Status::Ok();
#ifdef KDA_WITH_CUDA
      case Backend::kCuda: return cuda::prefill(pr, p.exec);
#endif
      default: return not_available();
    }
  });
}

Status decode(const DecodeParams& p) {
  return run_op<DecodeParams, detail::DecodeProblem>(p, detail::validate_decode, [&](const auto& pr, Backend be) -> Status {
    if (p.check_indices && pr.device == Device::kCPU) {
      Status s = detail::check_decode_index_values(pr, pr.state_indices.data, pr.num_accepted_tokens.data,
                                                   pr.cu_seqlens.data);
      if (!s.ok()) return s;
    }
    switch (be) {
      case Backend::kCpuReference: cpu::reference_decode(pr); return Status::Ok();
      case Backend::kCpu: cpu::fast_decode(pr, p.exec.num_threads); return Status::Ok();
#ifdef KDA_WITH_CUDA
      case Backend::kCuda: return cuda::decode(pr, p.exec, p.check_indices);
#endif
      default: return not_available();
    }
  });
}

Status prefill_workspace_size(const PrefillParams& p, size_t* bytes) {
  if (bytes == nullptr) return {StatusCode::kInvalidArgument, "argument 'bytes': expected a pointer, got nullptr"};
  *bytes = 0;
  return run_op<PrefillParams, detail::PrefillProblem>(p, detail::validate_prefill, [&](const auto& pr, Backend be) -> Status {
#ifdef KDA_WITH_CUDA
    if (be == Backend::kCuda) return cuda::prefill_workspace_size(pr, bytes);
#endif
    return Status::Ok();
  });
}

Status decode_workspace_size(const DecodeParams& p, size_t* bytes) {
  if (bytes == nullptr) return {StatusCode::kInvalidArgument, "argument 'bytes': expected a pointer, got nullptr"};
  *bytes = 0;  // decode needs no workspace on any backend
  return run_op<DecodeParams, detail::DecodeProblem>(p, detail::validate_decode,
                                                     [](const auto&, Backend) { return Status::Ok(); });
}

}  // namespace kda
