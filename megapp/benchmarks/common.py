"""What every benchmark in tools/benchmarks/ and the GPU check share: where and from what it
ran, timing, tables, ranks.

* provenance: :func:`command_line` (the command that produced a run, torchrun included),
  :func:`machine`, :func:`source_state` (commit, uncommitted changes, when ``megapp._C`` was
  built), :func:`load_average`, and Linux's CPU pressure (:func:`cpu_stall_us`,
  :func:`stall_pct`, :func:`cpu_pressure`), which says how much other jobs got in the way;
* timing: :func:`interleaved` runs several implementations round by round in a rotating or
  reversing order, so that load that drifts during a run falls on all of them alike;
  :func:`median` and :func:`iqr_pct` summarize the rounds;
* output: :func:`markdown_table`, :func:`fmt`, :func:`write_json`;
* processes: :class:`Ranks` runs a module-level function on every rank of a gloo world, either
  spawned here (a reusable ``megapp.testing.World``) or, under torchrun, with this process as
  one of the ranks.

Benchmarks measure; nothing here judges a timing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from megapp.testing import World

ROOT = Path(__file__).resolve().parents[2]  # the repository
T = TypeVar("T")


# ----- provenance -------------------------------------------------------------------------------
def launched_by_torchrun() -> bool:
    """Whether torchrun (or another launcher that sets RANK and WORLD_SIZE) started us."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def command_line() -> str:
    """The command that produced this run, as a user would type it again."""
    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    if main is not None:  # python -m <module>: argv[0] is the module's file
        module = main.name.removesuffix(".__main__")
        script = shlex.join(["-m", module, *sys.argv[1:]])
    else:
        script = shlex.join(sys.argv)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return f"torchrun --nproc-per-node {os.environ['WORLD_SIZE']} {script}"
    return f"python {script}"


def available_cores() -> int:
    """The cores this process may run on (its affinity), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, or what ``platform`` knows."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def machine() -> str:
    """One line: OS, CPU, usable cores, Python and torch versions."""
    return (
        f"{platform.platform()}, {cpu_model()}, {available_cores()} cores "
        f"(os.cpu_count()={os.cpu_count()}), python {platform.python_version()}, "
        f"torch {torch.__version__}"
    )


def built_at(module: str = "megapp._C") -> str:
    """When the compiled library ``module`` was built (its file's time), or "not built"."""
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        spec = None
    if spec is None or spec.origin is None:
        return "not built"
    return time.strftime("%Y-%m-%d %H:%M %Z", time.localtime(os.path.getmtime(spec.origin)))


def source_state(paths: Sequence[str]) -> str:
    """The commit, the uncommitted changes under ``paths`` (relative to the repository), and
    when ``megapp._C`` was built: which code a run measured."""

    def git(*argv: str) -> str:
        return subprocess.run(
            ["git", "-C", str(ROOT), *argv], capture_output=True, text=True, check=True
        ).stdout

    try:
        commit = git("rev-parse", "--short", "HEAD").strip()
        changed = [line[3:] for line in git("status", "--porcelain", "--", *paths).splitlines()]
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"
    shown = ", ".join(changed[:6]) + (f" and {len(changed) - 6} more" if len(changed) > 6 else "")
    return (
        f"commit {commit}, uncommitted changes in {shown or 'none'} (of {', '.join(paths)}); "
        f"megapp._C built {built_at()}"
    )


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, ``"1.02/0.80/0.61"``."""
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def cpu_stall_us() -> float | None:
    """Linux PSI: total µs during which some runnable task waited for a CPU (None without)."""
    with contextlib.suppress(OSError, IndexError, ValueError), open("/proc/pressure/cpu") as f:
        return float(f.readline().rsplit("total=", 1)[1])
    return None


def stall_pct(before: float | None, after: float | None, elapsed_s: float) -> float | None:
    """Share (%) of ``elapsed_s`` during which some task waited for a CPU: other jobs' load."""
    if before is None or after is None or elapsed_s <= 0:
        return None
    return min(100.0, 100.0 * (after - before) / 1e6 / elapsed_s)


def cpu_pressure() -> str:
    """Linux PSI averages: the share of time some runnable task waited for a CPU."""
    with contextlib.suppress(OSError, KeyError, ValueError), open("/proc/pressure/cpu") as f:
        fields = dict(kv.split("=") for kv in f.readline().split()[1:])
        return f"CPU pressure (some) avg10 {fields['avg10']}%, avg60 {fields['avg60']}%"
    return "CPU pressure unavailable"


# ----- timing -----------------------------------------------------------------------------------
def interleaved(
    calls: Mapping[str, Callable[[], T]],
    rounds: int,
    *,
    warmup: int = 0,
    order: str = "rotate",
    counts: Mapping[str, int] | None = None,
) -> dict[str, list[T]]:
    """Call every implementation once per round and keep what the timed rounds returned.

    Args:
        calls: name -> a call that measures one run and returns the measurement.
        rounds: timed rounds (the most any implementation gets, see ``counts``).
        warmup: untimed rounds first.
        order: ``"rotate"`` (a, b, c; b, c, a; ...) or ``"reverse"`` (a, b; b, a; ...), so
            that no implementation always runs right after another.
        counts: at most this many timed calls per name (default: ``rounds`` each).

    Returns:
        name -> the measurements of its timed calls, in order.
    """
    if order not in ("rotate", "reverse"):
        raise ValueError(f"order is 'rotate' or 'reverse', got {order!r}")
    names = list(calls)
    wanted = {name: rounds if counts is None else counts[name] for name in names}
    out: dict[str, list[T]] = {name: [] for name in names}
    for r in range(warmup + rounds):
        if order == "rotate":
            shift = r % len(names)
            sequence = names[shift:] + names[:shift]
        else:
            sequence = names if r % 2 == 0 else names[::-1]
        for name in sequence:
            if r < warmup:
                calls[name]()
            elif len(out[name]) < wanted[name]:
                out[name].append(calls[name]())
    return out


def median(xs: Sequence[float]) -> float:
    """The median, or NaN for no values (a variant that did not run)."""
    return statistics.median(xs) if xs else float("nan")


def iqr_pct(xs: Sequence[float]) -> float:
    """Interquartile range over the median, in %: the spread of the rounds (NaN below 4)."""
    if len(xs) < 4:
        return float("nan")
    q1, _, q3 = statistics.quantiles(xs, n=4)
    return 100.0 * (q3 - q1) / statistics.median(xs)


# ----- output -----------------------------------------------------------------------------------
def fmt(value: float | None, spec: str) -> str:
    """``format(value, spec)``, or ``-`` for a value that was not measured (None or NaN)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def markdown_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], align: str | None = None
) -> str:
    """A markdown table with padded columns (it reads in a terminal too); ``align`` has an
    ``l`` or ``r`` per column (default: every column right-aligned)."""
    align = align or "r" * len(header)
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        padded = (
            str(c).ljust(w) if a == "l" else str(c).rjust(w)
            for c, w, a in zip(cells, widths, align, strict=True)
        )
        return "| " + " | ".join(padded) + " |"

    pairs = zip(widths, align, strict=True)
    marks = [":" + "-" * (w + 1) if a == "l" else "-" * (w + 1) + ":" for w, a in pairs]
    rule = "|" + "|".join(marks) + "|"
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def write_json(path: str | Path, data: Any) -> None:
    """Write ``data`` as indented JSON, creating the directory; NaN becomes null."""

    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(clean(data), indent=1, allow_nan=False) + "\n")


# ----- processes --------------------------------------------------------------------------------
class Ranks:
    """Runs module-level functions on every rank of a gloo world.

    Spawned (``python tools/benchmarks/bench_x.py``): a ``megapp.testing.World`` of ``world_size``
    processes with ``threads`` torch threads each, and this process only orchestrates; a
    rank's output goes to its log and shows only if the call fails. Under torchrun: this
    process is one of the ranks (the world size is torchrun's) and calls the function itself;
    only rank 0 reports (:attr:`reporting`).
    """

    def __init__(self, world_size: int, *, threads: int = 1, timeout: float = 3600.0) -> None:
        self.timeout = timeout
        self.world: World | None = None
        if launched_by_torchrun():
            if not dist.is_initialized():
                dist.init_process_group("gloo")
            torch.set_num_threads(threads)
            self.world_size = dist.get_world_size()
        else:
            self.world_size = world_size
            self.world = World(world_size, num_threads=threads)
            self.world.start()

    @property
    def reporting(self) -> bool:
        """Whether this process prints the results (the spawner, or torchrun's rank 0)."""
        return self.world is not None or dist.get_rank() == 0

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on every rank; rank 0's result (spawned) or this rank's (torchrun)."""
        if self.world is None:
            try:
                return fn(*args)
            finally:
                parallel_state = sys.modules.get("megapp.parallel_state")
                if parallel_state is not None:  # as a World does after each task
                    parallel_state.destroy_model_parallel()
        return self.run_all(fn, *args)[0]

    def run_all(self, fn: Callable[..., T], *args: Any) -> list[T]:
        """``fn(*args)`` on every rank of a spawned world; the results by rank."""
        if self.world is None:
            raise RuntimeError("run_all needs spawned ranks; under torchrun use run")
        module = fn.__module__
        if module == "__main__":  # the workers import the script under its file name
            module = Path(sys.modules["__main__"].__file__).stem
        return self.world.run_by_name(module, fn.__qualname__, args, {}, timeout=self.timeout)

    def close(self, *, clean: bool = True) -> None:
        """Stop a spawned world; under torchrun leave the process group (after a barrier
        when ``clean``: a failed rank would never reach it)."""
        if self.world is not None:
            self.world.close()
        elif dist.is_initialized():
            if clean:
                dist.barrier()
            dist.destroy_process_group()

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(clean=exc_type is None)
