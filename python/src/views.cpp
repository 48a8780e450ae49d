// views.cpp — see views.h.
#include "views.h"

#include <string>

namespace kda::python {
namespace {

std::string py_type_name(nb::handle obj) { return Py_TYPE(obj.ptr())->tp_name; }

// Raise ValueError / TypeError with "argument '<name>': <what>".
[[noreturn]] void value_error(const char* name, const std::string& what) {
  throw nb::value_error((std::string("argument '") + name + "': " + what).c_str());
}
[[noreturn]] void type_error(const char* name, const std::string& what) {
  throw nb::type_error((std::string("argument '") + name + "': " + what).c_str());
}

// DLPack dtype -> kda::DType; nullopt for anything else.
std::optional<DType> to_dtype(nb::dlpack::dtype dt) {
  if (dt.lanes != 1) return std::nullopt;
  switch (static_cast<nb::dlpack::dtype_code>(dt.code)) {
    case nb::dlpack::dtype_code::Float:
      if (dt.bits == 32) return DType::kFloat32;
      if (dt.bits == 16) return DType::kFloat16;
      return std::nullopt;
    case nb::dlpack::dtype_code::Bfloat:
      if (dt.bits == 16) return DType::kBFloat16;
      return std::nullopt;
    case nb::dlpack::dtype_code::Int:
      if (dt.bits == 32) return DType::kInt32;
      if (dt.bits == 64) return DType::kInt64;
      return std::nullopt;
    default:
      return std::nullopt;
  }
}

std::string dlpack_dtype_name(nb::dlpack::dtype dt) {
  const char* prefix = "";
  switch (static_cast<nb::dlpack::dtype_code>(dt.code)) {
    case nb::dlpack::dtype_code::Int: prefix = "int"; break;
    case nb::dlpack::dtype_code::UInt: prefix = "uint"; break;
    case nb::dlpack::dtype_code::Float: prefix = "float"; break;
    case nb::dlpack::dtype_code::Bfloat: prefix = "bfloat"; break;
    case nb::dlpack::dtype_code::Complex: prefix = "complex"; break;
    case nb::dlpack::dtype_code::Bool: return "bool";
    default: return "DLPack dtype code " + std::to_string(dt.code);
  }
  std::string s = prefix + std::to_string(dt.bits);
  if (dt.lanes != 1) s += "x" + std::to_string(dt.lanes);
  return s;
}

template <typename Array>
TensorView fill_view(const char* name, const Array& a) {
  const std::optional<DType> dtype = to_dtype(a.dtype());
  if (!dtype)
    value_error(name, "expected dtype fp32, fp16, bf16, int32 or int64, got " +
                          dlpack_dtype_name(a.dtype()));
  TensorView t;
  t.dtype = *dtype;
  switch (a.device_type()) {
    case nb::device::cpu::value:
    case nb::device::cuda_host::value:  // pinned host memory: addressable by the CPU
      t.device = Device::kCPU;
      t.device_index = 0;
      break;
    case nb::device::cuda::value:
    case nb::device::cuda_managed::value:
      t.device = Device::kCUDA;
      t.device_index = a.device_id();
      break;
    default:
      value_error(name, "expected an array on the CPU or a CUDA device, got DLPack device type " +
                            std::to_string(a.device_type()));
  }
  if (a.ndim() == 0) value_error(name, "expected an array of rank >= 1, got a 0-d array");
  if (a.ndim() > static_cast<size_t>(kMaxDims))
    value_error(name, "expected rank <= " + std::to_string(kMaxDims) + ", got rank " +
                          std::to_string(a.ndim()));
  t.ndim = static_cast<int32_t>(a.ndim());
  const int64_t* shape = a.shape_ptr();
  const int64_t* strides = a.stride_ptr();
  if (shape == nullptr) value_error(name, "expected an array with a shape, got none (DLPack)");
  int64_t compact = 1;  // DLPack allows strides == NULL for a compact row-major array
  for (int i = t.ndim - 1; i >= 0; --i) {
    t.shape[i] = shape[i];
    t.strides[i] = strides != nullptr ? strides[i] : compact;  // DLPack strides count elements
    compact *= shape[i];
  }
  t.data = const_cast<void*>(static_cast<const void*>(a.data()));
  return t;
}

}  // namespace

TensorView to_view(const char* name, nb::handle obj, bool writable, ArrayKeeper* keep) {
  if (obj.is_none()) return TensorView{};
  if (writable) {
    nb::ndarray<> a;
    if (nb::try_cast(obj, a, /*convert=*/false)) {
      TensorView t = fill_view(name, a);
      keep->outputs.push_back(std::move(a));
      return t;
    }
    nb::ndarray<nb::ro> r;
    if (nb::try_cast(obj, r, /*convert=*/false))
      value_error(name, "expected a writable array, got a read-only " + py_type_name(obj));
  } else {
    nb::ndarray<nb::ro> a;
    if (nb::try_cast(obj, a, /*convert=*/false)) {
      TensorView t = fill_view(name, a);
      keep->inputs.push_back(std::move(a));
      return t;
    }
  }
  type_error(name, "expected an array (torch.Tensor, numpy.ndarray or any DLPack array) or None, "
                   "got " + py_type_name(obj));
}

void to_workspace(const char* name, nb::handle obj, ArrayKeeper* keep, void** data,
                  size_t* bytes) {
  *data = nullptr;
  *bytes = 0;
  if (obj.is_none()) return;
  nb::ndarray<> a;
  if (!nb::try_cast(obj, a, /*convert=*/false))
    type_error(name, "expected a writable array or None, got " + py_type_name(obj));
  int64_t expect = 1;
  const int64_t* strides = a.stride_ptr();  // NULL: compact row-major (DLPack)
  for (int i = static_cast<int>(a.ndim()) - 1; strides != nullptr && i >= 0; --i) {
    if (a.shape(i) != 1 && strides[i] != expect) value_error(name, "expected a contiguous array");
    expect *= static_cast<int64_t>(a.shape(i));
  }
  *data = a.data();
  *bytes = a.nbytes();
  keep->outputs.push_back(std::move(a));
}

nb::handle Kwargs::get(const char* name) {
  used_.emplace_back(name);
  // A borrowed reference: the kwargs dict keeps the value alive for the whole call (no temporary
  // object whose reference count the returned handle would outlive).
  PyObject* value = PyDict_GetItemString(kw_.ptr(), name);
  return value != nullptr ? nb::handle(value) : nb::none();
}

bool Kwargs::flag(const char* name, bool def) {
  nb::handle h = get(name);
  if (h.is_none()) return def;
  if (!PyBool_Check(h.ptr())) type_error(name, "expected bool, got " + py_type_name(h));
  return h.ptr() == Py_True;
}

int64_t Kwargs::integer(const char* name, int64_t def) {
  nb::handle h = get(name);
  if (h.is_none()) return def;
  if (PyBool_Check(h.ptr()) || !PyLong_Check(h.ptr()))
    type_error(name, "expected int, got " + py_type_name(h));
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(h.ptr(), &overflow);
  if (overflow != 0) value_error(name, "expected a 64-bit integer, got an out-of-range value");
  return v;
}

double Kwargs::real(const char* name, double def) {
  const std::optional<double> v = optional_real(name);
  return v.has_value() ? *v : def;
}

std::optional<double> Kwargs::optional_real(const char* name) {
  nb::handle h = get(name);
  if (h.is_none()) return std::nullopt;
  if (PyBool_Check(h.ptr()) || !(PyFloat_Check(h.ptr()) || PyLong_Check(h.ptr())))
    type_error(name, "expected float or None, got " + py_type_name(h));
  const double v = PyFloat_AsDouble(h.ptr());
  if (v == -1.0 && PyErr_Occurred()) throw nb::python_error();
  return v;
}

uintptr_t Kwargs::address(const char* name) {
  nb::handle h = get(name);
  if (h.is_none()) return 0;
  if (PyBool_Check(h.ptr()) || !PyLong_Check(h.ptr()))
    type_error(name, "expected int (a cudaStream_t address), got " + py_type_name(h));
  const unsigned long long v = PyLong_AsUnsignedLongLong(h.ptr());
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    value_error(name, "expected a non-negative address");
  }
  return static_cast<uintptr_t>(v);
}

void Kwargs::check_all_used(const char* function) const {
  for (auto item : kw_) {
    const std::string key = nb::str(item.first).c_str();
    bool found = false;
    for (const auto& u : used_) found = found || u == key;
    if (!found)
      throw nb::type_error(
          (std::string(function) + "() got an unexpected keyword argument '" + key + "'").c_str());
  }
}

[[noreturn]] void raise_status(const Status& status) {
  // The C++ messages name option fields as 'gate.x' / 'exec.x'; Python callers know them as 'x'.
  std::string msg = status.message();
  for (const std::string prefix : {"argument 'gate.", "argument 'exec."})
    for (size_t pos = msg.find(prefix); pos != std::string::npos; pos = msg.find(prefix, pos))
      msg.replace(pos, prefix.size(), "argument '");
  switch (status.code()) {
    case StatusCode::kInvalidArgument:
      throw nb::value_error(msg.c_str());
    case StatusCode::kUnsupported:
      PyErr_SetString(PyExc_NotImplementedError, msg.c_str());
      throw nb::python_error();
    case StatusCode::kCudaError:
      PyErr_SetString(PyExc_RuntimeError, ("CUDA error: " + msg).c_str());
      throw nb::python_error();
    default:
      PyErr_SetString(PyExc_RuntimeError, ("internal error: " + msg).c_str());
      throw nb::python_error();
  }
}

}  // namespace kda::python
