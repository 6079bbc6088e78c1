"""The index arithmetic of moving tokens to experts and back: pure functions, no communication.

A token chooses ``k`` experts, so the unit of work is the (token, slot) *pair*, numbered
``n = t · k + slot`` in the order of the ``[T, k]`` routing. :func:`sort_by_expert` lists
the kept pairs grouped by expert (ascending), in token order within an expert, which is
the order the grouped matmul wants; :func:`permute` gathers their tokens, :func:`unpermute`
puts expert outputs back in pair order (a dropped pair gets zeros) and
:func:`combine_slots` adds each token's ``k`` outputs with its routing weights. The weights
apply in the wider of the two dtypes (float32 for 16-bit outputs and float32 weights) and
:func:`weigh_rows` keeps the outputs for backward in their own dtype, not a float32 copy.

Under expert parallelism rank ``r`` of ``ep`` holds experts ``[r·L, (r+1)·L)``
(``L = E / ep``), so sorting by expert also sorts the pairs by destination rank.
:func:`all_to_all_plan` lays the rows out for an all-to-all of uneven slices: each rank
sends its sorted pairs as they are, slice ``j`` to rank ``j``, exactly the rows routed
there; the receiving rank takes its rows out in local-expert-major order (expert ``l``
from source 0, 1, ..., then expert ``l + 1``; :func:`expert_major_rows`), and the return
trip puts them back in the same rows, so the un-permutation is exact. Expert tensor
parallelism gathers the rows of its ranks (padded to the largest) in the same
expert-major layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "AllToAllPlan",
    "Permutation",
    "all_to_all_plan",
    "combine_slots",
    "expert_major_rows",
    "permute",
    "place_rows",
    "sort_by_expert",
    "unpermute",
    "weigh_rows",
]


@dataclass(frozen=True)
class Permutation:
    """The kept pairs of ``num_tokens`` tokens with ``topk`` slots, sorted by expert.

    ``pairs`` ``[N]``: pair numbers ``t · k + slot``; ``tokens_per_expert`` ``[E]`` (int64):
    how many of them go to each expert.
    """

    pairs: torch.Tensor
    tokens_per_expert: torch.Tensor
    num_tokens: int
    topk: int

    @property
    def tokens(self) -> torch.Tensor:
        """``[N]``: the token of each sorted pair."""
        return torch.div(self.pairs, self.topk, rounding_mode="floor")


def sort_by_expert(
    experts: torch.Tensor, kept: torch.Tensor | None, num_experts: int
) -> Permutation:
    """Sort the pairs of ``experts`` ``[T, k]`` (expert ids) by expert, leaving out those
    where ``kept`` ``[T, k]`` is False."""
    num_tokens, topk = experts.shape
    flat = experts.reshape(-1)
    pairs = torch.arange(flat.numel(), device=flat.device)
    if kept is not None:
        pairs = pairs[kept.reshape(-1)]
    pairs = pairs[torch.sort(flat[pairs], stable=True).indices]
    counts = torch.bincount(flat[pairs], minlength=num_experts)
    return Permutation(pairs, counts, num_tokens, topk)


def permute(x: torch.Tensor, perm: Permutation) -> torch.Tensor:
    """Tokens ``[T, h]`` -> one row per sorted pair ``[N, h]``."""
    return x.index_select(0, perm.tokens)


def place_rows(rows: torch.Tensor, index: torch.Tensor, count: int) -> torch.Tensor:
    """``[count, h]`` zeros with ``rows`` at ``index`` (distinct). Backward keeps the index
    alone (``index_copy`` would keep ``rows`` as well)."""
    return rows.new_zeros(count, rows.shape[-1]).index_put((index,), rows)


def unpermute(y: torch.Tensor, perm: Permutation) -> torch.Tensor:
    """Rows of the sorted pairs ``[N, h]`` -> ``[T, k, h]`` in pair order, zeros for dropped
    pairs."""
    out = place_rows(y, perm.pairs, perm.num_tokens * perm.topk)
    return out.view(perm.num_tokens, perm.topk, y.shape[-1])


class _WeighRows(torch.autograd.Function):
    """``y · w[..., None]`` in the wider dtype; backward reads ``y`` in its own dtype (the
    product of the two promotes it again, exactly), so no widened copy is kept."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(y.dtype, w.dtype)
        ctx.save_for_backward(y, w)
        return y * w.to(dtype).unsqueeze(-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        y, w = ctx.saved_tensors
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_y = (grad * w.to(grad.dtype).unsqueeze(-1)).to(y.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (grad * y).sum(-1).to(w.dtype)
        return grad_y, grad_w


def weigh_rows(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``y`` ``[..., h]`` scaled by ``w`` ``[...]``, in the wider of their dtypes; the same
    values and gradients as ``y.to(d) * w.to(d).unsqueeze(-1)``, keeping ``y`` itself for
    backward."""
    return _WeighRows.apply(y, w)


def combine_slots(y: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``Σ_slot probs[t, slot] · y[t, slot]``: ``y`` ``[T, k, h]``, ``probs`` ``[T, k]`` ->
    ``[T, h]``, in y's dtype (the product and the sum in the wider of the two)."""
    return weigh_rows(y, probs).sum(dim=1).to(y.dtype)


@dataclass(frozen=True)
class AllToAllPlan:
    """Where rows go in an all-to-all of uneven slices over ``ep`` ranks (one rank's view).

    ``send_splits[j]``: this rank's sorted pairs for rank ``j`` (they are already grouped by
    destination, so they go out as they are); ``recv_splits[i]``: the rows rank ``i``
    sends here. ``recv_rows`` ``[M]``: the receive buffer's rows for this rank's experts in
    local-expert-major order (a permutation of ``0..M-1``); ``tokens_per_local_expert``:
    ``M`` split by local expert.
    """

    send_splits: list[int]
    recv_splits: list[int]
    recv_rows: torch.Tensor
    tokens_per_local_expert: list[int]
    total: int  # rows all ranks send, together (every rank computes the same)


def all_to_all_plan(counts: torch.Tensor, rank: int) -> AllToAllPlan:
    """The plan of ``rank`` from every rank's pairs per expert, ``counts`` ``[ep, E]``
    (``counts[i, e]``: pairs rank ``i`` sends to expert ``e``; rank ``j`` holds experts
    ``[j·L, (j+1)·L)``)."""
    ep, num_experts = counts.shape
    local = num_experts // ep
    counts = counts.to(torch.int64).cpu()
    by_destination = counts.view(ep, ep, local).sum(dim=-1)  # [source, destination]
    received = counts[:, rank * local : (rank + 1) * local]  # [source, local expert]
    starts = torch.cumsum(by_destination[:, rank], 0) - by_destination[:, rank]
    return AllToAllPlan(
        send_splits=by_destination[rank].tolist(),
        recv_splits=by_destination[:, rank].tolist(),
        recv_rows=expert_major_rows(received, starts),
        tokens_per_local_expert=received.sum(dim=0).tolist(),
        total=int(counts.sum()),
    )


def expert_major_rows(counts: torch.Tensor, starts: torch.Tensor | int) -> torch.Tensor:
    """Rows of a buffer of ``sources`` slices, slice ``i`` starting at row ``starts[i]``
    (an int ``slot``: at ``i · slot``) with ``counts[i, l]`` rows for expert ``l`` for every
    ``l`` in turn (``counts`` ``[sources, L]``), listed expert-major: expert 0's rows from
    source 0, 1, ..., then expert 1's."""
    counts = counts.to(torch.int64).cpu()
    sources, local = counts.shape
    if isinstance(starts, int):
        starts = torch.arange(sources) * starts
    offsets = torch.cumsum(counts, 1) - counts + starts.view(-1, 1)
    pieces = [
        torch.arange(int(counts[i, l])) + int(offsets[i, l])
        for l in range(local)
        for i in range(sources)
    ]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
