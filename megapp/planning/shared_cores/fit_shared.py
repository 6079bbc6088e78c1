"""Fitting the time model to processes that outnumber the cores they share.

When a job's processes outnumber a machine's cores the cores stay busy: a process that
waits, for a message or for a collective's peer, leaves its core to one that has work (the
profiled iterations of the example sweep, 8 processes on 2 cores, keep both cores busy
over 95% of their time). An iteration then takes the CPU work of all its processes over
the cores, whatever the schedule's bubble. A profiled action's wall time says more about
what else ran beside it than about its own work, but its CPU time (every thread of its
process, gloo's included) is that work. So the constants are fitted to work:

- every profiled action's CPU time, by non-negative least squares over the time model's
  own counts (:func:`~megapp.planning.shared_cores.fit.fit_actions` with :data:`WORK`):
  FLOPs over a rate, a fixed cost per action and per layer pass, and per tensor-parallel
  collective call its fixed cost and bytes; the loss's passes are priced at the measured
  memory bandwidth;
- the pipeline's messages at the CPU time the profiled iterations spent on them, per
  message end (:func:`message_overhead`);
- what no action or message does (the optimizer's and the engine's own work, the
  data-parallel reductions beyond their steps), once per iteration: the step overhead,
  the mean by which the measured iterations (the median of each run's plain ones) exceed
  the shared-cores simulation (:func:`~megapp.planning.shared_cores.simulate.simulate_shared`)
  of the rest.

A job of no more processes than cores computes faster than its share of the fitted rates
(no turns taken, caches of its own): :func:`fit_uncontended_speedup` measures by how much.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from megapp.pipeline_parallel.messages import communication_plan
from megapp.planning.shared_cores.fit import Measurement, fit_actions, unit_profile
from megapp.planning.shared_cores.profile import CpuProfile, SharedCores
from megapp.planning.shared_cores.simulate import message_ends
from megapp.planning.timing import predict, shape_of

WORK = ("flops", "action", "layers", "collectives", "tp_bytes", "memory")
"""The constants an action's CPU time is fitted to (names of
:data:`~megapp.planning.shared_cores.fit.PROBES`; ``memory``, the loss's passes, is priced
by the measured bandwidth). Not the latency per ring step: every collective of a tensor-
parallel size has the same steps, so their cost is the call's fixed cost."""


def message_overhead(measurements: Sequence[Measurement], profile: CpuProfile) -> float:
    """CPU seconds per pipeline message end beyond what ``profile``'s hardware prices a
    message at (its latency and bytes): what the profiled iterations of ``measurements``
    spent on messages (``message_cpu_seconds`` of every process) less that price of their
    ends, over their ends (0 where no run sends any)."""
    sharing = dataclasses.replace(profile.sharing, message_overhead=0.0)
    unpriced = dataclasses.replace(profile, sharing=sharing)
    spent = ends = 0.0
    for m in measurements:
        schedule = m.config.schedule
        count = sum(map(sum, message_ends(communication_plan(schedule))))
        if count == 0:
            continue
        ranks = m.record["ranks"]
        if any("message_cpu_seconds" not in r for r in ranks):
            raise ValueError("a profile record has no message_cpu_seconds: run it again")
        count *= m.config.world_size // schedule.num_stages  # every process of a stage
        price = unpriced.action_costs(m.config.gpt_config(m.vocab_size), shape_of(m.config)).p2p
        spent += sum(r["message_cpu_seconds"] for r in ranks) - count * price
        ends += count
    return max(0.0, spent / ends) if ends else 0.0


def fit_shared_cores(
    measurements: Sequence[Measurement],
    cores: int,
    memory_bandwidth: float,
    name: str = "calibrated",
    memory_bytes: float = 1.0,
    profiles: Sequence[Measurement] | None = None,
) -> CpuProfile:
    """A machine whose processes share ``cores`` cores, fitted to
    ``measurements`` (runs on one machine, each of more processes than ``cores``; gloo
    transport): see the module docstring. ``memory_bandwidth`` prices the loss's passes
    and the optimizer step. ``profiles``: the profiled iterations whose actions and
    messages are fitted, every launch of every run (default: ``measurements``')."""
    profiles = measurements if profiles is None else profiles
    if any(m.config.world_size <= cores for m in [*measurements, *profiles]):
        raise ValueError(f"every run fitted here has more processes than the {cores} cores")
    world = max(m.config.world_size for m in measurements)
    coef = fit_actions(profiles, memory_bandwidth, WORK, cpu=True)
    bandwidth = 1.0 / coef["tp_bytes"] if coef["tp_bytes"] > 0 else 1e30
    hardware = dataclasses.replace(
        unit_profile(memory_bandwidth=memory_bandwidth).hardware,
        name=name,
        memory_bytes=memory_bytes,
        gpus_per_node=world,
        overlap_communication=False,
        transport="gloo",
        gemm_flops=1.0 / coef["flops"] if coef["flops"] > 0 else 1e30,
        action_overhead=coef["action"],
        layer_overhead=coef["layers"],
        intra_node_bandwidth=bandwidth,
        inter_node_bandwidth=bandwidth,
    )
    sharing = SharedCores(cores=cores, collective_overhead=coef["collectives"])
    profile = CpuProfile(hardware, sharing)
    sharing = dataclasses.replace(sharing, message_overhead=message_overhead(profiles, profile))
    profile = CpuProfile(hardware, sharing)
    residuals = [m.seconds - predict(m.config, m.vocab_size, profile).seconds for m in measurements]
    step = max(0.0, float(np.mean(residuals)))
    return CpuProfile(dataclasses.replace(hardware, step_overhead=step), sharing)


def fit_uncontended_speedup(alone: Measurement, profile: CpuProfile) -> float:
    """How much faster than its fitted share a process computes in a job of no more
    processes than cores: the factor for which the predicted iteration of ``alone`` (such
    a job) takes its measured time on ``profile``; by bisection."""
    cores = profile.sharing.cores
    if cores is None or alone.config.world_size > cores:
        raise ValueError("the speedup is measured by a run of no more processes than cores")

    def predicted(speedup: float) -> float:
        sharing = dataclasses.replace(profile.sharing, uncontended_speedup=speedup)
        trial = dataclasses.replace(profile, sharing=sharing)
        return predict(alone.config, alone.vocab_size, trial).seconds

    low, high = 0.25, 4.0
    for _ in range(40):
        middle = (low * high) ** 0.5
        low, high = (middle, high) if predicted(middle) > alone.seconds else (low, middle)
    return (low * high) ** 0.5
