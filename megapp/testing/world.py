"""A reusable pool of gloo processes that runs a function on every rank.

Spawning and initializing torch processes is the expensive part of a
distributed test (seconds per process on a small machine), so a ``World`` is
started once and then runs many functions. Workers are forked from a
forkserver that has already imported torch and megapp, so a fresh world starts in
a fraction of a second instead of importing them once per process. A task that
leaves its workers holding many process groups' threads gets the world restarted
after it (see ``_THREAD_LIMIT``).

A function is sent by reference (module name and qualified name) and must be
defined at module level. Its return value comes back from every rank. An
exception on any rank fails the call with that rank's traceback; a rank that
does not answer within the timeout fails the call with every rank's stack, and
the broken world is torn down so the next call starts a fresh one.

A script that starts a world must keep its own work under
``if __name__ == "__main__":``: multiprocessing's forkserver imports the main
module in every worker, as with the spawn start method. Nothing else is needed:
the workers see the caller's ``sys.path``, and the folder megapp is imported from
is put on the forkserver's ``PYTHONPATH``, so megapp need not be installed.
Each world keeps its ranks' logs in a temporary folder, removed by :meth:`World.close`.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import importlib
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

# Collectives give up after this long, so a worker never blocks forever even if
# the parent is gone; the per-call timeout below is normally much shorter.
_COLLECTIVE_TIMEOUT = timedelta(seconds=300)
# After one rank fails, the others get this long to finish before the world is
# declared broken (they are usually stuck in a collective with the dead rank).
_GRACE_AFTER_ERROR_S = 3.0
# A worker left with more threads than this after a task holds process groups that the
# task destroyed but left referenced (gloo keeps three threads per group until its last
# reference goes; a model whose gradient hooks point back at it is never collected). They
# poll while idle and slow every later task on a small machine, so the world is started
# afresh before its next task. A worker holds about ten threads of its own.
_THREAD_LIMIT = 48
# What the forkserver imports once, so that every worker, and every restart, starts with it.
# torch.optim imports torch._dynamo (and sympy with it) when an optimizer takes its first
# parameter group: 1 to 2 s of CPU in each worker that builds one, paid once here instead.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "megapp.training.pretrain",
    "megapp.models",
]


class DistributedTestError(AssertionError):
    """A function failed or hung on one or more ranks of a world."""


def _resolve(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    # A test decorated with `distributed` stands in for the body it runs.
    return getattr(obj, "__distributed_body__", obj)


def _after_task() -> None:
    """Leave the process as the next task expects it: no model-parallel groups."""
    parallel_state = sys.modules.get("megapp.parallel_state")
    if parallel_state is not None:
        parallel_state.destroy_model_parallel()


def _worker_main(
    rank: int, world_size: int, port: int, log_path: str, conn: Connection, num_threads: int
) -> None:
    # Append mode, so truncating the log at each task restarts it cleanly for every writer.
    log = open(log_path, "a", buffering=1)  # noqa: SIM115 (lives as long as the process)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    # What the forkserver imported lives as long as the worker: the collector need not scan
    # it again in every full collection.
    gc.freeze()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(num_threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=_COLLECTIVE_TIMEOUT,
    )
    conn.send(("ready", None))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            break
        if task is None:
            break
        sys_path, module, qualname, args, kwargs = task
        sys.stdout.flush()
        sys.stderr.flush()
        log.truncate(0)  # the log holds this task's output only
        sys.path[:0] = [p for p in sys_path if p not in sys.path]
        try:
            result = _resolve(module, qualname)(*args, **kwargs)
            reply = ("ok", result)
        except BaseException:
            reply = ("error", traceback.format_exc())
        try:
            _after_task()
        except Exception:
            if reply[0] == "ok":
                reply = ("error", traceback.format_exc())
        conn.send(reply)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def _free_port(ports: range | None) -> int:
    """A port on 127.0.0.1 nothing listens on: any (None), or the first free one of
    ``ports``."""
    for port in ports if ports is not None else [0]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(
        f"no free port in {ports[0]}..{ports[-1]} for the world's rendezvous: every one "
        "is in use; give World a wider or another port range"
    )


def _port_range(port: int | range | None) -> range | None:
    """``port`` as a range of candidate ports (None: any free port)."""
    if port is None:
        return None
    ports = range(port, port + 1) if isinstance(port, int) else port
    if not isinstance(ports, range) or isinstance(port, bool):
        raise TypeError(f"port must be an int, a range or None, got {port!r}")
    if len(ports) == 0 or not all(1 <= p <= 65535 for p in (ports[0], ports[-1])):
        raise ValueError(
            f"port must be one port or a non-empty range of ports in 1..65535, got {port!r}"
        )
    return ports


def _megapp_on_pythonpath() -> None:
    """Let the forkserver import megapp: it is started with the interpreter's default path
    (the caller's ``sys.path`` reaches each task, but only after the fork)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [root, *paths] if p)


def _context() -> mp.context.BaseContext:
    _megapp_on_pythonpath()
    ctx = mp.get_context("forkserver")
    # Import torch once in the forkserver; every worker forks with it loaded.
    ctx.set_forkserver_preload([*_PRELOAD, __name__])  # a module that fails to import is skipped
    return ctx


class World:
    """``world_size`` processes with an initialized gloo default group.

    ``port``: where rank 0 listens for the others to join, one port or a ``range`` of
    them (the first free one is taken when the world starts); default any free port.
    :attr:`port` is the one in use once started.
    """

    def __init__(
        self,
        world_size: int,
        *,
        num_threads: int = 1,
        start_timeout: float = 120.0,
        port: int | range | None = None,
    ):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.ports = _port_range(port)
        self.port: int | None = None
        self.world_size = world_size
        self.num_threads = num_threads
        self.start_timeout = start_timeout
        self._procs: list[mp.Process] = []
        self._conns: list[Connection] = []
        self._logdir: str | None = None

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> None:
        port = self.port = _free_port(self.ports)
        ctx = _context()
        self._logdir = tempfile.mkdtemp(prefix=f"megapp-world{self.world_size}-")
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, port, self._log(rank), child, self.num_threads),
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        replies, missing = self._gather(time.monotonic() + self.start_timeout)
        if missing or any(kind != "ready" for kind, _ in replies.values()):
            report = self._report(replies, missing, "did not start")
            self.close()
            raise DistributedTestError(report)

    def run(self, fn: Any, *args: Any, timeout: float = 60.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results by rank."""
        return self.run_by_name(fn.__module__, fn.__qualname__, args, kwargs, timeout=timeout)

    def run_by_name(
        self, module: str, qualname: str, args: tuple, kwargs: dict, *, timeout: float = 60.0
    ) -> list[Any]:
        if not self.alive:
            self.close()
            self.start()
        task = (list(sys.path), module, qualname, args, kwargs)
        for conn in self._conns:
            conn.send(task)
        replies, missing = self._gather(time.monotonic() + timeout)
        failed = missing or any(kind != "ok" for kind, _ in replies.values())
        if failed:
            errored = any(kind != "ok" for kind, _ in replies.values())
            why = (
                "were still running after another rank failed"
                if errored
                else (f"did not finish within {timeout:.0f} s")
            )
            report = self._report(replies, missing, why)
            if missing:
                self.close()  # the hung ranks cannot be trusted with another task
            raise DistributedTestError(f"{module}.{qualname} failed\n{report}")
        if max(self._threads()) > _THREAD_LIMIT:
            self.close()  # the next task starts a fresh world
        return [replies[rank][1] for rank in range(self.world_size)]

    def _threads(self) -> list[int]:
        """How many threads each worker runs (0 where that cannot be read)."""
        counts = []
        for proc in self._procs:
            try:
                counts.append(len(os.listdir(f"/proc/{proc.pid}/task")))
            except OSError:
                counts.append(0)
        return counts

    def _gather(self, deadline: float) -> tuple[dict[int, tuple[str, Any]], list[int]]:
        """Collect one reply per rank until ``deadline``; stop early after an error."""
        replies: dict[int, tuple[str, Any]] = {}
        pending = dict(enumerate(self._conns))
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for conn in wait(list(pending.values()), timeout=remaining):
                rank = next(r for r, c in pending.items() if c is conn)
                del pending[rank]
                try:
                    replies[rank] = conn.recv()
                except (EOFError, OSError):
                    self._procs[rank].join(timeout=2)
                    code = self._procs[rank].exitcode
                    log = self._tail(rank)
                    replies[rank] = ("died", f"process exited (exit code {code})\n{log}")
            if any(kind not in ("ok", "ready") for kind, _ in replies.values()):
                deadline = min(deadline, time.monotonic() + _GRACE_AFTER_ERROR_S)
        return replies, sorted(pending)

    def _report(self, replies: dict[int, tuple[str, Any]], missing: list[int], why: str) -> str:
        parts = []
        for rank, (kind, payload) in sorted(replies.items()):
            if kind not in ("ok", "ready"):
                parts.append(f"--- rank {rank} ({kind}) ---\n{payload}")
                output = self._tail(rank, limit=3000).strip() if kind == "error" else ""
                if output:
                    parts.append(f"--- rank {rank} output ---\n{output}")
        if missing:
            for rank in missing:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self._procs[rank].pid, signal.SIGUSR1)
            time.sleep(0.5)  # let faulthandler write the stacks
            parts.append(f"--- ranks {missing} {why} ---")
            for rank in missing:
                parts.append(f"--- rank {rank} log (ends with its stack) ---\n{self._tail(rank)}")
        return "\n".join(parts)

    def _log(self, rank: int) -> str:
        assert self._logdir is not None
        return os.path.join(self._logdir, f"rank{rank}.log")

    def _tail(self, rank: int, limit: int = 6000) -> str:
        try:
            with open(self._log(rank)) as f:
                return f.read()[-limit:]
        except OSError as err:
            return f"(no log: {err})"

    def close(self) -> None:
        """Stop the workers (politely, then by force)."""
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self._procs:
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=2)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self._logdir is not None:
            shutil.rmtree(self._logdir, ignore_errors=True)
            self._logdir = None


_WORLDS: dict[int, World] = {}


def get_world(world_size: int, *, fresh: bool = False) -> World:
    """The shared world of ``world_size`` ranks, started on first use; ``fresh``: in new
    processes, whatever earlier tasks left in the old ones."""
    world = _WORLDS.get(world_size)
    if world is None:
        world = _WORLDS[world_size] = World(world_size)
    if fresh or not world.alive:
        world.close()
        world.start()
    return world


def shutdown_worlds() -> None:
    for world in _WORLDS.values():
        world.close()
    _WORLDS.clear()


atexit.register(shutdown_worlds)
