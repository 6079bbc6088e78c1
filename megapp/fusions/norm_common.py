"""Plumbing shared by the fused LayerNorm and RMSNorm: argument checks, x̂ from the output (the
memory-efficient backward) and the modules' common base with their one constructor.

See :mod:`megapp.fusions.norm` for what the norms compute and keep for backward.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import nn

from megapp.param_attributes import mark_sequence_parallel

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
    """Constructor, parameters and settings of :class:`~megapp.fusions.layer_norm.LayerNorm` and
    :class:`~megapp.fusions.rms_norm.RMSNorm`, which differ in ``has_bias`` and their forward.

    Args:
        hidden_size: h, the normalized (last) dim; weight (and bias) are ``[h]``, initially 1
            (and 0).
        eps: added to the variance (LayerNorm) or the mean square (RMSNorm).
        memory_efficient: save the output instead of the input for backward (needs nonzero
            weight entries; see :mod:`megapp.fusions.norm`).
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
