"""Drop-in entry points with the call signatures of FlashKDA and MATE (spec section 7).

Each is a thin adapter over :func:`kda.prefill` / :func:`kda.decode`: same arguments, same
defaults, same return values, and the same error policy (TypeError / ValueError naming the
argument, in the caller's own argument names). Differences from the originals are listed in each
docstring.
"""

from typing import Any, Optional, Tuple, Union

from . import _arrays
from .api import NAMES, Array, caller_names, decode, prefill

__all__ = ["chunk_kda", "fwd", "gated_delta_rule_decode"]


def _dt_bias_2d(dt_bias: Any, q: Any, v: Any) -> Any:
    """Accepts dt_bias flattened to [HV * K] (as some FlashKDA callers keep it) as [HV, K]."""
    try:
        if dt_bias is not None and len(dt_bias.shape) == 1:
            hv, kk = int(v.shape[-2]), int(q.shape[-1])
            if int(dt_bias.shape[0]) == hv * kk:
                return dt_bias.reshape(hv, kk)
    except (AttributeError, TypeError, IndexError):
        pass
    return dt_bias


# ---------------------------------------------------------------------------------------------
# FlashKDA
# ---------------------------------------------------------------------------------------------

def fwd(q: Array, k: Array, v: Array, g: Array, beta: Array, scale: Optional[float], out: Array,
        A_log: Optional[Array], dt_bias: Optional[Array], lower_bound: float,
        initial_state: Optional[Array] = None, final_state: Optional[Array] = None,
        cu_seqlens: Optional[Array] = None) -> None:
    """FlashKDA's prefill entry (``flash_kda.fwd``): writes ``out`` and ``final_state`` in place.

    Fixed semantics: L2-normalized q/k, lower-bound gate
    ``a = lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``, beta given as logits
    (``b = sigmoid(beta)``), V-first states ``[N, H, V, K]``.

    Args:
        q, k: ``[B, T, H, K]`` bf16 (varlen: ``B = 1`` with ``cu_seqlens``).
        v: ``[B, T, H, V]``; g: ``[B, T, H, K]`` gate before activation; beta: ``[B, T, H]``
            logits.
        scale: q scale (None: ``K ** -0.5``).
        out: ``[B, T, H, V]`` output, written in place.
        A_log: ``[H]`` fp32; dt_bias: ``[H, K]`` (or flattened ``[H * K]``) fp32.
        lower_bound: in ``[-5, 0)``.
        initial_state: ``[N, H, V, K]`` fp32/bf16, optional (absent: zero).
        final_state: ``[N, H, V, K]``, optional, written in place.
        cu_seqlens: ``[N + 1]`` int32/int64, optional: varlen mode.

    Differences from FlashKDA: any backend of this package runs it (CPU arrays included, fp16/fp32
    accepted where the library takes them); grouped values (v with more heads than q) work; the
    workspace is allocated per call on CUDA (torch's caching allocator); ``lower_bound = 0`` is
    rejected (the contract is ``[-5, 0)``).
    """
    if NAMES.get() is not None:  # inside another caller's names: the API's own names here
        with caller_names({}):
            return fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state,
                       final_state, cu_seqlens)
    if not _arrays.is_array(out):
        raise TypeError("argument 'out': expected a preallocated array [B, T, H, V], got "
                        f"{type(out).__name__}")
    prefill(q, k, v, g, beta, A_log=A_log, dt_bias=_dt_bias_2d(dt_bias, q, v),
            cu_seqlens=cu_seqlens, scale=scale, use_qk_l2norm=True, gate="lower_bound",
            lower_bound=lower_bound, beta_logits=True, initial_state=initial_state,
            final_state=final_state, out=out, state_layout="v_first")
    return None


# ---------------------------------------------------------------------------------------------
# MATE
# ---------------------------------------------------------------------------------------------

_CHUNK_NAMES = {"out": "output", "use_qk_l2norm": "use_qk_l2norm_in_kernel"}


def chunk_kda(q: Array, k: Array, v: Array, g: Array, beta: Array,
              scale: Optional[float] = None, initial_state: Optional[Array] = None,
              output_final_state: bool = False, cu_seqlens: Optional[Array] = None,
              A_log: Optional[Array] = None, dt_bias: Optional[Array] = None,
              lower_bound: float = -5.0, use_qk_l2norm_in_kernel: bool = True,
              output: Optional[Array] = None,
              final_state: Optional[Array] = None) -> Union[Array, Tuple[Array, Array]]:
    """MATE's prefill entry (``mate.chunk_kda``).

    Args:
        q, k: ``[B, T, H, K]`` fp16/bf16, or varlen ``[S, H, K]`` / ``[1, S, H, K]`` with
            ``cu_seqlens``.
        v: ``[B, T, HV, V]`` (GVA: ``HV % H == 0``); g: ``[B, T, HV, K]``.
        beta: ``[B, T, HV]`` logits (``b = sigmoid(beta)``).
        scale: q scale (None: ``K ** -0.5``).
        initial_state: ``[N, HV, V, K]`` (V-first), q's dtype or fp32; absent: zero.
        output_final_state: return ``(output, final_state)``.
        cu_seqlens: ``[N + 1]`` int32/int64: varlen mode.
        A_log: ``[HV]`` fp32; dt_bias: ``[HV, K]`` fp32. With either of them the gate is applied
            in the kernel, ``a = lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``; without
            both, ``g`` is the log-space decay itself.
        lower_bound: in ``[-5, 0)`` (gate in kernel only).
        use_qk_l2norm_in_kernel: L2-normalize q and k.
        output: preallocated output (same shape as v, q's dtype).
        final_state: preallocated final state ``[N, HV, V, K]``; used only with
            ``output_final_state=True`` (as in MATE). When allocated here it has initial_state's
            dtype, else q's dtype (as in MATE).

    Returns:
        ``output``, or ``(output, final_state)`` with ``output_final_state``.

    Differences from MATE: ``A_log`` and ``dt_bias`` need not come together (a missing one means
    ``exp(A_log) = 1`` / ``dt_bias = 0``); head dims other than 128 are accepted where the library
    takes them; fp32 inputs work on CPU.

    Where MATE's documentation is silent (MATE's KDA source could not be consulted; these are
    the choices made): a precomputed ``g`` (neither A_log nor dt_bias) is the natural-log decay
    ``a_t`` (``exp(g)`` multiplies the state, as in FLA), not a base-2 log nor a linear
    multiplier; ``lower_bound`` must lie in ``[-5, 0)``; ``final_state`` given without
    ``output_final_state`` is left untouched.
    """
    with caller_names(_CHUNK_NAMES):
        if not isinstance(output_final_state, bool):
            raise TypeError("argument 'output_final_state': expected bool, got "
                            f"{type(output_final_state).__name__}")
        if not output_final_state:
            final_state = None
        elif final_state is None and hasattr(q, "dtype") and hasattr(v, "shape"):
            n = int(cu_seqlens.shape[0]) - 1 if cu_seqlens is not None else int(q.shape[0])
            if n >= 0 and len(v.shape) >= 2:
                dt = _arrays.dtype_name(initial_state if initial_state is not None else q)
                shape = (n, int(v.shape[-2]), int(v.shape[-1]), int(q.shape[-1]))
                final_state = _arrays.empty(q, shape, dt, "final_state")
        gated = A_log is not None or dt_bias is not None
        result = prefill(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens,
                         scale=scale, use_qk_l2norm=use_qk_l2norm_in_kernel,
                         gate="lower_bound" if gated else "precomputed", lower_bound=lower_bound,
                         beta_logits=True, initial_state=initial_state, final_state=final_state,
                         out=output, state_layout="v_first")
    return result


_DECODE_NAMES = {"g": "a", "beta": "b", "out": "output", "state_layout": "state_v_first",
                 "gate": "use_gate_in_kernel", "beta_logits": "apply_beta_sigmoid"}


def gated_delta_rule_decode(
        q: Array, k: Array, v: Array, state: Optional[Array], A_log: Optional[Array], a: Array,
        dt_bias: Optional[Array], num_accepted_tokens: Optional[Array],
        cu_seqlens: Optional[Array], b: Array, state_indices: Optional[Array] = None,
        scale: Optional[float] = None, output: Optional[Array] = None,
        use_qk_l2norm: Optional[bool] = None, lower_bound: Optional[float] = None,
        use_gate_in_kernel: Optional[bool] = None, use_lower_bound: Optional[bool] = None,
        apply_beta_sigmoid: Optional[bool] = None, allow_neg_eigval: Optional[bool] = None,
        use_initial_state: Optional[bool] = None, state_v_first: Optional[bool] = None,
        is_varlen: Optional[bool] = None, store_final_state: bool = False,
        inplace_final_state: bool = False,
        state_dtype: Optional[Any] = None) -> Tuple[Array, Optional[Array]]:
    """MATE's decode entry (``mate.gated_delta_rule_decode``).

    Args:
        q, k: ``[B, T, H, K]`` or ``[1, total_tokens, H, K]`` (varlen).
        v: ``[B, T, HV, V]``; ``K == V``.
        state: pool ``[P, HV, V, K]`` (V-first) or ``[P, HV, K, V]``, fp32/bf16; may be None when
            the state is neither read (``use_initial_state=False``) nor written in place.
        A_log: ``[HV]`` fp32 or None; dt_bias: ``[HV, K]`` fp32/bf16 or None.
        a: ``[B, T, HV, K]`` gate input; b: ``[B, T, HV]`` or ``[B, T, HV, V]`` beta.
        num_accepted_tokens: ``[B]`` (speculative decode, with ``[B, T]`` state_indices).
        cu_seqlens: ``[N + 1]`` (varlen, see ``is_varlen``).
        state_indices: ``[B]`` or ``[B, T]`` int32/int64 pool slots; negative = padding row.
        scale: q scale (None: ``K ** -0.5``).
        output: preallocated ``[B, T, HV, V]`` (q's dtype or fp32); allocated in q's dtype.
        use_qk_l2norm: None = on.
        lower_bound: for ``use_lower_bound``; None = -5.
        use_gate_in_kernel: None = on: ``a`` is the raw gate input, turned into the log decay by
            the softplus form ``-exp(A_log) * softplus(a + dt_bias)``, or with
            ``use_lower_bound`` by ``lower_bound * sigmoid(exp(A_log) * (a + dt_bias))``.
        use_lower_bound: None = off (softplus form).
        apply_beta_sigmoid: None = off (b used as given); on: ``b <- sigmoid(b)``.
        allow_neg_eigval: None = off; on (with ``apply_beta_sigmoid``): ``b <- 2 * sigmoid(b)``.
        use_initial_state: None = on; off: every row starts from zero.
        state_v_first: None = on (``[P, HV, V, K]``).
        is_varlen: None = ``cu_seqlens is not None``.
        store_final_state: return (and write) the final state. With ``state_indices`` the pool
            is advanced in place whatever this says (as MATE's code does); the flag then only
            chooses what is returned.
        inplace_final_state: return ``state`` itself (written in place, through the slots of
            ``state_indices`` when given); else a new ``[N, HV, ...]`` array (with
            ``state_indices``: a copy of the advanced slots, zero for padding rows).
        state_dtype: the state's dtype (checked against ``state``; the dtype of a state allocated
            here, default fp32).

    Returns:
        ``(output, final_state)``: ``final_state`` is ``state`` (in place), the new array, or
        None without ``store_final_state``.

    Differences from MATE: with ``use_gate_in_kernel=False``, ``a`` is the log-space decay
    (``a_t`` itself, natural log, as in FLA), where MATE takes it as a linear multiplier. A
    separate (not in place) final state with ``[B, T]`` state_indices raises
    NotImplementedError. When ``state`` is None, state_indices and num_accepted_tokens are not
    used (nothing is read or written through them, so negative indices do not mark padding rows
    there). Rows of padding sequences in a separately allocated final state are zero.

    Where MATE's documentation is silent (MATE's KDA source could not be consulted; these are
    the choices made): ``state_indices`` advance the pool whatever ``store_final_state`` says
    (the behaviour reported of MATE's code); ``use_lower_bound=True`` with ``lower_bound=None``
    uses -5 (the spec's default lower bound); slots outside ``[0, P)`` are padding rows (zero
    output, no state access); fp32 inputs run on the CPU backends.
    """
    names = _DECODE_NAMES
    with caller_names(names):
        def opt_bool(name: str, x: Any, default: bool) -> bool:
            if x is None:
                return default
            if not isinstance(x, bool):
                raise TypeError(f"argument '{name}': expected bool or None, got {type(x).__name__}")
            return x

        l2 = opt_bool("use_qk_l2norm", use_qk_l2norm, True)
        gate_in_kernel = opt_bool("use_gate_in_kernel", use_gate_in_kernel, True)
        use_lb = opt_bool("use_lower_bound", use_lower_bound, False)
        beta_sigmoid = opt_bool("apply_beta_sigmoid", apply_beta_sigmoid, False)
        neg = opt_bool("allow_neg_eigval", allow_neg_eigval, False)
        use_init = opt_bool("use_initial_state", use_initial_state, True)
        v_first = opt_bool("state_v_first", state_v_first, True)
        varlen = opt_bool("is_varlen", is_varlen, cu_seqlens is not None)
        store = opt_bool("store_final_state", store_final_state, False)
        inplace = opt_bool("inplace_final_state", inplace_final_state, False)
        if lower_bound is not None and (isinstance(lower_bound, bool)
                                        or not isinstance(lower_bound, (int, float))):
            raise TypeError("argument 'lower_bound': expected float or None, got "
                            f"{type(lower_bound).__name__}")

        if varlen and cu_seqlens is None:
            raise ValueError("argument 'cu_seqlens': expected a tensor [N + 1] when is_varlen is "
                             "True, got None")
        cu = cu_seqlens if varlen else None
        if not gate_in_kernel:
            gate = "precomputed"
        else:
            gate = "lower_bound" if use_lb else "softplus"
        layout = "v_first" if v_first else "k_first"

        sdt = None if state_dtype is None else _arrays.canonical_dtype(state_dtype, "state_dtype")
        if sdt is not None and sdt not in ("fp32", "bf16"):
            raise ValueError(f"argument 'state_dtype': expected float32 or bfloat16, "
                             f"got {state_dtype!r}")
        if state is not None and sdt is not None and _arrays.dtype_name(state) != sdt:
            raise ValueError(f"argument 'state_dtype': expected {_arrays.dtype_name(state)} "
                             f"(as state), got {state_dtype!r}")

        indices, accepted = state_indices, num_accepted_tokens
        if state is None:
            if use_init:
                raise ValueError("argument 'state': expected a state pool when use_initial_state "
                                 "is on, got None")
            if store and inplace:
                raise ValueError("argument 'state': expected a state pool when "
                                 "inplace_final_state is on, got None")
            # Neither read nor written: a scratch pool of one slot per sequence stands in.
            indices, accepted = None, None
            n = int(cu.shape[0]) - 1 if cu is not None else int(q.shape[0])
            kk, hv, vv = int(q.shape[-1]), int(v.shape[-2]), int(v.shape[-1])
            shape = (max(n, 0), hv, vv, kk) if v_first else (max(n, 0), hv, kk, vv)
            state = _arrays.empty(q, shape, sdt or "fp32", "state")

        pool_advanced = indices is not None  # MATE writes the pool through state_indices
        final = None
        if store and not inplace:
            if indices is not None and len(getattr(indices, "shape", ())) == 2:
                raise NotImplementedError(
                    "argument 'inplace_final_state': a separate final state with [B, T] "
                    "state_indices is not supported; pass inplace_final_state=True (the states "
                    "go to the slots of state_indices)")
            n = int(cu.shape[0]) - 1 if cu is not None else int(q.shape[0])
            if n >= 0 and not pool_advanced:
                shape = (n, *tuple(int(s) for s in state.shape[1:]))
                final = _arrays.empty(q, shape, _arrays.dtype_name(state), "final_state",
                                      zero=True)
            elif pool_advanced and _arrays.library(state) not in ("torch", "numpy"):
                raise NotImplementedError(
                    "argument 'inplace_final_state': a separate final state with state_indices "
                    "takes torch or numpy arrays; pass inplace_final_state=True")

        out = decode(q, k, v, a, b, state, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu,
                     state_indices=indices, num_accepted_tokens=accepted, final_state=final,
                     use_initial_state=use_init, store_final_state=store or pool_advanced,
                     out=output, scale=scale, use_qk_l2norm=l2, gate=gate,
                     lower_bound=-5.0 if lower_bound is None else float(lower_bound),
                     beta_logits=beta_sigmoid, allow_neg_eigval=neg, state_layout=layout)
    if not store:
        return out, None
    if not inplace and pool_advanced:
        final = _slots_copy(state, indices)
    return out, (state if inplace else final)


def _slots_copy(state: Any, indices: Any) -> Any:
    """``state[indices[n]]`` for every row n, zero where the slot is outside ``[0, P)``
    (torch or numpy arrays; no host synchronization for torch)."""
    P = int(state.shape[0])
    if _arrays.library(state) == "torch":
        import torch
        idx = indices.to(device=state.device, dtype=torch.int64)
        if P == 0:
            return torch.zeros((idx.shape[0], *state.shape[1:]), dtype=state.dtype,
                               device=state.device)
        rows = state.index_select(0, idx.clamp(0, P - 1))
        valid = ((idx >= 0) & (idx < P)).view(-1, *([1] * (state.ndim - 1)))
        return torch.where(valid, rows, torch.zeros((), dtype=state.dtype, device=state.device))
    import numpy as np
    idx = np.asarray(indices).astype(np.int64)
    if P == 0:
        return np.zeros((idx.shape[0], *state.shape[1:]), dtype=state.dtype)
    valid = ((idx >= 0) & (idx < P)).reshape(-1, *([1] * (state.ndim - 1)))
    return np.where(valid, np.take(state, np.clip(idx, 0, P - 1), axis=0),
                    np.zeros((), dtype=state.dtype))
