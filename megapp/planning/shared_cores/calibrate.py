"""Measure this machine and fit the time model's constants to it.

``python -m megapp.planning.shared_cores.calibrate --nproc 8 --out
runs/calibration/hardware.json`` (or ``python -m megapp.plan --calibrate``) trains a small
GPT (dropout off: the model prices none) for a few iterations under the layouts of
:data:`LAYOUTS` with ``torchrun --nproc-per-node N pretrain_gpt.py --profile-iteration K``
(:func:`~megapp.training.launch.run_pretrain`), at the process count the plans are for,
one thread per process (``OMP_NUM_THREADS=1``). The times a prediction is held to
are the median of each run's plain iterations (neither the first nor the profiled ones),
of its fastest launch with ``--repeats``.

Where the processes outnumber the machine's cores (8 on the 2-core development machine),
they keep the cores busy between them, and
:func:`~megapp.planning.shared_cores.fit_shared.fit_shared_cores` fits the compute rate and the
fixed costs per action, per layer pass and per tensor-parallel collective call to the CPU
time every profiled action took (of every launch), prices the messages at the CPU time
spent on them, and takes the step overhead from whole iterations; :data:`ALONE`, one
process, then measures how much faster a process computes with a core to itself. The
profile written records the cores, and the time model shares them among the processes as
they compute (:mod:`~megapp.planning.shared_cores.simulate`).

With a core per process, :func:`~megapp.planning.shared_cores.fit.fit_own_cores` fits every
profiled action's time instead, by non-negative least squares
(:func:`~megapp.planning.shared_cores.fit.fit_actions`)::

    seconds = FLOPs / rate + action_overhead + layers · layer_overhead
              + tp_bytes / bandwidth + tp_steps · latency + loss_bytes / memory_bandwidth

then the data-parallel reduction's bandwidth, a per-message overhead that makes the
simulated pipelines span what the measured ones did, and the step overhead. Both profiles
have gloo's send model (sends finish in the background) and no overlap of communication
with compute. ``--check`` then runs other layouts and prints how far their measured
iterations are from the prediction.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megapp.planning.layout import Layout, pretrain_config
from megapp.planning.models import MODELS
from megapp.planning.shared_cores.fit import (
    Measurement,
    fit_actions,
    fit_own_cores,
    memory_bandwidth,
    nonnegative_least_squares,
)
from megapp.planning.shared_cores.fit_shared import fit_shared_cores, fit_uncontended_speedup
from megapp.planning.shared_cores.profile import CpuProfile
from megapp.planning.timing import predict
from megapp.training.iteration_profile import plain_iteration_seconds
from megapp.training.launch import run_pretrain
from megapp.training.metrics import read_records

__all__ = [  # the fit's names too, for callers of one module
    "Measurement",
    "Run",
    "calibrate",
    "fit_actions",
    "fit_own_cores",
    "fit_shared_cores",
    "fit_uncontended_speedup",
    "nonnegative_least_squares",
    "run_profile",
]

MODEL = MODELS["tiny"].flags
"""The CPU demo's model (byte tokens)."""
VOCAB = MODELS["tiny"].vocab_size
GLOBAL_BATCH = 32


@dataclass(frozen=True)
class Run:
    """One calibration run: a layout (its data-parallel size filled up to the process
    count) and the global batch it trains."""

    layout: Layout
    global_batch: int = GLOBAL_BATCH

    @property
    def name(self) -> str:
        return f"{self.layout.name}.gbs{self.global_batch}"


LAYOUTS = (
    Run(Layout(tp=2, pp=2, dp=2, micro_batch_size=4)),
    Run(Layout(tp=1, pp=4, dp=2, micro_batch_size=2)),
    Run(Layout(tp=1, pp=2, dp=4, micro_batch_size=8)),
    Run(Layout(tp=1, pp=1, dp=8, micro_batch_size=4)),
    Run(Layout(tp=2, pp=4, dp=1, micro_batch_size=2)),
    Run(Layout(tp=1, pp=2, dp=4, micro_batch_size=4), global_batch=64),
    Run(Layout(tp=2, pp=2, dp=2, vpp=2, micro_batch_size=4)),
    Run(Layout(tp=1, pp=4, dp=2, micro_batch_size=2, schedule="zb-h1")),
)
"""8-process runs to fit: with and without tensor parallelism, one and two layers per
stage, micro-batches of 2 to 8 (so FLOPs vary apart from the count of layer passes, and
the tensor-parallel bytes apart from the collectives' count), data parallelism alone, a
global batch of 64 (so the work of an iteration varies apart from what it costs once),
two chunks per rank (a gradient bucket per chunk: more reductions and pipeline messages
per iteration) and backwards split into ``I`` and ``W`` (more actions for the same
messages and layer passes)."""
CHECKS = (
    Run(Layout(tp=2, pp=1, dp=4, micro_batch_size=2)),
    Run(Layout(tp=1, pp=1, dp=8, micro_batch_size=4, zero_stage=1)),
    Run(Layout(tp=1, pp=2, dp=4, vpp=2, micro_batch_size=2)),
)
"""Runs the fit never saw, to check its predictions against."""
ALONE = Run(Layout(tp=1, pp=1, dp=1, micro_batch_size=4))
"""One process, for the speed of a process with a core to itself."""


def run_profile(
    run: Run,
    nproc: int,
    workdir: Path,
    iteration: int = 3,
    plain: int = 5,
    reuse: bool = False,
    launch: int = 1,
) -> Measurement:
    """Train :data:`MODEL` as ``run`` says on ``nproc`` processes, profiling iteration
    ``iteration`` (and measuring memory in the next), then ``plain`` more iterations; the
    profile record it wrote and the median of its plain iterations' times. ``reuse``: read
    the metrics an earlier run left in ``workdir`` instead, where there are some.
    ``launch``: which launch of ``run`` this is (each writes its own metrics file)."""
    workdir.mkdir(parents=True, exist_ok=True)
    suffix = "" if launch == 1 else f".launch{launch}"
    metrics = workdir / f"{run.name}{suffix}.jsonl"
    if not (reuse and metrics.is_file()):
        _train(run, nproc, metrics, iteration, iteration + plain)
    records = read_records(metrics)
    profile = next((r for r in records if r.get("kind") == "profile"), None)
    if profile is None:
        raise RuntimeError(f"calibration run {run.name} wrote no profile record")
    iteration = profile["iteration"]
    steady = plain_iteration_seconds(records, iteration)
    timed = [
        r["elapsed_ms_per_iteration"] / 1e3
        for r in records
        if r.get("kind") == "train" and r["iteration"] == iteration
    ]
    config = pretrain_config(run.layout, MODEL, run.global_batch)
    median = statistics.median(steady) if steady else None
    return Measurement(config, VOCAB, profile, median, timed[0] if timed else None)


TIMEOUT_S = 1800.0
"""How long one calibration run may take before it is stopped (minutes, on two cores)."""


def _train(run: Run, nproc: int, metrics: Path, profiled: int, iterations: int) -> None:
    """``torchrun`` ``pretrain_gpt.py`` as ``run`` says (one thread per process), writing
    ``metrics``."""
    metrics.unlink(missing_ok=True)
    flags = [*MODEL, *run.layout.flags(4), "--global-batch-size", str(run.global_batch)]
    flags += ["--lr", "1e-4", "--train-iters", str(iterations), "--use-default-corpus"]
    flags += ["--hidden-dropout", "0", "--attention-dropout", "0"]  # the model prices none
    flags += ["--log-interval", "1", "--eval-iters", "0", "--metrics-path", str(metrics)]
    flags += ["--profile-iteration", str(profiled)]
    done = run_pretrain(nproc, flags, timeout_s=TIMEOUT_S)
    if done.timed_out:
        raise RuntimeError(f"calibration run {run.name} took over {TIMEOUT_S:.0f} s")
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"calibration run {run.name} failed: {tail[0]}")


def calibrate(
    nproc: int,
    out: str | Path,
    runs: Sequence[Run] = LAYOUTS,
    checks: Sequence[Run] = (),
    verbose: bool = True,
    reuse: bool = False,
    repeats: int = 1,
) -> CpuProfile:
    """Measure ``runs`` on ``nproc`` processes, fit, write the profile to ``out``; then
    measure ``checks`` and print their predicted against measured iteration times. Where
    the processes outnumber the cores, :data:`ALONE` on one process measures how much
    faster a process computes with a core to itself. ``reuse``: fit the metrics earlier
    runs left beside ``out`` rather than run them again. ``repeats``: launches per run, in
    rounds over the runs; a run's time is its fastest launch's."""
    workdir = Path(out).parent

    def measure_all(todo: Sequence[Run], processes: int = nproc) -> list[list[Measurement]]:
        """Every launch of every run of ``todo``, launched in rounds over the runs."""
        todo = [_resize(run, processes) for run in todo]
        launches: list[list[Measurement]] = [[] for _ in todo]
        for launch in range(1, repeats + 1):
            for run, done in zip(todo, launches, strict=True):
                done.append(run_profile(run, processes, workdir, reuse=reuse, launch=launch))
        return launches

    fitted = measure_all(runs)
    measurements = [_fastest_launch(done) for done in fitted]
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / nproc
    # The loss's passes are too small a part of an action to pin the memory bandwidth down.
    bandwidth = memory_bandwidth(nproc)
    cores = len(os.sched_getaffinity(0))
    name = f"cpu-{nproc}proc"
    if cores >= nproc:  # a core each: every profiled action shows its own cost
        profile = fit_own_cores(measurements, name, memory, memory_bandwidth=bandwidth)
    else:
        every = [m for done in fitted for m in done]  # their actions' CPU times are pooled
        profile = fit_shared_cores(measurements, cores, bandwidth, name, memory, every)
        (alone,) = map(_fastest_launch, measure_all([ALONE], 1))
        measurements.append(alone)
        speedup = fit_uncontended_speedup(alone, profile)
        sharing = dataclasses.replace(profile.sharing, uncontended_speedup=speedup)
        profile = dataclasses.replace(profile, sharing=sharing)
    profile.save(out)
    if verbose:
        print(f"wrote {out}")
        for m in measurements:
            _report("fitted", m, profile)
        for m in map(_fastest_launch, measure_all(checks)):
            _report("checked", m, profile)
    return profile


def _fastest_launch(launches: Sequence[Measurement]) -> Measurement:
    """The first launch's record, held to the fastest launch's time (the machine's slow
    spells only ever add time)."""
    seconds = min(m.seconds for m in launches)
    return dataclasses.replace(launches[0], steady_seconds=seconds)


def _report(what: str, m: Measurement, profile: CpuProfile) -> None:
    predicted = predict(m.config, m.vocab_size, profile).seconds
    measured = m.seconds
    print(
        f"{what} {m.config.schedule.name} {_label(m)}: measured {measured:.3f} s, "
        f"predicted {predicted:.3f} s ({100 * (predicted / measured - 1):+.1f}%)"
    )


def _label(m: Measurement) -> str:
    c = m.config
    tp, pp = c.parallel.tensor_model_parallel_size, c.parallel.pipeline_model_parallel_size
    chunks = c.schedule.num_virtual_stages // pp
    label = f"tp{tp} pp{pp} dp{c.data_parallel_size} mb{c.training.micro_batch_size}"
    label += f" gbs{c.training.global_batch_size}" + (f" v{chunks}" if chunks > 1 else "")
    return label + (f" zero{c.parallel.zero_stage}" if c.parallel.zero_stage else "")


def _resize(run: Run, nproc: int) -> Run:
    """``run`` with its data-parallel size changed to fill ``nproc`` processes."""
    layout = run.layout
    model_parallel = layout.tp * layout.pp
    if layout.world_size == nproc:
        return run
    if nproc % model_parallel:
        raise ValueError(f"{nproc} processes do not hold tp {layout.tp} × pp {layout.pp}")
    return dataclasses.replace(run, layout=dataclasses.replace(layout, dp=nproc // model_parallel))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megapp.planning.shared_cores.calibrate")
    parser.add_argument("--nproc", type=int, default=8, help="processes, as the plans use")
    parser.add_argument("--out", default="runs/calibration/hardware.json")
    parser.add_argument("--check", action="store_true", help="also time layouts not fitted")
    parser.add_argument(
        "--reuse", action="store_true", help="fit the metrics earlier runs left beside --out"
    )
    parser.add_argument("--repeats", type=int, default=1, help="launches per run")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    checks = CHECKS if args.check else ()
    try:
        calibrate(args.nproc, args.out, checks=checks, reuse=args.reuse, repeats=args.repeats)
    except (RuntimeError, ValueError) as error:
        print(f"python -m megapp.planning.shared_cores.calibrate: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
