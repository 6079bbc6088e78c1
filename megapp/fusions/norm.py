"""Fused LayerNorm and RMSNorm over the last dim, with an optional memory-efficient backward.

For x ``[..., h]`` (e.g. ``[s, b, h]``, or ``[s/tp, b, h]`` under sequence parallelism) and
parameters ``[h]``::

    LayerNorm: y = (x − mean)·rstd·weight + bias,  rstd = 1/√(Σ(x − mean)²/h + eps)
    RMSNorm:   y = x·rstd·weight,                   rstd = 1/√(Σx²/h + eps)

The math runs in float32 for float32/bf16/fp16 inputs (float64 for float64) and y is returned in
x's dtype. The parameters have x's dtype, or float32 when x is bf16/fp16 (mixed precision, as
Apex's ``MixedFusedLayerNorm``); their gradients come back in the parameters' dtype.

What backward keeps, besides the parameters:

* default: the input x and per-row statistics (mean and rstd for LayerNorm, rstd for RMSNorm) in
  float32 (float64 for float64 x), shaped ``[...]``;
* ``recompute_stats=True``: the input x alone. Backward recomputes the statistics from x with the
  forward's own code (the CPU kernel's ``layer_norm_stats`` / ``rms_norm_stats``, the reference's
  ``*_reference_stats``, the CUDA forward kernel), bit for bit, so the gradients are unchanged; it
  costs one more pass over x, and saves 8 (LayerNorm) or 4 (RMSNorm) bytes per row;
* ``memory_efficient=True`` (Apex's ``memory_efficient``): the output y and rstd. Backward recovers
  ``x̂ = (y − bias)/weight``, so when the next op keeps y anyway (a linear layer saves its input)
  the norm stores no activation of its own. This needs every weight entry nonzero: the compiled
  kernels and the reference turn x̂ into NaN where ``weight == 0``, so such gradients come out NaN
  (caught by loss-scaling / NaN checks) rather than silently wrong, and for CPU parameters, where
  the check costs no device synchronisation, the forward raises ``ValueError`` instead. Entries
  near zero amplify the rounding of y (≈ ulp(y)/|weight| in x̂): keep the default for such weights.

The weight/bias gradients are reduced over fixed row blocks in float32 (float64 for float64) and
the blocks summed in a fixed order, so they are bitwise reproducible.

This module holds what both norms share (argument checks, x̂ from the output, the modules' base
:class:`FusedNorm`) and LayerNorm (reference, autograd Function, functional and module);
:mod:`megapp.fusions.rms_norm` builds RMSNorm alike on the same base.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import nn
from torch.autograd.function import FunctionCtx, once_differentiable

from megapp.fusions.extension import acc_dtype, run_tier, select_tier
from megapp.param_attributes import mark_sequence_parallel

__all__ = [
    "FusedNorm",
    "LayerNorm",
    "LayerNormFunction",
    "layer_norm",
    "layer_norm_reference",
    "layer_norm_reference_backward",
    "layer_norm_reference_forward",
    "layer_norm_reference_stats",
]

# ----- what both norms share -----

FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
LOW_PRECISION = (torch.bfloat16, torch.float16)


def check_inputs(
    op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> None:
    """Raise ``ValueError`` naming ``op`` unless x ``[..., h]`` and the parameters ``[h]`` fit."""
    if weight.dim() != 1 or x.dim() == 0 or x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"{op}: weight must be [h] and x [..., h]; got x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError(f"{op}: the normalized dim h must be positive, got x {tuple(x.shape)}")
    if bias is not None and bias.shape != weight.shape:
        raise ValueError(
            f"{op}: bias shape {tuple(bias.shape)} must equal the weight shape "
            f"{tuple(weight.shape)}"
        )
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: unsupported dtype {x.dtype} (float32, float64, bfloat16, float16)")
    mixed = weight.dtype == torch.float32 and x.dtype in LOW_PRECISION
    if weight.dtype != x.dtype and not mixed:
        raise ValueError(
            f"{op}: weight must have x's dtype, or float32 for bfloat16/float16 x; "
            f"got x {x.dtype} and weight {weight.dtype}"
        )
    if bias is not None and bias.dtype != weight.dtype:
        raise ValueError(f"{op}: bias and weight dtypes differ: {bias.dtype} vs {weight.dtype}")
    devices = {t.device for t in (x, weight, bias) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"{op}: x and the parameters must be on one device, got {devices}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"{op}: eps must be finite and >= 0, got {eps}")


def check_memory_efficient(
    op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> None:
    """Raise ``ValueError`` if the memory-efficient backward would need a zero weight entry."""
    tensors = (x, weight, bias)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    # Only where the check is free: on an accelerator it would block on the device every call
    # (there the kernels' NaN marks a zero weight instead).
    if needs_grad and weight.device.type == "cpu" and not bool(weight.ne(0).all()):
        raise ValueError(
            f"{op}: memory_efficient=True recovers x̂ = (y - bias)/weight in backward and needs "
            f"every weight entry nonzero; {int(weight.eq(0).sum())} of {weight.numel()} are zero "
            f"(x {tuple(x.shape)}). Use memory_efficient=False."
        )


def check_saving_mode(op: str, memory_efficient: bool, recompute_stats: bool) -> None:
    """Raise ``ValueError`` for both saving modes at once: recomputing the statistics needs the
    input, which the memory-efficient mode does not keep."""
    if memory_efficient and recompute_stats:
        raise ValueError(
            f"{op}: recompute_stats=True recomputes the statistics from the input, which "
            "memory_efficient=True does not keep; choose one of them"
        )


def xhat_from_output(
    y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x̂ = (y − bias)/weight; NaN where weight == 0 (x̂ is lost there), as megapp/norm.h."""
    num = y if bias is None else y - bias
    return torch.where(weight != 0, num / weight, torch.full_like(num, math.nan))


class FusedNorm(nn.Module):
    """Constructor, parameters and settings of :class:`LayerNorm` and
    :class:`~megapp.fusions.rms_norm.RMSNorm`, which differ in ``has_bias`` and their forward.

    Args:
        hidden_size: h, the normalized (last) dim; weight (and bias) are ``[h]``, initially 1
            (and 0).
        eps: added to the variance (LayerNorm) or the mean square (RMSNorm).
        memory_efficient: save the output instead of the input for backward (needs nonzero
            weight entries; see this module's description).
        recompute_stats: save the input without the per-row statistics; backward recomputes
            them (not with ``memory_efficient``).
        sequence_parallel: the input is a sequence shard ``[s/tp, b, h]``; sets the attribute
            ``sequence_parallel`` on the parameters, whose gradients then need an all-reduce
            over the tensor-parallel group.
        params_dtype: dtype of the parameters (float32 also serves bf16/fp16 inputs).
        device: where to create the parameters.
    """

    has_bias: ClassVar[bool]

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        *,
        memory_efficient: bool = False,
        recompute_stats: bool = False,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(hidden_size, int) or hidden_size <= 0:
            raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
        self.hidden_size = hidden_size
        self.eps = eps
        self.memory_efficient = memory_efficient
        self.recompute_stats = recompute_stats
        self.sequence_parallel = sequence_parallel
        factory = dict(dtype=params_dtype, device=device)
        self.weight = nn.Parameter(torch.empty(hidden_size, **factory))
        if self.has_bias:
            self.bias = nn.Parameter(torch.empty(hidden_size, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()
        # With sequence parallelism each tensor-parallel rank normalizes its own [s/tp, b, h]
        # shard, so these gradients are partial sums to all-reduce over the tensor-parallel group.
        for param in self.parameters():
            mark_sequence_parallel(param, sequence_parallel)

    def normalize(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The norm of x ``[..., h]`` with these parameters ``[h]`` in place of the module's
        own (a recompute in backward passes the ones its forward used)."""
        raise NotImplementedError

    def reset_parameters(self) -> None:
        """weight = 1, bias = 0: the identity affine map."""
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return (
            f"{self.hidden_size}, eps={self.eps}, memory_efficient={self.memory_efficient}, "
            f"recompute_stats={self.recompute_stats}, sequence_parallel={self.sequence_parallel}"
        )


# ----- LayerNorm -----

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
    and recomputes them in backward (see this module's description; the two exclude each other).
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
