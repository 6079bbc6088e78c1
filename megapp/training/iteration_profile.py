"""``--profile-iteration N``: what one iteration did on every rank, for ablations.

Two consecutive iterations are measured, each with what the other would distort:

- iteration ``N``: the pipeline timeline of every rank (the engine's recorded actions and
  waits), the seconds each rank spent blocked in collectives (tensor- and data-parallel
  communication; the pipeline's waits are in the timeline), and its CPU seconds: all of
  them, those spent on pipeline messages, and each action's;
- iteration ``N + 1``: every rank's peak live tensor bytes (:class:`LiveTensorMemory`; its
  per-operator bookkeeping would slow the timeline), and the bytes live before it starts
  (weights, gradient buffers, optimizer states).

The last rank writes one ``{"kind": "profile", ...}`` record (:func:`profile_record`) into
the metrics file, with the measured bubble of the pipeline.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from megapp import comm
from megapp.pipeline_parallel.runner import message_cpu_seconds
from megapp.pipeline_parallel.simulate import Event
from megapp.training.live_memory import LiveTensorMemory


@dataclass
class RankProfile:
    """One rank's measurements (plain data, gathered to the writing rank)."""

    rank: int
    tp: int
    pp: int
    dp: int
    seconds: float = 0.0
    comm_seconds: float = 0.0
    cpu_seconds: float = 0.0  # the process's CPU time (all its threads)
    message_cpu_seconds: float = 0.0  # of which on pipeline messages
    action_cpu_seconds: list[float] = field(default_factory=list)  # per compute event
    events: list[list] = field(default_factory=list)  # [kind, name, start, end]
    state_bytes: int = 0
    peak_bytes: int = 0


class TimedIteration:
    """``with TimedIteration(profile): <iteration with record=True>`` then
    :meth:`keep_events`: fills the timeline half of ``profile``."""

    def __init__(self, profile: RankProfile) -> None:
        self.profile = profile

    def __enter__(self) -> TimedIteration:
        self.comm_start, self.start = comm.blocked_seconds(), time.perf_counter()
        self.cpu_start, self.message_start = time.process_time(), message_cpu_seconds()
        return self

    def __exit__(self, *exc) -> None:
        self.profile.seconds = time.perf_counter() - self.start
        self.profile.comm_seconds = comm.blocked_seconds() - self.comm_start
        self.profile.cpu_seconds = time.process_time() - self.cpu_start
        self.profile.message_cpu_seconds = message_cpu_seconds() - self.message_start

    def keep_events(self, events: Sequence[Event]) -> None:
        self.profile.events = [[e.kind, e.name, e.start, e.end] for e in events]
        computed = [e.cpu for e in events if e.kind == "compute"]
        self.profile.action_cpu_seconds = [0.0 if c is None else c for c in computed]


class MemoryIteration:
    """``with MemoryIteration(profile, resized): <iteration>``: fills the memory half of
    ``profile``. ``resized``: storages resized in place by their owners (ZeRO-3 buckets)."""

    def __init__(self, profile: RankProfile, resized: Sequence[torch.UntypedStorage]) -> None:
        self.profile = profile
        self.memory = LiveTensorMemory(resized)

    def __enter__(self) -> MemoryIteration:
        self.memory.__enter__()  # collects the garbage of earlier iterations first
        self.profile.state_bytes = self.memory.start
        return self

    def __exit__(self, *exc) -> None:
        self.memory.__exit__(*exc)
        self.profile.peak_bytes = self.memory.peak


def measured_bubble(profiles: Sequence[RankProfile]) -> float:
    """Idle share of the pipeline's time, ``1 - busy / (p · makespan)``, over the pipeline
    ranks of tensor- and data-parallel rank 0 (0 without a pipeline)."""
    stages = [p for p in profiles if p.tp == 0 and p.dp == 0]
    spans = [(e[2], e[3]) for p in stages for e in p.events]
    if len(stages) < 2 or not spans:
        return 0.0
    makespan = max(end for _, end in spans) - min(start for start, _ in spans)
    busy = sum(e[3] - e[2] for p in stages for e in p.events if e[0] == "compute")
    return max(0.0, 1.0 - busy / (len(stages) * makespan)) if makespan > 0 else 0.0


def profile_record(iteration: int, profiles: Sequence[RankProfile]) -> dict:
    """The metrics record of every rank's measurements of iteration ``iteration``."""
    ranks = sorted(profiles, key=lambda p: p.rank)
    return {
        "kind": "profile",
        "iteration": iteration,
        "seconds": max(p.seconds for p in ranks),
        "bubble": measured_bubble(ranks),
        "ranks": [vars(p) for p in ranks],
    }


def plain_iteration_seconds(records: Sequence[dict], profile_iteration: int | None) -> list[float]:
    """Seconds of every plain iteration among a run's metrics ``records``: neither the
    first (it warms up), nor the profiled one and the one after it, nor any other whose
    record says its memory was profiled (an asynchronous run's memory run may span
    several)."""
    profiled = {1}
    if profile_iteration is not None:
        profiled |= {profile_iteration, profile_iteration + 1}
    return [
        r["elapsed_ms_per_iteration"] / 1e3
        for r in records
        if r.get("kind") == "train" and r["iteration"] not in profiled and not r.get("profiled")
    ]
