"""A CPU machine as the time model sees it: its fitted rates, and how a job's processes
share its cores.

:class:`SharedCores` holds what only processes on one CPU machine have: the cores they
share, how much faster one computes with a core to itself, and the CPU time a pipeline
message end and a tensor-parallel collective call take beyond their bytes. A
:class:`CpuProfile` pairs it with the :class:`~megapp.planning.hardware.Hardware` of the
fitted rates, and is the :class:`~megapp.planning.timing.TimeModel` of such a machine:

- every action costs what it costs on a device (:func:`~megapp.planning.timing.action_costs`)
  plus ``collective_overhead`` per tensor-parallel collective call (and context-parallel
  transfer, priced like one) it makes, and a pipeline
  message ``message_overhead`` more (CPU profiles overlap no communication with compute, so
  the overheads add);
- with ``cores`` the schedule runs in :func:`~megapp.planning.shared_cores.simulate.simulate_shared`
  (a message is work at both its ends, the optimizer step, which every process runs at
  once, is slowed by all of them); without (a core per process) in the plain simulator,
  where a message is a wait.

:meth:`CpuProfile.save` writes ``{"hardware": {...}, "shared_cores": {...}}``;
:func:`read_profile` reads that, and the flat profile of one object earlier calibrations
wrote.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from megapp.models.gpt import GPTConfig
from megapp.pipeline_parallel.schedules import Schedule
from megapp.pipeline_parallel.simulate import Timeline, simulate
from megapp.planning.hardware import Hardware
from megapp.planning.shared_cores.simulate import core_slowdown, simulate_shared, slowed_steps
from megapp.planning.timing import ActionCosts, Shape, Table, action_costs, cost_model


@dataclass(frozen=True)
class SharedCores:
    """How a job's processes use one CPU machine's cores. Times in seconds of CPU."""

    cores: int | None = None  # the cores every process of a job shares; None: a core each
    # How much faster a process computes in a job of no more processes than cores (the
    # fitted rates are those of more processes taking turns on them).
    uncontended_speedup: float = 1.0
    # Per pipeline message beyond its latency and bytes; with shared cores, at each end.
    message_overhead: float = 0.0
    # Per tensor-parallel collective call beyond its ring steps (its CPU time apart from
    # its bytes).
    collective_overhead: float = 0.0

    def __post_init__(self) -> None:
        if self.cores is not None and self.cores < 1:
            raise ValueError(f"cores must be >= 1, got {self.cores}")
        if not self.uncontended_speedup > 0:
            raise ValueError(f"uncontended_speedup must be > 0, got {self.uncontended_speedup}")
        for name in ("message_overhead", "collective_overhead"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


_SHARING_KEYS = frozenset(f.name for f in dataclasses.fields(SharedCores)) - {"cores"}
_FLAT_CORES = "shared_cores"  # what the flat format called ``cores``


@dataclass(frozen=True)
class CpuProfile:
    """A CPU machine: ``hardware`` (its fitted rates; the processes of a job are its
    "devices", all in one node) and how the processes ``sharing`` its cores."""

    hardware: Hardware
    sharing: SharedCores = field(default_factory=SharedCores)

    @property
    def name(self) -> str:
        return self.hardware.name

    def with_gpus_per_node(self, gpus_per_node: int) -> CpuProfile:
        """The same machine with ``gpus_per_node`` processes to a node."""
        return dataclasses.replace(self, hardware=self.hardware.with_gpus_per_node(gpus_per_node))

    def action_costs(self, gpt: GPTConfig, shape: Shape) -> ActionCosts:
        """:func:`~megapp.planning.timing.action_costs` with each collective call's and
        each message's CPU overhead."""
        return with_overheads(action_costs(gpt, shape, self.hardware), self.sharing)

    def run(
        self, schedule: Schedule, costs: ActionCosts, world_size: int
    ) -> tuple[ActionCosts, Timeline]:
        """The timeline of ``schedule`` with ``costs`` on ``world_size`` processes: sharing
        the cores, or each on its own."""
        cores = self.sharing.cores
        if cores is None:
            return costs, simulate(schedule, cost_model(costs, self.hardware))
        costs = slowed_steps(costs, core_slowdown(cores, world_size, 1.0))
        per_rank = world_size // schedule.num_stages
        speedup = self.sharing.uncontended_speedup
        model = cost_model(costs, self.hardware)
        return costs, simulate_shared(schedule, model, per_rank, cores, speedup)

    def to_json(self) -> str:
        data = {
            "hardware": dataclasses.asdict(self.hardware),
            "shared_cores": dataclasses.asdict(self.sharing),
        }
        return json.dumps(data, indent=2) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())


def with_overheads(costs: ActionCosts, sharing: SharedCores) -> ActionCosts:
    """``costs`` with ``sharing``'s CPU time per tensor-parallel collective call and per
    context-parallel transfer (a ring step or a collective; in the action that makes it),
    and per pipeline message."""
    per_call, per_message = sharing.collective_overhead, sharing.message_overhead
    if per_call == 0 and per_message == 0:
        return costs

    def plus(table: Table, calls: Table) -> Table:
        pairs = zip(table, calls, strict=True)
        return [[t + c * per_call for t, c in zip(rt, rc, strict=True)] for rt, rc in pairs]

    forward, backward = costs.collectives_forward, costs.collectives_backward
    changed = dict(
        forward=plus(costs.forward, forward),
        input_grad=plus(costs.input_grad, backward),
        whole_backward=plus(costs.whole_backward, backward),
        tp_forward=plus(costs.tp_forward, forward),
        tp_backward=plus(costs.tp_backward, backward),
        p2p=costs.p2p + per_message,
    )
    cp_tables = (costs.cp_forward, costs.cp_backward, costs.cp_calls_forward)
    if all(table is not None for table in (*cp_tables, costs.cp_calls_backward)):
        forward, backward = costs.cp_calls_forward, costs.cp_calls_backward  # ring steps too
        changed["forward"] = plus(changed["forward"], forward)
        changed["input_grad"] = plus(changed["input_grad"], backward)
        changed["whole_backward"] = plus(changed["whole_backward"], backward)
        changed["cp_forward"] = plus(costs.cp_forward, forward)
        changed["cp_backward"] = plus(costs.cp_backward, backward)
    return dataclasses.replace(costs, **changed)


def profile_from_dict(data: dict) -> Hardware | CpuProfile:
    """A profile from a JSON object: ``{"hardware": ..., "shared_cores": ...}``, or the flat
    object earlier calibrations wrote (a device's where its CPU fields are all unset)."""
    if "hardware" in data:
        unknown = sorted(set(data) - {"hardware", "shared_cores"})
        if unknown:
            raise ValueError(f"unknown profile keys: {', '.join(unknown)}")
        sharing = SharedCores(**data.get("shared_cores", {}))
        return CpuProfile(Hardware.from_dict(data["hardware"]), sharing)
    flat = dict(data)
    sharing = {k: flat.pop(k) for k in _SHARING_KEYS if k in flat}
    if _FLAT_CORES in flat:
        sharing["cores"] = flat.pop(_FLAT_CORES)
    hardware = Hardware.from_dict(flat)
    if SharedCores(**sharing) == SharedCores():
        return hardware
    return CpuProfile(hardware, SharedCores(**sharing))


def read_profile(path: str | Path) -> Hardware | CpuProfile:
    """The profile in the JSON file ``path``: a CPU machine's, or a device's. Raises
    ValueError in one line for a file that is neither."""
    try:
        return profile_from_dict(json.loads(Path(path).read_text()))
    except (json.JSONDecodeError, TypeError, AttributeError) as error:
        raise ValueError(f"{path} is not a hardware profile: {error}") from None
