"""Fused rotary position embedding (RoPE) in Megatron's non-interleaved layout.

Queries or keys ``x`` ``[s, b, heads, d]`` are rotated on their first ``rot_dim`` channels, the
rest pass through. The angles ``freqs`` ``[s, 1, 1, rot_dim]`` (float32) hold one angle per
channel in two halves (``freqs[..., j]`` and ``freqs[..., j + rot_dim/2]``, equal as built by
:func:`rotary_freqs`), and with ``rotate_half(x) = [−x2, x1]``::

    y = x · cos(freqs) + rotate_half(x) · sin(freqs)

i.e. channel pair ``(j, j + rot_dim/2)`` is rotated by its angle. The map is linear in x, so
backward is its transpose, ``dx = dy · cos(freqs) − rotate_half(dy · sin(freqs))`` (a rotation
by the opposite angle), and needs nothing but the frequencies. Math runs in float32 (float64 for
float64 inputs), rounding once to the input dtype.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from megapp.fusions.extension import acc_dtype, run_tier, select_tier

_OP = "rope"


def rotary_freqs(
    seq_len: int,
    rot_dim: int,
    base: float = 10000.0,
    device: torch.device | str | None = None,
    scaling: dict[str, float] | None = None,
) -> torch.Tensor:
    """Angles ``[seq_len, 1, 1, rot_dim]`` float32: position ``p`` times ``base^(−2j / rot_dim)``.

    Channel ``j`` and ``j + rot_dim/2`` share the frequency ``j < rot_dim/2`` (Megatron's
    ``RotaryEmbedding``, non-interleaved). ``scaling`` (``factor``, ``low_freq_factor``,
    ``high_freq_factor``, ``original_max_position_embeddings``) applies Llama 3.1's
    frequency scaling, see :func:`llama3_scaled`.
    """
    if rot_dim <= 0 or rot_dim % 2:
        raise ValueError(f"rotary_freqs: rot_dim must be even and positive, got {rot_dim}")
    if seq_len < 0:
        raise ValueError(f"rotary_freqs: seq_len must be non-negative, got {seq_len}")
    exponent = torch.arange(0, rot_dim, 2, dtype=torch.float32, device=device) / rot_dim
    inv_freq = 1.0 / (base**exponent)
    if scaling is not None:
        inv_freq = llama3_scaled(inv_freq, **scaling)
    positions = torch.arange(seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq)  # [s, rot_dim/2]
    return torch.cat((angles, angles), dim=-1)[:, None, None, :]


def llama3_scaled(
    inv_freq: torch.Tensor,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> torch.Tensor:
    """Llama 3.1's RoPE scaling of the inverse frequencies: wavelengths longer than
    ``original / low_freq_factor`` are slowed by ``factor``, those shorter than
    ``original / high_freq_factor`` kept, and the band between blends the two linearly in
    ``original / wavelength``."""
    original = float(original_max_position_embeddings)
    wavelength = 2 * math.pi / inv_freq
    slowed = torch.where(wavelength > original / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * slowed / factor + smooth * slowed
    middle = (wavelength >= original / high_freq_factor) & (
        wavelength <= original / low_freq_factor
    )
    return torch.where(middle, blended, slowed)


def _check_inputs(x: torch.Tensor, freqs: torch.Tensor) -> None:
    if x.dim() != 4 or not x.is_floating_point():
        raise ValueError(
            f"rope: x must be a floating-point [s, b, heads, d] tensor, got {x.dtype} "
            f"{tuple(x.shape)}"
        )
    if freqs.dtype != torch.float32:
        raise ValueError(f"rope: freqs must be float32 angles, got {freqs.dtype}")
    if freqs.device != x.device:
        raise ValueError(f"rope: freqs is on {freqs.device}, x on {x.device}")
    if freqs.dim() != 4 or freqs.shape[0] != x.shape[0] or freqs.shape[1:3] != (1, 1):
        raise ValueError(
            f"rope: freqs must be [s, 1, 1, rot_dim] with s = {x.shape[0]} (x is "
            f"{tuple(x.shape)}), got {tuple(freqs.shape)}"
        )
    rot_dim = freqs.shape[-1]
    if rot_dim <= 0 or rot_dim % 2 or rot_dim > x.shape[-1]:
        raise ValueError(
            f"rope: rot_dim (freqs.shape[-1] = {rot_dim}) must be even, positive and at most "
            f"the head dim d = {x.shape[-1]}"
        )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [−x2, x1]`` on the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate(x: torch.Tensor, freqs: torch.Tensor, backward: bool) -> torch.Tensor:
    rot_dim = freqs.shape[-1]
    dtype = acc_dtype(x.dtype)
    angles = freqs.to(dtype)
    cos, sin = angles.cos(), angles.sin()
    x_rot = x[..., :rot_dim].to(dtype)
    if backward:  # the transpose: dx = dy·cos − rotate_half(dy·sin)
        y = x_rot * cos - _rotate_half(x_rot * sin)
    else:
        y = x_rot * cos + _rotate_half(x_rot) * sin
    return torch.cat((y.to(x.dtype), x[..., rot_dim:]), dim=-1)


def rope_reference(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Pure-PyTorch RoPE: x ``[s, b, heads, d]``, freqs ``[s, 1, 1, rot_dim]`` -> like x.

    Differentiable in x and freqs (freqs may be float64 here, e.g. for gradcheck).
    """
    return _rotate(x, freqs, backward=False)


def rope_reference_backward(grad: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Gradient of :func:`rope_reference` in x: ``grad · cos − rotate_half(grad · sin)``."""
    return _rotate(grad, freqs, backward=True)


class RotaryPosEmbFunction(torch.autograd.Function):
    """Autograd for RoPE that saves only the frequencies.

    The rotation is linear in x, so backward rotates the gradient back without x: no activation
    is kept. freqs gets no gradient (see :func:`apply_rotary_pos_emb`).
    """

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        ctx.tier = select_tier(_OP, x)
        ctx.save_for_backward(freqs)
        return run_tier(ctx.tier, "rope_fwd", rope_reference, x, freqs)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        (freqs,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None
        return run_tier(ctx.tier, "rope_bwd", rope_reference_backward, grad, freqs), None


def apply_rotary_pos_emb(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Fused rotary position embedding.

    Args:
        x: queries or keys ``[s, b, heads, d]``, any float dtype (math in float32).
        freqs: float32 angles ``[s, 1, 1, rot_dim]``, ``rot_dim`` even and ``<= d``, e.g. from
            :func:`rotary_freqs`; the first ``rot_dim`` channels are rotated, the rest copied.

    Returns:
        ``[s, b, heads, d]`` in the dtype of x. Uses the CUDA or CPU kernel when built and
        applicable, else the PyTorch reference. If freqs requires grad (learned angles), the
        differentiable reference runs instead, so its gradient is not silently dropped.
    """
    _check_inputs(x, freqs)
    if freqs.requires_grad and torch.is_grad_enabled():
        return rope_reference(x, freqs)
    return RotaryPosEmbFunction.apply(x, freqs)


__all__ = [
    "RotaryPosEmbFunction",
    "apply_rotary_pos_emb",
    "rope_reference",
    "rope_reference_backward",
    "rotary_freqs",
]
