"""kda.distributed.prefill on CPU with gloo: 2 and 4 processes against the one-process prefill.

Each spawned rank builds the whole input from a seed, runs the one-process kda.prefill of it, and
compares its own slice of the outputs (and every row of the final state) with the distributed
call's result.
"""

import subprocess
import sys

import pytest

from kdatest import SENTINEL, assert_close, kda, make_prefill, random_state, split

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
mp = pytest.importorskip("torch.multiprocessing")

H, HV, K, V = 2, 4, 32, 32  # GVA: HV = 2H

# name, token counts per rank, sequence lengths (None: dense), gate, initial state, state layout,
# form ("": fp32 [1, T, ...]; "rank3": varlen [T, ...]; "bf16": bf16 inputs and initial state;
# "B3": dense, three sequences of the same length split at the same tokens), then the state
# arguments (see _run_case). Checkpoint cases put rank cuts on and off checkpoint boundaries, with
# the slice before the first boundary longer and shorter than the rank's first piece.
CASES = {
    2: [
        ("dense uneven", [37, 113], None, "softplus", True, "v_first"),
        ("dense precomputed k_first", [90, 60], None, "precomputed", False, "k_first"),
        ("varlen spanning", [61, 139], [20, 70, 0, 45, 65], "lower_bound", True, "v_first"),
        ("varlen empty slice", [0, 150], [50, 100], "softplus", False, "k_first", "rank3"),
        ("dense bf16", [70, 58], None, "softplus", True, "v_first", "bf16"),
        ("checkpoints dense off a boundary", [37, 113], None, "softplus", True, "v_first", "",
         dict(every=64)),
        ("checkpoints dense on a boundary", [64, 136], None, "precomputed", False, "k_first", "",
         dict(every=64, gather=True)),
        ("checkpoints varlen spanning", [150, 140], [70, 150, 0, 70], "lower_bound", True,
         "v_first", "", dict(every=64, gather=True, explicit=True)),
        ("checkpoints bf16 every 128", [70, 200], [270], "softplus", True, "v_first", "bf16",
         dict(every=128)),
        ("final_state", [37, 113], None, "softplus", True, "k_first", "", dict(states="final")),
        ("pool varlen", [61, 139], [20, 70, 0, 45, 65], "lower_bound", False, "k_first", "",
         dict(states="pool")),
        ("pool checkpoints", [100, 190], [70, 150, 0, 70], "softplus", False, "v_first", "rank3",
         dict(states="pool", every=64, gather=True)),
    ],
    4: [
        ("dense uneven", [10, 70, 0, 120], None, "lower_bound", True, "k_first"),
        ("dense even", [50, 50, 50, 50], None, "precomputed", True, "v_first"),
        ("dense batch", [20, 0, 33, 11], None, "softplus", True, "k_first", "B3"),
        ("varlen one spans all", [30, 0, 80, 90], [5, 180, 15], "softplus", True, "v_first"),
        ("varlen spanning", [64, 64, 64, 8], [1, 99, 0, 33, 67], "precomputed", False,
         "k_first"),
        ("varlen bf16", [40, 41, 42, 77], [100, 100], "lower_bound", True, "v_first", "bf16"),
        ("checkpoints dense", [10, 70, 0, 120], None, "lower_bound", True, "k_first", "",
         dict(every=64, gather=True)),
        ("checkpoints dense batch", [20, 0, 33, 115], None, "softplus", True, "v_first", "B3",
         dict(every=64)),
        ("checkpoints varlen short heads", [30, 20, 80, 126], [5, 200, 51], "precomputed", False,
         "v_first", "", dict(every=64, gather=True)),
        ("checkpoints varlen bf16", [64, 100, 28, 64], [64, 100, 28, 64], "softplus", True,
         "k_first", "bf16", dict(every=64, explicit=True)),
        ("final_state varlen", [30, 0, 80, 90], [5, 180, 15], "softplus", True, "v_first", "",
         dict(states="final")),
        ("pool bf16", [40, 41, 42, 77], [100, 100], "lower_bound", True, "v_first", "bf16",
         dict(states="pool")),
        ("pool checkpoints", [64, 64, 64, 8], [1, 99, 0, 33, 67], "precomputed", False,
         "k_first", "", dict(states="pool", every=64, gather=True)),
    ],
}


def _owned(starts, counts, rank, every, goff, dense):
    """Per checkpoint row: whether its position falls in rank's slice (dense: every row of the
    batch is one sequence of sum(counts) tokens)."""
    lo, hi = sum(counts[:rank]), sum(counts[:rank + 1])
    owned = torch.zeros(goff[-1], dtype=torch.bool)
    for n in range(len(goff) - 1):
        for row in range(goff[n], goff[n + 1]):
            pos = (0 if dense else starts[n]) + (row - goff[n] + 1) * every
            owned[row] = lo < pos <= hi
    return owned


def _run_case(rank, name, counts, lengths, gate, with_h0, layout, form="", extra=None, *, seed):
    """extra: every (checkpoint_every), gather (gather_checkpoints), explicit (checkpoint_offsets
    passed), states ("initial": initial_state / output_final_state; "final": a preallocated
    final_state; "pool": state_pool / state_indices)."""
    extra = extra or {}
    every, states = extra.get("every", 0), extra.get("states", "initial")
    T = sum(counts)
    rank3 = form == "rank3"
    dtype = torch.bfloat16 if form == "bf16" else torch.float32
    B = 3 if form == "B3" else 1
    d = make_prefill(seed=seed, B=B, T=T, H=H, HV=HV, K=K, V=V, gate=gate, lengths=lengths,
                     rank3=rank3)
    (q, k, v, g, beta), kw = split(d)
    N = d["N"]
    options = dict(gate=gate, beta_logits=kw["beta_logits"], state_layout=layout, num_threads=1)
    if kw["A_log"] is not None:
        options.update(A_log=torch.from_numpy(kw["A_log"]), dt_bias=torch.from_numpy(kw["dt_bias"]))
    cu = None if kw["cu_seqlens"] is None else torch.from_numpy(kw["cu_seqlens"])
    shape = (N, HV, V, K) if layout == "v_first" else (N, HV, K, V)
    h0 = (torch.from_numpy(random_state(seed + 1, shape, scale=0.5)).to(dtype) if with_h0
          else None)
    state_dtype = dtype if with_h0 else torch.float32
    starts = [int(x) for x in cu] if cu is not None else [i * T for i in range(N + 1)]
    goff = kda.checkpoint_offsets(starts, every) if every else [0]
    one, many = {}, {}  # the one-process call's state arguments, the distributed call's
    if every:
        one = dict(checkpoint_every=every,
                   checkpoints=torch.zeros((goff[-1], *shape[1:]), dtype=state_dtype))
        many = dict(checkpoint_every=every,
                    checkpoints=torch.full_like(one["checkpoints"], SENTINEL),
                    gather_checkpoints=extra.get("gather", False))
        if extra.get("explicit"):
            many["checkpoint_offsets"] = torch.tensor(goff, dtype=torch.int32)
    if states == "pool":  # slots: a permutation with one unused slot and, for N > 1, a -1
        P = N + 1
        slots = torch.randperm(P, generator=torch.Generator().manual_seed(seed))[:N]
        if N > 1:
            slots[1] = -1
        pool = torch.from_numpy(random_state(seed + 2, (P, *shape[1:]), scale=0.5)).to(dtype)
        one.update(state_pool=pool.clone(), state_indices=slots)
        many.update(state_pool=pool.clone(), state_indices=slots.to(torch.int64),
                    check_indices=True)
    else:
        one.update(initial_state=h0, output_final_state=True)
        many.update(initial_state=h0)
        if states == "final":
            many["final_state"] = torch.full(shape, SENTINEL, dtype=state_dtype)
        else:
            many["output_final_state"] = True
    full = [torch.from_numpy(x).to(dtype) for x in (q, k, v, g, beta)]
    ref = kda.prefill(*full, cu_seqlens=cu, **one, **options)
    ref_out = ref[0] if isinstance(ref, tuple) else ref
    lo, hi = sum(counts[:rank]), sum(counts[:rank + 1])
    mine = [(x[lo:hi] if rank3 else x[:, lo:hi]).clone() for x in full]
    result = kda.distributed.prefill(*mine, cu_seqlens=cu, **many, **options)
    out = result[0] if isinstance(result, tuple) else result
    what = f"{name} (rank {rank})"
    tol_name = str(dtype)[6:]
    assert out.shape == ((counts[rank],) if rank3 else (B, counts[rank])) + (HV, V), what
    assert out.dtype == dtype, what
    ref_mine = ref_out[lo:hi] if rank3 else ref_out[:, lo:hi]
    if counts[rank]:
        assert_close(out.float().numpy(), ref_mine.float().numpy(), dtype=tol_name,
                     what=f"{what}: out")
    if states == "pool":
        # The rank holding a sequence's last token writes its slot; every other slot is
        # untouched, bit for bit.
        ends = starts[1:] if cu is not None else [T] * N
        lens = [b - a for a, b in zip(starts, starts[1:])] if cu is not None else [T] * N
        written = torch.zeros(P, dtype=torch.bool)
        for n in range(N):
            if slots[n] >= 0 and lens[n] > 0 and lo < ends[n] <= hi:
                written[slots[n]] = True
        got, want = many["state_pool"], one["state_pool"]
        if written.any():
            assert_close(got[written].float().numpy(), want[written].float().numpy(),
                         dtype=tol_name, what=f"{what}: written pool slots")
        assert torch.equal(got[~written], pool[~written]), f"{what}: untouched pool slots"
    else:
        final = result[1]
        assert final.shape == shape and final.dtype == state_dtype == ref[1].dtype, what
        if states == "final":
            assert final is many["final_state"], what
        assert_close(final.float().numpy(), ref[1].float().numpy(), dtype=str(state_dtype)[6:],
                     what=f"{what}: final state")
    if every:
        got, want = many["checkpoints"], one["checkpoints"]
        owned = _owned(starts, counts, rank, every, goff, cu is None)
        if many["gather_checkpoints"]:
            owned[:] = True
        else:
            assert torch.all(got[~owned] == SENTINEL), f"{what}: rows of other ranks"
        if owned.any():
            assert_close(got[owned].float().numpy(), want[owned].float().numpy(),
                         dtype=str(state_dtype)[6:], what=f"{what}: checkpoints")
    if states == "initial" and not every:
        # Without output_final_state: the output alone, the same values.
        again = kda.distributed.prefill(*mine, cu_seqlens=cu, initial_state=h0, **options)
        assert torch.equal(again, out), what


def _worker(rank, world, init, cases):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        for i, case in enumerate(cases):
            _run_case(rank, *case, seed=10 * i + world)
        # Bad arguments are refused on every rank before any state exchange; nothing is written.
        d = make_prefill(seed=3, B=1, T=8, H=H, HV=HV, K=K, V=V, gate="precomputed")
        (q, k, v, g, beta), _ = split(d)
        t = [torch.from_numpy(x) for x in (q, k, v, g, beta)]
        out = torch.full((1, 8, HV, V), SENTINEL)
        pool = torch.full((2, HV, V, K), SENTINEL)
        slots = torch.zeros(1, dtype=torch.int64)
        with pytest.raises(ValueError, match="checkpoints"):
            kda.distributed.prefill(*t, out=out, state_pool=pool, state_indices=slots,
                                    checkpoint_every=64, checkpoints=torch.zeros(1, HV, K, V + 1))
        with pytest.raises(ValueError, match="checkpoint_every"):
            kda.distributed.prefill(*t, out=out, state_pool=pool, state_indices=slots,
                                    checkpoint_every=32, checkpoints=torch.zeros(1, HV, V, K))
        with pytest.raises(ValueError, match="checkpoint_offsets"):
            kda.distributed.prefill(*t, out=out, checkpoint_every=64,
                                    checkpoints=torch.zeros(1, HV, V, K),
                                    checkpoint_offsets=torch.tensor([0, 2]))
        with pytest.raises(ValueError, match="final_state"):
            kda.distributed.prefill(*t, out=out, state_pool=pool, state_indices=slots,
                                    final_state=torch.zeros(1, HV, V, K))
        with pytest.raises(ValueError, match="state_indices"):
            kda.distributed.prefill(*t, out=out, state_pool=pool, check_indices=True,
                                    state_indices=torch.tensor([2]))
        with pytest.raises(ValueError, match="slot 1 for sequences 0 and 1"):
            kda.distributed.prefill(*t, out=out, state_pool=pool, check_indices=True,
                                    state_indices=torch.tensor([1, 1]),
                                    cu_seqlens=torch.tensor([0, 3, 8 * world]))
        with pytest.raises(ValueError, match="output_final_state"):
            kda.distributed.prefill(*t, out=out, state_pool=pool, state_indices=slots,
                                    output_final_state=True)
        with pytest.raises(ValueError, match="gather_checkpoints"):
            kda.distributed.prefill(*t, out=out, gather_checkpoints=True)
        with pytest.raises(ValueError, match="initial_state"):
            kda.distributed.prefill(*t, out=out, initial_state=torch.zeros(2, HV, V, K))
        assert torch.all(out == SENTINEL) and torch.all(pool == SENTINEL)
        with pytest.raises(TypeError, match="'q'"):
            kda.distributed.prefill(q, *t[1:])
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_matches_one_process_prefill(world, tmp_path):
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_worker, args=(world, init, CASES[world]), nprocs=world, join=True)


def test_import_kda_does_not_import_torch():
    code = ("import sys, kda; from kda import *; assert 'torch' not in sys.modules; "
            "assert 'kda.distributed' not in sys.modules; "
            "f = kda.distributed.prefill; assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cases_cover_the_tokens():
    for cases in CASES.values():
        for name, counts, lengths, *rest in cases:
            if lengths is not None:
                assert sum(counts) == sum(lengths), name
            assert len(counts) in CASES, name
            every = rest[4].get("every", 0) if len(rest) > 4 else 0
            if every:  # some checkpoint to compare
                assert max(lengths or [sum(counts)]) >= every, name
