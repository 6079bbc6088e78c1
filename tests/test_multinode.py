"""examples/pretrain_gpt_multinode.sh as users launch it, on one machine: two torchrun
"nodes" meet at a c10d rendezvous on a local port.

- Two nodes of 2 processes train pp 2 × dp 2 (the default order puts the pipeline stages
  on different nodes) and log exactly the losses of the same script run as one node of
  4 processes.
- ``kill -9`` on one node's torchrun ends the whole job: its orphaned workers notice that
  their launcher is gone and exit, the other node's workers lose their peers and exit
  naming the collective, and the other torchrun exits nonzero.

Both launch whole jobs (several torchruns each): they are marked slow.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from megapp.training.launch import REPOSITORY, Launched, finish, launch_env, start_command
from megapp.training.metrics import read_records

SCRIPT = REPOSITORY / "examples" / "pretrain_gpt_multinode.sh"
TIMEOUT_S = 15.0  # TIMEOUT_MINUTES=0.25
# Longest wait for the job to end by itself after the kill: the job's timeout and the
# launchers' teardown, many times over (a job that hangs waits forever).
HANG_S = 8 * TIMEOUT_S


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(corpus: Path, checkpoints: Path, **overrides: str) -> dict[str, str]:
    return launch_env(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
            "RDZV_ID": checkpoints.name,
            "TIMEOUT_MINUTES": "0.25",
            "DATA_PATH": str(corpus / "stdlib"),
            "CHECKPOINT_DIR": str(checkpoints),
            "TENSORBOARD_DIR": "",
            "FEATURES": "",
            "TOKENIZER_ARGS": "--tokenizer-type ByteTokenizer",
            "MODEL_ARGS": "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32",
            "BATCH_ARGS": "--micro-batch-size 2 --global-batch-size 8",
            "TRAIN_ARGS": "--lr 1e-3 --train-iters 3 --log-interval 1 --eval-iters 0",
            **overrides,
        }
    )


def _node(env: dict[str, str], cwd: Path, *extra: str) -> subprocess.Popen:
    """The script's node, started in a process group of its own (the script execs torchrun:
    its pid is the node's agent)."""
    command = ["bash", str(SCRIPT), "--data-cache-path", str(cwd / "cache"), *extra]
    return start_command(command, env=env, cwd=cwd)


def _finished(node: subprocess.Popen) -> Launched:
    done = finish(node, timeout_s=300)
    assert not done.timed_out, f"a node still ran after 300 s:\n{done.stderr[-3000:]}"
    return done


def _losses(metrics: Path) -> list[tuple[int, float, float]]:
    return [(r["iteration"], r["lm_loss"], r["grad_norm"]) for r in read_records(metrics, "train")]


@pytest.mark.slow
def test_two_nodes_train_exactly_like_one(corpus, tmp_path):
    layout = {"TP": "1", "PP": "2"}
    one = _env(corpus, tmp_path / "one", NNODES="1", GPUS_PER_NODE="4", **layout)
    one = _finished(_node(one, tmp_path))
    assert one.returncode == 0, one.stderr[-3000:]
    assert "layout tp 1 × pp 2 × dp 2" in one.stdout

    env = _env(corpus, tmp_path / "two", NNODES="2", GPUS_PER_NODE="2", **layout)
    nodes = [_node(env, tmp_path), _node(env, tmp_path)]
    for node in nodes:
        done = _finished(node)
        assert done.returncode == 0, done.stderr[-3000:]
    expected = _losses(tmp_path / "one" / "metrics.jsonl")
    assert [i for i, _, _ in expected] == [1, 2, 3]
    assert _losses(tmp_path / "two" / "metrics.jsonl") == expected


def _workers(marker: str) -> list[int]:
    """Pids of the running pretrain_gpt.py workers (not their torchrun) whose command line
    holds ``marker``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().split()[2]
        except OSError:
            continue
        worker = "pretrain_gpt.py" in cmdline and "torchrun" not in cmdline
        if worker and marker in cmdline and state != "Z":
            pids.append(int(entry.name))
    return pids


@pytest.mark.slow
def test_killing_one_nodes_torchrun_ends_the_whole_job(corpus, tmp_path):
    checkpoints = tmp_path / "killed"
    train = "--lr 1e-3 --train-iters 100000 --log-interval 1 --eval-iters 0"
    env = _env(corpus, checkpoints, NNODES="2", GPUS_PER_NODE="2", TP="1", TRAIN_ARGS=train)
    host = _node(env, tmp_path)  # the first to arrive hosts the rendezvous store
    time.sleep(1.0)
    nodes = [host, _node(env, tmp_path)]
    metrics = checkpoints / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not (metrics.exists() and len(_losses(metrics)) >= 3):
            assert all(n.poll() is None for n in nodes), "a node stopped before training"
            time.sleep(0.5)
        assert len(_workers(str(checkpoints))) == 4, "not every worker is training"
        # The other node's torchrun, not the host's: its workers could go on training with
        # the host's as orphans, since the host's agent and store are unaffected.
        other, killed = nodes
        os.kill(killed.pid, signal.SIGKILL)  # the script execs torchrun: this is the agent
        deadline = time.monotonic() + HANG_S
        while time.monotonic() < deadline:
            if not _workers(str(checkpoints)) and other.poll() is not None:
                break
            time.sleep(0.2)
        left = _workers(str(checkpoints))
    finally:
        for pid in _workers(str(checkpoints)):
            os.kill(pid, signal.SIGKILL)
        outputs = [finish(node, timeout_s=60) for node in nodes]
    assert not left, f"workers still running, a hang: {left}"
    assert outputs[0].returncode not in (0, None), outputs[0].stderr[-3000:]
    # each orphan exits: by noticing its launcher is gone, or because the other orphan
    # (its data-parallel peer on the same node) did so first
    orphans = [line for line in outputs[1].stderr.splitlines() if "pretrain_gpt.py: error:" in line]
    assert len(orphans) == 2, outputs[1].stderr[-3000:]
    assert any("its launcher (torchrun, pid" in line for line in orphans), orphans
    lines = outputs[0].stderr.splitlines()
    survivors = [line for line in lines if "pretrain_gpt.py: error:" in line]
    assert survivors and all(" over the " in line for line in survivors), lines[-30:]
