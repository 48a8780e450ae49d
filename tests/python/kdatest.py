"""Input generators and comparison helpers shared by the Python tests (numpy only).

The distributions follow tests/support.cpp: unit-normal q/k/v, precomputed log decays
-exp(N(-1.5, 1)), raw gates N(0, 1) with A_log, dt_bias ~ U(0, 1), beta logits N(0, 1) or
activated betas U(0, 1).
"""

import numpy as np

import kda

GATE_OPTIONS = ("precomputed", "softplus", "lower_bound")


def tolerance(dtype) -> float:
    """rel L2 bar of a result stored in `dtype` (see tolerance_for in tests/support.cpp)."""
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    return {"float16": 1e-3, "fp16": 1e-3, "bfloat16": 6e-3, "bf16": 6e-3}.get(name, 5e-5)


def rel_l2(got, ref) -> float:
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert np.isfinite(got).all(), "non-finite values in the result"
    den = np.linalg.norm(ref)
    num = np.linalg.norm(got - ref)
    return float(num / den) if den > 0 else float(num)


def assert_close(got, ref, dtype=np.float32, what="result", tol=None):
    err = rel_l2(got, ref)
    tol = tolerance(dtype) if tol is None else tol
    assert err <= tol, f"{what}: rel L2 {err:.3g} > {tol:.3g}"


def gate_inputs(rng, shape_g, HV, K, gate, dtype):
    """(g, A_log, dt_bias) for a gate form."""
    if gate == "precomputed":
        g = -np.exp(rng.normal(-1.5, 1.0, size=shape_g))
        return g.astype(dtype), None, None
    g = rng.standard_normal(shape_g).astype(dtype)
    A_log = rng.uniform(0.0, 1.0, size=(HV,)).astype(np.float32)
    dt_bias = rng.uniform(0.0, 1.0, size=(HV, K)).astype(np.float32)
    return g, A_log, dt_bias


def make_prefill(seed=0, B=2, T=70, H=2, HV=4, K=32, V=32, dtype=np.float32, gate="softplus",
                 beta_logits=True, lengths=None, rank3=False):
    """Inputs of one prefill call as a dict of keyword arguments (plus 'N').

    lengths: varlen mode with these sequence lengths ([1, T, ...] tensors, or [T, ...] with rank3).
    """
    rng = np.random.default_rng(seed)
    cu = None
    if lengths is not None:
        B, T = 1, int(sum(lengths))
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    lead = (T,) if rank3 else (B, T)
    d = dict(
        q=rng.standard_normal((*lead, H, K)).astype(dtype),
        k=rng.standard_normal((*lead, H, K)).astype(dtype),
        v=rng.standard_normal((*lead, HV, V)).astype(dtype),
    )
    d["g"], d["A_log"], d["dt_bias"] = gate_inputs(rng, (*lead, HV, K), HV, K, gate, dtype)
    d["beta"] = (rng.standard_normal((*lead, HV)) if beta_logits
                 else rng.uniform(0.0, 1.0, size=(*lead, HV))).astype(dtype)
    d["cu_seqlens"] = cu
    d["gate"] = gate
    d["beta_logits"] = beta_logits
    d["N"] = len(lengths) if lengths is not None else B
    return d


def split(d):
    """(positional arrays, keyword options) of a make_prefill/make_decode dict."""
    args = [d[n] for n in ("q", "k", "v", "g", "beta")]
    kw = {n: d[n] for n in ("A_log", "dt_bias", "cu_seqlens", "gate", "beta_logits")}
    return args, kw


def random_state(seed, shape, dtype=np.float32, scale=0.1):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


def make_decode(seed=0, N=4, T=1, H=2, HV=4, K=32, dtype=np.float32, gate="softplus",
                beta_logits=True, beta_per_v=False, lengths=None):
    """Inputs of one decode call (without the state) as a dict, plus 'N' and 'T'."""
    rng = np.random.default_rng(seed)
    cu = None
    B = N
    if lengths is not None:
        N, B, T = len(lengths), 1, int(sum(lengths))
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    d = dict(
        q=rng.standard_normal((B, T, H, K)).astype(dtype),
        k=rng.standard_normal((B, T, H, K)).astype(dtype),
        v=rng.standard_normal((B, T, HV, K)).astype(dtype),
    )
    d["g"], d["A_log"], d["dt_bias"] = gate_inputs(rng, (B, T, HV, K), HV, K, gate, dtype)
    bshape = (B, T, HV, K) if beta_per_v else (B, T, HV)
    d["beta"] = (rng.standard_normal(bshape) if beta_logits
                 else rng.uniform(0.0, 1.0, size=bshape)).astype(dtype)
    d["cu_seqlens"] = cu
    d["gate"] = gate
    d["beta_logits"] = beta_logits
    d["N"], d["T"] = N, T
    return d


def state_shape(rows, HV, K, V, layout="v_first"):
    return (rows, HV, V, K) if layout == "v_first" else (rows, HV, K, V)


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


__all__ = [
    "GATE_OPTIONS",
    "SENTINEL",
    "assert_close",
    "decode_call",
    "kda",
    "make_decode",
    "make_prefill",
    "np",
    "prefill_call",
    "random_state",
    "rel_l2",
    "split",
    "state_shape",
    "tolerance",
]


def to_torch(d, device="cpu", dtype=None):
    """The arrays of a make_prefill/make_decode dict as torch tensors (float arrays but A_log and
    dt_bias cast to `dtype` if given); other entries as they are."""
    import torch
    out = {}
    for name, x in d.items():
        if isinstance(x, np.ndarray):
            t = torch.from_numpy(x).to(device)
            if dtype is not None and t.is_floating_point() and name not in ("A_log", "dt_bias"):
                t = t.to(dtype)
            out[name] = t
        else:
            out[name] = x
    return out
