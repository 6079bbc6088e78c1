"""Fitting the time model to processes that outnumber the cores they share.

When a job's processes outnumber a machine's cores the cores stay busy: a process that
waits, for a message or for a collective's peer, leaves its core to one that has work (the
profiled timelines of the example sweep, 8 processes on 2 cores, leave a core idle for
under 5% of their pipeline). An iteration then takes the CPU work of all its processes over
the cores, whatever the schedule's bubble, and a profiled action's length says more about
what else ran beside it than about its own work. So the constants are fitted to whole
iterations, the median time of each run's plain iterations, by non-negative least squares::

    seconds = (FLOPs / rate + actions · action_overhead + layer passes · layer_overhead
               + collective calls · collective_overhead + ring steps · latency) / cores
              + reduction ring steps · latency + step_overhead + known

where each count is summed over the iteration's actions on every process, as
:func:`~megapp.planning.timing.action_costs` prices them (an action's tensor-parallel
collectives are its processes' CPU time: gloo copies, reduces and hands bytes to sockets on
the calling process); the data-parallel reductions after the pipeline (one per gradient
bucket, a bucket per model chunk) are steps every process waits through, not shared; and
``known`` is the time of what a measured constant already prices: the loss's passes
(memory bandwidth) and the optimizer step. The shared-cores simulation
(:func:`~megapp.planning.core_sharing.simulate_shared`) of the fitted profile then gives
those iterations back while their cores stay busy, and the bubble where they would not.

A job of no more processes than cores computes faster than its share of the fitted rates
(no turns taken, caches of its own): :func:`fit_uncontended_speedup` measures by how much.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from megapp.planning.calibration_fit import (
    PROBES,
    Measurement,
    nonnegative_least_squares,
    unit_hardware,
)
from megapp.planning.hardware import Hardware
from megapp.planning.timing import action_costs, predict_step_time, shape_of

COUNTS = ("flops", "action", "layers", "collectives", "tp_steps")
"""The per-iteration counts the fit weighs, in the order of its coefficients (names of
:data:`~megapp.planning.calibration_fit.PROBES`; ``tp_steps``: every ring step, those of
the data-parallel reductions included)."""


def iteration_counts(measurement: Measurement, cores: int) -> list[float]:
    """Every :data:`COUNTS` entry of one iteration of ``measurement``'s config: the
    seconds it costs on hardware where only that constant is 1, its actions summed over all
    processes over the ``cores`` they share, plus (ring steps) the data-parallel
    reductions' steps after them, where every process waits on the others."""
    config = measurement.config
    gpt = config.gpt_config(measurement.vocab_size)
    shape = dataclasses.replace(shape_of(config), zero_stage=0)
    processes = config.world_size // config.schedule.num_stages
    m, p = config.num_microbatches, config.schedule.num_stages
    out = []
    for name in COUNTS:
        costs = action_costs(gpt, shape, PROBES[name])
        work = processes * sum(costs.busy(rank, m) for rank in range(p)) / cores
        out.append(work + (max(costs.tail) if name == "tp_steps" else 0.0))
    return out


def fit_shared_cores(
    measurements: Sequence[Measurement],
    cores: int,
    memory_bandwidth: float,
    name: str = "calibrated",
    memory_bytes: float = 1.0,
) -> Hardware:
    """A :class:`Hardware` whose processes share ``cores`` cores and whose predictions fit
    ``measurements`` (runs on one machine, each of more processes than ``cores``; gloo
    transport): see the module docstring. ``memory_bandwidth`` prices the loss's passes
    and the optimizer step."""
    if any(m.config.world_size <= cores for m in measurements):
        raise ValueError(f"every run fitted here has more processes than the {cores} cores")
    world = max(m.config.world_size for m in measurements)
    known = dataclasses.replace(  # only what a measured constant prices costs anything
        unit_hardware(memory_bandwidth=memory_bandwidth, shared_cores=cores),
        name=name,
        memory_bytes=memory_bytes,
        gpus_per_node=world,
        overlap_communication=False,
        sends_finish_in_background=True,
    )
    rows, seconds = [], []
    for m in measurements:
        rows.append([*iteration_counts(m, cores), 1.0])
        seconds.append(m.seconds - predict_step_time(m.config, m.vocab_size, known).seconds)
    a, b = np.asarray(rows), np.asarray(seconds)
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0  # a count no run has (no tensor parallelism) stays 0
    x = nonnegative_least_squares(a / scale, b) / scale
    flops, action, layers, collectives, latency, step = (float(v) for v in x)
    return dataclasses.replace(
        known,
        gemm_flops=1.0 / flops if flops > 0 else 1e30,
        action_overhead=action,
        layer_overhead=layers,
        collective_overhead=collectives,
        intra_node_latency=latency,
        inter_node_latency=latency,
        step_overhead=step,
    )


def fit_uncontended_speedup(alone: Measurement, hardware: Hardware) -> float:
    """How much faster than its fitted share a process computes in a job of no more
    processes than cores: the factor for which the predicted iteration of ``alone`` (such
    a job) takes its measured time; by bisection."""
    if hardware.shared_cores is None or alone.config.world_size > hardware.shared_cores:
        raise ValueError("the speedup is measured by a run of no more processes than cores")

    def predicted(speedup: float) -> float:
        trial = dataclasses.replace(hardware, uncontended_speedup=speedup)
        return predict_step_time(alone.config, alone.vocab_size, trial).seconds

    low, high = 0.25, 4.0
    for _ in range(40):
        middle = (low * high) ** 0.5
        low, high = (middle, high) if predicted(middle) > alone.seconds else (low, middle)
    return (low * high) ** 0.5
