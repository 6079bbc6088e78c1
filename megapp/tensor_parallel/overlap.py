"""Sequence parallelism's collectives run against the matmuls beside them (``--tp-comm-overlap``).

With sequence parallelism a column-parallel linear all-gathers its input's sequence shards
before its matmul and a row-parallel one reduce-scatters its output after it. Here each
collective is a ring of ``tp`` steps whose transfers run while the matmul works on the
piece already at hand, as Transformer Engine's userbuffers do for Megatron-Core:

- :func:`ring_gather_matmul`: every rank computes the rows of its own shard while passing
  it on; each next step computes the shard that just arrived. After ``tp − 1`` hops every
  rank has every shard's rows, and (kept where asked) the gathered input as a by-product.
- :func:`matmul_ring_scatter`: every rank computes one shard's partial product, adds the
  running sum it received from the previous rank and passes it on; the sum of shard ``r``
  ends on rank ``r`` after ``tp − 1`` hops. The next piece's matmul runs while a sum
  travels.

:class:`OverlappedColumn` and :class:`OverlappedRow` are the column- and row-parallel
matmuls built on them (their backward passes use the other ring: a column layer's input
gradient is reduce-scattered, a row layer's output gradient gathered). Every piece adds
in a fixed order, so the result is the plain collective's up to floating-point
reassociation of the ``tp`` partial sums.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from megapp.autograd.deferred import weight_grad_of_linear
from megapp.comm import Group, rank, ring_shift, world_size
from megapp.tensor_parallel.mappings import gather_first

Matmul = Callable[[torch.Tensor], torch.Tensor]


def ring_gather_matmul(shard: torch.Tensor, matmul: Matmul, group: Group, keep: bool = False):
    """``matmul(gather(shard))`` along dimension 0, each shard's rows computed while the
    next one travels; with ``keep``, ``(that, gather(shard))``."""
    n, me = world_size(group), rank(group)
    rows = shard.shape[0]
    current = shard.contiguous()
    gathered = current.new_empty((n * rows, *current.shape[1:])) if keep else None
    out = None
    for step in range(n):
        owner = (me - step) % n  # the rank whose shard is at hand
        pending = []
        if step < n - 1:
            incoming = torch.empty_like(current)
            pending = ring_shift(current, incoming, group)
        if gathered is not None:
            gathered[owner * rows : (owner + 1) * rows] = current
        piece = matmul(current)
        if out is None:
            out = piece.new_empty((n * rows, *piece.shape[1:]))
        out[owner * rows : (owner + 1) * rows] = piece
        for work in pending:
            work.wait()
        if step < n - 1:
            current = incoming
    return (out, gathered) if keep else out


def matmul_ring_scatter(x: torch.Tensor, matmul: Matmul, group: Group) -> torch.Tensor:
    """This rank's shard of ``matmul(x)`` summed over the ranks (a reduce-scatter along
    dimension 0), each piece's sum passed on while the next piece is computed."""
    n, me = world_size(group), rank(group)
    if x.shape[0] % n:
        raise ValueError(f"dimension 0 ({x.shape[0]}) is not divisible by the {n} TP ranks")
    pieces = x.chunk(n, dim=0)
    total: torch.Tensor | None = None
    received: torch.Tensor | None = None
    pending: list = []
    for step in range(n):
        owner = (me - step - 1) % n  # the shard whose running sum this rank extends
        partial = matmul(pieces[owner])
        for work in pending:
            work.wait()
        total = partial if received is None else partial.add_(received)
        if step < n - 1:
            received = torch.empty_like(total)
            pending = ring_shift(total.contiguous(), received, group)
    assert total is not None
    return total


class OverlappedColumn(torch.autograd.Function):
    """``gather(x) Wᵀ (+ b)`` for a sequence shard ``x``: forward gathers by
    :func:`ring_gather_matmul`; backward starts gathering the input again for the weight
    gradient and reduce-scatters the input gradient by :func:`matmul_ring_scatter`
    meanwhile."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return ring_gather_matmul(x, lambda piece: F.linear(piece, weight, bias), group)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        total, gathering = gather_first(x, ctx.group, async_op=True)
        grad_input = matmul_ring_scatter(grad, lambda piece: piece.matmul(weight), ctx.group)
        gathering.wait()
        grad_weight = weight_grad_of_linear(grad, total)
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(dim=0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None


class OverlappedRow(torch.autograd.Function):
    """``reduce_scatter(x Wᵀ)`` along the sequence: forward by :func:`matmul_ring_scatter`;
    backward gathers the output gradient by :func:`ring_gather_matmul`, which computes the
    input gradient on the way and leaves the gathered gradient for the weight's."""

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.group = group
        ctx.save_for_backward(x, weight)
        return matmul_ring_scatter(x, lambda piece: F.linear(piece, weight), group)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_input, total = ring_gather_matmul(
            grad, lambda piece: piece.matmul(weight), ctx.group, keep=True
        )
        return grad_input, weight_grad_of_linear(total, x), None


__all__ = ["OverlappedColumn", "OverlappedRow", "matmul_ring_scatter", "ring_gather_matmul"]
