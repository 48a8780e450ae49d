"""torch.library custom ops ``kda::prefill`` and ``kda::decode``, registered when this module is
first imported (the first time a torch tensor reaches kda).

Both ops mutate their output arguments in place and return nothing, so the fake (meta)
implementations have nothing to compute: torch.compile sees an opaque op with declared
mutations, and CUDA-graph capture records the kernel launches on the current stream. The ops take
the enum options as integer codes (see ``kda.api``); users call ``kda.prefill`` / ``kda.decode``.

Tensors cross into the extension as DLPack capsules made by ``torch.utils.dlpack.to_dlpack``: zero
copies and, unlike ``Tensor.__dlpack__(stream=None)``, no stream synchronization, which would
break CUDA-graph capture.
"""

from typing import Any, Callable, Dict, Optional

import torch
import torch.utils.dlpack

from . import _C

Tensor = torch.Tensor
OptTensor = Optional[torch.Tensor]
_DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _capsule(t: Optional[torch.Tensor]) -> Any:
    if t is None:
        return None
    t = t.detach()
    to_dlpack = getattr(torch.utils.dlpack, "to_dlpack", None)
    if to_dlpack is not None:
        return to_dlpack(t)
    return t.__dlpack__(stream=-1)  # -1: no synchronization


def _call(fn: Callable[..., Any], tensors: Dict[str, Optional[torch.Tensor]],
          options: Dict[str, Any]) -> Any:
    """Calls an extension function with fresh capsules (a capsule can be consumed only once)."""
    kwargs = {name: _capsule(t) for name, t in tensors.items()}
    kwargs.update(options)
    return fn(**kwargs)


def run(op: str, tensors: Dict[str, Optional[torch.Tensor]], options: Dict[str, Any]) -> None:
    """Runs kda prefill/decode on torch tensors; on CUDA, on the current stream of q's device."""
    q = tensors["q"]
    if not q.is_cuda:
        _call(_C.prefill if op == "prefill" else _C.decode, tensors, options)
        return
    with torch.cuda.device(q.device):
        options = dict(options, stream=int(torch.cuda.current_stream(q.device).cuda_stream))
        if op == "prefill":
            if tensors.get("workspace") is None:
                nbytes = _call(_C.prefill_workspace_size, tensors, options)
                if nbytes > 0:
                    tensors = dict(tensors, workspace=torch.empty(nbytes, dtype=torch.uint8,
                                                                  device=q.device))
            _call(_C.prefill, tensors, options)
        else:
            _call(_C.decode, tensors, options)


def _prefill_impl(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, output: Tensor,
                  A_log: OptTensor, dt_bias: OptTensor, cu_seqlens: OptTensor,
                  initial_state: OptTensor, final_state: OptTensor, state_pool: OptTensor,
                  state_indices: OptTensor, checkpoints: OptTensor, checkpoint_offsets: OptTensor,
                  workspace: OptTensor, checkpoint_every: int, state_layout: int,
                  use_qk_l2norm: bool, scale: Optional[float], gate_form: int, lower_bound: float,
                  beta_form: int, allow_neg_eigval: bool, backend: int, num_threads: int) -> None:
    tensors = dict(q=q, k=k, v=v, g=g, beta=beta, out=output, A_log=A_log, dt_bias=dt_bias,
                   cu_seqlens=cu_seqlens, initial_state=initial_state, final_state=final_state,
                   state_pool=state_pool, state_indices=state_indices, checkpoints=checkpoints,
                   checkpoint_offsets=checkpoint_offsets, workspace=workspace)
    options = dict(checkpoint_every=checkpoint_every, state_layout=state_layout,
                   use_qk_l2norm=use_qk_l2norm, scale=scale, gate_form=gate_form,
                   lower_bound=lower_bound, beta_form=beta_form, allow_neg_eigval=allow_neg_eigval,
                   backend=backend, num_threads=num_threads)
    run("prefill", tensors, options)


def _decode_impl(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, output: Tensor,
                 A_log: OptTensor, dt_bias: OptTensor, cu_seqlens: OptTensor, state: Tensor,
                 state_indices: OptTensor, num_accepted_tokens: OptTensor,
                 final_state: OptTensor, intermediate_states: OptTensor,
                 use_initial_state: bool, store_final_state: bool, check_indices: bool,
                 state_layout: int, use_qk_l2norm: bool, scale: Optional[float], gate_form: int,
                 lower_bound: float, beta_form: int, allow_neg_eigval: bool, backend: int,
                 num_threads: int) -> None:
    tensors = dict(q=q, k=k, v=v, g=g, beta=beta, out=output, A_log=A_log, dt_bias=dt_bias,
                   cu_seqlens=cu_seqlens, state=state, state_indices=state_indices,
                   num_accepted_tokens=num_accepted_tokens, final_state=final_state,
                   intermediate_states=intermediate_states)
    options = dict(use_initial_state=use_initial_state, store_final_state=store_final_state,
                   check_indices=check_indices, state_layout=state_layout,
                   use_qk_l2norm=use_qk_l2norm, scale=scale, gate_form=gate_form,
                   lower_bound=lower_bound, beta_form=beta_form, allow_neg_eigval=allow_neg_eigval,
                   backend=backend, num_threads=num_threads)
    run("decode", tensors, options)


def _nothing(*args: Any, **kwargs: Any) -> None:
    """Fake implementation: the ops only mutate their arguments and return nothing."""
    return None


def _register() -> Dict[str, Callable[..., None]]:
    """Registers the custom ops (once per process); plain functions on torch < 2.4."""
    custom_op = getattr(torch.library, "custom_op", None)
    if custom_op is None:
        return {"prefill": _prefill_impl, "decode": _decode_impl}
    specs = (("prefill", _prefill_impl,
              ("output", "final_state", "state_pool", "checkpoints", "workspace")),
             ("decode", _decode_impl, ("output", "state", "final_state", "intermediate_states")))
    result = {}
    for name, impl, mutated in specs:
        try:
            op = custom_op(f"kda::{name}", impl, mutates_args=mutated)
            op.register_fake(_nothing)
        except RuntimeError:  # already registered (the module was reloaded)
            pass
        result[name] = getattr(torch.ops.kda, name).default
    return result


OPS: Dict[str, Callable[..., None]] = _register()


_is_compiling = getattr(torch.compiler, "is_compiling", None) or (lambda: False)


def compiling() -> bool:
    """True while torch.compile (dynamo) traces the caller."""
    return _is_compiling()


# ---------------------------------------------------------------------------------------------
# Traced paths: what kda.prefill / kda.decode do while torch.compile traces them. Straight-line
# torch code (no host reads, no try/except, no foreign objects) so that the call stays in one
# graph; argument errors surface when the op runs (the C++ validation).
# ---------------------------------------------------------------------------------------------

def prefill_traced(tensors: Dict[str, Optional[torch.Tensor]], options: Dict[str, Any],
                   allocate_final: bool) -> Any:
    q, v = tensors["q"], tensors["v"]
    out = tensors["out"]
    if out is None:
        out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    final_state = tensors["final_state"]
    if allocate_final:
        cu = tensors["cu_seqlens"]
        n = cu.shape[0] - 1 if cu is not None else q.shape[0]
        K, HV, V = q.shape[-1], v.shape[-2], v.shape[-1]
        shape = (n, HV, V, K) if options["state_layout"] == 0 else (n, HV, K, V)
        h0 = tensors["initial_state"]
        final_state = torch.empty(shape, dtype=torch.float32 if h0 is None else h0.dtype,
                                  device=q.device)
    args = {n: None if t is None else t.detach() for n, t in tensors.items() if n != "out"}
    args["final_state"] = None if final_state is None else final_state.detach()
    OPS["prefill"](output=out.detach(), **args, **options)
    return (out, final_state) if final_state is not None else out


def decode_traced(tensors: Dict[str, Optional[torch.Tensor]], options: Dict[str, Any],
                  out_dtype: Optional[torch.dtype]) -> torch.Tensor:
    q, v = tensors["q"], tensors["v"]
    out = tensors["out"]
    if out is None:
        if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
            out_dtype = getattr(torch, _DTYPE_NAMES.get(str(out_dtype), str(out_dtype)))
        out = torch.empty(v.shape, dtype=q.dtype if out_dtype is None else out_dtype,
                          device=q.device)
    args = {n: None if t is None else t.detach() for n, t in tensors.items() if n != "out"}
    OPS["decode"](output=out.detach(), **args, **options)
    return out
