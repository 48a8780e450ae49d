"""Property-based tests of kda.prefill and kda.decode (hypothesis, CPU).

Valid draws (shapes, dense or varlen with empty sequences, grouped values, dtypes, gate and beta
forms, layouts, pools with padding and out-of-range slots, speculative slots, checkpoints,
strided views, numpy or torch arrays) run on the fast CPU backend and on the fp64 reference
(``backend="reference"``): outputs agree within the bar of their dtype, states within that of
theirs (kdatest.tolerance, docs/design.md section 5), and slots no row uses stay bit-identical.

Invalid draws break one thing of a valid call (a shape, a dtype, a last-dimension stride, an
index dtype or value, an option, an array replaced by a list), in numpy or torch: the call
raises TypeError or ValueError naming the broken argument and leaves every output and pool byte
unchanged.
"""

import numpy as np
import pytest

import kda
from kdatest import rel_l2, tolerance

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

try:
    import torch
except ImportError:  # numpy-only draws
    torch = None

LIBS = ["numpy"] + (["torch"] if torch is not None else [])


def _empty_numpy_ok():
    """Whether zero-size numpy arrays (numpy gives them zero strides) are taken as the valid
    empty calls they are (spec section 6); where not yet, such draws are left out."""
    x = np.zeros((1, 0, 1, 16), np.float32)
    try:
        kda.prefill(x, x, x, x, np.zeros((1, 0, 1), np.float32))
    except ValueError:
        return False
    return True


EMPTY_NUMPY_OK = _empty_numpy_ok()
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow],
                derandomize=True)


# --- drawing a valid call ------------------------------------------------------------------------

@st.composite
def calls(draw, op):
    """(args, kwargs, meta) of a valid kda.prefill / kda.decode call, as numpy arrays in fp32
    (converted to the drawn library and dtype by `materialize`)."""
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    lib = draw(st.sampled_from(LIBS))
    dtype = draw(st.sampled_from(["fp32", "fp16"] + (["bf16"] if lib == "torch" else [])))
    H = draw(st.integers(1, 2))
    HV = H * draw(st.integers(1, 2))
    if op == "decode":
        K = V = 32
    else:
        K, V = draw(st.sampled_from([16, 32])), draw(st.sampled_from([16, 32]))
    varlen = draw(st.booleans())
    spec = False
    if varlen:
        lengths = draw(st.lists(st.integers(0, 70 if op == "prefill" else 4), min_size=1,
                                max_size=3))
        B, T, N = 1, sum(lengths), len(lengths)
    else:
        B = N = draw(st.integers(1, 2))
        T = draw(st.integers(0, 70)) if op == "prefill" else draw(st.integers(1, 3))
        lengths = [T] * B
        spec = op == "decode" and draw(st.booleans())
    hypothesis.assume(T > 0 or lib == "torch" or EMPTY_NUMPY_OK)
    gate = draw(st.sampled_from(["precomputed", "softplus", "lower_bound"]))
    beta_logits = draw(st.booleans())
    l2norm = draw(st.booleans())
    layout = draw(st.sampled_from(["v_first", "k_first"]))
    strided = draw(st.booleans())

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    lead = (B, T)
    if strided:  # q, k, v: views into one fused projection (only the last dim contiguous)
        fused = normal(B, T, 2 * H * K + HV * V)
        q = fused[..., :H * K].reshape(B, T, H, K)
        k = fused[..., H * K:2 * H * K].reshape(B, T, H, K)
        v = fused[..., 2 * H * K:].reshape(B, T, HV, V)
    else:
        q, k, v = normal(*lead, H, K), normal(*lead, H, K), normal(*lead, HV, V)
    if not l2norm:  # unit q, k keep the recurrence bounded
        for x in (q, k):
            x /= np.linalg.norm(x, axis=-1, keepdims=True) + 1e-6
    kw = dict(gate=gate, beta_logits=beta_logits, use_qk_l2norm=l2norm, state_layout=layout)
    if gate == "precomputed":
        g = -np.exp(rng.normal(-1.5, 1.0, size=(*lead, HV, K))).astype(np.float32)
        if draw(st.booleans()):
            g[rng.random(g.shape) < 0.1] = -1000.0  # "forget everything"
    else:
        g = normal(*lead, HV, K)
        if draw(st.booleans()):
            kw["A_log"] = rng.uniform(0, 1, HV).astype(np.float32)
        if draw(st.booleans()):
            kw["dt_bias"] = rng.uniform(0, 1, (HV, K)).astype(np.float32)
        if gate == "lower_bound":
            kw["lower_bound"] = draw(st.sampled_from([-5.0, -1.0, -0.1]))
    per_v = op == "decode" and draw(st.booleans())
    bshape = (*lead, HV, V) if per_v else (*lead, HV)
    beta = normal(*bshape) if beta_logits else rng.uniform(0, 1, bshape).astype(np.float32)
    if beta_logits and draw(st.booleans()):
        kw["allow_neg_eigval"] = True
    if varlen:
        kw["cu_seqlens"] = np.concatenate([[0], np.cumsum(lengths)]).astype(
            draw(st.sampled_from([np.int32, np.int64])))
    if draw(st.booleans()):
        kw["scale"] = draw(st.sampled_from([0.1, 0.5, 1.0]))

    shape = (HV, V, K) if layout == "v_first" else (HV, K, V)
    meta = dict(lib=lib, dtype=dtype, op=op, N=N, lengths=lengths, outputs=["out"],
                touched=None)
    state_dtype = draw(st.sampled_from(["fp32", "bf16"] if lib == "torch" else ["fp32"]))
    meta["state_dtype"] = state_dtype
    if op == "prefill":
        mode = draw(st.sampled_from(["none", "initial", "pool", "checkpoints"]))
        if mode == "initial":
            kw["initial_state"] = normal(N, *shape) * 0.1
            if draw(st.booleans()):
                kw["final_state"] = np.zeros((N, *shape), np.float32)
                meta["outputs"].append("final_state")
        elif mode == "pool":
            P = N + draw(st.integers(0, 2))
            slots = rng.permutation(P)[:N].astype(np.int64)
            for n in range(N):
                if draw(st.booleans()) and draw(st.booleans()):
                    slots[n] = draw(st.sampled_from([-1, P, P + 3]))  # no pooled state
            kw["state_pool"] = normal(P, *shape) * 0.1
            kw["state_indices"] = slots.astype(draw(st.sampled_from([np.int32, np.int64])))
            meta["outputs"].append("state_pool")
            meta["touched"] = {int(s) for s in slots if 0 <= s < P}
        elif mode == "checkpoints":
            offsets = kda.checkpoint_offsets([0, *np.cumsum(lengths).tolist()], 64)
            hypothesis.assume(offsets[-1] > 0 or lib == "torch" or EMPTY_NUMPY_OK)
            kw["checkpoint_every"] = 64
            kw["checkpoints"] = np.zeros((offsets[-1], *shape), np.float32)
            kw["checkpoint_offsets"] = np.asarray(offsets, np.int64)
            meta["outputs"].append("checkpoints")
        args = [q, k, v, g, beta]
    else:
        P = N * max(T, 1) + draw(st.integers(0, 2))
        state = normal(P, *shape) * 0.1
        if spec:
            idx = rng.permutation(P)[:N * T].reshape(N, T).astype(np.int64)
            kw["num_accepted_tokens"] = rng.integers(1, T + 1, N).astype(np.int32)
            if draw(st.booleans()):
                kw["num_accepted_tokens"][0] = T + 1  # out of range: a padding row
        else:
            idx = rng.permutation(P)[:N].astype(np.int64)
            if draw(st.booleans()):
                idx[0] = -1  # padding row
        if draw(st.booleans()) or spec:
            kw["state_indices"] = idx.astype(draw(st.sampled_from([np.int32, np.int64])))
            meta["touched"] = {int(s) for s in idx.ravel() if 0 <= s < P}
        else:
            meta["touched"] = set(range(min(N, P)))
        kw["use_initial_state"] = draw(st.booleans())
        kw["store_final_state"] = draw(st.booleans())
        if draw(st.booleans()):
            kw["out_dtype"] = "float32"
        args = [q, k, v, g, beta, state]
        meta["outputs"].append("state")
    return args, kw, meta


def _convert(x, lib, dtype):
    """`x` in library `lib` and float dtype `dtype`, as the same view of a converted base (so
    strided views stay strided)."""
    if x.size == 0 and lib == "torch":  # (numpy's empty arrays have zero strides)
        t = torch.zeros(x.shape, dtype=torch.from_numpy(np.zeros(1, x.dtype)).dtype)
        return t.to(torch.float16 if dtype == "fp16" else torch.bfloat16) if (
            t.is_floating_point() and dtype != "fp32") else t
    base = x
    while isinstance(base.base, np.ndarray):
        base = base.base
    base = np.ascontiguousarray(base)
    offset = (x.__array_interface__["data"][0] - base.__array_interface__["data"][0])
    offset //= x.itemsize
    strides = [st_ // x.itemsize for st_ in x.strides]
    is_float = x.dtype == np.float32
    if lib == "numpy":
        if not (is_float and dtype == "fp16"):
            return x
        flat = base.astype(np.float16).reshape(-1)
        return np.lib.stride_tricks.as_strided(flat[offset:], x.shape, [2 * e for e in strides])
    flat = torch.from_numpy(base).reshape(-1)
    if is_float and dtype != "fp32":
        flat = flat.to(torch.float16 if dtype == "fp16" else torch.bfloat16)
    return flat.as_strided(x.shape, strides, offset)


TOKEN_INPUTS = ("q", "k", "v", "g", "beta")
STATES = ("initial_state", "final_state", "state_pool", "checkpoints", "state")


def materialize(args, kw, meta):
    """The call in its library and dtypes (fresh copies, so that two runs do not share)."""
    lib, dtype, sdt = meta["lib"], meta["dtype"], meta["state_dtype"]
    names = ["q", "k", "v", "g", "beta", "state"][:len(args)]

    def conv(name, x):
        if not isinstance(x, np.ndarray):
            return x
        if name in TOKEN_INPUTS:
            return _convert(x.copy() if x.flags.c_contiguous else x, lib, dtype)
        if name in STATES:
            return _convert(x.copy(), lib, sdt if meta["op"] == "decode" else "fp32")
        return _convert(x.copy(), lib, "fp32")

    a = [conv(n, x) for n, x in zip(names, args)]
    k = {n: conv(n, x) for n, x in kw.items()}
    if "out_dtype" in k and lib == "torch":
        k["out_dtype"] = torch.float32
    return a, k


def as_f64(x):
    if torch is not None and isinstance(x, torch.Tensor):
        return x.detach().double().numpy()
    return np.asarray(x, dtype=np.float64)


def run(op, a, k, backend):
    fn = kda.prefill if op == "prefill" else kda.decode
    res = fn(*a, **k, backend=backend)
    return res[0] if isinstance(res, tuple) else res


def close(what, got, ref, dtype):
    got, ref = as_f64(got), as_f64(ref)
    assert got.shape == ref.shape
    if ref.size == 0 or not np.any(ref):
        np.testing.assert_array_equal(got, ref, err_msg=what)
        return
    err = rel_l2(got, ref)
    assert err <= tolerance(dtype), f"{what}: rel L2 {err:.3g} > {tolerance(dtype):.3g}"


@pytest.mark.parametrize("op", ["prefill", "decode"])
@settings(max_examples=100, **SETTINGS)
@given(data=st.data())
def test_valid_draws_match_the_reference(op, data):
    args, kw, meta = data.draw(calls(op))
    a1, k1 = materialize(args, kw, meta)
    a2, k2 = materialize(args, kw, meta)
    out_cpu = run(op, a1, k1, "cpu")
    out_ref = run(op, a2, k2, "reference")
    out_dtype = "fp32" if kw.get("out_dtype") else meta["dtype"]
    close("out", out_cpu, out_ref, out_dtype)
    state_tol = meta["state_dtype"] if op == "decode" else "fp32"
    for name in ("final_state", "checkpoints", "state_pool"):
        if name in k1:
            close(name, k1[name], k2[name], state_tol)
    if op == "decode":
        close("state", a1[5], a2[5], state_tol)
    if meta["touched"] is not None:  # slots no row uses: bit for bit
        a3, k3 = materialize(args, kw, meta)
        pools = [(a1[5], a2[5], a3[5])] if op == "decode" else [
            (k1["state_pool"], k2["state_pool"], k3["state_pool"])] if "state_pool" in k1 else []
        for got, ref, orig in pools:
            got, ref, orig = as_f64(got), as_f64(ref), as_f64(orig)
            for slot in range(orig.shape[0]):
                if slot not in meta["touched"]:
                    np.testing.assert_array_equal(got[slot], orig[slot])
                    np.testing.assert_array_equal(ref[slot], orig[slot])


# --- invalid draws ------------------------------------------------------------------------------

def _mutations(op):
    """(name, how) pairs: how(value) -> broken value, with the argument the error must name."""
    m = [
        ("k", "shape"), ("v", "shape"), ("g", "shape"), ("beta", "shape"), ("q", "rank"),
        ("v", "dtype"), ("g", "int"), ("beta", "int"), ("q", "stride"), ("k", "stride"),
        ("v", "stride"), ("g", "stride"), ("q", "list"), ("beta", "list"), ("out", "shape"),
        ("out", "dtype"), ("gate", "option"), ("state_layout", "option"), ("scale", "type"),
        ("use_qk_l2norm", "type"), ("A_log", "shape"), ("dt_bias", "shape"),
        ("cu_seqlens", "float"), ("cu_seqlens", "values"), ("lower_bound", "range"),
    ]
    if op == "prefill":
        m += [("initial_state", "shape"), ("state_indices", "float"), ("state_pool", "shape"),
              ("checkpoint_every", "value")]
    else:
        m += [("state", "shape"), ("state", "dtype"), ("state_indices", "float"),
              ("state_indices", "shape"), ("num_accepted_tokens", "float")]
    return m


def _break(call, name, how, op):
    """Breaks argument `name` of a numpy call in place; False when the draw lacks it."""
    a, k = call
    names = ["q", "k", "v", "g", "beta", "state"]
    get = (lambda: a[names.index(name)]) if name in names[:len(a)] else (lambda: k.get(name))

    def put(x):
        if name in names[:len(a)]:
            a[names.index(name)] = x
        else:
            k[name] = x

    x = get()
    if how == "option":
        put("no_such_choice")
    elif how == "type":
        put("0.5" if name == "scale" else 1)
    elif how == "range":
        if k.get("gate") != "lower_bound":
            return False
        put(-7.0)
    elif how == "value":
        if k.get("checkpoint_every", 0) == 0:
            return False
        put(48)
    elif x is None or not isinstance(x, np.ndarray):
        return False
    elif how == "shape":
        if (name in ("k", "v", "g", "beta", "out") and x.ndim == 4) or name == "beta":
            put(np.zeros((x.shape[0], x.shape[1] + 1, *x.shape[2:]), x.dtype))
        else:
            put(np.zeros((*x.shape[:-1], x.shape[-1] + 1), x.dtype))
    elif how == "rank":
        if "cu_seqlens" in k:
            return False  # [T, H, K] is a valid varlen q
        put(x[0])
    elif how == "dtype":
        put(x.astype(np.float16 if x.dtype != np.float16 else np.float32))
    elif how == "int":
        put(x.astype(np.int32))
    elif how == "float":
        put(x.astype(np.float32))
    elif how == "stride":
        if x.size == 0:
            return False
        wide = np.repeat(x, 2, axis=-1)
        put(wide[..., ::2])
    elif how == "list":
        put(x.tolist())
    elif how == "values":
        if x.shape[0] < 2:
            return False
        bad = x.copy()
        bad[-1] += 1  # last value != total tokens
        put(bad)
    return True


def _snapshot(a, k):
    """Bytes of every output and pool of the call."""
    snap = {}
    for name, x in list(zip(["q", "k", "v", "g", "beta", "state"], a)) + list(k.items()):
        if name not in ("out", "state", "state_pool", "final_state", "checkpoints",
                        "intermediate_states"):
            continue
        if isinstance(x, np.ndarray):
            snap[name] = x.tobytes()
        elif torch is not None and isinstance(x, torch.Tensor):
            snap[name] = x.clone().numpy().tobytes()
    return snap


def _to_library(a, k, lib):
    """The (broken) numpy call as `lib` arrays: same values, dtypes and strides."""
    if lib == "numpy":
        return a, k

    def conv(x):
        return _convert(x, "torch", "fp32") if isinstance(x, np.ndarray) else x

    return [conv(x) for x in a], {n: conv(x) for n, x in k.items()}


@pytest.mark.parametrize("op", ["prefill", "decode"])
@settings(max_examples=150, **SETTINGS)
@given(data=st.data())
def test_invalid_draws_raise_the_named_error_and_write_nothing(op, data):
    args, kw, meta = data.draw(calls(op))
    lib = meta["lib"]  # the call is built and broken in numpy fp32, then converted
    meta = dict(meta, lib="numpy", dtype="fp32", state_dtype="fp32")
    a, k = materialize(args, kw, meta)
    hypothesis.assume(EMPTY_NUMPY_OK or not any(
        isinstance(x, np.ndarray) and x.size == 0 for x in [*a, *k.values()]))
    k.pop("out_dtype", None)
    k["out"] = np.full(tuple(a[2].shape), 7.0, np.float32)
    name, how = data.draw(st.sampled_from(_mutations(op)))
    hypothesis.assume(_break((a, k), name, how, op))
    a, k = _to_library(a, k, lib)
    before = _snapshot(a, k)
    fn = kda.prefill if op == "prefill" else kda.decode
    with pytest.raises((TypeError, ValueError)) as info:
        fn(*a, **k, backend="cpu")
    assert f"'{name}'" in str(info.value), (name, how, str(info.value))
    after = _snapshot(a, k)
    for key, val in before.items():
        if key != name:
            assert after[key] == val, f"{key} written by a failed call ({name}: {how})"

