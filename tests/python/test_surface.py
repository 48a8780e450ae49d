"""The Python surface: no silent wrong result (devices the call does not run on, empty arrays,
lists), one extension call in the arguments' order, and errors named once in the caller's
vocabulary."""

import re

import numpy as np
import pytest

import kda
from kda import _C
from kdatest import (
    SENTINEL,
    decode_call,
    make_decode,
    make_prefill,
    prefill_call,
    random_state,
    split,
)

PREFILL_ARRAYS = ["q", "k", "v", "g", "beta", "A_log", "dt_bias", "cu_seqlens", "initial_state",
                  "final_state", "state_pool", "state_indices", "checkpoints",
                  "checkpoint_offsets", "out", "workspace"]
DECODE_ARRAYS = ["q", "k", "v", "g", "beta", "state", "A_log", "dt_bias", "cu_seqlens",
                 "state_indices", "num_accepted_tokens", "final_state", "intermediate_states",
                 "out"]


# --- a list or tuple where an array belongs ----------------------------------------------------

@pytest.mark.parametrize("fn,make,name",
                         [(kda.prefill, prefill_call, n) for n in PREFILL_ARRAYS]
                         + [(kda.decode, decode_call, n) for n in DECODE_ARRAYS])
@pytest.mark.parametrize("bad", [[1.0, 2.0], (1, 2)])
def test_list_or_tuple_is_a_type_error_naming_it(fn, make, name, bad):
    call = make(**{name: bad})
    before = {k: v.copy() for k, v in call.items() if isinstance(v, np.ndarray)}
    with pytest.raises(TypeError, match=re.escape(f"argument '{name}'")):
        fn(**call)
    for k, v in before.items():
        np.testing.assert_array_equal(call[k], v, err_msg=f"{k} was written")


@pytest.mark.parametrize("torch_inputs", [False, True])
@pytest.mark.parametrize("bad", [[1.0, 2.0], "x"])
def test_initial_state_not_an_array_with_an_allocated_final_state(torch_inputs, bad):
    call = prefill_call(final_state=None, initial_state=bad, output_final_state=True)
    if torch_inputs:
        torch = pytest.importorskip("torch")
        call = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
                for k, v in call.items()}
    with pytest.raises(TypeError, match="argument 'initial_state'"):
        kda.prefill(**call)


def test_required_array_message_does_not_offer_none():
    with pytest.raises(TypeError, match=r"argument 'q': expected an array \(.*\), got list$"):
        kda.prefill(**prefill_call(q=[1.0]))


# --- empty arrays (numpy gives them strides 0) -------------------------------------------------

def empty(*shape):
    return np.zeros(shape, np.float32)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_prefill_without_tokens_passes_the_states_through(backend):
    H, HV, K = 1, 2, 32
    q, v, b = empty(2, 0, H, K), empty(2, 0, HV, K), empty(2, 0, HV)
    assert q.strides == (0, 0, 0, 0)
    h0 = random_state(5, (2, HV, K, K))
    o, ht = kda.prefill(q, q, v, v, b, initial_state=h0, output_final_state=True,
                        backend=backend)
    assert o.shape == (2, 0, HV, K)
    np.testing.assert_array_equal(ht, h0)
    # varlen: two empty sequences
    qv, vv, bv = empty(1, 0, H, K), empty(1, 0, HV, K), empty(1, 0, HV)
    o, ht = kda.prefill(qv, qv, vv, vv, bv, cu_seqlens=np.array([0, 0, 0], np.int32),
                        initial_state=h0, output_final_state=True, backend=backend)
    assert o.shape == (1, 0, HV, K)
    np.testing.assert_array_equal(ht, h0)
    # pool mode: the slots keep their states
    pool = random_state(6, (3, HV, K, K))
    p0 = pool.copy()
    kda.prefill(q, q, v, v, b, state_pool=pool, state_indices=np.array([2, 0], np.int32),
                backend=backend)
    np.testing.assert_array_equal(pool, p0)


def test_prefill_without_sequences_gives_empty_outputs():
    H, HV, K = 1, 2, 32
    q, v, b = empty(0, 5, H, K), empty(0, 5, HV, K), empty(0, 5, HV)
    o, ht = kda.prefill(q, q, v, v, b, output_final_state=True)
    assert o.shape == (0, 5, HV, K) and ht.shape == (0, HV, K, K)
    qv, vv, bv = empty(1, 0, H, K), empty(1, 0, HV, K), empty(1, 0, HV)
    o, ht = kda.prefill(qv, qv, vv, vv, bv, cu_seqlens=np.array([0], np.int32),
                        output_final_state=True)
    assert o.shape == (1, 0, HV, K) and ht.shape == (0, HV, K, K)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_decode_without_sequences_leaves_the_pool(backend):
    H, HV, K = 1, 2, 32
    pool = random_state(7, (3, HV, K, K))
    p0 = pool.copy()
    q, v, b = empty(0, 1, H, K), empty(0, 1, HV, K), empty(0, 1, HV)
    o = kda.decode(q, q, v, v, b, pool, state_indices=np.zeros((0,), np.int32), backend=backend)
    assert o.shape == (0, 1, HV, K)
    qv, vv, bv = empty(1, 0, H, K), empty(1, 0, HV, K), empty(1, 0, HV)
    o = kda.decode(qv, qv, vv, vv, bv, pool, cu_seqlens=np.array([0, 0], np.int32),
                   backend=backend)
    assert o.shape == (1, 0, HV, K)
    np.testing.assert_array_equal(pool, p0)


def test_empty_arrays_are_still_checked():
    """An empty array is valid only with the right shape and dtype."""
    H, HV, K = 1, 2, 32
    q, v, b = empty(2, 0, H, K), empty(2, 0, HV, K), empty(2, 0, HV)
    with pytest.raises(ValueError, match="argument 'beta'"):
        kda.prefill(q, q, v, v, empty(2, 0, 3))
    with pytest.raises(ValueError, match="argument 'k'"):
        kda.prefill(q, q.astype(np.float16), v, v, b)


# --- the extension call: one call, arguments in its order --------------------------------------

class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


def test_prefill_passes_every_argument_in_the_extension_order(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(_C, "prefill", rec)
    arrays = {n: np.zeros((1,), np.float32) for n in PREFILL_ARRAYS}
    options = dict(checkpoint_every=0, check_indices=True, state_layout="k_first",
                   use_qk_l2norm=False, scale=0.5,
                   gate="softplus", lower_bound=-2.0, beta_logits=True, allow_neg_eigval=True,
                   backend="reference", num_threads=3)
    kda.prefill(**arrays, **options)
    assert len(rec.calls) == 1, "one extension call per prefill (validated once)"
    got = dict(zip(_C.prefill_arguments, rec.calls[0]))
    assert len(rec.calls[0]) == len(_C.prefill_arguments)
    for n, x in {**arrays, **options}.items():
        assert got[n] is x, n
    assert got["stream"] == 0 and got["allocate"] is None and got["names"] is None


def test_decode_passes_every_argument_in_the_extension_order(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(_C, "decode", rec)
    arrays = {n: np.zeros((1,), np.float32) for n in DECODE_ARRAYS}
    options = dict(use_initial_state=False, store_final_state=False, check_indices=True,
                   state_layout="k_first", use_qk_l2norm=False, scale=0.5, gate="lower_bound",
                   lower_bound=-2.0, beta_logits=True, allow_neg_eigval=True,
                   backend="reference", num_threads=3)
    kda.decode(**arrays, **options)
    assert len(rec.calls) == 1
    got = dict(zip(_C.decode_arguments, rec.calls[0]))
    assert len(rec.calls[0]) == len(_C.decode_arguments)
    for n, x in {**arrays, **options}.items():
        assert got[n] is x, n
    assert got["stream"] == 0 and got["names"] is None


def test_prefill_check_indices_reports_a_shared_slot():
    pool = random_state(16, (4, 4, 32, 32))
    call = prefill_call(initial_state=None, final_state=None, state_pool=pool,
                        state_indices=np.array([1, 1], np.int32))
    kda.prefill(**dict(call, state_pool=pool.copy()))  # unchecked: runs
    before = pool.copy()
    with pytest.raises(ValueError, match="argument 'state_indices'"):
        kda.prefill(**call, check_indices=True)
    np.testing.assert_array_equal(pool, before)


def test_scalar_options_take_numbers_and_0d_arrays():
    ref = kda.prefill(**prefill_call(scale=0.25, lower_bound=-2.0, gate="lower_bound"))
    for scale in (np.float32(0.25), np.array(0.25), 0.25):
        got = kda.prefill(**prefill_call(scale=scale, lower_bound=np.float64(-2.0),
                                         gate="lower_bound"))
        np.testing.assert_array_equal(got[0], ref[0])
    for bad in (np.array([0.25]), "0.25", True, [0.25]):
        with pytest.raises(TypeError, match="argument 'scale': expected float or None"):
            kda.prefill(**prefill_call(scale=bad))
    with pytest.raises(TypeError, match="argument 'num_threads': expected int"):
        kda.prefill(**prefill_call(num_threads=1.0))
    kda.prefill(**prefill_call(num_threads=np.int64(1), use_qk_l2norm=np.bool_(True)))


def test_enum_values_come_from_the_library():
    assert _C.enum_values == {"gate": ("precomputed", "softplus", "lower_bound"),
                              "state_layout": ("v_first", "k_first"),
                              "backend": ("auto", "cpu", "cuda", "reference")}
    with pytest.raises(ValueError, match="expected one of 'precomputed', 'softplus', "
                                         "'lower_bound', got 'sigmoid'"):
        kda.prefill(**prefill_call(gate="sigmoid"))


# --- errors in the caller's names, produced once ----------------------------------------------

def test_compat_names_reach_the_extension_messages():
    d = make_decode(seed=8, N=2)
    q, k, v, a, b = split(d)[0]
    pool = random_state(9, (2, 4, 32, 32))
    cases = [
        ("a", dict(a=a.astype(np.float64))),                     # dtype: reader
        ("b", dict(b=b[..., :2])),                               # shape: C++ validation
        ("output", dict(output=np.zeros((2, 1, 4, 16), np.float32))),
    ]
    for name, change in cases:
        args = dict(q=q, k=k, v=v, state=pool, A_log=None, a=a, dt_bias=None,
                    num_accepted_tokens=None, cu_seqlens=None, b=b, use_gate_in_kernel=False,
                    store_final_state=True, inplace_final_state=True)
        args.update(change)
        with pytest.raises((ValueError, TypeError), match=re.escape(f"argument '{name}'")):
            kda.gated_delta_rule_decode(**args)
    # outside the compatibility call the package's own names are back
    with pytest.raises(ValueError, match="argument 'g'"):
        kda.decode(q, k, v, a.astype(np.float64), b, pool)


def test_chunk_kda_names_its_output():
    d = make_prefill(seed=10, dtype=np.float16, gate="lower_bound")
    args = split(d)[0]
    bad = np.zeros((2, 70, 4, 16), np.float16)
    with pytest.raises(ValueError, match="argument 'output'"):
        kda.chunk_kda(*args, A_log=d["A_log"], dt_bias=d["dt_bias"], output=bad)
    # an option's type, checked by the extension, in MATE's name
    with pytest.raises(TypeError, match="argument 'use_qk_l2norm_in_kernel': expected bool"):
        kda.chunk_kda(*args, A_log=d["A_log"], dt_bias=d["dt_bias"], use_qk_l2norm_in_kernel=1)


def test_no_layer_rewrites_messages():
    import kda.api
    import kda.compat
    assert not hasattr(kda.api, "rename_arguments")
    assert not hasattr(kda.api, "_API_NAMES")
    for attr in ("validate_prefill", "validate_decode", "prefill_workspace_size"):
        assert not hasattr(_C, attr)


# --- torch: devices the call does not run on ---------------------------------------------------

def _torch():
    return pytest.importorskip("torch")


@pytest.mark.parametrize("name", ["q", "k", "g", "beta", "A_log", "initial_state", "out",
                                  "final_state"])
def test_prefill_meta_tensor_is_an_error_naming_it(name):
    torch = _torch()
    call = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
            for k, v in prefill_call().items()}
    before = {k: v.clone() for k, v in call.items() if isinstance(v, torch.Tensor)}
    call[name] = torch.empty_like(call[name], device="meta")
    with pytest.raises(ValueError, match=re.escape(f"argument '{name}'") + ".*meta"):
        kda.prefill(**call)
    for k, v in before.items():
        if k != name:
            assert torch.equal(call[k], v), f"{k} was written"


def test_meta_inputs_never_return_an_unwritten_output():
    torch = _torch()
    d = make_prefill(seed=11)
    args, kw = split(d)
    meta = [torch.from_numpy(x).to("meta") for x in args]
    with pytest.raises(ValueError, match=r"argument 'q'.*meta"):
        kda.prefill(*meta, **{k: (torch.from_numpy(v).to("meta")
                                  if isinstance(v, np.ndarray) else v) for k, v in kw.items()},
                    output_final_state=True)
    dd = make_decode(seed=12)
    dargs, dkw = split(dd)
    t = [torch.from_numpy(x) for x in dargs]
    pool = torch.from_numpy(random_state(13, (4, 4, 32, 32)))
    with pytest.raises(ValueError, match=r"argument 'state'.*meta"):
        kda.decode(*t, pool.to("meta"), A_log=torch.from_numpy(dkw["A_log"]),
                   dt_bias=torch.from_numpy(dkw["dt_bias"]), gate="softplus")
    with pytest.raises(ValueError, match=r"argument 'q'.*meta"):
        kda.decode(t[0].to("meta"), *t[1:], pool, gate="softplus",
                   A_log=torch.from_numpy(dkw["A_log"]), dt_bias=torch.from_numpy(dkw["dt_bias"]))


def test_torch_tensor_with_numpy_is_a_type_error():
    torch = _torch()
    call = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
            for k, v in decode_call().items()}
    call["state_indices"] = np.array([4, 0, 2], np.int32)
    with pytest.raises(TypeError, match=r"argument 'state_indices': expected a torch.Tensor"):
        kda.decode(**call)


def test_torch_empty_tensors_and_strided_views():
    torch = _torch()
    H, HV, K = 1, 2, 32
    q, v, b = torch.zeros(2, 0, H, K), torch.zeros(2, 0, HV, K), torch.zeros(2, 0, HV)
    h0 = torch.from_numpy(random_state(14, (2, HV, K, K)))
    o, ht = kda.prefill(q, q, v, v, b, initial_state=h0, output_final_state=True)
    assert o.shape == (2, 0, HV, K) and torch.equal(ht, h0)
    # a non-contiguous view (the last dimension contiguous) is read with its strides
    d = make_prefill(seed=15)
    args, kw = split(d)
    t = [torch.from_numpy(x) for x in args]
    wide = torch.full((*t[1].shape[:-1], 2 * t[1].shape[-1]), SENTINEL)
    wide[..., :t[1].shape[-1]] = t[1]
    kview = wide[..., :t[1].shape[-1]]
    assert not kview.is_contiguous()
    tkw = {k: torch.from_numpy(x) if isinstance(x, np.ndarray) else x for k, x in kw.items()}
    np.testing.assert_array_equal(kda.prefill(t[0], kview, *t[2:], **tkw).numpy(),
                                  kda.prefill(*args, **kw))
