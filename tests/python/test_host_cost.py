"""The per-call shortcuts of the torch path: outputs allocated like the inputs, the CUDA prefill
workspace kept per (device, stream), the extension's argument reading alone.

The workspace cache is exercised on the CPU through its functions (the stream lookup and the
capture check replaced); the CUDA end-to-end checks are in test_torch.py.
"""

from contextlib import nullcontext

import numpy as np
import pytest

import kda
from kdatest import assert_close, make_decode, make_prefill, random_state, split, to_torch

torch = pytest.importorskip("torch")

import kda._torch_ops as ops  # noqa: E402  (needs torch)

# --- outputs allocated per call follow each call's dtypes and shapes ---------------------------

@pytest.mark.parametrize("layout", ["v_first", "k_first"])
def test_allocated_outputs_follow_each_calls_dtypes(layout):
    """Calls alternating between fp32 and bf16 inputs (and initial states of either dtype, or
    none) allocate outputs of that call's dtype and shape, and match the reference."""
    d = make_prefill(seed=40, B=2, T=20, HV=4, K=32, V=32)
    h0 = random_state(41, (2, 4, 32, 32))
    for dt, h0_dt in ((torch.float32, None), (torch.bfloat16, torch.bfloat16),
                      (torch.float32, torch.float32), (torch.bfloat16, None)):
        t = to_torch(d, dtype=dt)
        args, kw = split(t)
        init = None if h0_dt is None else torch.from_numpy(h0).to(h0_dt)
        out, ht = kda.prefill(*args, **kw, initial_state=init, output_final_state=True,
                              state_layout=layout)
        assert out.dtype == dt and out.shape == args[2].shape and out.is_contiguous()
        assert ht.dtype == (torch.float32 if h0_dt is None else h0_dt)
        assert ht.shape == (2, 4, 32, 32) and ht.is_contiguous()
        ref_o, ref_h = kda.prefill(*[a.double().float() for a in args], **kw,
                                   initial_state=None if init is None else init.float(),
                                   output_final_state=True, state_layout=layout,
                                   backend="reference")
        tol = "bf16" if dt == torch.bfloat16 or h0_dt == torch.bfloat16 else np.float32
        assert_close(out.float().numpy(), ref_o.numpy(), tol, "out")
        assert_close(ht.float().numpy(), ref_h.numpy(), tol, "final_state")


def test_allocated_output_of_a_permuted_value_tensor_is_contiguous():
    """v dense but permuted (its last dimension contiguous): out is a new contiguous tensor, not
    a copy of v's layout."""
    d = to_torch(make_prefill(seed=42, B=2, T=20))
    args, kw = split(d)
    v = args[2]
    vp = v.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3)  # dense, batch stride 32 * 4
    assert not vp.is_contiguous() and torch.equal(vp, v)
    out = kda.prefill(args[0], args[1], vp, *args[3:], **kw)
    assert out.is_contiguous()
    assert torch.equal(out, kda.prefill(*args, **kw))


def test_decode_output_dtype_per_call():
    d = to_torch(make_decode(seed=43, N=3), dtype=torch.bfloat16)
    args, kw = split(d)
    pool = torch.from_numpy(random_state(44, (5, 4, 32, 32)))
    kw["state_indices"] = torch.tensor([4, 0, 2], dtype=torch.int32)
    a = kda.decode(*args, pool.clone(), **kw)
    b = kda.decode(*args, pool.clone(), **kw, out_dtype=torch.float32)
    c = kda.decode(*args, pool.clone(), **kw)
    assert a.dtype == c.dtype == torch.bfloat16 and b.dtype == torch.float32
    assert torch.equal(a, c) and torch.equal(b.to(torch.bfloat16), a)


def test_a_non_tensor_value_argument_is_the_extensions_error():
    d = to_torch(make_prefill(seed=45))
    args, kw = split(d)
    with pytest.raises(TypeError, match=r"argument 'v': expected a torch\.Tensor"):
        kda.prefill(args[0], args[1], args[2].numpy(), *args[3:], **kw)
    with pytest.raises(TypeError, match="argument 'v'"):
        kda.prefill(args[0], args[1], [1.0], *args[3:], **kw)


class Tagged(torch.Tensor):
    """A torch.Tensor subclass (read through the attribute lookup, not the type's descriptors)."""


def test_tensor_subclasses_and_parameters_read_as_plain_tensors():
    d = to_torch(make_prefill(seed=49, B=2, T=20))
    args, kw = split(d)
    want = kda.prefill(*args, **kw)
    sub = [a.as_subclass(Tagged) for a in args]
    kw_p = dict(kw, A_log=torch.nn.Parameter(kw["A_log"]),
                dt_bias=torch.nn.Parameter(kw["dt_bias"]))
    with torch.no_grad():
        got = kda.prefill(*sub, **kw_p)
    assert torch.equal(got.as_subclass(torch.Tensor), want)


class Shaped(torch.Tensor):
    """A subclass whose `shape` says something else than the tensor: honoured, so the call fails
    validation naming the argument."""

    @property
    def shape(self):
        return (1, 2, 3)


def test_a_subclass_attribute_override_is_honoured():
    d = to_torch(make_prefill(seed=50, B=2, T=20))
    args, kw = split(d)
    k = args[1].as_subclass(Shaped)
    with pytest.raises(ValueError, match="argument 'k'"):
        kda.prefill(args[0], k, *args[2:], **kw)


# --- the workspace kept per (device, stream) ---------------------------------------------------

@pytest.fixture
def cache(monkeypatch):
    """An empty workspace cache, a fake raw-stream lookup (the 'current stream' is `cache.stream`)
    and capture check (`cache.capturing`)."""
    class State:
        stream = 1000
        capturing = False
    state = State()
    monkeypatch.setattr(ops, "_workspaces", {})
    monkeypatch.setattr(ops, "_raw_stream", lambda index: state.stream)
    monkeypatch.setattr(ops, "_capturing", lambda: state.capturing)
    return state


def ws(nbytes):
    return torch.empty((nbytes + 7) // 8, dtype=torch.int64)


def test_workspace_is_kept_per_device_and_stream(cache):
    q = torch.zeros(1)  # get_device() == -1: the key's device part
    s, w, allocate, key = ops.prefill_device(q, None)
    assert (s, w, key) == (1000, None, (-1, 1000)) and allocate is ops.allocate_workspace
    first = ws(4096)
    ops.keep_workspace(key, w, first)  # the extension allocated `first` for this call
    s, w, _, key = ops.prefill_device(q, None)
    assert w is first and key == (-1, 1000)
    # while a call holds it, a concurrent call on the same stream gets none (allocates its own)
    assert ops.prefill_device(q, None)[1] is None
    ops.keep_workspace(key, w, None)  # the call used it and allocated nothing
    cache.stream = 2000  # another stream: not the first stream's workspace
    s, w, _, key2 = ops.prefill_device(q, None)
    assert (s, w, key2) == (2000, None, (-1, 2000))
    ops.keep_workspace(key2, None, ws(4096))
    assert ops.take_workspace((0, 2000)) is None  # another device, same stream
    assert ops.take_workspace((-1, 1000)) is first
    assert ops.take_workspace((-1, 1000)) is None


def test_workspace_keeps_the_larger_and_bounds_the_cache(cache):
    key = (0, 7)
    small, large = ws(1024), ws(8192)
    ops.keep_workspace(key, None, large)
    ops.keep_workspace(key, small, None)  # a smaller one does not replace the larger
    assert ops.take_workspace(key) is large
    ops.keep_workspace(key, None, small)
    ops.keep_workspace(key, small, large)  # grown: the allocated one replaces it
    assert ops.take_workspace(key) is large
    ops.keep_workspace(key, None, ws(ops.WORKSPACE_KEEP_BYTES + 8))  # too large to keep
    assert ops.take_workspace(key) is None
    for s in range(ops._WORKSPACE_STREAMS + 2):  # the oldest streams' entries go first
        ops.keep_workspace((0, s), None, ws(64))
    assert len(ops._workspaces) == ops._WORKSPACE_STREAMS
    assert ops.take_workspace((0, 0)) is None and ops.take_workspace((0, 1)) is None
    assert ops.take_workspace((0, ops._WORKSPACE_STREAMS + 1)) is not None
    ops.release_workspaces()
    assert not ops._workspaces


def test_workspace_is_not_kept_while_capturing_or_when_given(cache):
    q = torch.zeros(1)
    key = (-1, 1000)
    kept = ws(4096)
    ops.keep_workspace(key, None, kept)
    cache.capturing = True  # a graph's workspace comes from its pool: the kept one is not used
    s, w, _, k = ops.prefill_device(q, None)
    assert (s, w, k) == (1000, None, None)
    cache.capturing = False
    mine = ws(64)
    s, w, _, k = ops.prefill_device(q, mine)  # the caller's own workspace
    assert w is mine and k is None
    assert ops.take_workspace(key) is kept  # untouched by either call


# --- the two tensor readers: torch's DLTensor reader and the attributes -------------------------

class Recording(torch.overrides.TorchFunctionMode):
    """A pass-through torch function mode that records what it sees: while one is active, the
    extension reads tensors through their attributes (which the mode sees), not through torch's
    DLTensor reader."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_the_dltensor_reader_is_used_where_torch_has_one():
    has = (hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
           and hasattr(torch._C, "_is_torch_function_mode_enabled"))
    assert ops.DLTENSOR_READER is has


@pytest.fixture
def attribute_reader():
    """The extension reads torch tensors through their attributes only for the test (torch
    registered again without the DLTensor reader; as kda registers it afterwards)."""
    assert ops.register(dltensor_reader=False) is False
    yield
    assert ops.register() is ops.DLTENSOR_READER


def odd_layout_case(seed):
    """A prefill whose tensors are views with gaps: q, k, v slices of one fused tensor, g with a
    gap after each row, a size-1 batch dimension with an odd stride, out and the initial state
    slices."""
    d = to_torch(make_prefill(seed=seed, B=1, T=20, H=2, HV=2, K=32, V=32))
    args, kw = split(d)
    q, k, v, g, beta = args
    fused = torch.cat([q, k, v], dim=2)  # [1, T, 6, 32]
    q, k, v = fused[:, :, 0:2], fused[:, :, 2:4], fused[:, :, 4:6]
    wide = torch.zeros(1, 20, 2, 48)
    wide[..., :32] = g
    g = wide[..., :32]
    beta = torch.as_strided(beta.clone(), beta.shape, (7, beta.stride(1), 1))  # B = 1, stride 7
    out = torch.zeros(1, 20, 2, 40)[..., :32]
    h0 = torch.zeros(1, 2, 32, 33)[..., :32]
    h0.copy_(torch.from_numpy(random_state(seed + 1, (1, 2, 32, 32))))
    return (q, k, v, g, beta), dict(kw, initial_state=h0, out=out, output_final_state=True)


def test_a_torch_function_mode_sees_the_tensor_reads():
    """While a torch function mode is active, the extension reads tensors through their
    attributes, which the mode sees (torch's DLTensor reader would bypass it)."""
    args, kw = odd_layout_case(59)
    mode = Recording()
    with mode:
        out, ht = kda.prefill(*args, **kw)
    assert torch.Tensor.data_ptr in mode.seen and torch.Tensor.stride in mode.seen
    ref, ref_h = kda.prefill(*args, **dict(kw, out=None))
    assert torch.equal(out, ref) and torch.equal(ht, ref_h)


def test_both_readers_read_the_same_tensors(request):
    """Outputs of calls on views with gaps and odd strides are bitwise equal whichever reader
    reads the tensors, and equal those of contiguous copies."""
    args, kw = odd_layout_case(60)
    out_a, ht_a = kda.prefill(*args, **kw)
    out_a = out_a.clone()
    request.getfixturevalue("attribute_reader")
    out_b, ht_b = kda.prefill(*args, **kw)
    assert torch.equal(out_a, out_b) and torch.equal(ht_a, ht_b)
    contiguous = [a.contiguous() for a in args]
    ref, ref_h = kda.prefill(*contiguous, **dict(kw, out=None,
                                                 initial_state=kw["initial_state"].contiguous()))
    assert torch.equal(out_b, ref) and torch.equal(ht_b, ref_h)


@pytest.mark.parametrize("case", ["float64", "complex", "meta", "0-d", "sparse", "strided-last",
                                  "int8"])
def test_both_readers_report_the_same_errors(case, request):
    """What torch's DLTensor reader refuses or the library does not take is read again through
    the attributes, so every message is the attribute reader's."""
    d = to_torch(make_prefill(seed=61, B=1, T=20))
    args, kw = split(d)
    arg, bad = {
        "float64": ("k", lambda: args[1].double()),
        "complex": ("v", lambda: args[2].to(torch.complex64)),
        "meta": ("g", lambda: args[3].to("meta")),
        "0-d": ("beta", lambda: torch.tensor(0.5)),
        "sparse": ("g", lambda: args[3].to_sparse()),
        "strided-last": ("dt_bias", lambda: kw["dt_bias"][:, :1].expand(-1, 32)),
        "int8": ("A_log", lambda: kw["A_log"].to(torch.int8)),
    }[case]
    if arg in ("k", "v", "g", "beta"):
        call_args = list(args)
        call_args[("q", "k", "v", "g", "beta").index(arg)] = bad()
        call_kw = kw
    else:
        call_args, call_kw = args, dict(kw, **{arg: bad()})
    messages = []
    for reader in ("default", "attributes"):
        if reader == "attributes":
            request.getfixturevalue("attribute_reader")
        with pytest.raises(ValueError, match=f"argument '{arg}'") as e:
            kda.prefill(*call_args, **call_kw)
        messages.append(str(e.value))
    assert messages[0] == messages[1]


def test_requires_grad_is_getattrs_answer():
    """_C.requires_grad(*xs) is any(getattr(x, 'requires_grad', False) for x in xs): in order,
    stopping at the first true one, AttributeError read as False, other errors raised."""
    from kda import _C

    class Truthy:
        requires_grad = 1

    class Missing:
        @property
        def requires_grad(self):
            raise AttributeError("none here")

    class Broken:
        @property
        def requires_grad(self):
            raise KeyError("broken")

    class Overridden(torch.Tensor):
        @property
        def requires_grad(self):
            return True

    plain, grad = torch.zeros(2), torch.zeros(2, requires_grad=True)
    assert _C.requires_grad() is False
    assert _C.requires_grad(None, plain, 3, Missing(), torch.nn.Parameter(plain, False)) is False
    assert _C.requires_grad(plain, grad) is True
    assert _C.requires_grad(torch.nn.Parameter(plain)) is True
    assert _C.requires_grad(Truthy()) is True
    assert _C.requires_grad(plain.as_subclass(Overridden)) is True
    assert _C.requires_grad(grad, Broken()) is True  # stops at the first
    with pytest.raises(KeyError, match="broken"):
        _C.requires_grad(plain, Broken())


# --- the extension's argument reading alone ----------------------------------------------------

def test_read_prefill_and_read_decode_validate_and_write_nothing():
    from kda import _C
    d = to_torch(make_prefill(seed=46, B=1, T=20))
    args, kw = split(d)
    out = torch.full_like(args[2], 7.0)
    call = dict(zip(("q", "k", "v", "g", "beta"), args), **kw, out=out, initial_state=None,
                final_state=None, state_pool=None, state_indices=None, checkpoints=None,
                checkpoint_offsets=None, workspace=None, checkpoint_every=0, check_indices=False,
                state_layout="v_first", use_qk_l2norm=True, scale=None, lower_bound=-5.0,
                allow_neg_eigval=False, backend="auto", num_threads=1, stream=0,
                allocate=None, names=None)
    assert _C.read_prefill(*[call[n] for n in _C.prefill_arguments]) is None
    assert (out == 7.0).all()
    call["k"] = args[1][..., :16]
    with pytest.raises(ValueError, match="argument 'k'"):
        _C.read_prefill(*[call[n] for n in _C.prefill_arguments])
    dd = to_torch(make_decode(seed=47, N=2))
    dargs, dkw = split(dd)
    pool = torch.from_numpy(random_state(48, (2, 4, 32, 32)))
    before = pool.clone()
    dout = torch.full_like(dargs[2], 7.0)
    dcall = dict(zip(("q", "k", "v", "g", "beta"), dargs), **dkw, out=dout, state=pool,
                 state_indices=None, num_accepted_tokens=None, final_state=None,
                 intermediate_states=None, use_initial_state=True, store_final_state=True,
                 check_indices=False, state_layout="v_first", use_qk_l2norm=True, scale=None,
                 lower_bound=-5.0, allow_neg_eigval=False, backend="auto", num_threads=1,
                 stream=0, names=None)
    _C.read_decode(*[dcall[n] for n in _C.decode_arguments])
    assert (dout == 7.0).all() and torch.equal(pool, before)
    dcall["state"] = pool[..., :16]  # K = 32
    with pytest.raises(ValueError, match="argument 'state'"):
        _C.read_decode(*[dcall[n] for n in _C.decode_arguments])


def test_fwd_names_its_arguments_inside_another_callers_names():
    """kda.fwd skips the name table when none is set, and inside another caller's table (a
    wrapper of its own) still names its arguments as FlashKDA does."""
    d = to_torch(make_prefill(seed=51, B=1, T=20, H=2, HV=2, gate="lower_bound"))
    args, kw = split(d)
    out = torch.empty_like(args[2])
    bad_out = out[..., :16]
    for outer in (None, {"q": "query", "out": "output"}):
        ctx = kda.api.caller_names(outer) if outer else nullcontext()
        with ctx, pytest.raises(ValueError, match="argument 'out'"):
            kda.fwd(*args, None, bad_out, kw["A_log"], kw["dt_bias"], -5.0)
        with ctx:
            kda.fwd(*args, None, out, kw["A_log"], kw["dt_bias"], -5.0)
        ref = kda.prefill(*args, A_log=kw["A_log"], dt_bias=kw["dt_bias"], gate="lower_bound",
                          beta_logits=True)
        assert torch.equal(out, ref)


@pytest.mark.skipif(not (torch.cuda.is_available() and kda.cuda_available()),
                    reason="needs torch with CUDA, a CUDA build of kda and an sm_90 GPU")
def test_cuda_graph_capture_neither_takes_nor_keeps_a_workspace():
    """A warm-up on a side stream keeps its workspace; the capture allocates its own from the
    graph's pool and keeps none; replays match eager calls."""
    # 1024 tokens: the two-kernel plan, which needs a workspace (small calls such as 130 tokens
    # take the fused kernel, which needs none); eager calls launch its kernels as one graph, the
    # capture launches them directly.
    d = to_torch(make_prefill(seed=52, B=1, T=1024, H=2, HV=4, K=128, V=128, gate="lower_bound"),
                 "cuda", torch.bfloat16)
    args, kw = split(d)
    out = torch.empty_like(args[2])
    ops.release_workspaces()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        try:
            kda.prefill(*args, **kw, out=out)
        except NotImplementedError as e:
            pytest.skip(f"CUDA prefill not available: {e}")
    torch.cuda.current_stream().wait_stream(side)
    kept = dict(ops._workspaces)
    assert list(kept) == [(args[0].get_device(), side.cuda_stream)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):  # even on the warm-up's stream
        kda.prefill(*args, **kw, out=out)
    assert ops._workspaces.keys() == kept.keys()
    assert all(ops._workspaces[k] is kept[k] for k in kept)
    gen = torch.Generator(device="cuda").manual_seed(53)
    for x in args[:3]:
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda", dtype=x.dtype))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, kda.prefill(*args, **kw))
