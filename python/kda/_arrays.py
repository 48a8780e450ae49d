"""Array-library glue: recognising arrays, naming dtypes, allocating outputs like the inputs.

The package never imports torch or numpy eagerly: an array's library is read from its type's module,
so a numpy-only environment never pays for (or needs) torch.
"""

import sys
from typing import Any, Optional, Sequence, Tuple

# Canonical dtype names (those of the C++ library) and their spellings in the array libraries.
_CANONICAL = {
    "float32": "fp32", "fp32": "fp32", "float": "fp32",
    "float16": "fp16", "fp16": "fp16", "half": "fp16",
    "bfloat16": "bf16", "bf16": "bf16",
    "int32": "int32", "int": "int32",
    "int64": "int64", "long": "int64",
}
_LIBRARY_NAME = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int32": "int32",
                 "int64": "int64", "uint8": "uint8"}


def is_array(x: Any) -> bool:
    """Whether `x` can cross into the extension (DLPack or the array interface)."""
    return hasattr(x, "__dlpack__") or hasattr(x, "__array_interface__")


_TORCH_TENSOR: Any = None  # torch.Tensor once torch has been seen (never imported from here)


def is_torch(x: Any) -> bool:
    """Whether `x` is a torch.Tensor.

    Once torch is known this is a plain isinstance check against a module global, which
    torch.compile traces without a graph break.
    """
    global _TORCH_TENSOR
    if _TORCH_TENSOR is not None:
        return isinstance(x, _TORCH_TENSOR)
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    _TORCH_TENSOR = torch.Tensor
    return isinstance(x, _TORCH_TENSOR)


if "torch" in sys.modules:  # torch imported before kda: no lookup at trace time
    _TORCH_TENSOR = sys.modules["torch"].Tensor


def library(x: Any) -> str:
    """'torch', 'numpy', 'cupy' or 'other' for an array."""
    root = type(x).__module__.split(".", 1)[0]
    if root in ("torch", "numpy", "cupy"):
        return root
    return "torch" if is_torch(x) else "other"  # a user subclass of torch.Tensor


def dtype_name(x: Any) -> str:
    """Canonical name of an array's dtype ('fp32', 'bf16', ...), else the library's own name."""
    raw = str(getattr(x, "dtype", type(x).__name__)).rsplit(".", 1)[-1]
    return _CANONICAL.get(raw, raw)


def canonical_dtype(spec: Any, name: str) -> str:
    """Canonical name of a dtype given as a string, a torch dtype or a numpy dtype/type."""
    if isinstance(spec, str):
        key = spec
    elif hasattr(spec, "__name__") and not hasattr(spec, "is_floating_point"):  # np.float32 etc.
        key = spec.__name__
    else:
        key = str(spec)
    key = key.rsplit(".", 1)[-1].lower()
    if key not in _CANONICAL or _CANONICAL[key] not in ("fp32", "fp16", "bf16"):
        raise ValueError(f"argument '{name}': expected a float dtype (float32, float16 or "
                         f"bfloat16), got {spec!r}")
    return _CANONICAL[key]


def on_cuda(x: Any) -> bool:
    """Whether an array lives in CUDA device memory (DLPack device type 2 or 13)."""
    dev = getattr(x, "__dlpack_device__", None)
    if dev is None:
        return False
    try:
        return int(dev()[0]) in (2, 13)
    except Exception:
        return False


def _namespace(like: Any, name: str) -> Any:
    lib = library(like)
    if lib == "numpy" or (lib == "other" and not on_cuda(like)
                          and not hasattr(like, "__array_namespace__")):
        import numpy
        return numpy
    ns = getattr(like, "__array_namespace__", None)
    if ns is None:
        raise TypeError(f"argument '{name}': cannot allocate it like a {type(like).__module__}."
                        f"{type(like).__name__}; pass it preallocated")
    return ns()


def empty(like: Any, shape: Sequence[int], dtype: Optional[str], name: str,
          zero: bool = False) -> Any:
    """A new array in `like`'s library and device; `dtype` canonical, or None for like's dtype."""
    shape = tuple(int(s) for s in shape)
    lib = library(like)
    if lib == "torch":
        import torch
        dt = like.dtype if dtype is None else getattr(torch, _LIBRARY_NAME.get(dtype, dtype))
        fn = torch.zeros if zero else torch.empty
        return fn(shape, dtype=dt, device=like.device)
    ns = _namespace(like, name)
    if dtype is None:
        dt = like.dtype
    else:
        dt = getattr(ns, _LIBRARY_NAME.get(dtype, dtype), None)
        if dt is None:
            lib_name = getattr(ns, "__name__", "this library")
            raise ValueError(f"argument '{name}': {lib_name} has no "
                             f"{_LIBRARY_NAME.get(dtype, dtype)} dtype; pass '{name}' "
                             "preallocated or use torch")
    fn = ns.zeros if zero else ns.empty
    if getattr(ns, "__name__", "") == "numpy":
        return fn(shape, dtype=dt)
    return fn(shape, dtype=dt, device=like.device)


def from_ints(like: Any, values: Sequence[int], name: str) -> Any:
    """An int64 vector holding `values`, in `like`'s library and device."""
    lib = library(like)
    if lib == "torch":
        import torch
        return torch.tensor(list(values), dtype=torch.int64, device=like.device)
    ns = _namespace(like, name)
    if getattr(ns, "__name__", "") == "numpy":
        return ns.asarray(list(values), dtype=ns.int64)
    return ns.asarray(list(values), dtype=ns.int64, device=like.device)


def host_ints(x: Any, name: str) -> Tuple[int, ...]:
    """The values of an integer vector, read on the host (a device array is copied: a sync)."""
    if isinstance(x, (list, tuple)):
        return tuple(int(v) for v in x)
    lib = library(x)
    if lib in ("torch", "numpy"):
        return tuple(int(v) for v in x.tolist())
    if lib == "cupy":
        return tuple(int(v) for v in x.get().tolist())
    if not on_cuda(x):
        import numpy
        return tuple(int(v) for v in numpy.from_dlpack(x).tolist())
    raise TypeError(f"argument '{name}': cannot read a {type(x).__name__} on the host; "
                    "pass checkpoint_offsets explicitly")


def current_stream(like: Any) -> int:
    """The current CUDA stream of `like`'s library (0 = legacy default stream)."""
    lib = library(like)
    if lib == "torch" and like.is_cuda:
        import torch
        return int(torch.cuda.current_stream(like.device).cuda_stream)
    if lib == "cupy":
        import cupy
        return int(cupy.cuda.get_current_stream().ptr)
    return 0
