// backward.cpp — kda._C.prefill_backward: kda::prefill_backward with keyword arguments.
//
// Keywords: the forward's inputs by their PrefillParams names (q, k, v, g, beta, A_log, dt_bias,
// cu_seqlens, initial_state, state_layout and the math options as kda.prefill names them),
// the upstream gradients d_out, d_final_state, the gradient outputs dq, dk, dv, dg, dbeta,
// dA_log, ddt_bias, d_initial_state (written in place; absent = not computed), and backend,
// num_threads, stream (CUDA: the cudaStream_t as an int), workspace (CUDA: a device array of at
// least the call's workspace bytes) and allocate (CUDA: allocate(nbytes, device_index) -> array,
// called once when `workspace` is absent or too small). The GIL is released while the backward
// runs.
#include "backward.h"

#include <string>
#include <utility>

#include "views.h"

namespace kda::python {
namespace {

// The keywords kda._C.prefill_backward takes.
constexpr const char* kKeywords[] = {"q",
                                     "k",
                                     "v",
                                     "g",
                                     "beta",
                                     "A_log",
                                     "dt_bias",
                                     "cu_seqlens",
                                     "initial_state",
                                     "d_out",
                                     "d_final_state",
                                     "dq",
                                     "dk",
                                     "dv",
                                     "dg",
                                     "dbeta",
                                     "dA_log",
                                     "ddt_bias",
                                     "d_initial_state",
                                     "state_layout",
                                     "use_qk_l2norm",
                                     "scale",
                                     "gate",
                                     "lower_bound",
                                     "beta_logits",
                                     "allow_neg_eigval",
                                     "backend",
                                     "num_threads",
                                     "stream",
                                     "workspace",
                                     "allocate"};

void run_prefill_backward(const nb::kwargs& kwargs) {
  for (auto item : kwargs) {
    const std::string key = nb::str(item.first).c_str();
    bool known = false;
    for (const char* k : kKeywords) known = known || key == k;
    if (!known)
      throw nb::type_error(
          ("prefill_backward() got an unexpected keyword argument '" + key + "'").c_str());
  }
  // A borrowed reference (the kwargs dict keeps it alive for the call), or None when absent.
  auto get = [&](const char* name) {
    PyObject* value = PyDict_GetItemString(kwargs.ptr(), name);
    return value != nullptr ? nb::handle(value) : nb::none();
  };
  auto option = [&](const char* name, nb::handle def) {
    nb::handle h = get(name);
    return h.is_none() ? def : h;
  };
  Reader r{nb::none()};
  PrefillBackwardParams p;
  PrefillParams& f = p.forward;
  const std::pair<const char*, TensorView*> inputs[] = {{"q", &f.q},
                                                        {"k", &f.k},
                                                        {"v", &f.v},
                                                        {"g", &f.g},
                                                        {"beta", &f.beta},
                                                        {"A_log", &f.A_log},
                                                        {"dt_bias", &f.dt_bias},
                                                        {"cu_seqlens", &f.cu_seqlens},
                                                        {"initial_state", &f.initial_state},
                                                        {"d_out", &p.d_out},
                                                        {"d_final_state", &p.d_final_state}};
  for (const auto& [name, view] : inputs) *view = r.array(name, get(name), false);
  const std::pair<const char*, TensorView*> grads[] = {{"dq", &p.dq},
                                                       {"dk", &p.dk},
                                                       {"dv", &p.dv},
                                                       {"dg", &p.dg},
                                                       {"dbeta", &p.dbeta},
                                                       {"dA_log", &p.dA_log},
                                                       {"ddt_bias", &p.ddt_bias},
                                                       {"d_initial_state", &p.d_initial_state}};
  for (const auto& [name, view] : grads) *view = r.array(name, get(name), true);
  f.state_layout = r.choice("state_layout", option("state_layout", nb::str("v_first")),
                            state_layout_name, kNumStateLayouts);
  f.math.use_qk_l2norm = r.flag("use_qk_l2norm", option("use_qk_l2norm", Py_True));
  f.math.scale = r.optional_real("scale", get("scale"));
  f.math.gate = r.choice("gate", option("gate", nb::str("precomputed")), gate_name, kNumGateForms);
  f.math.lower_bound =
      static_cast<float>(r.real("lower_bound", option("lower_bound", nb::float_(-5.0))));
  f.math.beta_logits = r.flag("beta_logits", option("beta_logits", Py_False));
  f.math.allow_neg_eigval = r.flag("allow_neg_eigval", option("allow_neg_eigval", Py_False));
  p.exec.backend =
      r.choice("backend", option("backend", nb::str("auto")), backend_name, kNumBackends);
  p.exec.num_threads =
      static_cast<int>(r.integer("num_threads", option("num_threads", nb::int_(0))));
  p.exec.stream = reinterpret_cast<void*>(r.address("stream", option("stream", nb::int_(0))));
  r.workspace("workspace", get("workspace"), &p.exec.workspace, &p.exec.workspace_bytes);
  Allocation alloc;
  alloc.allocate = get("allocate");
  if (!alloc.allocate.is_none()) {
    alloc.reader = &r;
    alloc.device_index = f.q.device_index;
    p.exec.allocate_workspace = allocate_workspace;
    p.exec.allocate_context = &alloc;
  }
  Status s;
  {
    nb::gil_scoped_release release;
    s = kda::prefill_backward(p);
  }
  if (!alloc.error.empty()) {
    const std::string msg =
        "argument 'workspace': allocating the device workspace failed: " + alloc.error;
    PyErr_SetString(PyExc_RuntimeError, msg.c_str());
    throw nb::python_error();
  }
  if (!s.ok()) r.raise(s);
}

}  // namespace

void register_backward(nb::module_& m) {
  m.def("prefill_backward", &run_prefill_backward,
        "kda::prefill_backward with the forward's inputs, d_out, d_final_state and the gradient "
        "outputs as keyword arguments (writes the given gradients in place).");
}

}  // namespace kda::python
