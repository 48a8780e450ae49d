"""kda — Kimi Delta Attention kernels (CPU and CUDA sm_90a).

One import for the three families of callers:

* the package API, :func:`prefill` and :func:`decode`, over torch tensors, numpy arrays or any
  DLPack array (zero copies, any strides with a contiguous last dimension);
* FlashKDA callers: :func:`fwd`;
* MATE / FLA callers: :func:`chunk_kda` and :func:`gated_delta_rule_decode`.

Torch tensors run on torch's current stream; under torch.compile through the custom ops
``torch.ops.kda.prefill`` and ``torch.ops.kda.decode`` (torch.compile and CUDA graphs work). torch
is imported only once a torch tensor reaches kda.
"""

from . import _C
from .api import checkpoint_offsets, cuda_available, decode, info, prefill
from .compat import chunk_kda, fwd, gated_delta_rule_decode

__version__: str = _C.__version__

__all__ = [
    "__version__",
    "checkpoint_offsets",
    "chunk_kda",
    "cuda_available",
    "decode",
    "fwd",
    "gated_delta_rule_decode",
    "info",
    "prefill",
]
