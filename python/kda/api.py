"""The kda Python API: ``prefill`` and ``decode`` over torch, numpy or any DLPack arrays.

Arrays cross into the C++ library without copies, with their own strides, dtype and device;
outputs that are not given are allocated with the inputs' array library on q's device. Torch
tensors go through the custom ops ``torch.ops.kda.prefill`` / ``torch.ops.kda.decode`` so that
torch.compile and CUDA-graph capture see them. On CUDA the kernels run on the current stream of
the array library (torch, CuPy) or the legacy default stream.

Errors: a wrong type raises TypeError, a wrong value (shape, dtype, flag, index...) raises
ValueError, a valid call that the chosen backend cannot run raises NotImplementedError; every
message names the argument. Nothing is written when a call fails validation.
"""

import re
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

from . import _C, _arrays

Array = Any  # torch.Tensor, numpy.ndarray, or any array with __dlpack__

_GATES = {"precomputed": 0, "softplus": 1, "lower_bound": 2}
_LAYOUTS = {"v_first": 0, "k_first": 1}
_BACKENDS = {"auto": 0, "cpu": 1, "cuda": 2, "reference": 3}

# Names in the extension's messages -> names of this API's arguments.
_API_NAMES = {"gate_form": "gate", "beta_form": "beta_logits"}


_TORCH_OPS: Any = None


def _torch_module() -> Any:
    """kda._torch_ops, imported (and the custom ops registered) on first use with torch tensors;
    afterwards a module global, which torch.compile reads without tracing an import."""
    global _TORCH_OPS
    if _TORCH_OPS is None:
        from . import _torch_ops
        _TORCH_OPS = _torch_ops
    return _TORCH_OPS


# ---------------------------------------------------------------------------------------------
# Argument checks (types here; values mostly in the C++ validation)
# ---------------------------------------------------------------------------------------------

def _check_array(name: str, x: Any, required: bool = False) -> None:
    if x is None:
        if required:
            raise TypeError(f"argument '{name}': expected an array, got None")
        return
    if not _arrays.is_array(x):
        raise TypeError(f"argument '{name}': expected an array (torch.Tensor, numpy.ndarray or "
                        f"any DLPack array){'' if required else ' or None'}, "
                        f"got {type(x).__name__}")


def _check_bool(name: str, x: Any) -> bool:
    if isinstance(x, bool) or type(x).__name__ == "bool_":  # numpy.bool_
        return bool(x)
    raise TypeError(f"argument '{name}': expected bool, got {type(x).__name__}")


def _check_int(name: str, x: Any) -> int:
    if isinstance(x, bool) or not hasattr(x, "__index__"):
        raise TypeError(f"argument '{name}': expected int, got {type(x).__name__}")
    return int(x.__index__())


def _check_float(name: str, x: Any, optional: bool = False) -> Optional[float]:
    if x is None and optional:
        return None
    if isinstance(x, bool) or (not isinstance(x, (int, float)) and not hasattr(x, "__float__")):
        raise TypeError(f"argument '{name}': expected float{' or None' if optional else ''}, "
                        f"got {type(x).__name__}")
    if _arrays.is_array(x) and getattr(x, "ndim", 0) != 0:
        raise TypeError(f"argument '{name}': expected a float, got an array")
    return float(x)


def _choice(name: str, x: Any, choices: Mapping[str, int]) -> int:
    if not isinstance(x, str):
        raise TypeError(f"argument '{name}': expected str, got {type(x).__name__}")
    if x not in choices:
        raise ValueError(f"argument '{name}': expected one of {', '.join(map(repr, choices))}, "
                         f"got {x!r}")
    return choices[x]


def _gate_options(scale: Any, use_qk_l2norm: Any, gate: Any, lower_bound: Any, beta_logits: Any,
                  allow_neg_eigval: Any) -> Dict[str, Any]:
    return dict(scale=_check_float("scale", scale, optional=True),
                use_qk_l2norm=_check_bool("use_qk_l2norm", use_qk_l2norm),
                gate_form=_choice("gate", gate, _GATES),
                lower_bound=_check_float("lower_bound", lower_bound),
                beta_form=1 if _check_bool("beta_logits", beta_logits) else 0,
                allow_neg_eigval=_check_bool("allow_neg_eigval", allow_neg_eigval))


def _check_same_library(arrays: Mapping[str, Any]) -> str:
    """torch inputs must all be torch tensors (they cross the custom op); returns q's library."""
    lib = _arrays.library(arrays["q"])
    if lib == "torch":
        for name, x in arrays.items():
            if x is not None and _arrays.library(x) != "torch":
                raise TypeError(f"argument '{name}': expected a torch.Tensor (as q), "
                                f"got {type(x).__module__}.{type(x).__name__}")
    return lib


def rename_arguments(exc: BaseException, names: Mapping[str, str]) -> BaseException:
    """The same exception with "argument 'x'" rewritten to "argument 'names[x]'"."""
    msg = str(exc)
    new = re.sub(r"argument '([A-Za-z0-9_.]+)'",
                 lambda m: f"argument '{names.get(m.group(1), m.group(1))}'", msg)
    if new == msg:
        return exc
    try:
        return type(exc)(new)
    except Exception:
        return exc


def _run(op: str, lib: str, tensors: Dict[str, Any], options: Dict[str, Any],
         names: Mapping[str, str]) -> None:
    try:
        if lib == "torch":
            _torch_ops = _torch_module()
            # Inference only: detached aliases (the writes still land in the caller's tensors).
            args = {n: None if t is None else t.detach() for n, t in tensors.items()}
            args["output"] = args.pop("out")
            _torch_ops.OPS[op](**args, **options)
            return
        q = tensors["q"]
        if _arrays.on_cuda(q):
            options = dict(options, stream=_arrays.current_stream(q))
            if op == "prefill" and tensors.get("workspace") is None:
                nbytes = _C.prefill_workspace_size(**tensors, **options)
                if nbytes > 0:
                    tensors = dict(tensors,
                                   workspace=_arrays.empty(q, (nbytes,), "uint8", "workspace"))
        (_C.prefill if op == "prefill" else _C.decode)(**tensors, **options)
    except (TypeError, ValueError, NotImplementedError, RuntimeError) as e:
        raise rename_arguments(e, names) from None


def _state_shape(rows: int, q: Any, v: Any, state_layout: int) -> Optional[Tuple[int, ...]]:
    """[rows, HV, V, K] (V-first) or [rows, HV, K, V]; None when q/v are malformed (the C++
    validation then reports them)."""
    try:
        K, HV, V = int(q.shape[-1]), int(v.shape[-2]), int(v.shape[-1])
    except (AttributeError, IndexError, TypeError):
        return None
    if rows < 0:
        return None
    return (rows, HV, V, K) if state_layout == 0 else (rows, HV, K, V)


def _num_sequences(q: Any, cu_seqlens: Any) -> int:
    try:
        return int(cu_seqlens.shape[0]) - 1 if cu_seqlens is not None else int(q.shape[0])
    except (AttributeError, IndexError, TypeError):
        return -1


# ---------------------------------------------------------------------------------------------
# prefill
# ---------------------------------------------------------------------------------------------

def prefill(q: Array, k: Array, v: Array, g: Array, beta: Array, *,
            A_log: Optional[Array] = None, dt_bias: Optional[Array] = None,
            cu_seqlens: Optional[Array] = None, scale: Optional[float] = None,
            use_qk_l2norm: bool = True, gate: str = "precomputed", lower_bound: float = -5.0,
            beta_logits: bool = False, allow_neg_eigval: bool = False,
            initial_state: Optional[Array] = None, output_final_state: bool = False,
            final_state: Optional[Array] = None, state_pool: Optional[Array] = None,
            state_indices: Optional[Array] = None, checkpoint_every: int = 0,
            checkpoints: Optional[Array] = None, checkpoint_offsets: Optional[Array] = None,
            state_layout: str = "v_first", out: Optional[Array] = None, backend: str = "auto",
            workspace: Optional[Array] = None,
            num_threads: int = 0) -> Union[Array, Tuple[Array, Array]]:
    """Chunked KDA forward over whole prompts (spec section 4), dense or varlen.

    Args:
        q, k: ``[B, T, H, K]`` bf16/fp16 (fp32 also on CPU). Varlen: ``[1, T, H, K]`` or
            ``[T, H, K]`` with ``cu_seqlens``. Only the last dimension must be contiguous, so q, k
            and v may be views into one fused QKV projection.
        v: ``[B, T, HV, V]``, q's dtype; ``HV % H == 0`` (grouped values).
        g: ``[B, T, HV, K]``, q's dtype or fp32: the gate input (see ``gate``).
        beta: ``[B, T, HV]``, q's dtype or fp32 (see ``beta_logits``).
        A_log: ``[HV]`` fp32, optional (absent: ``exp(A_log) = 1``).
        dt_bias: ``[HV, K]`` fp32, optional (absent: 0).
        cu_seqlens: ``[N + 1]`` int32/int64 sequence starts: varlen mode.
        scale: q scale; default ``K ** -0.5``.
        use_qk_l2norm: L2-normalize q and k per token (default on).
        gate: how g becomes the log decay ``a``: ``"precomputed"`` (``a = g``, log space),
            ``"softplus"`` (``-exp(A_log) * softplus(g + dt_bias)``, Kimi-Linear) or
            ``"lower_bound"`` (``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``, FlashKDA).
        lower_bound: in ``[-5, 0)``, for ``gate="lower_bound"``.
        beta_logits: beta is logits: ``b = sigmoid(beta)`` (``2 * sigmoid(beta)`` with
            ``allow_neg_eigval``); else beta is used as given.
        allow_neg_eigval: see ``beta_logits``.
        initial_state: ``[N, HV, V, K]`` (V-first) or ``[N, HV, K, V]`` (K-first); fp32/bf16/fp16.
            Absent: zero.
        output_final_state: allocate and return the final state (fp32, or initial_state's dtype).
        final_state: preallocated final state ``[N, HV, ...]`` (implies ``output_final_state``).
        state_pool, state_indices: serving mode: read sequence n's initial state from
            ``state_pool[state_indices[n]]`` and write its final state back there, in place.
            A slot outside ``[0, P)`` means "no pooled state" (start at zero, write nothing).
        checkpoint_every: 0 or a multiple of 64: also store the state after every that many tokens
            of each sequence into ``checkpoints`` ``[num_checkpoints, HV, ...]`` at rows
            ``checkpoint_offsets[n] + j``. Without ``checkpoint_offsets`` they are computed on the
            host from ``cu_seqlens`` (a device-to-host copy for CUDA arrays; pass them explicitly
            under CUDA-graph capture), see :func:`checkpoint_offsets`.
        state_layout: ``"v_first"`` (default, FlashKDA/MATE) or ``"k_first"`` (FLA), for every
            state argument of the call.
        out: preallocated output ``[B, T, HV, V]`` in q's dtype (allocated when absent).
        backend: ``"auto"`` (the arrays' device), ``"cpu"``, ``"cuda"`` or ``"reference"``
            (the fp64 token-by-token CPU reference).
        workspace: device scratch memory; allocated with torch/CuPy when absent.
        num_threads: CPU backends: 0 = all hardware threads (or ``$KDA_NUM_THREADS``).

    Returns:
        ``out``, or ``(out, final_state)`` when ``output_final_state`` or ``final_state`` is given.

    Raises:
        TypeError: an argument of the wrong type (the message names it).
        ValueError: a bad shape, dtype, stride, device, index or option value (named).
        NotImplementedError: the chosen backend cannot run this valid call.
        RuntimeError: a CUDA or internal error.
    """
    arrays = dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias,
                  cu_seqlens=cu_seqlens, initial_state=initial_state, final_state=final_state,
                  state_pool=state_pool, state_indices=state_indices, checkpoints=checkpoints,
                  checkpoint_offsets=checkpoint_offsets, out=out, workspace=workspace)
    if _arrays.is_torch(q):
        _torch_ops = _torch_module()
        if _torch_ops.compiling():  # traced by torch.compile: straight to the op
            options = dict(checkpoint_every=checkpoint_every,
                           state_layout=_LAYOUTS[state_layout], use_qk_l2norm=use_qk_l2norm,
                           scale=None if scale is None else float(scale),
                           gate_form=_GATES[gate], lower_bound=float(lower_bound),
                           beta_form=1 if beta_logits else 0, allow_neg_eigval=allow_neg_eigval,
                           backend=_BACKENDS[backend], num_threads=num_threads)
            return _torch_ops.prefill_traced(arrays, options,
                                             bool(output_final_state) and final_state is None)
    for name, x in arrays.items():
        _check_array(name, x, required=name in ("q", "k", "v", "g", "beta"))
    options = _gate_options(scale, use_qk_l2norm, gate, lower_bound, beta_logits,
                            allow_neg_eigval)
    allocate_final = _check_bool("output_final_state", output_final_state) and final_state is None
    want_final = allocate_final or final_state is not None
    options.update(checkpoint_every=_check_int("checkpoint_every", checkpoint_every),
                   state_layout=_choice("state_layout", state_layout, _LAYOUTS),
                   backend=_choice("backend", backend, _BACKENDS),
                   num_threads=_check_int("num_threads", num_threads))
    lib = _check_same_library(arrays)
    if allocate_final and state_pool is not None:  # (a given final_state: the C++ check names it)
        raise ValueError("argument 'output_final_state': expected False in pool mode "
                         "(state_pool is updated in place through state_indices)")

    # Outputs the caller did not give, allocated like q (nothing is allocated for malformed q/v:
    # the validation reports those first).
    if out is None:
        out = _arrays.empty(q, tuple(v.shape), None, "out") if hasattr(v, "shape") else None
    if allocate_final:
        shape = _state_shape(_num_sequences(q, cu_seqlens), q, v, options["state_layout"])
        if shape is not None:
            dt = "fp32" if initial_state is None else _arrays.dtype_name(initial_state)
            final_state = _arrays.empty(q, shape, dt, "final_state")
    every = options["checkpoint_every"]
    if every > 0 and checkpoints is not None and checkpoint_offsets is None:
        starts: Optional[Sequence[int]] = None
        if cu_seqlens is not None:
            starts = _arrays.host_ints(cu_seqlens, "cu_seqlens")
        elif len(getattr(q, "shape", ())) == 4:
            n, t = int(q.shape[0]), int(q.shape[1])
            starts = [i * t for i in range(n + 1)]
        if starts is not None:  # else q is malformed: the validation reports it
            checkpoint_offsets = _arrays.from_ints(
                q, _C.checkpoint_offsets(list(starts), every), "checkpoint_offsets")

    tensors = dict(arrays, out=out, final_state=final_state,
                   checkpoint_offsets=checkpoint_offsets)
    _run("prefill", lib, tensors, options, _API_NAMES)
    return (out, final_state) if want_final else out


# ---------------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------------

def decode(q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array, *,
           A_log: Optional[Array] = None, dt_bias: Optional[Array] = None,
           cu_seqlens: Optional[Array] = None, state_indices: Optional[Array] = None,
           num_accepted_tokens: Optional[Array] = None, final_state: Optional[Array] = None,
           intermediate_states: Optional[Array] = None, use_initial_state: bool = True,
           store_final_state: bool = True, check_indices: bool = False,
           out_dtype: Optional[Any] = None, out: Optional[Array] = None,
           scale: Optional[float] = None, use_qk_l2norm: bool = True, gate: str = "precomputed",
           lower_bound: float = -5.0, beta_logits: bool = False, allow_neg_eigval: bool = False,
           state_layout: str = "v_first", backend: str = "auto", num_threads: int = 0) -> Array:
    """One or a few tokens per sequence against a state pool (spec section 5).

    Args:
        q, k: ``[B, T, H, K]`` (varlen: ``[1, total, H, K]`` or ``[total, H, K]`` with
            ``cu_seqlens``); ``K == V``, a multiple of 32 up to 256.
        v: ``[B, T, HV, V]``; g: ``[B, T, HV, K]``; beta: ``[B, T, HV]`` or ``[B, T, HV, V]``.
        state: the pool ``[P, HV, V, K]`` (V-first) or ``[P, HV, K, V]``, fp32 or bf16 (bf16 is
            widened for the arithmetic and rounded back after every token).
        A_log: ``[HV]`` fp32; dt_bias: ``[HV, K]`` fp32 or bf16; both optional.
        cu_seqlens: ``[N + 1]``: varlen mode.
        state_indices: ``[N]`` or ``[N, T]`` int32/int64 slots (without: sequence n uses slot n).
            A negative slot makes the row a padding row: zero output, no state access.
        num_accepted_tokens: ``[N]`` (with ``[N, T]`` indices): speculative decode; sequence n
            reads slot ``state_indices[n, num_accepted_tokens[n] - 1]``.
        final_state: separate output ``[N, HV, ...]`` for the state after the last token.
        intermediate_states: ``[total_tokens, HV, ...]``: the state after every token.
        use_initial_state: False: every row starts from zero.
        store_final_state: False: output only, no state written.
        check_indices: report out-of-range slots / accepted counts as ValueError instead of
            treating the rows as padding (reads the indices on the host: a sync for CUDA arrays).
        out_dtype: dtype of the allocated output (default q's; float32 allowed).
        out: preallocated output ``[B, T, HV, V]``.
        scale, use_qk_l2norm, gate, lower_bound, beta_logits, allow_neg_eigval, state_layout,
        backend, num_threads: as in :func:`prefill`.

    Writes (when ``store_final_state``): the per-token states to ``intermediate_states`` if given;
    else with ``[N, T]`` indices the state after token t to slot ``state_indices[n, t]``; else the
    final state to ``final_state[n]`` if given; else in place to the read slot. Slots that no row
    reads or writes are never touched.

    Returns:
        ``out``.

    Raises:
        TypeError, ValueError, NotImplementedError, RuntimeError: as :func:`prefill`.
    """
    arrays = dict(q=q, k=k, v=v, g=g, beta=beta, state=state, A_log=A_log, dt_bias=dt_bias,
                  cu_seqlens=cu_seqlens, state_indices=state_indices,
                  num_accepted_tokens=num_accepted_tokens, final_state=final_state,
                  intermediate_states=intermediate_states, out=out)
    if _arrays.is_torch(q):
        _torch_ops = _torch_module()
        if _torch_ops.compiling():  # traced by torch.compile: straight to the op
            options = dict(use_initial_state=use_initial_state,
                           store_final_state=store_final_state, check_indices=check_indices,
                           state_layout=_LAYOUTS[state_layout], use_qk_l2norm=use_qk_l2norm,
                           scale=None if scale is None else float(scale),
                           gate_form=_GATES[gate], lower_bound=float(lower_bound),
                           beta_form=1 if beta_logits else 0, allow_neg_eigval=allow_neg_eigval,
                           backend=_BACKENDS[backend], num_threads=num_threads)
            return _torch_ops.decode_traced(arrays, options, out_dtype)
    for name, x in arrays.items():
        _check_array(name, x, required=name in ("q", "k", "v", "g", "beta", "state"))
    options = _gate_options(scale, use_qk_l2norm, gate, lower_bound, beta_logits,
                            allow_neg_eigval)
    options.update(use_initial_state=_check_bool("use_initial_state", use_initial_state),
                   store_final_state=_check_bool("store_final_state", store_final_state),
                   check_indices=_check_bool("check_indices", check_indices),
                   state_layout=_choice("state_layout", state_layout, _LAYOUTS),
                   backend=_choice("backend", backend, _BACKENDS),
                   num_threads=_check_int("num_threads", num_threads))
    odt = None if out_dtype is None else _arrays.canonical_dtype(out_dtype, "out_dtype")
    lib = _check_same_library(arrays)
    if out is None:
        out = _arrays.empty(q, tuple(v.shape), odt, "out") if hasattr(v, "shape") else None
    elif odt is not None and _arrays.dtype_name(out) != odt:
        raise ValueError(f"argument 'out_dtype': expected {_arrays.dtype_name(out)} (as out) or "
                         f"None, got {out_dtype!r}")
    tensors = dict(arrays, out=out)
    _run("decode", lib, tensors, options, _API_NAMES)
    return out


# ---------------------------------------------------------------------------------------------
# Helpers and discovery
# ---------------------------------------------------------------------------------------------

def checkpoint_offsets(cu_seqlens: Union[Array, Sequence[int]], every: int) -> Any:
    """Offsets ``[N + 1]`` of each sequence's first checkpoint row for ``prefill(checkpoint_every=
    every)``; the last entry is the number of checkpoint rows to allocate.

    ``cu_seqlens`` is read on the host (a device array is copied). Returns an int64 array of
    ``cu_seqlens``' library and device, or a list when ``cu_seqlens`` is a list/tuple.
    """
    every = _check_int("every", every)
    if not isinstance(cu_seqlens, (list, tuple)):
        _check_array("cu_seqlens", cu_seqlens, required=True)
    values = _C.checkpoint_offsets(list(_arrays.host_ints(cu_seqlens, "cu_seqlens")), every)
    if isinstance(cu_seqlens, (list, tuple)):
        return list(values)
    return _arrays.from_ints(cu_seqlens, values, "cu_seqlens")


def info() -> Dict[str, Any]:
    """Version, build and device information: ``version``, ``cuda_compiled``, ``chunk_size``,
    ``cuda_devices`` (index, name, compute_capability, multiprocessors, global_memory_bytes,
    supported), ``torch`` (its version if importable, else None)."""
    d = dict(_C.info())
    try:
        import torch
        d["torch"] = str(torch.__version__)
    except ImportError:
        d["torch"] = None
    return d


def cuda_available() -> bool:
    """True when this build has the CUDA backend and a GPU it supports (sm_90) is visible."""
    return bool(_C.cuda_compiled()) and any(dev["supported"] for dev in _C.info()["cuda_devices"])
