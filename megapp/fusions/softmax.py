"""Fused scale + mask + softmax over attention scores, as in Megatron's core attention.

``y = softmax(scale · x + mask)`` along the last dim of scores ``x`` ``[b, heads, sq, sk]``.
Two masks, which may combine:

- ``causal``: key ``j`` is masked for query ``i`` when ``j > i + (sk − sq)``, so each query
  attends to the keys up to its own position (queries are the last ``sq`` of ``sk`` positions;
  Megatron's ``ScaledUpperTriangMaskedSoftmax`` is the case ``sq == sk``).
- ``mask``: a bool padding mask broadcastable to ``[b, heads, sq, sk]``, usually
  ``[b or 1, 1, sq, sk]``; ``True`` masks the score out (Megatron's ``ScaledMaskedSoftmax``).

Masked scores are excluded exactly (probability 0); a fully masked row gives zeros, not NaN nor
Megatron's uniform row. Math runs in float32 (float64 for float64 scores) with max subtraction.
Backward needs only the output: ``dx = scale · y · (dy − Σ dy · y)``.
"""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from megapp.fusions.extension import acc_dtype, run_tier, select_tier

_OP = "scaled_masked_softmax"


def _check_inputs(scores: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> None:
    if scores.dim() != 4:
        raise ValueError(
            f"scaled_masked_softmax: scores must be [b, heads, sq, sk], got {tuple(scores.shape)}"
        )
    if not scores.is_floating_point():
        raise ValueError(
            f"scaled_masked_softmax: scores must be floating point, got {scores.dtype}"
        )
    sq, sk = scores.shape[-2:]
    if causal and sk < sq:
        raise ValueError(
            f"scaled_masked_softmax: causal masking needs sk >= sq (queries are the last sq of "
            f"the sk positions), got sq={sq}, sk={sk}"
        )
    if mask is None:
        return
    if mask.dtype != torch.bool:
        raise ValueError(
            f"scaled_masked_softmax: mask must be bool (True = masked out), got {mask.dtype}"
        )
    if mask.device != scores.device:
        raise ValueError(
            f"scaled_masked_softmax: mask is on {mask.device}, scores on {scores.device}"
        )
    broadcasts = mask.dim() <= 4 and all(
        m in (1, s) for m, s in zip(reversed(mask.shape), reversed(scores.shape), strict=False)
    )
    if not broadcasts:
        raise ValueError(
            f"scaled_masked_softmax: mask of shape {tuple(mask.shape)} does not broadcast to the "
            f"scores' shape {tuple(scores.shape)} (expected [b or 1, 1, sq, sk])"
        )


def causal_mask(sq: int, sk: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Bool ``[sq, sk]``, True where key ``j > i + (sk − sq)`` (masked out) for query ``i``."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(sk - sq + 1)


def scaled_masked_softmax_reference(
    scores: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool
) -> torch.Tensor:
    """Pure-PyTorch ``softmax(scale · scores + mask)``; ``[b, heads, sq, sk]`` -> same shape.

    mask: bool, broadcastable to ``scores`` (True = masked out) or None; causal adds the
    ``j > i + (sk − sq)`` mask. Fully masked rows give zeros. Differentiable.
    """
    dtype = acc_dtype(scores.dtype)
    z = scores.to(dtype) * scale
    masked = mask
    if causal:
        tri = causal_mask(scores.shape[-2], scores.shape[-1], scores.device)
        masked = tri if masked is None else masked | tri
    if masked is not None:
        z = z.masked_fill(masked, float("-inf"))
    # Softmax is shift invariant: the max only guards exp against overflow (no gradient).
    row_max = z.detach().amax(dim=-1, keepdim=True)
    empty = row_max == float("-inf")
    # A fully masked row: exp(−∞ − 0) = 0 everywhere and the sum is replaced by 1, giving 0.
    e = torch.exp(z - row_max.masked_fill(empty, 0.0))
    total = e.sum(dim=-1, keepdim=True).masked_fill(empty, 1.0)
    # Multiply by the reciprocal, in the kernels' order.
    return (e * total.reciprocal()).to(scores.dtype)


def scaled_masked_softmax_reference_backward(
    grad: torch.Tensor, y: torch.Tensor, scale: float
) -> torch.Tensor:
    """Gradient of the scores from the output alone: ``scale · y · (dy − Σ dy · y)``."""
    dtype = acc_dtype(y.dtype)
    y_acc, dy = y.to(dtype), grad.to(dtype)
    dot = (dy * y_acc).sum(dim=-1, keepdim=True)
    return (scale * y_acc * (dy - dot)).to(y.dtype)


class ScaledMaskedSoftmaxFunction(torch.autograd.Function):
    """Autograd for the scaled masked softmax that saves only its output.

    Without attention dropout the ``probs @ v`` matmul saves the very same ``[b, heads, sq, sk]``
    tensor, so backward costs no extra activation memory; the scores and the mask are not kept.
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        scores: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
        causal: bool,
    ) -> torch.Tensor:
        ctx.tier = select_tier(_OP, scores)
        ctx.scale = scale
        args = (scores, mask, scale, causal)
        y = run_tier(ctx.tier, "scaled_masked_softmax_fwd", scaled_masked_softmax_reference, *args)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    @once_differentiable
    def backward(
        ctx: FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None, None]:
        (y,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        args = (grad, y, ctx.scale)
        grad_scores = run_tier(
            ctx.tier, "scaled_masked_softmax_bwd", scaled_masked_softmax_reference_backward, *args
        )
        return grad_scores, None, None, None


def scaled_masked_softmax(
    scores: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool
) -> torch.Tensor:
    """Fused ``softmax(scale · scores + mask)`` over the last dim.

    Args:
        scores: ``[b, heads, sq, sk]`` attention scores, any float dtype (math in float32).
        mask: bool padding mask broadcastable to ``scores`` (usually ``[b or 1, 1, sq, sk]``),
            True = masked out; or None.
        scale: multiplies the scores before the mask and softmax (e.g. ``1 / √d``).
        causal: also mask keys ``j > i + (sk − sq)`` for query ``i`` (needs ``sk >= sq``).

    Returns:
        Probabilities ``[b, heads, sq, sk]`` in the dtype of ``scores``; fully masked rows are 0.
        Uses the CUDA or CPU kernel when built and applicable, else the PyTorch reference.
    """
    _check_inputs(scores, mask, causal)
    return ScaledMaskedSoftmaxFunction.apply(scores, mask, float(scale), bool(causal))


__all__ = [
    "ScaledMaskedSoftmaxFunction",
    "causal_mask",
    "scaled_masked_softmax",
    "scaled_masked_softmax_reference",
    "scaled_masked_softmax_reference_backward",
]
