"""Node-deduplicated token dispatch (``hierarchical``): a token crosses between nodes once
per destination node, not once per chosen expert.

The expert-parallel ranks are ``ep / g`` nodes of ``g`` consecutive ranks (rank ``r`` on node
``r // g``, lane ``r % g``). A token goes out in two all-to-alls, as DeepEP's internode
dispatch moves it:

1. **across nodes**: once to each node holding one of its experts, to the rank of its own
   lane there, with the routing weights of the slots on that node (the others zeroed);
2. **within the node**: from there once to each rank holding one of those experts.

The expert rank weighs its experts' outputs and sums them per received row; the way back
retraces both steps, each summing what came back for one row before passing it on. With
``k`` experts a token on ``n`` nodes crosses ``n`` times instead of up to ``k``; the sums
are the flat dispatcher's (:class:`~megapp.moe.dispatch.AllToAllDispatcher`) in another
order, so the two agree to round-off. With ``g = ep`` (one node) the first step stays on
each rank and the second still sends a token once per destination rank.

Both steps are all-to-alls of uneven slices over the expert-parallel group
(:func:`~megapp.moe.dispatch.all_to_all`); a rank's slices for ranks it does not talk to in
a step are empty. The counts each step needs are all-gathered first; beside the rows, each
step sends the slots' experts (-1 for the slots elsewhere) and their weights. Backward is autograd
through the index operations and the all-to-alls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megapp import comm
from megapp.comm import Group
from megapp.moe.dispatch import AllToAllDispatcher, Dispatched, all_to_all
from megapp.moe.permutation import combine_slots, sort_by_expert, unpermute
from megapp.moe.router import Routing
from megapp.tensor_parallel.mappings import gather_first

__all__ = ["HierarchicalDispatcher", "fan_out"]


def fan_out(
    keys: torch.Tensor, valid: torch.Tensor, num_keys: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One pair per row and distinct key among its valid slots: ``keys`` ``[R, k]`` in
    ``[0, num_keys)``, ``valid`` ``[R, k]``. Returns the pairs' rows and keys ``[P]`` sorted
    by key, then row; the slots of each pair's row with its key ``[P, k]``; the pairs per key
    ``[num_keys]``."""
    hit = torch.zeros(num_keys, keys.shape[0], dtype=torch.bool, device=keys.device)
    rows = torch.arange(keys.shape[0], device=keys.device).unsqueeze(1).expand_as(keys)
    hit[keys[valid], rows[valid]] = True
    key, row = hit.nonzero(as_tuple=True)  # row-major: by key, then row
    slots = valid[row] & (keys[row] == key.unsqueeze(1))
    return row, key, slots, hit.sum(dim=1)


@dataclass
class _Step:
    """One all-to-all step of the dispatch: the rows it sends (pairs of rows and keys) and
    its slices, for the way back."""

    rows: torch.Tensor  # [P]: the source row of each pair sent
    sources: int  # rows the step sent from
    send_splits: list[int]
    recv_splits: list[int]


@dataclass
class HierarchicalDispatched(Dispatched):
    """:class:`~megapp.moe.dispatch.Dispatched` with both steps, for the way back; ``probs``
    are the arrived rows' weights ``[Q, k]`` (zero for slots of other ranks' experts)."""

    steps: tuple[_Step, _Step] | None = None


class HierarchicalDispatcher:
    """Tokens to experts over ``group`` in two steps, across nodes of ``node_size`` ranks
    (``None``, or at least the group: one node), then within them (see the module
    docstring)."""

    def __init__(self, num_experts: int, group: Group = None, node_size: int | None = None):
        self.num_experts, self.group = num_experts, group
        self.ep, self.rank = comm.world_size(group), comm.rank(group)
        self.local = num_experts // self.ep
        self.node_size = min(node_size or self.ep, self.ep)  # a node may hold whole groups
        if self.node_size < 1 or self.ep % self.node_size:
            raise ValueError(
                f"the hierarchical dispatcher's node size ({node_size}) must divide the "
                f"expert-parallel size ({self.ep}) or be a multiple of it"
            )
        self.one_rank = AllToAllDispatcher(num_experts)  # with ep 1 both are the same

    def _step(
        self, x: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, to_rank, num_keys: int
    ) -> tuple[_Step, torch.Tensor, torch.Tensor]:
        """Send each row of ``x`` once per distinct valid key to rank ``to_rank(key)`` (rising
        with the key, so the pairs, sorted by key, are grouped by destination), with the
        slots of that key: returns the step, the pairs' slot masks and what arrived."""
        row, key, slots, _ = fan_out(keys, valid, num_keys)
        send = torch.bincount(to_rank(key), minlength=self.ep)
        table = gather_first(send, self.group).view(self.ep, self.ep).cpu()
        send_splits, recv_splits = table[self.rank].tolist(), table[:, self.rank].tolist()
        step = _Step(row, x.shape[0], send_splits, recv_splits)
        return step, slots, self._forward(x.index_select(0, row), step)

    def _forward(self, values: torch.Tensor, step: _Step) -> torch.Tensor:
        """One row per pair of ``step`` (in its order) to where the step sends it."""
        return all_to_all(values, step.recv_splits, step.send_splits, self.group)

    def dispatch(self, x: torch.Tensor, routing: Routing) -> Dispatched:
        """This rank's tokens ``x`` ``[T, h]`` -> the rows for its experts."""
        if self.ep == 1:
            return self.one_rank.dispatch(x, routing)
        g, lane = self.node_size, self.rank % self.node_size
        experts = routing.experts
        valid = torch.ones_like(experts, dtype=torch.bool) if routing.kept is None else routing.kept
        owner = experts // self.local
        # 1: across nodes, to this lane's rank on each node holding a chosen expert
        step1, slots1, x1 = self._step(
            x, owner // g, valid, lambda node: node * g + lane, self.ep // g
        )
        # the slots there: their experts (-1 for the others) and weights (0 for the others)
        experts1 = self._forward(experts.index_select(0, step1.rows).where(slots1, -1), step1)
        probs1 = self._forward(routing.probs.index_select(0, step1.rows) * slots1, step1)
        # 2: within the node, to each rank holding one of them
        valid1 = experts1 >= 0
        owners1 = experts1.clamp(min=0) // self.local
        step2, slots2, x2 = self._step(x1, owners1, valid1, lambda r: r, self.ep)
        experts2 = self._forward(experts1.index_select(0, step2.rows).where(slots2, -1), step2)
        probs2 = self._forward(probs1.index_select(0, step2.rows) * slots2, step2)
        # here: each arrived row's slots for this rank's experts, by local expert
        local = (experts2 - self.rank * self.local).clamp(0, self.local - 1)
        perm = sort_by_expert(local, experts2 >= 0, self.local)
        rows = x2.index_select(0, perm.tokens)
        tokens_per_expert = perm.tokens_per_expert.tolist()
        return HierarchicalDispatched(rows, tokens_per_expert, perm, probs2, None, (step1, step2))

    def combine(self, out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """The experts' rows ``[M, h]`` -> this rank's routed output ``[T, h]``."""
        if self.ep == 1:
            return self.one_rank.combine(out, dispatched)
        pairs = unpermute(out, dispatched.perm)
        del out  # each buffer freed once the next is made
        summed = combine_slots(pairs, dispatched.probs)
        del pairs
        for step in reversed(dispatched.steps):  # each arrived row's sum back to its sender
            summed = all_to_all(summed, step.send_splits, step.recv_splits, self.group)
            summed = _sum_rows(summed, step.rows, step.sources)
        return summed


def _sum_rows(parts: torch.Tensor, rows: torch.Tensor, count: int) -> torch.Tensor:
    """``[count, h]``: ``parts`` summed by ``rows``, in float32 at least."""
    dtype = torch.promote_types(parts.dtype, torch.float32)
    total = parts.new_zeros(count, parts.shape[-1], dtype=dtype)
    return total.index_put((rows,), parts.to(dtype), accumulate=True).to(parts.dtype)
