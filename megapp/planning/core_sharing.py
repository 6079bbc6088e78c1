"""Processes that share a CPU's cores: how much each one slows the others.

On one CPU machine a job of ``world`` processes (one thread each) shares ``cores`` cores.
When ``k`` of them compute at once, each gets ``min(1, cores / k)`` of a core. The time
model runs the pipeline simulator with a core per process, then slows every action by
the processes computing at once on average, ``world × busy share / cores`` (the busy
share is one minus the simulated bubble), and the optimizer step, which every process runs
at once, by ``world / cores``: the iteration is then the larger of the dedicated critical
path and the job's compute spread over the cores, the fluid limit of processor sharing
(ranks idle in a bubble leave their core to the busy ones). Calibration divides measured
action times by the same factor, so the fitted rates are a process's on a core of its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def core_slowdown(shared_cores: int | None, world_size: int, busy_share: float) -> float:
    """How much slower each of ``world_size`` processes computes when they share
    ``shared_cores`` cores and are busy ``busy_share`` of the time: the processes busy at
    once over the cores, at least 1 (always 1 without shared cores)."""
    if shared_cores is None:
        return 1.0
    return max(1.0, world_size * busy_share / shared_cores)


def slowed(costs: Any, actions: float, everyone: float) -> Any:
    """``costs`` (an :class:`~megapp.planning.timing.ActionCosts`) with every action
    ``actions`` times slower and the optimizer step, which all processes run at once,
    ``everyone`` times slower."""

    def scaled(table: list[list[float]]) -> list[list[float]]:
        return [[t * actions for t in row] for row in table]

    extra = [o * (everyone - 1.0) for o in costs.optimizer]
    return dataclasses.replace(
        costs,
        forward=scaled(costs.forward),
        input_grad=scaled(costs.input_grad),
        weight_grad=scaled(costs.weight_grad),
        tail=[t + e for t, e in zip(costs.tail, extra, strict=True)],
        optimizer=[o * everyone for o in costs.optimizer],
    )
