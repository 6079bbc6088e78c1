"""Measure this machine and fit the time model's constants to it.

``python -m megapp.planning.calibrate --nproc 8 --out runs/calibration/hardware.json`` (or
``python -m megapp.plan --calibrate``) trains a small GPT for a few iterations under two
layouts with ``torchrun --nproc-per-node N pretrain_gpt.py --profile-iteration K``, at the
process count the plans are for (on a CPU machine with fewer cores than processes the
measured rates include the oversubscription; ``OMP_NUM_THREADS=1`` keeps every process on
one thread). From each profile record it takes every rank's action times and fits, by
non-negative least squares over all of them
(:func:`~megapp.planning.calibration_fit.fit_actions`)::

    seconds = FLOPs / rate + action_overhead + layers · layer_overhead
              + tp_bytes / bandwidth + tp_steps · latency + loss_bytes / memory_bandwidth

where ``tp_bytes`` and ``tp_steps`` are the bytes a ring moves and the ring steps of the
action's tensor-parallel collectives as :mod:`~megapp.planning.timing` counts them (so the
same bandwidth and latency also price pipeline messages and data-parallel reductions).
A fixed cost per pipeline message, ``message_overhead``, is then set so that the simulated
pipelines span what the measured ones did (on an oversubscribed CPU a message waits for
its receiver to be scheduled), and what the iteration spends beyond the pipeline, the
modelled reductions and the optimizer step becomes ``step_overhead`` (the mean residual).
The profile written has sends that finish in the background and no overlap of
communication with compute, as gloo runs on a CPU. ``--check`` then runs other layouts
and prints how far their measured iterations are from the prediction.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from megapp.planning.calibration_fit import (
    Measurement,
    fit_actions,
    fit_hardware,
    memory_bandwidth,
    nonnegative_least_squares,
)
from megapp.planning.hardware import Hardware
from megapp.planning.layout import Layout, pretrain_config
from megapp.planning.models import MODELS
from megapp.planning.timing import predict_step_time
from megapp.training.iteration_profile import plain_iteration_seconds

__all__ = [  # the fit's names too, for callers of one module
    "Measurement",
    "calibrate",
    "fit_actions",
    "fit_hardware",
    "nonnegative_least_squares",
    "run_profile",
]

MODEL = MODELS["tiny"].flags
"""The CPU demo's model (byte tokens)."""
VOCAB = MODELS["tiny"].vocab_size
LAYOUTS = (
    Layout(tp=2, pp=2, dp=2, micro_batch_size=4),
    Layout(tp=1, pp=4, dp=2, micro_batch_size=2),
    Layout(tp=1, pp=2, dp=4, micro_batch_size=8),
    Layout(tp=1, pp=1, dp=8, micro_batch_size=4),
    Layout(tp=2, pp=4, dp=1, micro_batch_size=2),
)
"""8-process layouts to fit: with and without tensor parallelism, one and two layers per
stage, micro-batches of 2 to 8 (so FLOPs vary apart from the layer count, and the
tensor-parallel bytes apart from the collectives' count), and data parallelism alone
(so the reduction's bytes vary)."""
CHECKS = (
    Layout(tp=2, pp=1, dp=4, micro_batch_size=2),
    Layout(tp=1, pp=1, dp=8, micro_batch_size=4, zero_stage=1),
    Layout(tp=1, pp=2, dp=4, vpp=2, micro_batch_size=2),
)
"""Layouts the fit never saw, to check its predictions against."""
GLOBAL_BATCH = 32


def run_profile(
    layout: Layout, nproc: int, workdir: Path, iteration: int = 3, plain: int = 5
) -> Measurement:
    """Train :data:`MODEL` under ``layout`` on ``nproc`` processes, profiling iteration
    ``iteration`` (and measuring memory in the next), then ``plain`` more iterations; the
    profile record it wrote and the median of its plain iterations' times."""
    workdir.mkdir(parents=True, exist_ok=True)
    metrics = workdir / f"{layout.name}.jsonl"
    metrics.unlink(missing_ok=True)
    flags = [*MODEL, *layout.flags(4), "--global-batch-size", str(GLOBAL_BATCH)]
    iterations = iteration + plain
    flags += ["--lr", "1e-4", "--train-iters", str(iterations), "--use-default-corpus"]
    flags += ["--log-interval", "1", "--eval-iters", "0", "--metrics-path", str(metrics)]
    flags += ["--profile-iteration", str(iteration)]
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    cmd += [str(root / "pretrain_gpt.py"), *flags]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"calibration run {layout.name} failed: {tail[0]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    profile = next((r for r in records if r.get("kind") == "profile"), None)
    if profile is None:
        raise RuntimeError(f"calibration run {layout.name} wrote no profile record")
    steady = plain_iteration_seconds(records, iteration)
    timed = [
        r["elapsed_ms_per_iteration"] / 1e3
        for r in records
        if r.get("kind") == "train" and r["iteration"] == iteration
    ]
    config = pretrain_config(layout, MODEL, GLOBAL_BATCH)
    median = statistics.median(steady) if steady else None
    return Measurement(config, VOCAB, profile, median, timed[0] if timed else None)


def calibrate(
    nproc: int,
    out: str | Path,
    layouts: Sequence[Layout] = LAYOUTS,
    checks: Sequence[Layout] = (),
    verbose: bool = True,
) -> Hardware:
    """Measure ``layouts`` on ``nproc`` processes, fit, write the profile to ``out``; then
    measure ``checks`` and print their predicted against measured iteration times."""
    workdir = Path(out).parent
    measurements = [run_profile(_resize(layout, nproc), nproc, workdir) for layout in layouts]
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / nproc
    # The loss's passes are too small a part of an action to pin the memory bandwidth down.
    bandwidth = memory_bandwidth(nproc)
    cores = len(os.sched_getaffinity(0))
    hardware = fit_hardware(
        measurements, f"cpu-{nproc}proc", memory, memory_bandwidth=bandwidth, shared_cores=cores
    )
    hardware.save(out)
    if verbose:
        print(f"wrote {out}")
        for m in measurements:
            _report("fitted", m, hardware)
        for layout in checks:
            _report("checked", run_profile(_resize(layout, nproc), nproc, workdir), hardware)
    return hardware


def _report(what: str, m: Measurement, hardware: Hardware) -> None:
    predicted = predict_step_time(m.config, m.vocab_size, hardware).seconds
    measured = m.seconds
    print(
        f"{what} {m.config.schedule.name} {_label(m)}: measured {measured:.3f} s, "
        f"predicted {predicted:.3f} s ({100 * (predicted / measured - 1):+.1f}%)"
    )


def _label(m: Measurement) -> str:
    tp, pp = (
        m.config.parallel.tensor_model_parallel_size,
        m.config.parallel.pipeline_model_parallel_size,
    )
    return f"tp{tp} pp{pp} dp{m.config.data_parallel_size}"


def _resize(layout: Layout, nproc: int) -> Layout:
    """``layout`` with its data-parallel size changed to fill ``nproc`` processes."""
    model_parallel = layout.tp * layout.pp
    if layout.world_size == nproc:
        return layout
    if nproc % model_parallel:
        raise ValueError(f"{nproc} processes do not hold tp {layout.tp} × pp {layout.pp}")
    return dataclasses.replace(layout, dp=nproc // model_parallel)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megapp.planning.calibrate")
    parser.add_argument("--nproc", type=int, default=8, help="processes, as the plans use")
    parser.add_argument("--out", default="runs/calibration/hardware.json")
    parser.add_argument("--check", action="store_true", help="also time layouts not fitted")
    args = parser.parse_args(argv)
    try:
        calibrate(args.nproc, args.out, checks=CHECKS if args.check else ())
    except (RuntimeError, ValueError) as error:
        print(f"python -m megapp.planning.calibrate: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
