"""Fused RMSNorm over the last dim: reference, autograd Function, functional and module.

``y = x·rstd·weight``, ``rstd = 1/√(Σx²/h + eps)``; see :mod:`megapp.fusions.norm` for dtypes
and what backward keeps.
"""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from megapp.fusions.extension import acc_dtype, run_tier, select_tier
from megapp.fusions.norm import (
    FusedNorm,
    check_inputs,
    check_memory_efficient,
    check_saving_mode,
    xhat_from_output,
)

_RMS = "rms_norm"


def rms_norm_reference_stats(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Per-row rstd of x ``[..., h]``, shaped ``[...]``, in float32 (float64 for float64 x): the
    statistic :func:`rms_norm_reference_forward` returns."""
    xa = x.to(acc_dtype(x.dtype))
    return 1.0 / torch.sqrt(xa.square().mean(dim=-1) + eps)


def rms_norm_reference_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch RMSNorm over the last dim with its statistic.

    x ``[..., h]``, weight ``[h]`` -> (y ``[..., h]`` in x's dtype, rstd ``[...]`` in float32,
    float64 for float64 x). Differentiable.
    """
    acc = acc_dtype(x.dtype)
    rstd = rms_norm_reference_stats(x, eps)
    y = x.to(acc) * rstd.unsqueeze(-1) * weight.to(acc)
    return y.to(x.dtype), rstd


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Pure-PyTorch RMSNorm over the last dim; x ``[..., h]``, weight ``[h]``."""
    return rms_norm_reference_forward(x, weight, eps)[0]


def rms_norm_reference_backward(
    grad: torch.Tensor,
    saved: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    *,
    memory_efficient: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of RMSNorm from what the forward saved.

    ``saved`` is x ``[..., h]`` (or y with ``memory_efficient=True``), rstd ``[...]`` from
    :func:`rms_norm_reference_forward`. Returns (grad_input ``[..., h]``, grad_weight ``[h]``).
    """
    acc = acc_dtype(saved.dtype)
    s, w, g = saved.to(acc), weight.to(acc), grad.to(acc)
    rstd = rstd.to(acc).unsqueeze(-1)
    xhat = xhat_from_output(s, w, None) if memory_efficient else s * rstd
    wg = w * g
    mean_wg_xhat = (wg * xhat).mean(dim=-1, keepdim=True)
    grad_input = rstd * (wg - xhat * mean_wg_xhat)
    grad_weight = (g * xhat).reshape(-1, weight.shape[0]).sum(dim=0)
    return grad_input.to(saved.dtype), grad_weight.to(weight.dtype)


def _rstd(tier: str, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The forward's rstd of x, recomputed bit for bit by the tier that computed it."""
    if tier == "cuda":
        # No statistics-only CUDA kernel: the forward kernel again (its y is dropped).
        return torch.ops.megapp.rms_norm_fwd(x, weight, eps)[1]
    return run_tier(tier, "rms_norm_stats", rms_norm_reference_stats, x, eps)


class RMSNormFunction(torch.autograd.Function):
    """Autograd for RMSNorm over the last dim.

    Saves x and rstd (default); x alone with ``recompute_stats`` (backward recomputes rstd from
    it); or, with ``memory_efficient``, the output y and rstd. The weight is saved in every case.
    Backward returns (grad_input, grad_weight).
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        memory_efficient: bool,
        recompute_stats: bool = False,
    ) -> torch.Tensor:
        tier = select_tier(_RMS, x)
        y, rstd = run_tier(tier, "rms_norm_fwd", rms_norm_reference_forward, x, weight, eps)
        ctx.tier, ctx.eps = tier, eps
        ctx.memory_efficient = memory_efficient
        ctx.recompute_stats = recompute_stats and not memory_efficient
        if ctx.recompute_stats:
            ctx.save_for_backward(x, weight)
        else:
            ctx.save_for_backward(y if memory_efficient else x, rstd, weight)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.recompute_stats:
            saved, weight = ctx.saved_tensors
            rstd = _rstd(ctx.tier, saved, weight, ctx.eps)
        else:
            saved, rstd, weight = ctx.saved_tensors
        # By name: the reference orders these unlike the kernel's schema.
        named = dict(rstd=rstd, weight=weight, memory_efficient=ctx.memory_efficient)
        grad_input, grad_weight = run_tier(
            ctx.tier, "rms_norm_bwd", rms_norm_reference_backward, grad, saved, **named
        )
        needs = ctx.needs_input_grad
        return (
            grad_input if needs[0] else None,
            grad_weight if needs[1] else None,
            None,
            None,
            None,
        )


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-5,
    memory_efficient: bool = False,
    recompute_stats: bool = False,
) -> torch.Tensor:
    """Fused RMSNorm over the last dim; x ``[..., h]``, weight ``[h]``.

    ``memory_efficient=True`` saves the output instead of the input for backward and needs every
    weight entry nonzero; ``recompute_stats=True`` saves the input without its per-row rstd and
    recomputes it in backward (see :mod:`megapp.fusions.norm`; the two exclude each other). Uses
    the CUDA or CPU kernel when built and applicable, else the PyTorch reference.
    """
    check_inputs(_RMS, x, weight, None, eps)
    check_saving_mode(_RMS, memory_efficient, recompute_stats)
    if memory_efficient:
        check_memory_efficient(_RMS, x, weight)
    return RMSNormFunction.apply(x, weight, eps, memory_efficient, recompute_stats)


class RMSNorm(FusedNorm):
    """RMSNorm over the last dim of ``[..., hidden_size]`` with the fused kernels; weight
    ``[hidden_size]``, no bias. Constructor arguments: see :class:`FusedNorm`."""

    has_bias = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[..., hidden_size]`` -> ``[..., hidden_size]`` in x's dtype."""
        return self.normalize(x, self.weight)

    def normalize(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """This norm with ``weight`` ``[h]`` in place of the module's (``bias`` must be None)."""
        if bias is not None:
            raise ValueError("RMSNorm has no bias")
        return rms_norm(x, weight, self.eps, self.memory_efficient, self.recompute_stats)


__all__ = [
    "RMSNorm",
    "RMSNormFunction",
    "rms_norm",
    "rms_norm_reference",
    "rms_norm_reference_backward",
    "rms_norm_reference_forward",
    "rms_norm_reference_stats",
]
