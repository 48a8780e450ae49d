"""The FlashKDA / MATE compatibility entry points against the module API (spec section 7)."""

import inspect

import numpy as np
import pytest

import kda
from kda import compat
from kdatest import assert_close, make_decode, make_prefill, random_state, split


def test_reexported_and_signatures():
    assert kda.fwd is compat.fwd and kda.chunk_kda is compat.chunk_kda
    assert kda.gated_delta_rule_decode is compat.gated_delta_rule_decode
    sig = inspect.signature(kda.fwd)
    assert list(sig.parameters) == ["q", "k", "v", "g", "beta", "scale", "out", "A_log", "dt_bias",
                                    "lower_bound", "initial_state", "final_state", "cu_seqlens"]
    assert all(sig.parameters[n].default is None
               for n in ("initial_state", "final_state", "cu_seqlens"))
    sig = inspect.signature(kda.chunk_kda)
    assert [(n, p.default) for n, p in list(sig.parameters.items())[5:]] == [
        ("scale", None), ("initial_state", None), ("output_final_state", False),
        ("cu_seqlens", None), ("A_log", None), ("dt_bias", None), ("lower_bound", -5.0),
        ("use_qk_l2norm_in_kernel", True), ("output", None), ("final_state", None)]
    sig = inspect.signature(kda.gated_delta_rule_decode)
    names = list(sig.parameters)
    assert names[:10] == ["q", "k", "v", "state", "A_log", "a", "dt_bias",
                          "num_accepted_tokens", "cu_seqlens", "b"]
    defaults = {n: p.default for n, p in sig.parameters.items() if n not in names[:10]}
    assert defaults == dict(state_indices=None, scale=None, output=None, use_qk_l2norm=None,
                            lower_bound=None, use_gate_in_kernel=None, use_lower_bound=None,
                            apply_beta_sigmoid=None, allow_neg_eigval=None,
                            use_initial_state=None, state_v_first=None, is_varlen=None,
                            store_final_state=False, inplace_final_state=False,
                            state_dtype=None)
    for fn in (kda.fwd, kda.chunk_kda, kda.gated_delta_rule_decode):
        assert fn.__doc__ and "Differences" in fn.__doc__


# --- FlashKDA fwd ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("varlen", [False, True])
def test_fwd_matches_prefill(dtype, varlen):
    d = make_prefill(seed=1, dtype=dtype, H=2, HV=2, gate="lower_bound",
                     lengths=[30, 70] if varlen else None)
    args, _kw = split(d)
    N = d["N"]
    h0 = random_state(2, (N, 2, 32, 32))
    out = np.empty(d["v"].shape, dtype)
    ht = np.empty((N, 2, 32, 32), np.float32)
    res = kda.fwd(*args, 0.2, out, d["A_log"], d["dt_bias"], -4.0, initial_state=h0,
                  final_state=ht, cu_seqlens=d["cu_seqlens"])
    assert res is None
    o_ref, h_ref = kda.prefill(*args, A_log=d["A_log"], dt_bias=d["dt_bias"],
                               cu_seqlens=d["cu_seqlens"], scale=0.2, gate="lower_bound",
                               lower_bound=-4.0, beta_logits=True, initial_state=h0,
                               output_final_state=True)
    np.testing.assert_array_equal(out, o_ref)
    np.testing.assert_array_equal(ht, h_ref)
    o_fp64, _ = kda.prefill(*args, A_log=d["A_log"], dt_bias=d["dt_bias"],
                            cu_seqlens=d["cu_seqlens"], scale=0.2, gate="lower_bound",
                            lower_bound=-4.0, beta_logits=True, initial_state=h0,
                            output_final_state=True, backend="reference")
    assert_close(out, o_fp64, dtype)


def test_fwd_flat_dt_bias_and_no_states():
    d = make_prefill(seed=3, H=2, HV=2, gate="lower_bound")
    args, _ = split(d)
    out1 = np.empty(d["v"].shape, np.float32)
    out2 = np.empty_like(out1)
    kda.fwd(*args, None, out1, d["A_log"], d["dt_bias"], -5.0)
    kda.fwd(*args, None, out2, d["A_log"], d["dt_bias"].reshape(-1), -5.0)
    np.testing.assert_array_equal(out1, out2)


def test_fwd_errors_name_arguments():
    d = make_prefill(seed=4, H=2, HV=2, gate="lower_bound")
    args, _ = split(d)
    out = np.full(d["v"].shape, 7.0, np.float32)
    with pytest.raises(ValueError, match="argument 'lower_bound'"):
        kda.fwd(*args, None, out, d["A_log"], d["dt_bias"], 0.0)
    with pytest.raises(ValueError, match="argument 'out'"):
        kda.fwd(*args, None, out.astype(np.float16), d["A_log"], d["dt_bias"], -5.0)
    with pytest.raises(TypeError, match="argument 'out'"):
        kda.fwd(*args, None, None, d["A_log"], d["dt_bias"], -5.0)
    assert (out == 7.0).all()


# --- MATE chunk_kda ------------------------------------------------------------------------------

@pytest.mark.parametrize("gated", [False, True])
def test_chunk_kda_matches_prefill(gated):
    d = make_prefill(seed=5, dtype=np.float16, gate="lower_bound" if gated else "precomputed")
    args, _ = split(d)
    gate_kw = dict(A_log=d["A_log"], dt_bias=d["dt_bias"]) if gated else {}
    o = kda.chunk_kda(*args, **gate_kw, lower_bound=-2.0)
    assert o.dtype == np.float16
    o_ref = kda.prefill(*args, **gate_kw, gate="lower_bound" if gated else "precomputed",
                        lower_bound=-2.0, beta_logits=True)
    np.testing.assert_array_equal(o, o_ref)


def test_chunk_kda_final_state_rules():
    d = make_prefill(seed=6, dtype=np.float16, gate="lower_bound")
    args, _ = split(d)
    gk = dict(A_log=d["A_log"], dt_bias=d["dt_bias"])
    o, ht = kda.chunk_kda(*args, **gk, output_final_state=True)
    assert ht.dtype == np.float16 and ht.shape == (2, 4, 32, 32)  # q's dtype, as in MATE
    h0 = random_state(7, (2, 4, 32, 32))
    o2, ht2 = kda.chunk_kda(*args, **gk, initial_state=h0, output_final_state=True)
    assert ht2.dtype == np.float32  # initial_state's dtype
    o_ref, h_ref = kda.prefill(*args, **gk, gate="lower_bound", beta_logits=True,
                               initial_state=h0, output_final_state=True)
    np.testing.assert_array_equal(o2, o_ref)
    np.testing.assert_array_equal(ht2, h_ref)
    # a given final_state is used only with output_final_state (as in MATE)
    fs = np.full((2, 4, 32, 32), 7.0, np.float32)
    res = kda.chunk_kda(*args, **gk, final_state=fs)
    assert isinstance(res, np.ndarray) and (fs == 7.0).all()
    out = np.empty_like(o)
    res = kda.chunk_kda(*args, **gk, output=out, final_state=fs, output_final_state=True)
    assert res[0] is out and res[1] is fs
    np.testing.assert_array_equal(out, o)
    _, h32 = kda.prefill(*args, **gk, gate="lower_bound", beta_logits=True,
                         output_final_state=True)
    np.testing.assert_array_equal(fs, h32)


def test_chunk_kda_varlen_rank3():
    lengths = [10, 50]
    d = make_prefill(seed=8, dtype=np.float16, gate="lower_bound", lengths=lengths, rank3=True)
    args, _ = split(d)
    gk = dict(A_log=d["A_log"], dt_bias=d["dt_bias"], cu_seqlens=d["cu_seqlens"])
    o, ht = kda.chunk_kda(*args, **gk, output_final_state=True)
    assert o.shape == (60, 4, 32) and ht.shape == (2, 4, 32, 32)
    o4 = kda.chunk_kda(*[x[None] for x in args], **gk)
    np.testing.assert_array_equal(o, o4[0])


def test_chunk_kda_errors_use_mate_names():
    d = make_prefill(seed=9, dtype=np.float16)
    args, _ = split(d)
    with pytest.raises(ValueError, match="argument 'output'"):
        kda.chunk_kda(*args, output=np.zeros((2, 70, 4, 32), np.float32))
    with pytest.raises(TypeError, match="argument 'use_qk_l2norm_in_kernel'"):
        kda.chunk_kda(*args, use_qk_l2norm_in_kernel=None)
    with pytest.raises(TypeError, match="argument 'output_final_state'"):
        kda.chunk_kda(*args, output_final_state=1)


# --- MATE gated_delta_rule_decode ---------------------------------------------------------

def decode_inputs(seed=10, N=3, T=1, **kw):
    d = make_decode(seed=seed, N=N, T=T, **kw)
    q, k, v, g, beta = split(d)[0]
    return d, q, k, v, g, beta


def test_decode_defaults_softplus_gate_beta_as_given():
    d, q, k, v, a, b = decode_inputs(gate="softplus", beta_logits=False)
    pool = random_state(11, (5, 4, 32, 32))
    idx = np.array([3, 0, 4], np.int32)
    s1, s2 = pool.copy(), pool.copy()
    out, fs = kda.gated_delta_rule_decode(q, k, v, s1, d["A_log"], a, d["dt_bias"], None, None, b,
                                          state_indices=idx)
    assert fs is None  # store_final_state defaults to False: nothing returned ...
    ref = kda.decode(q, k, v, a, b, s2, A_log=d["A_log"], dt_bias=d["dt_bias"],
                     state_indices=idx, gate="softplus")
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(s1, s2)  # ... but the pool is advanced, as MATE does
    assert not np.array_equal(s1[idx], pool[idx])
    np.testing.assert_array_equal(s1[[1, 2]], pool[[1, 2]])  # slots no row uses
    assert out.dtype == q.dtype


def test_decode_without_indices_writes_only_with_store_final_state():
    d, q, k, v, a, b = decode_inputs(seed=21, gate="softplus")
    pool = random_state(22, (3, 4, 32, 32))
    s1 = pool.copy()
    _out, fs = kda.gated_delta_rule_decode(q, k, v, s1, d["A_log"], a, d["dt_bias"], None, None, b)
    assert fs is None
    np.testing.assert_array_equal(s1, pool)


def test_decode_lower_bound_none_means_minus_five():
    d, q, k, v, a, b = decode_inputs(seed=23, gate="lower_bound")
    pool = random_state(24, (3, 4, 32, 32))
    out, _ = kda.gated_delta_rule_decode(q, k, v, pool.copy(), d["A_log"], a, d["dt_bias"], None,
                                         None, b, use_lower_bound=True)
    ref = kda.decode(q, k, v, a, b, pool.copy(), A_log=d["A_log"], dt_bias=d["dt_bias"],
                     gate="lower_bound", lower_bound=-5.0)
    np.testing.assert_array_equal(out, ref)


def test_chunk_kda_precomputed_gate_is_natural_log():
    """Without A_log/dt_bias, g is the natural-log decay: g = log(0.5) halves the state."""
    H, K = 1, 32
    q = np.zeros((1, 1, H, K), np.float32)
    q[..., 0] = 1.0
    k = np.zeros_like(q)
    k[..., 1] = 1.0  # orthogonal to q: o reads the decayed initial state only
    v = np.zeros((1, 1, H, K), np.float32)
    g = np.full((1, 1, H, K), np.log(0.5), np.float32)
    beta = np.zeros((1, 1, H), np.float32)  # sigmoid(0) = 0.5, on k's row only
    h0 = np.ones((1, H, K, K), np.float32)
    out = kda.chunk_kda(q, k, v, g, beta, scale=1.0, initial_state=h0,
                        use_qk_l2norm_in_kernel=False)
    np.testing.assert_allclose(out[0, 0, 0], 0.5 * np.ones(K), rtol=1e-6)


def test_decode_in_place_and_separate_final_state():
    d, q, k, v, a, b = decode_inputs(seed=12, gate="softplus", beta_logits=True)
    pool = random_state(13, (5, 4, 32, 32))
    idx = np.array([3, -1, 4], np.int32)
    common = dict(state_indices=idx, apply_beta_sigmoid=True, store_final_state=True)
    s_in = pool.copy()
    out1, fs1 = kda.gated_delta_rule_decode(q, k, v, s_in, d["A_log"], a, d["dt_bias"], None, None,
                                            b, inplace_final_state=True, **common)
    assert fs1 is s_in
    s_sep = pool.copy()
    out2, fs2 = kda.gated_delta_rule_decode(q, k, v, s_sep, d["A_log"], a, d["dt_bias"], None,
                                            None, b, **common)
    np.testing.assert_array_equal(s_sep, s_in)  # the pool is advanced through state_indices
    assert fs2.shape == (3, 4, 32, 32) and fs2 is not s_sep
    np.testing.assert_array_equal(out1, out2)
    np.testing.assert_array_equal(fs2[0], s_in[3])
    np.testing.assert_array_equal(fs2[2], s_in[4])
    assert (fs2[1] == 0).all() and (out1[1] == 0).all()  # padding row
    s_ref = pool.copy()
    ref = kda.decode(q, k, v, a, b, s_ref, A_log=d["A_log"], dt_bias=d["dt_bias"],
                     state_indices=idx, gate="softplus", beta_logits=True)
    np.testing.assert_array_equal(out1, ref)
    np.testing.assert_array_equal(s_in, s_ref)


@pytest.mark.parametrize("mode", ["precomputed", "lower_bound", "neg_eigval", "l2off", "k_first"])
def test_decode_flag_mapping(mode):
    gate = {"precomputed": "precomputed", "lower_bound": "lower_bound"}.get(mode, "softplus")
    d, q, k, v, a, b = decode_inputs(seed=14, T=2, gate=gate, beta_logits=True)
    pool = random_state(15, (3, 4, 32, 32))
    compat_kw, api_kw = dict(apply_beta_sigmoid=True), dict(beta_logits=True, gate=gate)
    if mode == "precomputed":
        compat_kw["use_gate_in_kernel"] = False
    elif mode == "lower_bound":
        compat_kw.update(use_lower_bound=True, lower_bound=-3.0)
        api_kw["lower_bound"] = -3.0
    elif mode == "neg_eigval":
        compat_kw["allow_neg_eigval"] = True
        api_kw["allow_neg_eigval"] = True
    elif mode == "l2off":
        compat_kw["use_qk_l2norm"] = False
        api_kw["use_qk_l2norm"] = False
    elif mode == "k_first":
        compat_kw["state_v_first"] = False
        api_kw["state_layout"] = "k_first"
    s1, s2 = pool.copy(), pool.copy()
    out, _fs = kda.gated_delta_rule_decode(q, k, v, s1, d["A_log"], a, d["dt_bias"], None, None, b,
                                          scale=0.3, store_final_state=True,
                                          inplace_final_state=True, **compat_kw)
    ref = kda.decode(q, k, v, a, b, s2, A_log=d["A_log"], dt_bias=d["dt_bias"], scale=0.3,
                     **api_kw)
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(s1, s2)


def test_decode_speculative_and_varlen():
    lengths = [2, 3]
    d = make_decode(seed=16, lengths=lengths, gate="softplus")
    q, k, v, a, b = split(d)[0]
    pool = random_state(17, (8, 4, 32, 32))
    idx = np.array([[0, 1, -1], [2, 3, 4]], np.int64)
    nat = np.array([2, 1], np.int64)
    s1, s2 = pool.copy(), pool.copy()
    out, _fs = kda.gated_delta_rule_decode(q, k, v, s1, d["A_log"], a, d["dt_bias"], nat,
                                          d["cu_seqlens"], b, state_indices=idx,
                                          store_final_state=True, inplace_final_state=True)
    ref = kda.decode(q, k, v, a, b, s2, A_log=d["A_log"], dt_bias=d["dt_bias"],
                     cu_seqlens=d["cu_seqlens"], state_indices=idx, num_accepted_tokens=nat,
                     gate="softplus")
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(s1, s2)
    with pytest.raises(NotImplementedError, match="argument 'inplace_final_state'"):
        kda.gated_delta_rule_decode(q, k, v, pool.copy(), d["A_log"], a, d["dt_bias"], nat,
                                    d["cu_seqlens"], b, state_indices=idx,
                                    store_final_state=True)


def test_decode_without_state():
    d, q, k, v, a, b = decode_inputs(seed=18, N=2)
    out, fs = kda.gated_delta_rule_decode(q, k, v, None, d["A_log"], a, d["dt_bias"], None, None,
                                          b, use_initial_state=False, store_final_state=True,
                                          state_dtype="float32")
    zero = np.zeros((2, 4, 32, 32), np.float32)
    ref = kda.decode(q, k, v, a, b, zero, A_log=d["A_log"], dt_bias=d["dt_bias"],
                     gate="softplus")
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(fs, zero)
    with pytest.raises(ValueError, match="argument 'state'"):
        kda.gated_delta_rule_decode(q, k, v, None, d["A_log"], a, d["dt_bias"], None, None, b)


def test_decode_errors_use_mate_names():
    d, q, k, v, a, b = decode_inputs(seed=19)
    pool = random_state(20, (3, 4, 32, 32))
    snap = pool.copy()
    call = lambda **kw: kda.gated_delta_rule_decode(  # noqa: E731
        kw.pop("q", q), k, v, kw.pop("state", pool), d["A_log"], kw.pop("a", a), d["dt_bias"],
        None, kw.pop("cu_seqlens", None), kw.pop("b", b), store_final_state=True,
        inplace_final_state=True, **kw)
    with pytest.raises(ValueError, match="argument 'a'"):
        call(a=a.astype(np.float64))
    with pytest.raises(ValueError, match="argument 'b'"):
        call(b=b[..., :2])
    with pytest.raises(ValueError, match="argument 'output'"):
        call(output=np.zeros((3, 1, 4, 16), np.float32))
    with pytest.raises(ValueError, match="argument 'state_dtype'"):
        call(state_dtype="bfloat16")
    with pytest.raises(ValueError, match="argument 'cu_seqlens'"):
        call(is_varlen=True)
    with pytest.raises(TypeError, match="argument 'use_gate_in_kernel'"):
        call(use_gate_in_kernel="yes")
    with pytest.raises(ValueError, match="argument 'lower_bound'"):
        call(use_lower_bound=True, lower_bound=0.5)
    np.testing.assert_array_equal(pool, snap)


def test_decode_separate_final_state_with_indices_torch():
    torch = pytest.importorskip("torch")
    d, q, k, v, a, b = decode_inputs(seed=25, gate="softplus")
    pool = torch.from_numpy(random_state(26, (5, 4, 32, 32)))
    idx = torch.tensor([4, -1, 7], dtype=torch.int32)  # 7 >= P: padding too
    t = [torch.from_numpy(x) for x in (q, k, v, a, b)]
    s1 = pool.clone()
    out, fs = kda.gated_delta_rule_decode(t[0], t[1], t[2], s1, torch.from_numpy(d["A_log"]),
                                          t[3], torch.from_numpy(d["dt_bias"]), None, None, t[4],
                                          state_indices=idx, store_final_state=True)
    assert torch.equal(fs[0], s1[4]) and not torch.equal(s1[4], pool[4])
    assert (fs[1:] == 0).all() and (out[1:] == 0).all()
    assert torch.equal(s1[:4], pool[:4])
