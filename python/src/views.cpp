// views.cpp — see views.h.
#include "views.h"

#include <string>

namespace kda::python {
namespace {

std::string py_type_name(nb::handle obj) { return Py_TYPE(obj.ptr())->tp_name; }

std::string py_str(nb::handle obj) {
  PyObject* s = PyObject_Str(obj.ptr());
  if (s == nullptr) {
    PyErr_Clear();
    return py_type_name(obj);
  }
  const char* c = PyUnicode_AsUTF8(s);
  std::string r = c != nullptr ? c : py_type_name(obj);
  Py_DECREF(s);
  return r;
}

// One attribute of torch.Tensor read per tensor: its name and its descriptor on the type (a
// getset descriptor for properties, a method descriptor for methods), or nullptr when the type
// does not hold a descriptor of that kind (then only the name is used).
struct Attribute {
  PyObject* name = nullptr;
  PyObject* descriptor = nullptr;
};

// The DLPack C exchange table (dlpack.h 1.2 and later: the PyCapsule "dlpack_exchange_api" held
// by the array type's `__dlpack_c_exchange_api__`), as far as it is read here: the version header
// and dltensor_from_py_object_no_sync (may be null), which describes an array as a DLTensor
// without copies, references or allocations (the array's own shape and stride arrays, valid
// while the array lives) and returns 0, or -1 with a Python error set.
struct DLPackExchangeApi {
  uint32_t major, minor;  // DLPack version of the table
  const void* prev_api;
  const void* managed_tensor_allocator;
  const void* managed_tensor_from_py_object_no_sync;
  const void* managed_tensor_to_py_object_no_sync;
  int (*dltensor_from_py_object_no_sync)(void* py_object, nb::dlpack::dltensor* out);
  const void* current_work_stream;
};

// torch.Tensor, its dtypes in kda::DType code order, and the attributes read per tensor; set once
// by register_torch and kept for the life of the process.
struct Torch {
  PyObject* tensor = nullptr;
  PyObject* parameter = nullptr;  // torch.nn.Parameter (read as a plain tensor), or nullptr
  PyObject* dtypes[5] = {};
  Attribute data_ptr, shape, stride, dtype, is_cuda, is_cpu, get_device, device, requires_grad;
  // torch.Tensor's DLTensor reader (nullptr: none, every tensor is read through its attributes)
  // and torch._C._is_torch_function_mode_enabled: while a torch function mode is active, tensors
  // are read through their attributes, which the mode sees.
  int (*dltensor)(void* py_object, nb::dlpack::dltensor* out) = nullptr;
  PyObject* mode_enabled = nullptr;
};
Torch g_torch;

const DLPackExchangeApi* exchange_api(PyObject* type) {
  PyObject* capsule = PyObject_GetAttrString(type, "__dlpack_c_exchange_api__");
  if (capsule == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  const auto* api = static_cast<const DLPackExchangeApi*>(
      PyCapsule_IsValid(capsule, "dlpack_exchange_api")
          ? PyCapsule_GetPointer(capsule, "dlpack_exchange_api")
          : nullptr);
  Py_DECREF(capsule);  // the table is static in the library that owns the type
  if (api == nullptr || api->major != 1 || api->minor < 2) return nullptr;
  return api;
}

Attribute attribute(PyObject* type, const char* name, PyTypeObject* kind) {
  Attribute a;
  a.name = PyUnicode_InternFromString(name);
  PyObject* d = PyObject_GetAttr(type, a.name);
  if (d == nullptr) {
    PyErr_Clear();
  } else if (Py_TYPE(d) == kind) {
    a.descriptor = d;  // kept (one reference) for the life of the process
  } else {
    Py_DECREF(d);
  }
  return a;
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
    case nb::dlpack::dtype_code::Int:
      prefix = "int";
      break;
    case nb::dlpack::dtype_code::UInt:
      prefix = "uint";
      break;
    case nb::dlpack::dtype_code::Float:
      prefix = "float";
      break;
    case nb::dlpack::dtype_code::Bfloat:
      prefix = "bfloat";
      break;
    case nb::dlpack::dtype_code::Complex:
      prefix = "complex";
      break;
    case nb::dlpack::dtype_code::Bool:
      return "bool";
    default:
      return "DLPack dtype code " + std::to_string(dt.code);
  }
  std::string s = prefix + std::to_string(dt.bits);
  if (dt.lanes != 1) s += "x" + std::to_string(dt.lanes);
  return s;
}

constexpr const char* kDtypesExpected = "expected dtype fp32, fp16, bf16, int32 or int64, got ";

// An array without elements addresses no memory: its strides (numpy gives 0 for every dimension)
// are replaced by the compact row-major ones, which every contract check accepts.
void compact_if_empty(TensorView* t) {
  if (t->numel() != 0) return;
  int64_t compact = 1;
  for (int i = t->ndim - 1; i >= 0; --i) {
    t->strides[i] = compact;
    compact *= t->shape[i] > 0 ? t->shape[i] : 1;
  }
}

// The rank, sizes and element strides of a DLPack array (strides == NULL: compact row-major, as
// DLPack before 1.2 allows), then compact_if_empty.
void set_dims(TensorView* t, int32_t ndim, const int64_t* shape, const int64_t* strides) {
  t->ndim = ndim;
  int64_t compact = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    t->shape[i] = shape[i];
    t->strides[i] = strides != nullptr ? strides[i] : compact;
    compact *= shape[i];
  }
  compact_if_empty(t);
}

// *t: the view of a DLTensor of a kind the library takes (its dtypes, the CPU or a CUDA device,
// rank 1..kMaxDims); false for anything else (which the attribute reader then reports).
bool view_of(const nb::dlpack::dltensor& dl, TensorView* t) {
  const std::optional<DType> dtype = to_dtype(dl.dtype);
  if (!dtype || dl.ndim < 1 || dl.ndim > kMaxDims || dl.shape == nullptr) return false;
  if (dl.device.device_type == nb::device::cuda::value) {
    t->device = Device::kCUDA;
    t->device_index = dl.device.device_id;
  } else if (dl.device.device_type != nb::device::cpu::value) {
    return false;
  }
  t->dtype = *dtype;
  t->data = static_cast<char*>(dl.data) + dl.byte_offset;
  set_dims(t, dl.ndim, dl.shape, dl.strides);
  return true;
}

bool is_torch_tensor(nb::handle obj) {
  return g_torch.tensor != nullptr &&
         PyObject_TypeCheck(obj.ptr(), reinterpret_cast<PyTypeObject*>(g_torch.tensor));
}

// A torch.Tensor or torch.nn.Parameter itself, not a subclass (which may override an attribute).
bool is_plain(PyTypeObject* type) {
  return type == reinterpret_cast<PyTypeObject*>(g_torch.tensor) ||
         (g_torch.parameter != nullptr &&
          type == reinterpret_cast<PyTypeObject*>(g_torch.parameter));
}

}  // namespace

bool register_torch(nb::handle tensor_type, nb::handle dtypes, nb::handle parameter_type,
                    nb::handle mode_enabled) {
  if (!PyType_Check(tensor_type.ptr())) throw nb::type_error("expected the torch.Tensor type");
  if (!PyTuple_Check(dtypes.ptr()) || PyTuple_GET_SIZE(dtypes.ptr()) != 5)
    throw nb::type_error("expected a tuple of 5 torch dtypes (fp32, fp16, bf16, int32, int64)");
  if (!parameter_type.is_none() && !PyType_Check(parameter_type.ptr()))
    throw nb::type_error("expected the torch.nn.Parameter type or None");
  Torch t;
  t.tensor = tensor_type.inc_ref().ptr();
  if (!parameter_type.is_none()) t.parameter = parameter_type.inc_ref().ptr();
  const DLPackExchangeApi* api = exchange_api(tensor_type.ptr());
  if (api != nullptr && api->dltensor_from_py_object_no_sync != nullptr &&
      PyCallable_Check(mode_enabled.ptr())) {
    t.dltensor = api->dltensor_from_py_object_no_sync;
    t.mode_enabled = mode_enabled.inc_ref().ptr();
  }
  for (int i = 0; i < 5; ++i)
    t.dtypes[i] = nb::handle(PyTuple_GET_ITEM(dtypes.ptr(), i)).inc_ref().ptr();
  PyObject* type = tensor_type.ptr();
  t.data_ptr = attribute(type, "data_ptr", &PyMethodDescr_Type);
  t.shape = attribute(type, "shape", &PyGetSetDescr_Type);
  t.stride = attribute(type, "stride", &PyMethodDescr_Type);
  t.dtype = attribute(type, "dtype", &PyGetSetDescr_Type);
  t.is_cuda = attribute(type, "is_cuda", &PyGetSetDescr_Type);
  t.is_cpu = attribute(type, "is_cpu", &PyGetSetDescr_Type);
  t.get_device = attribute(type, "get_device", &PyMethodDescr_Type);
  t.device = attribute(type, "device", &PyGetSetDescr_Type);
  t.requires_grad = attribute(type, "requires_grad", &PyGetSetDescr_Type);
  g_torch = t;
  return t.dltensor != nullptr;
}

PyObject* any_requires_grad(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  const Attribute& a = g_torch.requires_grad;  // (no name before register_torch)
  for (Py_ssize_t i = 0; i < nargs; ++i) {
    PyObject* o = args[i];
    if (o == Py_None) continue;  // getattr(None, "requires_grad", False) is False
    PyTypeObject* type = Py_TYPE(o);
    PyObject* r = nullptr;
    if (is_plain(type) && a.descriptor != nullptr)
      r = Py_TYPE(a.descriptor)->tp_descr_get(a.descriptor, o, reinterpret_cast<PyObject*>(type));
    else if (a.name != nullptr)
      r = PyObject_GetAttr(o, a.name);
    else
      r = PyObject_GetAttrString(o, "requires_grad");
    if (r == nullptr) {
      if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return nullptr;
      PyErr_Clear();
      continue;
    }
    const int truth = PyObject_IsTrue(r);
    Py_DECREF(r);
    if (truth < 0) return nullptr;
    if (truth != 0) Py_RETURN_TRUE;
  }
  Py_RETURN_FALSE;
}

std::string Reader::name(const char* api_name) const {
  if (names_.is_valid() && PyDict_Check(names_.ptr())) {
    PyObject* alias = PyDict_GetItemString(names_.ptr(), api_name);  // borrowed
    if (alias != nullptr && PyUnicode_Check(alias)) {
      const char* s = PyUnicode_AsUTF8(alias);
      if (s != nullptr) return s;
      PyErr_Clear();
    }
  }
  return api_name;
}

void Reader::type_error(const char* arg, const std::string& what) const {
  throw nb::type_error(("argument '" + name(arg) + "': " + what).c_str());
}

void Reader::value_error(const char* arg, const std::string& what) const {
  throw nb::value_error(("argument '" + name(arg) + "': " + what).c_str());
}

// Whether plain tensors are read through torch's DLTensor reader in this call: torch has one
// and no torch function mode is active (asked once per call, at the first plain tensor).
bool Reader::fast_torch() {
  if (fast_torch_ < 0) {
    fast_torch_ = 0;
    if (g_torch.dltensor != nullptr) {
      PyObject* active = PyObject_CallNoArgs(g_torch.mode_enabled);
      if (active == nullptr)
        PyErr_Clear();
      else
        fast_torch_ = active == Py_False ? 1 : 0;
      Py_XDECREF(active);
    }
  }
  return fast_torch_ == 1;
}

// A torch tensor. A plain torch.Tensor or nn.Parameter (not a subclass, which may override an
// attribute) is read by torch's DLTensor reader of the DLPack exchange table, where this torch
// has it: pointer, shape, strides, dtype and device at once, without Python objects. Otherwise,
// and for anything that reader refuses or that the library does not take (so that the messages
// stay those below), through its Python attributes: six reads, for a plain tensor through the
// type's descriptors directly (without the attribute lookup on the instance).
TensorView Reader::torch_view(const char* arg, nb::handle obj) {
  PyObject* o = obj.ptr();
  PyTypeObject* type = Py_TYPE(o);
  const bool plain = is_plain(type);
  if (plain && fast_torch()) {
    nb::dlpack::dltensor dl;
    TensorView t;
    if (g_torch.dltensor(o, &dl) == 0) {
      if (view_of(dl, &t)) return t;
    } else {
      PyErr_Clear();
    }
  }
  auto fail = [&](const char* what) {
    nb::python_error e;  // fetches (and clears) the Python error of the failed attribute read
    value_error(arg, std::string("expected a strided CPU or CUDA tensor with storage (") + what +
                         " failed: " + e.what() + ")");
  };
  auto get = [&](const Attribute& a) {
    PyObject* d = a.descriptor;
    PyObject* r = plain && d != nullptr
                      ? Py_TYPE(d)->tp_descr_get(d, o, reinterpret_cast<PyObject*>(type))
                      : PyObject_GetAttr(o, a.name);
    if (r == nullptr) fail(PyUnicode_AsUTF8(a.name));
    return nb::steal(r);
  };
  auto call = [&](const Attribute& a) {
    PyObject* r = plain && a.descriptor != nullptr
                      ? PyObject_Vectorcall(a.descriptor, &o, 1, nullptr)
                      : PyObject_CallMethodNoArgs(o, a.name);
    if (r == nullptr) fail(PyUnicode_AsUTF8(a.name));
    return nb::steal(r);
  };
  TensorView t;
  {
    nb::object dt = get(g_torch.dtype);
    int code = -1;
    for (int i = 0; i < 5 && code < 0; ++i)
      if (dt.ptr() == g_torch.dtypes[i]) code = i;
    if (code < 0) value_error(arg, kDtypesExpected + py_str(dt));
    t.dtype = static_cast<DType>(code);
  }
  if (get(g_torch.is_cuda).ptr() == Py_True) {
    t.device = Device::kCUDA;
    const long index = PyLong_AsLong(call(g_torch.get_device).ptr());
    if (index == -1 && PyErr_Occurred()) fail("get_device()");
    t.device_index = static_cast<int32_t>(index);
  } else if (get(g_torch.is_cpu).ptr() != Py_True) {
    value_error(arg, "expected a tensor on the CPU or a CUDA device, got device " +
                         py_str(get(g_torch.device)));
  }
  nb::object shape = get(g_torch.shape);
  nb::object strides = call(g_torch.stride);
  if (!PyTuple_Check(shape.ptr()) || !PyTuple_Check(strides.ptr()))
    value_error(arg, "expected a strided tensor (shape and stride() tuples)");
  const Py_ssize_t ndim = PyTuple_GET_SIZE(shape.ptr());
  if (ndim == 0) value_error(arg, "expected an array of rank >= 1, got a 0-d array");
  if (ndim > kMaxDims)
    value_error(
        arg, "expected rank <= " + std::to_string(kMaxDims) + ", got rank " + std::to_string(ndim));
  if (PyTuple_GET_SIZE(strides.ptr()) != ndim)
    value_error(arg, "expected one stride per dimension");
  t.ndim = static_cast<int32_t>(ndim);
  for (Py_ssize_t i = 0; i < ndim; ++i) {
    t.shape[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape.ptr(), i));
    t.strides[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(strides.ptr(), i));
  }
  if (PyErr_Occurred()) fail("shape / stride()");
  t.data = PyLong_AsVoidPtr(call(g_torch.data_ptr).ptr());
  if (t.data == nullptr && PyErr_Occurred()) fail("data_ptr()");
  compact_if_empty(&t);
  return t;
}

template <typename Array>
TensorView Reader::dlpack_view(const char* arg, const Array& a) {
  const std::optional<DType> dtype = to_dtype(a.dtype());
  if (!dtype) value_error(arg, kDtypesExpected + dlpack_dtype_name(a.dtype()));
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
      value_error(arg, "expected an array on the CPU or a CUDA device, got DLPack device type " +
                           std::to_string(a.device_type()));
  }
  if (a.ndim() == 0) value_error(arg, "expected an array of rank >= 1, got a 0-d array");
  if (a.ndim() > static_cast<size_t>(kMaxDims))
    value_error(arg, "expected rank <= " + std::to_string(kMaxDims) + ", got rank " +
                         std::to_string(a.ndim()));
  if (a.shape_ptr() == nullptr)
    value_error(arg, "expected an array with a shape, got none (DLPack)");
  t.data = const_cast<void*>(static_cast<const void*>(a.data()));
  set_dims(&t, static_cast<int32_t>(a.ndim()), a.shape_ptr(), a.stride_ptr());
  return t;
}

TensorView Reader::array(const char* arg, nb::handle obj, bool writable, bool optional) {
  if (obj.is_none()) return TensorView{};
  const bool torch = is_torch_tensor(obj);
  if (torch_ < 0) torch_ = torch ? 1 : 0;  // the first array read is q
  if (torch) return torch_view(arg, obj);
  if (torch_ == 1 && nb::ndarray_check(obj))
    type_error(arg, "expected a torch.Tensor (as q), got " + py_type_name(obj));
  if (writable) {
    nb::ndarray<> a;
    if (nb::try_cast(obj, a, /*convert=*/false)) {
      TensorView t = dlpack_view(arg, a);
      outputs_.push_back(std::move(a));
      return t;
    }
    nb::ndarray<nb::ro> r;
    if (nb::try_cast(obj, r, /*convert=*/false))
      value_error(arg, "expected a writable array, got a read-only " + py_type_name(obj));
  } else {
    nb::ndarray<nb::ro> a;
    if (nb::try_cast(obj, a, /*convert=*/false)) {
      TensorView t = dlpack_view(arg, a);
      inputs_.push_back(std::move(a));
      return t;
    }
  }
  type_error(arg, std::string("expected an array (torch.Tensor, numpy.ndarray or any DLPack "
                              "array)") +
                      (optional ? " or None" : "") + ", got " + py_type_name(obj));
}

void Reader::workspace(const char* arg, nb::handle obj, void** data, size_t* bytes) {
  *data = nullptr;
  *bytes = 0;
  if (obj.is_none()) return;
  const TensorView t = array(arg, obj, true);
  int64_t expect = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    if (t.shape[i] != 1 && t.strides[i] != expect) value_error(arg, "expected a contiguous array");
    expect *= t.shape[i];
  }
  *data = t.data;
  *bytes = static_cast<size_t>(t.numel()) * dtype_size(t.dtype);
}

bool Reader::flag(const char* arg, nb::handle obj) {
  if (PyBool_Check(obj.ptr())) return obj.ptr() == Py_True;
  const std::string type = py_type_name(obj);
  if (type == "numpy.bool_" || type == "numpy.bool") return PyObject_IsTrue(obj.ptr()) == 1;
  type_error(arg, "expected bool, got " + type);
}

int64_t Reader::integer(const char* arg, nb::handle obj) {
  PyObject* o = obj.ptr();
  if (PyBool_Check(o) || !(PyLong_Check(o) || PyIndex_Check(o)))
    type_error(arg, "expected int, got " + py_type_name(obj));
  nb::object index = nb::steal(PyNumber_Index(o));
  if (!index.is_valid()) throw nb::python_error();
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (overflow != 0) value_error(arg, "expected a 64-bit integer, got an out-of-range value");
  return v;
}

namespace {

// A Python float, int (not bool) or other number: a numpy scalar, or a 0-d array or tensor; not
// a string or an array with elements in a dimension.
bool is_real(PyObject* o) {
  if (PyFloat_Check(o)) return true;
  if (PyBool_Check(o) || PyUnicode_Check(o)) return false;
  if (PyLong_Check(o)) return true;
  const PyNumberMethods* num = Py_TYPE(o)->tp_as_number;
  if (num == nullptr || num->nb_float == nullptr) return false;
  if (!PySequence_Check(o)) return true;
  PyObject* ndim = PyObject_GetAttrString(o, "ndim");  // arrays: only 0-d ones
  if (ndim == nullptr) {
    PyErr_Clear();
    return false;
  }
  const bool zero = PyLong_Check(ndim) && PyLong_AsLong(ndim) == 0;
  Py_DECREF(ndim);
  return zero;
}

}  // namespace

double Reader::real(const char* arg, nb::handle obj) {
  if (!is_real(obj.ptr())) type_error(arg, "expected float, got " + py_type_name(obj));
  const double v = PyFloat_AsDouble(obj.ptr());
  if (v == -1.0 && PyErr_Occurred()) throw nb::python_error();
  return v;
}

std::optional<double> Reader::optional_real(const char* arg, nb::handle obj) {
  if (obj.is_none()) return std::nullopt;
  if (!is_real(obj.ptr())) type_error(arg, "expected float or None, got " + py_type_name(obj));
  return real(arg, obj);
}

uintptr_t Reader::address(const char* arg, nb::handle obj) {
  if (obj.is_none()) return 0;
  if (PyBool_Check(obj.ptr()) || !PyLong_Check(obj.ptr()))
    type_error(arg, "expected int (a cudaStream_t address), got " + py_type_name(obj));
  const unsigned long long v = PyLong_AsUnsignedLongLong(obj.ptr());
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    value_error(arg, "expected a non-negative address");
  }
  return static_cast<uintptr_t>(v);
}

void Reader::raise(const Status& status) const {
  const std::string msg =
      status.argument().empty()
          ? status.message()
          : "argument '" + name(status.argument().c_str()) + "': " + status.what();
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

// ExecOptions::allocate_workspace over an Allocation (views.h).
void* allocate_workspace(size_t bytes, void* context) {
  auto* a = static_cast<Allocation*>(context);
  nb::gil_scoped_acquire gil;
  try {
    a->array = a->allocate(bytes, a->device_index);
    void* data = nullptr;
    size_t got = 0;
    a->reader->workspace("workspace", a->array, &data, &got);
    if (got < bytes) {
      a->error = "the allocator returned " + std::to_string(got) + " bytes, " +
                 std::to_string(bytes) + " needed";
      return nullptr;
    }
    return data;
  } catch (nb::python_error& e) {
    // The exception's type and message, without the traceback that what() appends.
    a->error = std::string(Py_TYPE(e.value().ptr())->tp_name) + ": " + nb::str(e.value()).c_str();
    return nullptr;
  } catch (const std::exception& e) {
    a->error = e.what();
    return nullptr;
  }
}

}  // namespace kda::python
