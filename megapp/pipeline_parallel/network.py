"""What a backend does with posted point-to-point messages, for the simulator.

A rank posts each step's sends and receives (:mod:`megapp.pipeline_parallel.messages`);
:class:`Network` says when each completes under a backend's rules and a way of posting
(:class:`Rules`), and so what a rank waiting for them waits for. The rules, with their
sources, are in ``docs/pipeline.md``; in short:

- NCCL runs a communicator's operations on one stream per rank, in posting order: an
  operation starts only when the one before it on that stream has completed. A send
  completes only once the peer's matching receive runs, and the receive only once the
  send runs (a rendezvous). Operations posted as one group (``ncclGroupStart/End``,
  torch's ``batch_isend_irecv``) run as one and complete as one. Messages between two
  ranks on one communicator match in posting order; tags are ignored. With two pipeline
  ranks, the previous and the next rank are the same process, so one communicator
  between them carries both directions unless two are made.
- gloo has no streams: every message meets its peer on its own, a send completes once
  its receive is posted, and posting never blocks.

A message here is matched ``latency`` after both of its operations are running (posted
and at the head of their streams).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from megapp.pipeline_parallel.messages import Message, Step

Side = tuple[str, Message]  # ("send" | "recv", message)


class Rules(enum.Enum):
    """A backend's point-to-point rules together with the way the engine posts under them.

    - ``GLOO``: every message on its own, no order between messages; a rank waits for
      its receives only (megapp on gloo).
    - ``NCCL``: NCCL's rules with one communicator per direction of each pair of ranks
      (the sending rank's stream carries only sends to that peer, the receiving rank's
      only receives from it), every message posted on its own; a rank waits for its
      receives only and its sends finish on their own streams (megapp on NCCL, and
      gloo under ``--strict-p2p``).
    - ``NCCL_BATCHED``: NCCL's rules with one communicator for the pipeline group and
      every step's messages posted as one group that the rank waits for as a whole
      (``batch_isend_irecv`` per step, as Megatron-Core posts).
    - ``NCCL_SHARED``: NCCL's rules with one communicator for the pipeline group and
      every message posted on its own, waiting for receives only: a send waiting for
      its receive holds up every later operation of the rank.

    The last two are kept to show what those disciplines cost (``docs/pipeline.md``).
    """

    GLOO = "gloo"
    NCCL = "nccl"
    NCCL_BATCHED = "nccl-batched"
    NCCL_SHARED = "nccl-shared"


@dataclass(eq=False)
class Posted:
    """Operations of one rank posted as one unit on ``streams``; ``done`` once all matched."""

    rank: int
    ops: tuple[Side, ...]
    streams: tuple[Hashable, ...]
    posted: float
    done: float | None = None
    matched: dict[Side, float] = field(default_factory=dict)


def _peer(side: Side) -> Side:
    return ("recv" if side[0] == "send" else "send", side[1])


class Network:
    """Posted operations, their streams and completion times under ``rules``."""

    def __init__(self, rules: Rules, latency: float = 0.0):
        self.rules, self.latency = rules, latency
        self.queues: dict[Hashable, deque[Posted]] = {}
        self.free: dict[Hashable, float] = {}  # when the stream's last completed unit completed
        self.unit_of: dict[Side, Posted] = {}
        self.units: list[Posted] = []

    def post(self, rank: int, step: Step, now: float) -> None:
        """Post ``step``'s sends and receives on ``rank`` at ``now``."""
        ops = [("send", m) for m in step.sends] + [("recv", m) for m in step.recvs]
        if self.rules is Rules.NCCL_BATCHED:
            units = [(tuple(ops), (("pipeline", rank),))] if ops else []
        elif self.rules is Rules.NCCL:
            units = [((op,), (("channel", op[1].src, op[1].dst, rank),)) for op in ops]
        elif self.rules is Rules.NCCL_SHARED:
            units = [((op,), (("pipeline", rank),)) for op in ops]
        else:
            units = [((op,), (op,)) for op in ops]  # a stream of its own: no order
        for unit_ops, streams in units:
            unit = Posted(rank, unit_ops, streams, now)
            self.units.append(unit)
            for stream in streams:
                self.queues.setdefault(stream, deque()).append(unit)
            for op in unit_ops:
                self.unit_of[op] = unit
            self._settle([unit, *(self.unit_of.get(_peer(op)) for op in unit_ops)])

    def waits(self, step: Step) -> list[Posted]:
        """What a rank waits for before running ``step``'s action: the units holding its
        receives, or under ``NCCL_BATCHED`` the step's whole group."""
        sides = [("recv", m) for m in step.recvs]
        if self.rules is Rules.NCCL_BATCHED:
            sides += [("send", m) for m in step.sends]
        return list({id(u): u for u in (self.unit_of[s] for s in sides)}.values())

    def ready_at(self, step: Step) -> float | None:
        """When everything the rank waits for before ``step``'s action has completed, or
        None while something has not."""
        times = [unit.done for unit in self.waits(step)]
        return None if any(t is None for t in times) else max(times, default=0.0)

    def unfinished(self) -> list[Posted]:
        """Units posted but never completed."""
        return [unit for unit in self.units if unit.done is None]

    def blocking(self, unit: Posted) -> str:
        """Why ``unit`` has not completed, in words."""
        for stream in unit.streams:
            head = self.queues[stream][0]
            if head is not unit:
                return f"behind {_describe(head.ops)} on rank {unit.rank}'s stream"
        missing = [op for op in unit.ops if op not in unit.matched]
        peers = [self.unit_of.get(_peer(op)) for op in missing]
        if any(p is None for p in peers):
            return "for a peer that has not posted its side"
        return "for the peer's side, which waits behind its own stream"

    def _at_head(self, unit: Posted) -> bool:
        return all(self.queues[s][0] is unit for s in unit.streams)

    def _running_since(self, unit: Posted) -> float:
        return max([unit.posted, *(self.free.get(s, 0.0) for s in unit.streams)])

    def _settle(self, todo: Iterable[Posted | None]) -> None:
        """Match and complete what can be, starting from the units in ``todo``."""
        work = deque(u for u in todo if u is not None)
        while work:
            unit = work.popleft()
            if unit.done is not None or not self._at_head(unit):
                continue
            for op in unit.ops:
                if op in unit.matched:
                    continue
                peer = self.unit_of.get(_peer(op))
                if peer is None or not self._at_head(peer):
                    continue
                at = max(self._running_since(unit), self._running_since(peer)) + self.latency
                unit.matched[op] = peer.matched[_peer(op)] = at
                work.append(peer)
            if len(unit.matched) == len(unit.ops):
                unit.done = max(unit.matched.values())
                for stream in unit.streams:
                    queue = self.queues[stream]
                    queue.popleft()
                    self.free[stream] = unit.done
                    if queue:
                        work.append(queue[0])


def _describe(ops: tuple[Side, ...]) -> str:
    return "; ".join(f"the {side} of the {message}" for side, message in ops)
