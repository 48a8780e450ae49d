// validate.cpp — the contract checks shared by every backend (spec section 6).
//
// Every failure names the argument, what was expected and what was given. Validation reads no
// tensor data except, for host tensors, the values of cu_seqlens and checkpoint_offsets.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/problem.h"

namespace kda::detail {
namespace {

// Shapes are formatted with std::to_string, not iostreams: the error path then needs no locale or
// stream state of the C++ runtime (it runs inside host processes such as Python with torch and the
// CUDA driver loaded), and a view whose rank is out of range is never read past kMaxDims.
std::string dims_str(const int64_t* dims, int n) {
  std::string s = "[";
  for (int i = 0; i < n; ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  s += "]";
  return s;
}

std::string shape_str(const TensorView& t) {
  if (!t.present()) return "absent";
  if (t.ndim < 0 || t.ndim > kMaxDims) return "rank " + std::to_string(t.ndim);
  return dims_str(t.shape, t.ndim);
}

std::string dims_str(std::initializer_list<int64_t> dims) {
  return dims_str(dims.begin(), static_cast<int>(dims.size()));
}

Status Err(const char* arg, const std::string& expected, const std::string& got) {
  return {StatusCode::kInvalidArgument, arg, "expected " + expected + ", got " + got};
}

bool is_float(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat16 || d == DType::kBFloat16;
}
bool is_index(DType d) { return d == DType::kInt32 || d == DType::kInt64; }

// Largest element offset of a view with sizes and strides >= 0 and `numel` elements (0 when
// empty); -1 when it does not fit in int64.
int64_t max_offset(const TensorView& t, int64_t numel) {
  if (numel == 0) return 0;
  int64_t last = 0;
  for (int i = 0; i < t.ndim; ++i) {
    int64_t step = 0;
    if (__builtin_mul_overflow(t.shape[i] - 1, t.strides[i], &step) ||
        __builtin_add_overflow(last, step, &last))
      return -1;
  }
  return last;
}

std::string strides_str(const TensorView& t) { return dims_str(t.strides, t.ndim); }

// Structural checks every present tensor gets: rank within bounds, sizes >= 0, strides >= 0,
// element count and offsets within int64, last dimension contiguous, data present when
// non-empty, same device as the reference tensor. The dtype is checked by each argument's own
// check, which lists only the dtypes that argument allows.
Status check_view(const char* arg, const TensorView& t, const TensorView& ref_device) {
  if (t.ndim < 1 || t.ndim > kMaxDims)
    return Err(arg, "rank 1.." + std::to_string(kMaxDims), "rank " + std::to_string(t.ndim));
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] < 0) return Err(arg, "non-negative sizes", "shape " + shape_str(t));
    if (t.strides[i] < 0)
      return Err(arg, "non-negative strides",
                 "stride " + std::to_string(t.strides[i]) + " in dimension " + std::to_string(i));
  }
  const int64_t numel = t.numel();
  if (numel < 0) return Err(arg, "an element count that fits in int64", "shape " + shape_str(t));
  if (max_offset(t, numel) < 0)
    return Err(arg, "element offsets that fit in int64",
               "shape " + shape_str(t) + " with strides " + strides_str(t));
  if (t.shape[t.ndim - 1] > 1 && t.strides[t.ndim - 1] != 1)
    return Err(arg, "a contiguous last dimension (stride 1)",
               "stride " + std::to_string(t.strides[t.ndim - 1]));
  if (t.data == nullptr && numel > 0) return Err(arg, "a data pointer", "nullptr");
  if (t.device != ref_device.device ||
      (t.device == Device::kCUDA && t.device_index != ref_device.device_index)) {
    auto dev = [](const TensorView& x) {
      return x.device == Device::kCPU ? std::string("cpu")
                                      : "cuda:" + std::to_string(x.device_index);
    };
    return Err(arg, "device " + dev(ref_device) + " (same as q)", "device " + dev(t));
  }
  return Status::Ok();
}

Status check_dtype_float(const char* arg, const TensorView& t, DType q_dtype, bool allow_fp32) {
  if (t.dtype == q_dtype || (allow_fp32 && t.dtype == DType::kFloat32)) return Status::Ok();
  const bool or_fp32 = allow_fp32 && q_dtype != DType::kFloat32;
  return Err(arg,
             std::string("dtype ") + dtype_name(q_dtype) + (or_fp32 ? " or fp32" : "") + " (as q)",
             std::string("dtype ") + dtype_name(t.dtype));
}

Status check_shape(const char* arg, const TensorView& t, std::initializer_list<int64_t> dims) {
  bool ok = t.ndim == static_cast<int>(dims.size());
  int i = 0;
  for (int64_t d : dims) {
    if (!ok) break;
    ok = t.shape[i++] == d;
  }
  return ok ? Status::Ok() : Err(arg, "shape " + dims_str(dims), "shape " + shape_str(t));
}

// Views a per-token tensor as rank 4, adding the leading 1 of a rank-3 varlen tensor.
TensorView as_rank4(const TensorView& t) {
  if (t.ndim == 4) return t;
  TensorView r = t;
  r.ndim = 4;
  for (int i = 3; i >= 1; --i) {
    r.shape[i] = t.shape[i - 1];
    r.strides[i] = t.strides[i - 1];
  }
  r.shape[0] = 1;
  r.strides[0] = 0;
  return r;
}

// Per-token tensor: [B, T, d2, d3] (or [T, d2, d3] in varlen mode).
Status check_token_tensor(const char* arg, const TensorView& t, const Dims& d, int64_t d2,
                          int64_t d3, const TensorView& q) {
  if (!t.present()) return Err(arg, "a tensor", "absent");
  KDA_RETURN_IF_ERROR(check_view(arg, t, q));
  if (t.ndim == 4 || !d.varlen) return check_shape(arg, t, {d.B, d.T, d2, d3});
  return check_shape(arg, t, {d.T, d2, d3});
}

Status check_token_tensor3(const char* arg, const TensorView& t, const Dims& d, int64_t d2,
                           const TensorView& q) {
  if (!t.present()) return Err(arg, "a tensor", "absent");
  KDA_RETURN_IF_ERROR(check_view(arg, t, q));
  if (t.ndim == 3 || !d.varlen) return check_shape(arg, t, {d.B, d.T, d2});
  return check_shape(arg, t, {d.T, d2});
}

TensorView beta_as_rank4(const TensorView& t) {
  // [B, T, HV] -> [B, T, HV, 1]; [T, HV] -> [1, T, HV, 1]
  TensorView r = t;
  r.ndim = 4;
  const int o = t.ndim == 2 ? 1 : 0;
  r.shape[0] = o ? 1 : t.shape[0];
  r.strides[0] = o ? 0 : t.strides[0];
  r.shape[1] = t.shape[1 - o];
  r.strides[1] = t.strides[1 - o];
  r.shape[2] = t.shape[2 - o];
  r.strides[2] = t.strides[2 - o];
  r.shape[3] = 1;
  r.strides[3] = 1;
  return r;
}

// Parses q (and cu_seqlens) into Dims.
Status parse_q(const TensorView& q, const TensorView& cu, Dims* d) {
  if (!q.present()) return Err("q", "a tensor [B, T, H, K]", "absent");
  KDA_RETURN_IF_ERROR(check_view("q", q, q));
  if (!is_float(q.dtype))
    return Err("q", "dtype bf16, fp16 or fp32", std::string("dtype ") + dtype_name(q.dtype));
  d->varlen = cu.present();
  if (d->varlen) {
    KDA_RETURN_IF_ERROR(check_view("cu_seqlens", cu, q));
    if (cu.ndim != 1 || cu.shape[0] < 1)
      return Err("cu_seqlens", "shape [N + 1] with N >= 0", "shape " + shape_str(cu));
    if (!is_index(cu.dtype))
      return Err("cu_seqlens", "dtype int32 or int64",
                 std::string("dtype ") + dtype_name(cu.dtype));
    if (q.ndim == 3) {
      d->B = 1;
      d->T = q.shape[0];
      d->H = q.shape[1];
      d->K = q.shape[2];
    } else if (q.ndim == 4) {
      if (q.shape[0] != 1)
        return Err("q", "batch size 1 in varlen mode (cu_seqlens given)", "shape " + shape_str(q));
      d->B = 1;
      d->T = q.shape[1];
      d->H = q.shape[2];
      d->K = q.shape[3];
    } else {
      return Err("q", "shape [1, T, H, K] or [T, H, K] in varlen mode", "shape " + shape_str(q));
    }
    d->N = cu.shape[0] - 1;
  } else {
    if (q.ndim != 4) return Err("q", "shape [B, T, H, K]", "shape " + shape_str(q));
    d->B = q.shape[0];
    d->T = q.shape[1];
    d->H = q.shape[2];
    d->K = q.shape[3];
    d->N = d->B;
  }
  if (d->H < 1) return Err("q", "at least one head (H >= 1)", "shape " + shape_str(q));
  if (d->K < 1 || d->K > 256)
    return Err("q", "head dim K in [1, 256]", "K = " + std::to_string(d->K));
  return Status::Ok();
}

// v gives HV and V.
Status parse_v(const TensorView& v, const TensorView& q, Dims* d) {
  if (!v.present()) return Err("v", "a tensor [B, T, HV, V]", "absent");
  KDA_RETURN_IF_ERROR(check_view("v", v, q));
  if (v.ndim != q.ndim)
    return Err("v", "rank " + std::to_string(q.ndim) + " (as q)", "shape " + shape_str(v));
  const int o = v.ndim - 4;  // -1 for rank 3 (varlen [T, HV, V])
  if (!std::equal(v.shape, v.shape + v.ndim - 2, q.shape))
    return Err("v", "the same leading dimensions as q " + shape_str(q), "shape " + shape_str(v));
  d->HV = v.shape[2 + o];
  d->V = v.shape[3 + o];
  if (d->HV < 1 || d->HV % d->H != 0)
    return Err("v", "HV a positive multiple of H = " + std::to_string(d->H),
               "HV = " + std::to_string(d->HV));
  if (d->V < 1 || d->V > 256)
    return Err("v", "value dim V in [1, 256]", "V = " + std::to_string(d->V));
  if (v.dtype != q.dtype)
    return Err("v", std::string("dtype ") + dtype_name(q.dtype) + " (as q)",
               std::string("dtype ") + dtype_name(v.dtype));
  return Status::Ok();
}

// q, k, v (and cu_seqlens) into Dims.
Status parse_qkv(const TensorView& q, const TensorView& k, const TensorView& v,
                 const TensorView& cu, Dims* d) {
  KDA_RETURN_IF_ERROR(parse_q(q, cu, d));
  if (!k.present()) return Err("k", "a tensor [B, T, H, K]", "absent");
  KDA_RETURN_IF_ERROR(check_view("k", k, q));
  if (k.ndim != q.ndim || !std::equal(k.shape, k.shape + k.ndim, q.shape))
    return Err("k", "shape " + shape_str(q) + " (as q)", "shape " + shape_str(k));
  if (k.dtype != q.dtype)
    return Err("k", std::string("dtype ") + dtype_name(q.dtype) + " (as q)",
               std::string("dtype ") + dtype_name(k.dtype));
  return parse_v(v, q, d);
}

// One-of names of an enum's values for messages: "'a', 'b' or 'c'".
template <typename Enum>
std::string enum_names(const char* (*name)(Enum), int count) {
  std::string s;
  for (int i = 0; i < count; ++i) {
    s += i == 0 ? "" : (i + 1 == count ? " or " : ", ");
    s += std::string("'") + name(static_cast<Enum>(i)) + "'";
  }
  return s;
}

Status parse_math(const MathOptions& m, const Dims& d, MathConsts* mc) {
  const int gate = static_cast<int>(m.gate);
  if (gate < 0 || gate >= kNumGateForms)
    return Err("gate", enum_names(gate_name, kNumGateForms), "code " + std::to_string(gate));
  if (m.gate == GateForm::kLowerBound && !(m.lower_bound >= -5.0f && m.lower_bound < 0.0f))
    return Err("lower_bound", "a value in [-5, 0)", std::to_string(m.lower_bound));
  if (m.allow_neg_eigval && !m.beta_logits)
    return Err("allow_neg_eigval", "beta_logits (b = 2 * sigmoid(beta))", "beta_logits false");
  double scale = m.scale.has_value() ? *m.scale : 1.0 / std::sqrt(static_cast<double>(d.K));
  if (!std::isfinite(scale)) return Err("scale", "a finite value", std::to_string(scale));
  mc->gate = m.gate;
  mc->beta_logits = m.beta_logits;
  mc->allow_neg_eigval = m.allow_neg_eigval;
  mc->use_qk_l2norm = m.use_qk_l2norm;
  mc->scale = scale;
  mc->lower_bound = m.lower_bound;
  return Status::Ok();
}

Status check_state_layout(StateLayout layout) {
  const int code = static_cast<int>(layout);
  if (code >= 0 && code < kNumStateLayouts) return Status::Ok();
  return Err("state_layout", enum_names(state_layout_name, kNumStateLayouts),
             "code " + std::to_string(code));
}

Status check_gate_params(const TensorView& A_log, const TensorView& dt_bias, const Dims& d,
                         const TensorView& q, bool dt_bias_bf16_ok) {
  if (A_log.present()) {
    KDA_RETURN_IF_ERROR(check_view("A_log", A_log, q));
    KDA_RETURN_IF_ERROR(check_shape("A_log", A_log, {d.HV}));
    if (A_log.dtype != DType::kFloat32)
      return Err("A_log", "dtype fp32", std::string("dtype ") + dtype_name(A_log.dtype));
  }
  if (dt_bias.present()) {
    KDA_RETURN_IF_ERROR(check_view("dt_bias", dt_bias, q));
    KDA_RETURN_IF_ERROR(check_shape("dt_bias", dt_bias, {d.HV, d.K}));
    if (dt_bias.dtype != DType::kFloat32 && !(dt_bias_bf16_ok && dt_bias.dtype == DType::kBFloat16))
      return Err("dt_bias", dt_bias_bf16_ok ? "dtype fp32 or bf16" : "dtype fp32",
                 std::string("dtype ") + dtype_name(dt_bias.dtype));
  }
  return Status::Ok();
}

// A state tensor [rows, HV, V, K] (V-first) or [rows, HV, K, V] (K-first).
Status check_state(const char* arg, const TensorView& s, int64_t rows, const Dims& d,
                   StateLayout layout, const TensorView& q, bool allow_fp16) {
  KDA_RETURN_IF_ERROR(check_view(arg, s, q));
  const int64_t a = layout == StateLayout::kVFirst ? d.V : d.K;
  const int64_t b = layout == StateLayout::kVFirst ? d.K : d.V;
  const char* lname = layout == StateLayout::kVFirst ? " (V-first)" : " (K-first)";
  if (s.ndim != 4 || (rows >= 0 && s.shape[0] != rows) || s.shape[1] != d.HV || s.shape[2] != a ||
      s.shape[3] != b)
    return Err(arg,
               "shape " +
                   (rows >= 0 ? dims_str({rows, d.HV, a, b})
                              : "[P, " + std::to_string(d.HV) + ", " + std::to_string(a) + ", " +
                                    std::to_string(b) + "]") +
                   lname,
               "shape " + shape_str(s));
  const bool ok = s.dtype == DType::kFloat32 || s.dtype == DType::kBFloat16 ||
                  (allow_fp16 && s.dtype == DType::kFloat16);
  if (!ok)
    return Err(arg, allow_fp16 ? "dtype fp32, bf16 or fp16" : "dtype fp32 or bf16",
               std::string("dtype ") + dtype_name(s.dtype));
  return Status::Ok();
}

Status check_index_vector(const char* arg, const TensorView& t, int64_t n, const TensorView& q) {
  KDA_RETURN_IF_ERROR(check_view(arg, t, q));
  KDA_RETURN_IF_ERROR(check_shape(arg, t, {n}));
  if (!is_index(t.dtype))
    return Err(arg, "dtype int32 or int64", std::string("dtype ") + dtype_name(t.dtype));
  return Status::Ok();
}

// A tensor the call writes: no two of its elements may share memory (inputs may).
Status check_output_strides(const char* arg, const TensorView& t) {
  const Overlap o = internal_overlap(t);
  if (o == Overlap::kNo) return Status::Ok();
  return Err(arg,
             std::string("an output whose elements do not share memory") +
                 (o == Overlap::kUnknown ? " (strides too irregular to check)" : ""),
             "shape " + shape_str(t) + " with strides " + strides_str(t));
}

}  // namespace

Overlap internal_overlap(const TensorView& t) {
  struct Dim {
    int64_t size, stride;
  };
  Dim dims[kMaxDims];
  int nd = 0;
  for (int i = 0; i < t.ndim; ++i)
    if (t.shape[i] == 0) return Overlap::kNo;  // no element at all
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] == 1) continue;  // a size-1 dimension never moves
    if (t.strides[i] == 0) return Overlap::kYes;
    dims[nd++] = {t.shape[i], t.strides[i]};
  }
  for (int i = 1; i < nd; ++i)  // largest stride first (insertion sort of at most 6)
    for (int j = i; j > 0 && dims[j - 1].stride < dims[j].stride; --j)
      std::swap(dims[j - 1], dims[j]);
  // rest[i]: the span of dimensions i.. (largest stride first); offsets fit in int64.
  int64_t rest[kMaxDims + 1] = {};
  bool nested = true;  // every stride beyond the span of the smaller ones (any dense layout)
  for (int i = nd - 1; i >= 0; --i) {
    nested = nested && dims[i].stride > rest[i + 1];
    rest[i] = rest[i + 1] + (dims[i].size - 1) * dims[i].stride;
  }
  if (nested) return Overlap::kNo;
  // Exact search, largest stride first: a partial sum r can only return to 0 while |r| is within
  // the span of the remaining dimensions. The first nonzero x_i is positive (x and -x both
  // solve). 128-bit sums: r and the bounds stay below twice the largest offset.
  int64_t budget = int64_t{1} << 20;
  auto floor_div = [](__int128 a, __int128 b) { return a / b - ((a % b != 0) && (a < 0)); };
  auto search = [&](auto&& self, int i, __int128 r, bool nonzero) -> Overlap {
    if (i == nd) return nonzero && r == 0 ? Overlap::kYes : Overlap::kNo;
    if (--budget < 0) return Overlap::kUnknown;
    const __int128 s = dims[i].stride, lim = rest[i + 1];
    __int128 lo = -floor_div(lim + r, s), hi = floor_div(lim - r, s);
    lo = std::max<__int128>(lo, nonzero ? -(dims[i].size - 1) : 0);
    hi = std::min<__int128>(hi, dims[i].size - 1);
    for (__int128 x = lo; x <= hi; ++x) {
      const Overlap o = self(self, i + 1, r + x * s, nonzero || x != 0);
      if (o != Overlap::kNo) return o;
    }
    return Overlap::kNo;
  };
  return search(search, 0, 0, false);
}

Status check_cu_seqlens_values(const TensorView& cu, int64_t total_tokens) {
  const int64_t n1 = cu.shape[0];
  if (load_index(cu, 0) != 0)
    return Err("cu_seqlens", "cu_seqlens[0] == 0",
               "cu_seqlens[0] = " + std::to_string(load_index(cu, 0)));
  for (int64_t i = 1; i < n1; ++i) {
    if (load_index(cu, i) < load_index(cu, i - 1))
      return Err("cu_seqlens", "non-decreasing values",
                 "cu_seqlens[" + std::to_string(i) + "] = " + std::to_string(load_index(cu, i)) +
                     " < cu_seqlens[" + std::to_string(i - 1) +
                     "] = " + std::to_string(load_index(cu, i - 1)));
  }
  if (load_index(cu, n1 - 1) != total_tokens)
    return Err("cu_seqlens", "last value == total tokens " + std::to_string(total_tokens),
               std::to_string(load_index(cu, n1 - 1)));
  return Status::Ok();
}

Status validate_prefill(const PrefillParams& p, PrefillProblem* pr) {
  Dims d;
  KDA_RETURN_IF_ERROR(parse_qkv(p.q, p.k, p.v, p.cu_seqlens, &d));
  KDA_RETURN_IF_ERROR(check_token_tensor("g", p.g, d, d.HV, d.K, p.q));
  KDA_RETURN_IF_ERROR(check_dtype_float("g", p.g, p.q.dtype, true));
  KDA_RETURN_IF_ERROR(check_token_tensor3("beta", p.beta, d, d.HV, p.q));
  KDA_RETURN_IF_ERROR(check_dtype_float("beta", p.beta, p.q.dtype, true));
  KDA_RETURN_IF_ERROR(check_gate_params(p.A_log, p.dt_bias, d, p.q, false));
  KDA_RETURN_IF_ERROR(check_token_tensor("out", p.out, d, d.HV, d.V, p.q));
  KDA_RETURN_IF_ERROR(check_dtype_float("out", p.out, p.q.dtype, false));
  KDA_RETURN_IF_ERROR(check_output_strides("out", p.out));
  MathConsts mc;
  KDA_RETURN_IF_ERROR(parse_math(p.math, d, &mc));
  KDA_RETURN_IF_ERROR(check_state_layout(p.state_layout));

  // States: either initial/final rows per sequence, or a pool with indices.
  if (p.state_pool.present() || p.state_indices.present()) {
    if (!p.state_pool.present())
      return Err("state_pool", "a pool [P, HV, ...] with state_indices", "absent");
    if (!p.state_indices.present())
      return Err("state_indices", "a tensor [N] with state_pool", "absent");
    if (p.initial_state.present())
      return Err("initial_state", "absent in pool mode (the pool is read through state_indices)",
                 shape_str(p.initial_state));
    if (p.final_state.present())
      return Err("final_state", "absent in pool mode (the pool is written in place)",
                 shape_str(p.final_state));
    KDA_RETURN_IF_ERROR(check_state("state_pool", p.state_pool, -1, d, p.state_layout, p.q, true));
    KDA_RETURN_IF_ERROR(check_output_strides("state_pool", p.state_pool));
    KDA_RETURN_IF_ERROR(check_index_vector("state_indices", p.state_indices, d.N, p.q));
  }
  if (p.initial_state.present())
    KDA_RETURN_IF_ERROR(
        check_state("initial_state", p.initial_state, d.N, d, p.state_layout, p.q, true));
  if (p.final_state.present()) {
    KDA_RETURN_IF_ERROR(
        check_state("final_state", p.final_state, d.N, d, p.state_layout, p.q, true));
    KDA_RETURN_IF_ERROR(check_output_strides("final_state", p.final_state));
  }

  if (p.checkpoint_every < 0 || p.checkpoint_every % kChunkSize != 0)
    return Err("checkpoint_every", "0 or a positive multiple of " + std::to_string(kChunkSize),
               std::to_string(p.checkpoint_every));
  if (p.checkpoint_every > 0) {
    if (!p.checkpoints.present())
      return Err("checkpoints", "a tensor [num_checkpoints, HV, ...] when checkpoint_every > 0",
                 "absent");
    KDA_RETURN_IF_ERROR(
        check_state("checkpoints", p.checkpoints, -1, d, p.state_layout, p.q, true));
    KDA_RETURN_IF_ERROR(check_output_strides("checkpoints", p.checkpoints));
    if (!p.checkpoint_offsets.present())
      return Err("checkpoint_offsets", "a tensor [N + 1] when checkpoint_every > 0", "absent");
    KDA_RETURN_IF_ERROR(
        check_index_vector("checkpoint_offsets", p.checkpoint_offsets, d.N + 1, p.q));
  } else if (p.checkpoints.present() || p.checkpoint_offsets.present()) {
    return Err(
        "checkpoint_every",
        "a positive multiple of " + std::to_string(kChunkSize) + " when checkpoints are given",
        "0");
  }

  // Host-visible index values.
  if (p.q.device == Device::kCPU) {
    if (d.varlen) KDA_RETURN_IF_ERROR(check_cu_seqlens_values(p.cu_seqlens, d.T));
    if (p.checkpoint_every > 0) {
      const TensorView& o = p.checkpoint_offsets;
      const int64_t rows = p.checkpoints.shape[0];
      for (int64_t i = 0; i <= d.N; ++i) {
        const int64_t x = load_index(o, i);
        if (x < 0 || x > rows || (i > 0 && x < load_index(o, i - 1)))
          return Err("checkpoint_offsets",
                     "non-decreasing values in [0, " + std::to_string(rows) + "]",
                     "checkpoint_offsets[" + std::to_string(i) + "] = " + std::to_string(x));
      }
    }
  }

  pr->d = d;
  pr->math = mc;
  pr->q = as_rank4(p.q);
  pr->k = as_rank4(p.k);
  pr->v = as_rank4(p.v);
  pr->g = as_rank4(p.g);
  pr->out = as_rank4(p.out);
  pr->beta = beta_as_rank4(p.beta);
  pr->A_log = p.A_log;
  pr->dt_bias = p.dt_bias;
  pr->cu_seqlens = p.cu_seqlens;
  pr->initial_state = p.initial_state;
  pr->final_state = p.final_state;
  pr->state_pool = p.state_pool;
  pr->state_indices = p.state_indices;
  pr->checkpoints = p.checkpoints;
  pr->checkpoint_offsets = p.checkpoint_offsets;
  pr->checkpoint_every = p.checkpoint_every;
  pr->layout = p.state_layout;
  pr->device = p.q.device;
  return Status::Ok();
}

Status validate_decode(const DecodeParams& p, DecodeProblem* pr) {
  Dims d;
  KDA_RETURN_IF_ERROR(parse_qkv(p.q, p.k, p.v, p.cu_seqlens, &d));
  if (d.K != d.V || d.K % 32 != 0)
    return Err("v", "decode head dims K == V, a multiple of 32 up to 256",
               "K = " + std::to_string(d.K) + ", V = " + std::to_string(d.V));
  KDA_RETURN_IF_ERROR(check_token_tensor("g", p.g, d, d.HV, d.K, p.q));
  KDA_RETURN_IF_ERROR(check_dtype_float("g", p.g, p.q.dtype, true));
  // beta: [B, T, HV] or [B, T, HV, V]
  bool beta_per_v = false;
  if (!p.beta.present()) return Err("beta", "a tensor [B, T, HV] or [B, T, HV, V]", "absent");
  {
    const int tok_rank = d.varlen && p.q.ndim == 3 ? 2 : 3;
    beta_per_v = p.beta.ndim == tok_rank + 1;
    Status s = beta_per_v ? check_token_tensor("beta", p.beta, d, d.HV, d.V, p.q)
                          : check_token_tensor3("beta", p.beta, d, d.HV, p.q);
    if (!s.ok())
      return Err("beta", "shape [B, T, HV] or [B, T, HV, V] = " + dims_str({d.B, d.T, d.HV, d.V}),
                 "shape " + shape_str(p.beta));
  }
  KDA_RETURN_IF_ERROR(check_dtype_float("beta", p.beta, p.q.dtype, true));
  KDA_RETURN_IF_ERROR(check_gate_params(p.A_log, p.dt_bias, d, p.q, true));
  KDA_RETURN_IF_ERROR(check_token_tensor("out", p.out, d, d.HV, d.V, p.q));
  KDA_RETURN_IF_ERROR(check_dtype_float("out", p.out, p.q.dtype, true));
  KDA_RETURN_IF_ERROR(check_output_strides("out", p.out));
  MathConsts mc;
  KDA_RETURN_IF_ERROR(parse_math(p.math, d, &mc));
  KDA_RETURN_IF_ERROR(check_state_layout(p.state_layout));

  if (!p.state.present()) return Err("state", "a state pool [P, HV, V, K]", "absent");
  KDA_RETURN_IF_ERROR(check_state("state", p.state, -1, d, p.state_layout, p.q, false));

  const int64_t total_tokens = d.B * d.T;
  int64_t Tmax = d.varlen ? 0 : d.T;
  bool indices_2d = false;
  if (p.state_indices.present()) {
    const TensorView& si = p.state_indices;
    KDA_RETURN_IF_ERROR(check_view("state_indices", si, p.q));
    if (!is_index(si.dtype))
      return Err("state_indices", "dtype int32 or int64",
                 std::string("dtype ") + dtype_name(si.dtype));
    if (si.ndim == 1) {
      KDA_RETURN_IF_ERROR(check_shape("state_indices", si, {d.N}));
    } else if (si.ndim == 2 && si.shape[0] == d.N &&
               (d.varlen ? si.shape[1] >= 1 : si.shape[1] == d.T)) {
      indices_2d = true;
      Tmax = si.shape[1];
    } else {
      return Err("state_indices",
                 "shape [N] or [N, T] with N = " + std::to_string(d.N) +
                     (d.varlen ? ", T >= 1" : ", T = " + std::to_string(d.T)),
                 "shape " + shape_str(si));
    }
  }
  if (p.num_accepted_tokens.present()) {
    if (!indices_2d)
      return Err("num_accepted_tokens",
                 "absent unless state_indices is [N, T] (speculative decode)",
                 shape_str(p.num_accepted_tokens));
    KDA_RETURN_IF_ERROR(check_index_vector("num_accepted_tokens", p.num_accepted_tokens, d.N, p.q));
  }
  if (p.final_state.present()) {
    if (indices_2d)
      return Err(
          "final_state",
          "absent with [N, T] state_indices (states go to the slots or to intermediate_states)",
          shape_str(p.final_state));
    KDA_RETURN_IF_ERROR(
        check_state("final_state", p.final_state, d.N, d, p.state_layout, p.q, false));
    if (p.final_state.dtype != p.state.dtype)
      return Err("final_state", std::string("dtype ") + dtype_name(p.state.dtype) + " (as state)",
                 std::string("dtype ") + dtype_name(p.final_state.dtype));
  }
  if (p.intermediate_states.present()) {
    KDA_RETURN_IF_ERROR(check_state("intermediate_states", p.intermediate_states, total_tokens, d,
                                    p.state_layout, p.q, false));
    if (p.intermediate_states.dtype != p.state.dtype)
      return Err("intermediate_states",
                 std::string("dtype ") + dtype_name(p.state.dtype) + " (as state)",
                 std::string("dtype ") + dtype_name(p.intermediate_states.dtype));
  }
  // The outputs the call writes: the pool only in place (neither separate output present).
  if (p.store_final_state) {
    if (p.final_state.present())
      KDA_RETURN_IF_ERROR(check_output_strides("final_state", p.final_state));
    if (p.intermediate_states.present())
      KDA_RETURN_IF_ERROR(check_output_strides("intermediate_states", p.intermediate_states));
    if (!p.final_state.present() && !p.intermediate_states.present())
      KDA_RETURN_IF_ERROR(check_output_strides("state", p.state));
  }
  if (p.q.device == Device::kCPU && d.varlen)
    KDA_RETURN_IF_ERROR(check_cu_seqlens_values(p.cu_seqlens, d.T));

  pr->d = d;
  pr->math = mc;
  pr->Tmax = Tmax;
  pr->beta_per_v = beta_per_v;
  pr->q = as_rank4(p.q);
  pr->k = as_rank4(p.k);
  pr->v = as_rank4(p.v);
  pr->g = as_rank4(p.g);
  pr->out = as_rank4(p.out);
  pr->beta = beta_per_v ? as_rank4(p.beta) : beta_as_rank4(p.beta);
  pr->A_log = p.A_log;
  pr->dt_bias = p.dt_bias;
  pr->cu_seqlens = p.cu_seqlens;
  pr->state = p.state;
  pr->state_indices = p.state_indices;
  pr->num_accepted_tokens = p.num_accepted_tokens;
  pr->final_state = p.final_state;
  pr->intermediate_states = p.intermediate_states;
  pr->indices_2d = indices_2d;
  pr->use_initial_state = p.use_initial_state;
  pr->store_final_state = p.store_final_state;
  pr->layout = p.state_layout;
  pr->device = p.q.device;
  return Status::Ok();
}

namespace {

// A pool slot that a live row (a sequence) reads, or writes.
struct SlotUse {
  int64_t slot, row;
  bool writes;
};

// Spec section 5: two live rows that use one slot, one of them writing it, are a caller error
// (two rows may read the same slot). Names the slot and both rows.
Status check_shared_slots(std::vector<SlotUse> uses) {
  std::sort(uses.begin(), uses.end(), [](const SlotUse& a, const SlotUse& b) {
    return a.slot != b.slot ? a.slot < b.slot : a.row < b.row;
  });
  for (size_t i = 0; i < uses.size();) {
    size_t j = i;
    const SlotUse* writer = nullptr;
    for (; j < uses.size() && uses[j].slot == uses[i].slot; ++j)
      if (uses[j].writes && writer == nullptr) writer = &uses[j];
    if (writer != nullptr) {
      for (size_t m = i; m < j; ++m) {
        if (uses[m].row == writer->row) continue;
        const int64_t r0 = std::min(uses[m].row, writer->row);
        const int64_t r1 = std::max(uses[m].row, writer->row);
        return Err("state_indices",
                   "no slot shared by two live sequences when one of them writes it",
                   "slot " + std::to_string(writer->slot) + " for sequences " + std::to_string(r0) +
                       " and " + std::to_string(r1));
      }
    }
    i = j;
  }
  return Status::Ok();
}

}  // namespace

// Checking mode of decode: reports the rows that would silently become padding (every RowState
// rules::is_index_error flags; negative slots are intended padding), then two live rows that
// share a slot one of them writes.
Status check_decode_index_values(const DecodeProblem& pr, const void* indices_host,
                                 const void* nat_host, const void* cu_host) {
  const int64_t P = pr.state.shape[0];
  const DecodeIndexData host{indices_host, nat_host, cu_host};
  const bool writes = pr.store_final_state && !pr.intermediate_states.present();
  std::vector<SlotUse> uses;
  for (int64_t n = 0; n < pr.d.N; ++n) {
    const int64_t len = seq_span_at(pr.d, pr.cu_seqlens, cu_host, n).len;
    const rules::ReadSlot r = decode_row_slot(pr, host, n, len);
    const std::string seq = "sequence " + std::to_string(n);
    switch (r.state) {
      case rules::RowState::kLive:
        break;
      case rules::RowState::kNegativeSlot:
        continue;  // padding by intent
      case rules::RowState::kAcceptedOutOfRange:
        return Err("num_accepted_tokens", "values in [1, T_n] = [1, " + std::to_string(len) + "]",
                   "num_accepted_tokens[" + std::to_string(n) + "] = " + std::to_string(r.value));
      case rules::RowState::kLongerThanIndexColumns:
        return Err("state_indices", "at least T_n = " + std::to_string(len) + " columns for " + seq,
                   std::to_string(pr.Tmax) + " columns");
      case rules::RowState::kSlotOutOfRange:
        return Err("state_indices",
                   "slots < P = " + std::to_string(P) + " (or negative for padding)",
                   "slot " + std::to_string(r.value) + " for " + seq);
      case rules::RowState::kNoSlotForRow:
        return Err("state",
                   "at least N = " + std::to_string(pr.d.N) + " slots without state_indices",
                   "P = " + std::to_string(P));
    }
    if (!pr.state_indices.present()) continue;  // row n uses slot n: never shared
    if (pr.use_initial_state) uses.push_back({r.slot, n, false});
    if (!writes) continue;
    if (pr.indices_2d) {
      for (int64_t t = 0; t < len; ++t) {
        const int64_t ws = rules::pool_slot(load_index_at(pr.state_indices, indices_host, n, t), P);
        if (ws != rules::kNoSlot) uses.push_back({ws, n, true});
      }
    } else if (!pr.final_state.present()) {
      uses.push_back({r.slot, n, true});
    }
  }
  return check_shared_slots(std::move(uses));
}

// Checking mode of prefill: pool slots >= P (negative slots mean "no pooled state"), then two
// sequences with the same slot (each reads and writes its slot).
Status check_prefill_index_values(const PrefillProblem& pr, const void* state_indices_host) {
  if (!pr.state_pool.present()) return Status::Ok();
  const int64_t P = pr.state_pool.shape[0];
  std::vector<SlotUse> uses;
  for (int64_t n = 0; n < pr.d.N; ++n) {
    const int64_t value = load_index_at(pr.state_indices, state_indices_host, n);
    if (value >= P)
      return Err("state_indices",
                 "slots < P = " + std::to_string(P) + " (or negative: no pooled state)",
                 "slot " + std::to_string(value) + " for sequence " + std::to_string(n));
    if (rules::pool_slot(value, P) != rules::kNoSlot) uses.push_back({value, n, true});
  }
  return check_shared_slots(std::move(uses));
}

// ---------------------------------------------------------------------------------------------
// Prefill backward
// ---------------------------------------------------------------------------------------------

namespace {

// A gradient output: `dtype` exactly (the dtype of the tensor it is the gradient of, `of`).
Status check_grad_dtype(const char* arg, const TensorView& t, DType dtype, const char* of) {
  if (t.dtype == dtype) return Status::Ok();
  return Err(arg, std::string("dtype ") + dtype_name(dtype) + " (as " + of + ")",
             std::string("dtype ") + dtype_name(t.dtype));
}

Status check_grad_token(const char* arg, const TensorView& t, const Dims& d, int64_t d2, int64_t d3,
                        const TensorView& q, DType dtype, const char* of) {
  if (!t.present()) return Status::Ok();
  KDA_RETURN_IF_ERROR(check_token_tensor(arg, t, d, d2, d3, q));
  return check_grad_dtype(arg, t, dtype, of);
}

// Refuses a forward argument the backward does not implement.
Status refuse_in_backward(const char* arg, const TensorView& t) {
  if (!t.present()) return Status::Ok();
  return Err(arg, "absent (the prefill backward has no pool mode or checkpoints)", shape_str(t));
}

}  // namespace

Status validate_prefill_backward(const PrefillBackwardParams& p, PrefillBackwardProblem* pr) {
  const PrefillParams& f = p.forward;
  KDA_RETURN_IF_ERROR(refuse_in_backward("forward.state_pool", f.state_pool));
  KDA_RETURN_IF_ERROR(refuse_in_backward("forward.state_indices", f.state_indices));
  KDA_RETURN_IF_ERROR(refuse_in_backward("forward.checkpoints", f.checkpoints));
  KDA_RETURN_IF_ERROR(refuse_in_backward("forward.checkpoint_offsets", f.checkpoint_offsets));
  if (f.checkpoint_every != 0)
    return Err("forward.checkpoint_every", "0 (the prefill backward has no checkpoints)",
               std::to_string(f.checkpoint_every));
  Dims d;
  KDA_RETURN_IF_ERROR(parse_qkv(f.q, f.k, f.v, f.cu_seqlens, &d));

  // The forward's outputs are not inputs of the backward: the forward's checks run on its inputs
  // with a stand-in `out` of the right shape (a view of q's memory, never read or written).
  PrefillParams fi = f;
  fi.final_state = TensorView{};
  fi.out = f.q;
  fi.out.shape[fi.out.ndim - 2] = d.HV;
  fi.out.shape[fi.out.ndim - 1] = d.V;
  int64_t inner = 1;
  for (int i = fi.out.ndim - 1; i >= 0; --i) {
    fi.out.strides[i] = inner;
    inner *= std::max<int64_t>(fi.out.shape[i], 1);
  }
  PrefillProblem fwd;
  KDA_RETURN_IF_ERROR(validate_prefill(fi, &fwd));
  fwd.out = TensorView{};

  const TensorView& q = f.q;
  if (p.d_out.present()) {
    KDA_RETURN_IF_ERROR(check_token_tensor("d_out", p.d_out, d, d.HV, d.V, q));
    KDA_RETURN_IF_ERROR(check_dtype_float("d_out", p.d_out, q.dtype, true));
  }
  if (p.d_final_state.present())
    KDA_RETURN_IF_ERROR(
        check_state("d_final_state", p.d_final_state, d.N, d, f.state_layout, q, true));
  KDA_RETURN_IF_ERROR(check_grad_token("dq", p.dq, d, d.H, d.K, q, q.dtype, "q"));
  KDA_RETURN_IF_ERROR(check_grad_token("dk", p.dk, d, d.H, d.K, q, q.dtype, "k"));
  KDA_RETURN_IF_ERROR(check_grad_token("dv", p.dv, d, d.HV, d.V, q, q.dtype, "v"));
  KDA_RETURN_IF_ERROR(check_grad_token("dg", p.dg, d, d.HV, d.K, q, f.g.dtype, "g"));
  if (p.dbeta.present()) {
    KDA_RETURN_IF_ERROR(check_token_tensor3("dbeta", p.dbeta, d, d.HV, q));
    KDA_RETURN_IF_ERROR(check_grad_dtype("dbeta", p.dbeta, f.beta.dtype, "beta"));
  }
  if (p.dA_log.present()) {
    KDA_RETURN_IF_ERROR(check_view("dA_log", p.dA_log, q));
    KDA_RETURN_IF_ERROR(check_shape("dA_log", p.dA_log, {d.HV}));
    KDA_RETURN_IF_ERROR(check_grad_dtype("dA_log", p.dA_log, DType::kFloat32, "A_log"));
  }
  if (p.ddt_bias.present()) {
    KDA_RETURN_IF_ERROR(check_view("ddt_bias", p.ddt_bias, q));
    KDA_RETURN_IF_ERROR(check_shape("ddt_bias", p.ddt_bias, {d.HV, d.K}));
    KDA_RETURN_IF_ERROR(check_grad_dtype("ddt_bias", p.ddt_bias, DType::kFloat32, "dt_bias"));
  }
  if (p.d_initial_state.present()) {
    KDA_RETURN_IF_ERROR(
        check_state("d_initial_state", p.d_initial_state, d.N, d, f.state_layout, q, true));
    if (f.initial_state.present())
      KDA_RETURN_IF_ERROR(check_grad_dtype("d_initial_state", p.d_initial_state,
                                           f.initial_state.dtype, "initial_state"));
  }

  pr->fwd = fwd;
  auto rank4 = [](const TensorView& t) { return t.present() ? as_rank4(t) : TensorView{}; };
  pr->d_out = rank4(p.d_out);
  pr->d_final_state = p.d_final_state;
  pr->dq = rank4(p.dq);
  pr->dk = rank4(p.dk);
  pr->dv = rank4(p.dv);
  pr->dg = rank4(p.dg);
  pr->dbeta = p.dbeta.present() ? beta_as_rank4(p.dbeta) : TensorView{};
  pr->dA_log = p.dA_log;
  pr->ddt_bias = p.ddt_bias;
  pr->d_initial_state = p.d_initial_state;
  return Status::Ok();
}

}  // namespace kda::detail
