"""Fused ops that begin by adding a linear layer's bias: the MLP's activations and the end of
every transformer sublayer.

x is a linear layer's output without its bias (e.g. ``[s, b, h]``, or a tensor-parallel or
sequence-parallel shard of it); each op adds the bias and runs its elementwise math in one pass,
in float32 (float64 for float64 inputs) like its reference, and keeps for backward only what it
cannot cheaply recompute:

- :func:`bias_gelu`: ``gelu(x + bias)`` with the tanh approximation,
  ``gelu(z) = 0.5·z·(1 + tanh(√(2/π)·(z + 0.044715·z³)))``; x ``[..., 4h]``, bias ``[4h]``;
  keeps x and bias.
- :func:`bias_swiglu`: the gated activation of a Llama-style MLP. x ``[..., 2f]`` is laid out as
  ``[gate | up]`` along the last dim (under tensor parallelism each rank holds matching gate and
  up columns), bias is ``[2f]`` or None::

      g, u = (x + bias).chunk(2, dim=-1)
      y = silu(g) · u,  silu(g) = g·σ(g)                                    # [..., f]

  with the formulas of ``csrc/include/megapp/swiglu.h``; keeps x and bias.
- :func:`bias_dropout_add`: ``out = residual + dropout(x + bias, p)``, dropout scaling kept
  elements by ``1/(1 − p)``; residual has x's shape, bias is ``[h]`` or None; keeps no tensor.

No dropout mask is stored. It is a pure function of ``(seed, offset)`` and the element index,
drawn from a counter-based generator (Philox-4x32-10, ``csrc/include/megapp/philox.h``) that the
CPU and CUDA kernels and the PyTorch reference below compute bit for bit alike::

    n     = offset + i                          # i: flat (row-major) index of the element
    draws = philox4x32_10(counter=(lo(n//4), hi(n//4), 0, 0), key=(lo(seed), hi(seed)))
    keep  = draws[n % 4] < floor((1 − p)·2^32)

Backward regenerates it from ``(seed, offset)``: the autograd function keeps neither x nor a
mask. The seed is one 63-bit draw from torch's default CPU generator per forward, so restoring
that generator's state (as :func:`megapp.tensor_parallel.random.checkpoint` does for its
recompute) reproduces the mask, and forking an RNG tracker stream around the call
(``get_rng_tracker().fork()``) gives a different one. The CPU generator is used on every device:
no device synchronisation, and a CPU and a CUDA run from the same state draw the same mask.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from megapp.fusions.extension import acc_dtype, check_bias, run_tier, select_tier

__all__ = [
    "BiasDropoutAddFunction",
    "BiasGeLUFunction",
    "BiasSwiGLUFunction",
    "bias_dropout_add",
    "bias_dropout_add_reference",
    "bias_dropout_add_reference_backward",
    "bias_gelu",
    "bias_gelu_reference",
    "bias_gelu_reference_backward",
    "bias_swiglu",
    "bias_swiglu_reference",
    "bias_swiglu_reference_backward",
    "draw_dropout_seed",
    "dropout_mask",
    "philox4x32_10",
]

# ----- bias + GeLU -----

_GELU = "bias_gelu"
_BETA = math.sqrt(2.0 / math.pi)
_KAPPA = 0.044715


def _acc_biased(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``x + bias``, ``[..., h]``, in the accumulation dtype."""
    dtype = acc_dtype(x.dtype)
    return x.to(dtype) + bias.to(dtype)


def _gelu_sigma(z: torch.Tensor) -> torch.Tensor:
    """σ(2u) with u = √(2/π)·(z + 0.044715·z³): 1 + tanh(u) = 2·σ(2u)."""
    u = _BETA * (z + _KAPPA * (z * z * z))
    return 1.0 / (1.0 + torch.exp(-2.0 * u))


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Pure-PyTorch ``gelu_tanh(x + bias)``; x ``[..., h]``, bias ``[h]`` -> ``[..., h]``."""
    z = _acc_biased(x, bias)
    # z·σ(2u) = 0.5·z·(1 + tanh u), as csrc/include/megapp/gelu.h computes it (no cancellation).
    return (z * _gelu_sigma(z)).to(x.dtype)


def bias_gelu_reference_backward(
    grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`bias_gelu_reference`: (grad_input ``[..., h]``, grad_bias ``[h]``)."""
    z = _acc_biased(x, bias)
    sigma = _gelu_sigma(z)
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
        ctx.tier = select_tier(_GELU, x)
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
    check_bias(_GELU, x, bias)
    return BiasGeLUFunction.apply(x, bias)


# ----- bias + SwiGLU -----

_SWIGLU = "bias_swiglu"


def _check_swiglu_inputs(x: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() == 0 or x.shape[-1] % 2 != 0:
        raise ValueError(
            f"bias_swiglu: x must be [..., 2f] = [gate | up] with an even last dim; "
            f"got x {tuple(x.shape)}"
        )
    if bias is not None:
        check_bias(_SWIGLU, x, bias, "2f")


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
        ctx.tier = select_tier(_SWIGLU, x)
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
    _check_swiglu_inputs(x, bias)
    return BiasSwiGLUFunction.apply(x, bias)


# ----- bias + dropout + residual add -----

_DROPOUT_ADD = "bias_dropout_add"
_M32 = 0xFFFFFFFF
_M16 = 0xFFFF
# Random123's Philox-4x32 constants (round multipliers, Weyl key increments).
_PHILOX_M0 = 0xD2511F53
_PHILOX_M1 = 0xCD9E8D57
_PHILOX_W0 = 0x9E3779B9
_PHILOX_W1 = 0xBB67AE85
_PHILOX_ROUNDS = 10
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _mulhilo32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of the 64-bit product ``a · b`` for a, b < 2^32.

    int64 cannot hold the product, so b is split into 16-bit halves (each partial < 2^48).
    """
    p_lo = a * (b & _M16)
    p_hi = a * (b >> 16)
    t = ((p_hi & _M16) << 16) + p_lo  # < 2^49
    return (p_hi >> 16) + (t >> 32), t & _M32


def philox4x32_10(counter: torch.Tensor, key: tuple[int, int]) -> torch.Tensor:
    """Philox-4x32-10 of each counter: int64 ``[..., 4]`` holding uint32 words -> same shape.

    ``key`` is two uint32 words. Matches Random123 (and ``csrc/include/megapp/philox.h``).
    """
    if counter.dtype != torch.int64 or counter.shape[-1:] != (4,):
        raise ValueError(
            f"philox4x32_10: counter must be int64 [..., 4], got {counter.dtype} "
            f"{tuple(counter.shape)}"
        )
    c0, c1, c2, c3 = counter.unbind(-1)
    k0, k1 = key[0] & _M32, key[1] & _M32
    for round_ in range(_PHILOX_ROUNDS):
        if round_ > 0:
            k0, k1 = (k0 + _PHILOX_W0) & _M32, (k1 + _PHILOX_W1) & _M32
        hi0, lo0 = _mulhilo32(_PHILOX_M0, c0)
        hi1, lo1 = _mulhilo32(_PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return torch.stack([c0, c1, c2, c3], dim=-1)


def _check_dropout_args(p: float, seed: int, offset: int) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"bias_dropout_add: dropout probability must be in [0, 1], got {p}")
    if not _INT64_MIN <= seed <= _INT64_MAX:
        raise ValueError(f"bias_dropout_add: seed must fit in int64, got {seed}")
    if not 0 <= offset <= _INT64_MAX:
        raise ValueError(f"bias_dropout_add: offset must be a non-negative int64, got {offset}")


def _keep_threshold(p: float) -> int:
    # floor((1 − p)·2^32) in IEEE double, exactly as dropout_keep_threshold() in philox.h.
    return int((1.0 - p) * 4294967296.0)


def _scale(p: float) -> float:
    return 1.0 / (1.0 - p) if p < 1.0 else 0.0


def draw_dropout_seed() -> int:
    """One 63-bit seed from torch's default CPU generator (what each training forward draws)."""
    return int(torch.randint(0, _INT64_MAX, (), dtype=torch.int64).item())


def dropout_mask(
    shape: Sequence[int],
    p: float,
    seed: int,
    offset: int = 0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The keep mask (``True`` = kept) that the kernels draw for ``(seed, offset)``.

    Bool tensor of ``shape``; element with flat index i uses counter index ``offset + i``, so
    ``dropout_mask(shape, p, seed)`` flattened and sliced at ``k`` equals the mask of the rest
    drawn with ``offset=k``. Pure PyTorch int64 arithmetic, on any device.
    """
    _check_dropout_args(p, seed, offset)
    shape = tuple(shape)
    numel = math.prod(shape)
    if numel == 0:
        return torch.zeros(shape, dtype=torch.bool, device=device)
    first, last = offset >> 2, (offset + numel - 1) >> 2
    blocks = torch.arange(first, last + 1, dtype=torch.int64, device=device)
    zeros = torch.zeros_like(blocks)
    counter = torch.stack([blocks & _M32, blocks >> 32, zeros, zeros], dim=-1)
    draws = philox4x32_10(counter, (seed & _M32, (seed >> 32) & _M32)).reshape(-1)
    start = offset & 3
    return (draws[start : start + numel] < _keep_threshold(p)).reshape(shape)


def _check_dropout_add_inputs(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor
) -> None:
    if x.dim() == 0:
        raise ValueError("bias_dropout_add: x must be [..., h], got a 0-d tensor")
    if residual.shape != x.shape:
        raise ValueError(
            f"bias_dropout_add: residual shape {tuple(residual.shape)} must equal x shape "
            f"{tuple(x.shape)}"
        )
    if residual.dtype != x.dtype:
        raise ValueError(
            f"bias_dropout_add: x and residual dtypes differ: {x.dtype} vs {residual.dtype}"
        )
    if bias is not None:
        check_bias(_DROPOUT_ADD, x, bias)


def _apply_mask(t: torch.Tensor, p: float, seed: int, offset: int) -> torch.Tensor:
    """``mask · t · 1/(1 − p)`` in t's (accumulation) dtype; t itself when p == 0."""
    if p == 0.0:
        return t
    mask = dropout_mask(t.shape, p, seed, offset, device=t.device)
    # The scale rounded to the accumulation type once, as the kernels do.
    scale = torch.tensor(_scale(p), dtype=t.dtype, device=t.device)
    return torch.where(mask, t * scale, torch.zeros((), dtype=t.dtype, device=t.device))


def bias_dropout_add_reference(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    p: float,
    seed: int,
    offset: int = 0,
) -> torch.Tensor:
    """Pure-PyTorch ``residual + dropout(x + bias)`` with the mask of ``(seed, offset)``.

    x, residual ``[..., h]``, bias ``[h]`` or None -> ``[..., h]`` in x's dtype. ``p == 0``
    draws nothing (``seed`` is ignored).
    """
    _check_dropout_args(p, seed, offset)
    acc = acc_dtype(x.dtype)
    z = x.to(acc)
    if bias is not None:
        z = z + bias.to(acc)
    # Same operation order as the kernels: one rounding, at the end.
    return (residual.to(acc) + _apply_mask(z, p, seed, offset)).to(x.dtype)


def bias_dropout_add_reference_backward(
    grad: torch.Tensor, p: float, seed: int, offset: int = 0, bias_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of :func:`bias_dropout_add_reference` with respect to x and bias.

    grad ``[..., h]`` -> (grad_x ``[..., h]``, grad_bias ``[h]`` or None unless ``bias_grad``).
    The residual's gradient is ``grad`` itself.
    """
    _check_dropout_args(p, seed, offset)
    grad_x = _apply_mask(grad.to(acc_dtype(grad.dtype)), p, seed, offset)
    grad_bias = None
    if bias_grad:
        # Sum the unrounded grad_x, as the kernels do.
        grad_bias = grad_x.reshape(-1, grad.shape[-1]).sum(dim=0).to(grad.dtype)
    return grad_x.to(grad.dtype), grad_bias


class BiasDropoutAddFunction(torch.autograd.Function):
    """Autograd for ``residual + dropout(x + bias, p)`` that saves no tensor at all.

    Backward needs only the mask, regenerated from ``(seed, offset)``: nothing of size
    ``[..., h]`` (neither x nor a mask) is kept between forward and backward. ``p == 0`` is the
    inference path: a plain fused add, no random draws.
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        residual: torch.Tensor,
        p: float,
        seed: int,
        offset: int,
    ) -> torch.Tensor:
        ctx.tier = select_tier(_DROPOUT_ADD, x)
        ctx.p, ctx.seed, ctx.offset = p, seed, offset
        args = (x, bias, residual, p, seed, offset)
        return run_tier(ctx.tier, "bias_dropout_add_fwd", bias_dropout_add_reference, *args)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        need_x, need_bias, need_residual = ctx.needs_input_grad[:3]
        grad_x = grad_bias = None
        if need_x or need_bias:
            args = (grad, ctx.p, ctx.seed, ctx.offset, need_bias)
            grad_x, grad_bias = run_tier(
                ctx.tier, "bias_dropout_add_bwd", bias_dropout_add_reference_backward, *args
            )
        return (
            grad_x if need_x else None,
            grad_bias if need_bias else None,
            grad if need_residual else None,
            None,
            None,
            None,
        )


def bias_dropout_add(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    p: float,
    training: bool,
    *,
    seed: int | None = None,
    offset: int = 0,
) -> torch.Tensor:
    """Fused ``residual + dropout(x + bias, p)``; x, residual ``[..., h]``, bias ``[h]`` or None.

    In training with ``p > 0`` the mask comes from ``seed`` (default: one draw from torch's
    default CPU generator) and ``offset`` (the flat index of x's first element in a larger
    tensor whose mask it should share; 0 otherwise). Otherwise it is ``residual + x + bias``
    with no random draw. Uses the CUDA or CPU kernel when built and applicable, else the
    PyTorch reference.
    """
    _check_dropout_add_inputs(x, bias, residual)
    _check_dropout_args(p, 0 if seed is None else seed, offset)
    if not training or p == 0.0:
        p, seed = 0.0, 0
    elif seed is None:
        seed = draw_dropout_seed()
    return BiasDropoutAddFunction.apply(x, bias, residual, float(p), seed, offset)
