"""Ulysses context parallelism: all-to-alls that trade the sequence for heads.

Before attention, one all-to-all turns every cp rank's ``[b, heads, s/cp, d]``
into ``[b, heads/cp, s, d]``: a whole sequence for a cp-th of the heads. Each
rank then runs ordinary attention (heads are independent), block by block, keeping
no probabilities (:func:`~megapp.context_parallel.blocks.attend_in_tiles`), and a second
all-to-all turns the output back into ``[b, heads, s/cp, d]``. The backward of an
all-to-all is the opposite all-to-all. Query heads must be divisible by cp.

Grouped-query attention: key/value head ``j`` serves query heads ``j·r … j·r + r − 1``
(``r = heads / kv_heads``), so a rank that holds query heads ``[c·heads/cp, …)``
needs key/value heads ``[c·kv_heads/cp, …)``, which lines up when cp divides
kv_heads. Otherwise each key/value head is first repeated ``f = cp / gcd(kv_heads, cp)``
times (the fewest that cp divides; ``f`` always divides ``r``), as Ulysses
implementations such as verl's do for fewer key/value heads than ranks; the repeats'
gradients are summed back. (Transformer Engine's a2a, under Megatron-Core, refuses
this case.)
"""

from __future__ import annotations

import math

import torch

from megapp import comm
from megapp.comm import Group
from megapp.context_parallel import blocks
from megapp.context_parallel.layout import restore_order, to_rank_order

__all__ = ["a2a_attention", "check_heads", "kv_repeats"]


def check_heads(heads: int, cp: int) -> None:
    """Raise ValueError unless cp divides the query heads."""
    if heads % cp:
        raise ValueError(
            f"comm_type 'a2a' splits the attention heads over the context-parallel ranks, "
            f"but {heads} query heads are not divisible by cp = {cp}; use another cp size or "
            "comm_type 'p2p' or 'all_gather'"
        )


def kv_repeats(kv_heads: int, cp: int) -> int:
    """How many times each key/value head is repeated so that cp divides their number."""
    return cp // math.gcd(kv_heads, cp)


def _all_to_all(x: torch.Tensor, group: Group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``x`` along ``scatter_dim`` into one piece per rank, send piece i to rank i and
    concatenate what arrives, in rank order, along ``gather_dim``."""
    cp = comm.world_size(group)
    pieces = torch.stack(x.chunk(cp, dim=scatter_dim))  # [cp, ...]: piece i for rank i
    received = torch.empty_like(pieces)
    comm.all_to_all_into(received, pieces, group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """Forward: all-to-all scattering ``scatter_dim``, gathering ``gather_dim``. Backward: the
    all-to-all the other way."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def a2a_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Group,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """Attention of this cp rank's queries ``[b, heads, s/cp, d]`` (keys and values
    ``[b, kv_heads, s/cp, d]``) with heads redistributed over ``group``; returns
    ``[b, heads, s/cp, d]``."""
    cp = comm.world_size(group)
    if cp == 1:
        return blocks.attend(q, k, v, scale, causal)
    check_heads(q.shape[1], cp)
    repeats = kv_repeats(k.shape[1], cp)
    kv = torch.stack([k, v])  # [2, b, g, s/cp, d]: one all-to-all for both
    if repeats > 1:
        kv = kv.repeat_interleave(repeats, dim=2)
    # heads -> sequence: [b, heads/cp, s, d] in rank order, then in sequence order
    q = restore_order(_AllToAll.apply(q, group, 1, 2), cp, dim=2)
    kv = restore_order(_AllToAll.apply(kv, group, 2, 3), cp, dim=3)
    chunk = q.shape[2] // (2 * cp)  # tiles of a chunk of the load-balanced layout
    out = blocks.attend_in_tiles(q, kv, scale, causal, chunk)
    # sequence -> heads: back to this rank's slice of the sequence, all heads
    return _AllToAll.apply(to_rank_order(out, cp, dim=2), group, 2, 1)
