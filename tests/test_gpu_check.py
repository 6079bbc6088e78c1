"""The GPU check (tools/gpu_check.sh over megapp.benchmarks.gpu_check) end to end with every
stage shrunk: without a GPU each GPU stage is skipped with its reason and the report is still
written where the caller says; a stage that fails, hangs past its limit or raises is recorded
with its output and the next stage runs; the multi-rank smoke run's command works (on gloo,
where no GPU is)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megapp.benchmarks import gpu_check
from megapp.benchmarks.gpu_stages import Check, StageResult, cuda_toolkit, step_profile

ROOT = Path(__file__).resolve().parents[1]

GPU_STAGES = ("calibrate", "step", "overlap", "tests", "kernels", "gpt", "nccl")


def running(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie waiting to be reaped does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def run_tool(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict, str]:
    md, js = tmp_path / "check.md", tmp_path / "check.json"
    command = [str(ROOT / "tools" / "gpu_check.sh"), "--quick", "--markdown", str(md)]
    command += ["--json", str(js), "--logs", str(tmp_path / "logs"), *extra]
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    return done, json.loads(js.read_text()), md.read_text()


@pytest.mark.slow  # runs tools/gpu_check.sh
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without a GPU does")
def test_without_a_gpu_every_gpu_stage_is_skipped_and_the_report_written(tmp_path):
    done, report, page = run_tool(tmp_path, "--stages", "env", *GPU_STAGES)
    assert done.returncode == 0, done.stdout + done.stderr
    stages = {s["name"]: s for s in report["stages"]}
    assert list(stages) == ["env", *GPU_STAGES]
    assert stages["env"]["status"] == "ok" and "no CUDA device" in stages["env"]["summary"]
    for name in GPU_STAGES:
        assert stages[name]["status"] == "skipped"
        assert stages[name]["summary"].startswith("no CUDA device")
        assert f"\n{name} " in done.stdout  # one line per stage
    assert "CUDA-marked tests in" in stages["tests"]["summary"]
    assert report["gpus"] == [] and report["command"].startswith("python ")
    assert re.search(r"\| tests +\| skipped +\|", page)


@pytest.mark.slow
def test_the_smoke_run_command_trains_on_gloo(tmp_path):
    done, report, page = run_tool(tmp_path, "--stages", "nccl", "--nccl-backend", "gloo")
    assert done.returncode == 0, done.stdout + done.stderr
    (stage,) = report["stages"]
    assert stage["status"] == "ok", stage
    for name in ("tp 2", "tp 2 overlapped"):
        assert stage["details"][name]["iteration"] == 2
        assert 0 < stage["details"][name]["lm_loss"] < 10
    # the rings reassociate the tp partial sums only: the same loss to round-off
    loss = stage["details"]["tp 2"]["lm_loss"]
    assert stage["details"]["tp 2 overlapped"]["lm_loss"] == pytest.approx(loss, rel=1e-4)
    assert "## NCCL smoke run" in page


@pytest.mark.slow  # waits out a hung stage
def test_failed_hung_and_broken_stages_are_recorded_and_the_next_runs(tmp_path, monkeypatch):
    python = sys.executable

    def fails(check, r):
        check.run(r, [python, "-c", "print('about to fail'); raise SystemExit(3)"], "a.log")

    rank = tmp_path / "hung.pid"  # a process the hung command started

    def hangs(check, r):
        waits = f"sleep 60 & echo $! > {rank}.part; mv {rank}.part {rank}; echo waiting; wait"
        check.run(r, ["sh", "-c", waits], "b.log")

    def raises(check, r):
        raise ValueError("unreadable output")

    def works(check, r):
        if check.run(r, [python, "-c", "print('fine')"], "d.log") == 0:
            r.status, r.summary = "ok", "fine"

    fakes = dict(env=fails, build=hangs, tests=raises, kernels=works)
    monkeypatch.setattr(gpu_check, "RUNNERS", fakes)
    monkeypatch.setattr(gpu_check, "skip_reason", lambda name, check: None)
    md, js = tmp_path / "c.md", tmp_path / "c.json"
    code = gpu_check.main(
        ["--stages", *fakes, "--limit", "build=2", "--markdown", str(md), "--json", str(js),
         "--logs", str(tmp_path / "logs")]
    )  # fmt: skip
    assert code == 1
    assert not running(int(rank.read_text()))  # the hung stage's whole group was stopped
    stages = {s["name"]: s for s in json.loads(js.read_text())["stages"]}
    assert stages["env"]["status"] == "failed" and "about to fail" in stages["env"]["tail"]
    assert stages["env"]["summary"] == "exit status 3 (a.log)"
    assert stages["build"]["status"] == "timeout" and "waiting" in stages["build"]["tail"]
    assert stages["build"]["limit_s"] == 2 and stages["build"]["summary"] == "out of 2 s (b.log)"
    assert stages["tests"]["status"] == "failed"
    assert stages["tests"]["summary"] == "ValueError: unreadable output"
    assert stages["kernels"]["status"] == "ok"
    page = md.read_text()
    assert "### env (failed)" in page and "### build (timeout)" in page


def test_limits_are_checked_on_the_command_line():
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--limit", "kernel=10"])
    assert gpu_check.parse_args(["--limit", "gpt=90"]).limits == {"gpt": 90.0}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_build_finds_the_toolkit_nvcc_runs_from(tmp_path):
    args = gpu_check.parse_args(["--quick"])
    check = Check(args, tmp_path, time.monotonic() + 120, [])
    result = StageResult("build", status="running", limit_s=60)
    toolkit = Path(cuda_toolkit(check, result))
    assert (toolkit / "bin" / "nvcc").is_file() and (toolkit / "include" / "cuda.h").is_file()
    assert result.status == "running"  # nothing failed


def test_the_step_stage_predicts_on_the_calibration_else_the_profile_given_else_the_gpus(
    tmp_path,
):
    def chosen(argv: list[str], gpus: list[str]) -> str:
        return step_profile(Check(gpu_check.parse_args(argv), tmp_path, 0.0, gpus))

    assert chosen([], ["NVIDIA H200"]) == "h200"
    assert chosen([], ["NVIDIA H100 80GB HBM3"]) == "h100"
    assert chosen([], []) == "h100"  # none to name: the default profile
    assert chosen(["--profile", "a100"], ["NVIDIA H200"]) == "a100"
    (tmp_path / "profile.json").write_text("{}")  # the calibrate stage wrote one
    assert chosen(["--profile", "a100"], ["NVIDIA H200"]) == str(tmp_path / "profile.json")
