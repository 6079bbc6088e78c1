"""Launching ``pretrain_gpt.py`` under torchrun from Python: the command, its environment,
and a run with a time limit.

The tests, the ablation sweep, the calibration and the memory check all start jobs this
way. A job runs in a process group of its own, so a time limit (or the caller's cleanup)
stops torchrun and every rank together.

    done = run_pretrain(4, ["--num-layers", "2", ...], timeout_s=300)
    assert done.returncode == 0, done.stderr
    train = read_records(metrics_path, "train")   # megapp.training.metrics
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]
PRETRAIN_SCRIPT = REPOSITORY / "pretrain_gpt.py"


def torchrun_command(
    nproc: int,
    flags: Sequence[str],
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    script: str | os.PathLike = PRETRAIN_SCRIPT,
) -> list[str]:
    """``python -m torch.distributed.run ... pretrain_gpt.py <flags>`` (this interpreter's
    torchrun). One node runs ``--standalone`` (a free port, so jobs can run side by side);
    several join the c10d rendezvous at ``rdzv_endpoint`` as ``node_rank``."""
    command = [sys.executable, "-m", "torch.distributed.run"]
    if nnodes == 1:
        command.append("--standalone")
    else:
        if rdzv_endpoint is None:
            raise ValueError(f"a job of {nnodes} nodes needs an rdzv_endpoint (host:port)")
        command += ["--nnodes", str(nnodes), "--node-rank", str(node_rank)]
        command += ["--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint]
    return [*command, "--nproc-per-node", str(nproc), str(script), *flags]


def launch_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment with one thread per rank (ranks sharing cores would
    fight over them) and the repository first on ``PYTHONPATH`` (megapp need not be
    installed), plus ``extra``."""
    path = os.pathsep.join(p for p in (str(REPOSITORY), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **(extra or {})}


@dataclass(frozen=True)
class Launched:
    """How a job ended: its exit status (None when stopped at the time limit) and what it
    printed (empty when its output went to a log file)."""

    returncode: int | None
    timed_out: bool
    seconds: float
    stdout: str = ""
    stderr: str = ""


def start_pretrain(
    nproc: int,
    flags: Sequence[str],
    *,
    cwd: str | os.PathLike | None = None,
    log_path: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    **torchrun: object,
) -> subprocess.Popen:
    """Start ``pretrain_gpt.py`` on ``nproc`` ranks per node in a process group of its own.

    ``torchrun`` holds :func:`torchrun_command`'s multi-node arguments; the rest is
    :func:`start_command`'s.
    """
    command = torchrun_command(nproc, flags, **torchrun)  # type: ignore[arg-type]
    return start_command(command, cwd=cwd, log_path=log_path, env=env)


def start_command(
    command: Sequence[str],
    *,
    cwd: str | os.PathLike | None = None,
    log_path: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen:
    """Start ``command`` in a process group of its own, so :func:`stop` ends it whole.

    Its output goes to ``log_path`` (stdout and stderr together, after the command line),
    or to pipes read by :func:`finish`. ``env`` defaults to :func:`launch_env`.
    """
    command = [str(part) for part in command]
    if log_path is None:
        out = err = subprocess.PIPE
    else:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        out = open(log_path, "w")  # noqa: SIM115 (the child holds it; closed below)
        out.write("$ " + " ".join(command) + "\n")
        out.flush()
        err = subprocess.STDOUT
    try:
        return subprocess.Popen(
            command,
            cwd=cwd,
            env=dict(env) if env is not None else launch_env(),
            stdout=out,
            stderr=err,
            text=True,
            start_new_session=True,
        )
    finally:
        if log_path is not None:
            out.close()


def stop(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop a started job's whole process group: SIGTERM, then SIGKILL after ``grace_s``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def finish(process: subprocess.Popen, timeout_s: float, started: float | None = None) -> Launched:
    """Wait for a started job; past ``timeout_s`` stop it. ``started``: its
    ``time.perf_counter()`` at start, for :attr:`Launched.seconds`."""
    started = time.perf_counter() if started is None else started
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        stop(process)
        stdout, stderr = process.communicate()
        timed_out = True
    except BaseException:  # a Ctrl-C misses a job in its own session: stop it too
        stop(process)
        raise
    return Launched(
        None if timed_out else process.returncode,
        timed_out,
        time.perf_counter() - started,
        stdout or "",
        stderr or "",
    )


def run_pretrain(
    nproc: int, flags: Sequence[str], *, timeout_s: float = 600.0, **start: object
) -> Launched:
    """:func:`start_pretrain` then :func:`finish`: one job, start to end."""
    started = time.perf_counter()
    return finish(start_pretrain(nproc, flags, **start), timeout_s, started)  # type: ignore[arg-type]
