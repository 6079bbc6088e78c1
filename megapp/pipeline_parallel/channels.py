"""One process group per direction of each pair of neighbouring pipeline ranks.

NCCL runs a communicator's operations in posting order on one stream per rank, and a
send there completes only once its receive runs. With one communicator for the whole
pipeline, a rank's send that waits for its peer holds up every receive the rank posted
after it, and schedules whose ranks send to each other at the same time (zero-bubble,
V-shaped, interleaved with ``m`` not a multiple of ``p``) deadlock or lose their bubble.
Here every ordered pair ``(src, dst)`` of neighbouring pipeline ranks gets a group of its
own that carries only ``src``'s messages to ``dst`` (and a second one for the headers that
announce their shapes), so on every stream the sends or the receives of one direction
queue in the order both ranks post them, and no message waits behind one going the other
way. With two pipeline ranks, previous and next are one peer: its two directions still
get two groups.

The groups are made once, with the layout (:func:`make_channels`; by
:func:`~megapp.parallel_state.initialize_model_parallel` on NCCL, or on gloo with
``strict_p2p``, ``pretrain_gpt.py --strict-p2p``); NCCL sets a communicator up only when
it first carries a message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from megapp import comm

__all__ = ["Channels", "channel_pairs", "make_channels"]


@dataclass
class Channels:
    """This rank's one-way groups, keyed by global ``(src, dst)``: ``data`` for activations
    and gradients, ``headers`` for the shapes announced ahead of them. ``strict``: on gloo,
    run each group's operations as NCCL runs a communicator's
    (:mod:`~megapp.pipeline_parallel.strict_p2p`)."""

    strict: bool = False
    data: dict[tuple[int, int], dist.ProcessGroup] = field(default_factory=dict)
    headers: dict[tuple[int, int], dist.ProcessGroup] = field(default_factory=dict)

    def group(self, src: int, dst: int, *, header: bool = False) -> dist.ProcessGroup:
        """The group carrying ``src``'s messages to ``dst`` (global ranks)."""
        table = self.headers if header else self.data
        if (src, dst) not in table:
            raise ValueError(
                f"no pipeline channel from rank {src} to rank {dst}: the two are not "
                "neighbours in a pipeline group given to make_channels"
            )
        return table[(src, dst)]

    def destroy(self) -> None:
        for group in [*self.data.values(), *self.headers.values()]:
            dist.destroy_process_group(group)
        self.data.clear()
        self.headers.clear()


def channel_pairs(ranks: Sequence[int]) -> list[tuple[int, int]]:
    """The ordered pairs of one pipeline's ranks that a schedule may send between: each
    rank and the next, both ways, the last and the first included (the looped placement
    sends from the last stage of one chunk to the first of the next)."""
    p = len(ranks)
    if p < 2:
        return []
    pairs = {(ranks[i], ranks[(i + 1) % p]) for i in range(p)}
    pairs |= {(b, a) for a, b in pairs}
    return sorted(pairs)


def make_channels(
    pipelines: Sequence[Sequence[int]],
    timeout: timedelta | None = None,
    *,
    strict: bool = False,
) -> Channels:
    """The channels of every pipeline in ``pipelines`` (lists of global ranks, stage
    order). Collective over the default group: every rank calls it with every pipeline,
    in the same order, as ``new_group`` requires; each keeps the groups it is in.
    ``strict``: see :class:`Channels`."""
    me, channels = dist.get_rank(), Channels(strict=strict)
    for ranks in pipelines:
        for src, dst in channel_pairs(ranks):
            for table, what in ((channels.data, "data"), (channels.headers, "header")):
                group = comm.new_group([src, dst], f"pipeline {what} {src}->{dst}", timeout)
                if me in (src, dst):
                    table[(src, dst)] = group
    return channels
