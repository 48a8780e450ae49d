"""kda — Kimi Delta Attention kernels (CPU and CUDA sm_90a).

One import for the three families of callers:

* the package API, :func:`prefill` and :func:`decode`, over torch tensors, numpy arrays or any
  DLPack array (zero copies, any strides with a contiguous last dimension);
* FlashKDA callers: :func:`fwd`;
* MATE callers: :func:`chunk_kda` and :func:`gated_delta_rule_decode`;
* FLA callers (``fla.ops.kda`` of fla-core 0.6.0): the module :mod:`kda.fla`, with ``chunk_kda``,
  ``fused_recurrent_kda`` and ``fused_recurrent_kda_fwd`` (torch tensors).

Torch tensors run on torch's current stream; under torch.compile through the custom ops
``torch.ops.kda.prefill`` and ``torch.ops.kda.decode`` (torch.compile and CUDA graphs work). torch
is imported only once a torch tensor reaches kda, or :mod:`kda.distributed` (context-parallel
prefill over ``torch.distributed``) is first used.
"""

from . import _C, fla
from .api import checkpoint_offsets, cuda_available, decode, info, prefill
from .compat import chunk_kda, fwd, gated_delta_rule_decode

__version__: str = _C.__version__


def __getattr__(name: str):
    """kda.distributed, imported on first use (it imports torch; so it is not in __all__)."""
    if name == "distributed":
        import importlib

        return importlib.import_module(".distributed", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "__version__",
    "checkpoint_offsets",
    "chunk_kda",
    "cuda_available",
    "decode",
    "fla",
    "fwd",
    "gated_delta_rule_decode",
    "info",
    "prefill",
]
