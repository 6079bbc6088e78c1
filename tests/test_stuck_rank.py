"""A dead or stuck rank ends every other rank of the job within the timeout, each with one
line naming the group and the operation it waited on.

Four ranks (pipeline 2 × data parallel 2) are started by hand, not by torchrun, so each
rank's own exit and message can be observed (torchrun would stop the rest once the first
one fails). Rank 0 gets stuck in the middle of iteration 2. The jobs are whole launches:
marked slow.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from megapp.training.launch import REPOSITORY, finish, launch_env, start_command

TIMEOUT_S = 15.0  # --distributed-timeout-minutes 0.25
MODES = ("stop", "sleep", "kill")
FLAGS = [
    "--pipeline-model-parallel-size",
    "2",
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "2",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "4",
    "--lr",
    "1e-3",
    "--train-iters",
    "20",
    "--eval-iters",
    "0",
    "--log-interval",
    "1",
    "--use-default-corpus",
    "--distributed-timeout-minutes",
    "0.25",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(mode: str, root: Path, cache: Path) -> tuple[list[subprocess.Popen], Path]:
    marker = root / "stuck_at"
    env = launch_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
    env["WORLD_SIZE"] = "4"
    flags = [*FLAGS, "--data-cache-path", str(cache)]
    script = REPOSITORY / "tests" / "stuck_rank_job.py"
    job = [sys.executable, str(script), mode, "0", "3", str(marker), "--", *flags]
    procs = [
        start_command(job, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=root)
        for r in range(4)
    ]
    return procs, marker


@dataclass
class Job:
    procs: list[subprocess.Popen]
    marker: Path
    exits: set[int] = field(default_factory=set)  # the ranks seen gone
    outputs: list[tuple[str, str]] = field(default_factory=list)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, Job]:
    """Every mode's job, side by side so the waits for the timeout overlap: "stop" and
    "sleep" start together, "kill" once both are stuck (its peers have no timeout to wait
    for, so it runs while the other two wait out theirs, on an otherwise idle machine)."""
    roots = {mode: tmp_path_factory.mktemp(mode) for mode in MODES}
    cache = roots["stop"] / "cache"  # "kill" reuses the corpus "stop" built before it got stuck
    running = {mode: Job(*_launch(mode, roots[mode], roots[mode] / "cache")) for mode in MODES[:2]}
    try:
        deadline = time.monotonic() + 240  # a hang guard: the jobs end by themselves
        while time.monotonic() < deadline and (
            len(running) < len(MODES) or any(len(job.exits) < 3 for job in running.values())
        ):
            stuck = all(job.marker.exists() or job.exits for job in running.values())
            if "kill" not in running and stuck:
                running["kill"] = Job(*_launch("kill", roots["kill"], cache))
            for job in running.values():
                for r in (1, 2, 3):
                    if r not in job.exits and job.procs[r].poll() is not None:
                        job.exits.add(r)
            time.sleep(0.1)
    finally:
        for job in running.values():
            for p in job.procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGKILL)
            job.outputs = [(done.stdout, done.stderr) for done in map(_finished, job.procs)]
    return running


def _finished(process: subprocess.Popen):
    return finish(process, timeout_s=60)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_every_other_rank_exits_within_the_timeout(mode, jobs):
    """Each other rank exits with one line naming what it waited on: on a stuck rank once
    the job's timeout has run out (gloo says how long it waited: the job's 15 s, not
    torch's default of 30 minutes; a rank waiting on a peer that gave up first sees that
    peer's connection close, as late), on a dead one as soon as its connection closes."""
    assert mode in jobs, f"the {mode} job never started"
    job = jobs[mode]
    procs, exits, outputs = job.procs, job.exits, job.outputs
    assert len(exits) == 3, f"ranks {sorted({1, 2, 3} - set(exits))} still running"
    assert job.marker.exists(), "rank 0 never got stuck"
    waited_out = []
    for r in (1, 2, 3):
        stderr = outputs[r][1]
        assert procs[r].returncode == 1, f"rank {r} exited {procs[r].returncode}:\n{stderr[-3000:]}"
        lines = [line for line in stderr.splitlines() if "error:" in line]
        assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
        if mode == "kill":  # a dead peer closes its connections: no timeout to wait out
            assert re.search(r"Connection (reset|closed) by peer", lines[0]), lines[0]
            assert "Timed out" not in lines[0], lines[0]
        else:
            own = f"Timed out waiting {TIMEOUT_S * 1000:.0f}ms" in lines[0]
            if not own:  # its peer waited out the timeout and left first
                assert re.search(r"Connection (reset|closed) by peer", lines[0]), lines[0]
            waited_out.append(own)
        assert re.search(
            rf"stuck_rank_job.py: error: rank {r}: .*"
            r"(all-reduce|all-gather|reduce-scatter|barrier|receive|send).*"
            r" over the (data|pipeline|tensor|embedding|model)-parallel group \(ranks [\d, ]+\)",
            lines[0],
        ), lines[0]
    if mode != "kill":
        assert any(waited_out), "no rank waited out the job's timeout"
    # rank 2 runs stage 1 after rank 0: it waits for rank 0's activation
    assert "over the pipeline-parallel group (ranks 0, 2)" in outputs[2][1]
    assert "receive of the activation" in outputs[2][1]
