"""kda.prefill under torch.autograd (kda._autograd): dtypes of the gradients, determinism, the
custom op's autograd formula under torch.compile, the no-grad path, refused arguments and the
missing CUDA backward. Skipped without torch; CUDA tests skipped without a GPU."""

import os
import shutil

import pytest

torch = pytest.importorskip("torch")

import kda  # noqa: E402
from kda import _autograd  # noqa: E402

NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
GATE = dict(gate="softplus", beta_logits=True)


def inputs(B=2, T=20, H=2, HV=4, K=16, V=16, seed=0, dtype=torch.float32, varlen=False):
    """Dense (or varlen: the same tokens packed with cu_seqlens) prefill inputs, fp32 gate
    parameters and initial state; q, k, v, g, beta in `dtype`."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=gen)

    x = dict(q=rnd(B, T, H, K, scale=0.5), k=rnd(B, T, H, K, scale=0.5), v=rnd(B, T, HV, V),
             g=rnd(B, T, HV, K), beta=rnd(B, T, HV))
    x = {n: t.to(dtype) for n, t in x.items()}
    x.update(A_log=torch.rand(HV, generator=gen), dt_bias=torch.rand(HV, K, generator=gen),
             initial_state=rnd(B, HV, V, K, scale=0.1))
    cu = None
    if varlen:
        for n in ("q", "k", "v", "g", "beta"):
            x[n] = x[n].flatten(0, 1).unsqueeze(0)
        cu = torch.tensor([0, T // 2, B * T], dtype=torch.int32)
    return x, cu


def leaves(x):
    return {n: t.detach().clone().requires_grad_() for n, t in x.items()}


def run(t, cu=None, **options):
    a = dict(t)
    return kda.prefill(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("g"), a.pop("beta"),
                       cu_seqlens=cu, output_final_state=True, **a, **dict(GATE, **options))


def loss_of(out, final, seed=1):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out.shape, generator=gen).bfloat16()  # representable in bf16, fp16, fp32
    w_s = torch.randn(final.shape, generator=gen)
    return (out.float() * w.float()).sum() + (final * w_s).sum()


def grads(x, cu=None, **options):
    t = leaves(x)
    loss_of(*run(t, cu, **options)).backward()
    return {n: v.grad for n, v in t.items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gradients_in_the_inputs_dtypes(dtype):
    """bf16/fp16 q, k, v, g, beta (fp32 gate parameters): every gradient in its input's dtype and
    equal, to its rounding, to the fp32 gradient at the same (rounded) values: the backward is
    the same fp64 computation, rounded once to each gradient's dtype."""
    x, _ = inputs(dtype=dtype)
    got = grads(x)
    want = grads({n: t.float() for n, t in x.items()})
    for n in NAMES:
        assert got[n].dtype == x[n].dtype, n
        assert want[n].dtype == torch.float32, n
        assert want[n].abs().sum() > 0, n
        # Within one ulp of the gradient's dtype (fp64 -> fp32 -> dtype may round twice; fp16's
        # subnormals have an absolute ulp of 2^-24).
        torch.testing.assert_close(got[n].float(), want[n], rtol=torch.finfo(got[n].dtype).eps,
                                   atol=2.0 ** -24, msg=n)


def test_fp32_state_and_bf16_initial_state():
    x, _ = inputs()
    x["initial_state"] = x["initial_state"].to(torch.bfloat16)
    t = leaves(x)
    out, final = run(t)
    assert final.dtype == torch.bfloat16
    loss_of(out, final.float()).backward()
    assert t["initial_state"].grad.dtype == torch.bfloat16
    assert t["initial_state"].grad.abs().sum() > 0


@pytest.mark.parametrize("varlen", [False, True])
def test_backward_is_deterministic(varlen):
    """Two backward calls (sequences across the 64-token checkpoints, all threads) give bitwise
    equal gradients, dA_log and ddt_bias (sums over tokens) included."""
    x, cu = inputs(T=150, varlen=varlen, seed=2)
    a, b = grads(x, cu), grads(x, cu)
    for n in NAMES:
        assert torch.equal(a[n], b[n]), n
    assert a["A_log"].abs().sum() > 0 and a["dt_bias"].abs().sum() > 0


def test_fused_qkv_views_and_unused_inputs():
    """q, k, v as views of one projection get their gradient slices; inputs that do not require
    grad get none; A_log given with the precomputed gate gets a zero gradient."""
    x, _ = inputs(H=2, HV=2)
    qkv = torch.cat([x["q"], x["k"], x["v"]], dim=-1).requires_grad_()
    q, k, v = qkv.split(16, dim=-1)
    g = -torch.exp(x["g"] - 1.5)
    A_log = x["A_log"][:2].clone().requires_grad_()
    out = kda.prefill(q, k, v, g, x["beta"].sigmoid(), A_log=A_log)
    out.square().sum().backward()
    ref = {n: x[n].detach().clone().requires_grad_() for n in ("q", "k", "v")}
    kda.prefill(ref["q"], ref["k"], ref["v"], g, x["beta"].sigmoid()).square().sum().backward()
    for i, n in enumerate(("q", "k", "v")):
        assert torch.equal(qkv.grad[..., 16 * i:16 * (i + 1)], ref[n].grad), n
    assert A_log.grad is not None and not A_log.grad.any()


def test_chunk_kda_shares_the_glue():
    """kda.fla.chunk_kda differentiates through kda.prefill (the same backward node)."""
    x, _ = inputs(H=2, HV=4)
    t = leaves({n: x[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")})
    o, _ = kda.fla.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"],
                             dt_bias=t["dt_bias"], use_gate_in_kernel=True,
                             use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True)
    assert type(o.grad_fn).__name__ == "PrefillFunctionBackward"
    o.sum().backward()
    r = leaves({n: x[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")})
    a = dict(r)
    kda.prefill(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("g"), a.pop("beta"), **a, **GATE,
                state_layout="k_first").sum().backward()
    for n in r:
        assert torch.equal(t[n].grad, r[n].grad), n


# --- torch.compile: the functional op's registered autograd formula ------------------------------

def test_functional_op_has_an_autograd_formula():
    x, _ = inputs(T=6)
    t = leaves(x)
    opts = _autograd._canonical(GATE)
    out, final = torch.ops.kda.prefill_functional(*(t[n] for n in NAMES), None,
                                                  *(opts[n] for n in _autograd.OPTIONS))
    assert out.grad_fn is not None
    loss_of(out, final).backward()
    want = grads(x)
    for n in NAMES:
        assert torch.equal(t[n].grad, want[n]), n


@pytest.mark.parametrize("varlen", [False, True])
def test_torch_compile_fullgraph_backward(varlen):
    """torch.compile(fullgraph=True) of a training step's loss (aot_eager: AOTAutograd traces the
    op's autograd formula into the backward graph; no C++ compiler needed) gives the eager
    gradients bitwise, for kda.prefill and kda.fla.chunk_kda."""
    x, cu = inputs(T=12, varlen=varlen, seed=4)

    def step(q, k, v, g, beta, A_log, dt_bias, initial_state):
        out, final = kda.prefill(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias,
                                 initial_state=initial_state, cu_seqlens=cu,
                                 output_final_state=True, **GATE)
        o2, _ = kda.fla.chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias.flatten(),
                                  use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                  cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
        return (out * v[..., :1]).square().sum() + final.square().sum() + o2.square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    te, tc = leaves(x), leaves(x)
    step(*(te[n] for n in NAMES)).backward()
    loss = compiled(*(tc[n] for n in NAMES))
    loss.backward()
    for n in NAMES:
        assert tc[n].grad is not None and tc[n].grad.abs().sum() > 0, n
        assert torch.equal(tc[n].grad, te[n].grad), n


def test_torch_compile_preallocated_outputs():
    """Under torch.compile a given out / final_state receives the functional op's results as
    in-place copies (the graph records them); gradients equal eager ones bitwise."""
    x, _ = inputs(T=10, seed=6)

    def step(q, k, v, g, beta, A_log, dt_bias, initial_state):
        o, h = torch.empty(v.shape), torch.empty(initial_state.shape)
        kda.prefill(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state,
                    out=o, final_state=h, **GATE)
        return o.square().sum() + h.square().sum()

    torch._dynamo.reset()
    te, tc = leaves(x), leaves(x)
    step(*(te[n] for n in NAMES)).backward()
    torch.compile(step, backend="aot_eager", fullgraph=True)(*(tc[n] for n in NAMES)).backward()
    for n in NAMES:
        assert tc[n].grad.abs().sum() > 0 and torch.equal(tc[n].grad, te[n].grad), n


@pytest.mark.skipif(not shutil.which(os.environ.get("CXX", "c++")), reason="no C++ compiler")
def test_torch_compile_inductor_backward():
    """The default backend (inductor) compiles the forward and backward graphs around the ops;
    the gradients equal eager ones to fp32 rounding (inductor fuses the loss's elementwise
    work), and a second call with another length runs the compiled code again."""
    def step(q, k, v, g, beta, A_log, dt_bias, initial_state):
        out, final = kda.prefill(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias,
                                 initial_state=initial_state, output_final_state=True, **GATE)
        return (out * 2).square().sum() + final.square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    for T in (8, 13):
        x, _ = inputs(T=T, seed=T)
        te, tc = leaves(x), leaves(x)
        step(*(te[n] for n in NAMES)).backward()
        compiled(*(tc[n] for n in NAMES)).backward()
        for n in NAMES:
            assert tc[n].grad.abs().sum() > 0, n
            torch.testing.assert_close(tc[n].grad, te[n].grad, rtol=1e-5, atol=1e-6, msg=n)


# --- the no-grad path ----------------------------------------------------------------------------

def test_no_grad_path_does_no_autograd_work(monkeypatch):
    """Without an input that requires grad (or under no_grad / inference_mode) kda.prefill never
    enters kda._autograd and returns tensors without a graph; with one, it does."""
    calls = []
    real = _autograd.prefill
    monkeypatch.setattr(_autograd, "prefill", lambda *a: calls.append(1) or real(*a))
    x, _ = inputs(T=6)
    out, final = run(x)
    assert out.grad_fn is None and final.grad_fn is None and not calls
    t = leaves(x)
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx():
            out, final = run(t)
        assert out.grad_fn is None and not out.requires_grad and not calls
    out, final = run(t)
    assert calls == [1] and out.grad_fn is not None and final.grad_fn is not None


def test_preallocated_outputs_are_written_in_the_graph():
    """A given out / final_state is written in place and carries the gradient (as a torch
    in-place op); the drop-in FlashKDA / MATE functions, which pass them, differentiate too."""
    x, _ = inputs(T=10, H=2, HV=2)
    x["g"] = -torch.exp(x["g"] - 1.5)
    want = grads(x, gate="precomputed", beta_logits=False)
    t = leaves(x)
    out, final = torch.full_like(x["v"], 7.0), torch.full_like(x["initial_state"], 7.0)
    a = dict(t)
    res = kda.prefill(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("g"), a.pop("beta"), **a,
                      out=out, final_state=final)
    assert res[0] is out and res[1] is final and out.grad_fn is not None
    loss_of(out, final).backward()
    for n in NAMES:
        assert torch.equal(t[n].grad, want[n]), n
    # FlashKDA's fwd (writes o and final_state) and MATE's chunk_kda (lower-bound gate).
    q, k, v, g, beta, A_log, dt_bias, h0 = (t[n] for n in NAMES)
    for n in NAMES:
        t[n].grad = None
    o, h = torch.empty_like(x["v"]), torch.empty_like(x["initial_state"])
    kda.fwd(q, k, v, g, beta, None, o, A_log, dt_bias, -5.0, initial_state=h0, final_state=h)
    (o.sum() + h.sum()).backward()
    first = {n: t[n].grad for n in NAMES}
    assert all(first[n].abs().sum() > 0 for n in NAMES)
    for n in NAMES:
        t[n].grad = None
    o2, h2 = kda.chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0,
                           output_final_state=True)
    (o2.sum() + h2.sum()).backward()
    for n in NAMES:
        assert torch.equal(t[n].grad, first[n]), n


# --- refused arguments and the missing CUDA backward ---------------------------------------------

def test_refused_arguments_name_themselves():
    x, _ = inputs(T=6)
    t = leaves(x)
    a = {n: t[n] for n in ("A_log", "dt_bias")}
    qkvgb = [t[n] for n in ("q", "k", "v", "g", "beta")]
    with pytest.raises(ValueError, match="argument 'out'"):  # the forward's own validation
        kda.prefill(*qkvgb, **a, **GATE, out=torch.empty_like(x["v"])[..., :8])
    with pytest.raises(NotImplementedError, match="argument 'state_pool'"):
        kda.prefill(*qkvgb, **a, **GATE, state_pool=torch.zeros(4, 4, 16, 16),
                    state_indices=torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="argument 'checkpoint_every'"):
        kda.prefill(*qkvgb, **a, **GATE, checkpoint_every=64)
    with pytest.raises(ValueError, match="argument 'gate'"):  # the forward's own validation
        kda.prefill(*qkvgb, **a, gate="nope")
    with pytest.raises(TypeError, match="argument 'output_final_state'"):
        kda.prefill(*qkvgb, **a, **GATE, output_final_state=1)


def test_backward_on_another_device_raises():
    """The backward op's implementation refuses tensors that are neither CPU nor CUDA ones before
    it reads or allocates anything (meta tensors here)."""
    x, _ = inputs(T=6)
    m = {n: t.to("meta") for n, t in x.items()}
    opts = _autograd._canonical(GATE)
    with pytest.raises(NotImplementedError, match="CPU and CUDA tensors, got meta tensors"):
        _autograd.backward_impl(*(m[n] for n in NAMES), None, torch.ones_like(m["v"]), None,
                                [True] * 8, **opts)


cuda = pytest.mark.skipif(not (torch.cuda.is_available() and kda.cuda_available()),
                          reason="no supported CUDA device")


def rel_l2(got, ref):
    got, ref = got.double().cpu(), ref.double().cpu()
    return float((got - ref).norm() / ref.norm())


@cuda
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("varlen", [False, True])
def test_cuda_backward_matches_cpu_reference(compiled, varlen):
    """Gradients through CUDA tensors (the CUDA backward, eager and under torch.compile) against
    the fp64 CPU reference on the same bf16-exact inputs: within the bf16 rounding of the
    gradients (~2e-3) plus the kernels' allowance (2.5e-3, tests/test_gpu_backward.cpp)."""
    x, cu = inputs(B=2, T=100, H=1, HV=2, K=128, V=128, dtype=torch.bfloat16, varlen=varlen)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(x["v"].shape, generator=gen)
    wf = torch.randn(x["initial_state"].shape, generator=gen)

    def step(q, k, v, g, beta, A_log, dt_bias, initial_state, w, wf, cu):
        out, final = kda.prefill(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu,
                                 initial_state=initial_state, output_final_state=True, **GATE)
        return (out.float() * w).sum() + (final * wf).sum()

    t = {n: v.cuda().requires_grad_() for n, v in x.items()}
    f = step
    if compiled:
        torch._dynamo.reset()
        f = torch.compile(step, fullgraph=True)
    loss = f(*(t[n] for n in NAMES), w.cuda(), wf.cuda(), None if cu is None else cu.cuda())
    got = torch.autograd.grad(loss, [t[n] for n in NAMES])
    r = {n: v.float().requires_grad_() for n, v in x.items()}
    ref = torch.autograd.grad(step(*(r[n] for n in NAMES), w, wf, cu), [r[n] for n in NAMES])
    for name, a, b in zip(NAMES, got, ref):
        assert a.dtype == x[name].dtype and a.device.type == "cuda", name
        assert rel_l2(a, b) < 5e-3, (name, rel_l2(a, b))
