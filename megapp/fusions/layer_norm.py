"""Fused LayerNorm over the last dim: reference, autograd Function, functional and module.

``y = (x − mean)·rstd·weight + bias``, ``rstd = 1/√(Σ(x − mean)²/h + eps)``; see
:mod:`megapp.fusions.norm` for dtypes and what backward keeps.
"""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from megapp.fusions.common import acc_dtype, run_tier
from megapp.fusions.extension import select_tier
from megapp.fusions.norm_common import (
    FusedNorm,
    check_inputs,
    check_memory_efficient,
    check_saving_mode,
    xhat_from_output,
)

_LN = "layer_norm"


def layer_norm_reference_stats(
    x: torch.Tensor, eps: float = 1e-5
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row mean and rstd of x ``[..., h]``, shaped ``[...]``, in float32 (float64 for float64
    x): the statistics :func:`layer_norm_reference_forward` returns."""
    xa = x.to(acc_dtype(x.dtype))
    # Same operation order as csrc/include/megapp/norm.h: two-pass variance, 1/√ (not rsqrt).
    mean = xa.mean(dim=-1)
    centred = xa - mean.unsqueeze(-1)
    rstd = 1.0 / torch.sqrt(centred.square().mean(dim=-1) + eps)
    return mean, rstd


def layer_norm_reference_forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-5
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-PyTorch LayerNorm over the last dim with its statistics.

    x ``[..., h]``, weight/bias ``[h]`` -> (y ``[..., h]`` in x's dtype, mean ``[...]``,
    rstd ``[...]``), the statistics in float32 (float64 for float64 x). Differentiable.
    """
    acc = acc_dtype(x.dtype)
    mean, rstd = layer_norm_reference_stats(x, eps)
    centred = x.to(acc) - mean.unsqueeze(-1)
    y = centred * rstd.unsqueeze(-1) * weight.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype), mean, rstd


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    """Pure-PyTorch LayerNorm over the last dim; x ``[..., h]``, weight/bias ``[h]``."""
    return layer_norm_reference_forward(x, weight, bias, eps)[0]


def layer_norm_reference_backward(
    grad: torch.Tensor,
    saved: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    *,
    memory_efficient: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of LayerNorm from what the forward saved.

    ``saved`` is x ``[..., h]`` with mean/rstd ``[...]`` from
    :func:`layer_norm_reference_forward`, or with ``memory_efficient=True`` the output y
    (mean unused). Returns (grad_input ``[..., h]``, grad_weight ``[h]``, grad_bias ``[h]``);
    grad_bias = Σ_rows grad is returned even when bias is None.
    """
    acc = acc_dtype(saved.dtype)
    s, w, g = saved.to(acc), weight.to(acc), grad.to(acc)
    rstd = rstd.to(acc).unsqueeze(-1)
    if memory_efficient:
        xhat = xhat_from_output(s, w, None if bias is None else bias.to(acc))
    else:
        xhat = (s - mean.to(acc).unsqueeze(-1)) * rstd
    wg = w * g
    mean_wg = wg.mean(dim=-1, keepdim=True)
    mean_wg_xhat = (wg * xhat).mean(dim=-1, keepdim=True)
    grad_input = rstd * (wg - mean_wg - xhat * mean_wg_xhat)
    h = weight.shape[0]
    grad_weight = (g * xhat).reshape(-1, h).sum(dim=0)
    grad_bias = g.reshape(-1, h).sum(dim=0)
    return grad_input.to(saved.dtype), grad_weight.to(weight.dtype), grad_bias.to(weight.dtype)


def _stats(
    tier: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's (mean, rstd) of x, recomputed bit for bit by the tier that computed them."""
    if tier == "cuda":
        # No statistics-only CUDA kernel: the forward kernel again (its y is dropped).
        return torch.ops.megapp.layer_norm_fwd(x, weight, bias, eps)[1:]
    return run_tier(tier, "layer_norm_stats", layer_norm_reference_stats, x, eps)


class LayerNormFunction(torch.autograd.Function):
    """Autograd for LayerNorm over the last dim.

    Saves x, mean and rstd (default); x alone with ``recompute_stats`` (backward recomputes the
    statistics from it); or, with ``memory_efficient``, the output y and rstd. The parameters are
    saved in every case. Backward returns (grad_input, grad_weight, grad_bias).
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        eps: float,
        memory_efficient: bool,
        recompute_stats: bool = False,
    ) -> torch.Tensor:
        tier = select_tier(_LN, x)
        args = (x, weight, bias, eps)
        y, mean, rstd = run_tier(tier, "layer_norm_fwd", layer_norm_reference_forward, *args)
        ctx.tier, ctx.eps = tier, eps
        ctx.memory_efficient = memory_efficient
        ctx.recompute_stats = recompute_stats and not memory_efficient
        if memory_efficient:
            ctx.save_for_backward(y, rstd, weight, bias)
        elif recompute_stats:
            ctx.save_for_backward(x, weight, bias)
        else:
            ctx.save_for_backward(x, mean, rstd, weight, bias)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.memory_efficient:
            saved, rstd, weight, bias = ctx.saved_tensors
            mean = None
        elif ctx.recompute_stats:
            saved, weight, bias = ctx.saved_tensors
            mean, rstd = _stats(ctx.tier, saved, weight, bias, ctx.eps)
        else:
            saved, mean, rstd, weight, bias = ctx.saved_tensors
        # By name: the reference orders these unlike the kernel's schema.
        named = dict(
            mean=mean, rstd=rstd, weight=weight, bias=bias, memory_efficient=ctx.memory_efficient
        )
        grad_input, grad_weight, grad_bias = run_tier(
            ctx.tier, "layer_norm_bwd", layer_norm_reference_backward, grad, saved, **named
        )
        needs = ctx.needs_input_grad
        return (
            grad_input if needs[0] else None,
            grad_weight if needs[1] else None,
            grad_bias if bias is not None and needs[2] else None,
            None,
            None,
            None,
        )


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    memory_efficient: bool = False,
    recompute_stats: bool = False,
) -> torch.Tensor:
    """Fused LayerNorm over the last dim; x ``[..., h]``, weight/bias ``[h]`` (bias may be None).

    ``memory_efficient=True`` saves the output instead of the input for backward and needs every
    weight entry nonzero; ``recompute_stats=True`` saves the input without its per-row statistics
    and recomputes them in backward (see :mod:`megapp.fusions.norm`; the two exclude each other).
    Uses the CUDA or CPU kernel when built and applicable, else the PyTorch reference.
    """
    check_inputs(_LN, x, weight, bias, eps)
    check_saving_mode(_LN, memory_efficient, recompute_stats)
    if memory_efficient:
        check_memory_efficient(_LN, x, weight, bias)
    return LayerNormFunction.apply(x, weight, bias, eps, memory_efficient, recompute_stats)


class LayerNorm(FusedNorm):
    """LayerNorm over the last dim of ``[..., hidden_size]`` with the fused kernels; weight and
    bias ``[hidden_size]``. Constructor arguments: see :class:`FusedNorm`."""

    has_bias = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[..., hidden_size]`` -> ``[..., hidden_size]`` in x's dtype."""
        return self.normalize(x, self.weight, self.bias)

    def normalize(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """This norm with ``weight`` ``[h]`` and ``bias`` ``[h]`` in place of the module's."""
        return layer_norm(x, weight, bias, self.eps, self.memory_efficient, self.recompute_stats)


__all__ = [
    "LayerNorm",
    "LayerNormFunction",
    "layer_norm",
    "layer_norm_reference",
    "layer_norm_reference_backward",
    "layer_norm_reference_forward",
    "layer_norm_reference_stats",
]
