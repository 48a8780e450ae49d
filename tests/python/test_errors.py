"""Every error path of the Python API: the exception type, the argument named in the message, and
nothing written to any output or state when a call fails."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

import kda
from kdatest import (
    SENTINEL,
    decode_call,
    make_decode,
    make_prefill,
    prefill_call,
    random_state,
    split,
)


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


# --- error paths in a process that also holds torch and the CUDA driver ------------------------

def test_decode_strided_beta_view_message_spells_both_shapes():
    """beta as the strided view b[..., :2] (HV 2 instead of 4): the C++ validation rejects it and
    the message gives the expected and the given shape (no iostreams on this path)."""
    call = decode_call()
    call["beta"] = call["beta"][..., :2]
    assert not call["beta"].flags.c_contiguous
    expect(ValueError, "beta", kda.decode, call)
    with pytest.raises(ValueError, match=re.escape("[3, 1, 4, 32], got shape [3, 1, 2]")):
        kda.decode(**call)


_ERROR_PATHS_CHILD = r"""
import faulthandler, sys
faulthandler.enable()
import numpy as np
import kda                      # imported first, as in the pytest run (test_compat.py)
try:                            # then torch and the CUDA driver, as test_torch.py's collection does
    import torch
    torch.cuda.is_available()
except ImportError:
    pass
kda.cuda_available()
rng = np.random.default_rng(0)
N, H, HV, K = 3, 2, 4, 32
q, k = (rng.standard_normal((N, 1, H, K)).astype(np.float32) for _ in range(2))
v, g = (rng.standard_normal((N, 1, HV, K)).astype(np.float32) for _ in range(2))
b = rng.standard_normal((N, 1, HV)).astype(np.float32)
pool = rng.standard_normal((N, HV, K, K)).astype(np.float32)
kda.gated_delta_rule_decode(q, k, v, pool, None, g, None, None, None, b, use_gate_in_kernel=False,
                            store_final_state=True, inplace_final_state=True)
for name, kw in (("a", dict(a=g.astype(np.float64))), ("b", dict(b=b[..., :2])),
                 ("output", dict(output=np.zeros((N, 1, HV, 16), np.float32)))):
    args = dict(a=g, b=b)
    args.update(kw)
    try:
        kda.gated_delta_rule_decode(q, k, v, pool, None, args.pop("a"), None, None, None,
                                    args.pop("b"), use_gate_in_kernel=False, store_final_state=True,
                                    inplace_final_state=True, **args)
    except ValueError as e:
        assert f"argument '{name}'" in str(e), str(e)
    else:
        raise AssertionError(f"no ValueError for {name}")
print("error paths ok")
"""


def test_error_paths_in_a_process_with_torch_and_cuda():
    """The failing-validation calls of test_compat.py::test_decode_errors_use_mate_names, in a
    child process that loads torch and initialises the CUDA driver after kda (as the full pytest
    run does): a crash there fails this test instead of killing the whole run."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, "-c", _ERROR_PATHS_CHILD], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "error paths ok" in r.stdout, (
        f"child exited with {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr[-4000:]}")
