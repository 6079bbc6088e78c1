"""The stages of the GPU check (:mod:`megapp.benchmarks.gpu_check`): each runs its commands
through :meth:`Check.run`, within its time limit, and fills one :class:`StageResult` (status,
a one-line summary, figures)."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from megapp.benchmarks.common import ROOT, fmt
from megapp.benchmarks.step_models import STEP_MODELS, STEP_QUICK, argv_flags
from megapp.planning.calibrate import BUILTIN_OF_PART
from megapp.training.flops import GpuPeak, gpu_peak
from megapp.training.launch import finish, start_command, torchrun_command
from megapp.training.metrics import read_records

LIMITS_S = {"env": 60, "build": 300, "calibrate": 180, "step": 240, "tests": 180, "kernels": 240}
LIMITS_S |= {"gpt": 180, "nccl": 150, "overlap": 120}
TAIL_LINES = 40  # of a failed command's output, in the report


@dataclass
class StageResult:
    """What one stage did: ``status`` is ok, failed, timeout or skipped."""

    name: str
    status: str = "skipped"
    summary: str = ""
    seconds: float = 0.0
    limit_s: float | None = None
    commands: list[str] = field(default_factory=list)
    details: dict = field(default_factory=dict)
    tail: str = ""  # the end of the output of a command that did not succeed


@dataclass
class Check:
    """The run's settings and what the machine offers, shared by the stages."""

    args: argparse.Namespace  # quick, limits (stage -> s), nccl_backend, step_models, profile
    logs: Path  # every command's whole output
    deadline: float  # time.monotonic() by which every stage must have ended
    gpus: list[str]  # torch.cuda.get_device_name() of each visible device

    def run(self, r: StageResult, argv: list[str], log: str, **env: str) -> int | None:
        """Run ``argv`` from the repository root within what is left of the stage's limit,
        its output to ``logs/<log>`` after its command line. Returns the exit status, or None
        when it ran out of time (its whole process group is then stopped); either failure
        sets the stage's status."""
        r.commands.append(" ".join(argv))
        started = start_command(argv, cwd=ROOT, log_path=self.logs / log, env={**os.environ, **env})
        done = finish(started, max(r.limit_s - r.seconds, 0.01))
        r.seconds += done.seconds
        if done.returncode != 0:
            lines = (self.logs / log).read_text(errors="replace").splitlines()
            r.tail = "\n".join(lines[-TAIL_LINES:])
            r.status = "timeout" if done.timed_out else "failed"
            r.summary = (
                f"out of {r.limit_s:.0f} s" if done.timed_out else f"exit status {done.returncode}"
            )
            r.summary += f" ({log})"
        return done.returncode

    def output(self, log: str) -> list[str]:
        """The lines a command wrote to ``logs/<log>``, without the command line above them."""
        lines = (self.logs / log).read_text(errors="replace").splitlines()
        return lines[1:] if lines and lines[0].startswith("$ ") else lines


def describe_peak(peak: GpuPeak | None) -> str:
    if peak is None:
        return "peaks unknown"
    hbm = "HBM unknown" if peak.hbm_tbps is None else f"HBM {peak.hbm_tbps:g} TB/s"
    return f"{peak.part}: {peak.dense_16bit_tflops:g} TFLOP/s 16-bit dense, {hbm}"


def stage_env(check: Check, r: StageResult) -> None:
    """Python, torch, CUDA, the GPUs and their peaks, nvidia-smi, nvcc, ninja."""
    peaks = [gpu_peak(name) for name in check.gpus]
    r.details = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "gpus": [
            {"name": name, "peak": asdict(peak) if peak else None}
            for name, peak in zip(check.gpus, peaks, strict=True)
        ],
        "ninja": shutil.which("ninja") is not None,
    }
    for tool, argv in (("nvidia_smi", ["nvidia-smi", "-L"]), ("nvcc", ["nvcc", "--version"])):
        if shutil.which(argv[0]) and check.run(r, argv, f"env_{tool}.log") == 0:
            lines = [line for line in check.output(f"env_{tool}.log") if line.strip()]
            release = [line for line in lines if "release" in line]  # nvcc's version line
            r.details[tool] = (release or lines)[-1] if tool == "nvcc" else lines
    if r.status != "running":
        return
    r.status = "ok"
    gpus = ", ".join(
        f"{name} ({describe_peak(peak)})" for name, peak in zip(check.gpus, peaks, strict=True)
    )
    nvcc = r.details.get("nvcc", "nvcc not found")
    ninja = "ninja found" if r.details["ninja"] else "no ninja (the build compiles serially)"
    cuda = f"CUDA {torch.version.cuda}"
    r.summary = f"{gpus or 'no CUDA device'}; torch {torch.__version__} ({cuda}); {nvcc}; {ninja}"


def cuda_toolkit(check: Check, r: StageResult) -> str | None:
    """The toolkit that ``nvcc`` really runs from (its ``TOP`` in a dry run), or None.

    torch guesses CUDA_HOME as the folder above the first ``nvcc`` on the PATH, which is wrong
    when that ``nvcc`` is a wrapper script (``/usr/local/bin/nvcc`` on these machines)."""
    if shutil.which("nvcc") is None:
        return None
    empty = check.logs / "empty.cu"
    empty.write_text("")
    argv = ["nvcc", "--dryrun", "-c", str(empty), "-o", str(check.logs / "empty.o")]
    if check.run(r, argv, "build_nvcc_dryrun.log") != 0:
        r.status, r.summary, r.tail = "running", "", ""  # only a guess failed: torch's own then
        return None
    top = re.search(r"TOP=(\S+)", "\n".join(check.output("build_nvcc_dryrun.log")))
    return os.path.realpath(top.group(1)) if top else None


def stage_build(check: Check, r: StageResult) -> None:
    """The CUDA extension against the installed torch, then the compiled tiers that load."""
    env = {"MEGAPP_BUILD_CUDA": "1"}
    if "CUDA_HOME" not in os.environ:
        toolkit = cuda_toolkit(check, r)
        if toolkit is not None:
            env["CUDA_HOME"] = r.details["cuda_home"] = toolkit
    argv = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "-e", "."]
    if check.run(r, argv, "build.log", **env) != 0:
        return
    probe = "from megapp.fusions import extension; print(sorted(extension.built_tiers()))"
    if check.run(r, [sys.executable, "-c", probe], "build_tiers.log") != 0:
        return
    tiers = [line for line in check.output("build_tiers.log") if line.strip()][-1]
    r.details["tiers"] = tiers
    r.status = "ok" if "cuda" in tiers else "failed"
    r.summary = f"built; compiled tiers that load: {tiers}"


def cuda_test_files() -> list[str]:
    """The test files (relative to the repository) that mark CUDA tests."""
    files = sorted((ROOT / "tests").glob("test_*.py"))
    return [str(p.relative_to(ROOT)) for p in files if "@pytest.mark.cuda" in p.read_text()]


def junit_counts(path: Path) -> dict:
    """Passed, failed, errors and skipped counts of a JUnit XML file, and each failure."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": []}
    keys = {"failure": "failed", "error": "errors", "skipped": "skipped"}
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = next((c for c in case if c.tag in keys), None)
        if outcome is None:
            counts["passed"] += 1
            continue
        counts[keys[outcome.tag]] += 1
        if outcome.tag != "skipped":
            message = (outcome.get("message") or "").strip().splitlines()[:1]
            name = f"{case.get('classname')}::{case.get('name')}"
            counts["failures"].append(f"{name}: {message[0] if message else outcome.tag}")
    return counts


def stage_tests(check: Check, r: StageResult) -> None:
    """``pytest -m cuda`` over the files that mark CUDA tests (quick: the first, up to a
    failure)."""
    files = cuda_test_files()[: 1 if check.args.quick else None]
    junit = check.logs / "cuda_tests.xml"
    argv = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider"]
    argv += [f"--junitxml={junit}", *(["-x"] if check.args.quick else []), *files]
    code = check.run(r, argv, "tests.log")
    if junit.exists():
        r.details = junit_counts(junit)
    if code is None:
        return
    n = r.details
    r.status = "ok" if code == 0 and n.get("passed") else "failed"
    r.summary = (
        f"{n.get('passed', 0)} passed, {n.get('failed', 0)} failed, {n.get('errors', 0)} "
        f"errors, {n.get('skipped', 0)} skipped, in {len(files)} files"
    )


def stage_kernels(check: Check, r: StageResult) -> None:
    """``tools/benchmarks/bench_kernels.py --device cuda``; each cell's GB/s against the HBM
    peak."""
    out = check.logs / "kernels.json"
    argv = [
        sys.executable,
        "tools/benchmarks/bench_kernels.py",
        "--device",
        "cuda",
        "--compile",
        "off",
    ]
    argv += ["--budget-s", "1", "--json", str(out)]
    if check.args.quick:
        argv += ["--ops", "bias_gelu", "--dtypes", "bf16", "--passes", "fwd", "--budget-s", "0.2"]
        argv += ["--min-repeats", "3", "--repeats", "5"]
    if check.run(r, argv, "kernels.log") != 0:
        return
    device = json.loads(out.read_text())["devices"]["cuda"]
    keys = ("op", "dtype", "pass", "gbps", "hbm_pct")
    rows = [{k: row[k] for k in keys} for row in device["rows"]]
    peak = device["hbm_peak_tbps"]
    r.details = {"device": device["device"], "hbm_peak_tbps": peak, "rows": rows}
    r.status = "ok"
    shares = sorted(row["hbm_pct"] for row in rows if row["hbm_pct"] is not None)
    if not shares:
        r.summary = f"{len(rows)} cells timed; no HBM peak known for {device['device']}"
        return
    r.summary = (
        f"{len(rows)} cells: {shares[len(shares) // 2]:.0f}% of the {peak:g} TB/s HBM peak at "
        f"the median ({shares[0]:.0f} to {shares[-1]:.0f}%), {sum(s >= 85 for s in shares)} "
        "at 85% or more"
    )


def stage_calibrate(check: Check, r: StageResult) -> None:
    """``python -m megapp.planning.calibrate --device cuda``: the device's matmul, attention
    and memory-bound rates, written as a hardware profile (``profile.json`` in the logs)."""
    out, figures = check.logs / "profile.json", check.logs / "calibration.json"
    argv = [sys.executable, "-m", "megapp.planning.calibrate", "--device", "cuda"]
    argv += ["--out", str(out), "--measurements", str(figures)]
    argv += ["--quick"] if check.args.quick else []
    if check.run(r, argv, "calibrate.log") != 0:
        return
    ops = json.loads(out.read_text())["ops"]
    fit = json.loads(figures.read_text())["fit"]
    r.details = {"ops": ops, "fit": fit}
    r.status = "ok"
    attention = ", ".join(
        f"{a['forward_flops'] / 1e12:.0f}/{a['backward_flops'] / 1e12:.0f} at d {a['head_dim']}"
        for a in ops["attention"]
    )
    r.summary = (
        f"matmul {ops['matmul_flops'] / 1e12:.0f} TFLOP/s in full waves (tile "
        f"{'x'.join(map(str, ops['tile']))}, grid within {fit['matmul']['mean_error']:.1%} "
        f"mean); attention TFLOP/s forward/backward {attention}; memory-bound median "
        f"{ops['memory_bandwidth'] / 1e12:.2f} TB/s; {ops['kernel_overhead'] * 1e6:.1f} us per "
        f"kernel on the device, {ops['launch_overhead'] * 1e6:.1f} us to launch"
    )


def step_profile(check: Check) -> str:
    """The profile the step stage predicts with: the one the calibrate stage wrote, else
    ``--profile``, else the built-in profile of the GPU's part (h100 where none matches)."""
    calibrated = check.logs / "profile.json"
    if calibrated.exists():
        return str(calibrated)
    if check.args.profile:
        return check.args.profile
    row = gpu_peak(check.gpus[0]) if check.gpus else None
    return BUILTIN_OF_PART.get(row.part, "h100") if row is not None else "h100"


def stage_step(check: Check, r: StageResult) -> None:
    """``python -m megapp.benchmarks.predicted_step``: a single-GPU training step of each
    :data:`STEP_MODELS` measured and predicted on the calibrated profile (else
    :func:`step_profile`'s). Quick: one small GPT."""
    hardware = step_profile(check)
    chosen = check.args.step_models or list(STEP_MODELS)
    models = {"quick": STEP_QUICK} if check.args.quick else {n: STEP_MODELS[n] for n in chosen}
    failed = False
    for name, model in models.items():
        stem = "step_" + re.sub(r"[^a-z0-9]+", "_", name).strip("_")
        out = check.logs / f"{stem}.json"
        argv = [sys.executable, "-m", "megapp.benchmarks.predicted_step", "--hardware", hardware]
        argv += ["--out", str(out), "--log", str(check.logs / f"{stem}_job.log"), "--"]
        argv += argv_flags(name, model)
        code = check.run(r, argv, f"{stem}.log")
        if code is None:
            break
        r.details[name] = {}
        if code == 0:
            report = json.loads(out.read_text())
            keep = ("measured_s", "predicted_s", "ratio", "times_s", "breakdown", "layer")
            r.details[name] = {k: report[k] for k in keep}
        failed |= code != 0
        kernels = check.logs / f"{stem}_kernels.json"  # the same step's device time by kind
        argv = [sys.executable, "-m", "megapp.benchmarks.kernel_time", "--out", str(kernels)]
        argv += ["--", *argv_flags(name, model), "--lr", "1e-4"]
        code = check.run(r, argv, f"{stem}_kernels.log")
        if code is None:
            break
        if code == 0:
            k = json.loads(kernels.read_text())
            r.details[name]["kernels"] = {x: k[x] for x in ("wall_s", "kernel_seconds", "heaviest")}
        failed |= code != 0
    if r.status == "timeout":
        return
    r.status = "failed" if failed else "ok"
    r.summary = "; ".join(
        f"{name}: predicted/measured {d['ratio']:.3f} ({d['measured_s'] * 1e3:.0f} ms)"
        for name, d in r.details.items()
        if "ratio" in d
    )


def stage_overlap(check: Check, r: StageResult) -> None:
    """``python -m megapp.benchmarks.overlap_matmuls``: the matmuls of ``--tp-comm-overlap``
    in pieces and beside held-back multiprocessors, measured and predicted on
    :func:`step_profile`'s profile (quick: one small layer)."""
    out = check.logs / "overlap.json"
    argv = [sys.executable, "-m", "megapp.benchmarks.overlap_matmuls", "--out", str(out)]
    argv += ["--hardware", step_profile(check)] + (["--quick"] if check.args.quick else [])
    if check.run(r, argv, "overlap.log") != 0:
        return
    cases = json.loads(out.read_text())["cases"]
    r.details = cases
    r.status = "ok"
    r.summary = "; ".join(
        f"{name}: +{c['extra_s'] * 1e6:.0f} us measured, +{c['predicted_extra_s'] * 1e6:.0f} us "
        f"predicted over {c['alone_s'] * 1e6:.0f} us of matmuls"
        for name, c in cases.items()
    )


def stage_gpt(check: Check, r: StageResult) -> None:
    """``tools/benchmarks/bench_gpt.py --device cuda``: TFLOP/s and MFU (quick: a small
    GPT)."""
    out = check.logs / "bench_gpt.json"
    argv = [sys.executable, "tools/benchmarks/bench_gpt.py", "--device", "cuda"]
    argv += ["--json", str(out)]
    if check.args.quick:
        argv += ["--layers", "2", "--hidden", "256", "--heads", "4", "--seq", "256"]
        argv += ["--vocab", "1024", "--global-batch", "4", "--micro-batch", "2", "--iters", "2"]
        argv += ["--warmup-iters", "1"]
    if check.run(r, argv, "gpt.log") != 0:
        return
    g = json.loads(out.read_text())["gpu"]
    keys = ("device", "dtype", "parameters", "iteration_s", "tokens_per_s", "tflops_per_device")
    keys += ("peak_tflops", "mfu", "max_memory_allocated_gib", "flops_per_iteration")
    r.details = {k: g[k] for k in keys}
    r.status = "ok"
    mfu = "unknown peak" if g["mfu"] is None else f"{g['mfu']:.1%} of {g['peak_tflops']:g}"
    r.summary = (
        f"MFU {mfu} TFLOP/s ({g['tflops_per_device']:.1f} TFLOP/s), "
        f"{g['iteration_s'] * 1e3:.1f} ms per iteration, {g['parameters'] / 1e6:.1f}M parameters"
    )


def stage_nccl(check: Check, r: StageResult) -> None:
    """``pretrain_gpt.py`` on 2 ranks under torchrun: tensor parallel 2 with sequence
    parallelism, the same with ``--tp-comm-overlap``, then pipeline parallel 2 (quick: the
    first two, 2 iterations of a smaller GPT)."""
    layouts = {
        "tp 2": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        "tp 2 overlapped": [
            "--tensor-model-parallel-size", "2", "--sequence-parallel", "--tp-comm-overlap"
        ],
        "pp 2": ["--pipeline-model-parallel-size", "2"],
    }  # fmt: skip
    width = "64" if check.args.quick else "256"  # hidden size and sequence length
    model = ["--num-layers", "2", "--hidden-size", width, "--num-attention-heads", "4"]
    model += ["--seq-length", width, "--micro-batch-size", "2", "--global-batch-size", "8"]
    model += ["--lr", "1e-3", "--train-iters", "2" if check.args.quick else "10"]
    model += ["--log-interval", "1", "--eval-iters", "0", "--use-default-corpus"]
    model += ["--distributed-timeout-minutes", "2", "--distributed-backend"]
    model += [check.args.nccl_backend]
    for name, flags in list(layouts.items())[: 2 if check.args.quick else None]:
        stem = f"nccl_{name.replace(' ', '')}"
        metrics = check.logs / f"{stem}.jsonl"
        metrics.unlink(missing_ok=True)
        argv = torchrun_command(2, [*flags, *model, "--metrics-path", str(metrics)])
        if check.run(r, argv, f"{stem}.log") != 0:
            return
        last = read_records(metrics, "train")[-1]
        r.details[name] = {k: last.get(k) for k in ("iteration", "lm_loss", "tflops_per_device")}
    losses = {name: d["lm_loss"] for name, d in r.details.items()}
    finite = all(loss is not None and math.isfinite(loss) for loss in losses.values())
    r.status = "ok" if finite else "failed"
    shown = ", ".join(f"{name} {fmt(loss, '.4f')}" for name, loss in losses.items())
    r.summary = f"{check.args.nccl_backend}, 2 ranks; last lm loss {shown}"
