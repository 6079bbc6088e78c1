"""Search the schedules of a pipeline for the fastest one that fits a memory limit.

Given per-chunk action times (measured: :func:`costs_from_events` reads them from a
recorded iteration), a point-to-point latency and what each rank may hold, the search
simulates every candidate and keeps the shortest iteration:

- every built-in schedule that the placement allows;
- the zero-bubble list scheduler (:func:`~megapp.pipeline_parallel.zero_bubble_greedy.greedy`)
  run against *these* costs, with whole and split backwards, under every activation
  cap from one microbatch-chunk up to the limit.

The list scheduler adapts the order to the costs (a slow last stage, a cheap ``W``),
which the textbook schedules, built for equal stages, cannot. The winner is validated
like any other schedule (its communication plan, FIFO order and a deadlock-free
simulation) and runs on the same engine, on gloo or NCCL.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from megapp.pipeline_parallel.catalog import SCHEDULE_KINDS, default_schedule
from megapp.pipeline_parallel.messages import ScheduleError, communication_plan
from megapp.pipeline_parallel.schedules import (
    Action,
    Op,
    Schedule,
    looped_placement,
    v_placement,
)
from megapp.pipeline_parallel.simulate import CostModel, Event, Timeline, simulate
from megapp.pipeline_parallel.zero_bubble_greedy import greedy

_ACTION = re.compile(r"^([FBIW])(\d+)(?:\.(\d+))?$")


@dataclass
class SearchResult:
    """The winner, its simulated timeline, and every candidate tried:
    ``(label, makespan, peak activations held)``, best first."""

    schedule: Schedule
    timeline: Timeline
    candidates: list[tuple[str, float, float]] = field(default_factory=list)


def costs_from_events(
    schedule: Schedule, events: Sequence[Event], **options: float | bool
) -> CostModel:
    """The median time of each kind of action per ``[rank][chunk]``, from a recorded
    iteration of ``schedule`` (every rank's compute events; :class:`CostModel` options
    such as ``p2p_latency`` pass through). A kind the schedule did not run is derived:
    ``B = I + W``, or ``I = W = B / 2``."""
    p, v = schedule.num_stages, schedule.num_chunks
    times: dict[tuple[str, int, int], list[float]] = defaultdict(list)
    for event in events:
        match = _ACTION.match(event.name)
        if event.kind == "compute" and match:
            times[(match[1], event.rank, int(match[3] or 0))].append(event.end - event.start)

    def table(kind: str) -> list[list[float]] | None:
        rows = [[times.get((kind, r, c)) for c in range(v)] for r in range(p)]
        if any(t is None for row in rows for t in row):
            return None
        return [[statistics.median(t) for t in row] for row in rows]

    forward, backward = table("F"), table("B")
    input_grad, weight_grad = table("I"), table("W")
    if forward is None or (backward is None and (input_grad is None or weight_grad is None)):
        raise ValueError(
            "the recorded events do not time every rank's forward and backward of every "
            "chunk; record a whole iteration of every pipeline rank"
        )
    if backward is None:
        backward = [
            [i + w for i, w in zip(ri, rw, strict=True)]
            for ri, rw in zip(input_grad, weight_grad, strict=True)
        ]
    return CostModel(
        forward=forward,
        backward=backward,
        input_grad=input_grad,
        weight_grad=weight_grad,
        **options,
    )


def _fits(timeline: Timeline, limit: Sequence[float]) -> bool:
    return all(peak <= cap + 1e-9 for peak, cap in zip(timeline.peak_in_flight, limit, strict=True))


def search_schedule(
    num_stages: int,
    num_microbatches: int,
    costs: CostModel,
    *,
    num_chunks: int = 1,
    v_shape: bool = False,
    memory_limit: float | Sequence[float] | None = None,
) -> SearchResult:
    """The fastest schedule for ``p`` stages and ``m`` microbatches under ``costs``.

    ``num_chunks`` and ``v_shape`` fix the placement (the model's chunks are built for
    it): looped with ``v`` chunks per rank, or the V with two. ``memory_limit`` caps the
    activations each rank may hold at once, in the units of ``costs.activation``
    (default: what the placement's 1F1B-style schedule holds at most). The simulation
    follows ``costs.rules``; the engine's posting gives the same timeline on gloo and
    NCCL.
    """
    p, m, v = num_stages, num_microbatches, num_chunks
    if v_shape and v != 2:
        raise ValueError(f"the V placement takes two chunks per rank, got num_chunks={v}")
    placement = v_placement(p) if v_shape else looped_placement(p, v)
    candidates: list[tuple[str, Schedule]] = []
    for name, kind in SCHEDULE_KINDS.items():
        if kind.asynchronous or kind.v_shaped != v_shape:
            continue
        try:
            candidates.append((name, kind.build(p, m, v)))
        except ValueError:
            continue  # not for this p, m, v
    if memory_limit is None:
        reference = "zb-v" if v_shape else default_schedule(v)
        base = dict(candidates).get(reference) or candidates[0][1]
        memory_limit = max(simulate(base, costs).peak_in_flight)
    limit = (
        [float(memory_limit)] * p if isinstance(memory_limit, int | float) else list(memory_limit)
    )
    sizes = sorted({costs.memory(r, Action(Op.FORWARD, 0, c)) for r in range(p) for c in range(v)})
    step = sizes[-1]
    caps = [k * step for k in range(1, m * v + 1) if k * step <= max(limit) + 1e-9]
    for split in (True, False):
        for cap in caps:
            label = f"greedy({'split' if split else 'whole'}, cap {cap:g})"
            try:
                schedule = greedy(
                    "auto", p, m, v, placement, [min(cap, c) for c in limit], costs, split
                )
            except ValueError:
                continue  # too tight for any forward to run
            candidates.append((label, schedule))
    tried = []
    for label, schedule in candidates:
        try:
            communication_plan(schedule)
            timeline = simulate(schedule, costs)
        except ScheduleError:
            continue
        if _fits(timeline, limit):
            tried.append(
                (timeline.makespan, max(timeline.peak_in_flight), label, schedule, timeline)
            )
    if not tried:
        raise ValueError(
            f"no schedule for p={p}, m={m}, v={v} keeps every rank within {limit}; raise the "
            "memory limit"
        )
    tried.sort(key=lambda t: (t[0], t[1]))
    _, _, label, best, timeline = tried[0]
    return SearchResult(
        replace(best, name="auto") if best.name != "auto" else best,
        timeline,
        [(lbl, span, peak) for span, peak, lbl, _, _ in tried],
    )
