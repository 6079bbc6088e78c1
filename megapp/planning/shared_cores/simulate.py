"""Processes that share a CPU's cores: each computes at its share of them.

On one CPU machine a job of ``world`` single-threaded processes shares ``cores`` cores. When
``n`` of them compute at once, each gets ``cores / n`` of a core (processor sharing: the
fluid limit of a fair scheduler), or, while they fit on the cores, a core of its own; a
process waiting for a message uses none.

:func:`simulate_shared` runs a schedule's communication plan that way. Every pipeline rank
stands for ``processes_per_rank`` processes (its tensor- and data-parallel peers, which run
the same actions in step), an action's cost is its work in seconds on a core of its own
(its tensor-parallel collectives included: gloo's collectives keep their processes busy
copying, reducing and handing bytes to sockets, and a peer waiting for another leaves its
core to the processes that have work), a pipeline message costs its seconds as work at
both ends (its sender's and its receiver's copies through the socket), and the rate of
every running action changes whenever an action starts or ends. A pipeline's bubble
therefore leaves its cores to the ranks that compute, when it happens and for as long as
it lasts. With a core per process and free messages it gives the timeline of
:func:`~megapp.pipeline_parallel.simulate.simulate`. The optimizer
step, which every process runs at once, is :func:`core_slowdown` ``(cores, world, 1)``
times slower.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megapp.pipeline_parallel.messages import ScheduleError, Step, communication_plan
from megapp.pipeline_parallel.network import Rules
from megapp.pipeline_parallel.schedules import Schedule
from megapp.pipeline_parallel.simulate import CostModel, Event, Timeline
from megapp.planning.timing import ActionCosts


def core_slowdown(cores: int, world_size: int, busy_share: float) -> float:
    """How much slower each of ``world_size`` processes computes when they share ``cores``
    cores and are busy ``busy_share`` of the time: the processes busy at once over the
    cores, at least 1."""
    return max(1.0, world_size * busy_share / cores)


def slowed_steps(costs: ActionCosts, everyone: float) -> ActionCosts:
    """``costs`` with the optimizer step, which all processes run at once, ``everyone``
    times slower."""
    extra = [o * (everyone - 1.0) for o in costs.optimizer]
    return dataclasses.replace(
        costs,
        tail=[t + e for t, e in zip(costs.tail, extra, strict=True)],
        optimizer=[o * everyone for o in costs.optimizer],
    )


class _Rank:
    """Where one pipeline rank is in its plan during :func:`simulate_shared`."""

    def __init__(self) -> None:
        self.cursor = 0
        # ready | waiting (a peer has not posted) | until (its messages are in at ``wake``)
        # | running | done
        self.state = "ready"
        self.posted_at = 0.0  # when it posted the current step
        self.wake = 0.0  # until: when its messages are in
        self.work = 0.0  # running: seconds of work left on a core of its own
        self.started = 0.0


def message_ends(plan: list[list[Step]]) -> list[list[int]]:
    """Per rank and step of ``plan``, the message ends whose work the step's action does:
    the sends and receives it posts, and on its last action those of the final flush."""
    ends = []
    for steps in plan:
        row = [len(step.sends) + len(step.recvs) for step in steps]
        acting = [i for i, step in enumerate(steps) if step.action is not None]
        for i, step in enumerate(steps):
            if step.action is None and row[i] and acting:
                before = [a for a in acting if a < i] or acting
                row[before[-1]] += row[i]
                row[i] = 0
        ends.append(row)
    return ends


def simulate_shared(
    schedule: Schedule,
    costs: CostModel,
    processes_per_rank: int,
    cores: int,
    uncontended_speedup: float = 1.0,
) -> Timeline:
    """The timeline of ``schedule`` when its ``p × processes_per_rank`` processes share
    ``cores`` cores (see the module docstring). A job of no more processes than cores
    computes ``uncontended_speedup`` times faster than the rate its costs are in, which is
    a process's when more processes take turns on the cores (a larger job keeps that rate
    even where few of its processes run at once: the others have just left their caches
    and memory traffic behind). Raises
    :class:`~megapp.pipeline_parallel.messages.ScheduleError` on a deadlock."""
    plan = communication_plan(schedule)
    p = schedule.num_stages
    messages = message_ends(plan)
    alone = uncontended_speedup if p * processes_per_rank <= cores else 1.0
    ranks = [_Rank() for _ in range(p)]
    posted: dict[tuple[str, Any], float] = {}
    timeline = Timeline(schedule)
    in_flight, peak = [0.0] * p, [0.0] * p
    now = 0.0

    def advance(rank: int) -> bool:
        """Move ``rank`` on at ``now`` as far as it can; True if its state changed."""
        r, changed = ranks[rank], False
        while r.state in ("ready", "waiting"):
            if r.cursor == len(plan[rank]):
                r.state = "done"
                return True
            step = plan[rank][r.cursor]
            if r.state == "ready":
                for msg in step.sends:
                    posted[("send", msg)] = now
                for msg in step.recvs:
                    posted[("recv", msg)] = now
                r.posted_at, r.state, changed = now, "waiting", True
            batched = costs.rules is Rules.NCCL_BATCHED
            waits = [("recv", m) for m in step.sends] if batched else []
            waits += [("send", m) for m in step.recvs]
            if any(key not in posted for key in waits):
                return changed
            times = [max(posted[("send", k[1])], posted[("recv", k[1])]) for k in waits]
            ready = max([now, *times])  # a message's seconds are work at its ends
            if ready > now:
                r.state, r.wake = "until", ready
                return True
            start(rank, step)
            changed = True
        return changed

    def start(rank: int, step) -> None:
        r = ranks[rank]
        if now > r.posted_at:
            timeline.events.append(Event(rank, "wait", "p2p", r.posted_at, now))
        if step.action is None:
            r.cursor, r.state = r.cursor + 1, "ready"
            return
        r.state, r.started = "running", now
        r.work = costs.time(rank, step.action) + messages[rank][r.cursor] * costs.p2p_latency

    def finish(rank: int) -> None:
        r = ranks[rank]
        action = plan[rank][r.cursor].action
        timeline.events.append(Event(rank, "compute", str(action), r.started, now))
        if not schedule.forward_only:
            in_flight[rank] += costs.memory(rank, action)
            peak[rank] = max(peak[rank], in_flight[rank])
        r.cursor, r.state = r.cursor + 1, "ready"

    def settle() -> None:
        while any(advance(rank) for rank in range(p)):
            pass

    settle()
    while True:
        running = [i for i, r in enumerate(ranks) if r.state == "running"]
        sleeping = [i for i, r in enumerate(ranks) if r.state == "until"]
        if not running and not sleeping:
            break
        computing = len(running) * processes_per_rank
        rate = cores / computing if computing > cores else alone
        ends = {i: now + ranks[i].work / rate for i in running}
        then = min([*ends.values(), *(ranks[i].wake for i in sleeping)])
        for i in running:
            ranks[i].work -= (then - now) * rate
        now = then
        for i in running:
            if ends[i] <= now:
                finish(i)
        for i in sleeping:
            if ranks[i].wake <= now:
                start(i, plan[i][ranks[i].cursor])
        settle()
    stuck = [i for i, r in enumerate(ranks) if r.state != "done"]
    if stuck:
        where = ", ".join(f"rank {i} before {plan[i][ranks[i].cursor].action}" for i in stuck)
        raise ScheduleError(f"{schedule.name} deadlocks: {where} wait forever")
    timeline.peak_in_flight = [int(x) if float(x).is_integer() else x for x in peak]
    return timeline
