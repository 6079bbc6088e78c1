"""Run a schedule's communication plan against a cost model, without processes.

The simulator walks every rank's plan (:mod:`megapp.pipeline_parallel.messages`):
a rank posts a step's sends and receives when it reaches the step, and the
step's action starts once what the rank waits for has completed under the
transport's rules (:class:`~megapp.pipeline_parallel.network.Rules`, default
``NCCL``: the engine's posting on NCCL, where a send finishes on its own
stream and a rank waits for its receives). A message completes ``p2p_latency``
after both of its operations are running. Header negotiation and the engine's
own cost per message are not modelled.

It returns every rank's timeline, the makespan, the bubble fraction and the
peak activations each rank holds (forwards whose backward has not run, with a
split backward's ``W`` holding ``weight_grad_memory`` of them). A schedule
whose ranks would wait on each other forever, or whose messages would never
all complete, raises :class:`ScheduleError` naming what each stuck rank waits
for.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from megapp.pipeline_parallel.messages import Message, ScheduleError, Step, communication_plan
from megapp.pipeline_parallel.network import Network, Rules
from megapp.pipeline_parallel.schedules import Action, Op, Schedule


@dataclass(frozen=True)
class CostModel:
    """Time of each action of one microbatch through one chunk, and what it holds.

    ``forward``/``backward`` are a number (every chunk alike) or a table
    ``[rank][chunk]`` for uneven stages; a split backward's ``input_grad`` and
    ``weight_grad`` default to half of ``backward`` each. ``p2p_latency`` is added to
    every message from the later of its two postings.

    ``activation`` is what one microbatch's forward through a chunk leaves held (a
    number or a ``[rank][chunk]`` table; 1 counts microbatch-chunks), and
    ``weight_grad_memory`` the share of it a deferred ``W`` keeps alive after its
    ``I`` (the inputs of the weight matmuls; 1.0 counts the whole until ``W``).

    ``update`` is the time of an optimizer step ``U`` of the asynchronous schedules (a
    number, or one per rank).

    ``rules``: the transport's point-to-point rules and the engine's way of posting
    under them (:class:`~megapp.pipeline_parallel.network.Rules`).
    """

    forward: float | Sequence[Sequence[float]] = 1.0
    backward: float | Sequence[Sequence[float]] = 2.0
    p2p_latency: float = 0.0
    input_grad: float | Sequence[Sequence[float]] | None = None
    weight_grad: float | Sequence[Sequence[float]] | None = None
    weight_grad_memory: float = 1.0
    rules: Rules = Rules.NCCL
    activation: float | Sequence[Sequence[float]] = 1.0
    update: float | Sequence[float] = 0.0

    def time(self, rank: int, action: Action) -> float:
        if action.op is Op.UPDATE:
            return float(self.update if isinstance(self.update, _NUMBER) else self.update[rank])
        if action.op is Op.FORWARD:
            return _lookup(self.forward, rank, action.chunk)
        if action.op is Op.BACKWARD:
            return _lookup(self.backward, rank, action.chunk)
        whole = _lookup(self.backward, rank, action.chunk)
        table = self.input_grad if action.op is Op.INPUT_GRAD else self.weight_grad
        return whole / 2 if table is None else _lookup(table, rank, action.chunk)

    def memory(self, rank: int, action: Action) -> float:
        """Change in held activations once ``action`` has run on ``rank``, in units of
        ``activation`` (default: one per microbatch-chunk)."""
        if action.op is Op.UPDATE:
            return 0.0
        size = _lookup(self.activation, rank, action.chunk)
        if action.op is Op.FORWARD:
            return size
        if action.op is Op.BACKWARD:
            return -size
        if action.op is Op.INPUT_GRAD:
            return -size * (1.0 - self.weight_grad_memory)
        return -size * self.weight_grad_memory


_NUMBER = (int, float)  # a tuple: isinstance checks it faster than a union


def _lookup(table: float | Sequence[Sequence[float]], rank: int, chunk: int) -> float:
    if isinstance(table, _NUMBER):
        return float(table)
    return float(table[rank][chunk])


class Event(NamedTuple):
    """One interval on one rank: an action (``kind`` "compute") or a wait for messages.
    A named tuple: a simulated timeline holds one per action, and a tuple is quick to make."""

    rank: int
    kind: str  # "compute" or "wait"
    name: str
    start: float
    end: float
    cpu: float | None = None  # a measured action's CPU seconds (its process, all threads)


@dataclass
class Timeline:
    schedule: Schedule
    events: list[Event] = field(default_factory=list)
    peak_in_flight: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)  # rank_ends() of a run kept without events

    def rank_ends(self) -> list[float]:
        """When every rank's last event ends."""
        ends = [0.0] * self.schedule.num_stages
        for event in self.events:
            ends[event.rank] = max(ends[event.rank], event.end)
        return ends

    @property
    def makespan(self) -> float:
        return max((e.end for e in self.events), default=0.0)

    def busy(self, rank: int) -> float:
        return sum(e.end - e.start for e in self.events if e.rank == rank and e.kind == "compute")

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time over the iteration: 1 - busy / (p · makespan)."""
        total = self.makespan * self.schedule.num_stages
        busy = sum(self.busy(r) for r in range(self.schedule.num_stages))
        return 0.0 if total == 0 else 1.0 - busy / total


def simulate(schedule: Schedule, costs: CostModel | None = None) -> Timeline:
    """Timeline of ``schedule`` under ``costs`` (default: forward 1, backward 2, no latency,
    NCCL's rules)."""
    costs = costs or CostModel()
    plan = communication_plan(schedule)
    if costs.rules in _CHANNEL_RULES:
        timeline = _simulate_channels(schedule, costs, plan)
        if timeline is not None:
            return timeline
    p = schedule.num_stages
    network = Network(costs.rules, costs.p2p_latency)
    clock = [0.0] * p
    cursor = [0] * p
    is_posted = [False] * p
    in_flight, peak = [0.0] * p, [0.0] * p
    timeline = Timeline(schedule)

    progress = True
    while progress:
        progress = False
        for rank in range(p):
            while cursor[rank] < len(plan[rank]):
                step = plan[rank][cursor[rank]]
                if not is_posted[rank]:
                    network.post(rank, step, clock[rank])
                    is_posted[rank] = True
                done = network.ready_at(step)
                if done is None:
                    break  # what this rank waits for has not completed yet
                ready = max(clock[rank], done)
                if ready > clock[rank]:
                    timeline.events.append(Event(rank, "wait", "p2p", clock[rank], ready))
                clock[rank] = ready
                if step.action is not None:
                    duration = costs.time(rank, step.action)
                    timeline.events.append(
                        Event(rank, "compute", str(step.action), ready, ready + duration)
                    )
                    clock[rank] = ready + duration
                    if not schedule.forward_only:  # evaluation keeps no activations
                        in_flight[rank] += costs.memory(rank, step.action)
                        peak[rank] = max(peak[rank], in_flight[rank])
                cursor[rank] += 1
                is_posted[rank] = False
                progress = True

    stuck = [r for r in range(p) if cursor[r] < len(plan[r])]
    if stuck or network.unfinished():
        lines = []
        for rank in stuck:
            step = plan[rank][cursor[rank]]
            waits = [
                f"{side} of the {message} ({network.blocking(unit)})"
                for unit in network.waits(step)
                if unit.done is None
                for side, message in unit.ops
            ]
            before = f"before {step.action}" if step.action else "at the end"
            lines.append(f"  rank {rank} {before} waits for: {'; '.join(waits)}")
        for unit in network.unfinished() if not stuck else ():
            ops = "; ".join(f"{side} of the {message}" for side, message in unit.ops)
            lines.append(f"  rank {unit.rank}'s {ops} never completes ({network.blocking(unit)})")
        raise ScheduleError(
            f"{schedule.name} deadlocks under {costs.rules.value}'s rules:\n" + "\n".join(lines)
        )
    timeline.peak_in_flight = [int(x) if float(x).is_integer() else x for x in peak]
    return timeline


def finish_times(schedule: Schedule, costs: CostModel | None = None) -> list[float]:
    """When every rank's last action of ``schedule`` ends under ``costs``: what
    :func:`simulate`'s timeline says, without recording its events (a search simulates
    many layouts to keep few). Raises :class:`ScheduleError` as :func:`simulate` does."""
    costs = costs or CostModel()
    if costs.rules in _CHANNEL_RULES:
        timeline = _simulate_channels(schedule, costs, communication_plan(schedule), False)
        if timeline is not None:
            return timeline.ends
    return simulate(schedule, costs).rank_ends()


# The rules under which a rank waits for its receives only and messages meet in order on
# channels: for each, whether every message is a channel of its own (gloo) or a channel is
# an ordered pair of ranks (NCCL, one communicator per direction).
_CHANNEL_RULES = {Rules.NCCL: False, Rules.GLOO: True}


def _simulate_channels(
    schedule: Schedule,
    costs: CostModel,
    plan: tuple[tuple[Step, ...], ...],
    record: bool = True,
) -> Timeline | None:
    """:func:`simulate` under NCCL's or gloo's rules, the same timeline faster; None where a
    rank or a message never completes (:func:`simulate` then names what each waits for).

    Under NCCL's rules every message between two ranks has a stream of its own at each end
    (one per direction of the pair), so the ``k``-th send on a channel meets the ``k``-th
    receive once both are posted and the message before them on the channel is done:
    ``done = max(send posted, receive posted, previous done) + latency``, the time
    :class:`~megapp.pipeline_parallel.network.Network` gives it. Under gloo's every message
    is a channel of its own, so nothing comes before it. Without ``record`` the timeline
    keeps no events, only every rank's end (``Timeline.ends``)."""
    p, latency = schedule.num_stages, costs.p2p_latency
    steps_of, messages, channels = _channel_plan(plan, _CHANNEL_RULES[costs.rules])
    sends: list[deque[tuple[int, float]]] = [deque() for _ in range(channels)]
    recvs: list[deque[tuple[int, float]]] = [deque() for _ in range(channels)]
    free = [0.0] * channels  # when the channel's last message completed
    done: list[float | None] = [None] * messages

    def match(channel: int) -> None:
        out, inbox = sends[channel], recvs[channel]
        while out and inbox:
            (message, sent), (wanted, received) = out[0], inbox[0]
            if message != wanted:
                return  # out of order: it never completes
            at = max(sent, received, free[channel]) + latency
            done[message] = free[channel] = at
            out.popleft()
            inbox.popleft()

    # per rank, (seconds, memory) of each (op, chunk) its actions run, asked once
    durations: list[dict[tuple[Op, int], tuple[float, float]]] = [{} for _ in range(p)]
    clock = [0.0] * p
    cursor = [0] * p
    is_posted = [False] * p
    in_flight, peak = [0.0] * p, [0.0] * p
    timeline = Timeline(schedule)
    events = timeline.events
    keeps = not schedule.forward_only  # evaluation keeps no activations
    progress = True
    while progress:
        progress = False
        for rank in range(p):
            steps, cost = steps_of[rank], durations[rank]
            # this rank's state, in locals while it advances
            at, now, posted = cursor[rank], clock[rank], is_posted[rank]
            held, top = in_flight[rank], peak[rank]
            while at < len(steps):
                posts, waits, action = steps[at]
                if not posted:
                    for message, channel, is_send in posts:
                        (sends if is_send else recvs)[channel].append((message, now))
                        match(channel)
                    posted = True
                ready, waiting = now, False
                for message in waits:
                    arrived = done[message]
                    if arrived is None:
                        waiting = True
                        break
                    if arrived > ready:
                        ready = arrived
                if waiting:
                    break  # what this rank waits for has not completed yet
                if record and ready > now:
                    events.append(Event(rank, "wait", "p2p", now, ready))
                now = ready
                if action is not None:
                    key = (action.op, action.chunk)
                    entry = cost.get(key)
                    if entry is None:
                        entry = cost[key] = (costs.time(rank, action), costs.memory(rank, action))
                    duration, memory = entry
                    if record:
                        events.append(Event(rank, "compute", str(action), now, now + duration))
                    now += duration
                    if keeps:
                        held += memory
                        top = max(top, held)
                at += 1
                posted = False
                progress = True
            cursor[rank], clock[rank], is_posted[rank] = at, now, posted
            in_flight[rank], peak[rank] = held, top
    stuck = any(cursor[r] < len(steps_of[r]) for r in range(p))
    if stuck or any(sends) or any(recvs):
        return None
    timeline.peak_in_flight = [int(x) if float(x).is_integer() else x for x in peak]
    timeline.ends = clock
    return timeline


_CHANNEL_PLANS: dict[tuple[int, bool], tuple[object, tuple]] = {}


def _channel_plan(plan: tuple[tuple[Step, ...], ...], per_message: bool) -> tuple[tuple, int, int]:
    """``plan`` with messages and channels (ordered pairs of ranks, or with ``per_message``
    one per message) numbered: per rank and step, what it posts ``(message, channel,
    is_send)`` in posting order, the messages it waits for and its action; then the numbers
    of messages and channels. Kept for the plans :func:`communication_plan` keeps."""
    entry = _CHANNEL_PLANS.get((id(plan), per_message))
    if entry is not None and entry[0] is plan:
        return entry[1]
    numbers: dict[Message, int] = {}  # in the order the messages are first posted
    channels: dict[tuple[int, int], int] = {}
    for steps in plan:
        for step in steps:
            for message in step.sends + step.recvs:
                if message not in numbers:
                    numbers[message] = len(numbers)
                    channels.setdefault((message.src, message.dst), len(channels))
    posted_as = {}  # each message as a send, and as a receive: (number, channel, is_send)
    for m, n in numbers.items():
        channel = n if per_message else channels[(m.src, m.dst)]
        posted_as[m] = (n, channel, True), (n, channel, False)
    steps_of = []
    for steps in plan:
        row = []
        for sends, recvs, action in steps:
            posts = waits = ()
            if sends or recvs:
                posts = tuple([posted_as[m][0] for m in sends] + [posted_as[m][1] for m in recvs])
                waits = tuple([numbers[m] for m in recvs])
            row.append((posts, waits, action))
        steps_of.append(tuple(row))
    steps_of = tuple(steps_of)
    compiled = (steps_of, len(numbers), len(numbers) if per_message else len(channels))
    if len(_CHANNEL_PLANS) >= 64:
        _CHANNEL_PLANS.clear()
    _CHANNEL_PLANS[(id(plan), per_message)] = (plan, compiled)
    return compiled
