"""Token dispatch: getting each (token, expert) pair to the rank that holds the expert, and
its output back, over the expert-parallel group.

Both dispatchers take this rank's tokens ``[T, h]`` with their routing and return the rows
for this rank's experts (grouped by local expert) and, after the experts, the layer's
routed output ``[T, h]``. The routing weights are applied after the experts, at combine, as
Megatron-Core applies them. With one rank both are the plain permute / un-permute.

- :class:`AllToAllDispatcher` (``alltoall``): the pairs' counts per expert are all-gathered
  first (``E`` integers per rank), then the tokens go out in one all-to-all of uneven
  slices, exactly the rows routed to each rank (see
  :func:`~megapp.moe.permutation.all_to_all_plan`), and the outputs come back in a second;
  each rank applies the weights to its own tokens' outputs.
- :class:`AllGatherDispatcher` (``allgather``): every rank all-gathers all tokens, their
  choices and weights, runs its experts on the pairs routed to them, weights them and
  reduce-scatters the sums back (Megatron-Core's ``allgather`` dispatcher). Every rank must
  hold the same number of tokens.

Backward is autograd through the index operations and the collectives: an all-to-all's
gradient is the all-to-all of the gradients, an all-gather's a reduce-scatter. Expert tensor
parallelism happens inside the experts (:mod:`~megapp.moe.experts`), after dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megapp import comm
from megapp.comm import Group
from megapp.moe.permutation import (
    AllToAllPlan,
    Permutation,
    all_to_all_plan,
    combine_slots,
    permute,
    place_rows,
    sort_by_expert,
    unpermute,
    weigh_rows,
)
from megapp.moe.router import Routing
from megapp.tensor_parallel.mappings import (
    gather_first,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

__all__ = ["AllGatherDispatcher", "AllToAllDispatcher", "Dispatched", "all_to_all"]


class _AllToAll(torch.autograd.Function):
    """Forward: send slice i of dimension 0 (``in_splits[i]`` rows) to rank i, receive
    ``out_splits[i]`` rows from it. Backward: the all-to-all of the gradients the other way,
    which returns every slice to the rank it came from."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        comm.all_to_all_split(out, x.contiguous(), out_splits, in_splits, group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        out = grad.new_empty(sum(in_splits), *grad.shape[1:])
        comm.all_to_all_split(out, grad.contiguous(), in_splits, out_splits, ctx.group)
        return out, None, None, None


def all_to_all(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Group
) -> torch.Tensor:
    """Differentiable all-to-all of uneven slices of dimension 0 over ``group``:
    ``in_splits[i]`` rows of ``x`` to rank i, ``out_splits[i]`` rows from it."""
    if comm.world_size(group) == 1:
        return x
    return _AllToAll.apply(x, out_splits, in_splits, group)


@dataclass
class Dispatched:
    """The rows for this rank's experts, and what combine needs to bring them back.

    ``rows`` ``[M, h]``: grouped by local expert, ``tokens_per_expert[l]`` rows each.
    """

    rows: torch.Tensor
    tokens_per_expert: list[int]
    perm: Permutation
    probs: torch.Tensor
    plan: AllToAllPlan | None = None


class AllToAllDispatcher:
    """Pairs to experts by all-to-all over ``group`` (``None``: one rank, no communication)."""

    def __init__(self, num_experts: int, group: Group = None):
        self.num_experts, self.group = num_experts, group
        self.ep, self.rank = comm.world_size(group), comm.rank(group)

    def dispatch(self, x: torch.Tensor, routing: Routing) -> Dispatched:
        """This rank's tokens ``x`` ``[T, h]`` -> the rows for its experts."""
        perm = sort_by_expert(routing.experts, routing.kept, self.num_experts)
        rows = permute(x, perm)
        if self.ep == 1:
            return Dispatched(rows, perm.tokens_per_expert.tolist(), perm, routing.probs)
        counts = gather_first(perm.tokens_per_expert, self.group).view(self.ep, -1)
        plan = all_to_all_plan(counts, self.rank)
        if plan.total == 0:  # no rank routes any pair: every rank skips the exchange alike
            return Dispatched(rows, plan.tokens_per_local_expert, perm, routing.probs, plan)
        received = all_to_all(rows, plan.recv_splits, plan.send_splits, self.group)
        del rows  # sent: free it before the next copy (on any device, a reference holds it)
        mine = received.index_select(0, plan.recv_rows.to(x.device))
        return Dispatched(mine, plan.tokens_per_local_expert, perm, routing.probs, plan)

    def combine(self, out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """The experts' rows ``[M, h]`` -> this rank's routed output ``[T, h]``."""
        plan = dispatched.plan
        if plan is not None and plan.total > 0:  # each buffer freed once the next is made
            out = place_rows(out, plan.recv_rows.to(out.device), out.shape[0])
            out = all_to_all(out, plan.send_splits, plan.recv_splits, self.group)
        pairs = unpermute(out, dispatched.perm)
        del out
        return combine_slots(pairs, dispatched.probs)


class AllGatherDispatcher:
    """Pairs to experts by all-gathering every rank's tokens over ``group``; outputs back by
    reduce-scatter. Every rank of ``group`` must hold the same number of tokens."""

    def __init__(self, num_experts: int, group: Group = None):
        self.num_experts, self.group = num_experts, group
        self.ep, self.rank = comm.world_size(group), comm.rank(group)
        self.local = num_experts // self.ep
        self.one_rank = AllToAllDispatcher(num_experts)  # with ep 1 both are the same

    def dispatch(self, x: torch.Tensor, routing: Routing) -> Dispatched:
        if self.ep == 1:
            return self.one_rank.dispatch(x, routing)
        every_x = gather_from_sequence_parallel_region(x, self.group)  # [ep·T, h]
        every_probs = gather_from_sequence_parallel_region(routing.probs, self.group)
        experts = gather_first(routing.experts, self.group)
        first = self.rank * self.local
        mine = (experts >= first) & (experts < first + self.local)
        if routing.kept is not None:
            mine &= gather_first(routing.kept, self.group)
        # other ranks' experts are left out; ours are numbered from 0
        perm = sort_by_expert((experts - first).clamp(0, self.local - 1), mine, self.local)
        rows = permute(every_x, perm)
        return Dispatched(rows, perm.tokens_per_expert.tolist(), perm, every_probs)

    def combine(self, out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        if self.ep == 1:
            return self.one_rank.combine(out, dispatched)
        perm = dispatched.perm
        weights = dispatched.probs.reshape(-1).index_select(0, perm.pairs)
        weighted = weigh_rows(out, weights).to(out.dtype)
        partial = out.new_zeros(perm.num_tokens, out.shape[-1])  # [ep·T, h]: this rank's share
        # summed in place by index (index_add would keep the weighted rows for backward)
        partial = partial.index_put((perm.tokens,), weighted, accumulate=True)
        return reduce_scatter_to_sequence_parallel_region(partial, self.group)
