"""torch integration: custom ops, torch outputs, bf16, torch.compile and CUDA graphs.

Skipped without torch. The CUDA tests also need a CUDA build of kda and an sm_90 GPU; while the
CUDA prefill/decode kernels are not implemented they skip on NotImplementedError (with the
message) instead of failing.
"""

import numpy as np
import pytest

import kda
from kdatest import assert_close, make_decode, make_prefill, random_state, split, to_torch

torch = pytest.importorskip("torch")

HAS_CUDA = torch.cuda.is_available() and kda.cuda_available()
# These tests check the binding (devices, streams, graphs), not kernel accuracy (the C++ GPU tests
# do): a loose bar against the fp64 reference on the same bf16 inputs.
CUDA_TOL = 2e-2
needs_cuda = pytest.mark.skipif(
    not HAS_CUDA, reason="needs torch with CUDA, a CUDA build of kda and an sm_90 GPU")


def args_kw(d):
    return split(d)


def run_or_skip(fn, *args, **kwargs):
    """Runs a CUDA call; skips the test while the CUDA kernel reports NotImplementedError."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as e:
        pytest.skip(f"CUDA kernel not available yet: {e}")


def np_of(t):
    return t.detach().float().cpu().numpy()


# --- CPU tensors ---------------------------------------------------------------------------------

def test_ops_are_registered_and_mutate_their_outputs():
    d = to_torch(make_prefill(seed=1))
    args, kw = args_kw(d)
    kda.prefill(*args, **kw)
    schema = str(torch.ops.kda.prefill.default._schema)
    assert "!) out," in schema and "str gate" in schema
    assert hasattr(torch.ops.kda, "decode")


def test_prefill_torch_cpu_equals_numpy():
    dn = make_prefill(seed=2)
    dt = to_torch(dn)
    h0 = random_state(3, (2, 4, 32, 32))
    o_np, h_np = kda.prefill(*split(dn)[0], **split(dn)[1], initial_state=h0,
                             output_final_state=True)
    o_t, h_t = kda.prefill(*split(dt)[0], **split(dt)[1], initial_state=torch.from_numpy(h0),
                           output_final_state=True)
    assert isinstance(o_t, torch.Tensor) and isinstance(h_t, torch.Tensor)
    assert o_t.dtype == torch.float32 and h_t.dtype == torch.float32
    np.testing.assert_array_equal(o_t.numpy(), o_np)
    np.testing.assert_array_equal(h_t.numpy(), h_np)


def test_bf16_on_cpu_against_the_reference():
    d = to_torch(make_prefill(seed=4, T=100), dtype=torch.bfloat16)
    args, kw = args_kw(d)
    h0 = torch.from_numpy(random_state(5, (2, 4, 32, 32))).to(torch.bfloat16)
    o, ht = kda.prefill(*args, **kw, initial_state=h0, output_final_state=True)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.bfloat16
    o_ref, ht_ref = kda.prefill(*args, **kw, initial_state=h0, output_final_state=True,
                                backend="reference")
    assert_close(np_of(o), np_of(o_ref), "bf16")
    assert_close(np_of(ht), np_of(ht_ref), "bf16")


def test_decode_bf16_pool_on_cpu():
    d = to_torch(make_decode(seed=6, N=3, T=2), dtype=torch.bfloat16)
    args, kw = args_kw(d)
    pool = torch.from_numpy(random_state(7, (5, 4, 32, 32))).to(torch.bfloat16)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    p1, p2 = pool.clone(), pool.clone()
    o = kda.decode(*args, p1, **kw, state_indices=idx, out_dtype=torch.float32)
    o_ref = kda.decode(*args, p2, **kw, state_indices=idx, out_dtype="float32",
                       backend="reference")
    assert o.dtype == torch.float32
    assert_close(o.numpy(), o_ref.numpy(), "bf16")
    assert_close(np_of(p1), np_of(p2), "bf16")
    assert torch.equal(p1[[1, 3]], pool[[1, 3]])


def test_inputs_that_require_grad():
    d = to_torch(make_prefill(seed=8))
    args, kw = args_kw(d)
    ref = kda.prefill(*args, **kw)
    q = args[0].clone().requires_grad_(True)
    o = kda.prefill(q, *args[1:], **kw)
    assert torch.equal(o, ref)


def test_mixed_array_libraries_are_a_type_error():
    dn = make_prefill(seed=9)
    dt = to_torch(dn)
    args, kw = args_kw(dt)
    with pytest.raises(TypeError, match="argument 'k'"):
        kda.prefill(args[0], dn["k"], *args[2:], **kw)


def test_errors_from_torch_inputs_name_the_argument():
    d = to_torch(make_prefill(seed=10))
    args, kw = args_kw(d)
    out = torch.full((2, 70, 4, 32), 7.0)
    with pytest.raises(ValueError, match="argument 'k'"):
        kda.prefill(args[0], args[1].half(), *args[2:], **kw, out=out)
    with pytest.raises(ValueError, match="argument 'gate'"):
        kda.prefill(*args, **dict(kw, gate="nope"), out=out)
    assert (out == 7.0).all()


def test_compat_functions_with_torch():
    d = to_torch(make_prefill(seed=11, dtype=np.float16, gate="lower_bound"))
    args = args_kw(d)[0]
    o, ht = kda.chunk_kda(*args, A_log=d["A_log"], dt_bias=d["dt_bias"], output_final_state=True)
    assert o.dtype == torch.float16 and ht.dtype == torch.float16
    dd = to_torch(make_decode(seed=12, N=2), dtype=torch.float16)
    q, k, v, a, b = args_kw(dd)[0]
    pool = torch.zeros(2, 4, 32, 32)
    out, fs = kda.gated_delta_rule_decode(q, k, v, pool, dd["A_log"], a, dd["dt_bias"], None,
                                          None, b, store_final_state=True,
                                          inplace_final_state=True, state_dtype=torch.float32)
    assert out.dtype == torch.float16 and fs is pool and pool.abs().sum() > 0


def test_torch_compile_on_cpu():
    """The ops inside a compiled function (aot_eager: no C++ compiler needed), one graph."""
    d = to_torch(make_prefill(seed=13, T=65))
    args, kw = args_kw(d)
    pool0 = torch.from_numpy(random_state(14, (3, 4, 32, 32)))
    idx = torch.tensor([2, 0], dtype=torch.int32)

    def step(q, k, v, g, beta, pool):
        o = kda.prefill(q[:, :64], k[:, :64], v[:, :64], g[:, :64], beta[:, :64], **kw,
                        state_pool=pool, state_indices=idx)
        y = kda.decode(q[:, 64:], k[:, 64:], v[:, 64:], g[:, 64:], beta[:, 64:], pool, **kw,
                       state_indices=idx)
        return o * 2, y + 1

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    p_eager, p_comp = pool0.clone(), pool0.clone()
    e = step(*args, p_eager)
    c = compiled(*args, p_comp)
    for x, y in zip(e, c):
        torch.testing.assert_close(x, y)
    torch.testing.assert_close(p_eager, p_comp)


# --- CUDA tensors --------------------------------------------------------------------------------

def cuda_prefill_case(seed=20, T=200, lengths=None):
    return make_prefill(seed=seed, B=2, T=T, H=2, HV=4, K=128, V=128, gate="lower_bound",
                        lengths=lengths)


@needs_cuda
@pytest.mark.parametrize("varlen", [False, True])
def test_cuda_prefill_against_the_cpu_reference(varlen):
    dn = cuda_prefill_case(lengths=[1, 130, 64] if varlen else None)
    dc = to_torch(dn, "cuda", torch.bfloat16)
    args, kw = args_kw(dc)
    n = dn["N"]
    h0 = torch.from_numpy(random_state(21, (n, 4, 128, 128))).cuda()
    o, ht = run_or_skip(kda.prefill, *args, **kw, initial_state=h0, output_final_state=True)
    torch.cuda.synchronize()
    assert o.is_cuda and o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    cpu_args = [x.cpu() for x in args]
    cpu_kw = {k_: (v_.cpu() if isinstance(v_, torch.Tensor) else v_) for k_, v_ in kw.items()}
    o_ref, ht_ref = kda.prefill(*cpu_args, **cpu_kw, initial_state=h0.cpu(),
                                output_final_state=True, backend="reference")
    assert_close(np_of(o), np_of(o_ref), "bf16", "out", tol=CUDA_TOL)
    assert_close(np_of(ht), np_of(ht_ref), "bf16", "final_state", tol=CUDA_TOL)


@needs_cuda
def test_cuda_prefill_on_a_side_stream_is_deterministic():
    dc = to_torch(cuda_prefill_case(seed=22), "cuda", torch.bfloat16)
    args, kw = args_kw(dc)
    o1 = run_or_skip(kda.prefill, *args, **kw)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        o2 = kda.prefill(*args, **kw)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(o1, o2)


@needs_cuda
def test_cuda_decode_against_the_cpu_reference():
    dn = make_decode(seed=23, N=5, T=1, H=2, HV=4, K=128, gate="softplus")
    dc = to_torch(dn, "cuda", torch.bfloat16)
    args, kw = args_kw(dc)
    pool = torch.from_numpy(random_state(24, (8, 4, 128, 128))).cuda()
    idx = torch.tensor([7, -1, 0, 3, 5], dtype=torch.int32, device="cuda")
    p_gpu, p_cpu = pool.clone(), pool.cpu()
    o = run_or_skip(kda.decode, *args, p_gpu, **kw, state_indices=idx)
    torch.cuda.synchronize()
    cpu_args = [x.cpu() for x in args]
    cpu_kw = {k_: (v_.cpu() if isinstance(v_, torch.Tensor) else v_) for k_, v_ in kw.items()}
    o_ref = kda.decode(*cpu_args, p_cpu, **cpu_kw, state_indices=idx.cpu(), backend="reference")
    assert_close(np_of(o), np_of(o_ref), "bf16", "out", tol=CUDA_TOL)
    assert_close(np_of(p_gpu), np_of(p_cpu), "bf16", "state pool", tol=CUDA_TOL)
    untouched = [1, 2, 4, 6]
    assert torch.equal(p_gpu[untouched], pool[untouched])


@needs_cuda
def test_cuda_torch_compile():
    dc = to_torch(cuda_prefill_case(seed=25, T=129), "cuda", torch.bfloat16)
    args, kw = args_kw(dc)
    run_or_skip(kda.prefill, *args, **kw)  # skip early while the kernel is missing
    dd = to_torch(make_decode(seed=26, N=2, T=1, K=128, HV=4, H=2, gate="softplus"), "cuda",
                  torch.bfloat16)
    dargs, dkw = args_kw(dd)
    pool0 = torch.from_numpy(random_state(27, (3, 4, 128, 128))).cuda()
    idx = torch.tensor([2, 0], dtype=torch.int32, device="cuda")
    run_or_skip(kda.decode, *dargs, pool0.clone(), **dkw, state_indices=idx)

    def step(pool):
        o, ht = kda.prefill(*args, **kw, output_final_state=True)
        y = kda.decode(*dargs, pool, **dkw, state_indices=idx)
        return o.float().sum(dim=-1), ht, y

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    p_eager, p_comp = pool0.clone(), pool0.clone()
    e = step(p_eager)
    c = compiled(p_comp)
    for x, y in zip(e, c):
        torch.testing.assert_close(x, y)
    torch.testing.assert_close(p_eager, p_comp)


@needs_cuda
def test_cuda_graph_capture_and_replay():
    dc = to_torch(cuda_prefill_case(seed=28, T=128), "cuda", torch.bfloat16)
    args, kw = args_kw(dc)
    dd = to_torch(make_decode(seed=29, N=4, T=1, K=128, HV=4, H=2, gate="softplus"), "cuda",
                  torch.bfloat16)
    dargs, dkw = args_kw(dd)
    idx = torch.tensor([3, 1, -1, 0], dtype=torch.int32, device="cuda")
    pool = torch.from_numpy(random_state(30, (5, 4, 128, 128))).cuda()
    pool0 = pool.clone()
    out_p = torch.empty_like(args[2])
    out_d = torch.empty_like(dargs[2])

    def step():
        kda.prefill(*args, **kw, out=out_p)
        kda.decode(*dargs, pool, **dkw, state_indices=idx, out=out_d)

    # warm up on a side stream (as torch.cuda.graphs recommends), then capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run_or_skip(step)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    # new inputs in the captured buffers, a fresh pool, replay; compare with eager on copies
    gen = torch.Generator(device="cuda").manual_seed(31)
    for x in (*args[:3], *dargs[:3]):
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda", dtype=x.dtype))
    pool.copy_(pool0)
    graph.replay()
    torch.cuda.synchronize()
    p_ref = pool0.clone()
    o_ref = kda.prefill(*args, **kw)
    d_ref = kda.decode(*dargs, p_ref, **dkw, state_indices=idx)
    torch.cuda.synchronize()
    assert torch.equal(out_p, o_ref)
    assert torch.equal(out_d, d_ref)
    assert torch.equal(pool, p_ref)


@needs_cuda
def test_cuda_flashkda_fwd():
    dn = make_prefill(seed=32, B=1, T=150, H=4, HV=4, K=128, V=128, gate="lower_bound")
    dc = to_torch(dn, "cuda", torch.bfloat16)
    args, _ = args_kw(dc)
    out = torch.empty_like(args[2])
    ht = torch.empty(1, 4, 128, 128, device="cuda")
    run_or_skip(kda.fwd, *args, None, out, dc["A_log"], dc["dt_bias"], -5.0, final_state=ht)
    o_ref, h_ref = kda.prefill(*[x.cpu() for x in args], A_log=dc["A_log"].cpu(),
                               dt_bias=dc["dt_bias"].cpu(), gate="lower_bound", beta_logits=True,
                               output_final_state=True, backend="reference")
    assert_close(np_of(out), np_of(o_ref), "bf16", "out", tol=CUDA_TOL)
    assert_close(np_of(ht), np_of(h_ref), "bf16", "final_state", tol=CUDA_TOL)


@needs_cuda
def test_cuda_workspace_comes_from_the_allocator_once(monkeypatch):
    """The CUDA prefill asks for its workspace once, after validation, and keeps it for the next
    call on the same stream: a failing allocator is a RuntimeError naming 'workspace' that writes
    nothing; an invalid call never allocates."""
    import kda._torch_ops as ops
    # 1024 tokens: the two-kernel plan, which needs a workspace (small calls such as 100 tokens
    # take the fused kernel, which needs none).
    dc = to_torch(cuda_prefill_case(seed=33, T=1024), "cuda", torch.bfloat16)
    args, kw = args_kw(dc)
    run_or_skip(kda.prefill, *args, **kw)
    sizes = []
    real = ops.allocate_workspace

    def counting(nbytes, index):
        sizes.append((nbytes, index))
        return real(nbytes, index)
    monkeypatch.setattr(ops, "allocate_workspace", counting)
    ops.release_workspaces()
    kda.prefill(*args, **kw)
    assert len(sizes) == 1 and sizes[0][0] > 0 and sizes[0][1] == args[0].get_device()
    kda.prefill(*args, **kw)  # the kept workspace
    assert len(sizes) == 1
    with torch.cuda.stream(torch.cuda.Stream()):  # another stream: its own workspace
        kda.prefill(*args, **kw)
    assert len(sizes) == 2
    with pytest.raises(ValueError, match="argument 'k'"):
        kda.prefill(args[0], args[1][..., :64], *args[2:], **kw)
    assert len(sizes) == 2

    def failing(nbytes, index):
        raise MemoryError("no memory")
    monkeypatch.setattr(ops, "allocate_workspace", failing)
    ops.release_workspaces()
    out = torch.full_like(args[2], 7.0)
    with pytest.raises(RuntimeError, match=r"argument 'workspace'.*no memory"):
        kda.prefill(*args, **kw, out=out)
    torch.cuda.synchronize()
    assert (out == 7.0).all()


@needs_cuda
def test_cuda_and_cpu_tensors_mixed_name_the_argument():
    dc = to_torch(cuda_prefill_case(seed=34, T=64), "cuda", torch.bfloat16)
    args, kw = args_kw(dc)
    with pytest.raises(ValueError, match=r"argument 'k'.*device"):
        kda.prefill(args[0], args[1].cpu(), *args[2:], **kw)
    with pytest.raises(ValueError, match=r"argument 'q'.*meta"):
        kda.prefill(args[0].to("meta"), *args[1:], **kw)
