"""Fused bias + SwiGLU, the gated activation of a Llama-style MLP.

x is the output of the first MLP linear without its bias, ``[..., 2f]`` laid out as
``[gate | up]`` along the last dim (e.g. ``[s, b, 2f]``, or ``[s, b, 2f/tp]`` under tensor
parallelism with each rank holding matching gate and up columns); bias is ``[2f]`` or None::

    g, u = (x + bias).chunk(2, dim=-1)
    y = silu(g) · u,  silu(g) = g·σ(g)                                    # [..., f]

The compiled kernels compute in float32 (float64 for float64 inputs), like the reference, using
the formulas of ``csrc/include/megapp/swiglu.h``.
"""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from megapp.fusions.common import acc_dtype, check_bias, run_tier
from megapp.fusions.extension import select_tier

_OP = "bias_swiglu"


def _check_inputs(x: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() == 0 or x.shape[-1] % 2 != 0:
        raise ValueError(
            f"bias_swiglu: x must be [..., 2f] = [gate | up] with an even last dim; "
            f"got x {tuple(x.shape)}"
        )
    if bias is not None:
        check_bias(_OP, x, bias, "2f")


def _acc_gate_up(x: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = acc_dtype(x.dtype)
    gate, up = x.to(dtype).chunk(2, dim=-1)
    if bias is not None:
        bias_gate, bias_up = bias.to(dtype).chunk(2)
        gate, up = gate + bias_gate, up + bias_up
    return gate, up


def _sigmoid(g: torch.Tensor) -> torch.Tensor:
    # 1/(1 + exp(−g)) as the kernels write it (torch.sigmoid may round differently).
    return 1.0 / (1.0 + torch.exp(-g))


def bias_swiglu_reference(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Pure-PyTorch ``silu(gate + b_gate) · (up + b_up)``.

    x ``[..., 2f]`` (``[gate | up]``), bias ``[2f]`` or None -> ``[..., f]`` in x's dtype.
    """
    g, u = _acc_gate_up(x, bias)
    # Same operation order as csrc/include/megapp/swiglu.h so fp32 results agree to round-off.
    y = (g * _sigmoid(g)) * u
    return y.to(x.dtype)


def bias_swiglu_reference_backward(
    grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of :func:`bias_swiglu_reference`.

    grad ``[..., f]``, x ``[..., 2f]`` -> (grad_input ``[..., 2f]``, grad_bias ``[2f]`` or None).
    """
    g, u = _acc_gate_up(x, bias)
    s = _sigmoid(g)
    dy = grad.to(g.dtype)
    dg = (dy * u) * (s * (1.0 + g * (1.0 - s)))
    du = dy * (g * s)
    grad_input = torch.cat([dg, du], dim=-1)
    grad_bias = None
    if bias is not None:
        # Sum the unrounded grad_input, as the kernels do.
        grad_bias = grad_input.reshape(-1, x.shape[-1]).sum(dim=0).to(bias.dtype)
    return grad_input.to(x.dtype), grad_bias


class BiasSwiGLUFunction(torch.autograd.Function):
    """Autograd for bias + SwiGLU that saves only the pre-activation input (x and bias).

    Backward recomputes σ(gate) from x instead of keeping the ``[..., f]`` output or the
    activation's intermediates: a cheap elementwise recompute for an activation less per layer.
    """

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.tier = select_tier(_OP, x)
        ctx.save_for_backward(x, bias)
        return run_tier(ctx.tier, "bias_swiglu_fwd", bias_swiglu_reference, x, bias)

    @staticmethod
    @once_differentiable
    def backward(
        ctx: FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, bias = ctx.saved_tensors
        grad_input, grad_bias = run_tier(
            ctx.tier, "bias_swiglu_bwd", bias_swiglu_reference_backward, grad, x, bias
        )
        return (
            grad_input if ctx.needs_input_grad[0] else None,
            grad_bias if ctx.needs_input_grad[1] else None,
        )


def bias_swiglu(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Fused ``silu(x[..., :f] + bias[:f]) · (x[..., f:] + bias[f:])``.

    x ``[..., 2f]`` laid out as ``[gate | up]`` (e.g. ``[s, b, 2f]``), bias ``[2f]`` or None;
    returns ``[..., f]``. Uses the CUDA or CPU kernel when built and applicable, else the
    PyTorch reference.
    """
    _check_inputs(x, bias)
    return BiasSwiGLUFunction.apply(x, bias)


__all__ = [
    "BiasSwiGLUFunction",
    "bias_swiglu",
    "bias_swiglu_reference",
    "bias_swiglu_reference_backward",
]
