"""One command for a GPU machine: build, test and measure megapp's CUDA paths, write one report.

``tools/gpu_check.sh`` runs it (``python -m megapp.benchmarks.gpu_check``) from the checkout:

    tools/gpu_check.sh                      # on a GPU: docs/gpu_check.md + docs/img/gpu_check.json
    tools/gpu_check.sh --markdown /tmp/c.md --json /tmp/c.json --logs /tmp/logs
    tools/gpu_check.sh --quick --stages env tests kernels gpt nccl   # every stage shrunk

Stages, in order, each a subprocess with its own time limit (``--limit STAGE=SECONDS``) inside
an overall budget (``--total-s``, 9 minutes); a stage that fails or runs out of time is
recorded with the end of its output and the next stage runs:

* ``env``: Python, torch, CUDA, nvcc, ninja, the GPUs and their peaks (megapp.training.flops);
* ``build``: ``MEGAPP_BUILD_CUDA=1 pip install --no-build-isolation --no-deps -e .``, then
  which compiled tiers load;
* ``calibrate``: ``python -m megapp.planning.calibrate --device cuda``: the device's matmul,
  attention and memory-bound rates as a hardware profile;
* ``step``: ``python -m megapp.benchmarks.predicted_step``: single-GPU training steps of a
  1.2B GPT and a 1.0B Llama-style model, measured and predicted on that profile;
* ``overlap``: ``python -m megapp.benchmarks.overlap_matmuls``: the matmuls of
  ``--tp-comm-overlap`` (in pieces, beside held-back multiprocessors) of Megatron-Core's
  H100 layers, measured and predicted on the step stage's profile;
* ``tests``: ``pytest -m cuda`` over the test files that mark CUDA tests;
* ``kernels``: ``tools/benchmarks/bench_kernels.py --device cuda``: GB/s of every fused op
  against the device's HBM peak;
* ``gpt``: ``tools/benchmarks/bench_gpt.py --device cuda``: TFLOP/s and MFU of the 125M GPT in
  bf16;
* ``nccl``: with 2 or more GPUs, ``pretrain_gpt.py`` under torchrun on NCCL, tensor parallel 2
  (sequence parallel, then with ``--tp-comm-overlap``) and pipeline parallel 2, a few
  iterations each.

Without a CUDA device every GPU stage is skipped with one line saying why, and the report goes
to ``$TMPDIR/megapp_gpu_check/`` unless a path is given, so a CPU run never overwrites the
GPU report in docs/. The exit status is 1 when a stage failed or ran out of time.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from megapp.benchmarks.common import ROOT, command_line, machine, source_state, write_json
from megapp.benchmarks.gpu_report import markdown_report
from megapp.benchmarks.gpu_stages import (
    LIMITS_S,
    Check,
    StageResult,
    cuda_test_files,
    stage_build,
    stage_calibrate,
    stage_env,
    stage_gpt,
    stage_kernels,
    stage_nccl,
    stage_overlap,
    stage_step,
    stage_tests,
)
from megapp.benchmarks.step_models import STEP_MODELS

STAGES = ("env", "build", "calibrate", "step", "overlap", "tests", "kernels", "gpt", "nccl")
REPORT_RESERVE_S = 15  # kept back from --total-s to write the report
CPU_OUT = Path(tempfile.gettempdir()) / "megapp_gpu_check"  # where a run without a GPU reports


def skip_reason(name: str, check: Check) -> str | None:
    """Why a stage cannot run on this machine, or None."""
    if name == "env":
        return None
    if name == "nccl" and check.args.nccl_backend == "gloo":
        return None  # the multi-rank smoke run on CPU processes, to check this script
    if not check.gpus:
        why = f"no CUDA device (torch {torch.__version__}, CUDA {torch.version.cuda})"
        if name == "tests":
            files = cuda_test_files()
            marks = sum((ROOT / f).read_text().count("@pytest.mark.cuda") for f in files)
            why += f"; {marks} CUDA-marked tests in {len(files)} files not run"
        return why
    if name == "nccl" and len(check.gpus) < 2:
        return f"{len(check.gpus)} GPU: the NCCL smoke run needs 2 or more"
    return None


RUNNERS: dict[str, Callable[[Check, StageResult], None]] = {
    "env": stage_env,
    "build": stage_build,
    "calibrate": stage_calibrate,
    "step": stage_step,
    "overlap": stage_overlap,
    "tests": stage_tests,
    "kernels": stage_kernels,
    "gpt": stage_gpt,
    "nccl": stage_nccl,
}


def run_stage(check: Check, name: str) -> StageResult:
    """One stage: skipped with its reason, or run within its limit; never raises."""
    r = StageResult(name)
    reason = skip_reason(name, check)
    if reason is not None:
        r.summary = reason
        return r
    left = check.deadline - time.monotonic()
    if left < 5:
        r.summary = f"no time left in the --total-s budget ({check.args.total_s:g} s)"
        return r
    r.limit_s = min(check.args.limits.get(name, LIMITS_S[name]), left)
    r.status = "running"
    try:
        RUNNERS[name](check, r)
    except Exception as err:  # a stage's own bug or an unreadable output: record it, go on
        r.status, r.summary = "failed", f"{type(err).__name__}: {err}"
    if r.status == "running":
        r.status = "failed"
    return r


# ----- entry ------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check.sh", description=__doc__.splitlines()[0])
    p.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    p.add_argument("--quick", action="store_true", help="shrink every stage (tests, a smoke run)")
    p.add_argument("--total-s", type=float, default=540.0, help="budget of the whole run")
    p.add_argument("--limit", action="append", default=[], metavar="STAGE=SECONDS",
                   help=f"a stage's own time limit (defaults: {LIMITS_S})")  # fmt: skip
    p.add_argument("--step-models", nargs="+", choices=list(STEP_MODELS), metavar="NAME",
                   help="the steps the step stage runs (default: all)")  # fmt: skip
    p.add_argument("--profile", metavar="NAME_OR_JSON",
                   help="the profile the step stage predicts with where the calibrate stage "
                   "does not run (default: the GPU's built-in profile)")  # fmt: skip
    p.add_argument("--markdown", help="report (default: docs/gpu_check.md on a GPU)")
    p.add_argument("--json", help="figures (default: docs/img/gpu_check.json on a GPU)")
    p.add_argument("--logs", help="every command's full output (default: a temporary folder)")
    p.add_argument("--nccl-backend", choices=("nccl", "gloo"), default="nccl",
                   help="gloo runs the multi-rank smoke run on CPU processes: a check of this "
                   "script where no GPU is")  # fmt: skip
    args = p.parse_args(argv)
    args.limits = {}
    for text in args.limit:
        name, _, seconds = text.partition("=")
        if name not in STAGES or not re.fullmatch(r"\d+(\.\d*)?", seconds):
            p.error(f"--limit takes STAGE=SECONDS with a stage of {', '.join(STAGES)}: {text!r}")
        args.limits[name] = float(seconds)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started, wall = time.monotonic(), time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    on_gpu = bool(gpus)
    home = {"md": ROOT / "docs", "json": ROOT / "docs" / "img"} if on_gpu else {}
    markdown = Path(args.markdown or home.get("md", CPU_OUT) / "gpu_check.md")
    figures = Path(args.json or home.get("json", CPU_OUT) / "gpu_check.json")
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="megapp_gpu_check_"))
    logs.mkdir(parents=True, exist_ok=True)
    check = Check(args, logs, started + args.total_s - REPORT_RESERVE_S, gpus)
    print(f"$ {command_line()}\nlogs: {logs}", flush=True)
    results = []
    for name in STAGES:
        if name not in args.stages:
            continue
        r = run_stage(check, name)
        results.append(r)
        print(f"{name:8s} {r.status:8s} {r.seconds:6.1f} s  {r.summary}", flush=True)
    report = {
        "command": command_line(),
        "started": wall,
        "seconds": time.monotonic() - started,
        "machine": machine(),
        "sources": source_state(("megapp", "csrc", "tools", "tests", "setup.py")),
        "gpus": gpus,
        "logs": str(logs),
        "stages": [asdict(r) for r in results],
    }
    write_json(figures, report)
    markdown.parent.mkdir(parents=True, exist_ok=True)
    markdown.write_text(markdown_report(report, figures))
    print(f"wrote {markdown} and {figures} ({report['seconds']:.0f} s)")
    return 1 if any(r.status in ("failed", "timeout") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
