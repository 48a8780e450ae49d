// views.h — Python objects to kda::TensorView, Python scalars to C++ values, Status to errors.
//
// Arrays arrive through nanobind's ndarray caster (DLPack capsules, __dlpack__, buffer protocol):
// zero copies, the array's own strides (in elements), dtype and device. Every conversion error is
// a Python exception whose message names the argument, as the C++ validation messages do.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kda/kda.h"

namespace kda::python {

namespace nb = nanobind;

// Keeps the imported arrays (and so their DLPack capsules) alive for the duration of one call.
struct ArrayKeeper {
  std::vector<nb::ndarray<nb::ro>> inputs;
  std::vector<nb::ndarray<>> outputs;
};

// None -> absent view. `writable` arrays are written by the call (outputs, in-place states).
// Raises TypeError when `obj` is not an array, ValueError for an unsupported dtype, device or rank,
// or a read-only array where a writable one is needed.
TensorView to_view(const char* name, nb::handle obj, bool writable, ArrayKeeper* keep);

// Raw bytes of a scratch array (any dtype, contiguous, on the tensors' device).
void to_workspace(const char* name, nb::handle obj, ArrayKeeper* keep, void** data, size_t* bytes);

// Keyword arguments of one call, looked up by name; each lookup marks the name used.
class Kwargs {
 public:
  explicit Kwargs(const nb::kwargs& kw) : kw_(kw) {}
  nb::handle get(const char* name);  // None when absent
  bool flag(const char* name, bool def);
  int64_t integer(const char* name, int64_t def);
  double real(const char* name, double def);
  std::optional<double> optional_real(const char* name);
  uintptr_t address(const char* name);
  // Raises TypeError naming the first keyword that no lookup used.
  void check_all_used(const char* function) const;

 private:
  const nb::kwargs& kw_;
  std::vector<std::string> used_;
};

// Raises the Python exception of a failed Status: ValueError (invalid argument),
// NotImplementedError (unsupported), RuntimeError (CUDA or internal error).
[[noreturn]] void raise_status(const Status& status);

}  // namespace kda::python
