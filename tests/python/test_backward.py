"""The prefill backward from Python: kda._C.prefill_backward and the autograd Function of
kda._autograd, checked with torch.autograd.gradcheck in fp64 on CPU. Skipped without torch.

The library computes in fp64 but takes at most fp32 tensors, so the checked function casts its
fp64 arguments to fp32 and its results back. Inputs lie on a grid of 2^-12 and gradcheck's step
is 2^-7, so every perturbed input is exact in fp32; the remaining error of the numerical
Jacobian is the fp32 rounding of the outputs (~2^-24 |out| / 2^-6 ~ 1e-6 relative) and
truncation (O(eps^2) ~ 1e-4), hence atol = rtol = 2e-3.
"""

import pytest

torch = pytest.importorskip("torch")

import kda  # noqa: E402
from kda import _C  # noqa: E402
from kda._autograd import prefill_with_grad  # noqa: E402

GRID = 2.0 ** -12
EPS = 2.0 ** -7


def on_grid(x):
    return (x / GRID).round() * GRID


def make_inputs(gate, T=(5, 0, 4), H=1, HV=2, K=4, V=3, varlen=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    N, total = len(T), sum(T)

    def rnd(*shape, lo=None, hi=None):
        x = torch.randn(*shape, generator=gen, dtype=torch.float64)
        if lo is not None:
            x = lo + (hi - lo) * torch.rand(*shape, generator=gen, dtype=torch.float64)
        return on_grid(x)

    lead = (total,) if varlen else (N, T[0])
    x = dict(q=rnd(*lead, H, K), k=rnd(*lead, H, K), v=rnd(*lead, HV, V),
             beta=rnd(*lead, HV), initial_state=on_grid(0.1 * rnd(N, HV, V, K)))
    if gate == "precomputed":
        x["g"] = on_grid(-torch.exp(rnd(*lead, HV, K) - 1.5))
    else:
        x["g"] = rnd(*lead, HV, K)
        x["A_log"] = rnd(HV, lo=0.0, hi=1.0)
        x["dt_bias"] = rnd(HV, K, lo=0.0, hi=1.0)
    cu = None
    if varlen:
        starts = [0]
        for t in T:
            starts.append(starts[-1] + t)
        cu = torch.tensor(starts, dtype=torch.int32)
    return x, cu


@pytest.mark.parametrize("gate,beta_logits,l2norm,layout", [
    ("precomputed", False, True, "v_first"),
    ("softplus", True, True, "v_first"),
    ("lower_bound", True, False, "k_first"),
])
def test_gradcheck_fp64(gate, beta_logits, l2norm, layout):
    x, cu = make_inputs(gate, varlen=True)
    if layout == "k_first":
        x["initial_state"] = x["initial_state"].transpose(-1, -2).contiguous()
    names = list(x)
    options = dict(gate=gate, beta_logits=beta_logits, use_qk_l2norm=l2norm, state_layout=layout,
                   backend="reference")

    def f(*args):
        a = {n: t.float() for n, t in zip(names, args)}
        out, final = prefill_with_grad(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("g"),
                                       a.pop("beta"), cu_seqlens=cu, **a, **options)
        return out.double(), final.double()

    args = tuple(x[n].requires_grad_() for n in names)
    assert torch.autograd.gradcheck(f, args, eps=EPS, atol=2e-3, rtol=2e-3)


def test_gradients_flow_dense_gva():
    x, _ = make_inputs("softplus", T=(6, 6), H=1, HV=2, varlen=False)
    t = {n: v.float().requires_grad_() for n, v in x.items()}
    out, final = prefill_with_grad(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"],
                                   dt_bias=t["dt_bias"], initial_state=t["initial_state"],
                                   gate="softplus", beta_logits=True)
    ref = kda.prefill(*(x[n].float() for n in ("q", "k", "v", "g", "beta")),
                      A_log=x["A_log"].float(), dt_bias=x["dt_bias"].float(),
                      initial_state=x["initial_state"].float(), gate="softplus",
                      beta_logits=True, backend="reference")
    assert torch.allclose(out.detach(), ref, atol=1e-5)
    (out.square().sum() + final.sum()).backward()
    for n, v in t.items():
        assert v.grad is not None and v.grad.dtype == v.dtype, n
        assert torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0, n


def test_binding_names_bad_arguments():
    x, cu = make_inputs("precomputed")
    f = {n: v.float() for n, v in x.items()}
    dq = torch.zeros_like(f["q"])
    with pytest.raises(ValueError, match="argument 'dq'"):
        _C.prefill_backward(**f, cu_seqlens=cu, dq=dq[:, :, :2])
    with pytest.raises(TypeError, match="d_outt"):
        _C.prefill_backward(**f, cu_seqlens=cu, d_outt=dq)
    with pytest.raises(TypeError, match="state_pool"):  # no pool mode in the backward
        _C.prefill_backward(**f, cu_seqlens=cu, state_pool=f["initial_state"])
