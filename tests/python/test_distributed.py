"""kda.distributed.prefill on CPU with gloo: 2 and 4 processes against the one-process prefill.

Each spawned rank builds the whole input from a seed, runs the one-process kda.prefill of it, and
compares its own slice of the outputs (and every row of the final state) with the distributed
call's result.
"""

import subprocess
import sys

import pytest

from kdatest import assert_close, kda, make_prefill, random_state, split

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
mp = pytest.importorskip("torch.multiprocessing")

H, HV, K, V = 2, 4, 32, 32  # GVA: HV = 2H

# name, token counts per rank, sequence lengths (None: dense), gate, initial state, state layout,
# form ("": fp32 [1, T, ...]; "rank3": varlen [T, ...]; "bf16": bf16 inputs and initial state;
# "B3": dense, three sequences of the same length split at the same tokens).
CASES = {
    2: [
        ("dense uneven", [37, 113], None, "softplus", True, "v_first"),
        ("dense precomputed k_first", [90, 60], None, "precomputed", False, "k_first"),
        ("varlen spanning", [61, 139], [20, 70, 0, 45, 65], "lower_bound", True, "v_first"),
        ("varlen empty slice", [0, 150], [50, 100], "softplus", False, "k_first", "rank3"),
        ("dense bf16", [70, 58], None, "softplus", True, "v_first", "bf16"),
    ],
    4: [
        ("dense uneven", [10, 70, 0, 120], None, "lower_bound", True, "k_first"),
        ("dense even", [50, 50, 50, 50], None, "precomputed", True, "v_first"),
        ("dense batch", [20, 0, 33, 11], None, "softplus", True, "k_first", "B3"),
        ("varlen one spans all", [30, 0, 80, 90], [5, 180, 15], "softplus", True, "v_first"),
        ("varlen spanning", [64, 64, 64, 8], [1, 99, 0, 33, 67], "precomputed", False,
         "k_first"),
        ("varlen bf16", [40, 41, 42, 77], [100, 100], "lower_bound", True, "v_first", "bf16"),
    ],
}


def _run_case(rank, name, counts, lengths, gate, with_h0, layout, form="", *, seed):
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
    full = [torch.from_numpy(x).to(dtype) for x in (q, k, v, g, beta)]
    ref_out, ref_final = kda.prefill(*full, cu_seqlens=cu, initial_state=h0,
                                     output_final_state=True, **options)
    lo, hi = sum(counts[:rank]), sum(counts[:rank + 1])
    mine = [(x[lo:hi] if rank3 else x[:, lo:hi]).clone() for x in full]
    out, final = kda.distributed.prefill(*mine, cu_seqlens=cu, initial_state=h0,
                                         output_final_state=True, **options)
    what = f"{name} (rank {rank})"
    assert out.shape == ((counts[rank],) if rank3 else (B, counts[rank])) + (HV, V), what
    assert out.dtype == dtype, what
    ref_mine = ref_out[lo:hi] if rank3 else ref_out[:, lo:hi]
    if counts[rank]:
        assert_close(out.float().numpy(), ref_mine.float().numpy(), dtype=str(dtype)[6:],
                     what=f"{what}: out")
    state_dtype = dtype if with_h0 else torch.float32
    assert final.shape == shape and final.dtype == state_dtype == ref_final.dtype, what
    assert_close(final.float().numpy(), ref_final.float().numpy(), dtype=str(state_dtype)[6:],
                 what=f"{what}: final state")
    # Without output_final_state: the output alone, the same values.
    again = kda.distributed.prefill(*mine, cu_seqlens=cu, initial_state=h0, **options)
    assert torch.equal(again, out), what


def _worker(rank, world, init, cases):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        for i, case in enumerate(cases):
            _run_case(rank, *case, seed=10 * i + world)
        # Unsupported arguments and bad shapes are refused on every rank before any exchange.
        d = make_prefill(seed=3, B=1, T=8, H=H, HV=HV, K=K, V=V, gate="precomputed")
        (q, k, v, g, beta), _ = split(d)
        t = [torch.from_numpy(x) for x in (q, k, v, g, beta)]
        with pytest.raises(NotImplementedError, match="checkpoint_every"):
            kda.distributed.prefill(*t, checkpoint_every=64)
        with pytest.raises(NotImplementedError, match="state_pool"):
            kda.distributed.prefill(*t, state_pool=torch.zeros(1, HV, V, K),
                                    state_indices=torch.zeros(1, dtype=torch.int32))
        with pytest.raises(ValueError, match="initial_state"):
            kda.distributed.prefill(*t, initial_state=torch.zeros(2, HV, V, K))
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
        for name, counts, lengths, *_ in cases:
            if lengths is not None:
                assert sum(counts) == sum(lengths), name
            assert len(counts) in CASES, name
