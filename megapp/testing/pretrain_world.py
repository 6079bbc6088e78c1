"""``pretrain_gpt.py``'s ``main(argv)`` on every rank of a reused gloo world, in place of a
torchrun launch.

A torchrun launch pays for its processes: each imports torch and joins a rendezvous (tens
of seconds on a small machine). A test that is about what the job computes (a resume
continuing exactly, a checkpoint loading under another layout, two schedules training the
same model) runs the same ``main`` in the workers of :func:`~megapp.testing.get_world`,
whose default group is already up::

    done = run_pretrain_in_world(4, ["--tensor-model-parallel-size", "2", ...], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    train = read_records(tmp_path / "metrics.jsonl", "train")

Each rank sees what torchrun would give it on one node (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, its own error file), ``sys.argv[0]`` naming the
script and ``cwd`` as its working directory, all restored afterwards. What differs from a
launch, and stays for torchrun tests to check: the job keeps the world's default group
(``main`` tears down only the layout's groups), and a settings error ends every rank at
once, as torchrun ends a node once its first process has reported (the others, silent, do
not wait out the grace torchrun would cut short). A failed collective ends the worker
(``main`` leaves with ``os._exit``): the world reports its output and starts afresh.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any, TextIO

from megapp.testing.world import get_world
from megapp.training.launch import PRETRAIN_SCRIPT, Launched

__all__ = ["pretrain_script", "run_pretrain_in_world"]


def run_pretrain_in_world(
    world_size: int,
    flags: Sequence[str | os.PathLike],
    *,
    cwd: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    fresh: bool = False,
    timeout_s: float = 300.0,
) -> Launched:
    """Run ``pretrain_gpt.py <flags>`` on the ``world_size`` ranks of the shared world.

    Returns what :func:`megapp.training.launch.run_pretrain` would: the exit status (0, or
    ``main``'s ``SystemExit`` code, 2 for a settings error), and what the ranks printed,
    rank by rank, to stdout and stderr. ``env``: more environment variables for the job.
    ``fresh``: start the world's processes afresh first, for a run that measures its
    process (``--profile-iteration`` counts every live tensor, and a launched job's fresh
    process holds none from earlier work).
    A rank still running after ``timeout_s`` fails the call
    (:class:`~megapp.testing.DistributedTestError`, with every rank's stack).
    """
    started = time.perf_counter()
    reports = tempfile.mkdtemp(prefix="megapp-pretrain-world-")
    try:
        outcomes = get_world(world_size, fresh=fresh).run(
            _main_on_rank,
            [str(flag) for flag in flags],
            os.fspath(cwd) if cwd is not None else os.getcwd(),
            dict(env or {}),
            reports,
            timeout=timeout_s,
        )
    finally:
        shutil.rmtree(reports, ignore_errors=True)
    failed = [code for code, _, _ in outcomes if code != 0]
    return Launched(
        failed[0] if failed else 0,
        False,
        time.perf_counter() - started,
        "".join(out for _, out, _ in outcomes),
        "".join(err for _, _, err in outcomes),
    )


def pretrain_script() -> ModuleType:
    """``pretrain_gpt.py`` as a module, imported once per process from the repository root
    (no change to ``sys.path``)."""
    module = sys.modules.get("pretrain_gpt")
    if module is None:
        spec = importlib.util.spec_from_file_location("pretrain_gpt", PRETRAIN_SCRIPT)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["pretrain_gpt"] = module
        spec.loader.exec_module(module)
    return module


class _Tee(io.TextIOBase):
    """Writes to ``first`` and ``second``: captured for the caller and kept in the world's
    log (which a worker that dies leaves behind)."""

    def __init__(self, first: TextIO, second: TextIO):
        self.first, self.second = first, second

    def write(self, text: str) -> int:
        self.second.write(text)
        return self.first.write(text)

    def flush(self) -> None:
        self.first.flush()
        self.second.flush()


@contextlib.contextmanager
def _as_a_torchrun_worker(
    rank: int, size: int, cwd: str, env: Mapping[str, str], reports: str
) -> Iterator[None]:
    """This process as torchrun would start rank ``rank`` of ``size`` on one node, until
    the block ends."""
    import torch.distributed as dist

    from megapp.training import arguments

    error_file = os.path.join(reports, str(rank), "error.json")
    os.makedirs(os.path.dirname(error_file), exist_ok=True)
    variables = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(size),
        "LOCAL_WORLD_SIZE": str(size),
        "TORCHELASTIC_ERROR_FILE": error_file,  # the node's first error report is claimed here
        **env,
    }
    saved_env = {name: os.environ.get(name) for name in [*variables, "TORCHELASTIC_RUN_ID"]}
    saved_cwd, saved_argv = os.getcwd(), sys.argv
    saved_grace, destroy = arguments.ERROR_GRACE_S, dist.destroy_process_group

    def destroy_but_the_default(group: Any = None) -> None:
        if group is not None and group is not dist.group.WORLD:
            destroy(group)

    os.environ.update(variables)
    os.environ.pop("TORCHELASTIC_RUN_ID", None)  # no launcher to watch
    os.chdir(cwd)
    sys.argv = [str(PRETRAIN_SCRIPT)]
    arguments.ERROR_GRACE_S = 0.0
    dist.destroy_process_group = destroy_but_the_default
    try:
        yield
    finally:
        dist.destroy_process_group = destroy
        arguments.ERROR_GRACE_S = saved_grace
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _main_on_rank(
    flags: list[str], cwd: str, env: dict[str, str], reports: str
) -> tuple[int, str, str]:
    """``main(flags)`` on this rank: (exit status, stdout, stderr)."""
    import torch.distributed as dist

    main = pretrain_script().main
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with (
        _as_a_torchrun_worker(dist.get_rank(), dist.get_world_size(), cwd, env, reports),
        contextlib.redirect_stdout(_Tee(out, sys.stdout)),
        contextlib.redirect_stderr(_Tee(err, sys.stderr)),
    ):
        try:
            main(flags)
        except SystemExit as stop:
            code = 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
    return code, out.getvalue(), err.getvalue()
