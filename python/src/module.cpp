// module.cpp — kda._C: the C++ entry points for Python (private; the API is python/kda).
//
// Every call takes keyword arguments only, named as the fields of kda::PrefillParams /
// kda::DecodeParams (options flattened: gate_form, beta_form, backend, stream, ...). Enum options
// cross as their integer codes; the Python layer maps strings to them. The GIL is released while
// the kernels run.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "kda/kda.h"
#include "backward.h"
#include "views.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace kda::python {
namespace {

void read_gate(Kwargs& kw, GateOptions* g) {
  g->use_qk_l2norm = kw.flag("use_qk_l2norm", true);
  g->scale = kw.optional_real("scale");
  g->gate_form = static_cast<GateForm>(kw.integer("gate_form", 0));
  g->lower_bound = static_cast<float>(kw.real("lower_bound", -5.0));
  g->beta_form = static_cast<BetaForm>(kw.integer("beta_form", 0));
  g->allow_neg_eigval = kw.flag("allow_neg_eigval", false);
}

void read_exec(Kwargs& kw, ArrayKeeper* keep, ExecOptions* e) {
  e->backend = static_cast<Backend>(kw.integer("backend", 0));
  e->stream = reinterpret_cast<void*>(kw.address("stream"));
  to_workspace("workspace", kw.get("workspace"), keep, &e->workspace, &e->workspace_bytes);
  const int64_t threads = kw.integer("num_threads", 0);
  e->num_threads = static_cast<int>(threads);
}

// The per-token tensors of both entry points: q, k, v, g, beta, the gate parameters, cu_seqlens
// (inputs) and out (written).
template <typename Params>
void read_tokens(Kwargs& kw, ArrayKeeper* keep, Params* p) {
  auto in = [&](const char* name) { return to_view(name, kw.get(name), false, keep); };
  p->q = in("q");
  p->k = in("k");
  p->v = in("v");
  p->g = in("g");
  p->beta = in("beta");
  p->A_log = in("A_log");
  p->dt_bias = in("dt_bias");
  p->cu_seqlens = in("cu_seqlens");
  p->out = to_view("out", kw.get("out"), true, keep);
}

PrefillParams prefill_params(const nb::kwargs& kwargs, const char* fn, ArrayKeeper* keep) {
  Kwargs kw(kwargs);
  PrefillParams p;
  auto in = [&](const char* name) { return to_view(name, kw.get(name), false, keep); };
  auto out = [&](const char* name) { return to_view(name, kw.get(name), true, keep); };
  read_tokens(kw, keep, &p);
  p.initial_state = in("initial_state");
  p.final_state = out("final_state");
  p.state_pool = out("state_pool");
  p.state_indices = in("state_indices");
  p.checkpoint_every = kw.integer("checkpoint_every", 0);
  p.checkpoints = out("checkpoints");
  p.checkpoint_offsets = in("checkpoint_offsets");
  p.state_layout = static_cast<StateLayout>(kw.integer("state_layout", 0));
  read_gate(kw, &p.gate);
  read_exec(kw, keep, &p.exec);
  kw.check_all_used(fn);
  return p;
}

DecodeParams decode_params(const nb::kwargs& kwargs, const char* fn, ArrayKeeper* keep) {
  Kwargs kw(kwargs);
  DecodeParams p;
  auto in = [&](const char* name) { return to_view(name, kw.get(name), false, keep); };
  auto out = [&](const char* name) { return to_view(name, kw.get(name), true, keep); };
  // Flags first: whether the pool must be writable depends on store_final_state.
  p.use_initial_state = kw.flag("use_initial_state", true);
  p.store_final_state = kw.flag("store_final_state", true);
  p.check_indices = kw.flag("check_indices", false);
  read_tokens(kw, keep, &p);
  p.state = to_view("state", kw.get("state"), p.store_final_state, keep);
  p.state_indices = in("state_indices");
  p.num_accepted_tokens = in("num_accepted_tokens");
  p.final_state = out("final_state");
  p.intermediate_states = out("intermediate_states");
  p.state_layout = static_cast<StateLayout>(kw.integer("state_layout", 0));
  read_gate(kw, &p.gate);
  read_exec(kw, keep, &p.exec);
  kw.check_all_used(fn);
  return p;
}

// Runs op(params) with the GIL released; a failed Status becomes a Python exception.
template <typename Params, typename Op>
void run_released(const Params& p, Op&& op) {
  Status s;
  {
    nb::gil_scoped_release release;
    s = op(p);
  }
  if (!s.ok()) raise_status(s);
}

void check(const Status& s) {
  if (!s.ok()) raise_status(s);
}

void run_prefill(const nb::kwargs& kwargs) {
  ArrayKeeper keep;
  run_released(prefill_params(kwargs, "prefill", &keep), [](const PrefillParams& p) { return kda::prefill(p); });
}

size_t prefill_workspace_size(const nb::kwargs& kwargs) {
  ArrayKeeper keep;
  size_t bytes = 0;
  check(kda::prefill_workspace_size(prefill_params(kwargs, "prefill_workspace_size", &keep), &bytes));
  return bytes;
}

void validate_prefill(const nb::kwargs& kwargs) {
  ArrayKeeper keep;
  check(kda::validate(prefill_params(kwargs, "validate_prefill", &keep)));
}

void run_decode(const nb::kwargs& kwargs) {
  ArrayKeeper keep;
  run_released(decode_params(kwargs, "decode", &keep), [](const DecodeParams& p) { return kda::decode(p); });
}

void validate_decode(const nb::kwargs& kwargs) {
  ArrayKeeper keep;
  check(kda::validate(decode_params(kwargs, "validate_decode", &keep)));
}

nb::dict info() {
  nb::dict d;
  d["version"] = kda::version();
  d["cuda_compiled"] = kda::cuda_compiled();
  d["chunk_size"] = kda::kChunkSize;
  nb::list devices;
  for (const DeviceInfo& dev : kda::cuda_devices()) {
    nb::dict x;
    x["index"] = dev.index;
    x["name"] = dev.name;
    x["compute_capability"] = nb::make_tuple(dev.sm_major, dev.sm_minor);
    x["multiprocessors"] = dev.multiprocessors;
    x["global_memory_bytes"] = dev.global_memory_bytes;
    x["supported"] = dev.supported;
    devices.append(x);
  }
  d["cuda_devices"] = devices;
  return d;
}

}  // namespace
}  // namespace kda::python

NB_MODULE(_C, m) {
  namespace kp = kda::python;
  m.doc() = "KDA kernels (private bindings; use the `kda` package).";
  m.attr("__version__") = kda::version();
  m.attr("chunk_size") = kda::kChunkSize;

  m.def(
      "prefill", &kp::run_prefill,
      "kda::prefill with PrefillParams fields as keyword arguments (mutates out/states in place).");
  m.def("prefill_workspace_size", &kp::prefill_workspace_size,
        "Bytes of device workspace kda::prefill needs for these arguments.");
  m.def("validate_prefill", &kp::validate_prefill,
        "Validation alone; raises ValueError naming the argument.");
  m.def("decode", &kp::run_decode,
        "kda::decode with DecodeParams fields as keyword arguments (mutates out/state in place).");
  m.def("validate_decode", &kp::validate_decode,
        "Validation alone; raises ValueError naming the argument.");
  m.def("checkpoint_offsets", &kda::checkpoint_offsets, "cu_seqlens"_a, "every"_a,
        "Checkpoint offsets [N + 1] for host cu_seqlens.");
  m.def("cuda_compiled", &kda::cuda_compiled, "Whether this build contains the CUDA backend.");
  m.def("info", &kp::info, "Version, build and CUDA device information.");
  kp::register_backward(m);
}
