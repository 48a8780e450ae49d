"""FLA's KDA entry points (``fla.ops.kda`` of fla-core 0.6.0) over :func:`kda.prefill` and
:func:`kda.decode` (spec section 7, third surface).

A model written against FLA runs by changing its import::

    from kda.fla import chunk_kda, fused_recurrent_kda, fused_recurrent_kda_fwd

Same signatures, defaults and returns as FLA 0.6.0: ``g`` is the log-space decay unless
``use_gate_in_kernel`` (then ``-exp(A_log) * softplus(g + dt_bias)``, or with ``lower_bound``
given ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``); beta is used as given unless
``use_beta_sigmoid_in_kernel``; no l2norm unless ``use_qk_l2norm_in_kernel``; states
``[N, HV, K, V]`` unless ``state_v_first``; ``(o, final_state_or_None)`` returned with an fp32
final state. ``A_log`` may have any shape of ``HV`` elements and ``dt_bias`` any of ``HV * K``
(FLA's ``[HV * K]`` included), in any float dtype.

Torch tensors only (FLA's functions are torch functions). Arguments of FLA that this package does
not implement raise an error naming them when set to anything but their default; unknown keyword
arguments raise TypeError (FLA drops them silently). Errors follow the package policy (TypeError
/ ValueError / NotImplementedError naming the argument, in FLA's argument names); nothing is
written when a call fails validation. torch is imported on the first call, not with this module.
"""

import warnings
from typing import Any, Dict, Optional, Tuple

from .api import caller_names, decode, prefill

__all__ = ["chunk_kda", "fused_recurrent_kda", "fused_recurrent_kda_fwd"]

Tensor = Any  # torch.Tensor

# kda.prefill / kda.decode argument names -> FLA's, for the library's error messages.
_NAMES = {"use_qk_l2norm": "use_qk_l2norm_in_kernel", "gate": "use_gate_in_kernel",
          "beta_logits": "use_beta_sigmoid_in_kernel", "state_layout": "state_v_first",
          "state_indices": "ssm_state_indices", "state": "initial_state",
          "intermediate_states": "final_state", "checkpoints": "return_intermediate_states"}

# Sequences up to this many tokens (on average) run on the decode kernel in fused_recurrent_kda.
_RECURRENT_MAX_TOKENS = 64

_TORCH: Any = None


def _torch() -> Any:
    global _TORCH
    if _TORCH is None:
        import torch
        _TORCH = torch
    return _TORCH


def _compiling() -> bool:
    torch = _torch()
    fn = getattr(torch.compiler, "is_compiling", None)
    return bool(fn()) if fn is not None else False


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Runs `fn` with the library's errors in FLA's argument names (eager only: under
    torch.compile the call is traced straight through)."""
    if _compiling():
        return fn(*args, **kwargs)
    with caller_names(_NAMES):
        return fn(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# Argument handling shared by the three entry points
# ---------------------------------------------------------------------------------------------

def _flag(name: str, x: Any) -> bool:
    if isinstance(x, bool):
        return x
    raise TypeError(f"argument '{name}': expected bool, got {type(x).__name__}")


def _flags(**values: Any) -> Dict[str, bool]:
    return {name: _flag(name, x) for name, x in values.items()}


def _unsupported(name: str, value: Any, default: Any, why: str) -> None:
    """FLA arguments this package does not implement: only their default is accepted."""
    if value is not default and value != default:
        raise NotImplementedError(f"argument '{name}': only {default!r} is supported ({why}), "
                                  f"got {value!r}")


def _state_v_first(state_v_first: Any, kwargs: Dict[str, Any]) -> bool:
    """FLA's deprecated ``transpose_state_layout`` alias of ``state_v_first``."""
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("argument 'transpose_state_layout': cannot be passed together with "
                             "state_v_first (its new name)")
        warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.",
                      DeprecationWarning, stacklevel=3)
        state_v_first = kwargs.pop("transpose_state_layout")
    return _flag("state_v_first", state_v_first)


def _check_kwargs(fn: str, kwargs: Dict[str, Any], known: Tuple[str, ...]) -> None:
    if "head_first" in kwargs:
        _unsupported("head_first", kwargs.pop("head_first"), False,
                     "tensors are [B, T, H, ...]")
    for name in kwargs:
        if name not in known:
            raise TypeError(f"{fn}() got an unexpected keyword argument '{name}'")


def _dense_rows(x: Any) -> Any:
    """A read-only input whose last dimension is strided, copied (FLA's input_guard makes every
    input contiguous; the library needs only the last dimension to be)."""
    return x if x is None or x.ndim == 0 or x.stride(-1) == 1 else x.contiguous()


def _check_tensor(name: str, x: Any, required: bool = True) -> None:
    if x is None and not required:
        return
    if not isinstance(x, _torch().Tensor):
        raise TypeError(f"argument '{name}': expected a torch.Tensor"
                        f"{'' if required else ' or None'}, got {type(x).__name__}")


def _qkv_dims(q: Any, k: Any, v: Any, cu_seqlens: Any, initial_state: Any) -> Tuple[int, ...]:
    """(B, T, H, K, HV, V, N) with FLA's checks on q/k/v, cu_seqlens and initial_state."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x)
        if x.ndim != 4:
            raise ValueError(f"argument '{name}': expected shape [B, T, H, D], "
                             f"got {list(x.shape)}")
    _check_tensor("cu_seqlens", cu_seqlens, required=False)
    _check_tensor("initial_state", initial_state, required=False)
    B, T, H, K = (int(s) for s in q.shape)
    HV, V = int(v.shape[2]), int(v.shape[3])
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"argument 'k': expected shape {list(q.shape)} (as q), "
                         f"got {list(k.shape)}")
    N = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"argument 'q': expected batch size 1 with cu_seqlens (flatten the "
                             f"sequences), got {B}")
        N = int(cu_seqlens.shape[0]) - 1
    if initial_state is not None and int(initial_state.shape[0]) != N:
        raise ValueError(f"argument 'initial_state': expected {N} states (one per sequence), "
                         f"got {int(initial_state.shape[0])}")
    return B, T, H, K, HV, V, N


def _gate(use_gate_in_kernel: bool, A_log: Any, dt_bias: Any, lower_bound: Any, HV: int,
          K: int, decode_dt_bias: bool) -> Dict[str, Any]:
    """kda options for FLA's gate arguments; A_log as [HV] fp32, dt_bias as [HV, K] (fp32, or
    bf16 kept for decode)."""
    torch = _torch()
    if not use_gate_in_kernel:  # FLA ignores A_log, dt_bias and lower_bound here
        return dict(gate="precomputed", A_log=None, dt_bias=None)
    if lower_bound is not None and (isinstance(lower_bound, bool)
                                    or not isinstance(lower_bound, (int, float))):
        raise TypeError(f"argument 'lower_bound': expected float or None, "
                        f"got {type(lower_bound).__name__}")
    for name, x, n in (("A_log", A_log, HV), ("dt_bias", dt_bias, HV * K)):
        _check_tensor(name, x, required=False)
        if x is not None and (x.numel() != n or not x.is_floating_point()):
            raise ValueError(f"argument '{name}': expected {n} float elements, got shape "
                             f"{list(x.shape)} of dtype {x.dtype}")
    if A_log is not None:
        A_log = A_log.reshape(HV)
        if A_log.dtype != torch.float32:
            A_log = A_log.float()
    if dt_bias is not None:
        dt_bias = dt_bias.reshape(HV, K)
        if dt_bias.dtype != torch.float32 and not (decode_dt_bias
                                                   and dt_bias.dtype == torch.bfloat16):
            dt_bias = dt_bias.float()
    if lower_bound is not None:
        return dict(gate="lower_bound", lower_bound=float(lower_bound), A_log=A_log,
                    dt_bias=dt_bias)
    return dict(gate="softplus", A_log=A_log, dt_bias=dt_bias)


def _beta(use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool) -> Dict[str, Any]:
    return dict(beta_logits=use_beta_sigmoid_in_kernel,
                allow_neg_eigval=allow_neg_eigval and use_beta_sigmoid_in_kernel)


def _token_input(name: str, x: Any, q: Any, shape: Tuple[int, ...]) -> Any:
    """g / beta in q's dtype or fp32 as the library takes them (FLA reads any float dtype: other
    dtypes are widened to fp32, exactly)."""
    _check_tensor(name, x)
    if tuple(x.shape) != shape:
        raise ValueError(f"argument '{name}': expected shape {list(shape)}, got {list(x.shape)}")
    torch = _torch()
    if x.dtype != q.dtype and x.dtype != torch.float32 and x.is_floating_point():
        return x.float()
    return _dense_rows(x)


def _check_scale(scale: Any) -> None:
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"argument 'scale': expected float or None, got {type(scale).__name__}")


def _needs_grad(*inputs: Any) -> bool:
    torch = _torch()
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)


# ---------------------------------------------------------------------------------------------
# chunk_kda
# ---------------------------------------------------------------------------------------------

def chunk_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
              scale: Optional[float] = None, initial_state: Optional[Tensor] = None,
              output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
              use_gate_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
              allow_neg_eigval: bool = False, safe_gate: bool = False,
              lower_bound: Optional[float] = None, disable_recompute: bool = False,
              return_intermediate_states: bool = False, state_v_first: bool = False,
              cu_seqlens: Optional[Tensor] = None, cu_seqlens_cpu: Optional[Tensor] = None,
              cp_context: Any = None, use_graph: bool = False,
              max_num_seqs: Optional[int] = None, **kwargs: Any) -> Tuple[Tensor, ...]:
    """FLA's ``fla.ops.kda.chunk_kda`` (fla-core 0.6.0) on :func:`kda.prefill`.

    Args (as FLA's):
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]`` (``HV % H == 0``); varlen: ``B = 1`` with
            ``cu_seqlens`` ``[N + 1]``.
        g: ``[B, T, HV, K]``: the log-space decay, or with ``use_gate_in_kernel`` the raw gate
            input of ``-exp(A_log) * softplus(g + dt_bias)`` (``lower_bound`` given:
            ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``, ``exp(A_log) = 1`` without
            A_log).
        beta: ``[B, T, HV]``, used as given (``use_beta_sigmoid_in_kernel``: ``sigmoid(beta)``,
            ``2 * sigmoid(beta)`` with ``allow_neg_eigval``).
        scale: default ``K ** -0.5``.
        initial_state: fp32 ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``).
        output_final_state: return the fp32 final state.
        use_qk_l2norm_in_kernel: L2-normalize q and k (eps 1e-6).
        safe_gate, chunk_size (keyword, 32 or 64), use_graph, max_num_seqs, cu_seqlens_cpu:
            accepted and checked as FLA does; they choose FLA kernels and change nothing here.
        A_log (keyword): ``HV`` elements; dt_bias (keyword): ``HV * K`` elements. Used only with
            ``use_gate_in_kernel`` (as in FLA).
        return_intermediate_states: under ``torch.inference_mode()``: also return ``h``, the
            state at the start of every 64-token chunk of each sequence, ``[B, NT, HV, K, V]``
            in k's dtype (varlen: ``[1, sum of NT_n, ...]``). Needs ``chunk_size=64``; reads
            ``cu_seqlens`` on the host (as FLA does).

    Returns:
        ``(o, final_state)`` (``final_state`` None without ``output_final_state``), or
        ``(o, final_state, h)`` with ``return_intermediate_states``. ``o`` has q's dtype.

    Differentiable as FLA's when an input requires grad (grad mode on): gradients of q, k, v, g,
    beta, A_log, dt_bias and initial_state from the analytic backward of ``kda._autograd`` (the
    fp64 reference on CPU tensors, the CUDA backward on CUDA tensors).

    Not implemented (an error naming them when set): ``cp_context`` (context parallel),
    ``disable_recompute=True`` (a knob of FLA's backward), ``head_first=True``.

    Differences from FLA: the CUDA backend takes bf16/fp16 inputs with K = V = 128 (others raise
    NotImplementedError; the CPU backends take any K, V <= 256 and fp32); ``lower_bound`` must
    lie in ``[-5, 0)``; q and k are L2-normalized in fp32 (FLA rounds them to their dtype first);
    unknown keyword arguments raise TypeError.
    """
    torch = _torch()
    state_v_first = _state_v_first(state_v_first, kwargs)
    A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
    chunk_size = kwargs.pop("chunk_size", 64)
    _check_kwargs("chunk_kda", kwargs, ())
    _unsupported("cp_context", cp_context, None, "context parallel is not implemented")
    _unsupported("disable_recompute", disable_recompute, False,
                 "a memory knob of FLA's backward, not implemented here")
    flags = _flags(output_final_state=output_final_state,
                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                   use_gate_in_kernel=use_gate_in_kernel,
                   use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                   allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate,
                   return_intermediate_states=return_intermediate_states,
                   use_graph=use_graph)
    _check_scale(scale)
    B, T, H, K, HV, V, N = _qkv_dims(q, k, v, cu_seqlens, initial_state)
    q, k, v, initial_state = (_dense_rows(x) for x in (q, k, v, initial_state))
    if use_graph and cu_seqlens is not None and max_num_seqs is not None and N != max_num_seqs:
        raise ValueError(f"argument 'cu_seqlens': expected max_num_seqs + 1 = {max_num_seqs + 1}"
                         f" entries with use_graph (pad with empty sequences), got {N + 1}")
    if initial_state is not None and initial_state.dtype != torch.float32:
        raise ValueError(f"argument 'initial_state': expected dtype float32, "
                         f"got {initial_state.dtype}")
    if use_gate_in_kernel and A_log is None and lower_bound is None:
        raise ValueError("argument 'A_log': expected a tensor when use_gate_in_kernel=True and "
                         "lower_bound is not set, got None")
    if chunk_size not in (32, 64):
        raise ValueError(f"argument 'chunk_size': expected 32 or 64, got {chunk_size!r}")
    if safe_gate and use_gate_in_kernel and (lower_bound is None or not -5 <= lower_bound < 0):
        raise ValueError(f"argument 'lower_bound': expected a value in [-5, 0) with safe_gate "
                         f"and use_gate_in_kernel, got {lower_bound!r}")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("argument 'allow_neg_eigval': requires use_beta_sigmoid_in_kernel=True")
    if K > 256 or HV % H != 0:
        raise ValueError(f"argument 'v': expected K <= 256 and HV a multiple of H = {H}, "
                         f"got K = {K}, HV = {HV}")
    g = _token_input("g", g, q, (B, T, HV, K))
    beta = _token_input("beta", beta, q, (B, T, HV))
    options = dict(_gate(flags["use_gate_in_kernel"], A_log, dt_bias, lower_bound, HV, K, False),
                   **_beta(use_beta_sigmoid_in_kernel, allow_neg_eigval))
    layout = "v_first" if state_v_first else "k_first"
    final = None
    if output_final_state:
        shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        final = torch.empty(shape, dtype=torch.float32, device=q.device)

    ckpt, offsets = None, None
    if return_intermediate_states:
        if not torch.is_inference_mode_enabled():
            raise ValueError("argument 'return_intermediate_states': only allowed under "
                             "torch.inference_mode()")
        if chunk_size != 64:
            raise NotImplementedError("argument 'chunk_size': return_intermediate_states "
                                      f"needs 64, got {chunk_size}")
        starts = ([int(x) for x in (cu_seqlens_cpu if cu_seqlens_cpu is not None
                                    else cu_seqlens).tolist()]
                  if cu_seqlens is not None else [n * T for n in range(B + 1)])
        offsets = [0]
        for n in range(N):
            offsets.append(offsets[-1] + (starts[n + 1] - starts[n]) // 64)
        shape = (offsets[-1], HV, V, K) if state_v_first else (offsets[-1], HV, K, V)
        ckpt = torch.empty(shape, dtype=k.dtype, device=q.device)

    if ckpt is None and _needs_grad(q, k, v, g, beta, options["A_log"], options["dt_bias"],
                                    initial_state):
        # Differentiable through kda.prefill (kda._autograd; CPU tensors: CUDA tensors raise
        # NotImplementedError from backward()), which allocates the final state itself.
        o, ht = _call(prefill, q, k, v, g, beta, cu_seqlens=cu_seqlens, scale=scale,
                      use_qk_l2norm=use_qk_l2norm_in_kernel, initial_state=initial_state,
                      output_final_state=True, state_layout=layout, **options)
        return o, (ht if output_final_state else None)
    o = _call(prefill, q, k, v, g, beta, cu_seqlens=cu_seqlens, scale=scale,
              use_qk_l2norm=use_qk_l2norm_in_kernel, initial_state=initial_state,
              final_state=final, state_layout=layout, **options,
              checkpoint_every=64 if ckpt is not None else 0, checkpoints=ckpt,
              checkpoint_offsets=None if ckpt is None else torch.tensor(
                  offsets, dtype=torch.int64, device=q.device))
    if final is not None:
        o = o[0]
    if ckpt is not None:
        return o, final, _chunk_starts(ckpt, offsets, starts, initial_state, B, cu_seqlens)
    return o, final


def _chunk_starts(ckpt: Any, offsets: Any, starts: Any, h0: Any, B: int, cu: Any) -> Any:
    """FLA's ``h``: per sequence, its initial state then the checkpoints that start a chunk."""
    torch = _torch()
    rows = []
    for n in range(len(offsets) - 1):
        nt = -(-(starts[n + 1] - starts[n]) // 64)
        if nt == 0:
            continue
        first = (h0[n:n + 1].to(ckpt.dtype) if h0 is not None else
                 torch.zeros((1, *ckpt.shape[1:]), dtype=ckpt.dtype, device=ckpt.device))
        rows.append(torch.cat([first, ckpt[offsets[n]:offsets[n] + nt - 1]]))
    h = (torch.cat(rows) if rows
         else torch.empty((0, *ckpt.shape[1:]), dtype=ckpt.dtype, device=ckpt.device))
    return h.reshape(1, -1, *ckpt.shape[1:]) if cu is not None else h.reshape(
        B, -1, *ckpt.shape[1:])


# ---------------------------------------------------------------------------------------------
# fused_recurrent_kda / fused_recurrent_kda_fwd
# ---------------------------------------------------------------------------------------------

def _prefill_can_run(q: Any, K: int, V: int) -> bool:
    """Whether kda.prefill takes these shapes on q's device (CUDA: bf16/fp16, K = V = 128)."""
    torch = _torch()
    return not q.is_cuda or (K == 128 and V == 128 and q.dtype in (torch.bfloat16,
                                                                  torch.float16))


def _runs_on_decode(q: Any, v: Any, beta: Any, tokens: int, N: int, K: int, V: int) -> bool:
    """fused_recurrent_kda's kernel choice: decode (FLA's token-by-token recurrence) for short
    sequences and per-row beta; the chunked prefill (the same function, faster on long ones)
    where decode cannot take the head dims or the sequences are long."""
    if beta.ndim == v.ndim:
        return True  # beta [B, T, HV, V]: decode only
    if K != V or K % 32 != 0:
        return False
    long = tokens > _RECURRENT_MAX_TOKENS * max(N, 1)  # (on average per sequence)
    return not (long and _prefill_can_run(q, K, V))


def _recurrent_checks(q: Any, k: Any, v: Any, g: Any, beta: Any, cu_seqlens: Any,
                      initial_state: Any, scale: Any, A_log: Any, dt_bias: Any, lower_bound: Any,
                      l2norm: Any, gate_in_kernel: Any, beta_sigmoid: Any,
                      neg_eigval: Any) -> Tuple[Any, ...]:
    """Shapes and options of the recurrent entry points: (B, T, H, K, HV, V, N, q, k, v, g,
    beta, options)."""
    flags = _flags(use_qk_l2norm_in_kernel=l2norm, use_gate_in_kernel=gate_in_kernel,
                   use_beta_sigmoid_in_kernel=beta_sigmoid, allow_neg_eigval=neg_eigval)
    _check_scale(scale)
    B, T, H, K, HV, V, N = _qkv_dims(q, k, v, cu_seqlens, initial_state)
    q, k, v = (_dense_rows(x) for x in (q, k, v))
    g = _token_input("g", g, q, (B, T, HV, K))
    _check_tensor("beta", beta)
    beta = _token_input("beta", beta, q, (B, T, HV, V) if beta.ndim == 4 else (B, T, HV))
    options = dict(_gate(gate_in_kernel, A_log, dt_bias, lower_bound, HV, K, True),
                   **_beta(flags["use_beta_sigmoid_in_kernel"], flags["allow_neg_eigval"]),
                   scale=scale, use_qk_l2norm=flags["use_qk_l2norm_in_kernel"])
    if flags["use_gate_in_kernel"] and options["gate"] == "softplus" and A_log is None:
        # FLA's recurrent kernel reads a missing A_log as A_log = 1 (exp(A_log) = e).
        options["A_log"] = _torch().ones(HV, dtype=_torch().float32, device=q.device)
    return B, T, H, K, HV, V, N, q, k, v, g, beta, options


def fused_recurrent_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                        A_log: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
                        scale: Optional[float] = None, initial_state: Optional[Tensor] = None,
                        output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                        use_gate_in_kernel: bool = False,
                        use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
                        lower_bound: Optional[float] = None, state_v_first: bool = False,
                        cu_seqlens: Optional[Tensor] = None,
                        **kwargs: Any) -> Tuple[Tensor, Optional[Tensor]]:
    """FLA's ``fla.ops.kda.fused_recurrent_kda`` (fla-core 0.6.0).

    Args: as :func:`chunk_kda`, plus beta ``[B, T, HV, V]`` (one beta per value row) and any
    initial-state dtype; ``initial_state`` is never modified.

    Returns:
        ``(o, final_state)``: o in q's dtype; final_state fp32 ``[N, HV, K, V]`` (V-first with
        ``state_v_first``), or None without ``output_final_state``.

    Runs :func:`kda.decode` (the token-by-token recurrence, as FLA's kernel) for sequences of up
    to 64 tokens on average and for per-row beta, else :func:`kda.prefill` (the same function,
    chunked); prefill also takes head dims that decode cannot (K != V, K not a multiple of 32).

    Differences from FLA: as :func:`chunk_kda` (devices, dtypes, ``lower_bound`` range,
    unknown keyword arguments); no autograd (FLA's recurrent kernel has none either).
    With ``use_gate_in_kernel`` in the softplus form and no ``A_log``, FLA's kernel computes
    ``-e * softplus(g + dt_bias)`` (it reads a missing A_log as 1): so does this function.
    """
    torch = _torch()
    state_v_first = _state_v_first(state_v_first, kwargs)
    _check_kwargs("fused_recurrent_kda", kwargs, ())
    _flag("output_final_state", output_final_state)
    B, T, _H, K, HV, V, N, q, k, v, g, beta, options = _recurrent_checks(
        q, k, v, g, beta, cu_seqlens, initial_state, scale, A_log, dt_bias, lower_bound,
        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("argument 'allow_neg_eigval': requires use_beta_sigmoid_in_kernel=True")
    initial_state = _dense_rows(initial_state)  # read only
    layout = "v_first" if state_v_first else "k_first"
    shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    final = None
    if output_final_state:
        final = torch.empty(shape, dtype=torch.float32, device=q.device)

    if not _runs_on_decode(q, v, beta, B * T, N, K, V):
        if options["dt_bias"] is not None and options["dt_bias"].dtype != torch.float32:
            options["dt_bias"] = options["dt_bias"].float()
        o = _call(prefill, q, k, v, g, beta, cu_seqlens=cu_seqlens, initial_state=initial_state,
                  final_state=final, state_layout=layout, **options)
        return (o[0] if final is not None else o), final

    # decode: the state argument is a pool of N rows, slot n for sequence n.
    pool, use_init, store, final_arg = initial_state, initial_state is not None, False, None
    if final is not None:
        store = True
        if initial_state is None:
            pool = final  # start from zero, write the final state in place
        elif initial_state.dtype == torch.float32:
            final_arg = final
        else:  # read in fp32 (as FLA does): a widened copy, advanced in place
            pool = final.copy_(initial_state)
    elif pool is None:
        pool = torch.empty(shape, dtype=torch.float32, device=q.device)  # never read or written
    elif pool.dtype not in (torch.float32, torch.bfloat16):
        pool = pool.float()
    o = _call(decode, q, k, v, g, beta, pool, cu_seqlens=cu_seqlens, final_state=final_arg,
              use_initial_state=use_init, store_final_state=store, state_layout=layout,
              **options)
    return o, final


def fused_recurrent_kda_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                            A_log: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
                            initial_state: Optional[Tensor] = None,
                            scale: Optional[float] = None, output_final_state: bool = False,
                            inplace_final_state: bool = True, state_v_first: bool = False,
                            cu_seqlens: Optional[Tensor] = None,
                            ssm_state_indices: Optional[Tensor] = None,
                            num_accepted_tokens: Optional[Tensor] = None,
                            use_qk_l2norm_in_kernel: bool = False,
                            use_gate_in_kernel: bool = False,
                            use_beta_sigmoid_in_kernel: bool = False,
                            allow_neg_eigval: bool = False, lower_bound: Optional[float] = None,
                            out: Optional[Tensor] = None,
                            **kwargs: Any) -> Tuple[Tensor, Optional[Tensor]]:
    """FLA's ``fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd`` (fla-core 0.6.0), the entry
    of vLLM-style callers, on :func:`kda.decode`.

    Args: as :func:`fused_recurrent_kda`, plus:
        initial_state: the state pool ``[P, HV, K, V]`` (``[P, HV, V, K]`` with
            ``state_v_first``), fp32 or bf16; without ``ssm_state_indices`` sequence n uses
            row n.
        inplace_final_state: (default) write the new states into ``initial_state`` and return
            it as the final state; it must then be given.
        ssm_state_indices: ``[N]`` or ``[N, T]`` int32/int64 pool slots (continuous batching):
            sequence n reads slot ``ssm_state_indices[n, num_accepted_tokens[n] - 1]``
            (speculative decode) or ``ssm_state_indices[n, 0]``; with ``[N, T]`` indices the
            state after token t goes to slot ``ssm_state_indices[n, t]``, with ``[N]`` indices
            the state after the last token to ``ssm_state_indices[n]``. Empty sequences are
            skipped.
        output_final_state: without ``inplace_final_state``: return a new fp32 final state
            ``[N, HV, ...]`` (with ``ssm_state_indices``: row r holds the state after token r,
            as FLA writes it; the pool is then fp32 and must be given).
        out: preallocated output ``[B, T, HV, V]`` (q's dtype or fp32).

    Returns:
        ``(out, final_state)``: ``final_state`` is ``initial_state`` (in place), the new array,
        or None.

    Differences from FLA 0.6.0 (whose kernel has no bounds checks): a negative slot marks a
    padding row (zero output, no state read or written) and slots ``>= P`` are padding too,
    where FLA reads and writes outside the pool; with ``[N]`` indices and sequences of more than
    one token, FLA writes the state after token t to slot ``ssm_state_indices[n + t]`` (other
    sequences' entries) while this function writes only the final state, to
    ``ssm_state_indices[n]``; a bf16 pool is rounded after every token (FLA rounds what it
    stores, keeping fp32 between tokens: identical for one-token steps); without
    ``inplace_final_state`` and with indices, ``output_final_state=False`` raises ValueError
    (FLA's kernel would write through a null pointer). ``num_accepted_tokens`` needs ``[N, T]``
    indices (FLA ignores it without indices).
    """
    torch = _torch()
    state_v_first = _state_v_first(state_v_first, kwargs)
    _check_kwargs("fused_recurrent_kda_fwd", kwargs, ())
    _flags(output_final_state=output_final_state, inplace_final_state=inplace_final_state)
    for name, x in (("ssm_state_indices", ssm_state_indices),
                    ("num_accepted_tokens", num_accepted_tokens), ("out", out)):
        _check_tensor(name, x, required=False)
    # (the pool may have any number of rows: initial_state is not checked as one per sequence)
    B, T, _H, K, HV, V, N, q, k, v, g, beta, options = _recurrent_checks(
        q, k, v, g, beta, cu_seqlens, None, scale, A_log, dt_bias, lower_bound,
        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    _check_tensor("initial_state", initial_state, required=False)
    layout = "v_first" if state_v_first else "k_first"
    if inplace_final_state and initial_state is None:
        raise ValueError("argument 'initial_state': expected the state pool with "
                         "inplace_final_state=True, got None")
    if out is not None and tuple(out.shape) != tuple(v.shape):
        raise ValueError(f"argument 'out': expected shape {list(v.shape)} (as v), "
                         f"got {list(out.shape)}")
    common = dict(cu_seqlens=cu_seqlens, out=out, state_layout=layout, **options)

    if inplace_final_state:
        o = _call(decode, q, k, v, g, beta, initial_state, state_indices=ssm_state_indices,
                  num_accepted_tokens=num_accepted_tokens, **common)
        return o, initial_state

    shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    if ssm_state_indices is None:
        final = (torch.empty(shape, dtype=torch.float32, device=q.device)
                 if output_final_state else None)
        pool, final_arg = initial_state, final
        if pool is None:
            pool, final_arg = (final if final is not None else
                               torch.empty(shape, dtype=torch.float32, device=q.device)), None
        elif final is not None and pool.dtype != torch.float32:  # read in fp32, as FLA
            if int(pool.shape[0]) < N:
                raise ValueError(f"argument 'initial_state': expected at least {N} rows (one "
                                 f"per sequence), got {int(pool.shape[0])}")
            pool, final_arg = final.copy_(initial_state[:N]), None
        o = _call(decode, q, k, v, g, beta, pool, final_state=final_arg,
                  use_initial_state=initial_state is not None, store_final_state=final is not None,
                  num_accepted_tokens=num_accepted_tokens, **common)
        return o, final

    if not output_final_state:
        raise ValueError("argument 'output_final_state': expected True with ssm_state_indices "
                         "and inplace_final_state=False (the token states go to final_state)")
    if initial_state is None or initial_state.dtype != torch.float32:
        raise NotImplementedError("argument 'initial_state': with ssm_state_indices and "
                                  "inplace_final_state=False an fp32 pool is needed, got "
                                  f"{None if initial_state is None else initial_state.dtype}")
    tokens = B * T
    rows = (max(N, tokens), *shape[1:])
    buffer = torch.empty(rows, dtype=torch.float32, device=q.device)
    o = _call(decode, q, k, v, g, beta, initial_state, state_indices=ssm_state_indices,
              num_accepted_tokens=num_accepted_tokens, intermediate_states=buffer[:tokens],
              **common)
    return o, buffer[:N]

