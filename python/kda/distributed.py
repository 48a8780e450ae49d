"""Context-parallel prefill over ``torch.distributed`` (spec section 9).

:func:`prefill` splits the token axis across the ranks of a process group: rank r holds a
contiguous slice of the tokens, and the slices in rank order form the whole input. The result on
each rank equals the one-process :func:`kda.prefill` of the whole input, for the rank's slice.

The state map over a token range is affine, ``S_end = M S_start + S_local`` (K-first states; with
V-first states, stored transposed, ``S_end = S_start M^T + S_local``). Each rank computes its
pieces' ``(M, S_local)`` with two :func:`kda.prefill` calls, the ranks exchange them
(``all_gather``), every rank scans them in rank order to get its pieces' true start states, and a
third :func:`kda.prefill` call gives the outputs (and the checkpoints in the rank's slice). Works
on CPU tensors with gloo and on CUDA tensors with NCCL (the same code).
"""

import copy
import inspect
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from . import _C, api

_PREFILL = inspect.signature(api.prefill)


def _validate(q: Any, k: Any, v: Any, g: Any, beta: Any, **arguments: Any) -> None:
    """kda.prefill's validation of one call (the extension's rules, its messages): raises what
    kda.prefill would raise; runs and writes nothing."""
    api._torch_module()  # torch tensors registered with the extension
    bound = _PREFILL.bind(q, k, v, g, beta, **arguments)
    bound.apply_defaults()
    a = dict(bound.arguments, stream=0, allocate=None, names=None)
    _C.read_prefill(*[a[name] for name in _C.prefill_arguments])


class _Pieces:
    """Where a rank's tokens [start, end) fall in each sequence: piece n begins `offset[n]` tokens
    into sequence n and has `length[n]` tokens (host integers)."""

    def __init__(self, starts: Sequence[int], dense: bool, start: int, end: int) -> None:
        n = len(starts) - 1
        if dense:  # every row one sequence of starts[1] tokens, split at the same tokens
            self.offset, self.length = [start] * n, [end - start] * n
        else:
            self.offset = [min(max(start - starts[i], 0), starts[i + 1] - starts[i])
                           for i in range(n)]
            self.length = [max(min(starts[i + 1], end) - max(starts[i], start), 0)
                           for i in range(n)]

    def rows(self, goff: Sequence[int], every: int) -> List[range]:
        """Per sequence, the checkpoint rows whose positions fall in the piece (clipped at the
        next sequence's first row, as kda.prefill clips them)."""
        return [range(min(goff[i] + o // every, goff[i + 1]),
                      min(goff[i] + (o + n) // every, goff[i + 1]))
                for i, (o, n) in enumerate(zip(self.offset, self.length))]

    def checkpoint_offsets(self, goff: Sequence[int], every: int) -> List[int]:
        """checkpoint_offsets [N + 1] of a kda.prefill over the pieces that writes each piece's
        checkpoints to its rows of the global checkpoints (pieces that begin inside a sequence
        must begin on a checkpoint boundary)."""
        rows = self.rows(goff, every)
        return [r.start for r in rows] + [rows[-1].stop if rows else goff[0]]


def _host_layout(cu_seqlens: Any, N: int, total: int, every: int,
                 checkpoints: Any, checkpoint_offsets: Any) -> Tuple[List[int], List[int]]:
    """(global sequence starts, global checkpoint offsets) on the host; the offsets checked as
    kda.prefill checks them."""
    if cu_seqlens is not None:
        starts = [int(x) for x in cu_seqlens.tolist()]
    else:
        starts = [i * total for i in range(N + 1)]
    if checkpoint_offsets is None:
        return starts, list(_C.checkpoint_offsets(starts, every))
    if (not isinstance(checkpoint_offsets, torch.Tensor) or checkpoint_offsets.dim() != 1
            or checkpoint_offsets.shape[0] != N + 1
            or checkpoint_offsets.dtype not in (torch.int32, torch.int64)):
        got = (f"{tuple(checkpoint_offsets.shape)} {checkpoint_offsets.dtype}"
               if isinstance(checkpoint_offsets, torch.Tensor)
               else type(checkpoint_offsets).__name__)
        raise ValueError(f"argument 'checkpoint_offsets': expected an int32/int64 tensor "
                         f"[{N + 1}], got {got}")
    goff = [int(x) for x in checkpoint_offsets.tolist()]
    rows = (checkpoints.shape[0] if isinstance(checkpoints, torch.Tensor) and checkpoints.dim()
            else 0)
    for i, x in enumerate(goff):
        if x < 0 or x > rows or (i > 0 and x < goff[i - 1]):
            raise ValueError(f"argument 'checkpoint_offsets': expected non-decreasing values in "
                             f"[0, {rows}], got checkpoint_offsets[{i}] = {x}")
    return starts, goff


def _check_slots(state_indices: Any, P: int) -> None:
    """check_indices of a pool call, on the host: kda.prefill's rules (a slot >= P, or two
    sequences with one slot in [0, P), is an error naming them)."""
    seen = {}
    for n, slot in enumerate(int(x) for x in state_indices.tolist()):
        if slot >= P:
            raise ValueError(f"argument 'state_indices': expected slots < P = {P} (or negative: "
                             f"no pooled state), got slot {slot} for sequence {n}")
        if slot >= 0 and slot in seen:
            raise ValueError("argument 'state_indices': expected no slot shared by two live "
                             "sequences when one of them writes it, got slot "
                             f"{slot} for sequences {seen[slot]} and {n}")
        seen[slot] = n


def _head(pieces: _Pieces, every: int) -> Tuple[int, List[int]]:
    """(h, sequences): the tokens before the slice's first checkpoint boundary when its first
    piece begins inside a sequence off a boundary (0 otherwise), and the sequences they belong to
    (one varlen sequence, or every dense row)."""
    seqs = [i for i, (o, n) in enumerate(zip(pieces.offset, pieces.length))
            if n > 0 and o % every != 0]
    if not seqs:
        return 0, []
    o, n = pieces.offset[seqs[0]], pieces.length[seqs[0]]
    return min(every - o % every, n), seqs


def prefill(q: Any, k: Any, v: Any, g: Any, beta: Any, *, group: Any = None,
            cu_seqlens: Optional[Any] = None, initial_state: Optional[Any] = None,
            output_final_state: bool = False, final_state: Optional[Any] = None,
            state_pool: Optional[Any] = None, state_indices: Optional[Any] = None,
            checkpoint_every: int = 0, checkpoints: Optional[Any] = None,
            checkpoint_offsets: Optional[Any] = None, gather_checkpoints: bool = False,
            out: Optional[Any] = None, **options: Any) -> Union[Any, Tuple[Any, Any]]:
    """:func:`kda.prefill` of a token axis split across the ranks of ``group``.

    Every rank of ``group`` calls this collectively, with its own slice of the tokens and the same
    global arguments (cu_seqlens, states, pool, checkpoint layout, options).

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
        final_state: preallocated ``[N, HV, ...]`` (implies ``output_final_state``): every rank
            writes every row, as ``output_final_state`` returns them.
        state_pool, state_indices: pool mode, the same pool contents and indices on every rank:
            sequence n starts from ``state_pool[state_indices[n]]`` (zero for a slot outside
            ``[0, P)``). Only the rank that holds a sequence's last token writes its final state to
            the slot; the other ranks leave their pools untouched (bit for bit), and so does every
            rank for a sequence without tokens (its state is unchanged). ``check_indices`` (in
            ``options``) checks the slots on every rank. Writing the slots picks the sequences this
            rank owns on the host (a device-to-host copy for CUDA tensors).
        checkpoint_every, checkpoints, checkpoint_offsets: as in :func:`kda.prefill`, with the
            GLOBAL layout: ``checkpoints`` is the one-process call's ``[num_checkpoints, HV, ...]``
            and ``checkpoint_offsets`` its ``[N + 1]`` (absent: computed from cu_seqlens, or N
            sequences of the total length). Checkpoint j of sequence n is the state after
            ``(j + 1) * checkpoint_every`` tokens of the sequence; the rank that holds that token
            writes row ``checkpoint_offsets[n] + j``. Rows other ranks own are left untouched,
            unless ``gather_checkpoints``. The checkpoint layout is read on the host (a
            device-to-host copy of the slice lengths, cu_seqlens and checkpoint_offsets for CUDA
            tensors).
        gather_checkpoints: also fill the rows that other ranks own (one ``all_gather`` of every
            rank's rows, padded to the largest count), so that every rank holds all checkpoints.
        out: preallocated output for this rank's slice ``[B, T_r, HV, V]``.
        options: :func:`kda.prefill`'s other keyword arguments (``gate``, ``A_log``, ``dt_bias``,
            ``beta_logits``, ``allow_neg_eigval``, ``lower_bound``, ``scale``, ``use_qk_l2norm``,
            ``state_layout``, ``check_indices``, ``backend``, ``workspace``, ``num_threads``),
            passed through.

    Returns:
        ``out`` (this rank's slice), or ``(out, final_state)`` with ``output_final_state`` or
        ``final_state``.

    Method (exact up to rounding): for each piece of a sequence on a rank, ``S_local`` is the final
    state of the piece's prefill from a zero state, and ``M`` the final state of the piece's prefill
    with ``v`` replaced by zeros (value dimension K) from the identity state: ``M`` itself in the
    K-first layout, ``M^T`` as stored in the V-first layout. The scan over ranks runs in fp64; the
    start states enter the last prefill as fp32 initial states. Three prefill passes over the
    slice, one ``all_gather`` of lengths and two of states (``N * HV * (K + V) * K`` floats per
    rank); the gather of ``S_local`` overlaps the ``M`` pass. With checkpoints, a slice whose first
    piece begins inside a sequence off a checkpoint boundary runs its last pass in two calls: the
    tokens up to the boundary (their final state is the boundary's checkpoint), then the rest from
    that state, so that the rest's checkpoints fall on kda.prefill's own.

    Every rank validates the whole call (kda.prefill's rules, on its slice) after the exchange of
    lengths and before any other exchange; nothing is written when validation fails. An argument
    that is wrong on some ranks only (a slice's shape) raises there and leaves the other ranks
    waiting in the collective, as any collective does.

    Raises:
        TypeError: q is not a torch tensor, or an unknown option.
        ValueError: a bad shape (named), cu_seqlens not covering the ranks' tokens (CPU
            cu_seqlens only: checking needs its values on the host), or kda.prefill's errors.
    """
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"argument 'q': expected a torch tensor, got {type(q).__name__}")
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
    pool = state_pool is not None or state_indices is not None
    if output_final_state and pool:
        raise ValueError("argument 'output_final_state': expected False in pool mode (state_pool "
                         "is updated in place through state_indices)")
    every = api._check_int("checkpoint_every", checkpoint_every)
    if gather_checkpoints and every <= 0:
        raise ValueError("argument 'gather_checkpoints': expected False without checkpoints "
                         f"(checkpoint_every = {every})")
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

    # Checkpoints: the global layout on the host, this slice's pieces and their rows.
    h, head_seqs, rank_pieces, goff = 0, [], [], []
    ckpt_offsets = None
    if every > 0:
        ends_h = [int(x) for x in ends.tolist()]
        starts, goff = _host_layout(cu_seqlens, N, ends_h[-1], every, checkpoints,
                                    checkpoint_offsets)
        rank_pieces = [_Pieces(starts, not varlen, b, e)
                       for b, e in zip([0, *ends_h[:-1]], ends_h)]
        mine = rank_pieces[rank]
        ckpt_offsets = torch.tensor(mine.checkpoint_offsets(goff, every), dtype=torch.int64,
                                    device=device)
        h, head_seqs = _head(mine, every)
    if out is None:
        out = torch.empty(tuple(v.shape), dtype=q.dtype, device=device)
    _validate(q, k, v, g, beta, cu_seqlens=local_cu, out=out, initial_state=initial_state,
              final_state=final_state, state_pool=state_pool, state_indices=state_indices,
              checkpoint_every=every, checkpoints=checkpoints, checkpoint_offsets=ckpt_offsets,
              **options)
    if pool and options.pop("check_indices", False):  # kda.validate leaves the values to the run
        _check_slots(state_indices, state_pool.shape[0])
    options.pop("check_indices", None)
    if pool:
        P = state_pool.shape[0]
        slots = state_indices.to(device=device, dtype=torch.int64)
        valid = (slots >= 0) & (slots < P)
        h0 = torch.zeros(shape, dtype=torch.float64, device=device)
        if P > 0:
            read = state_pool.index_select(0, slots.clamp(0, P - 1)).to(torch.float64)
            h0 = torch.where(valid.view(N, 1, 1, 1), read, h0)
    else:
        h0 = (torch.zeros(shape, dtype=torch.float64, device=device) if initial_state is None
              else initial_state.to(torch.float64))

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

    hs = h0
    own_start = hs
    for j in range(world):
        if j == rank:
            own_start = hs
        m, s = m_all[j].to(torch.float64), s_all[j].to(torch.float64)
        hs = (hs @ m if layout == "v_first" else m @ hs) + s

    # The outputs from the true start states, in two calls when the slice begins off a
    # checkpoint boundary inside a sequence (the head's final state is that boundary's state).
    states = own_start.to(torch.float32)
    inputs = [q, k, v, g, beta]
    token_dim = [-3, -3, -3, -3, -2]
    tail_cu = local_cu
    if h > 0:
        head_cu = None if local_cu is None else torch.clamp(local_cu, max=h)
        tail_cu = None if local_cu is None else torch.clamp(local_cu - h, min=0)
        _, states = api.prefill(*[x.narrow(d, 0, h) for x, d in zip(inputs, token_dim)],
                                cu_seqlens=head_cu, initial_state=states,
                                output_final_state=True, out=out.narrow(-3, 0, h), **options)
        boundary = [(n, goff[n] + (mine.offset[n] + h) // every - 1) for n in head_seqs
                    if (mine.offset[n] + h) % every == 0]
        boundary = [(n, r) for n, r in boundary if r < goff[n + 1]]
        if boundary:
            seqs = torch.tensor([n for n, _ in boundary], dtype=torch.int64, device=device)
            rows = torch.tensor([r for _, r in boundary], dtype=torch.int64, device=device)
            checkpoints.index_copy_(0, rows, states.index_select(0, seqs).to(checkpoints.dtype))
        tail = copy.deepcopy(mine)
        for n in head_seqs:
            tail.offset[n] += h
            tail.length[n] -= h
        ckpt_offsets = torch.tensor(tail.checkpoint_offsets(goff, every), dtype=torch.int64,
                                    device=device)
        inputs = [x.narrow(d, h, T_r - h) for x, d in zip(inputs, token_dim)]
    checkpointing = (dict(checkpoint_every=every, checkpoints=checkpoints,
                          checkpoint_offsets=ckpt_offsets) if every > 0 else {})
    _, last = api.prefill(*inputs, cu_seqlens=tail_cu, initial_state=states,
                          output_final_state=True, out=out.narrow(-3, h, T_r - h),
                          **checkpointing, **options)
    if gather_checkpoints:
        _gather_checkpoints(checkpoints, rank_pieces, goff, every, rank, group)

    # The rank holding a sequence's last token keeps its own final state.
    owns = (seq_end > seq_begin) & (seq_end > start) & (seq_end <= end)
    final = torch.where(owns.view(N, 1, 1, 1), last, hs.to(last.dtype))
    if pool:
        write = torch.nonzero(owns & valid).flatten()
        state_pool.index_copy_(0, slots.index_select(0, write),
                               last.index_select(0, write).to(state_pool.dtype))
        return out
    if final_state is not None:
        final_state.copy_(final)
        return out, final_state
    if not output_final_state:
        return out
    if initial_state is not None and initial_state.dtype != final.dtype:
        final = final.to(initial_state.dtype)
    return out, final


def _gather_checkpoints(checkpoints: Any, pieces: List[_Pieces], goff: Sequence[int],
                        every: int, rank: int, group: Any) -> None:
    """Every rank's checkpoint rows to every rank: one all_gather, padded to the largest count."""
    rows = [[r for span in p.rows(goff, every) for r in span] for p in pieces]
    width = max(len(r) for r in rows)
    if width == 0:
        return
    device = checkpoints.device
    mine = torch.zeros((width, *checkpoints.shape[1:]), dtype=checkpoints.dtype, device=device)
    if rows[rank]:
        index = torch.tensor(rows[rank], dtype=torch.int64, device=device)
        mine[:len(rows[rank])] = checkpoints.index_select(0, index)
    gathered = [torch.empty_like(mine) for _ in pieces]
    dist.all_gather(gathered, mine, group=group)
    for j, (r, buf) in enumerate(zip(rows, gathered)):
        if j != rank and r:
            index = torch.tensor(r, dtype=torch.int64, device=device)
            checkpoints.index_copy_(0, index, buf[:len(r)])


__all__ = ["prefill"]
