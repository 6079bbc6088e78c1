"""What pretrain_gpt.py checks before its first collective, and its workers' watch on their
launcher from their first moment: outputs it could not write, a model larger than the
memory, a killed torchrun."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import types
import uuid
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from megapp.training import arguments, initialize
from megapp.training.arguments import ArgumentsError, check_outputs, config_from_flags
from megapp.training.initialize import check_memory, start_up_timeout
from megapp.training.launch import finish, launch_env, start_pretrain, stop
from megapp.training.live_memory import refusing_out_of_memory

# Longest wait for killed torchrun's workers to leave by themselves (a hang waits forever).
HANG_S = 120.0
SMALL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2"]
SMALL += ["--seq-length", "16", "--micro-batch-size", "2", "--lr", "1e-3"]
SMALL += ["--train-iters", "50", "--eval-iters", "0"]


def marked_processes(marker: str) -> dict[int, bool]:
    """Every live process whose environment holds ``marker``: pid -> whether it is a worker
    (torchrun gives its workers LOCAL_RANK)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in environ and state != "Z":
            found[int(entry.name)] = any(v.startswith(b"LOCAL_RANK=") for v in environ)
    return found


def kill_all(pids) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds workers in /proc")
@pytest.mark.parametrize("after_s", [0.0, 1.5])
def test_workers_leave_with_a_launcher_killed_as_they_start(tmp_path, corpus, after_s):
    """torchrun killed ``after_s`` after its workers appear (importing torch, then in the
    rendezvous): every worker leaves by itself, each with one line saying its launcher is
    gone. Without the watch from the first line they waited in the rendezvous until its
    timeout, and said so."""
    marker = f"MEGAPP_LAUNCH_MARKER={uuid.uuid4().hex}"
    nproc = 3
    data = ["--data-path", str(corpus / "stdlib"), "--data-cache-path", str(tmp_path / "cache")]
    name, value = marker.split("=")
    launcher = start_pretrain(nproc, [*SMALL, *data], cwd=tmp_path, env=launch_env({name: value}))
    try:
        deadline = time.monotonic() + 300  # a loaded machine imports slowly
        while sum(marked_processes(marker).values()) < nproc:
            assert time.monotonic() < deadline and launcher.poll() is None, "no workers"
            time.sleep(0.02)
        time.sleep(after_s)
        launcher.kill()  # torchrun alone: its workers are left to notice
        deadline = time.monotonic() + HANG_S
        while marked_processes(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = marked_processes(marker)
        assert not left, f"{len(left)} worker(s) still alive after torchrun was killed: a hang"
        stderr = finish(launcher, timeout_s=10).stderr
    finally:
        kill_all(marked_processes(marker))
        stop(launcher)
    gone = [line for line in stderr.splitlines() if "pretrain_gpt.py: error: rank" in line]
    assert len(gone) == nproc, stderr[-3000:]
    launcher_gone = ("is gone; exiting", "died while it started; exiting")
    assert all(line.endswith(launcher_gone) for line in gone), gone
    assert "Traceback" not in stderr, stderr[-3000:]


def test_a_worker_whose_launcher_is_gone_before_its_first_line_exits_at_once():
    """A worker already adopted by a process that is not Python (init, a shell), as after
    torchrun died while it started, leaves at once instead of waiting on a rendezvous."""
    script = (
        "from megapp.launcher_watch import exit_with_launcher; "
        "exit_with_launcher('pretrain_gpt.py'); print('still running')"
    )
    # the shell stays the parent: it has a second command to run after Python
    shell = f'{sys.executable} -c "{script}"; true'
    env = launch_env({"TORCHELASTIC_RUN_ID": "x", "RANK": "3"})
    done = subprocess.run(["sh", "-c", shell], env=env, capture_output=True, text=True)
    assert "still running" not in done.stdout
    assert done.stderr.strip() == (
        "pretrain_gpt.py: error: rank 3: its launcher (torchrun) died while it started; exiting"
    )
    # with Python as the parent (as torchrun is), the same call goes on
    kept = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    assert kept.stdout.strip() == "still running"


FLAGS = ["--tensor-model-parallel-size", "1", *SMALL[:-4], "--train-iters", "2"]


def config(*extra: str, world_size: int = 1):
    return config_from_flags([*FLAGS, "--use-default-corpus", *extra], world_size)


def test_outputs_that_cannot_be_written_are_refused_naming_the_flag(tmp_path):
    (tmp_path / "a_file").write_text("")
    (tmp_path / "a_directory").mkdir()
    a_file, a_directory = tmp_path / "a_file", tmp_path / "a_directory"
    refused = {
        ("--save", "/proc/nope"): "--save /proc/nope: cannot create it in /proc (",
        ("--save", str(a_file)): f"--save {a_file}: is a file; --save names a directory",
        ("--save", str(a_file / "run")): f"--save {a_file / 'run'}: {a_file} is a file, not a",
        ("--metrics-path", str(a_directory)): f"--metrics-path {a_directory}: is a directory",
        ("--save-hf", "/proc/hf"): "--save-hf /proc/hf: cannot create it in /proc (",
        ("--data-cache-path", str(a_file)): f"--data-cache-path {a_file}: is a file;",
    }
    for (flag, path), message in refused.items():
        extra = [flag, path] + (["--hf-model-type", "llama"] if flag == "--save-hf" else [])
        with pytest.raises(ArgumentsError) as error:
            check_outputs(config(*extra))
        assert str(error.value).startswith(message), (flag, str(error.value))
    # --tensorboard-dir too (the flag needs the tensorboard package: a stand-in module here)
    stand_in = {"tensorboard": types.ModuleType("tensorboard")}
    refused_board = pytest.raises(ArgumentsError, match=f"--tensorboard-dir {a_file}: is a file;")
    with mock.patch.dict(sys.modules, stand_in), refused_board:
        check_outputs(config("--tensorboard-dir", str(a_file)))
    # the default metrics file is checked where it goes: in --save
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").mkdir()
    with pytest.raises(ArgumentsError, match=r"--metrics-path .*run/metrics.jsonl: is a dir"):
        check_outputs(config("--save", str(tmp_path / "run")))
    # places that can be made are accepted, and neither they nor a probe are left behind
    check_outputs(config("--save", str(tmp_path / "new" / "run"), "--metrics-path", str(a_file)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_directory", "a_file", "run"]


def test_a_model_is_refused_when_its_state_exceeds_the_free_memory(monkeypatch):
    """The bar is the model's weights, gradients and two Adam moments in fp32 (16 bytes a
    parameter), for every process of the machine on CPU. The 2-layer, 64-wide GPT on 257
    byte tokens (padded to 384 rows) has 384·64 + 16·64 + 2·(12·64² + 13·64) + 2·64
    parameters."""
    parameters = 384 * 64 + 16 * 64 + 2 * (12 * 64**2 + 13 * 64) + 2 * 64
    small = config("--hidden-size", "64", world_size=2)  # two data-parallel replicas
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    for processes in (1, 2):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(processes))
        needed = 16 * parameters * processes
        monkeypatch.setattr(initialize, "available_bytes", lambda device, n=needed: n)
        check_memory(small, 257)
        monkeypatch.setattr(initialize, "available_bytes", lambda device, n=needed: n - 1)
        with pytest.raises(ArgumentsError, match="the model does not fit in memory: "):
            check_memory(small, 257)
    monkeypatch.setattr(initialize, "available_bytes", lambda device: 20 * 2**30)
    with pytest.raises(ArgumentsError) as error:
        check_memory(config("--hidden-size", "65536"), 257)
    assert re.search(r"need 1536\.\d GiB but this machine has 20\.0 GiB free", str(error.value))


def test_an_allocation_that_fails_while_building_is_one_line():
    building = refusing_out_of_memory(torch.device("cpu"), "building the model")
    with pytest.raises(ArgumentsError) as error, building:  # one pebibyte: refused at once
        torch.empty(2**50, dtype=torch.uint8)
    message = str(error.value)
    assert message.startswith("out of memory building the model (") and "\n" not in message
    assert re.search(r"; this machine has \d+\.\d GiB free; split the model", message)
    building = refusing_out_of_memory(torch.device("cpu"), "building the model")
    with pytest.raises(RuntimeError, match="something else"), building:  # other errors pass
        raise RuntimeError("something else")


def test_a_start_up_wait_that_times_out_names_the_flag(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    short = config("--distributed-timeout-minutes", "0.001")
    joining = start_up_timeout(short, "the other ranks to join")
    with pytest.raises(ArgumentsError) as error, joining:
        raise dist.DistStoreError("wait timeout after 60ms, keys: /default_pg/0//cpu//0/0")
    assert str(error.value).startswith(
        "--distributed-timeout-minutes 0.001 (0.060 s) is too short for start-up: rank 1 gave "
        "up after 0.000 s waiting for the other ranks to join; raise"
    )
    joining = start_up_timeout(short, "the other ranks to join")
    with pytest.raises(RuntimeError, match="Connection closed by peer"), joining:  # a dead peer
        raise RuntimeError("Connection closed by peer")


def test_the_first_process_of_a_node_to_fail_reports_and_no_other(tmp_path, monkeypatch, capsys):
    """Under torchrun, whichever process of the node fails first says why at once (here
    local rank 1, before local rank 0 got there); the node's later ones stay silent, and so
    does a rank whose collective then fails for it."""
    monkeypatch.setattr(arguments, "ERROR_GRACE_S", 0.0)
    attempt = tmp_path / "run" / "attempt_0"
    for local_rank in ("1", "0"):
        (attempt / local_rank).mkdir(parents=True)
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(attempt / local_rank / "error.json"))
        with pytest.raises(SystemExit) as exit:
            arguments.exit_with_error("pretrain_gpt.py", ArgumentsError(f"from {local_rank}"))
        assert exit.value.code == 2
    assert capsys.readouterr().err == "pretrain_gpt.py: error: from 1\n"
    monkeypatch.setattr(os, "_exit", lambda status: None)
    arguments.exit_after_failure("pretrain_gpt.py", RuntimeError("a peer left"))
    assert capsys.readouterr().err == ""
