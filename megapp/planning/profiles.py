"""A time profile by name or file, whichever machine it describes: devices of their own
(:mod:`megapp.planning.hardware`) or a CPU machine whose processes share its cores
(:mod:`megapp.planning.shared_cores`), and the prediction on it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from megapp.planning.hardware import PROFILES, Hardware, load_hardware
from megapp.planning.step_time import StepTime
from megapp.planning.timing import Devices, TimeModel, predict
from megapp.training.config import PretrainConfig

if TYPE_CHECKING:
    from megapp.planning.shared_cores import CpuProfile


def load_profile(name_or_path: str) -> Hardware | CpuProfile:
    """A built-in device profile by name, or the profile in a JSON file (a device's, or a
    CPU machine's that ``--calibrate`` wrote). Raises ValueError in one line otherwise."""
    if name_or_path.lower() not in PROFILES and Path(name_or_path).is_file():
        from megapp.planning.shared_cores import read_profile

        return read_profile(name_or_path)
    return load_hardware(name_or_path)


def time_model(profile: Hardware | TimeModel) -> TimeModel:
    """The time model of ``profile``: devices of their own for a :class:`Hardware`."""
    return Devices(profile) if isinstance(profile, Hardware) else profile


def predict_step_time(
    config: PretrainConfig, vocab_size: int, profile: Hardware | TimeModel
) -> StepTime:
    """:func:`~megapp.planning.timing.predict` on either kind of profile."""
    return predict(config, vocab_size, time_model(profile))
