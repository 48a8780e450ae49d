"""kda.fla against FLA's own reference functions (fla-core 0.6.0, ``fla.ops.kda.naive``).

The parameter grids follow FLA's forward tests for KDA (tests/ops/test_kda.py: test_chunk,
test_chunk_varlen, test_chunk_state_v_first, test_chunk_use_beta_sigmoid_in_kernel,
test_fused_recurrent*, test_fused_recurrent_vllm_decode), with shorter sequences so that the
pure-torch reference stays fast on a CPU. Skipped without torch or fla-core; each case runs on
the CPU and, when present, on a CUDA device (where the kernels take bf16/fp16 inputs: fp32 cases
run in bf16 there, and head dims the CUDA kernels do not take are skipped).

Tolerances (docs/design.md section 5): the reference is FLA's fp32 recurrence rounded to the
output dtype, kda computes in fp32 and rounds once: the bar of the output dtype
(kdatest.tolerance). The CUDA prefill keeps some operands in bf16, so on CUDA the output bar is
that of bf16 and the fp32 final state's is 4e-3 (design.md).
"""

import inspect

import pytest

import kda
from kdatest import tolerance

torch = pytest.importorskip("torch")
naive = pytest.importorskip("fla.ops.kda.naive")
fla_gate = pytest.importorskip("fla.ops.kda.gate")
import torch.nn.functional as F  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and kda.cuda_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
CUDA_STATE_TOL = 4e-3


def rel(got, ref):
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert torch.isfinite(got).all(), "non-finite values in the result"
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def check(what, got, ref, dtype, device, state=False):
    if device == "cuda":
        tol = CUDA_STATE_TOL if state else max(tolerance("bf16"), tolerance(_name(dtype)))
    else:
        tol = tolerance("fp32" if state else _name(dtype))
    err = rel(got, ref)
    assert err <= tol, f"{what}: rel L2 {err:.3g} > {tol:.3g}"


def _name(dtype):
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


def on_device(device, dtype, D, chunked):
    """The dtype a case runs in on `device`; skips head dims its kernels do not take."""
    if device == "cpu":
        return dtype
    if (chunked and D != 128) or (not chunked and D % 32 != 0):
        pytest.skip(f"the CUDA kernels do not take head dim {D}")
    return torch.bfloat16 if dtype == torch.float32 else dtype


def to(device, *xs):
    return [None if x is None else x.to(device) for x in xs]


def normalize(x):
    return F.normalize(x.float(), p=2, dim=-1)


def reference(q, k, v, g, beta, scale, h0, l2norm):
    """FLA's naive recurrence (K-first states) of the given inputs."""
    if l2norm:
        q, k = normalize(q), normalize(k)
    return naive.naive_recurrent_kda(q=q, k=k, v=v, g=g, beta=beta, scale=scale,
                                     initial_state=h0, output_final_state=True)


def reference_varlen(q, k, v, g, beta, scale, h0, cu, l2norm):
    outs, states = [], []
    for n in range(len(cu) - 1):
        s, e = int(cu[n]), int(cu[n + 1])
        o, ht = reference(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], scale,
                          h0[n:n + 1], l2norm)
        outs.append(o)
        states.append(ht)
    return torch.cat(outs, 1), torch.cat(states, 0)


# --- signatures ----------------------------------------------------------------------------------

def test_signatures_are_fla_s():
    from fla.ops.kda import chunk_kda, fused_recurrent_kda
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    for theirs, ours in ((chunk_kda, kda.fla.chunk_kda),
                         (fused_recurrent_kda, kda.fla.fused_recurrent_kda),
                         (fused_recurrent_kda_fwd, kda.fla.fused_recurrent_kda_fwd)):
        a = [(n, p.default, p.kind) for n, p in inspect.signature(theirs).parameters.items()]
        b = [(n, p.default, p.kind) for n, p in inspect.signature(ours).parameters.items()]
        assert a == b, ours.__name__


# --- chunk_kda -----------------------------------------------------------------------------------

CHUNK = [  # FLA test_chunk (forward), shorter T
    # B, T, H, HV, D, scale, gate_norm, mask_p, l2norm_in_kernel, gate_in_kernel, dtype,
    # safe_gate, chunk_size
    (1, 63, 1, 1, 64, 1, 1, 0, False, False, torch.float16, True, 64),
    (2, 100, 3, 3, 60, 1, 1, 0, False, False, torch.float16, True, 64),
    (2, 200, 3, 3, 64, 0.1, 1, 0.5, False, False, torch.float16, False, 64),
    (3, 130, 4, 4, 100, 1, 0.1, 0, False, False, torch.float16, False, 64),
    (2, 150, 2, 2, 128, 0.1, 1, 0, True, False, torch.float16, True, 64),
    (2, 150, 2, 2, 128, 0.1, 10, 0, False, True, torch.float16, False, 64),
    (2, 128, 2, 4, 64, 0.1, 1, 0, False, False, torch.float16, False, 64),
    (2, 128, 2, 8, 64, 0.1, 1, 0, False, True, torch.float16, False, 64),
    (2, 128, 2, 4, 128, 0.1, 1, 0, True, True, torch.float16, False, 64),
    (2, 160, 2, 4, 64, 0.1, 1, 0, False, True, torch.float16, True, 32),
    (2, 128, 2, 4, 64, 0.1, 1, 0, True, True, torch.bfloat16, True, 64),
    (2, 160, 2, 4, 64, 0.1, 1, 0, False, True, torch.bfloat16, True, 32),
    (2, 128, 2, 8, 128, 0.1, 1, 0, True, True, torch.bfloat16, False, 64),
    (1, 70, 1, 2, 32, 1, 1, 0, False, False, torch.float32, False, 64),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("B", "T", "H", "HV", "D", "scale", "gate_norm", "mask_p", "l2norm",
                          "gate_in_kernel", "dtype", "safe_gate", "chunk_size"), CHUNK)
def test_chunk(device, B, T, H, HV, D, scale, gate_norm, mask_p, l2norm, gate_in_kernel, dtype,
               safe_gate, chunk_size):
    dtype = on_device(device, dtype, D, chunked=True)
    torch.manual_seed(42)
    q, k = torch.rand(B, T, H, D, dtype=dtype), torch.rand(B, T, H, D, dtype=dtype)
    v = torch.rand(B, T, HV, D, dtype=dtype)
    g = torch.randn(B, T, HV, D, dtype=dtype if gate_in_kernel else torch.float)
    A_log = dt_bias = lower_bound = None
    if gate_in_kernel:
        A_log, dt_bias = torch.randn(HV), torch.randn(HV * D)
    else:
        g = F.logsigmoid(g) / gate_norm
        g = g * (torch.rand_like(g) > mask_p)
    if safe_gate:
        lower_bound = -5.0
        if not gate_in_kernel:
            g = g.clamp(-5, 0)
    beta = torch.randn(B, T, HV, dtype=dtype).sigmoid()
    h0 = torch.randn(B, HV, D, D)
    if not l2norm:
        q, k = normalize(q).to(dtype), normalize(k).to(dtype)
    if gate_in_kernel:
        gate_fn = fla_gate.naive_kda_lowerbound_gate if safe_gate else fla_gate.naive_kda_gate
        g_ref = gate_fn(g, A_log, dt_bias)
    else:
        g_ref = g
    ref, ref_ht = reference(q, k, v, g_ref, beta, scale, h0, l2norm)
    q, k, v, g, beta, h0, A_log, dt_bias = to(device, q, k, v, g, beta, h0, A_log, dt_bias)
    o, ht = kda.fla.chunk_kda(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias,
                              scale=scale, initial_state=h0, output_final_state=True,
                              use_qk_l2norm_in_kernel=l2norm, use_gate_in_kernel=gate_in_kernel,
                              safe_gate=safe_gate, lower_bound=lower_bound,
                              chunk_size=chunk_size)
    assert o.dtype == dtype and ht.dtype == torch.float32 and ht.shape == (B, HV, D, D)
    check("o", o, ref, dtype, device)
    check("ht", ht, ref_ht, dtype, device, state=True)


VARLEN = [  # FLA test_chunk_varlen: H, D, mask_p, cu_seqlens, dtype, gate_in_kernel, safe_gate
    (4, 60, 0.1, [0, 15], torch.float16, True, False),
    (4, 64, 0.9, [0, 64, 125, 250], torch.float16, True, False),
    (2, 128, 0.5, [0, 64, 125, 200], torch.float16, False, False),
    (4, 100, 0, [0, 15, 100, 150, 150, 300], torch.float16, True, False),
    (1, 256, 0, [0, 50, 75, 120, 140], torch.float16, False, True),
    (4, 128, 0.1, [0, 31, 96, 160], torch.bfloat16, True, False),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("H", "D", "mask_p", "cu_seqlens", "dtype", "gate_in_kernel",
                          "safe_gate"), VARLEN)
def test_chunk_varlen(device, H, D, mask_p, cu_seqlens, dtype, gate_in_kernel, safe_gate):
    dtype = on_device(device, dtype, D, chunked=True)
    torch.manual_seed(42)
    cu = torch.tensor(cu_seqlens, dtype=torch.long)
    T, N = cu_seqlens[-1], len(cu_seqlens) - 1
    q = torch.randn(1, T, H, D, dtype=dtype)
    k = normalize(torch.randn(1, T, H, D)).to(dtype)
    v = torch.randn(1, T, H, D, dtype=dtype)
    g = torch.randn(1, T, H, D, dtype=dtype if gate_in_kernel else torch.float)
    A_log = dt_bias = None
    if gate_in_kernel:
        A_log = torch.log(torch.empty(1, 1, H, 1).uniform_(1, 16))  # FLA's [1, 1, H, 1]
        dt_bias = torch.randn(H * D)
    else:
        g = F.logsigmoid(g) * (torch.rand_like(g) > mask_p)
    mask = torch.rand_like(g.float()) > mask_p
    g = (g * mask + (~mask) * (-1000)).to(g.dtype)  # decays of -1000: "forget everything"
    if safe_gate:
        g = g.clamp(-5, 0)
    beta = torch.rand(1, T, H, dtype=dtype).sigmoid()
    h0 = torch.randn(N, H, D, D)
    g_ref = fla_gate.naive_kda_gate(g.float(), A_log, dt_bias) if gate_in_kernel else g
    qn = normalize(q).to(dtype)
    qn, k, v, g, beta, h0, A_log, dt_bias, cu_d = to(device, qn, k, v, g, beta, h0, A_log,
                                                     dt_bias, cu)
    o, ht = kda.fla.chunk_kda(q=qn, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias,
                              initial_state=h0, output_final_state=True, cu_seqlens=cu_d,
                              cu_seqlens_cpu=cu, use_gate_in_kernel=gate_in_kernel,
                              safe_gate=safe_gate)
    ref, ref_ht = reference_varlen(qn.cpu(), k.cpu(), v.cpu(), g_ref, beta.cpu(), None,
                                   h0.cpu(), cu, False)
    check("o", o, ref, dtype, device)
    check("ht", ht, ref_ht, dtype, device, state=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("B", "T", "H", "D"), [(1, 63, 1, 64), (2, 100, 3, 60), (2, 130, 2, 128)])
def test_chunk_state_v_first(device, B, T, H, D):
    dtype = on_device(device, torch.float16, D, chunked=True)
    torch.manual_seed(42)
    q, k = normalize(torch.rand(B, T, H, D)).to(dtype), normalize(torch.rand(B, T, H, D)).to(dtype)
    v = torch.rand(B, T, H, D, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, H, D))
    beta = torch.randn(B, T, H, dtype=dtype).sigmoid()
    h0_kv = torch.randn(B, H, D, D)
    ref, ref_ht = reference(q, k, v, g, beta, None, h0_kv, False)
    q, k, v, g, beta, h0_vk = to(device, q, k, v, g, beta, h0_kv.transpose(-1, -2).contiguous())
    o, ht = kda.fla.chunk_kda(q, k, v, g, beta, initial_state=h0_vk, output_final_state=True,
                              state_v_first=True)
    check("o", o, ref, dtype, device)
    check("ht", ht.transpose(-1, -2), ref_ht, dtype, device, state=True)
    with pytest.warns(DeprecationWarning):
        _o2, ht2 = kda.fla.chunk_kda(q, k, v, g, beta, initial_state=h0_vk,
                                    output_final_state=True, transpose_state_layout=True)
    torch.testing.assert_close(ht2, ht, rtol=0, atol=0)
    with pytest.raises(ValueError, match="transpose_state_layout"):
        kda.fla.chunk_kda(q, k, v, g, beta, state_v_first=True, transpose_state_layout=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("B", "T", "H", "D", "allow_neg_eigval", "dtype"), [
    (1, 200, 4, 128, False, torch.bfloat16), (1, 200, 4, 128, True, torch.bfloat16),
    (2, 96, 2, 64, True, torch.float16)])
def test_chunk_use_beta_sigmoid_in_kernel(device, B, T, H, D, allow_neg_eigval, dtype):
    dtype = on_device(device, dtype, D, chunked=True)
    torch.manual_seed(42)
    q, k = normalize(torch.rand(B, T, H, D)).to(dtype), normalize(torch.rand(B, T, H, D)).to(dtype)
    v = torch.rand(B, T, H, D, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, H, D))
    beta_raw = torch.randn(B, T, H, dtype=dtype)
    h0 = torch.randn(B, H, D, D)
    beta_ref = beta_raw.float().sigmoid() * (2 if allow_neg_eigval else 1)
    ref, ref_ht = reference(q, k, v, g, beta_ref, None, h0, False)
    q, k, v, g, beta_raw, h0 = to(device, q, k, v, g, beta_raw, h0)
    o, ht = kda.fla.chunk_kda(q, k, v, g, beta_raw, initial_state=h0, output_final_state=True,
                              use_beta_sigmoid_in_kernel=True, allow_neg_eigval=allow_neg_eigval)
    check("o", o, ref, dtype, device)
    check("ht", ht, ref_ht, dtype, device, state=True)


def test_defaults_are_fla_s_six_points():
    """What kda.chunk_kda (MATE's signature) does differently, here as FLA: softplus gate with
    A_log/dt_bias, beta as given, K-first states, no l2norm, (o, None) returned, fp32 state."""
    torch.manual_seed(3)
    B, T, H, D = 1, 40, 2, 32
    q, k = torch.rand(B, T, H, D), torch.rand(B, T, H, D)
    q, k = normalize(q), normalize(k)
    v, beta = torch.rand(B, T, H, D), torch.rand(B, T, H)
    g_raw, A_log, dt_bias = torch.randn(B, T, H, D), torch.rand(H), torch.randn(H * D)
    h0 = torch.randn(B, H, D, D)
    res = kda.fla.chunk_kda(q.bfloat16(), k.bfloat16(), v.bfloat16(), g_raw, beta)
    assert isinstance(res, tuple) and res[1] is None
    o, ht = kda.fla.chunk_kda(q, k, v, g_raw, beta, A_log=A_log, dt_bias=dt_bias,
                              use_gate_in_kernel=True, initial_state=h0, output_final_state=True)
    ref, ref_ht = reference(q, k, v, fla_gate.naive_kda_gate(g_raw, A_log, dt_bias), beta, None,
                            h0, False)
    assert ht.dtype == torch.float32
    check("o", o, ref, torch.float32, "cpu")
    check("ht", ht, ref_ht, torch.float32, "cpu", state=True)
    ob, htb = kda.fla.chunk_kda(q.bfloat16(), k.bfloat16(), v.bfloat16(), g_raw, beta,
                                A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True,
                                initial_state=h0, output_final_state=True)
    assert ob.dtype == torch.bfloat16 and htb.dtype == torch.float32


@pytest.mark.parametrize("varlen", [False, True])
def test_return_intermediate_states(varlen):
    """h: the state at the start of every 64-token chunk, as FLA returns it."""
    torch.manual_seed(5)
    H, D = 2, 32
    lengths = [130, 0, 64, 10] if varlen else [150, 150]
    T = sum(lengths) if varlen else lengths[0]
    B = 1 if varlen else len(lengths)
    q, k = normalize(torch.rand(B, T, H, D)), normalize(torch.rand(B, T, H, D))
    v, beta = torch.rand(B, T, H, D), torch.rand(B, T, H)
    g = F.logsigmoid(torch.randn(B, T, H, D))
    h0 = torch.randn(len(lengths), H, D, D)
    cu = torch.tensor([0, *list(torch.tensor(lengths).cumsum(0))], dtype=torch.long)
    with torch.inference_mode():
        _o, _ht, h = kda.fla.chunk_kda(q, k, v, g, beta, initial_state=h0,
                                     output_final_state=True, return_intermediate_states=True,
                                     cu_seqlens=cu if varlen else None)
    expect = []
    for n, L in enumerate(lengths):
        s = int(cu[n]) if varlen else 0
        b = 0 if varlen else n
        for c in range(-(-L // 64)):
            if c == 0:
                expect.append(h0[n])
                continue
            e = s + 64 * c
            _, st = reference(q[b:b + 1, s:e], k[b:b + 1, s:e], v[b:b + 1, s:e],
                              g[b:b + 1, s:e], beta[b:b + 1, s:e], None, h0[n:n + 1], False)
            expect.append(st[0])
    want = torch.stack(expect).reshape(1 if varlen else B, -1, H, D, D)
    assert h.shape == want.shape and h.dtype == q.dtype
    check("h", h, want, torch.float32, "cpu", state=True)
    with pytest.raises(ValueError, match="return_intermediate_states"):
        kda.fla.chunk_kda(q, k, v, g, beta, return_intermediate_states=True)


# --- fused_recurrent_kda -------------------------------------------------------------------------

RECURRENT = [  # FLA test_fused_recurrent: B, T, H, HV, D, scale, gate_norm, l2norm_in_kernel
    (1, 64, 1, 1, 64, 1, 1, False),
    (2, 100, 3, 3, 60, 1, 1, False),
    (3, 100, 4, 4, 100, 0.1, 1, True),
    (2, 40, 4, 4, 128, 0.1, 1, False),
    (2, 30, 2, 4, 60, 1, 1, False),
    (2, 50, 2, 8, 128, 0.1, 1, True),
    (3, 7, 2, 4, 32, 1, 1, True),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("B", "T", "H", "HV", "D", "scale", "gate_norm", "l2norm"), RECURRENT)
def test_fused_recurrent(device, B, T, H, HV, D, scale, gate_norm, l2norm):
    dtype = on_device(device, torch.float32, D, chunked=T > 64)
    torch.manual_seed(42)
    q, k = torch.rand(B, T, H, D, dtype=dtype), torch.rand(B, T, H, D, dtype=dtype)
    v = torch.rand(B, T, HV, D, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, HV, D)) / gate_norm
    beta = torch.randn(B, T, HV, dtype=dtype).sigmoid()
    h0 = torch.randn(B, HV, D, D)
    if not l2norm:
        q, k = normalize(q).to(dtype), normalize(k).to(dtype)
    ref, ref_ht = reference(q, k, v, g, beta, scale, h0, l2norm)
    q, k, v, g, beta, h0 = to(device, q, k, v, g, beta, h0)
    h0_before = h0.clone()
    o, ht = kda.fla.fused_recurrent_kda(q=q, k=k, v=v, g=g, beta=beta, scale=scale,
                                        initial_state=h0, output_final_state=True,
                                        use_qk_l2norm_in_kernel=l2norm)
    assert torch.equal(h0, h0_before)  # never written
    assert o.dtype == dtype and ht.dtype == torch.float32
    check("o", o, ref, dtype, device)
    check("ht", ht, ref_ht, dtype, device, state=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("B", "T", "H", "HV", "D", "scale", "has_a_log", "has_dt_bias",
                          "safe_gate", "dtype"), [  # FLA test_fused_recurrent_gate_in_kernel
    (1, 64, 1, 1, 64, 1, True, False, False, torch.float),
    (2, 60, 2, 2, 64, 1, True, True, False, torch.float),
    (2, 50, 2, 4, 64, 0.1, True, True, True, torch.float16),
    (3, 100, 2, 8, 128, 1, True, False, False, torch.float16),
    (1, 64, 1, 1, 64, 1, False, False, True, torch.float),
    (2, 60, 2, 4, 64, 1, False, True, True, torch.float),
    (2, 20, 2, 4, 64, 1, False, True, False, torch.float),  # FLA's kernel: A_log read as 1
])
def test_fused_recurrent_gate_in_kernel(device, B, T, H, HV, D, scale, has_a_log, has_dt_bias,
                                        safe_gate, dtype):
    dtype = on_device(device, dtype, D, chunked=T > 64)
    torch.manual_seed(42)
    q, k = torch.rand(B, T, H, D, dtype=dtype), torch.rand(B, T, H, D, dtype=dtype)
    v = torch.rand(B, T, HV, D, dtype=dtype)
    beta = torch.rand(B, T, HV, dtype=dtype).sigmoid()
    g_raw = torch.randn(B, T, HV, D)
    A_log = torch.log(torch.empty(HV).uniform_(1, 16)) if has_a_log else None
    dt_bias = torch.randn(HV * D) if has_dt_bias else None
    h0 = torch.randn(B, HV, D, D)
    lower_bound = -5.0 if safe_gate else None
    if safe_gate:
        g_ref = fla_gate.naive_kda_lowerbound_gate(g_raw, A_log, dt_bias)
    else:
        g_ref = fla_gate.naive_kda_gate(g_raw, A_log if has_a_log else torch.ones(HV), dt_bias)
    ref, ref_ht = reference(q, k, v, g_ref, beta, scale, h0, True)
    q, k, v, g_raw, beta, h0, A_log, dt_bias = to(device, q, k, v, g_raw, beta, h0, A_log,
                                                  dt_bias)
    o, ht = kda.fla.fused_recurrent_kda(q=q, k=k, v=v, g=g_raw, beta=beta, A_log=A_log,
                                        dt_bias=dt_bias, scale=scale, initial_state=h0,
                                        output_final_state=True, use_qk_l2norm_in_kernel=True,
                                        use_gate_in_kernel=True, lower_bound=lower_bound)
    check("o", o, ref, dtype, device)
    check("ht", ht, ref_ht, dtype, device, state=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("B", "T", "H", "D", "allow_neg_eigval"), [
    (2, 60, 4, 64, False), (2, 60, 4, 64, True), (1, 100, 3, 60, True)])
def test_fused_recurrent_beta_sigmoid_and_state_v_first(device, B, T, H, D, allow_neg_eigval):
    dtype = on_device(device, torch.float32, D, chunked=T > 64)
    torch.manual_seed(42)
    q, k = normalize(torch.rand(B, T, H, D)).to(dtype), normalize(torch.rand(B, T, H, D)).to(dtype)
    v = torch.rand(B, T, H, D, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, H, D))
    beta_raw = torch.logit(torch.randn(B, T, H).sigmoid().clamp(1e-4, 1 - 1e-4)).to(dtype)
    h0 = torch.randn(B, H, D, D)
    ref, ref_ht = reference(q, k, v, g, beta_raw.float().sigmoid() * (1 + allow_neg_eigval),
                            None, h0, False)
    q, k, v, g, beta_raw, h0 = to(device, q, k, v, g, beta_raw, h0)
    o, ht = kda.fla.fused_recurrent_kda(q, k, v, g, beta_raw, initial_state=h0.transpose(-1, -2),
                                        output_final_state=True, state_v_first=True,
                                        use_beta_sigmoid_in_kernel=True,
                                        allow_neg_eigval=allow_neg_eigval)
    check("o", o, ref, dtype, device)
    check("ht", ht.transpose(-1, -2), ref_ht, dtype, device, state=True)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_recurrent_beta_per_value_row_and_varlen(device):
    torch.manual_seed(8)
    H, D, cu = 2, 32, torch.tensor([0, 3, 3, 9], dtype=torch.int32)
    T, N = 9, 3
    dtype = on_device(device, torch.float32, D, chunked=False)
    q, k = normalize(torch.rand(1, T, H, D)).to(dtype), normalize(torch.rand(1, T, H, D)).to(dtype)
    v = torch.rand(1, T, H, D, dtype=dtype)
    g = F.logsigmoid(torch.randn(1, T, H, D))
    beta = torch.rand(1, T, H, D, dtype=dtype)  # one beta per value row
    h0 = torch.randn(N, H, D, D).bfloat16()  # any dtype: read in fp32
    outs, states = [], []
    for n in range(N):
        s, e = int(cu[n]), int(cu[n + 1])
        S = h0[n].float()
        o = torch.zeros(1, e - s, H, D)
        for t in range(s, e):  # the recurrence with a [V] beta (naive_recurrent_kda takes [HV])
            S = S * g[0, t, :, :, None].exp()
            u = beta[0, t].float() * (v[0, t].float() - (k[0, t].float()[..., None] * S).sum(-2))
            S = S + k[0, t].float()[..., None] * u[:, None, :]
            o[0, t - s] = ((q[0, t].float() * D ** -0.5)[..., None] * S).sum(-2)
        outs.append(o)
        states.append(S)
    ref, ref_ht = torch.cat(outs, 1), torch.stack(states)
    args = to(device, q, k, v, g, beta, h0, cu)
    o, ht = kda.fla.fused_recurrent_kda(*args[:5], initial_state=args[5], cu_seqlens=args[6],
                                        output_final_state=True)
    check("o", o, ref, dtype, device)
    check("ht", ht, ref_ht, dtype, device, state=True)


# --- fused_recurrent_kda_fwd (vLLM-style callers) ------------------------------------------------

def step_reference(q, k, v, g, beta, pool, slot, scale, l2norm, t0, t1):
    """One sequence's tokens [t0, t1) from pool[slot]: (o, new state)."""
    return reference(q[:, t0:t1], k[:, t0:t1], v[:, t0:t1], g[:, t0:t1], beta[:, t0:t1], scale,
                     pool[slot].unsqueeze(0).float(), l2norm)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("B", "H", "D", "scale", "gate_norm", "l2norm", "gate_in_kernel",
                          "safe_gate", "dtype"), [  # FLA test_fused_recurrent_vllm_decode
    (16, 4, 128, 0.1, 1.0, True, False, False, torch.bfloat16),
    (32, 2, 64, 1.0, 1.0, False, False, False, torch.float16),
    (7, 4, 128, 0.5, 0.5, True, False, False, torch.bfloat16),
    (16, 4, 128, 0.1, 1.0, True, True, False, torch.bfloat16),
    (32, 2, 64, 1.0, 1.0, False, True, False, torch.float16),
    (7, 4, 128, 0.5, 0.5, True, True, True, torch.bfloat16),
])
def test_vllm_decode(device, B, H, D, scale, gate_norm, l2norm, gate_in_kernel, safe_gate,
                     dtype):
    """Continuous batching: one token per sequence against a pool, slots through
    ssm_state_indices; slots no row uses keep their (huge) values bit for bit; a negative slot
    is a padding row."""
    torch.manual_seed(42)
    P = B * 3
    pool = torch.randn(P, H, D, D)
    idx = torch.randperm(P)[:B].int()
    idx[1] = -1  # padding row (FLA 0.6.0 has no padding rule: it reads outside the pool)
    untouched = torch.ones(P, dtype=torch.bool)
    untouched[idx[idx >= 0].long()] = False
    pool[untouched] = 1e30
    q, k = torch.rand(1, B, H, D, dtype=dtype), torch.rand(1, B, H, D, dtype=dtype)
    v = torch.rand(1, B, H, D, dtype=dtype)
    g = torch.randn(1, B, H, D, dtype=dtype if gate_in_kernel else torch.float)
    A_log = dt_bias = lower_bound = None
    if gate_in_kernel:
        A_log = torch.log(torch.randn(1, 1, H, 1).uniform_(1, 16)).squeeze()
        dt_bias = torch.randn(H * D)
        lower_bound = -5.0 if safe_gate else None
        gate_fn = fla_gate.naive_kda_lowerbound_gate if safe_gate else fla_gate.naive_kda_gate
        g_ref = gate_fn(g, A_log, dt_bias)
    else:
        g = F.logsigmoid(g) / gate_norm
        g_ref = g
    beta = torch.randn(1, B, H, dtype=dtype).sigmoid()
    cu = torch.arange(0, B + 1, dtype=torch.int32)
    qi, ki = (q, k) if l2norm else (normalize(q).to(dtype), normalize(k).to(dtype))
    ref_pool, ref_out = pool.clone(), torch.zeros(1, B, H, D)
    for i in range(B):
        if idx[i] < 0:
            continue
        o_i, ht_i = step_reference(qi, ki, v, g_ref, beta, ref_pool, int(idx[i]), scale, l2norm,
                                   i, i + 1)
        ref_out[:, i] = o_i[:, 0].float()
        ref_pool[int(idx[i])] = ht_i[0]
    args = to(device, qi, ki, v, g, beta, A_log, dt_bias, pool, cu, idx)
    tri_pool = args[7]
    o, final = kda.fla.fused_recurrent_kda_fwd(
        q=args[0], k=args[1], v=args[2], g=args[3], beta=args[4], A_log=args[5],
        dt_bias=args[6], initial_state=tri_pool, scale=scale, output_final_state=False,
        inplace_final_state=True, cu_seqlens=args[8], ssm_state_indices=args[9],
        num_accepted_tokens=None, use_qk_l2norm_in_kernel=l2norm,
        use_gate_in_kernel=gate_in_kernel, lower_bound=lower_bound)
    assert final is tri_pool
    live = idx[idx >= 0].long()
    check("o", o, ref_out.to(dtype), dtype, device)
    assert torch.count_nonzero(o[:, 1].float()) == 0  # padding row
    check("ht", tri_pool.cpu()[live], ref_pool[live], dtype, device, state=True)
    assert torch.equal(tri_pool.cpu()[untouched], pool[untouched])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_speculative_decode(device, pool_dtype):
    """[N, T] slots: sequence n reads slot idx[n, accepted[n] - 1] and writes the state after
    token t to idx[n, t] (FLA's continuous-batching semantics)."""
    torch.manual_seed(9)
    N, T, H, D, P = 3, 3, 2, 32, 12
    dtype = torch.bfloat16
    pool = torch.randn(P, H, D, D).to(pool_dtype)
    idx = torch.randperm(P)[:N * T].reshape(N, T).to(torch.int64)
    accepted = torch.tensor([1, 3, 2], dtype=torch.int32)
    q, k = torch.rand(N, T, H, D, dtype=dtype), torch.rand(N, T, H, D, dtype=dtype)
    v = torch.rand(N, T, H, D, dtype=dtype)
    g = F.logsigmoid(torch.randn(N, T, H, D))
    beta = torch.rand(N, T, H, dtype=dtype)
    ref_pool, ref_out = pool.clone(), torch.zeros(N, T, H, D)
    for n in range(N):
        S = pool[int(idx[n, int(accepted[n]) - 1])].float()[None]
        for t in range(T):
            o_t, S = reference(q[n:n + 1, t:t + 1], k[n:n + 1, t:t + 1], v[n:n + 1, t:t + 1],
                               g[n:n + 1, t:t + 1], beta[n:n + 1, t:t + 1], None, S, True)
            S = S.to(pool_dtype).float()  # a bf16 pool is rounded after every token
            ref_out[n, t] = o_t[0, 0].float()
            ref_pool[int(idx[n, t])] = S[0].to(pool_dtype)
    args = to(device, q, k, v, g, beta, pool.clone(), idx, accepted)
    o, final = kda.fla.fused_recurrent_kda_fwd(
        *args[:5], initial_state=args[5], ssm_state_indices=args[6],
        num_accepted_tokens=args[7], use_qk_l2norm_in_kernel=True)
    check("o", o, ref_out.to(dtype), dtype, device)
    check("ht", final.cpu().float(), ref_pool.float(), pool_dtype, device, state=True)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_recurrent_kda_fwd_separate_final_state(device):
    """inplace_final_state=False: the pool is read, never written; without indices the final
    state is a new fp32 [N, ...]; with indices its row r holds the state after token r."""
    torch.manual_seed(10)
    N, H, D, P = 4, 2, 32, 6
    dtype = torch.bfloat16
    pool = torch.randn(P, H, D, D)
    q, k = torch.rand(N, 1, H, D, dtype=dtype), torch.rand(N, 1, H, D, dtype=dtype)
    v = torch.rand(N, 1, H, D, dtype=dtype)
    g = F.logsigmoid(torch.randn(N, 1, H, D))
    beta = torch.rand(N, 1, H, dtype=dtype)
    idx = torch.tensor([5, 0, 3, 2], dtype=torch.int32)
    args = to(device, q, k, v, g, beta, pool.clone(), idx)
    o, final = kda.fla.fused_recurrent_kda_fwd(*args[:5], initial_state=args[5],
                                               inplace_final_state=False,
                                               output_final_state=True, ssm_state_indices=args[6],
                                               use_qk_l2norm_in_kernel=True)
    assert torch.equal(args[5].cpu(), pool) and final.dtype == torch.float32
    for n in range(N):
        o_n, ht_n = reference(q[n:n + 1], k[n:n + 1], v[n:n + 1], g[n:n + 1], beta[n:n + 1],
                              None, pool[int(idx[n])][None], True)
        check("o", o[n:n + 1], o_n, dtype, device)
        check("ht", final[n:n + 1], ht_n, dtype, device, state=True)
    with pytest.raises(ValueError, match="output_final_state"):
        kda.fla.fused_recurrent_kda_fwd(*args[:5], initial_state=args[5],
                                        inplace_final_state=False, ssm_state_indices=args[6])
    _o2, final2 = kda.fla.fused_recurrent_kda_fwd(*args[:5], initial_state=args[5][:N],
                                                 inplace_final_state=False,
                                                 output_final_state=True,
                                                 use_qk_l2norm_in_kernel=True)
    _, ref_ht = reference(q, k, v, g, beta, None, pool[:N], True)
    assert torch.equal(args[5].cpu(), pool)
    check("ht", final2, ref_ht, dtype, device, state=True)


def test_fused_recurrent_kda_fwd_bf16_pool_into_a_new_fp32_state():
    """Without indices and not in place: rows 0..N-1 of a larger bf16 pool are read in fp32 and
    the final state is a new fp32 array (FLA's kernel keeps fp32 in registers)."""
    torch.manual_seed(11)
    N, H, D = 3, 2, 32
    q = normalize(torch.rand(N, 1, H, D)).bfloat16()
    v, beta = torch.rand(N, 1, H, D).bfloat16(), torch.rand(N, 1, H).bfloat16()
    g = F.logsigmoid(torch.randn(N, 1, H, D))
    pool = torch.randn(N + 2, H, D, D).bfloat16()
    before = pool.clone()
    o, final = kda.fla.fused_recurrent_kda_fwd(q, q, v, g, beta, initial_state=pool,
                                               inplace_final_state=False,
                                               output_final_state=True)
    ref, ref_ht = reference(q, q, v, g, beta, None, pool[:N].float(), False)
    assert torch.equal(pool, before) and final.dtype == torch.float32
    check("o", o, ref, torch.bfloat16, "cpu")
    check("ht", final, ref_ht, torch.bfloat16, "cpu", state=True)
    with pytest.raises(ValueError, match="initial_state"):
        kda.fla.fused_recurrent_kda_fwd(q, q, v, g, beta, initial_state=pool[:2],
                                        inplace_final_state=False, output_final_state=True)


# --- errors, autograd, torch.compile --------------------------------------------------------------

def small(B=2, T=8, H=2, D=32, dtype=torch.float32):
    torch.manual_seed(1)
    q, k = (normalize(torch.rand(B, T, H, D)).to(dtype) for _ in range(2))
    return (q, k, torch.rand(B, T, H, D, dtype=dtype), F.logsigmoid(torch.randn(B, T, H, D)),
            torch.rand(B, T, H, dtype=dtype))


@pytest.mark.parametrize(("kwargs", "error", "name"), [
    (dict(cp_context=object()), NotImplementedError, "cp_context"),
    (dict(disable_recompute=True), NotImplementedError, "disable_recompute"),
    (dict(head_first=True), NotImplementedError, "head_first"),
    (dict(no_such_option=1), TypeError, "no_such_option"),
    (dict(chunk_size=16), ValueError, "chunk_size"),
    (dict(use_gate_in_kernel=True), ValueError, "A_log"),
    (dict(allow_neg_eigval=True), ValueError, "allow_neg_eigval"),
    (dict(use_gate_in_kernel=True, safe_gate=True, A_log=torch.zeros(2)), ValueError,
     "lower_bound"),
    (dict(initial_state=torch.zeros(2, 2, 32, 32, dtype=torch.bfloat16)), ValueError,
     "initial_state"),
    (dict(initial_state=torch.zeros(3, 2, 32, 32)), ValueError, "initial_state"),
    (dict(cu_seqlens=torch.tensor([0, 8, 16])), ValueError, "'q'"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(3)), ValueError, "A_log"),
    (dict(use_qk_l2norm_in_kernel=1), TypeError, "use_qk_l2norm_in_kernel"),
])
def test_chunk_kda_errors_name_the_argument(kwargs, error, name):
    args = small()
    with pytest.raises(error, match=name):
        kda.fla.chunk_kda(*args, **kwargs)


def test_library_errors_use_fla_names_and_write_nothing():
    q, k, v, g, beta = small(B=1, T=4)
    pool = torch.randn(4, 2, 32, 32)
    before = pool.clone()
    with pytest.raises(ValueError, match="ssm_state_indices"):
        kda.fla.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool,
                                        ssm_state_indices=torch.zeros(1, dtype=torch.float32))
    with pytest.raises(ValueError, match="initial_state"):
        kda.fla.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool[:, :1])
    with pytest.raises(ValueError, match="initial_state"):
        kda.fla.fused_recurrent_kda_fwd(q, k, v, g, beta)
    with pytest.raises(NotImplementedError, match="head_first"):
        kda.fla.fused_recurrent_kda(q, k, v, g, beta, head_first=True)
    with pytest.raises(TypeError, match="bogus"):
        kda.fla.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, bogus=1)
    assert torch.equal(pool, before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gate_in_kernel", [False, True])
def test_chunk_gradients_match_fla_reference(device, gate_in_kernel):
    """Gradients of chunk_kda (FLA's test_chunk backward part) against autograd through
    fla.ops.kda.naive in fp32 on the CPU; on CUDA tensors (K = V = 128, bf16: the CUDA backward)
    against the same chunk_kda on CPU copies (the fp64 reference backward)."""
    torch.manual_seed(12)
    if device == "cuda":
        def leaf(*shape):
            return torch.rand(*shape).to(torch.bfloat16)

        xs = [leaf(1, 70, 1, 128), leaf(1, 70, 1, 128), leaf(1, 70, 2, 128),
              F.logsigmoid(torch.randn(1, 70, 2, 128)).to(torch.bfloat16),
              torch.rand(1, 70, 2).to(torch.bfloat16)]
        w = torch.randn(1, 70, 2, 128)

        def grads(ts):
            ts = [t.detach().requires_grad_(True) for t in ts]
            o, _ = kda.fla.chunk_kda(*ts, use_qk_l2norm_in_kernel=True)
            return torch.autograd.grad((o.float() * w.to(o.device)).sum(), ts)

        got = grads([x.cuda() for x in xs])
        ref = grads([x.float() for x in xs])
        for a, b in zip(got, ref):
            a, b = a.double().cpu(), b.double()
            assert float((a - b).norm() / b.norm()) < 5e-3
        return
    B, T, H, HV, D = 2, 70, 1, 2, 16
    q, k = torch.rand(B, T, H, D), torch.rand(B, T, H, D)
    v, beta = torch.rand(B, T, HV, D), torch.rand(B, T, HV).sigmoid()
    g = torch.randn(B, T, HV, D) if gate_in_kernel else F.logsigmoid(torch.randn(B, T, HV, D))
    A_log, dt_bias = torch.rand(HV), torch.randn(HV * D)
    h0 = torch.randn(B, HV, D, D)
    leaves = [x.requires_grad_(True) for x in (q, k, v, g, beta, A_log, dt_bias, h0)]
    do, dht = torch.randn(B, T, HV, D), torch.randn(B, HV, D, D)
    g_ref = fla_gate.naive_kda_gate(g, A_log, dt_bias) if gate_in_kernel else g
    ref, ref_ht = reference(q, k, v, g_ref, beta, 0.5, h0, True)
    ((ref * do).sum() + (ref_ht * dht).sum()).backward()
    ref_grads = [x.grad for x in leaves]
    for x in leaves:
        x.grad = None
    args = to(device, q, k, v, g, beta, A_log, dt_bias, h0)
    args = [x.detach().requires_grad_(True) for x in args]
    o, ht = kda.fla.chunk_kda(*args[:5], A_log=args[5], dt_bias=args[6], scale=0.5,
                              initial_state=args[7], output_final_state=True,
                              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=gate_in_kernel)
    assert o.requires_grad and ht.requires_grad
    loss = (o * do.to(device)).sum() + (ht * dht.to(device)).sum()
    loss.backward()
    names = ["dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0"]
    for name, x, want in zip(names, args, ref_grads):
        if not gate_in_kernel and name in ("dA_log", "ddt_bias"):
            assert x.grad is None or not x.grad.any()  # not used without the gate in kernel
            continue
        check(name, x.grad, want, torch.float32, "cpu", state=True)
    with torch.no_grad():
        o2, _ = kda.fla.chunk_kda(*args[:5], scale=0.5, use_qk_l2norm_in_kernel=True,
                                  A_log=args[5], dt_bias=args[6], initial_state=args[7],
                                  use_gate_in_kernel=gate_in_kernel)
    assert not o2.requires_grad
    torch.testing.assert_close(o2, o.detach(), rtol=0, atol=0)


def test_torch_compile_fullgraph():
    """kda.fla inside a compiled function (aot_eager, one graph): chunked prefill into a pool
    row, then one decode step on it."""
    q, k, v, g, beta = small(B=2, T=9)
    A_log, dt_bias = torch.rand(2), torch.randn(2 * 32)
    pool0 = torch.randn(3, 2, 32, 32)
    idx = torch.tensor([2, 0], dtype=torch.int32)

    def step(q, k, v, g, beta, pool):
        o, ht = kda.fla.chunk_kda(q[:, :8], k[:, :8], v[:, :8], g[:, :8], beta[:, :8],
                                  A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True,
                                  use_qk_l2norm_in_kernel=True, output_final_state=True)
        pool[idx.long()] = ht
        y, _ = kda.fla.fused_recurrent_kda_fwd(q[:, 8:], k[:, 8:], v[:, 8:], g[:, 8:],
                                               beta[:, 8:], A_log=A_log, dt_bias=dt_bias,
                                               initial_state=pool, ssm_state_indices=idx,
                                               use_gate_in_kernel=True,
                                               use_qk_l2norm_in_kernel=True)
        return o * 2, y + 1

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    p_eager, p_comp = pool0.clone(), pool0.clone()
    e = step(q, k, v, g, beta, p_eager)
    c = compiled(q, k, v, g, beta, p_comp)
    for x, y in zip(e, c):
        torch.testing.assert_close(x, y)
    torch.testing.assert_close(p_eager, p_comp)


def test_import_kda_does_not_import_torch():
    """kda.fla is part of `import kda`, and imports torch only on its first call."""
    import subprocess
    import sys
    code = "import sys, kda; kda.fla.chunk_kda; print('torch' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False"
