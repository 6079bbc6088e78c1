"""Launching one sweep point: the torchrun command, a run with a time limit, and the error
lines of a failed run's log.

A launcher is any callable ``(command, log_path, timeout_s, env) -> LaunchResult``;
:func:`run_command` runs a real process group, tests pass a fake one.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRETRAIN = "pretrain_gpt.py"
ERROR_TAIL_LINES = 12


@dataclass(frozen=True)
class LaunchResult:
    """How a command ended: its exit status (None when stopped at the time limit)."""

    returncode: int | None
    timed_out: bool
    seconds: float


Launcher = Callable[[Sequence[str], Path, float, Mapping[str, str]], LaunchResult]


def torchrun() -> list[str]:
    """torchrun from PATH, else the same launcher through this Python."""
    found = shutil.which("torchrun")
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


def point_command(
    flags: Sequence[str], nproc: int, metrics_path: Path, profile_iteration: int | None
) -> list[str]:
    """``torchrun --standalone --nproc-per-node N pretrain_gpt.py <flags>`` writing its
    metrics to ``metrics_path`` (and the profile of ``profile_iteration`` when given)."""
    command = [*torchrun(), "--standalone", "--nproc-per-node", str(nproc), PRETRAIN]
    command += [*flags, "--metrics-path", str(metrics_path)]
    if profile_iteration is not None:
        command += ["--profile-iteration", str(profile_iteration)]
    return command


def point_env() -> dict[str, str]:
    """The environment of a point: one thread per process, so ranks do not fight over the
    cores and timings compare between layouts."""
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def run_command(
    command: Sequence[str], log_path: Path, timeout_s: float, env: Mapping[str, str]
) -> LaunchResult:
    """Run ``command`` from the repository root with its output in ``log_path``; past
    ``timeout_s`` its whole process group is stopped (SIGTERM, then SIGKILL after 10 s)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        process = subprocess.Popen(
            list(command),
            cwd=ROOT,
            env=dict(env),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the time limit stops every rank
        )
        try:
            code = process.wait(timeout=timeout_s)
            return LaunchResult(code, False, time.perf_counter() - start)
        except subprocess.TimeoutExpired:
            _stop(process)
            log.write(f"\nstopped after the time limit of {timeout_s:.0f} s\n")
            return LaunchResult(None, True, time.perf_counter() - start)
        except KeyboardInterrupt:  # its own process group misses the terminal's Ctrl-C
            _stop(process)
            raise


def _stop(process: subprocess.Popen) -> None:
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def error_summary(log_path: Path, tail: int = ERROR_TAIL_LINES) -> str:
    """What a failed run said: its ``error:`` lines (a refused flag, a crashed rank) and
    the last ``tail`` lines of its log."""
    if not log_path.is_file():
        return f"no log at {log_path}"
    lines = log_path.read_text(errors="replace").splitlines()
    errors = [ln for ln in lines if "error:" in ln.lower() or "Error:" in ln][:3]
    last = [ln for ln in lines[-tail:] if ln not in errors]
    return "\n".join([*errors, *last]).strip()
