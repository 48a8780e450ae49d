// module.cpp — kda._C: the C++ entry points for Python (private; the API is python/kda).
//
// prefill() and decode() take their arguments positionally, in the order of the tuples
// prefill_arguments / decode_arguments (the PrefillParams / DecodeParams field names, options by
// their own names; enum options as the names of their values, e.g. gate="softplus"), then
//   stream    the cudaStream_t address for CUDA arrays (0: the legacy default stream);
//   allocate  None, or allocate(nbytes, device_index) -> array: called once, after validation,
//             when the call needs device workspace that `workspace` does not provide;
//   names     None, or a dict {argument: the caller's name for it} applied to every message.
// Each call validates once (in kda::prefill / kda::decode) and releases the GIL while it runs.
// read_prefill() / read_decode() take the same arguments and stop after the validation:
// the host cost of reading the arguments, without the run.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <iterator>
#include <string>

#include "backward.h"
#include "kda/kda.h"
#include "views.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace kda::python {
namespace {

// clang-format off
constexpr const char* kPrefillArguments[] = {
    "q", "k", "v", "g", "beta", "A_log", "dt_bias", "cu_seqlens", "out", "initial_state",
    "final_state", "state_pool", "state_indices", "checkpoints", "checkpoint_offsets",
    "workspace", "checkpoint_every", "check_indices", "state_layout", "use_qk_l2norm", "scale",
    "gate", "lower_bound", "beta_logits", "allow_neg_eigval", "backend", "num_threads", "stream",
    "allocate", "names"};

constexpr const char* kDecodeArguments[] = {
    "q", "k", "v", "g", "beta", "A_log", "dt_bias", "cu_seqlens", "out", "state",
    "state_indices", "num_accepted_tokens", "final_state", "intermediate_states",
    "use_initial_state", "store_final_state", "check_indices", "state_layout", "use_qk_l2norm",
    "scale", "gate", "lower_bound", "beta_logits", "allow_neg_eigval", "backend", "num_threads",
    "stream", "names"};
// clang-format on

template <size_t N>
nb::tuple names_tuple(const char* const (&names)[N]) {
  nb::list l;
  for (const char* n : names) l.append(n);
  return nb::tuple(l);
}

// The positional arguments of one call, in the order of `names`: next() reads them in that
// order (and checks that the caller asks for the name at that position), find() by name.
template <size_t N>
class Args {
 public:
  Args(const nb::args& args, const char* const (&names)[N], const char* function)
      : args_(args), names_(names) {
    if (PyTuple_GET_SIZE(args.ptr()) != static_cast<Py_ssize_t>(N))
      throw nb::type_error((std::string("kda._C.") + function + "() takes " + std::to_string(N) +
                            " positional arguments (see " + function + "_arguments), got " +
                            std::to_string(PyTuple_GET_SIZE(args.ptr())))
                               .c_str());
  }
  // (The names are literals of this file, which the compiler merges: the pointers compare equal
  // and strcmp runs only for a name at the wrong position.)
  nb::handle next(const char* name) {
    if (next_ >= N || (names_[next_] != name && std::strcmp(names_[next_], name) != 0))
      throw nb::type_error((std::string("kda._C: argument '") + name + "' out of order").c_str());
    return PyTuple_GET_ITEM(args_.ptr(), next_++);
  }
  nb::handle find(const char* name) const {
    for (size_t i = N; i-- > 0;)  // from the end: "names" is the last argument
      if (names_[i] == name || std::strcmp(names_[i], name) == 0)
        return PyTuple_GET_ITEM(args_.ptr(), i);
    throw nb::type_error((std::string("kda._C: no argument '") + name + "'").c_str());
  }

 private:
  const nb::args& args_;
  const char* const (&names_)[N];
  size_t next_ = 0;
};

template <size_t N>
void read_math(Args<N>& c, Reader& r, MathOptions* m) {
  m->use_qk_l2norm = r.flag("use_qk_l2norm", c.next("use_qk_l2norm"));
  m->scale = r.optional_real("scale", c.next("scale"));
  m->gate = r.choice("gate", c.next("gate"), gate_name, kNumGateForms);
  m->lower_bound = static_cast<float>(r.real("lower_bound", c.next("lower_bound")));
  m->beta_logits = r.flag("beta_logits", c.next("beta_logits"));
  m->allow_neg_eigval = r.flag("allow_neg_eigval", c.next("allow_neg_eigval"));
}

template <size_t N>
void read_exec(Args<N>& c, Reader& r, ExecOptions* e) {
  e->backend = r.choice("backend", c.next("backend"), backend_name, kNumBackends);
  e->num_threads = static_cast<int>(r.integer("num_threads", c.next("num_threads")));
  e->stream = reinterpret_cast<void*>(r.address("stream", c.next("stream")));
}

// The per-token tensors of both entry points, in their common order.
template <size_t N, typename Params>
void read_tokens(Args<N>& c, Reader& r, Params* p) {
  auto required = [&](const char* arg) {
    nb::handle h = c.next(arg);
    if (h.is_none()) r.type_error(arg, "expected an array, got None");
    return r.array(arg, h, false, /*optional=*/false);
  };
  p->q = required("q");
  p->k = required("k");
  p->v = required("v");
  p->g = required("g");
  p->beta = required("beta");
  p->A_log = r.array("A_log", c.next("A_log"), false);
  p->dt_bias = r.array("dt_bias", c.next("dt_bias"), false);
  p->cu_seqlens = r.array("cu_seqlens", c.next("cu_seqlens"), false);
  p->out = r.array("out", c.next("out"), true);
}

// Runs op() with the GIL released.
template <typename Op>
Status without_gil(Op&& op) {
  nb::gil_scoped_release release;
  return op();
}

// kRun: kda::prefill; else only kda::validate (the host-cost benchmark's split of one call).
// Returns the workspace array allocated for the call, or None, so that the caller can keep it
// for its next call on the same stream.
template <bool kRun>
nb::object run_prefill(const nb::args& args) {
  Args<std::size(kPrefillArguments)> c(args, kPrefillArguments, "prefill");
  Reader r(c.find("names"));
  PrefillParams p;
  read_tokens(c, r, &p);
  p.initial_state = r.array("initial_state", c.next("initial_state"), false);
  p.final_state = r.array("final_state", c.next("final_state"), true);
  p.state_pool = r.array("state_pool", c.next("state_pool"), true);
  p.state_indices = r.array("state_indices", c.next("state_indices"), false);
  p.checkpoints = r.array("checkpoints", c.next("checkpoints"), true);
  p.checkpoint_offsets = r.array("checkpoint_offsets", c.next("checkpoint_offsets"), false);
  r.workspace("workspace", c.next("workspace"), &p.exec.workspace, &p.exec.workspace_bytes);
  p.checkpoint_every = r.integer("checkpoint_every", c.next("checkpoint_every"));
  p.check_indices = r.flag("check_indices", c.next("check_indices"));
  p.state_layout =
      r.choice("state_layout", c.next("state_layout"), state_layout_name, kNumStateLayouts);
  read_math(c, r, &p.math);
  read_exec(c, r, &p.exec);
  Allocation alloc;
  alloc.allocate = c.next("allocate");
  if (!alloc.allocate.is_none()) {
    alloc.reader = &r;
    alloc.device_index = p.q.device_index;
    p.exec.allocate_workspace = allocate_workspace;
    p.exec.allocate_context = &alloc;
  }
  const Status s = without_gil([&] { return kRun ? kda::prefill(p) : kda::validate(p); });
  if (!alloc.error.empty()) {
    const std::string msg = "argument '" + r.name("workspace") +
                            "': allocating the device workspace failed: " + alloc.error;
    PyErr_SetString(PyExc_RuntimeError, msg.c_str());
    throw nb::python_error();
  }
  if (!s.ok()) r.raise(s);
  return alloc.array.is_valid() ? std::move(alloc.array) : nb::none();
}

// kRun: kda::decode; else only kda::validate.
template <bool kRun>
void run_decode(const nb::args& args) {
  Args<std::size(kDecodeArguments)> c(args, kDecodeArguments, "decode");
  Reader r(c.find("names"));
  DecodeParams p;
  read_tokens(c, r, &p);
  // Whether the pool must be writable depends on store_final_state (read first).
  const bool store = r.flag("store_final_state", c.find("store_final_state"));
  if (c.find("state").is_none())
    r.type_error("state", "expected an array (the state pool), got None");
  p.state = r.array("state", c.next("state"), store, /*optional=*/false);
  p.state_indices = r.array("state_indices", c.next("state_indices"), false);
  p.num_accepted_tokens = r.array("num_accepted_tokens", c.next("num_accepted_tokens"), false);
  p.final_state = r.array("final_state", c.next("final_state"), true);
  p.intermediate_states = r.array("intermediate_states", c.next("intermediate_states"), true);
  p.use_initial_state = r.flag("use_initial_state", c.next("use_initial_state"));
  p.store_final_state = r.flag("store_final_state", c.next("store_final_state"));
  p.check_indices = r.flag("check_indices", c.next("check_indices"));
  p.state_layout =
      r.choice("state_layout", c.next("state_layout"), state_layout_name, kNumStateLayouts);
  read_math(c, r, &p.math);
  read_exec(c, r, &p.exec);
  const Status s = without_gil([&] { return kRun ? kda::decode(p) : kda::validate(p); });
  if (!s.ok()) r.raise(s);
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

// {option: (value names in code order)} of every enum option.
nb::dict enum_values() {
  auto values = [](auto name_of, int count) {
    nb::list l;
    for (int i = 0; i < count; ++i) l.append(name_of(i));
    return nb::tuple(l);
  };
  nb::dict d;
  d["gate"] = values([](int i) { return gate_name(static_cast<GateForm>(i)); }, kNumGateForms);
  d["state_layout"] = values([](int i) { return state_layout_name(static_cast<StateLayout>(i)); },
                             kNumStateLayouts);
  d["backend"] = values([](int i) { return backend_name(static_cast<Backend>(i)); }, kNumBackends);
  return d;
}

}  // namespace
}  // namespace kda::python

NB_MODULE(_C, m) {
  namespace kp = kda::python;
  m.doc() = "KDA kernels (private bindings; use the `kda` package).";
  m.attr("__version__") = kda::version();
  m.attr("chunk_size") = kda::kChunkSize;
  m.attr("prefill_arguments") = kp::names_tuple(kp::kPrefillArguments);
  m.attr("decode_arguments") = kp::names_tuple(kp::kDecodeArguments);
  m.attr("enum_values") = kp::enum_values();

  m.def("prefill", &kp::run_prefill<true>,
        "kda::prefill over the arguments of prefill_arguments, positionally (writes out and the "
        "states in place); returns the workspace array allocated for the call, or None.");
  m.def("decode", &kp::run_decode<true>,
        "kda::decode over the arguments of decode_arguments, positionally (writes out and the "
        "state in place).");
  m.def("read_prefill", &kp::run_prefill<false>,
        "prefill's argument reading and kda::validate only: writes nothing, launches nothing.");
  m.def("read_decode", &kp::run_decode<false>,
        "decode's argument reading and kda::validate only: writes nothing, launches nothing.");
  m.def("register_torch", &kp::register_torch, "tensor_type"_a, "dtypes"_a,
        "parameter_type"_a = nb::none(), "mode_enabled"_a = nb::none(),
        "Registers torch.Tensor and (fp32, fp16, bf16, int32, int64) for reading tensors "
        "without DLPack capsules; torch.nn.Parameter, read like torch.Tensor; "
        "torch._C._is_torch_function_mode_enabled, without which torch's DLTensor reader is "
        "not used. Returns whether that reader is used.");
  m.def("checkpoint_offsets", &kda::checkpoint_offsets, "cu_seqlens"_a, "every"_a,
        "Checkpoint offsets [N + 1] for host cu_seqlens.");
  m.def("cuda_compiled", &kda::cuda_compiled, "Whether this build contains the CUDA backend.");
  m.def("info", &kp::info, "Version, build and CUDA device information.");
  kp::register_backward(m);

  // (PyCFunction is the C API's generic type; METH_FASTCALL says the real signature.)
  static PyMethodDef raw[] = {
      {"requires_grad",
       reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&kp::any_requires_grad)),
       METH_FASTCALL,
       "requires_grad(*objects): whether one has a true `requires_grad` attribute (as "
       "any(getattr(x, 'requires_grad', False) for x in objects))."},
      {nullptr, nullptr, 0, nullptr}};
  if (PyModule_AddFunctions(m.ptr(), raw) != 0) throw nb::python_error();
}
