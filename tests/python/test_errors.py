"""Every error path of the Python API: the exception type, the argument named in the message, and
nothing written to any output or state when a call fails."""

import re

import numpy as np
import pytest

import kda
from kdatest import make_decode, make_prefill, random_state, split

SENTINEL = 7.0


def prefill_call(**changes):
    """A valid prefill call (varlen off, softplus gate, initial + final state), then `changes`."""
    d = make_prefill(seed=1, B=2, T=20)
    args, kw = split(d)
    names = ["q", "k", "v", "g", "beta"]
    call = dict(zip(names, args), **kw)
    call["initial_state"] = random_state(2, (2, 4, 32, 32))
    call["final_state"] = np.full((2, 4, 32, 32), SENTINEL, np.float32)
    call["out"] = np.full((2, 20, 4, 32), SENTINEL, np.float32)
    call.update(changes)
    return call


def decode_call(**changes):
    d = make_decode(seed=3, N=3, T=1)
    args, kw = split(d)
    call = dict(zip(["q", "k", "v", "g", "beta"], args), **kw)
    call["state"] = random_state(4, (5, 4, 32, 32))
    call["state_indices"] = np.array([4, 0, 2], np.int32)
    call["out"] = np.full((3, 1, 4, 32), SENTINEL, np.float32)
    call.update(changes)
    return call


def expect(exc, name, fn, call):
    """fn(**call) raises `exc` naming argument `name`, and writes nothing."""
    snapshots = {k: v.copy() for k, v in call.items()
                 if isinstance(v, np.ndarray) and v.flags.writeable}
    with pytest.raises(exc, match=re.escape(f"argument '{name}'")):
        fn(**call)
    for k, before in snapshots.items():
        np.testing.assert_array_equal(call[k], before, err_msg=f"{k} was written")


def test_valid_calls_pass():
    kda.prefill(**prefill_call())
    kda.decode(**decode_call())


# --- prefill: values ---------------------------------------------------------------------------

F16 = np.float16


@pytest.mark.parametrize("name,bad", [
    ("q", lambda c: c["q"].astype(np.float64)),
    ("q", lambda c: c["q"].astype(np.int32)),
    ("k", lambda c: c["k"].astype(F16)),
    ("v", lambda c: c["v"].astype(F16)),
    ("g", lambda c: c["g"].astype(F16)),
    ("beta", lambda c: c["beta"].astype(F16)),
    ("A_log", lambda c: c["A_log"].astype(F16)),
    ("dt_bias", lambda c: c["dt_bias"].astype(F16)),
    ("out", lambda c: c["out"].astype(F16)),
    ("initial_state", lambda c: c["initial_state"].astype(np.int32)),
    ("final_state", lambda c: c["final_state"].astype(np.int64)),
])
def test_prefill_wrong_dtype(name, bad):
    call = prefill_call()
    call[name] = bad(call)
    expect(ValueError, name, kda.prefill, call)


@pytest.mark.parametrize("name,shape", [
    ("q", (2, 20, 2)),
    ("k", (2, 20, 2, 16)),
    ("v", (2, 20, 3, 32)),         # HV not a multiple of H
    ("v", (2, 19, 4, 32)),
    ("g", (2, 20, 4, 16)),
    ("beta", (2, 20, 3)),
    ("A_log", (3,)),
    ("dt_bias", (4,)),
    ("out", (2, 20, 4, 16)),
    ("initial_state", (3, 4, 32, 32)),
    ("final_state", (2, 4, 32, 16)),
])
def test_prefill_wrong_shape(name, shape):
    call = prefill_call()
    call[name] = np.zeros(shape, call[name].dtype)
    expect(ValueError, name, kda.prefill, call)


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta"])
def test_prefill_required_argument_none(name):
    call = prefill_call(**{name: None})
    expect(TypeError, name, kda.prefill, call)


@pytest.mark.parametrize("name", ["q", "beta", "A_log", "cu_seqlens", "out", "final_state",
                                  "state_pool", "checkpoints", "workspace"])
@pytest.mark.parametrize("bad", [[1.0, 2.0], "x", 3])
def test_prefill_not_an_array(name, bad):
    expect(TypeError, name, kda.prefill, prefill_call(**{name: bad}))


def test_prefill_non_contiguous_last_dimension():
    call = prefill_call()
    call["k"] = np.asfortranarray(call["k"])
    expect(ValueError, "k", kda.prefill, call)
    call = prefill_call()
    call["out"] = np.full((2, 20, 4, 64), SENTINEL, np.float32)[..., ::2]
    expect(ValueError, "out", kda.prefill, call)


def test_prefill_negative_strides():
    call = prefill_call()
    call["v"] = call["v"][:, ::-1]
    expect(ValueError, "v", kda.prefill, call)


def test_prefill_read_only_output():
    call = prefill_call()
    call["out"].setflags(write=False)
    expect(ValueError, "out", kda.prefill, call)


@pytest.mark.parametrize("name,value", [
    ("gate", "sigmoid"), ("state_layout", "kv"), ("backend", "gpu"),
    ("lower_bound", 0.5), ("lower_bound", -6.0), ("scale", float("nan")),
    ("checkpoint_every", 10), ("checkpoint_every", -64), ("num_threads", -1),
    ("allow_neg_eigval", True),  # needs beta logits
])
def test_prefill_bad_option_value(name, value):
    changes = {name: value}
    if name == "lower_bound":
        changes["gate"] = "lower_bound"
    if name == "allow_neg_eigval":
        changes["beta_logits"] = False
    expect(ValueError, name, kda.prefill, prefill_call(**changes))


@pytest.mark.parametrize("name,value", [
    ("gate", 1), ("state_layout", None), ("backend", 0), ("use_qk_l2norm", 1),
    ("beta_logits", "yes"), ("allow_neg_eigval", None), ("output_final_state", 0),
    ("scale", "0.1"), ("lower_bound", None), ("checkpoint_every", 64.0), ("num_threads", 1.5),
])
def test_prefill_bad_option_type(name, value):
    expect(TypeError, name, kda.prefill, prefill_call(**{name: value}))


def test_prefill_unknown_keyword():
    with pytest.raises(TypeError, match="nonsense"):
        kda.prefill(**prefill_call(nonsense=1))


def test_prefill_varlen_errors():
    d = make_prefill(seed=5, lengths=[3, 4])
    args, kw = split(d)
    out = np.full((1, 7, 4, 32), SENTINEL, np.float32)
    for bad, name in [
        (np.array([0, 3, 6], np.int32), "cu_seqlens"),    # last != total tokens
        (np.array([0, 5, 3, 7], np.int32), "cu_seqlens"),  # decreasing
        (np.array([1, 3, 7], np.int32), "cu_seqlens"),    # does not start at 0
        (np.array([0.0, 3.0, 7.0], np.float32), "cu_seqlens"),
        (np.zeros((0,), np.int32), "cu_seqlens"),
    ]:
        call = dict(zip(["q", "k", "v", "g", "beta"], args), **dict(kw, cu_seqlens=bad), out=out)
        expect(ValueError, name, kda.prefill, call)
    dense = make_prefill(seed=6, B=2, T=4)
    dargs, dkw = split(dense)
    call = dict(zip(["q", "k", "v", "g", "beta"], dargs),
                **dict(dkw, cu_seqlens=np.array([0, 4, 8])))
    expect(ValueError, "q", kda.prefill, call)  # batch 2 in varlen mode


def test_prefill_pool_errors():
    pool = random_state(7, (4, 4, 32, 32))
    idx = np.array([0, 1], np.int32)
    base = dict(initial_state=None, final_state=None)
    expect(ValueError, "state_indices", kda.prefill, prefill_call(**base, state_pool=pool))
    expect(ValueError, "state_pool", kda.prefill, prefill_call(**base, state_indices=idx))
    expect(ValueError, "initial_state", kda.prefill,
           prefill_call(final_state=None, state_pool=pool, state_indices=idx))
    expect(ValueError, "final_state", kda.prefill,
           prefill_call(initial_state=None, state_pool=pool, state_indices=idx))
    expect(ValueError, "output_final_state", kda.prefill,
           prefill_call(**base, state_pool=pool, state_indices=idx, output_final_state=True))
    expect(ValueError, "state_indices", kda.prefill,
           prefill_call(**base, state_pool=pool, state_indices=idx.astype(np.float32)))
    expect(ValueError, "state_indices", kda.prefill,
           prefill_call(**base, state_pool=pool, state_indices=np.array([0, 1, 2], np.int32)))
    expect(ValueError, "state_pool", kda.prefill,
           prefill_call(**base, state_pool=pool[:, :2], state_indices=idx))


def test_prefill_checkpoint_errors():
    ckpt = np.zeros((2, 4, 32, 32), np.float32)
    expect(ValueError, "checkpoints", kda.prefill, prefill_call(checkpoint_every=64))
    expect(ValueError, "checkpoint_every", kda.prefill, prefill_call(checkpoints=ckpt))
    expect(ValueError, "checkpoint_offsets", kda.prefill,
           prefill_call(checkpoint_every=64, checkpoints=ckpt,
                        checkpoint_offsets=np.array([0, 5, 1], np.int64)))
    expect(ValueError, "checkpoint_offsets", kda.prefill,
           prefill_call(checkpoint_every=64, checkpoints=ckpt,
                        checkpoint_offsets=np.array([0, 1], np.int64)))


def test_prefill_cuda_backend_on_cpu_arrays():
    call = prefill_call(backend="cuda")
    exc = ValueError if kda.info()["cuda_compiled"] else (ValueError, NotImplementedError)
    expect(exc, "backend", kda.prefill, call)


def test_prefill_rank_zero_and_unsupported_dtypes():
    expect(ValueError, "A_log", kda.prefill, prefill_call(A_log=np.float32(1.0) * np.ones(())))
    expect(ValueError, "beta", kda.prefill,
           prefill_call(beta=np.zeros((2, 20, 4), np.complex64)))
    expect(ValueError, "g", kda.prefill, prefill_call(g=np.zeros((2, 20, 4, 32), np.uint8)))
    expect(ValueError, "q", kda.prefill, prefill_call(q=np.zeros((1,) * 7, np.float32)))


# --- decode ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,bad", [
    ("q", lambda c: c["q"].astype(np.float64)),
    ("k", lambda c: c["k"].astype(F16)),
    ("v", lambda c: c["v"].astype(F16)),
    ("g", lambda c: c["g"].astype(np.int32)),
    ("beta", lambda c: c["beta"].astype(F16)),
    ("A_log", lambda c: c["A_log"].astype(F16)),
    ("dt_bias", lambda c: c["dt_bias"].astype(F16)),
    ("state", lambda c: c["state"].astype(F16)),
    ("state_indices", lambda c: c["state_indices"].astype(np.float32)),
    ("out", lambda c: c["out"].astype(F16)),
])
def test_decode_wrong_dtype(name, bad):
    call = decode_call()
    call[name] = bad(call)
    expect(ValueError, name, kda.decode, call)


@pytest.mark.parametrize("name,shape", [
    ("q", (3, 1, 2)),
    ("v", (3, 1, 4, 64)),      # K != V
    ("g", (3, 1, 4, 16)),
    ("beta", (3, 1, 4, 5)),
    ("state", (5, 4, 32, 16)),
    ("state_indices", (4,)),
    ("out", (3, 2, 4, 32)),
])
def test_decode_wrong_shape(name, shape):
    call = decode_call()
    call[name] = np.zeros(shape, call[name].dtype)
    expect(ValueError, name, kda.decode, call)


def test_decode_head_dim_not_multiple_of_32():
    d = make_decode(seed=8, N=2, K=48)
    args, kw = split(d)
    call = dict(zip(["q", "k", "v", "g", "beta"], args), **kw,
                state=random_state(9, (2, 4, 48, 48)))
    expect(ValueError, "v", kda.decode, call)


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta", "state"])
def test_decode_required_argument_none(name):
    expect(TypeError, name, kda.decode, decode_call(**{name: None}))


def test_decode_index_errors():
    nat = np.array([1, 1, 1], np.int32)
    expect(ValueError, "num_accepted_tokens", kda.decode, decode_call(num_accepted_tokens=nat))
    expect(ValueError, "state_indices", kda.decode,
           decode_call(state_indices=np.array([4, 0, 5], np.int32), check_indices=True))
    expect(ValueError, "state", kda.decode,
           decode_call(state_indices=None, state=random_state(4, (2, 4, 32, 32)),
                       check_indices=True))
    expect(ValueError, "final_state", kda.decode,
           decode_call(final_state=np.zeros((3, 4, 32, 32), F16)))
    expect(ValueError, "intermediate_states", kda.decode,
           decode_call(intermediate_states=np.zeros((2, 4, 32, 32), np.float32)))


def test_decode_read_only_state():
    call = decode_call()
    call["state"].setflags(write=False)
    expect(ValueError, "state", kda.decode, call)
    # without writes a read-only pool is fine
    kda.decode(**dict(call, store_final_state=False))


@pytest.mark.parametrize("name,value,exc", [
    ("out_dtype", "int32", ValueError), ("out_dtype", "float64", ValueError),
    ("out_dtype", "float16", ValueError),  # != the given out's dtype
    ("check_indices", 1, TypeError), ("use_initial_state", "no", TypeError),
    ("store_final_state", None, TypeError), ("gate", "none", ValueError),
    ("state_layout", "k", ValueError), ("backend", "tpu", ValueError),
])
def test_decode_bad_options(name, value, exc):
    expect(exc, name, kda.decode, decode_call(**{name: value}))


def test_helper_errors():
    with pytest.raises(TypeError, match="argument 'every'"):
        kda.checkpoint_offsets([0, 10], "64")
    with pytest.raises(TypeError, match="argument 'cu_seqlens'"):
        kda.checkpoint_offsets({"a": 1}, 64)
