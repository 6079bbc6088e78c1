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
* ``memory_efficient=True`` (Apex's ``memory_efficient``): the output y and rstd. Backward recovers
  ``x̂ = (y − bias)/weight``, so when the next op keeps y anyway (a linear layer saves its input)
  the norm stores no activation of its own. This needs every weight entry nonzero: the compiled
  kernels and the reference turn x̂ into NaN where ``weight == 0``, so such gradients come out NaN
  (caught by loss-scaling / NaN checks) rather than silently wrong, and for CPU parameters, where
  the check costs no device synchronisation, the forward raises ``ValueError`` instead. Entries
  near zero amplify the rounding of y (≈ ulp(y)/|weight| in x̂): keep the default for such weights.

The weight/bias gradients are reduced over fixed row blocks in float32 (float64 for float64) and
the blocks summed in a fixed order, so they are bitwise reproducible.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.autograd.function import FunctionCtx, once_differentiable

from megapp.fusions.extension import select_tier

_LN = "layer_norm"
_RMS = "rms_norm"
_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    # float32 math for low-precision inputs (as the kernels), float64 stays float64.
    return torch.promote_types(dtype, torch.float32)


def _check_inputs(
    op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> None:
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
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{op}: unsupported dtype {x.dtype} (float32, float64, bfloat16, float16)")
    mixed = weight.dtype == torch.float32 and x.dtype in _LOW_PRECISION
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


def _check_memory_efficient(
    op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> None:
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


def _xhat_from_output(
    y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    # NaN where weight == 0 (x̂ is lost there), as megapp/norm.h.
    num = y if bias is None else y - bias
    return torch.where(weight != 0, num / weight, torch.full_like(num, math.nan))


# LayerNorm ----------------------------------------------------------------------------------------


def layer_norm_reference_forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-5
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-PyTorch LayerNorm over the last dim with its statistics.

    x ``[..., h]``, weight/bias ``[h]`` -> (y ``[..., h]`` in x's dtype, mean ``[...]``,
    rstd ``[...]``), the statistics in float32 (float64 for float64 x). Differentiable.
    """
    acc = _acc_dtype(x.dtype)
    xa = x.to(acc)
    # Same operation order as csrc/include/megapp/norm.h: two-pass variance, 1/√ (not rsqrt).
    mean = xa.mean(dim=-1)
    centred = xa - mean.unsqueeze(-1)
    rstd = 1.0 / torch.sqrt(centred.square().mean(dim=-1) + eps)
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
    acc = _acc_dtype(saved.dtype)
    s, w, g = saved.to(acc), weight.to(acc), grad.to(acc)
    rstd = rstd.to(acc).unsqueeze(-1)
    if memory_efficient:
        xhat = _xhat_from_output(s, w, None if bias is None else bias.to(acc))
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


class LayerNormFunction(torch.autograd.Function):
    """Autograd for LayerNorm over the last dim.

    Saves x, mean and rstd (default) or, with ``memory_efficient``, the output y and rstd; plus
    the parameters. Backward returns (grad_input, grad_weight, grad_bias).
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        eps: float,
        memory_efficient: bool,
    ) -> torch.Tensor:
        tier = select_tier(_LN, x)
        if tier == "reference":
            y, mean, rstd = layer_norm_reference_forward(x, weight, bias, eps)
        else:
            y, mean, rstd = torch.ops.megapp.layer_norm_fwd(x, weight, bias, eps)
        ctx.tier = tier
        ctx.memory_efficient = memory_efficient
        if memory_efficient:
            ctx.save_for_backward(y, rstd, weight, bias)
        else:
            ctx.save_for_backward(x, mean, rstd, weight, bias)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.memory_efficient:
            saved, rstd, weight, bias = ctx.saved_tensors
            mean = None
        else:
            saved, mean, rstd, weight, bias = ctx.saved_tensors
        if ctx.tier == "reference":
            grad_input, grad_weight, grad_bias = layer_norm_reference_backward(
                grad, saved, weight, bias, mean, rstd, memory_efficient=ctx.memory_efficient
            )
        else:
            grad_input, grad_weight, grad_bias = torch.ops.megapp.layer_norm_bwd(
                grad, saved, mean, rstd, weight, bias, ctx.memory_efficient
            )
        needs = ctx.needs_input_grad
        return (
            grad_input if needs[0] else None,
            grad_weight if needs[1] else None,
            grad_bias if bias is not None and needs[2] else None,
            None,
            None,
        )


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    memory_efficient: bool = False,
) -> torch.Tensor:
    """Fused LayerNorm over the last dim; x ``[..., h]``, weight/bias ``[h]`` (bias may be None).

    ``memory_efficient=True`` saves the output instead of the input for backward and needs every
    weight entry nonzero (see the module docstring). Uses the CUDA or CPU kernel when built and
    applicable, else the PyTorch reference.
    """
    _check_inputs(_LN, x, weight, bias, eps)
    if memory_efficient:
        _check_memory_efficient(_LN, x, weight, bias)
    return LayerNormFunction.apply(x, weight, bias, eps, memory_efficient)


# RMSNorm ------------------------------------------------------------------------------------------


def rms_norm_reference_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch RMSNorm over the last dim with its statistic.

    x ``[..., h]``, weight ``[h]`` -> (y ``[..., h]`` in x's dtype, rstd ``[...]`` in float32,
    float64 for float64 x). Differentiable.
    """
    acc = _acc_dtype(x.dtype)
    xa = x.to(acc)
    rstd = 1.0 / torch.sqrt(xa.square().mean(dim=-1) + eps)
    y = xa * rstd.unsqueeze(-1) * weight.to(acc)
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
    acc = _acc_dtype(saved.dtype)
    s, w, g = saved.to(acc), weight.to(acc), grad.to(acc)
    rstd = rstd.to(acc).unsqueeze(-1)
    xhat = _xhat_from_output(s, w, None) if memory_efficient else s * rstd
    wg = w * g
    mean_wg_xhat = (wg * xhat).mean(dim=-1, keepdim=True)
    grad_input = rstd * (wg - xhat * mean_wg_xhat)
    grad_weight = (g * xhat).reshape(-1, weight.shape[0]).sum(dim=0)
    return grad_input.to(saved.dtype), grad_weight.to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    """Autograd for RMSNorm over the last dim.

    Saves x and rstd (default) or, with ``memory_efficient``, the output y and rstd; plus the
    weight. Backward returns (grad_input, grad_weight).
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        memory_efficient: bool,
    ) -> torch.Tensor:
        tier = select_tier(_RMS, x)
        if tier == "reference":
            y, rstd = rms_norm_reference_forward(x, weight, eps)
        else:
            y, rstd = torch.ops.megapp.rms_norm_fwd(x, weight, eps)
        ctx.tier = tier
        ctx.memory_efficient = memory_efficient
        ctx.save_for_backward(y if memory_efficient else x, rstd, weight)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved, rstd, weight = ctx.saved_tensors
        if ctx.tier == "reference":
            grad_input, grad_weight = rms_norm_reference_backward(
                grad, saved, weight, rstd, memory_efficient=ctx.memory_efficient
            )
        else:
            grad_input, grad_weight = torch.ops.megapp.rms_norm_bwd(
                grad, saved, rstd, weight, ctx.memory_efficient
            )
        needs = ctx.needs_input_grad
        return (
            grad_input if needs[0] else None,
            grad_weight if needs[1] else None,
            None,
            None,
        )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, memory_efficient: bool = False
) -> torch.Tensor:
    """Fused RMSNorm over the last dim; x ``[..., h]``, weight ``[h]``.

    ``memory_efficient=True`` saves the output instead of the input for backward and needs every
    weight entry nonzero (see the module docstring). Uses the CUDA or CPU kernel when built and
    applicable, else the PyTorch reference.
    """
    _check_inputs(_RMS, x, weight, None, eps)
    if memory_efficient:
        _check_memory_efficient(_RMS, x, weight)
    return RMSNormFunction.apply(x, weight, eps, memory_efficient)


# Modules ------------------------------------------------------------------------------------------


class _FusedNorm(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        eps: float,
        memory_efficient: bool,
        sequence_parallel: bool,
        params_dtype: torch.dtype,
        device: torch.device | str | None,
        with_bias: bool,
    ) -> None:
        super().__init__()
        if not isinstance(hidden_size, int) or hidden_size <= 0:
            raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
        self.hidden_size = hidden_size
        self.eps = eps
        self.memory_efficient = memory_efficient
        self.sequence_parallel = sequence_parallel
        factory = dict(dtype=params_dtype, device=device)
        self.weight = nn.Parameter(torch.empty(hidden_size, **factory))
        if with_bias:
            self.bias = nn.Parameter(torch.empty(hidden_size, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()
        # With sequence parallelism each tensor-parallel rank normalizes its own [s/tp, b, h]
        # shard, so these gradients are partial sums to all-reduce over the tensor-parallel group.
        for param in self.parameters():
            param.sequence_parallel = sequence_parallel

    def reset_parameters(self) -> None:
        """weight = 1, bias = 0: the identity affine map."""
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return (
            f"{self.hidden_size}, eps={self.eps}, memory_efficient={self.memory_efficient}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class LayerNorm(_FusedNorm):
    """LayerNorm over the last dim of ``[..., hidden_size]`` with the fused kernels.

    Args:
        hidden_size: h, the normalized (last) dim.
        eps: added to the variance.
        memory_efficient: save the output instead of the input for backward (needs nonzero
            weight entries; see :mod:`megapp.fusions.norm`).
        sequence_parallel: the input is a sequence shard ``[s/tp, b, h]``; sets the attribute
            ``sequence_parallel`` on weight and bias, whose gradients then need an all-reduce
            over the tensor-parallel group.
        params_dtype: dtype of weight and bias (float32 also serves bf16/fp16 inputs).
        device: where to create the parameters.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        *,
        memory_efficient: bool = False,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(
            hidden_size, eps, memory_efficient, sequence_parallel, params_dtype, device, True
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[..., hidden_size]`` -> ``[..., hidden_size]`` in x's dtype."""
        return layer_norm(x, self.weight, self.bias, self.eps, self.memory_efficient)


class RMSNorm(_FusedNorm):
    """RMSNorm over the last dim of ``[..., hidden_size]`` with the fused kernels.

    Same arguments as :class:`LayerNorm`; there is no bias.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        *,
        memory_efficient: bool = False,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(
            hidden_size, eps, memory_efficient, sequence_parallel, params_dtype, device, False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[..., hidden_size]`` -> ``[..., hidden_size]`` in x's dtype."""
        return rms_norm(x, self.weight, self.eps, self.memory_efficient)


__all__ = [
    "LayerNorm",
    "LayerNormFunction",
    "RMSNorm",
    "RMSNormFunction",
    "layer_norm",
    "layer_norm_reference",
    "layer_norm_reference_backward",
    "layer_norm_reference_forward",
    "rms_norm",
    "rms_norm_reference",
    "rms_norm_reference_backward",
    "rms_norm_reference_forward",
]
