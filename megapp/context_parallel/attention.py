"""The front of context-parallel attention: check the inputs once, pick the mechanism."""

from __future__ import annotations

import math

import torch

from megapp import comm
from megapp.comm import Group
from megapp.context_parallel.a2a import a2a_attention, check_heads
from megapp.context_parallel.all_gather import all_gather_attention
from megapp.context_parallel.layout import check_sequence_length
from megapp.context_parallel.ring import ring_attention

__all__ = ["COMM_TYPES", "attention"]

# Megatron-Core's names for them (its --cp-comm-type).
COMM_TYPES = {
    "p2p": ring_attention,
    "all_gather": all_gather_attention,
    "a2a": a2a_attention,
}


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int, comm_type: str) -> None:
    if comm_type not in COMM_TYPES:
        raise ValueError(
            f"unknown comm_type {comm_type!r}; choose one of {', '.join(map(repr, COMM_TYPES))}"
        )
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(
            "q, k and v must be [b, heads, s/cp, d] with k and v of one shape, got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    (b, heads, s, d), (kb, kv_heads, ks, kd) = q.shape, k.shape
    if (kb, ks, kd) != (b, s, d):
        raise ValueError(
            f"k and v {tuple(k.shape)} must match q {tuple(q.shape)} in batch, sequence and "
            "head size"
        )
    if heads % kv_heads:
        raise ValueError(
            f"{heads} query heads are not divisible by {kv_heads} key/value heads; each "
            "key/value head serves a whole group of query heads"
        )
    check_sequence_length(s * cp, cp)
    if comm_type == "a2a":
        check_heads(heads, cp)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Group,
    comm_type: str,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """softmax(q kᵀ · scale) v over the whole sequence, from this cp rank's slice of it.

    Args:
        q: this rank's queries ``[b, heads, s/cp, d]``, the slice of
            :func:`~megapp.context_parallel.layout.split` (chunks ``i`` and
            ``2cp − 1 − i`` of the sequence on cp rank ``i``), as megapp's attention
            lays them out.
        k, v: this rank's keys and values ``[b, kv_heads, s/cp, d]``; ``kv_heads``
            divides ``heads`` (grouped-query attention).
        group: the context-parallel group (``None``: one rank, plain attention).
        comm_type: ``"p2p"`` (ring), ``"all_gather"`` or ``"a2a"`` (Ulysses).
        causal: mask each query from the keys after it, in global positions.
        softmax_scale: default ``1/√d``.

    Returns this rank's slice of the output, ``[b, heads, s/cp, d]`` in q's dtype;
    differentiable in q, k and v. Raises ValueError, before any communication, for a
    comm_type, shape or head count that cannot work. No attention dropout.
    """
    cp = comm.world_size(group)
    _check(q, k, v, cp, comm_type)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return COMM_TYPES[comm_type](q, k, v, group, causal, scale)
