"""Launching one sweep point: its torchrun command, a run with a time limit, and the error
lines of a failed run's log, over :mod:`megapp.training.launch`.

A launcher is any callable ``(command, log_path, timeout_s, env) -> Launched``;
:func:`run_command` runs a real process group, tests pass a fake one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from megapp.training.launch import (
    REPOSITORY,
    Launched,
    finish,
    launch_env,
    start_command,
    torchrun_command,
)

ERROR_TAIL_LINES = 12

Launcher = Callable[[Sequence[str], Path, float, Mapping[str, str]], Launched]


def point_flags(
    flags: Sequence[str], metrics_path: Path, profile_iteration: int | None
) -> list[str]:
    """``flags`` writing the metrics to ``metrics_path`` (and the profile of
    ``profile_iteration`` when given)."""
    out = [*flags, "--metrics-path", str(metrics_path)]
    if profile_iteration is not None:
        out += ["--profile-iteration", str(profile_iteration)]
    return out


def point_command(
    flags: Sequence[str], nproc: int, metrics_path: Path, profile_iteration: int | None
) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N pretrain_gpt.py
    <flags>`` writing its metrics to ``metrics_path``."""
    return torchrun_command(nproc, point_flags(flags, metrics_path, profile_iteration))


def point_env() -> dict[str, str]:
    """The environment of a point: one thread per process, so ranks do not fight over the
    cores and timings compare between layouts."""
    return launch_env()


def run_command(
    command: Sequence[str], log_path: Path, timeout_s: float, env: Mapping[str, str]
) -> Launched:
    """Run ``command`` from the repository root with its output in ``log_path``; past
    ``timeout_s`` its whole process group is stopped and the log says so."""
    started = start_command(command, cwd=REPOSITORY, log_path=log_path, env=env)
    done = finish(started, timeout_s)
    if done.timed_out:
        with open(log_path, "a") as log:
            log.write(f"\nstopped after the time limit of {timeout_s:.0f} s\n")
    return done


def error_summary(log_path: Path, tail: int = ERROR_TAIL_LINES) -> str:
    """What a failed run said: its ``error:`` lines (a refused flag, a crashed rank) and
    the last ``tail`` lines of its log."""
    if not log_path.is_file():
        return f"no log at {log_path}"
    lines = log_path.read_text(errors="replace").splitlines()
    errors = [ln for ln in lines if "error:" in ln.lower() or "Error:" in ln][:3]
    last = [ln for ln in lines[-tail:] if ln not in errors]
    return "\n".join([*errors, *last]).strip()
