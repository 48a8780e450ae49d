// views.h — Python arguments of one call to kda::TensorView and C++ values, Status to exceptions.
//
// Arrays cross without copies, with their own strides (in elements), dtype and device, two ways:
//   * torch tensors (once the package has registered torch.Tensor and its dtypes, see
//     register_torch): a plain torch.Tensor or nn.Parameter through torch's DLTensor reader of
//     the DLPack C exchange table (torch.Tensor.__dlpack_c_exchange_api__, where this torch has
//     it and no torch function mode is active); otherwise, and for whatever that reader refuses,
//     through their Python attributes (data_ptr(), shape, stride(), dtype, is_cuda / is_cpu,
//     get_device()). No DLPack capsule, no torch headers or library;
//   * anything else through nanobind's ndarray caster (DLPack capsules, __dlpack__, buffer
//     protocol).
// Every conversion error is a Python exception whose message names the argument in the caller's
// vocabulary: the Reader holds the call's alias table (API name -> caller's name), applied to the
// reader's own errors and to the failed Status of the call, so no layer rewrites messages.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "kda/kda.h"

namespace kda::python {

namespace nb = nanobind;

// Registers torch.Tensor and the torch dtypes of kda::DType's codes 0..4 (fp32, fp16, bf16,
// int32, int64), so that torch tensors are read without DLPack capsules; torch.nn.Parameter (or
// None), read like torch.Tensor; torch._C._is_torch_function_mode_enabled (or None), asked once
// per call before torch's DLTensor reader is used. Returns whether that reader is used (this torch
// has the DLPack exchange table).
bool register_torch(nb::handle tensor_type, nb::handle dtypes, nb::handle parameter_type,
                    nb::handle mode_enabled);

// requires_grad(*objects) -> bool: whether one of the objects has a true `requires_grad`
// attribute, as `any(getattr(x, "requires_grad", False) for x in objects)` (in order, stopping at
// the first; plain tensors read through the type's descriptor). A METH_FASTCALL function: this
// runs on every eager kda.prefill call with grad mode on.
PyObject* any_requires_grad(PyObject* self, PyObject* const* args, Py_ssize_t nargs);

class Reader {
 public:
  // `names`: a dict {API name: caller's name} or None.
  explicit Reader(nb::handle names) : names_(names) {}

  // The caller's name of an argument.
  std::string name(const char* api_name) const;

  // None -> absent view. `writable` arrays are written by the call (outputs, in-place states).
  // TypeError when `obj` is not an array (or not a torch tensor while q is one), ValueError for an
  // unsupported dtype, device or rank, or a read-only array where a writable one is needed.
  TensorView array(const char* arg, nb::handle obj, bool writable, bool optional = true);
  // Raw bytes of a scratch array (any dtype, contiguous, on the tensors' device); None -> none.
  void workspace(const char* arg, nb::handle obj, void** data, size_t* bytes);

  bool flag(const char* arg, nb::handle obj);
  int64_t integer(const char* arg, nb::handle obj);
  double real(const char* arg, nb::handle obj);
  std::optional<double> optional_real(const char* arg, nb::handle obj);
  uintptr_t address(const char* arg, nb::handle obj);
  // The code of an enum value given by its name (kda's *_name() functions over codes 0..count-1).
  template <typename Enum>
  Enum choice(const char* arg, nb::handle obj, const char* (*value_name)(Enum), int count) {
    return static_cast<Enum>(choice_code(
        arg, obj, [&](int i) { return value_name(static_cast<Enum>(i)); }, count));
  }

  // Raises the Python exception of a failed Status: ValueError (invalid argument),
  // NotImplementedError (unsupported), RuntimeError (CUDA or internal error); the argument named
  // in the caller's vocabulary.
  [[noreturn]] void raise(const Status& status) const;

  [[noreturn]] void type_error(const char* arg, const std::string& what) const;
  [[noreturn]] void value_error(const char* arg, const std::string& what) const;

 private:
  template <typename NameOf>
  int choice_code(const char* arg, nb::handle obj, NameOf&& value_name, int count);
  TensorView torch_view(const char* arg, nb::handle obj);
  bool fast_torch();
  template <typename Array>
  TensorView dlpack_view(const char* arg, const Array& a);

  nb::handle names_;
  int torch_ = -1;  // whether the first array (q) was a torch tensor: then every array must be one
  int fast_torch_ = -1;  // whether plain tensors are read by torch's DLTensor reader (-1: unknown)
  // Keeps the arrays imported through DLPack (and their capsules) alive for the call.
  std::vector<nb::ndarray<nb::ro>> inputs_;
  std::vector<nb::ndarray<>> outputs_;
};

template <typename NameOf>
int Reader::choice_code(const char* arg, nb::handle obj, NameOf&& value_name, int count) {
  if (!PyUnicode_Check(obj.ptr()))
    type_error(arg, std::string("expected str, got ") + Py_TYPE(obj.ptr())->tp_name);
  const char* s = PyUnicode_AsUTF8(obj.ptr());
  if (s == nullptr) throw nb::python_error();
  for (int i = 0; i < count; ++i)
    if (std::strcmp(value_name(i), s) == 0) return i;
  std::string names;
  for (int i = 0; i < count; ++i) names += (i ? ", '" : "'") + std::string(value_name(i)) + "'";
  value_error(arg, "expected one of " + names + ", got '" + s + "'");
}

// What the workspace allocator of ExecOptions needs: the Python callable
// allocate(nbytes, device_index) -> array and where the array it returns goes.
struct Allocation {
  Reader* reader = nullptr;
  nb::handle allocate;
  int device_index = 0;
  nb::object array;   // keeps the workspace alive until the call returns
  std::string error;  // the allocator's exception, re-raised after the call
};
// ExecOptions::allocate_workspace over an Allocation (the context); takes the GIL.
void* allocate_workspace(size_t bytes, void* context);

}  // namespace kda::python
