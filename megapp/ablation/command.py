"""Ablation sweep: one model trained under many parallel layouts, measured and predicted.

The command line of ``tools/ablate.py`` (also ``python -m megapp.ablation``):

    python tools/ablate.py --config sweep.toml --out runs/ablation
    python tools/ablate.py --out runs/ablation --model-flags "--num-layers 4 --hidden-size 128
        --num-attention-heads 4 --seq-length 128" --nproc 8 --tp 1 2 --pp 1 2
        --schedule 1f1b gpipe --micro-batch-size 4 --recompute none selective
    python tools/ablate.py --config sweep.toml --out runs/ablation --slurm   # array job
    python tools/ablation_report.py runs/ablation                            # the report

The cross product of the axes (tp, cp and its communication, ep, pp, vpp, schedule, micro
batch, recompute, ZeRO stage, sequence parallelism) is checked as ``pretrain_gpt.py``
checks its flags; refused points are listed with the reason. Each point runs as ``torchrun
--standalone --nproc-per-node N pretrain_gpt.py ...`` (dropout off, a loss every
iteration, one profiled iteration) with a time limit, ``--repeats`` times in rounds over
the points; its record (``points/<name>.json``) holds the measured iteration time,
tokens/s, memory per rank, bubble, communication time, losses, the planner's prediction
and the parity with the single-process reference of its update rule (flushed schedules, or
PipeDream-2BW; PipeDream has none). A model with experts also runs its dense twin (the
same model with dense MLPs of the experts' active width, :mod:`megapp.ablation.twins`)
under each layout its points use, at ep 1, for the report's tokens/s against a dense
model. Finished points are not run again. A TOML file's
top-level keys are the fields of :class:`megapp.ablation.points.SweepSpec`; flags override
them.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from megapp.ablation import points, records
from megapp.ablation.launch import point_command
from megapp.ablation.parity import DEFAULT_RTOL, NOT_APPLICABLE, NOT_APPLICABLE_WHY, deviating
from megapp.ablation.points import SweepSpec, load_spec, spec_from_mapping
from megapp.ablation.slurm import slurm_script
from megapp.ablation.sweep import (
    Progress,
    collect,
    finish,
    finished,
    record_path,
    reference_points,
    repeats_to_run,
    run_dir,
    run_sweep,
    write_manifest,
)
from megapp.planning.layout import CP_COMM_TYPES

AXES = ("tp", "cp", "ep", "pp", "vpp", "micro_batch_size", "zero_stage")
WORD_AXES = ("schedule", "recompute", "cp_comm_type")


def parse_args(argv: list[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawTextHelpFormatter,
    )
    parser.add_argument("--config", help="TOML file of SweepSpec fields")
    parser.add_argument("--out", required=True, help="sweep directory")
    parser.add_argument("--model", help="a megapp.planning.models preset or a file of flags")
    for name in ("model_flags", "data_flags", "run_flags"):
        parser.add_argument("--" + name.replace("_", "-"), help="flags as one quoted string")
    for name in ("global_batch_size", "train_iters", "nproc", "nnodes", "seed"):
        parser.add_argument("--" + name.replace("_", "-"), type=int)
    parser.add_argument("--profile-iteration", type=int)
    parser.add_argument("--timeout", type=float, dest="timeout_s", help="seconds per point")
    parser.add_argument("--hardware", help="hardware profile (name or JSON) for the time")
    parser.add_argument("--repeats", type=int, help="launches per point, for its time")
    for name in AXES:
        parser.add_argument("--" + name.replace("_", "-"), type=int, nargs="+")
    for name in WORD_AXES:
        flag = "--" + name.replace("_", "-")
        if name == "cp_comm_type":
            parser.add_argument(flag, nargs="+", choices=CP_COMM_TYPES, help="with cp > 1")
        else:
            parser.add_argument(flag, nargs="+", help="'none' for the default")
    parser.add_argument("--sequence-parallel", nargs="+", choices=("off", "on"))
    parser.add_argument("--rtol", type=float, default=DEFAULT_RTOL, help="parity tolerance")
    parser.add_argument("--retry-failed", action="store_true", help="rerun failed points")
    parser.add_argument("--dry-run", action="store_true", help="list the points, run nothing")
    parser.add_argument("--slurm", action="store_true", help="write a SLURM array script")
    parser.add_argument("--collect", action="store_true", help="records from SLURM runs")
    return parser.parse_args(argv)


def spec_from_args(args: argparse.Namespace) -> SweepSpec:
    """The TOML file's settings with the flags given on the command line on top."""
    values: dict[str, Any] = load_spec(args.config) if args.config else {}
    for name in ("model_flags", "data_flags", "run_flags"):
        if getattr(args, name) is not None:
            values[name] = shlex.split(getattr(args, name))
    simple = ("global_batch_size", "train_iters", "nproc", "nnodes", "seed", "timeout_s")
    for name in (*simple, "model", "profile_iteration", "hardware", "repeats", *AXES, *WORD_AXES):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    if args.sequence_parallel is not None:
        values["sequence_parallel"] = [v == "on" for v in args.sequence_parallel]
    return spec_from_mapping(values)


class ProgressBar(Progress):
    """A tqdm bar over the points that run (reused ones do not count toward the ETA) on a
    terminal, else (or without tqdm) one plain line per point with the elapsed time and ETA."""

    def __init__(self, pending: int) -> None:
        self.pending, self.ran, self.start_time = pending, 0, time.perf_counter()
        self.bar = None
        if sys.stdout.isatty():  # a log file gets plain lines, not a redrawn bar
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=pending, unit="point", file=sys.stdout, smoothing=0)
            except ImportError:
                pass

    def start(self, name: str) -> None:
        if self.bar is not None:
            self.bar.set_description(name)
            return
        elapsed = time.perf_counter() - self.start_time
        eta = elapsed / self.ran * (self.pending - self.ran) if self.ran else None
        eta_text = f"ETA {eta / 60:.1f} min" if eta is not None else "ETA ?"
        print(f"[{self.ran}/{self.pending}] {name} ({elapsed:.0f} s, {eta_text})", flush=True)

    def done(self, name: str, ran: bool) -> None:
        if not ran:
            print(f"  {name}: reused", flush=True)
            return
        self.ran += 1
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def print_points(expansion: points.Expansion, dropped: bool = True) -> None:
    """The runnable points and (with ``dropped``, else see sweep.json) every refused one
    with its reason."""
    where = "" if dropped else " (see sweep.json)"
    print(f"{len(expansion.points)} points, {len(expansion.dropped)} dropped{where}")
    for point in expansion.points:
        print(f"  run   {point.name}")
    for drop in expansion.dropped if dropped else []:
        print(f"  drop  {drop.description}: {drop.reason.splitlines()[0]}")


def write_slurm(spec: SweepSpec, out: Path, command: str) -> None:
    """``sweep.sbatch`` (one array job per point, the references first) and ``sweep.json``."""
    expansion = points.expand(spec)
    write_manifest(spec, out, expansion, command)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    collect_command = command.replace(" --slurm", "") + " --collect"
    references = reference_points(spec, expansion)
    script = slurm_script(spec, references, expansion.points, out, command, collect_command)
    (out / "sweep.sbatch").write_text(script)
    print_points(expansion)
    count = len(references) + len(expansion.points)
    print(f"wrote {out / 'sweep.sbatch'} ({count} array jobs); after it: {collect_command}")


def collect_runs(spec: SweepSpec, out: Path, rtol: float) -> list[records.PointRecord]:
    """Records from the metrics files that the SLURM array jobs wrote."""
    expansion = points.expand(spec)
    found = []
    for point in [*reference_points(spec, expansion), *expansion.points]:
        metrics = run_dir(out, point) / "metrics.jsonl"
        command = point_command(point.flags, point.world_size, metrics, spec.profiled_iteration)
        record = collect(spec, point, out, command, 0, False, None)
        if not metrics.is_file():
            record.status, record.error = records.FAILED, "not run (no metrics file)"
        records.save(record, record_path(out, point))
        found.append(record)
    finish(found, out, rtol)
    return found


def summary(point_records: list[records.PointRecord]) -> None:
    """One line per point, why PipeDream has no parity verdict, and the parity alarm
    loudly at the end."""
    for r in point_records:
        m = r.measured
        time_text = f"{m.iteration_seconds * 1e3:8.1f} ms" if m.iteration_seconds else "       -   "
        parity = r.parity.status if r.parity else "twin" if r.dense_twin else "-"
        print(f"  {r.status:7s} {time_text}  parity {parity:7s} {r.name}")
        if r.error:
            print("          " + r.error.splitlines()[-1][:150])
    if any(r.parity and r.parity.status == NOT_APPLICABLE for r in point_records):
        print(f"  parity {NOT_APPLICABLE}: {NOT_APPLICABLE_WHY}")
    bad = deviating(point_records)
    if bad:
        print("\n" + "!" * 78)
        print(
            f"PARITY ALARM: {len(bad)} layout(s) trained a different model than the "
            "single-process run of their update rule:"
        )
        for r in bad:
            p = r.parity
            where = f"from iteration {p.first_bad_iteration} (against {p.reference})"
            print(f"  {r.name}: max relative difference {p.max_rel_diff:.3g} {where}")
        print("!" * 78)


PROG = "tools/ablate.py"
"""The command as the docs name it; ``python -m megapp.ablation`` passes its own."""


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """Run the command with ``argv`` (default: ``sys.argv[1:]``); returns the exit status.
    ``prog``: the command as the echoed line shows it (``python <prog> <argv>``)."""
    argv = sys.argv[1:] if argv is None else argv
    name = prog.split()[-1].rsplit("/", 1)[-1]  # ablate.py, or megapp.ablation
    args = parse_args(argv, name)
    command = " ".join(["python", prog, shlex.join(argv)]).rstrip()
    print(f"$ {command}", flush=True)
    try:
        spec = spec_from_args(args)
    except (ValueError, OSError) as error:
        print(f"{name}: error: {error}", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()  # the array jobs and the launcher run elsewhere
    expansion = points.expand(spec)
    if not expansion.points:  # only the references would run: nothing to compare
        print_points(expansion)
        first = expansion.dropped[0]
        print(
            f"{name}: error: every point of the sweep is refused ({len(expansion.dropped)}; "
            f"the first, {first.description}: {first.reason.splitlines()[0]})",
            file=sys.stderr,
        )
        return 2
    if args.dry_run:
        print_points(expansion)
        return 0
    if (args.slurm or args.collect) and spec.repeats > 1:
        print(f"{name}: error: --repeats runs here only; an array job launches each point once")
        return 2
    if args.slurm:
        write_slurm(spec, out, command)
        return 0
    if args.collect:
        point_records = collect_runs(spec, out, args.rtol)
    else:
        if spec.nnodes != 1:
            print(f"{name}: error: nnodes > 1 runs under --slurm only", file=sys.stderr)
            return 2
        print_points(expansion, dropped=False)
        todo = [*reference_points(spec, expansion), *expansion.points]
        done = [finished(out, p, args.retry_failed) for p in todo]
        pending = sum(spec.repeats for record in done if record is None)
        pending += repeats_to_run(spec, [record for record in done if record is not None])
        bar = ProgressBar(pending)
        result = run_sweep(
            spec,
            out,
            retry_failed=args.retry_failed,
            rtol=args.rtol,
            progress=bar,
            command_line=command,
        )
        bar.close()
        point_records = result.records
    summary(point_records)
    print(f"records in {out / 'points'}; report: python tools/ablation_report.py {out}")
    return 1 if deviating(point_records) else 0
