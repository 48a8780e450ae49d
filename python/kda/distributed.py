"""Context-parallel prefill over ``torch.distributed`` (spec section 9).

:func:`prefill` splits the token axis across the ranks of a process group: rank r holds a
contiguous slice of the tokens, and the slices in rank order form the whole input. The result on
each rank equals the one-process :func:`kda.prefill` of the whole input, for the rank's slice.

The state map over a token range is affine, ``S_end = M S_start + S_local`` (K-first states; with
V-first states, stored transposed, ``S_end = S_start M^T + S_local``). Each rank computes its
pieces' ``(M, S_local)`` with two :func:`kda.prefill` calls, the ranks exchange them
(``all_gather``), every rank scans them in rank order to get its pieces' true start states, and a
third :func:`kda.prefill` call gives the outputs. Works on CPU tensors with gloo and on CUDA tensors
with NCCL (the same code).
"""

from typing import Any, Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import api

_UNSUPPORTED = ("final_state", "state_pool", "state_indices", "checkpoints",
                "checkpoint_offsets")


def prefill(q: Any, k: Any, v: Any, g: Any, beta: Any, *, group: Any = None,
            cu_seqlens: Optional[Any] = None, initial_state: Optional[Any] = None,
            output_final_state: bool = False, **options: Any) -> Union[Any, Tuple[Any, Any]]:
    """:func:`kda.prefill` of a token axis split across the ranks of ``group``.

    Every rank of ``group`` calls this collectively, with its own slice of the tokens.

    Args:
        q, k, v, g, beta: torch tensors, this rank's contiguous slice of the token axis, as
            :func:`kda.prefill` takes them: dense ``[B, T_r, ...]`` (each batch row one sequence,
            every row split at the same tokens; ``B = 1``: one sequence) or varlen ``[1, T_r, ...]``
            / ``[T_r, ...]`` packed. ``T_r`` may differ between ranks and may be 0. The slices in
            rank order form the whole input.
        group: the ``torch.distributed`` process group (None: the default group). Tensors on the
            CPU need a backend that runs CPU collectives (gloo), CUDA tensors one that runs CUDA
            collectives (NCCL).
        cu_seqlens: varlen mode: the GLOBAL ``[N + 1]`` sequence starts over the concatenated
            tokens of all ranks, the same on every rank. A sequence may span ranks; each rank
            learns its token offset from an ``all_gather`` of the slice lengths.
        initial_state: global ``[N, HV, V, K]`` (V-first) or ``[N, HV, K, V]`` (K-first), the same
            on every rank; absent: zero.
        output_final_state: also return the final states, ``[N, HV, ...]`` on every rank (fp32, or
            initial_state's dtype). A sequence's row on the rank that holds its last token is that
            rank's own prefill result; the other rows (and every row of a sequence without tokens)
            are the scan's composition of all ranks' ``(M, S_local)``: the same value within
            rounding.
        options: :func:`kda.prefill`'s other keyword arguments (``gate``, ``A_log``, ``dt_bias``,
            ``beta_logits``, ``allow_neg_eigval``, ``lower_bound``, ``scale``, ``use_qk_l2norm``,
            ``state_layout``, ``out``, ``backend``, ``workspace``, ``num_threads``), passed through.
            Not implemented (NotImplementedError): ``checkpoint_every`` other than 0 and the
            checkpoint arguments, ``final_state``, ``state_pool`` / ``state_indices``.

    Returns:
        ``out`` (this rank's slice), or ``(out, final_state)`` with ``output_final_state``.

    Method (exact up to rounding): for each piece of a sequence on a rank, ``S_local`` is the final
    state of the piece's prefill from a zero state, and ``M`` the final state of the piece's prefill
    with ``v`` replaced by zeros (value dimension K) from the identity state: ``M`` itself in the
    K-first layout, ``M^T`` as stored in the V-first layout. The scan over ranks runs in fp64; the
    start states enter the last prefill as fp32 initial states. Three prefill passes over the
    slice, one ``all_gather`` of lengths and two of states (``N * HV * (K + V) * K`` floats per
    rank); the gather of ``S_local`` overlaps the ``M`` pass.

    Every rank validates the same things before the first exchange; an argument that is wrong on
    some ranks only (a slice's shape) raises there and leaves the other ranks waiting in the
    collective, as any collective does.

    Raises:
        TypeError: q is not a torch tensor.
        ValueError: a bad shape (named), cu_seqlens not covering the ranks' tokens (CPU
            cu_seqlens only: checking needs its values on the host), or kda.prefill's errors.
        NotImplementedError: an argument listed above as not implemented.
    """
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"argument 'q': expected a torch tensor, got {type(q).__name__}")
    if options.get("checkpoint_every", 0) not in (0, None):
        raise NotImplementedError("argument 'checkpoint_every': checkpoints are not implemented "
                                  "by kda.distributed.prefill (pass 0)")
    for name in _UNSUPPORTED:
        if options.get(name) is not None:
            what = ("checkpoints across ranks (checkpoint_every) are" if "checkpoint" in name
                    else "it is")
            raise NotImplementedError(f"argument '{name}': {what} not implemented by "
                                      "kda.distributed.prefill")
    options.pop("checkpoint_every", None)
    for name in _UNSUPPORTED:
        options.pop(name, None)
    out = options.pop("out", None)
    layout = options.get("state_layout", "v_first")
    if layout not in ("v_first", "k_first"):
        raise ValueError(f"argument 'state_layout': expected 'v_first' or 'k_first', got "
                         f"{layout!r}")
    varlen = cu_seqlens is not None
    if q.dim() != 4 and not (varlen and q.dim() == 3):
        raise ValueError(f"argument 'q': expected [B, T, H, K]{' or [T, H, K]' if varlen else ''}"
                         f", got shape {tuple(q.shape)}")
    if not isinstance(v, torch.Tensor) or v.dim() != q.dim():
        raise ValueError(f"argument 'v': expected a torch tensor of rank {q.dim()}")
    device = q.device
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    T_r = q.shape[-3]
    K, HV, V = q.shape[-1], v.shape[-2], v.shape[-1]

    lengths = [torch.empty(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([T_r], dtype=torch.int64, device=device), group=group)
    ends = torch.cumsum(torch.cat(lengths), 0)  # [world]: each rank's end token
    end = ends[rank]
    start = end - T_r
    total = ends[-1]

    if varlen:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1:
            raise ValueError("argument 'cu_seqlens': expected a 1-D torch tensor")
        N = cu_seqlens.shape[0] - 1
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        if cu_seqlens.device.type == "cpu" and N >= 0 and int(cu[-1]) != int(total):
            raise ValueError(f"argument 'cu_seqlens': its last value {int(cu[-1])} is not the "
                             f"number of tokens over all ranks ({int(total)})")
        local_cu = torch.minimum(torch.clamp(cu - start, min=0), end - start)
        local_cu = local_cu.to(cu_seqlens.dtype)
        seq_begin, seq_end = cu[:-1], cu[1:]
    else:
        N = q.shape[0]
        local_cu = None
        seq_begin = torch.zeros(N, dtype=torch.int64, device=device)
        seq_end = total.expand(N)
    shape = (N, HV, V, K) if layout == "v_first" else (N, HV, K, V)
    if initial_state is not None and (not isinstance(initial_state, torch.Tensor)
                                      or tuple(initial_state.shape) != shape):
        got = (tuple(initial_state.shape) if isinstance(initial_state, torch.Tensor)
               else type(initial_state).__name__)
        raise ValueError(f"argument 'initial_state': expected a torch tensor of shape {shape}, "
                         f"got {got}")

    # S_local: from a zero state. Its gather overlaps the M pass.
    _, s_local = api.prefill(q, k, v, g, beta, cu_seqlens=local_cu, output_final_state=True,
                             **options)
    s_all = [torch.empty_like(s_local) for _ in range(world)]
    s_work = dist.all_gather(s_all, s_local.contiguous(), group=group, async_op=True)
    # M: v = 0 with value dimension K, from the identity state.
    v0 = torch.zeros((*v.shape[:-1], K), dtype=v.dtype, device=device)
    eye = torch.eye(K, dtype=torch.float32, device=device).expand(N, HV, K, K).contiguous()
    _, m_local = api.prefill(q, k, v0, g, beta, cu_seqlens=local_cu, initial_state=eye,
                             output_final_state=True, **options)
    m_all = [torch.empty_like(m_local) for _ in range(world)]
    dist.all_gather(m_all, m_local, group=group)
    s_work.wait()

    h = (torch.zeros(shape, dtype=torch.float64, device=device) if initial_state is None
         else initial_state.to(torch.float64))
    own_start = h
    for j in range(world):
        if j == rank:
            own_start = h
        m, s = m_all[j].to(torch.float64), s_all[j].to(torch.float64)
        h = (h @ m if layout == "v_first" else m @ h) + s

    result = api.prefill(q, k, v, g, beta, cu_seqlens=local_cu,
                         initial_state=own_start.to(torch.float32),
                         output_final_state=output_final_state, out=out, **options)
    if not output_final_state:
        return result
    out, final = result
    # The rank holding a sequence's last token keeps its own final state.
    owns = (seq_end > seq_begin) & (seq_end > start) & (seq_end <= end)
    final = torch.where(owns.view(N, 1, 1, 1), final, h.to(final.dtype))
    if initial_state is not None and initial_state.dtype != final.dtype:
        final = final.to(initial_state.dtype)
    return out, final


__all__ = ["prefill"]
