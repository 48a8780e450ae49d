"""kda.prefill on numpy arrays: the fast CPU backend against the fp64 reference backend, varlen,
state pools, checkpoints, strided views and output allocation."""

import numpy as np
import pytest

import kda
from kdatest import assert_close, make_prefill, random_state, split, state_shape


def run_both(args, kw):
    """(fast CPU result, reference result) of the same call."""
    fast = kda.prefill(*args, **kw)
    ref = kda.prefill(*args, **dict(kw, backend="reference"))
    return fast, ref


@pytest.mark.parametrize("gate", ["precomputed", "softplus", "lower_bound"])
@pytest.mark.parametrize("beta_logits", [False, True])
def test_gate_and_beta_forms(gate, beta_logits):
    d = make_prefill(seed=1, gate=gate, beta_logits=beta_logits)
    args, kw = split(d)
    if gate == "lower_bound":
        kw["lower_bound"] = -3.0
    h0 = random_state(2, state_shape(2, 4, 32, 32))
    (o, ht), (o_ref, ht_ref) = run_both(args, dict(kw, initial_state=h0, output_final_state=True))
    assert_close(o, o_ref, what="out")
    assert_close(ht, ht_ref, what="final_state")


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("layout", ["v_first", "k_first"])
def test_dtypes_and_layouts(dtype, layout):
    d = make_prefill(seed=3, dtype=dtype, B=1, T=130, H=1, HV=2, K=64, V=32)
    args, kw = split(d)
    h0 = random_state(4, state_shape(1, 2, 64, 32, layout))
    kw.update(initial_state=h0, output_final_state=True, state_layout=layout)
    (o, ht), (o_ref, ht_ref) = run_both(args, kw)
    assert o.dtype == dtype and o.shape == (1, 130, 2, 32)
    assert ht.dtype == np.float32 and ht.shape == state_shape(1, 2, 64, 32, layout)
    assert_close(o, o_ref, dtype, "out")
    assert_close(ht, ht_ref, what="final_state")


def test_k_first_is_the_transpose_of_v_first():
    d = make_prefill(seed=5)
    args, kw = split(d)
    h0 = random_state(6, (2, 4, 32, 32))
    o1, h1 = kda.prefill(*args, **kw, initial_state=h0, output_final_state=True)
    o2, h2 = kda.prefill(*args, **kw, initial_state=np.ascontiguousarray(h0.transpose(0, 1, 3, 2)),
                         output_final_state=True, state_layout="k_first")
    np.testing.assert_allclose(o1, o2, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(h1, h2.transpose(0, 1, 3, 2), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("l2norm", [True, False])
def test_scale_and_l2norm(l2norm):
    d = make_prefill(seed=7, gate="precomputed", beta_logits=False)
    args, kw = split(d)
    kw.update(scale=0.3, use_qk_l2norm=l2norm)
    o, o_ref = run_both(args, kw)
    assert_close(o, o_ref)
    o_default = kda.prefill(*args, **dict(kw, scale=None))
    assert not np.allclose(o, o_default)


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("rank3", [False, True])
def test_varlen_equals_per_sequence_runs(index_dtype, rank3):
    lengths = [5, 0, 70, 1, 64]
    d = make_prefill(seed=8, lengths=lengths, rank3=rank3)
    d["cu_seqlens"] = d["cu_seqlens"].astype(index_dtype)
    args, kw = split(d)
    h0 = random_state(9, (len(lengths), 4, 32, 32))
    o, ht = kda.prefill(*args, **kw, initial_state=h0, output_final_state=True)
    assert o.shape == d["v"].shape
    cu = d["cu_seqlens"]
    for n in range(len(lengths)):
        sl = slice(int(cu[n]), int(cu[n + 1]))
        part = [x[sl][None] if rank3 else x[:, sl] for x in args]
        if lengths[n] == 0:
            np.testing.assert_array_equal(ht[n], h0[n])  # a 0-length sequence passes its state
            continue
        on, hn = kda.prefill(*part, A_log=d["A_log"], dt_bias=d["dt_bias"], gate=d["gate"],
                             beta_logits=True, initial_state=h0[n:n + 1], output_final_state=True)
        got = o[sl] if rank3 else o[:, sl]
        assert_close(got, on[0] if rank3 else on, what=f"out of sequence {n}")
        assert_close(ht[n], hn[0], what=f"final_state of sequence {n}")


def test_state_pool_reads_and_writes_slots_in_place():
    d = make_prefill(seed=10, B=3, T=40)
    args, kw = split(d)
    P = 6
    pool = random_state(11, (P, 4, 32, 32))
    before = pool.copy()
    idx = np.array([4, -1, 1], dtype=np.int64)  # -1: no pooled state (zero start, no write)
    o = kda.prefill(*args, **kw, state_pool=pool, state_indices=idx)
    h0 = np.stack([before[4], np.zeros_like(before[0]), before[1]])
    o_ref, ht_ref = kda.prefill(*args, **kw, initial_state=h0, output_final_state=True,
                                backend="reference")
    assert_close(o, o_ref)
    assert_close(pool[4], ht_ref[0])
    assert_close(pool[1], ht_ref[2])
    for slot in (0, 2, 3, 5):  # untouched slots stay bit-identical
        np.testing.assert_array_equal(pool[slot], before[slot])


def test_checkpoints_are_prefix_states():
    lengths = [150, 64, 10]
    d = make_prefill(seed=12, lengths=lengths)
    args, kw = split(d)
    offsets = kda.checkpoint_offsets(d["cu_seqlens"], 64)
    assert offsets.dtype == np.int64 and offsets.tolist() == [0, 2, 3, 3]
    assert kda.checkpoint_offsets([0, 150, 214, 224], 64) == [0, 2, 3, 3]
    ckpt = np.zeros((3, 4, 32, 32), np.float32)
    ckpt_auto = np.zeros_like(ckpt)
    _o, ht = kda.prefill(*args, **kw, output_final_state=True, checkpoint_every=64,
                        checkpoints=ckpt, checkpoint_offsets=offsets)
    kda.prefill(*args, **kw, checkpoint_every=64, checkpoints=ckpt_auto)  # offsets computed here
    np.testing.assert_array_equal(ckpt, ckpt_auto)
    cu = d["cu_seqlens"]
    for n, row, upto in [(0, 0, 64), (0, 1, 128), (1, 2, 64)]:
        sl = slice(int(cu[n]), int(cu[n]) + upto)
        _, h = kda.prefill(*[x[:, sl] for x in args], A_log=d["A_log"], dt_bias=d["dt_bias"],
                           gate=d["gate"], beta_logits=True, output_final_state=True,
                           backend="reference")
        assert_close(ckpt[row], h[0], what=f"checkpoint {row}")
    assert_close(ckpt[2], ht[1], what="checkpoint at the end of sequence 1")


@pytest.mark.parametrize("pad", [0, 8])
def test_strided_views_of_a_fused_qkv(pad):
    """q, k, v as views into one [B, T, 2H + HV, K + pad] projection (only the last dimension is
    contiguous); g and beta as views too. Same result as contiguous copies."""
    rng = np.random.default_rng(13)
    B, T, H, HV, K = 2, 67, 2, 4, 32
    qkv = rng.standard_normal((B, T, 2 * H + HV, K + pad)).astype(np.float32)
    q, k, v = qkv[:, :, :H, :K], qkv[:, :, H:2 * H, :K], qkv[:, :, 2 * H:, :K]
    g = rng.standard_normal((B, T, HV, K + 3)).astype(np.float32)[..., :K]
    beta = rng.standard_normal((B, T + 1, HV + 2)).astype(np.float32)[:, 1:, :HV]
    assert not q.flags.c_contiguous and not g.flags.c_contiguous
    assert not beta.flags.c_contiguous
    A_log = rng.uniform(0, 1, HV).astype(np.float32)
    dt_bias = rng.uniform(0, 1, (HV, K)).astype(np.float32)
    kw = dict(A_log=A_log, dt_bias=dt_bias, gate="softplus", beta_logits=True,
              output_final_state=True)
    o, ht = kda.prefill(q, k, v, g, beta, **kw)
    contiguous = [np.ascontiguousarray(x) for x in (q, k, v, g, beta)]
    o2, ht2 = kda.prefill(*contiguous, **kw)
    np.testing.assert_array_equal(o, o2)
    np.testing.assert_array_equal(ht, ht2)
    o_ref, _ = kda.prefill(q, k, v, g, beta, **kw, backend="reference")
    assert_close(o, o_ref)


def test_strided_output_and_state():
    d = make_prefill(seed=14)
    args, kw = split(d)
    out_buf = np.full((2, 70, 4, 40), 7.0, np.float32)
    fs_buf = np.full((2, 5, 32, 32), 7.0, np.float32)
    out, fs = out_buf[..., :32], fs_buf[:, 1:5]
    res = kda.prefill(*args, **kw, out=out, final_state=fs)
    assert res[0] is out and res[1] is fs
    o_ref, h_ref = kda.prefill(*args, **kw, output_final_state=True)
    np.testing.assert_array_equal(out, o_ref)
    np.testing.assert_array_equal(fs, h_ref)
    assert (out_buf[..., 32:] == 7.0).all() and (fs_buf[:, 0] == 7.0).all()


def test_output_allocation_and_return_values():
    d = make_prefill(seed=15, dtype=np.float16)
    args, kw = split(d)
    o = kda.prefill(*args, **kw)
    assert isinstance(o, np.ndarray) and o.dtype == np.float16 and o.shape == (2, 70, 4, 32)
    o2, ht = kda.prefill(*args, **kw, output_final_state=True)
    assert ht.dtype == np.float32 and ht.shape == (2, 4, 32, 32)
    np.testing.assert_array_equal(o, o2)
    h0 = random_state(16, (2, 4, 32, 32), np.float16)
    _, ht16 = kda.prefill(*args, **kw, initial_state=h0, output_final_state=True)
    assert ht16.dtype == np.float16  # allocated like the initial state
    out = np.empty_like(o)
    assert kda.prefill(*args, **kw, out=out) is out
    np.testing.assert_array_equal(out, o)


def test_read_only_inputs_are_accepted():
    d = make_prefill(seed=17)
    args, kw = split(d)
    ro = []
    for x in args:
        x = x.copy()
        x.setflags(write=False)
        ro.append(x)
    np.testing.assert_array_equal(kda.prefill(*ro, **kw), kda.prefill(*args, **kw))


def test_backends_and_threads_agree():
    d = make_prefill(seed=18)
    args, kw = split(d)
    o1 = kda.prefill(*args, **kw, backend="cpu", num_threads=1)
    o4 = kda.prefill(*args, **kw, backend="cpu", num_threads=4)
    oa = kda.prefill(*args, **kw)
    np.testing.assert_array_equal(o1, o4)
    np.testing.assert_array_equal(o1, oa)


def test_extreme_precomputed_gates_stay_finite():
    d = make_prefill(seed=19, gate="precomputed", T=130)
    d["g"][:, ::7] = -1000.0
    args, kw = split(d)
    (o, ht), (o_ref, ht_ref) = run_both(args, dict(kw, output_final_state=True))
    assert np.isfinite(o).all() and np.isfinite(ht).all()
    assert_close(o, o_ref)
    assert_close(ht, ht_ref)


def test_info_and_version():
    info = kda.info()
    assert info["version"] == kda.__version__
    assert info["chunk_size"] == 64
    assert isinstance(info["cuda_compiled"], bool)
    assert isinstance(info["cuda_devices"], list)
    assert isinstance(kda.cuda_available(), bool)
    if not info["cuda_devices"]:
        assert kda.cuda_available() is False
