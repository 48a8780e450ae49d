"""torch glue: the tensor reader's registration, streams, allocation, and the custom ops
``kda::prefill`` / ``kda::decode`` (imported the first time a torch tensor reaches kda).

Eager calls go straight to the extension: it reads each tensor's pointer, shape, strides, dtype and
device through torch's DLTensor reader (the DLPack C exchange table of torch.Tensor, where this
torch has one) or else the tensor's attributes (torch.Tensor and its dtypes are registered with
``kda._C`` here; the extension neither includes nor links torch), with torch's current stream and,
for the CUDA workspace, torch's caching allocator. While torch.compile traces a call,
``kda.prefill`` / ``kda.decode`` call the custom ops instead: both mutate their output arguments in
place and return nothing, so the fake (meta) implementations have nothing to compute,
torch.compile sees an opaque op with declared mutations, and CUDA-graph capture records the
kernel launches on the current stream. The ops run the same extension call as eager mode.
"""

from typing import Any, Callable, Dict, Optional, Tuple

import torch

from . import _C

Tensor = torch.Tensor
OptTensor = Optional[torch.Tensor]


def register(dltensor_reader: bool = True) -> bool:
    """Registers torch.Tensor, nn.Parameter and the dtypes with the extension; returns whether it
    reads plain tensors through torch's DLTensor reader (torch's DLPack exchange table,
    ``torch.Tensor.__dlpack_c_exchange_api__``, where this torch has it and `dltensor_reader`)
    rather than through their attributes."""
    mode_enabled = getattr(torch._C, "_is_torch_function_mode_enabled", None)
    return _C.register_torch(
        torch.Tensor, (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64),
        torch.nn.Parameter, mode_enabled if dltensor_reader else None)


DLTENSOR_READER: bool = register()

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _current_stream(index: int) -> int:
    return int(torch.cuda.current_stream(index).cuda_stream)


# The address of torch's current CUDA stream on a device index: torch's raw lookup (no Stream
# object, no device query) where this torch has it.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or _current_stream


def stream(t: torch.Tensor) -> int:
    """The address of torch's current CUDA stream on `t`'s device (`t` a CUDA tensor)."""
    return _raw_stream(t.get_device())


_CUDA_DEVICES: Dict[int, torch.device] = {}


def allocate_workspace(nbytes: int, index: int) -> torch.Tensor:
    """Device workspace from torch's caching allocator (stream-ordered on the current stream)."""
    dev = _CUDA_DEVICES.get(index)
    if dev is None:
        dev = _CUDA_DEVICES.setdefault(index, torch.device("cuda", index))
    # int64 elements: a dtype the extension reads (nbytes rounded up to whole elements).
    return torch.empty((nbytes + 7) // 8, dtype=torch.int64, device=dev)


# Workspaces kept between eager CUDA prefill calls, {(device index, stream address): int64
# tensor}. A call on the same device and stream reuses the last one (the stream orders the calls,
# so they never overlap), which saves an allocation per call once warm. A call takes its entry out
# while it runs (a concurrent call on the same stream then allocates its own) and puts back the
# larger of the two. Nothing is kept of more than WORKSPACE_KEEP_BYTES, for more than
# _WORKSPACE_STREAMS streams, or while the current stream captures a CUDA graph (a captured
# workspace belongs to the graph's memory pool); release_workspaces() drops them all.
WORKSPACE_KEEP_BYTES = 64 << 20
_WORKSPACE_STREAMS = 8
_workspaces: Dict[Tuple[int, int], torch.Tensor] = {}
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or (lambda: False)


def prefill_device(q: torch.Tensor, workspace: OptTensor) -> tuple:
    """(stream, workspace, allocate, key) of a prefill on `q`'s CUDA device: torch's current
    stream, the caller's workspace or the one kept for this device and stream (None: allocated
    through `allocate` when the call needs one), and the key to keep it under after the call
    (None: keep nothing)."""
    index = q.get_device()
    s = _raw_stream(index)
    if workspace is not None or _capturing():
        return s, workspace, allocate_workspace, None
    key = (index, s)
    return s, _workspaces.pop(key, None), allocate_workspace, key


def take_workspace(key: Tuple[int, int]) -> OptTensor:
    """The workspace kept for (device index, stream), removed from the cache, or None."""
    return _workspaces.pop(key, None)


def keep_workspace(key: Tuple[int, int], used: OptTensor, allocated: OptTensor) -> None:
    """Keeps the workspace of a call for the next call on its device and stream: the one the
    extension `allocated` for it, else the one it `used` (the one taken from the cache for the
    call, which was within WORKSPACE_KEEP_BYTES when it was kept)."""
    ws = allocated
    if ws is None:
        if used is None:
            return
        if key not in _workspaces:  # the warm call: back where it was taken from
            if len(_workspaces) >= _WORKSPACE_STREAMS:
                del _workspaces[next(iter(_workspaces))]  # the oldest entry
            _workspaces[key] = used
            return
        ws = used  # a concurrent call on the stream kept one meanwhile: the larger stays
    if ws.numel() * ws.element_size() > WORKSPACE_KEEP_BYTES:
        return
    held = _workspaces.get(key)
    if held is not None and held.numel() >= ws.numel():
        return
    if held is None and len(_workspaces) >= _WORKSPACE_STREAMS:
        del _workspaces[next(iter(_workspaces))]  # the oldest entry
    _workspaces[key] = ws


def release_workspaces() -> None:
    """Drops every kept workspace (their memory returns to torch's caching allocator)."""
    _workspaces.clear()


_contiguous = torch.contiguous_format
_empty_like = torch.empty_like


def empty_out(v: Any, dt: torch.dtype) -> Any:
    """The output [B, T, HV, V] of dtype `dt`, like v (on v's device: a v on another device than
    q is reported before out); None when v is not a tensor (the extension reports it)."""
    if isinstance(v, Tensor):
        return _empty_like(v, dtype=dt, memory_format=_contiguous)
    return None


def empty_state(q: Any, v: Any, initial_state: Any, cu_seqlens: Any, layout: Any) -> Any:
    """The final state of a prefill: initial_state's shape and dtype (it is validated before the
    final state), else [N, HV, V, K] (or K-first) fp32; None when q or v is malformed (the
    extension reports them)."""
    if isinstance(initial_state, Tensor):
        return _empty_like(initial_state, memory_format=_contiguous)
    try:
        n = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else q.shape[0]
        K, HV, V = q.shape[-1], v.shape[-2], v.shape[-1]
    except (AttributeError, IndexError, TypeError):
        return None
    if not isinstance(n, int) or n < 0:
        return None
    return q.new_empty((n, HV, V, K) if layout != "k_first" else (n, HV, K, V),
                       dtype=torch.float32)


def dtype(name: Optional[str], like: torch.Tensor) -> torch.dtype:
    return like.dtype if name is None else _DTYPES[name]


def _prefill_impl(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, out: Tensor,
                  A_log: OptTensor, dt_bias: OptTensor, cu_seqlens: OptTensor,
                  initial_state: OptTensor, final_state: OptTensor, state_pool: OptTensor,
                  state_indices: OptTensor, checkpoints: OptTensor, checkpoint_offsets: OptTensor,
                  workspace: OptTensor, checkpoint_every: int, check_indices: bool,
                  state_layout: str,
                  use_qk_l2norm: bool, scale: Optional[float], gate: str, lower_bound: float,
                  beta_logits: bool, allow_neg_eigval: bool, backend: str,
                  num_threads: int) -> None:
    s, allocate, key = 0, None, None
    if q.is_cuda:
        s, workspace, allocate, key = prefill_device(q, workspace)
    allocated = _C.prefill(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, out, initial_state,
                           final_state, state_pool, state_indices, checkpoints,
                           checkpoint_offsets, workspace, checkpoint_every, check_indices,
                           state_layout, use_qk_l2norm, scale, gate, lower_bound, beta_logits,
                           allow_neg_eigval, backend, num_threads, s, allocate, None)
    if key is not None:
        keep_workspace(key, workspace, allocated)


def _decode_impl(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, out: Tensor,
                 A_log: OptTensor, dt_bias: OptTensor, cu_seqlens: OptTensor, state: Tensor,
                 state_indices: OptTensor, num_accepted_tokens: OptTensor,
                 final_state: OptTensor, intermediate_states: OptTensor,
                 use_initial_state: bool, store_final_state: bool, check_indices: bool,
                 state_layout: str, use_qk_l2norm: bool, scale: Optional[float], gate: str,
                 lower_bound: float, beta_logits: bool, allow_neg_eigval: bool, backend: str,
                 num_threads: int) -> None:
    s = stream(q) if q.is_cuda else 0
    _C.decode(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, out, state, state_indices,
              num_accepted_tokens, final_state, intermediate_states, use_initial_state,
              store_final_state, check_indices, state_layout, use_qk_l2norm, scale, gate,
              lower_bound, beta_logits, allow_neg_eigval, backend, num_threads, s, None)


def _nothing(*args: Any, **kwargs: Any) -> None:
    """Fake implementation: the ops only mutate their arguments and return nothing."""
    return None


def _register() -> Dict[str, Callable[..., None]]:
    """Registers the custom ops (once per process); plain functions on torch < 2.4."""
    custom_op = getattr(torch.library, "custom_op", None)
    if custom_op is None:
        return {"prefill": _prefill_impl, "decode": _decode_impl}
    specs = (("prefill", _prefill_impl,
              ("out", "final_state", "state_pool", "checkpoints", "workspace")),
             ("decode", _decode_impl, ("out", "state", "final_state", "intermediate_states")))
    result = {}
    for name, impl, mutated in specs:
        try:
            op = custom_op(f"kda::{name}", impl, mutates_args=mutated)
            op.register_fake(_nothing)
        except RuntimeError:  # already registered (the module was reloaded)
            pass
        result[name] = getattr(torch.ops.kda, name).default
    return result


OPS: Dict[str, Callable[..., None]] = _register()


def _never_compiling() -> bool:
    return False


# compiling() is True while torch.compile (dynamo) traces the caller: torch's own function (one
# call per eager call, which dynamo folds to True while it traces).
compiling: Callable[[], bool] = getattr(torch.compiler, "is_compiling", None) or _never_compiling
grad_enabled: Callable[[], bool] = torch.is_grad_enabled


# ---------------------------------------------------------------------------------------------
# Traced paths: what kda.prefill / kda.decode do while torch.compile traces them. Straight-line
# torch code (no host reads, no try/except, no foreign objects) so that the call stays in one
# graph; argument errors surface when the op runs (the C++ validation).
# ---------------------------------------------------------------------------------------------

def prefill_traced(tensors: Dict[str, Optional[torch.Tensor]], options: Dict[str, Any],
                   allocate_final: bool) -> Any:
    q, v = tensors["q"], tensors["v"]
    out = tensors["out"]
    if out is None:
        out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    final_state = tensors["final_state"]
    if allocate_final:
        cu = tensors["cu_seqlens"]
        n = cu.shape[0] - 1 if cu is not None else q.shape[0]
        K, HV, V = q.shape[-1], v.shape[-2], v.shape[-1]
        shape = (n, HV, V, K) if options["state_layout"] == "v_first" else (n, HV, K, V)
        h0 = tensors["initial_state"]
        final_state = torch.empty(shape, dtype=torch.float32 if h0 is None else h0.dtype,
                                  device=q.device)
    args = {n: None if t is None else t.detach() for n, t in tensors.items() if n != "out"}
    args["final_state"] = None if final_state is None else final_state.detach()
    OPS["prefill"](out=out.detach(), **args, **options)
    return (out, final_state) if final_state is not None else out


def decode_traced(tensors: Dict[str, Optional[torch.Tensor]], options: Dict[str, Any],
                  out_dtype: Optional[torch.dtype]) -> torch.Tensor:
    q, v = tensors["q"], tensors["v"]
    out = tensors["out"]
    if out is None:
        if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
            out_dtype = getattr(torch, {"fp32": "float32", "fp16": "float16",
                                        "bf16": "bfloat16"}.get(str(out_dtype), str(out_dtype)))
        out = torch.empty(v.shape, dtype=q.dtype if out_dtype is None else out_dtype,
                          device=q.device)
    args = {n: None if t is None else t.detach() for n, t in tensors.items() if n != "out"}
    OPS["decode"](out=out.detach(), **args, **options)
    return out
