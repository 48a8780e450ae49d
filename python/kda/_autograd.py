"""A differentiable prefill on CPU tensors: ``torch.autograd.Function`` over ``kda.prefill`` and
``kda._C.prefill_backward`` (the analytic fp64 reference backward).

Not wired into ``kda.prefill``: call :func:`prefill_with_grad` directly. The CUDA backward does
not exist yet, so CUDA tensors raise NotImplementedError from the backward.
"""

from typing import Any, Dict, Optional, Tuple

import torch

from . import _C
from .api import prefill

# The differentiable inputs, in the order of PrefillFunction.apply's tensor arguments.
_INPUTS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
_GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "d_initial_state")


class PrefillFunction(torch.autograd.Function):
    """(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, options) -> (out,
    final_state). ``options`` holds kda.prefill's keyword options (scale, use_qk_l2norm, gate,
    lower_bound, beta_logits, allow_neg_eigval, state_layout, backend)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, A_log: Optional[torch.Tensor],
                dt_bias: Optional[torch.Tensor], initial_state: Optional[torch.Tensor],
                cu_seqlens: Optional[torch.Tensor],
                options: Dict[str, Any]) -> Tuple[torch.Tensor, torch.Tensor]:
        out, final_state = prefill(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias,
                                   cu_seqlens=cu_seqlens, initial_state=initial_state,
                                   output_final_state=True, **options)
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens)
        ctx.options = options
        return out, final_state

    @staticmethod
    def backward(ctx: Any, d_out: Optional[torch.Tensor],
                 d_final_state: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
        saved = ctx.saved_tensors
        inputs = dict(zip(_INPUTS, saved[:8]))
        cu_seqlens = saved[8]
        opts = ctx.options
        grads: Dict[str, Optional[torch.Tensor]] = {}
        for name, grad_name, needed in zip(_INPUTS, _GRADS, ctx.needs_input_grad[:8]):
            x = inputs[name]
            grads[grad_name] = torch.empty_like(x) if needed and x is not None else None
        def as_arg(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else t.contiguous()

        _C.prefill_backward(
            **inputs, cu_seqlens=cu_seqlens,
            d_out=as_arg(d_out), d_final_state=as_arg(d_final_state), **grads,
            scale=opts.get("scale"), use_qk_l2norm=opts.get("use_qk_l2norm", True),
            gate=opts.get("gate", "precomputed"), lower_bound=opts.get("lower_bound", -5.0),
            beta_logits=opts.get("beta_logits", False),
            allow_neg_eigval=opts.get("allow_neg_eigval", False),
            state_layout=opts.get("state_layout", "v_first"), backend=opts.get("backend", "auto"))
        return (*(grads[n] for n in _GRADS), None, None)


def prefill_with_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, *, A_log: Optional[torch.Tensor] = None,
                      dt_bias: Optional[torch.Tensor] = None,
                      initial_state: Optional[torch.Tensor] = None,
                      cu_seqlens: Optional[torch.Tensor] = None,
                      **options: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    """kda.prefill(..., output_final_state=True) with gradients for q, k, v, g, beta, A_log,
    dt_bias and initial_state (CPU tensors; backend "cpu" or "reference")."""
    return PrefillFunction.apply(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                                 options)
