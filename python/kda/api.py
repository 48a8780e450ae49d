"""The kda Python API: ``prefill`` and ``decode`` over torch, numpy or any DLPack arrays.

Arrays cross into the C++ library without copies, with their own strides, dtype and device;
outputs that are not given are allocated with the inputs' array library on q's device. Each call
is one call into the extension, which validates once and runs. While torch.compile traces a call,
torch tensors go through the custom ops ``torch.ops.kda.prefill`` / ``torch.ops.kda.decode``
instead, so that torch.compile and CUDA-graph capture see them. On CUDA the kernels run on the
current stream of the array library (torch, CuPy) or the legacy default stream.

Errors: a wrong type raises TypeError, a wrong value (shape, dtype, flag, index...) raises
ValueError, a valid call that the chosen backend cannot run raises NotImplementedError; every
message names the argument. Nothing is written when a call fails validation.
"""

from contextvars import ContextVar
from typing import Any, Dict, Optional, Sequence, Tuple, Union

from . import _C, _arrays

Array = Any  # torch.Tensor, numpy.ndarray, or any array with __dlpack__

# The argument names of the call in progress, {API name: caller's name}, set by the compatibility
# functions (kda.compat) for the extension, which names arguments in every message with them.
NAMES: "ContextVar[Optional[Dict[str, str]]]" = ContextVar("kda_argument_names", default=None)


class caller_names:
    """Within the block, kda.prefill / kda.decode name their arguments as `names` maps them
    ({API name: caller's name}), in the errors of the extension and of the API alike."""

    def __init__(self, names: Dict[str, str]) -> None:
        self.names = names

    def __enter__(self) -> None:
        self.token = NAMES.set(self.names or None)

    def __exit__(self, et: Any, e: Any, tb: Any) -> bool:
        NAMES.reset(self.token)
        return False

_TORCH_OPS: Any = None
_AUTOGRAD: Any = None


class _NoTensor:
    """Stands for torch.Tensor in `isinstance` checks until torch tensors have reached kda."""


# torch.Tensor once kda._torch_ops is imported: `isinstance(q, _TENSOR)` is the first test of every
# call (a plain isinstance, which torch.compile traces without a graph break).
_TENSOR: Any = _NoTensor


def _torch_module() -> Any:
    """kda._torch_ops, imported (torch registered with the extension, the custom ops defined) on
    first use with torch tensors, and kda._autograd with it; afterwards module globals, which
    torch.compile reads without tracing an import."""
    global _TORCH_OPS, _AUTOGRAD, _TENSOR
    if _TORCH_OPS is None:
        from . import _autograd, _torch_ops
        _TORCH_OPS, _AUTOGRAD, _TENSOR = _torch_ops, _autograd, _torch_ops.Tensor
    return _TORCH_OPS


def _name(arg: str, names: Optional[Dict[str, str]]) -> str:
    return names.get(arg, arg) if names else arg


def _check_bool(name: str, x: Any, names: Optional[Dict[str, str]] = None) -> bool:
    if isinstance(x, bool) or type(x).__name__ == "bool_":  # numpy.bool_
        return bool(x)
    raise TypeError(f"argument '{_name(name, names)}': expected bool, got {type(x).__name__}")


def _check_int(name: str, x: Any) -> int:
    if isinstance(x, bool) or not hasattr(x, "__index__"):
        raise TypeError(f"argument '{name}': expected int, got {type(x).__name__}")
    return int(x.__index__())


def _check_array(name: str, x: Any) -> None:
    if not _arrays.is_array(x):
        raise TypeError(f"argument '{name}': expected an array (torch.Tensor, numpy.ndarray or "
                        f"any DLPack array), got {type(x).__name__}")


def _state_shape(rows: int, q: Any, v: Any, state_layout: Any) -> Optional[Tuple[int, ...]]:
    """[rows, HV, V, K] (V-first) or [rows, HV, K, V]; None when q/v are malformed (the C++
    validation then reports them)."""
    try:
        K, HV, V = int(q.shape[-1]), int(v.shape[-2]), int(v.shape[-1])
    except (AttributeError, IndexError, TypeError):
        return None
    if rows < 0:
        return None
    return (rows, HV, V, K) if state_layout != "k_first" else (rows, HV, K, V)


def _num_sequences(q: Any, cu_seqlens: Any) -> int:
    try:
        return int(cu_seqlens.shape[0]) - 1 if cu_seqlens is not None else int(q.shape[0])
    except (AttributeError, IndexError, TypeError):
        return -1


def _array_workspace(q: Any) -> Any:
    """The workspace allocator of a CUDA prefill on arrays of another library than torch."""
    def allocate(nbytes: int, index: int) -> Any:
        return _arrays.empty(q, (nbytes,), "uint8", "workspace")
    return allocate


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
            check_indices: bool = False, state_layout: str = "v_first",
            out: Optional[Array] = None, backend: str = "auto",
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
        check_indices: report a slot ``>= P`` or two sequences with the same slot in ``[0, P)``
            as ValueError (reads state_indices on the host; CPU arrays only). Without it such
            sequences' results are unspecified; every other sequence and slot is exact.
        state_layout: ``"v_first"`` (default, FlashKDA/MATE) or ``"k_first"`` (FLA), for every
            state argument of the call.
        out: preallocated output ``[B, T, HV, V]`` in q's dtype (allocated when absent).
        backend: ``"auto"`` (the arrays' device), ``"cpu"``, ``"cuda"`` or ``"reference"``
            (the fp64 token-by-token CPU reference).
        workspace: device scratch memory; allocated with torch/CuPy when absent.
        num_threads: CPU backends: 0 = all hardware threads (or ``$KDA_NUM_THREADS``).

    Returns:
        ``out``, or ``(out, final_state)`` when ``output_final_state`` or ``final_state`` is given.

    Differentiable (torch tensors, grad mode on, an input requiring grad): ``backward()`` gives
    the gradients of q, k, v, g, beta, A_log, dt_bias and initial_state in their dtypes, from
    the gradients of ``out`` and ``final_state`` (``kda._autograd``): the analytic fp64 reference
    backward on CPU tensors, the CUDA backward on CUDA tensors (bf16 / fp16, head dim 128; tensors
    of other devices raise NotImplementedError). A given ``out`` / ``final_state`` is written in
    place as part of the graph; pools and checkpoints raise NotImplementedError; ``workspace`` is
    unused.

    Raises:
        TypeError: an argument of the wrong type (the message names it).
        ValueError: a bad shape, dtype, stride, device, index or option value (named).
        NotImplementedError: the chosen backend cannot run this valid call.
        RuntimeError: a CUDA or internal error.
    """
    torch = isinstance(q, _TENSOR) or _arrays.is_torch(q)
    if torch:
        ops = _TORCH_OPS if _TORCH_OPS is not None else _torch_module()
        traced = ops.compiling()
        # The differentiable path when grad mode is on and an input requires grad: asked of the
        # extension in eager calls (one C call), in Python while torch.compile traces.
        if ops.grad_enabled() and (_AUTOGRAD if traced else _C).requires_grad(
                q, k, v, g, beta, A_log, dt_bias, initial_state):
            return _AUTOGRAD.prefill(
                (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens),
                dict(scale=scale, use_qk_l2norm=use_qk_l2norm, gate=gate,
                     lower_bound=lower_bound, beta_logits=beta_logits,
                     allow_neg_eigval=allow_neg_eigval, state_layout=state_layout,
                     backend=backend, num_threads=num_threads),
                output_final_state, out, final_state,
                dict(state_pool=state_pool, state_indices=state_indices,
                     checkpoints=checkpoints, checkpoint_offsets=checkpoint_offsets),
                checkpoint_every)
        if traced:  # traced by torch.compile: straight to the op
            arrays = dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias,
                          cu_seqlens=cu_seqlens, initial_state=initial_state,
                          final_state=final_state, state_pool=state_pool,
                          state_indices=state_indices, checkpoints=checkpoints,
                          checkpoint_offsets=checkpoint_offsets, out=out, workspace=workspace)
            options = dict(checkpoint_every=checkpoint_every, check_indices=check_indices,
                           state_layout=state_layout,
                           use_qk_l2norm=use_qk_l2norm,
                           scale=None if scale is None else float(scale), gate=gate,
                           lower_bound=float(lower_bound), beta_logits=beta_logits,
                           allow_neg_eigval=allow_neg_eigval, backend=backend,
                           num_threads=num_threads)
            return ops.prefill_traced(arrays, options,
                                      bool(output_final_state) and final_state is None)
    names = NAMES.get()
    # Outputs the caller did not give, allocated like q (nothing is allocated for malformed q/v:
    # the extension reports those first). Every other check is the extension's (validated once).
    allocate_final = ((output_final_state if output_final_state is True
                       or output_final_state is False
                       else _check_bool("output_final_state", output_final_state, names))
                      and final_state is None)
    if allocate_final and state_pool is not None:  # (a given final_state: the C++ check names it)
        raise ValueError(f"argument '{_name('output_final_state', names)}': expected False in "
                         "pool mode (state_pool is updated in place through state_indices)")
    want_final = allocate_final or final_state is not None
    if torch:
        if out is None:
            out = ops.empty_out(v, q.dtype)
        if allocate_final:  # initial_state's shape and dtype, else [N, HV, ...] fp32
            final_state = ops.empty_state(q, v, initial_state, cu_seqlens, state_layout)
    else:
        if out is None and hasattr(v, "shape") and _arrays.is_array(q):
            out = _arrays.empty(q, tuple(v.shape), None, _name("out", names))
        if allocate_final and _arrays.is_array(q):
            shape = _state_shape(_num_sequences(q, cu_seqlens), q, v, state_layout)
            if shape is not None:  # fp32, or initial_state's dtype (a non-array: the extension
                h0 = initial_state if _arrays.is_array(initial_state) else None  # reports it)
                dt = "fp32" if h0 is None else _arrays.dtype_name(h0)
                final_state = _arrays.empty(q, shape, dt, _name("final_state", names))
    if (checkpoints is not None and checkpoint_offsets is None
            and isinstance(checkpoint_every, int) and checkpoint_every > 0):
        checkpoint_offsets = _host_checkpoint_offsets(q, cu_seqlens, checkpoint_every)
    stream, allocate, key = 0, None, None
    if torch:
        if q.is_cuda:  # torch's stream and allocator; the workspace kept from the last call
            stream, workspace, allocate, key = ops.prefill_device(q, workspace)
    elif _arrays.is_array(q) and _arrays.on_cuda(q):
        stream, allocate = _arrays.current_stream(q), _array_workspace(q)
    allocated = _C.prefill(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, out, initial_state,
                           final_state, state_pool, state_indices, checkpoints,
                           checkpoint_offsets, workspace, checkpoint_every, check_indices,
                           state_layout, use_qk_l2norm, scale, gate, lower_bound, beta_logits,
                           allow_neg_eigval, backend, num_threads, stream, allocate, names)
    if key is not None:
        ops.keep_workspace(key, workspace, allocated)
    return (out, final_state) if want_final else out


def _host_checkpoint_offsets(q: Any, cu_seqlens: Any, every: int) -> Any:
    """checkpoint_offsets for prefill(checkpoint_every=every) from cu_seqlens read on the host
    (or N sequences of q's T tokens); None when q or cu_seqlens is malformed (the validation
    reports it)."""
    starts: Optional[Sequence[int]] = None
    if cu_seqlens is not None and _arrays.is_array(cu_seqlens):
        starts = _arrays.host_ints(cu_seqlens, "cu_seqlens")
    elif cu_seqlens is None and len(getattr(q, "shape", ())) == 4:
        n, t = int(q.shape[0]), int(q.shape[1])
        starts = [i * t for i in range(n + 1)]
    if starts is None:
        return None
    return _arrays.from_ints(q, _C.checkpoint_offsets(list(starts), every), "checkpoint_offsets")


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
    torch = isinstance(q, _TENSOR) or _arrays.is_torch(q)
    if torch:
        ops = _TORCH_OPS if _TORCH_OPS is not None else _torch_module()
        if ops.compiling():  # traced by torch.compile: straight to the op
            arrays = dict(q=q, k=k, v=v, g=g, beta=beta, state=state, A_log=A_log,
                          dt_bias=dt_bias, cu_seqlens=cu_seqlens, state_indices=state_indices,
                          num_accepted_tokens=num_accepted_tokens, final_state=final_state,
                          intermediate_states=intermediate_states, out=out)
            options = dict(use_initial_state=use_initial_state,
                           store_final_state=store_final_state, check_indices=check_indices,
                           state_layout=state_layout, use_qk_l2norm=use_qk_l2norm,
                           scale=None if scale is None else float(scale), gate=gate,
                           lower_bound=float(lower_bound), beta_logits=beta_logits,
                           allow_neg_eigval=allow_neg_eigval, backend=backend,
                           num_threads=num_threads)
            return ops.decode_traced(arrays, options, out_dtype)
    names = NAMES.get()
    odt = (None if out_dtype is None
           else _arrays.canonical_dtype(out_dtype, _name("out_dtype", names)))
    if out is None:
        if torch:
            out = ops.empty_out(v, q.dtype if odt is None else ops.dtype(odt, q))
        elif hasattr(v, "shape") and _arrays.is_array(q):
            out = _arrays.empty(q, tuple(v.shape), odt, _name("out", names))
    elif odt is not None and _arrays.dtype_name(out) != odt:
        raise ValueError(f"argument '{_name('out_dtype', names)}': expected "
                         f"{_arrays.dtype_name(out)} (as out) or None, got {out_dtype!r}")
    stream = 0
    if torch:
        if q.is_cuda:
            stream = ops.stream(q)
    elif _arrays.is_array(q) and _arrays.on_cuda(q):
        stream = _arrays.current_stream(q)
    _C.decode(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, out, state, state_indices,
              num_accepted_tokens, final_state, intermediate_states, use_initial_state,
              store_final_state, check_indices, state_layout, use_qk_l2norm, scale, gate,
              lower_bound, beta_logits, allow_neg_eigval, backend, num_threads, stream, names)
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
        _check_array("cu_seqlens", cu_seqlens)
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
