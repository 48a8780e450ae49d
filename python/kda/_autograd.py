"""torch autograd for the prefill (spec section 8): ``kda.prefill`` (and ``kda.fla.chunk_kda``
through it) is differentiable when grad mode is on and an input requires grad.

- Eager calls run :class:`PrefillFunction`, a ``torch.autograd.Function`` over the eager prefill.
- Under torch.compile they run the functional custom op ``kda::prefill_functional`` (new
  ``out`` and ``final_state``), whose autograd formula is registered with
  ``register_autograd``: ``kda::prefill`` mutates its outputs, and torch registers autograd
  formulas on functional ops only.

Both save the inputs and run one backward, :func:`backward`, through the custom op
``kda::prefill_backward``: the analytic fp64 reference (``kda._C.prefill_backward``) on CPU
tensors and the CUDA backward (sm_90a) on CUDA tensors, on torch's current stream with its
workspace from torch's caching allocator; nothing is moved between devices. Calls where no
input requires grad never come here.
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import _C, _torch_ops, api

Tensor = torch.Tensor
OptTensor = Optional[torch.Tensor]

# The differentiable inputs (the first tensor arguments of both paths, then cu_seqlens), their
# gradients' keywords in kda._C.prefill_backward, and the options that the backward takes.
INPUTS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
_GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "d_initial_state")
OPTIONS = ("scale", "use_qk_l2norm", "gate", "lower_bound", "beta_logits", "allow_neg_eigval",
           "state_layout", "backend", "num_threads")
# Gradients the extension computes in fp32 whatever the input's dtype (then cast to it).
_FP32_GRADS = ("dA_log", "ddt_bias")
# Arguments of kda.prefill that the differentiable path refuses: the serving modes (a pool,
# checkpoints), which the backward does not have.
_SERVING = ("state_pool", "state_indices", "checkpoints", "checkpoint_offsets")

def requires_grad(q: Any, k: Any, v: Any, g: Any, beta: Any, A_log: Any, dt_bias: Any,
                  initial_state: Any) -> bool:
    """True when a differentiable input is a tensor that requires grad (kda.prefill asks only
    while grad mode is on)."""
    # Unrolled (no loop): this runs on every eager call with grad mode on, autograd or not.
    return (
        getattr(q, "requires_grad", False) or getattr(k, "requires_grad", False)
        or getattr(v, "requires_grad", False) or getattr(g, "requires_grad", False)
        or getattr(beta, "requires_grad", False) or getattr(A_log, "requires_grad", False)
        or getattr(dt_bias, "requires_grad", False)
        or getattr(initial_state, "requires_grad", False))


# ---------------------------------------------------------------------------------------------
# The ops' implementations (plain functions: the backward's device check is testable without a
# GPU) and fake implementations
# ---------------------------------------------------------------------------------------------

def forward_impl(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: OptTensor,
                 dt_bias: OptTensor, initial_state: OptTensor, cu_seqlens: OptTensor,
                 scale: Optional[float], use_qk_l2norm: bool, gate: str, lower_bound: float,
                 beta_logits: bool, allow_neg_eigval: bool, state_layout: str, backend: str,
                 num_threads: int) -> Tuple[Tensor, Tensor]:
    """(out, final_state) of the eager prefill (kda.prefill's validation and allocation)."""
    with torch.no_grad():
        return api.prefill(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens,
                           initial_state=initial_state, output_final_state=True, scale=scale,
                           use_qk_l2norm=use_qk_l2norm, gate=gate, lower_bound=lower_bound,
                           beta_logits=beta_logits, allow_neg_eigval=allow_neg_eigval,
                           state_layout=state_layout, backend=backend, num_threads=num_threads)


def _forward_fake(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: OptTensor,
                  dt_bias: OptTensor, initial_state: OptTensor, cu_seqlens: OptTensor,
                  *options: Any) -> Tuple[Tensor, Tensor]:
    n = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else q.shape[0]
    K, HV, V = q.shape[-1], v.shape[-2], v.shape[-1]
    layout = options[OPTIONS.index("state_layout")]
    shape = (n, HV, V, K) if layout != "k_first" else (n, HV, K, V)
    dt = torch.float32 if initial_state is None else initial_state.dtype
    return (torch.empty(v.shape, dtype=q.dtype, device=q.device),
            torch.empty(shape, dtype=dt, device=q.device))


def backward_impl(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: OptTensor,
                  dt_bias: OptTensor, initial_state: OptTensor, cu_seqlens: OptTensor,
                  d_out: OptTensor, d_final_state: OptTensor, needs: List[bool],
                  scale: Optional[float], use_qk_l2norm: bool, gate: str, lower_bound: float,
                  beta_logits: bool, allow_neg_eigval: bool, state_layout: str, backend: str,
                  num_threads: int) -> List[Tensor]:
    """The gradients of the inputs flagged in `needs` (in INPUTS order, each in its input's
    dtype) from the upstream gradients d_out and d_final_state (None: zero)."""
    device = q.device
    if device.type not in ("cpu", "cuda"):
        raise NotImplementedError(
            f"the prefill backward runs on CPU and CUDA tensors, got {device.type} tensors")
    inputs = dict(zip(INPUTS, (q, k, v, g, beta, A_log, dt_bias, initial_state)))
    grads: Dict[str, Tensor] = {}
    for name, grad, need in zip(INPUTS, _GRADS, needs):
        x = inputs[name]
        if need and x is not None:
            dt = torch.float32 if grad in _FP32_GRADS else x.dtype
            grads[grad] = torch.empty(x.shape, dtype=dt, device=device)
    cuda: Dict[str, Any] = {}
    if device.type == "cuda":
        cuda = dict(stream=_torch_ops.stream(q), allocate=_torch_ops.allocate_workspace)
    _C.prefill_backward(**inputs, cu_seqlens=cu_seqlens, **cuda,
                        d_out=None if d_out is None else d_out.contiguous(),
                        d_final_state=None if d_final_state is None else d_final_state.contiguous(),
                        **grads, scale=scale, use_qk_l2norm=use_qk_l2norm, gate=gate,
                        lower_bound=lower_bound, beta_logits=beta_logits,
                        allow_neg_eigval=allow_neg_eigval, state_layout=state_layout,
                        backend=backend, num_threads=num_threads)
    return [grads[grad].to(inputs[name].dtype) for name, grad in zip(INPUTS, _GRADS)
            if grad in grads]


def _backward_fake(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: OptTensor,
                   dt_bias: OptTensor, initial_state: OptTensor, cu_seqlens: OptTensor,
                   d_out: OptTensor, d_final_state: OptTensor, needs: List[bool],
                   *options: Any) -> List[Tensor]:
    xs = (q, k, v, g, beta, A_log, dt_bias, initial_state)
    return [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x, need in zip(xs, needs)
            if need and x is not None]


# ---------------------------------------------------------------------------------------------
# The backward shared by both paths
# ---------------------------------------------------------------------------------------------

def _canonical(options: Dict[str, Any]) -> Dict[str, Any]:
    """The backward's options with the types of the op's schema (after a successful forward)."""
    scale = options.get("scale")
    return dict(scale=None if scale is None else float(scale),
                use_qk_l2norm=bool(options.get("use_qk_l2norm", True)),
                gate=str(options.get("gate", "precomputed")),
                lower_bound=float(options.get("lower_bound", -5.0)),
                beta_logits=bool(options.get("beta_logits", False)),
                allow_neg_eigval=bool(options.get("allow_neg_eigval", False)),
                state_layout=str(options.get("state_layout", "v_first")),
                backend=str(options.get("backend", "auto")),
                num_threads=int(options.get("num_threads", 0)))


def save(ctx: Any, tensors: Sequence[OptTensor], options: Dict[str, Any]) -> None:
    """Saves the inputs (INPUTS, then cu_seqlens) and the options for :func:`backward`."""
    ctx.save_for_backward(*tensors)
    ctx.options = _canonical(options)


def backward(ctx: Any, d_out: OptTensor, d_final_state: OptTensor) -> Tuple[OptTensor, ...]:
    """The gradients of INPUTS (None where not needed) from what :func:`save` kept."""
    saved = ctx.saved_tensors
    needs = [bool(n) and x is not None for n, x in zip(ctx.needs_input_grad, saved[:8])]
    if not any(needs):
        return (None,) * 8
    grads = iter(BACKWARD(*saved, d_out, d_final_state, needs, **ctx.options))
    return tuple(next(grads) if need else None for need in needs)


class PrefillFunction(torch.autograd.Function):
    """(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out, final_state, options)
    -> (out, final_state), eagerly. ``out`` / ``final_state``: preallocated outputs or None
    (written in place and marked dirty); ``options`` holds kda.prefill's OPTIONS."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                A_log: OptTensor, dt_bias: OptTensor, initial_state: OptTensor,
                cu_seqlens: OptTensor, out: OptTensor, final_state: OptTensor,
                options: Dict[str, Any]) -> Tuple[Tensor, Tensor]:
        result = api.prefill(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias,
                             cu_seqlens=cu_seqlens, initial_state=initial_state,
                             output_final_state=True, out=out, final_state=final_state,
                             **options)
        save(ctx, (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens), options)
        given = [t for t in (out, final_state) if t is not None]
        if given:
            ctx.mark_dirty(*given)
        return result

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, d_out: OptTensor,
                 d_final_state: OptTensor) -> Tuple[OptTensor, ...]:
        return (*backward(ctx, d_out, d_final_state), None, None, None, None)


def _setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
    save(ctx, inputs[:9], dict(zip(OPTIONS, inputs[9:])))


def _op_backward(ctx: Any, d_out: OptTensor, d_final_state: OptTensor) -> Tuple[Any, ...]:
    return (*backward(ctx, d_out, d_final_state), None) + (None,) * len(OPTIONS)


def _register() -> Tuple[Any, Any]:
    """The ops kda::prefill_functional (with its autograd formula) and kda::prefill_backward;
    (None, backward_impl) on torch < 2.4 (no torch.library.custom_op: eager autograd only)."""
    custom_op = getattr(torch.library, "custom_op", None)
    if custom_op is None:
        return None, backward_impl
    try:
        fwd = custom_op("kda::prefill_functional", forward_impl, mutates_args=())
        fwd.register_fake(_forward_fake)
        fwd.register_autograd(_op_backward, setup_context=_setup_context)
        bwd = custom_op("kda::prefill_backward", backward_impl, mutates_args=())
        bwd.register_fake(_backward_fake)
    except RuntimeError:  # already registered (the module was reloaded)
        pass
    return torch.ops.kda.prefill_functional.default, torch.ops.kda.prefill_backward.default


FORWARD, BACKWARD = _register()


# ---------------------------------------------------------------------------------------------
# kda.prefill's differentiable path
# ---------------------------------------------------------------------------------------------

def prefill(tensors: Tuple[Any, ...], options: Dict[str, Any], output_final_state: Any,
            out: Any, final_state: Any, serving: Dict[str, Any], checkpoint_every: Any) -> Any:
    """kda.prefill when an input requires grad: `tensors` are INPUTS then cu_seqlens, `options`
    the OPTIONS, `out` / `final_state` preallocated outputs or None (written in place, as part
    of the graph); `serving` the pool and checkpoint arguments, which this path refuses."""
    traced = _torch_ops.compiling()
    names = None if traced else api.NAMES.get()
    for arg in _SERVING:
        if serving[arg] is not None:
            raise NotImplementedError(f"argument '{api._name(arg, names)}': the prefill backward "
                                      "has no pool or checkpoints; run serving calls under "
                                      "torch.no_grad() or torch.inference_mode()")
    if checkpoint_every != 0:
        raise NotImplementedError(f"argument '{api._name('checkpoint_every', names)}': the "
                                  "prefill backward has no checkpoints (expected 0 when an "
                                  "input requires grad)")
    want_final = (api._check_bool("output_final_state", output_final_state, names)
                  or final_state is not None)
    if traced and FORWARD is not None:  # traced by torch.compile: the functional op
        options = _canonical(options)
        o, h = FORWARD(*tensors, *(options[n] for n in OPTIONS))
        if out is not None:  # written in place (the graph records the copy)
            o = out.copy_(o)
        if final_state is not None:
            h = final_state.copy_(h)
    else:
        o, h = PrefillFunction.apply(*tensors, out, final_state, options)
    return (o, h) if want_final else o
