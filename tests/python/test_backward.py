"""The prefill backward from Python: kda._C.prefill_backward, and torch.autograd.gradcheck in fp64
on CPU of kda.prefill (differentiable through kda._autograd) over the feature matrix. Skipped
without torch.

The library computes in fp64 but takes at most fp32 tensors, so the checked function casts its
fp64 arguments to fp32 and its results back. Inputs lie on a grid of 2^-12 and gradcheck's step
is 2^-7, so every perturbed input is exact in fp32; the remaining error of the numerical
Jacobian is the fp32 rounding of the outputs (~2^-24 |out| / 2^-6 ~ 1e-6 relative) and
truncation (O(eps^2) ~ 1e-4), hence atol = rtol = 2e-3.
"""

import itertools

import pytest

torch = pytest.importorskip("torch")

import kda  # noqa: E402
from kda import _C  # noqa: E402

GRID = 2.0 ** -12
EPS = 2.0 ** -7
TOL = 2e-3


def on_grid(x):
    return (x / GRID).round() * GRID


def make_inputs(gate, T=(5, 0, 7), H=1, HV=2, K=8, V=8, varlen=True, beta_logits=True,
                initial_state=True, seed=0):
    """fp64 inputs on the grid, as a dict of kda.prefill's tensor arguments, and cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)
    N, total = len(T), sum(T)

    def rnd(*shape, lo=None, hi=None, scale=1.0):
        if lo is not None:
            return on_grid(lo + (hi - lo) * torch.rand(*shape, generator=gen,
                                                       dtype=torch.float64))
        return on_grid(scale * torch.randn(*shape, generator=gen, dtype=torch.float64))

    lead = (total,) if varlen else (N, T[0])
    x = dict(q=rnd(*lead, H, K, scale=0.5), k=rnd(*lead, H, K, scale=0.5),
             v=rnd(*lead, HV, V),
             beta=rnd(*lead, HV) if beta_logits else rnd(*lead, HV, lo=0.1, hi=0.9))
    if gate == "precomputed":
        x["g"] = on_grid(-torch.exp(rnd(*lead, HV, K) - 1.5))
    else:
        x["g"] = rnd(*lead, HV, K)
        x["A_log"] = rnd(HV, lo=0.0, hi=1.0)
        x["dt_bias"] = rnd(HV, K, lo=0.0, hi=1.0)
    if initial_state:
        x["initial_state"] = rnd(N, HV, V, K, scale=0.1)
    cu = None
    if varlen:
        starts = [0]
        for t in T:
            starts.append(starts[-1] + t)
        cu = torch.tensor(starts, dtype=torch.int32)
    return x, cu


def gradcheck(x, cu, **options):
    names = list(x)

    def f(*args):
        a = {n: t.float() for n, t in zip(names, args)}
        out, final = kda.prefill(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("g"), a.pop("beta"),
                                 cu_seqlens=cu, output_final_state=True, **a, **options)
        return out.double(), final.double()

    args = tuple(x[n].requires_grad_() for n in names)
    return torch.autograd.gradcheck(f, args, eps=EPS, atol=TOL, rtol=TOL)


# Every gate form with beta logits on/off, l2norm on/off, initial state on/off, dense and varlen;
# grouped values (HV = 2 H) throughout.
MATRIX = list(itertools.product(("precomputed", "lower_bound", "softplus"), (False, True),
                                (False, True), (False, True), (False, True)))


@pytest.mark.parametrize("gate,beta_logits,l2norm,h0,varlen", MATRIX)
def test_gradcheck_fp64(gate, beta_logits, l2norm, h0, varlen):
    T = (5, 0, 7) if varlen else (6, 6)
    x, cu = make_inputs(gate, T=T, varlen=varlen, beta_logits=beta_logits, initial_state=h0,
                        seed=len(MATRIX))
    assert gradcheck(x, cu, gate=gate, beta_logits=beta_logits, use_qk_l2norm=l2norm,
                     backend="reference")


@pytest.mark.parametrize("layout", ["v_first", "k_first"])
def test_gradcheck_k_first_neg_eigval_scale_gva4(layout):
    """K != V, HV = 4 H, a K-first state, allow_neg_eigval and an explicit scale."""
    x, cu = make_inputs("lower_bound", T=(9, 4), H=1, HV=4, K=8, V=16, seed=3)
    if layout == "k_first":
        x["initial_state"] = x["initial_state"].transpose(-1, -2).contiguous()
    assert gradcheck(x, cu, gate="lower_bound", lower_bound=-2.0, beta_logits=True,
                     allow_neg_eigval=True, scale=0.7, state_layout=layout)


def test_gradients_flow_dense_gva():
    x, _ = make_inputs("softplus", T=(6, 6), H=1, HV=2, varlen=False)
    t = {n: v.float().requires_grad_() for n, v in x.items()}
    out, final = kda.prefill(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"],
                             dt_bias=t["dt_bias"], initial_state=t["initial_state"],
                             gate="softplus", beta_logits=True, output_final_state=True)
    ref = kda.prefill(*(x[n].float() for n in ("q", "k", "v", "g", "beta")),
                      A_log=x["A_log"].float(), dt_bias=x["dt_bias"].float(),
                      initial_state=x["initial_state"].float(), gate="softplus",
                      beta_logits=True, backend="reference")
    assert torch.allclose(out.detach(), ref, atol=1e-5)
    (out.square().sum() + final.sum()).backward()
    for n, v in t.items():
        assert v.grad is not None and v.grad.dtype == v.dtype, n
        assert torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0, n


def test_autograd_equals_the_binding():
    """The gradients of loss = <out, w> + <final_state, w_s> equal kda._C.prefill_backward's with
    d_out = w, d_final_state = w_s (bitwise: the same backward); with the final state unused
    (output_final_state=False) d_final_state is absent."""
    x, cu = make_inputs("softplus", seed=5)
    f = {n: v.float() for n, v in x.items()}
    w = torch.randn(12, 2, 8, dtype=torch.float32)
    w_s = torch.randn(3, 2, 8, 8, dtype=torch.float32)
    opts = dict(gate="softplus", beta_logits=True)
    for use_final in (True, False):
        leaves = {n: v.clone().requires_grad_() for n, v in f.items()}
        a = dict(leaves)
        res = kda.prefill(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("g"), a.pop("beta"),
                          cu_seqlens=cu, output_final_state=use_final, **a, **opts)
        if use_final:
            loss = (res[0] * w).sum() + (res[1] * w_s).sum()
        else:
            assert isinstance(res, torch.Tensor)
            loss = (res * w).sum()
        loss.backward()
        want = {"d" + n if n != "initial_state" else "d_initial_state": torch.empty_like(v)
                for n, v in f.items()}
        _C.prefill_backward(**f, cu_seqlens=cu, d_out=w, d_final_state=w_s if use_final else None,
                            **want, **opts)
        for n, v in leaves.items():
            key = "d" + n if n != "initial_state" else "d_initial_state"
            assert torch.equal(v.grad, want[key]), (n, use_final)
            assert v.grad.abs().sum() > 0, n


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
