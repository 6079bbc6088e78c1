"""Processes of one job sharing a CPU machine's cores: their time model and its calibration.

Used only where a run's processes share a CPU (the development machine: eight processes on
two cores); the device time model (:mod:`megapp.planning.timing`) reads none of this.

- :mod:`.profile`: :class:`SharedCores`, the CPU-sharing constants, and :class:`CpuProfile`,
  a machine's fitted rates with them, the time model of such a run;
- :mod:`.simulate`: the schedule run with every process at its share of the cores;
- :mod:`.fit`, :mod:`.fit_shared`: the constants fitted to profiled runs, with a core per
  process and with more processes than cores;
- :mod:`.calibrate`: ``python -m megapp.planning.shared_cores.calibrate``, which measures
  this machine and writes its profile.
"""

from megapp.planning.shared_cores.profile import (
    CpuProfile,
    SharedCores,
    profile_from_dict,
    read_profile,
    with_overheads,
)
from megapp.planning.shared_cores.simulate import simulate_shared

__all__ = [
    "CpuProfile",
    "SharedCores",
    "profile_from_dict",
    "read_profile",
    "simulate_shared",
    "with_overheads",
]
