// backward.cpp — kda._C.prefill_backward: kda::prefill_backward with keyword arguments.
//
// Keywords: the forward's inputs by their PrefillParams names (q, k, v, g, beta, A_log, dt_bias,
// cu_seqlens, initial_state, state_layout and the gate options as kda._C.prefill takes them),
// the upstream gradients d_out, d_final_state, the gradient outputs dq, dk, dv, dg, dbeta,
// dA_log, ddt_bias, d_initial_state (written in place; absent = not computed), and backend,
// num_threads. The GIL is released while the backward runs.
#include "backward.h"

#include <utility>

#include "views.h"

namespace kda::python {
namespace {

void run_prefill_backward(const nb::kwargs& kwargs) {
  ArrayKeeper keep;
  Kwargs kw(kwargs);
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
  for (const auto& [name, view] : inputs) *view = to_view(name, kw.get(name), false, &keep);
  const std::pair<const char*, TensorView*> grads[] = {{"dq", &p.dq},
                                                       {"dk", &p.dk},
                                                       {"dv", &p.dv},
                                                       {"dg", &p.dg},
                                                       {"dbeta", &p.dbeta},
                                                       {"dA_log", &p.dA_log},
                                                       {"ddt_bias", &p.ddt_bias},
                                                       {"d_initial_state", &p.d_initial_state}};
  for (const auto& [name, view] : grads) *view = to_view(name, kw.get(name), true, &keep);
  f.state_layout = static_cast<StateLayout>(kw.integer("state_layout", 0));
  f.gate.use_qk_l2norm = kw.flag("use_qk_l2norm", true);
  f.gate.scale = kw.optional_real("scale");
  f.gate.gate_form = static_cast<GateForm>(kw.integer("gate_form", 0));
  f.gate.lower_bound = static_cast<float>(kw.real("lower_bound", -5.0));
  f.gate.beta_form = static_cast<BetaForm>(kw.integer("beta_form", 0));
  f.gate.allow_neg_eigval = kw.flag("allow_neg_eigval", false);
  p.exec.backend = static_cast<Backend>(kw.integer("backend", 0));
  p.exec.num_threads = static_cast<int>(kw.integer("num_threads", 0));
  kw.check_all_used("prefill_backward");
  Status s;
  {
    nb::gil_scoped_release release;
    s = kda::prefill_backward(p);
  }
  if (!s.ok()) raise_status(s);
}

}  // namespace

void register_backward(nb::module_& m) {
  m.def("prefill_backward", &run_prefill_backward,
        "kda::prefill_backward with the forward's inputs, d_out, d_final_state and the gradient "
        "outputs as keyword arguments (writes the given gradients in place).");
}

}  // namespace kda::python
