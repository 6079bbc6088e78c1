"""Fitting the time model's constants to profiled runs of processes with a core each
(:mod:`~megapp.planning.shared_cores.calibrate` measures them;
:mod:`~megapp.planning.shared_cores.fit_shared` fits processes that outnumber their cores):
every action's seconds against the model's own feature counts by non-negative least
squares, then the data-parallel tail's bandwidth, the per-message overhead and the step
overhead."""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from megapp.planning.hardware import Hardware
from megapp.planning.shared_cores.profile import CpuProfile, SharedCores
from megapp.planning.timing import predict, shape_of
from megapp.training.config import PretrainConfig

_ACTION = re.compile(r"^([FBIW])(\d+)(?:\.(\d+))?$")


@dataclass(frozen=True)
class Measurement:
    """One profiled iteration: the config it ran and its ``"profile"`` metrics record; and
    the median time of the run's plain iterations (neither the first, nor the profiled
    ones, whose recording and memory counting slow them), when it had some."""

    config: PretrainConfig
    vocab_size: int
    record: dict
    steady_seconds: float | None = None
    profiled_seconds: float | None = None  # the profiled iteration's own time

    @property
    def seconds(self) -> float:
        """The iteration time a prediction is held to."""
        return self.record["seconds"] if self.steady_seconds is None else self.steady_seconds

    @property
    def pace(self) -> float:
        """How much faster a plain iteration ran than the profiled one (1 when unknown):
        the profiled iteration's action times are scaled by it."""
        if self.steady_seconds is None or not self.profiled_seconds:
            return 1.0
        return self.steady_seconds / self.profiled_seconds


def unit_profile(**rates: float) -> CpuProfile:
    """A CPU machine on which only the named constants (of :class:`Hardware` or
    :class:`SharedCores`) cost anything, a core per process, so an action's predicted
    seconds read out one feature."""
    sharing = {k: rates.pop(k) for k in list(rates) if k in _SHARING_FIELDS}
    free = dict(
        gemm_flops=1e30,
        memory_bandwidth=1e30,
        intra_node_bandwidth=1e30,
        inter_node_bandwidth=1e30,
        intra_node_latency=0.0,
        inter_node_latency=0.0,
    )
    hardware = Hardware(
        name="unit", peak_flops=None, memory_bytes=1.0, gpus_per_node=1 << 20, **(free | rates)
    )
    return CpuProfile(hardware, SharedCores(**sharing))


_SHARING_FIELDS = {f.name for f in dataclasses.fields(SharedCores)}

PROBES = {
    "flops": unit_profile(gemm_flops=1.0),
    "action": unit_profile(action_overhead=1.0),
    "layers": unit_profile(layer_overhead=1.0),
    "tp_bytes": unit_profile(intra_node_bandwidth=1.0, inter_node_bandwidth=1.0),
    "tp_steps": unit_profile(intra_node_latency=1.0, inter_node_latency=1.0),
    "collectives": unit_profile(collective_overhead=1.0),
    "memory": unit_profile(memory_bandwidth=1.0),
}
"""Per model constant, the machine on which only it costs anything: an action's seconds
there count what that constant multiplies (FLOPs, ring steps, collective calls, ...)."""
FEATURES = ("flops", "action", "layers", "tp_bytes", "tp_steps", "memory")


def action_features(
    config: PretrainConfig, vocab_size: int, names: Sequence[str] = FEATURES
) -> dict[tuple[str, int, int], list]:
    """For every kind of action (``"F"``, ``"B"``, ``"I"``, ``"W"``) on every ``[rank][chunk]``
    its features ``names`` (of :data:`PROBES`): the action's seconds on hardware where only
    that constant is 1."""
    gpt, shape = config.gpt_config(vocab_size), shape_of(config)
    shape = dataclasses.replace(shape, dp=1, zero_stage=0)  # no ZeRO transfers in the actions
    tables = {name: PROBES[name].action_costs(gpt, shape) for name in names}
    out = {}
    p, v = len(shape.placement), len(shape.placement[0])
    for rank in range(p):
        for chunk in range(v):
            for kind in "FBIW":
                row = []
                for name in names:
                    costs = tables[name]
                    f, i, w, b = (
                        t[rank][chunk]
                        for t in (
                            costs.forward,
                            costs.input_grad,
                            costs.weight_grad,
                            costs.whole_backward,
                        )
                    )
                    row.append({"F": f, "I": i, "W": w, "B": b}[kind])
                out[(kind, rank, chunk)] = row
    return out


def samples(
    measurement: Measurement, names: Sequence[str] = FEATURES, cpu: bool = False
) -> tuple[list[list[float]], list[float]]:
    """Features ``names`` and measured seconds of every compute action of every rank in a
    record: its wall time at the pace of the plain iterations, or (``cpu``) the CPU time
    the action took, its work whatever else ran beside it."""
    features = action_features(measurement.config, measurement.vocab_size, names)
    rows, seconds = [], []
    for rank in measurement.record["ranks"]:
        computes = [e for e in rank["events"] if e[0] == "compute"]
        if cpu and len(rank.get("action_cpu_seconds", ())) != len(computes):
            raise ValueError("a profile record has no action_cpu_seconds: run it again")
        for index, (_, name, start, end) in enumerate(computes):
            match = _ACTION.match(name)
            if match is None:
                continue
            rows.append(features[(match[1], rank["pp"], int(match[3] or 0))])
            took = rank["action_cpu_seconds"][index] if cpu else (end - start) * measurement.pace
            seconds.append(took)
    return rows, seconds


def nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``argmin |a·x - b|`` with ``x >= 0``: least squares, dropping the most negative
    coefficient until none is left (enough for a handful of features)."""
    active = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            x[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return x


def fit_actions(
    measurements: Sequence[Measurement],
    memory_bandwidth: float | None = None,
    names: Sequence[str] = FEATURES,
    cpu: bool = False,
) -> dict[str, float]:
    """The coefficient of every feature in ``names`` (``"memory"`` among them), fitted to
    every action of every measurement (its wall time, or with ``cpu`` its CPU time: see
    :func:`samples`). Features no measurement varies (no tensor parallelism: no
    ``tp_bytes``) come out 0. A known ``memory_bandwidth`` prices the loss's passes
    instead of fitting them."""
    rows, seconds = [], []
    for measurement in measurements:
        r, s = samples(measurement, names, cpu)
        rows += r
        seconds += s
    if not rows:
        raise ValueError("the profile records hold no compute actions to fit")
    a, b = np.asarray(rows, dtype=float), np.asarray(seconds, dtype=float)
    if memory_bandwidth is not None:
        column = list(names).index("memory")
        b = b - a[:, column] / memory_bandwidth
        a[:, column] = 0.0
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0  # a feature that is always 0 stays 0
    x = nonnegative_least_squares(a / scale, b) / scale
    coef = dict(zip(names, (float(v) for v in x), strict=True))
    if memory_bandwidth is not None:
        coef["memory"] = 1.0 / memory_bandwidth
    return coef


def makespan(record: dict) -> float:
    """The measured pipeline's span: the latest event end over all ranks."""
    return max((e[3] for r in record["ranks"] for e in r["events"]), default=0.0)


def fit_own_cores(
    measurements: Sequence[Measurement],
    name: str = "calibrated",
    memory_bytes: float = 1.0,
    memory_bandwidth: float | None = None,
) -> CpuProfile:
    """A machine whose predictions fit ``measurements`` (all taken on it: one node of
    ``world_size`` processes, gloo transport, a core per process). ``memory_bandwidth``:
    default, a copy timed in this process and shared by the processes."""
    coef = fit_actions(measurements, memory_bandwidth)
    world = measurements[0].config.world_size
    bandwidth = 1.0 / coef["tp_bytes"] if coef["tp_bytes"] > 0 else 1e30
    hardware = Hardware(
        name=name,
        gemm_flops=1.0 / coef["flops"] if coef["flops"] > 0 else 1e30,
        peak_flops=None,
        memory_bytes=memory_bytes,
        memory_bandwidth=memory_bandwidth or _fitted_or_measured(coef["memory"], world),
        gpus_per_node=world,
        intra_node_bandwidth=bandwidth,
        intra_node_latency=coef["tp_steps"],
        inter_node_bandwidth=bandwidth,
        inter_node_latency=coef["tp_steps"],
        layer_overhead=coef["layers"],
        action_overhead=coef["action"],
        overlap_communication=False,
        transport="gloo",
    )
    per_byte = _fit_tail_bandwidth(measurements, hardware)
    if per_byte > 0:  # the data-parallel reductions' bytes show the bandwidth best
        link = dict(intra_node_bandwidth=1.0 / per_byte, inter_node_bandwidth=1.0 / per_byte)
        hardware = dataclasses.replace(hardware, **link)
    profile = CpuProfile(hardware)
    sharing = SharedCores(message_overhead=_fit_messages(measurements, profile))
    profile = CpuProfile(hardware, sharing)
    residuals = _residuals(measurements, profile)
    step = max(0.0, float(np.mean(residuals)))
    return CpuProfile(dataclasses.replace(hardware, step_overhead=step), sharing)


def _residuals(measurements: Sequence[Measurement], profile: CpuProfile) -> list[float]:
    """Measured less predicted seconds of every measurement's iteration."""
    return [m.seconds - predict(m.config, m.vocab_size, profile).seconds for m in measurements]


def _fit_tail_bandwidth(measurements: Sequence[Measurement], hardware: Hardware) -> float:
    """Seconds per byte of the collectives after the pipeline: what each iteration spent
    beyond its measured pipeline span and the optimizer step, fitted against the bytes
    its data-parallel reduction moves (plus a constant)."""
    rows, residual = [], []
    for m in measurements:
        gpt, shape = m.config.gpt_config(m.vocab_size), shape_of(m.config)
        moved = max(PROBES["tp_bytes"].action_costs(gpt, shape).tail)
        steps = max(PROBES["tp_steps"].action_costs(gpt, shape).tail)
        optimizer = max(CpuProfile(hardware).action_costs(gpt, shape).optimizer)
        rows.append([1.0, moved])
        spent = m.record["seconds"] - makespan(m.record) - optimizer  # the profiled one's
        residual.append(spent - steps * hardware.intra_node_latency)
    return float(nonnegative_least_squares(np.asarray(rows), np.asarray(residual))[1])


def _fit_messages(measurements: Sequence[Measurement], profile: CpuProfile) -> float:
    """The per-message overhead for which the pipelined layouts' iterations miss their
    measured times by as much as every layout's do on average (what the constant per-step
    overhead then takes up); by bisection, as the pipelined ones grow with it. With no
    layout free of messages to tell the two apart, the simulated pipelines are held to the
    measured spans instead."""
    piped = [m.config.schedule.num_stages > 1 for m in measurements]

    def excess(overhead: float) -> float:
        sharing = dataclasses.replace(profile.sharing, message_overhead=overhead)
        trial = dataclasses.replace(profile, sharing=sharing)
        if all(piped):
            return float(
                np.mean(
                    [
                        predict(m.config, m.vocab_size, trial).timeline.makespan
                        - makespan(m.record)
                        for m in measurements
                    ]
                )
            )
        residuals = np.asarray(_residuals(measurements, trial))
        return float(residuals.mean() - residuals[np.asarray(piped)].mean())

    low, high = 0.0, 1.0
    if excess(low) >= 0:
        return 0.0
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if excess(middle) < 0 else (low, middle)
    return (low + high) / 2


def _fitted_or_measured(seconds_per_byte: float, processes: int) -> float:
    """The memory bandwidth the loss's passes fitted, else a measured one."""
    return 1.0 / seconds_per_byte if seconds_per_byte > 0 else memory_bandwidth(processes)


def memory_bandwidth(processes: int) -> float:
    """Bytes/s of a large copy in this process, shared among ``processes`` on the cores."""
    src = torch.empty(32 * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    rate = 2 * 5 * src.numel() / (time.perf_counter() - start)  # read and write
    cores = os.cpu_count() or 1
    return rate * min(1.0, cores / processes)
