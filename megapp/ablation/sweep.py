"""Running a sweep: every point once, the single-process references first (one per update
rule the points train under that has one), then (with ``repeats``) every point again,
round after round, for its time, then the parity check of every layout against the
reference of its rule.

A sweep directory holds ``points/<name>.json`` (one :class:`PointRecord` per point, the
references' with ``reference: true``, a mixture-of-experts model's dense twins' with
``dense_twin: true``), ``runs/<name>/`` (each point's metrics file and
log) and ``sweep.json`` (the spec, the dropped points and the command). A record whose
key equals the point's (the same command) is not run again, so an interrupted sweep
continues where it stopped; a failed point runs again only with ``retry_failed``. The
launches after a point's first write ``runs/<name>/launch<k>/``; a point's time is its
fastest launch's (a machine shared with other jobs has slow spells of minutes, which only
ever add time; rounds spread them over every point alike).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megapp.ablation import records
from megapp.ablation.launch import Launcher, error_summary, point_command, point_env, run_command
from megapp.ablation.parity import DEFAULT_RTOL, apply_parity
from megapp.ablation.points import (
    Expansion,
    Point,
    SweepSpec,
    check_point,
    expand,
    is_reference,
    point_for,
    reference_layouts,
    spec_of,
)
from megapp.ablation.predict import predict
from megapp.ablation.records import FAILED, OK, TIMEOUT, Measured, PointRecord, Prediction


class Progress:
    """What the sweep reports as it goes: a point starts, a point is done (``ran``: False
    when its record was reused). This one says nothing; the command line draws a bar."""

    def start(self, name: str) -> None:
        """``name`` is next."""

    def done(self, name: str, ran: bool) -> None:
        """``name`` is finished."""


@dataclass
class SweepResult:
    """The sweep's records (references first) and what it skipped or dropped."""

    records: list[PointRecord] = field(default_factory=list)
    reused: list[str] = field(default_factory=list)
    expansion: Expansion = field(default_factory=Expansion)


def reference_points(spec: SweepSpec, expansion: Expansion) -> list[Point]:
    """The single-process references of ``expansion``'s points, the flushed one first."""
    layouts = reference_layouts(spec, [point.layout for point in expansion.points])
    return [point_for(spec, layout) for layout in layouts]


def record_path(out_dir: Path, point: Point) -> Path:
    return out_dir / "points" / f"{point.name}.json"


def run_dir(out_dir: Path, point: Point) -> Path:
    return out_dir / "runs" / point.name


def finished(out_dir: Path, point: Point, retry_failed: bool) -> PointRecord | None:
    """The saved record of ``point`` if it ran with the same command (and succeeded, or
    failed and ``retry_failed`` is off), else None; its dense twin is the point's now."""
    path = record_path(out_dir, point)
    if not path.is_file():
        return None
    record = records.load(path)
    if record.key != point.key or (retry_failed and record.status != OK):
        return None
    record.twin = point.twin
    return record


def collect(
    spec: SweepSpec,
    point: Point,
    out_dir: Path,
    command: Sequence[str],
    returncode: int | None,
    timed_out: bool,
    seconds: float | None,
) -> PointRecord:
    """The record of a point that ran (here, or as a SLURM array job): its measured
    figures from the metrics file, the prediction, and the error of a failed run."""
    where = run_dir(out_dir, point)
    metrics, log = where / "metrics.jsonl", where / "log.txt"
    record = PointRecord(
        name=point.name,
        key=point.key,
        layout=asdict(point.layout),
        world_size=point.world_size,
        command=list(command),
        status=OK,
        wall_seconds=seconds,
        log=str(log.relative_to(out_dir)),
        reference=not point.dense_twin and is_reference(spec, point.layout),
        dense_twin=point.dense_twin,
        twin=point.twin,
    )
    try:
        measured = measure_if_there(metrics, spec.profiled_iteration)
    except ValueError as error:
        measured, unreadable = None, str(error)
    else:
        unreadable = None
    record.measured = measured or Measured()
    if timed_out:
        record.status = TIMEOUT
        record.error = f"stopped after {spec.timeout_s:.0f} s\n" + error_summary(log)
    elif unreadable is not None:
        record.status, record.error = FAILED, unreadable
    elif returncode != 0 or len(record.measured.losses) < spec.train_iters:
        record.status = FAILED
        record.error = f"exit status {returncode}\n" + error_summary(log)
    return with_prediction(spec, point, record)


def measure_if_there(metrics: Path, profile_iteration: int) -> Measured | None:
    """The figures of the metrics file ``metrics``, or None where the run wrote none."""
    return records.measure(metrics, profile_iteration) if metrics.is_file() else None


def with_prediction(spec: SweepSpec, point: Point, record: PointRecord) -> PointRecord:
    """``record`` with the planner's current prediction for ``point`` (cheap: no run), so a
    resumed sweep also refreshes the predictions of the points it reuses."""
    try:
        record.predicted = predict(check_point(spec_of(spec, point), point.layout), spec.hardware)
    except ValueError as error:
        record.predicted = Prediction(note=f"no prediction: {error}")
    return record


def run_sweep(
    spec: SweepSpec,
    out_dir: Path,
    *,
    launcher: Launcher = run_command,
    retry_failed: bool = False,
    rtol: float = DEFAULT_RTOL,
    progress: Progress | None = None,
    command_line: str = "",
) -> SweepResult:
    """Run (or reuse) the references and every runnable point of ``spec`` under
    ``out_dir``, then record every point's parity with the reference of its update rule. A
    failing point is recorded with its error and the sweep goes on."""
    out_dir = Path(out_dir).resolve()  # the launcher runs from the repository root
    result = SweepResult(expansion=expand(spec))
    write_manifest(spec, out_dir, result.expansion, command_line)
    progress = progress or Progress()
    todo = [*reference_points(spec, result.expansion), *result.expansion.points]
    for point in todo:
        progress.start(point.name)
        record = finished(out_dir, point, retry_failed)
        if record is not None:
            result.reused.append(point.name)
            record = with_prediction(spec, point, record)
        else:
            where = run_dir(out_dir, point)
            metrics = where / "metrics.jsonl"
            if metrics.exists():
                metrics.unlink()  # a rerun starts a fresh file
            command = point_command(point.flags, point.world_size, metrics, spec.profiled_iteration)
            outcome = launcher(command, where / "log.txt", spec.timeout_s, point_env())
            record = collect(
                spec,
                point,
                out_dir,
                command,
                outcome.returncode,
                outcome.timed_out,
                outcome.seconds,
            )
            records.save(record, record_path(out_dir, point))
        result.records.append(record)
        progress.done(point.name, ran=point.name not in result.reused)
    points = {p.name: p for p in todo}
    run_repeats(spec, out_dir, result.records, points, launcher, progress)
    finish(result.records, out_dir, rtol)
    return result


def repeats_to_run(spec: SweepSpec, point_records: Sequence[PointRecord]) -> int:
    """How many more launches the finished points need to have ``spec.repeats`` each."""
    done = [r for r in point_records if r.status == OK]
    return sum(max(0, spec.repeats - len(r.measured.launch_seconds)) for r in done)


def run_repeats(
    spec: SweepSpec,
    out_dir: Path,
    point_records: Sequence[PointRecord],
    points: dict[str, Point],
    launcher: Launcher,
    progress: Progress,
) -> None:
    """Launch every finished point again, round after round, until each has
    ``spec.repeats`` launches, saving its record after each. A launch that fails, or whose
    losses are not the first launch's, is noted in the record's error and its time not
    counted."""
    for launch in range(2, spec.repeats + 1):
        for record in point_records:
            if record.status != OK or len(record.measured.launch_seconds) >= launch:
                continue
            point = points[record.name]
            where = run_dir(out_dir, point) / f"launch{launch}"
            metrics = where / "metrics.jsonl"
            metrics.unlink(missing_ok=True)
            command = point_command(point.flags, point.world_size, metrics, spec.profiled_iteration)
            progress.start(f"{point.name} launch {launch}")
            outcome = launcher(command, where / "log.txt", spec.timeout_s, point_env())
            try:
                again = measure_if_there(metrics, spec.profiled_iteration)
            except ValueError:
                again = None
            if outcome.returncode != 0 or again is None or again.iteration_seconds is None:
                why = f"exit status {outcome.returncode}" if outcome.returncode else "no time"
                why = f"stopped after {spec.timeout_s:.0f} s" if outcome.timed_out else why
                record.error = f"launch {launch} failed ({why}), not counted\n" + error_summary(
                    where / "log.txt"
                )
            elif again.losses != record.measured.losses:
                record.error = f"launch {launch} trained other losses than the first, not counted"
            else:
                record.measured.add_launch(again.iteration_seconds)
                if record.error and record.error.startswith(f"launch {launch} "):
                    record.error = None  # an earlier attempt at this launch failed
            records.save(record, record_path(out_dir, point))
            progress.done(point.name, ran=True)


def finish(point_records: Sequence[PointRecord], out_dir: Path, rtol: float) -> None:
    """Set every record's parity against the reference of its update rule among them and
    save them again."""
    apply_parity(point_records, [r for r in point_records if r.reference], rtol)
    for record in point_records:
        records.save(record, out_dir / "points" / f"{record.name}.json")


def write_manifest(spec: SweepSpec, out_dir: Path, expansion: Expansion, command: str) -> None:
    """``sweep.json``: the spec, the references (the flushed one first), the points (a
    model with experts: its dense twins among them, and what the twin is), the dropped
    points with their reasons, and the command that ran the sweep."""
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = {
        "command": command,
        "spec": asdict(spec),
        "references": [p.name for p in reference_points(spec, expansion)],
        "points": [p.name for p in expansion.points],
        "dropped": [{"point": d.description, "reason": d.reason} for d in expansion.dropped],
        "written": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if expansion.twin is not None:
        manifest["dense_twin"] = expansion.twin.description()
    (out_dir / "sweep.json").write_text(json.dumps(manifest, indent=1))
