// backward.h — registers kda._C.prefill_backward (backward.cpp).
#pragma once

#include <nanobind/nanobind.h>

namespace kda::python {

void register_backward(nanobind::module_& m);

}  // namespace kda::python
