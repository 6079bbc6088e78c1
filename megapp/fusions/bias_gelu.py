"""Fused bias + GeLU (tanh approximation), as in the MLP of a transformer layer.

``y = gelu(x + bias)`` with ``gelu(z) = 0.5·z·(1 + tanh(√(2/π)·(z + 0.044715·z³)))``.
x is the output of the first MLP linear without its bias, e.g. ``[s, b, 4h]`` (or ``[s, b, 4h/tp]``
under tensor parallelism); bias is ``[4h]``. The compiled kernels compute in float32 (float64 for
float64 inputs), like the reference.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from megapp.fusions.common import acc_dtype, check_bias, run_tier
from megapp.fusions.extension import select_tier

_OP = "bias_gelu"
_BETA = math.sqrt(2.0 / math.pi)
_KAPPA = 0.044715


def _acc(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``x + bias``, ``[..., h]``, in the accumulation dtype."""
    dtype = acc_dtype(x.dtype)
    return x.to(dtype) + bias.to(dtype)


def _sigma(z: torch.Tensor) -> torch.Tensor:
    """σ(2u) with u = √(2/π)·(z + 0.044715·z³): 1 + tanh(u) = 2·σ(2u)."""
    u = _BETA * (z + _KAPPA * (z * z * z))
    return 1.0 / (1.0 + torch.exp(-2.0 * u))


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Pure-PyTorch ``gelu_tanh(x + bias)``; x ``[..., h]``, bias ``[h]`` -> ``[..., h]``."""
    z = _acc(x, bias)
    # z·σ(2u) = 0.5·z·(1 + tanh u), as csrc/include/megapp/gelu.h computes it (no cancellation).
    return (z * _sigma(z)).to(x.dtype)


def bias_gelu_reference_backward(
    grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`bias_gelu_reference`: (grad_input ``[..., h]``, grad_bias ``[h]``)."""
    z = _acc(x, bias)
    sigma = _sigma(z)
    dgelu = sigma + 2.0 * z * sigma * (1.0 - sigma) * _BETA * (1.0 + 3.0 * _KAPPA * (z * z))
    grad_input = grad.to(z.dtype) * dgelu
    # Sum the unrounded grad_input, as the kernels do.
    grad_bias = grad_input.reshape(-1, bias.shape[0]).sum(dim=0)
    return grad_input.to(x.dtype), grad_bias.to(bias.dtype)


class BiasGeLUFunction(torch.autograd.Function):
    """Autograd for ``gelu_tanh(x + bias)`` that saves only x and bias.

    Backward recomputes gelu' from the pre-activation instead of keeping the output: one
    ``[..., h]`` activation less per layer for a cheap elementwise recompute.
    """

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        ctx.tier = select_tier(_OP, x)
        ctx.save_for_backward(x, bias)
        return run_tier(ctx.tier, "bias_gelu_fwd", bias_gelu_reference, x, bias)

    @staticmethod
    @once_differentiable
    def backward(
        ctx: FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, bias = ctx.saved_tensors
        grad_input, grad_bias = run_tier(
            ctx.tier, "bias_gelu_bwd", bias_gelu_reference_backward, grad, x, bias
        )
        return (
            grad_input if ctx.needs_input_grad[0] else None,
            grad_bias if ctx.needs_input_grad[1] else None,
        )


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Fused ``gelu_tanh(x + bias)``; x ``[..., h]`` (e.g. ``[s, b, h]``), bias ``[h]``.

    Uses the CUDA or CPU kernel when built and applicable, else the PyTorch reference.
    """
    check_bias(_OP, x, bias)
    return BiasGeLUFunction.apply(x, bias)


__all__ = [
    "BiasGeLUFunction",
    "bias_gelu",
    "bias_gelu_reference",
    "bias_gelu_reference_backward",
]
