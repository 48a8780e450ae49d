"""kda.decode on numpy arrays: fast CPU backend against the reference backend, state pools with
padding and speculative indices, separate outputs, and decode-after-prefill consistency."""

import numpy as np
import pytest

import kda
from kdatest import assert_close, make_decode, make_prefill, random_state, split


def pool_for(seed, P, HV=4, K=32, dtype=np.float32, layout="v_first"):
    shape = (P, HV, K, K)
    return random_state(seed, shape).astype(dtype)


def both(args, state, kw):
    """Runs decode with the fast and the reference backend on copies of the pool."""
    s_fast, s_ref = state.copy(), state.copy()
    o_fast = kda.decode(*args, s_fast, **kw)
    o_ref = kda.decode(*args, s_ref, **dict(kw, backend="reference"))
    return (o_fast, s_fast), (o_ref, s_ref)


@pytest.mark.parametrize("gate", ["precomputed", "softplus", "lower_bound"])
@pytest.mark.parametrize("beta_per_v", [False, True])
def test_indices_1d_in_place(gate, beta_per_v):
    d = make_decode(seed=1, N=4, T=1, gate=gate, beta_per_v=beta_per_v)
    args, kw = split(d)
    pool = pool_for(2, P=9)
    idx = np.array([7, 0, 3, 5], np.int32)
    (o, s), (o_ref, s_ref) = both(args, pool, dict(kw, state_indices=idx))
    assert o.shape == (4, 1, 4, 32) and o.dtype == np.float32
    assert_close(o, o_ref)
    assert_close(s[idx], s_ref[idx])
    untouched = [i for i in range(9) if i not in idx]
    np.testing.assert_array_equal(s[untouched], pool[untouched])


def test_padding_rows_and_untouched_slots():
    d = make_decode(seed=3, N=4, T=2)
    args, kw = split(d)
    pool = pool_for(4, P=6)
    idx = np.array([-1, 2, 9, 4], np.int64)  # row 0: padding; row 2: slot >= P is padding too
    s = pool.copy()
    o = kda.decode(*args, s, **kw, state_indices=idx)
    assert (o[0] == 0).all() and (o[2] == 0).all()
    for slot in (0, 1, 3, 5):
        np.testing.assert_array_equal(s[slot], pool[slot])
    with pytest.raises(ValueError, match="argument 'state_indices'"):
        kda.decode(*args, pool.copy(), **kw, state_indices=idx, check_indices=True)


def test_speculative_decode_with_accepted_tokens():
    N, T = 3, 4
    d = make_decode(seed=5, N=N, T=T)
    args, kw = split(d)
    P = N * T + 2
    pool = pool_for(6, P=P)
    idx = np.random.default_rng(7).permutation(P)[:N * T].reshape(N, T).astype(np.int32)
    nat = np.array([1, 4, 2], np.int32)
    kw.update(state_indices=idx, num_accepted_tokens=nat)
    (o, s), (o_ref, s_ref) = both(args, pool, kw)
    assert_close(o, o_ref)
    assert_close(s[idx.ravel()], s_ref[idx.ravel()])
    unused = sorted(set(range(P)) - set(idx.ravel().tolist()))
    np.testing.assert_array_equal(s[unused], pool[unused])


def test_separate_final_and_intermediate_states():
    d = make_decode(seed=8, N=3, T=2)
    args, kw = split(d)
    pool = pool_for(9, P=3)
    final = np.zeros((3, 4, 32, 32), np.float32)
    inter = np.zeros((6, 4, 32, 32), np.float32)
    s = pool.copy()
    o1 = kda.decode(*args, s, **kw, final_state=final)
    np.testing.assert_array_equal(s, pool)  # the pool is not written
    o2 = kda.decode(*args, s, **kw, intermediate_states=inter)
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(inter[1::2], final)
    s_in_place = pool.copy()
    kda.decode(*args, s_in_place, **kw)
    np.testing.assert_array_equal(s_in_place, final)
    o_nostore = kda.decode(*args, s, **kw, store_final_state=False)
    np.testing.assert_array_equal(o_nostore, o1)
    np.testing.assert_array_equal(s, pool)


def test_use_initial_state_off_starts_from_zero():
    d = make_decode(seed=10, N=2, T=3)
    args, kw = split(d)
    o_zero_init = kda.decode(*args, np.zeros((2, 4, 32, 32), np.float32), **kw)
    o_no_init = kda.decode(*args, pool_for(11, P=2), **kw, use_initial_state=False)
    np.testing.assert_array_equal(o_zero_init, o_no_init)


def test_varlen_decode():
    lengths = [1, 3, 0, 2]
    d = make_decode(seed=12, lengths=lengths)
    args, kw = split(d)
    pool = pool_for(13, P=5)
    idx = np.array([4, 0, 2, 1], np.int32)
    (o, s), (o_ref, s_ref) = both(args, pool, dict(kw, state_indices=idx))
    assert o.shape == (1, 6, 4, 32)
    assert_close(o, o_ref)
    assert_close(s, s_ref)
    np.testing.assert_array_equal(s[[2, 3]], pool[[2, 3]])  # 0-length row and the unused slot


@pytest.mark.parametrize("out_dtype", [None, "float32", np.float32])
def test_out_dtype(out_dtype):
    d = make_decode(seed=14, N=2, T=1, dtype=np.float16)
    args, kw = split(d)
    o = kda.decode(*args, pool_for(15, P=2), **kw, out_dtype=out_dtype)
    assert o.dtype == (np.float16 if out_dtype is None else np.float32)
    o_ref = kda.decode(*args, pool_for(15, P=2), **kw, out_dtype=out_dtype, backend="reference")
    assert_close(o, o_ref, o.dtype)


def test_k_first_pool():
    d = make_decode(seed=16, N=2, T=2)
    args, kw = split(d)
    pool = pool_for(17, P=2)
    s_v = pool.copy()
    s_k = np.ascontiguousarray(pool.transpose(0, 1, 3, 2))
    o_v = kda.decode(*args, s_v, **kw)
    o_k = kda.decode(*args, s_k, **kw, state_layout="k_first")
    np.testing.assert_allclose(o_v, o_k, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s_v, s_k.transpose(0, 1, 3, 2), rtol=1e-5, atol=1e-6)


def test_decode_after_prefill_equals_prefill_of_the_longer_sequence():
    """Prefill T tokens into a pool, decode 2 more: same as prefill over T + 2 tokens."""
    d = make_prefill(seed=18, B=2, T=66, H=2, HV=4, K=32, V=32)
    args, kw = split(d)
    o_all, h_all = kda.prefill(*args, **kw, output_final_state=True)
    pool = np.zeros((3, 4, 32, 32), np.float32)
    idx = np.array([2, 0], np.int32)
    kda.prefill(*[x[:, :64] for x in args], **kw, state_pool=pool, state_indices=idx)
    o_dec = kda.decode(*[x[:, 64:] for x in args], pool, **kw, state_indices=idx)
    assert_close(o_dec, o_all[:, 64:], what="decoded tokens")
    assert_close(pool[idx], h_all, what="final states")


def test_strided_decode_inputs():
    rng = np.random.default_rng(19)
    N, H, HV, K = 3, 2, 4, 32
    qkv = rng.standard_normal((N, 1, 2 * H + HV, K)).astype(np.float32)
    q, k, v = qkv[:, :, :H], qkv[:, :, H:2 * H], qkv[:, :, 2 * H:]
    g = -np.exp(rng.normal(-1.5, 1, (N, 1, HV, K + 4))).astype(np.float32)[..., :K]
    beta = rng.uniform(0, 1, (N, 1, HV)).astype(np.float32)
    pool = pool_for(20, P=N)
    s1, s2 = pool.copy(), pool.copy()
    o1 = kda.decode(q, k, v, g, beta, s1)
    o2 = kda.decode(*[np.ascontiguousarray(x) for x in (q, k, v, g, beta)], s2)
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(s1, s2)
