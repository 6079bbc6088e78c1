"""The pictures of an ablation report, each one PNG from the sweep's records: throughput and
memory per layout, predicted against measured, the measured timelines of two layouts, and
the loss curves with their distance from the single-process reference of their update rule.

Every function takes the records and an output path and returns the path, or None when the
records hold nothing to draw (no prediction yet, no profile).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from megapp.ablation.parity import references_by_rule, rule_of
from megapp.ablation.points import FLUSHED
from megapp.ablation.records import OK, PointRecord
from megapp.pipeline_parallel.simulate import Event
from megapp.pipeline_parallel.timeline import plot_timelines

MIB = 2**20


def _finished(point_records: Sequence[PointRecord]) -> list[PointRecord]:
    return [r for r in point_records if r.status == OK and r.measured.iteration_seconds]


def _bar_figure(count: int):
    """A figure for ``count`` horizontal bars (layout names are long: they read on the y
    axis, first layout on top)."""
    fig, ax = plt.subplots(figsize=(9.0, 1.4 + 0.38 * count))
    ax.invert_yaxis()
    return fig, ax


def _names(ax, done: Sequence[PointRecord]) -> None:
    ax.set_yticks(range(len(done)), [r.name for r in done], fontsize=7)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def throughput_bars(point_records: Sequence[PointRecord], path: Path) -> Path | None:
    """Tokens per second of the whole job per layout, fastest first."""
    done = sorted(_finished(point_records), key=lambda r: -r.measured.tokens_per_second)
    if not done:
        return None
    fig, ax = _bar_figure(len(done))
    colors = ["#999999" if r.reference else "#4c78a8" for r in done]
    ax.barh(range(len(done)), [r.measured.tokens_per_second for r in done], color=colors)
    _names(ax, done)
    ax.set_xlabel("tokens / s (whole job)")
    ax.set_title("Throughput per layout (grey: single-process reference)", fontsize=10)
    return _save(fig, path)


def memory_bars(point_records: Sequence[PointRecord], path: Path) -> Path | None:
    """Measured peak live tensor memory of every pipeline rank per layout, with the
    predicted total of each pipeline rank as a black tick where there is one."""
    done = [r for r in _finished(point_records) if r.measured.ranks]
    if not done:
        return None
    fig, ax = _bar_figure(len(done))
    height = 0.8 / max(len(r.measured.peak_per_stage()) for r in done)
    for y, record in enumerate(done):
        predicted = record.predicted.memory_per_stage or []
        for stage, peak in enumerate(record.measured.peak_per_stage()):
            top = y - 0.4 + stage * height
            ax.barh(top, peak / MIB, height, align="edge", color=f"C{stage}")
            if stage < len(predicted):
                ax.vlines(predicted[stage] / MIB, top, top + height, color="black", lw=2)
    _names(ax, done)
    ax.set_xlabel("peak live tensor MiB per rank")
    ax.set_title(
        "Peak memory per pipeline rank (colour: stage; black tick: prediction)", fontsize=10
    )
    return _save(fig, path)


def prediction_scatter(point_records: Sequence[PointRecord], path: Path) -> Path | None:
    """Predicted against measured iteration time and memory (every pipeline rank), on the
    diagonal where the planner is exact; the title gives the mean relative error."""
    done = _finished(point_records)
    times = [
        (r.measured.iteration_seconds, r.predicted.iteration_seconds)
        for r in done
        if r.predicted.iteration_seconds
    ]
    memory = [
        (measured, predicted)
        for r in done
        for measured, predicted in zip(
            r.measured.peak_per_stage(), r.predicted.memory_per_stage or [], strict=False
        )
    ]
    if not times and not memory:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    panels = ((axes[0], times, 1e3, "iteration time (ms)"), (axes[1], memory, 1 / MIB, "MiB"))
    for ax, pairs, scale, unit in panels:
        if not pairs:
            ax.text(0.5, 0.5, "no prediction", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
            continue
        xs = [m * scale for m, _ in pairs]
        ys = [p * scale for _, p in pairs]
        top = max(*xs, *ys) * 1.1
        ax.plot([0, top], [0, top], color="#999999", lw=1, ls="--")
        ax.scatter(xs, ys, s=18)
        error = sum(abs(p / m - 1) for m, p in pairs) / len(pairs)
        ax.set_xlabel(f"measured {unit}")
        ax.set_ylabel(f"predicted {unit}")
        ax.set_title(f"{unit}: mean |error| {100 * error:.1f}% over {len(pairs)}", fontsize=10)
    return _save(fig, path)


def pipeline_events(record: PointRecord) -> list[Event]:
    """The profiled timeline of the pipeline ranks of tensor and data-parallel rank 0, each
    on the row of its pipeline rank."""
    out = []
    for rank in record.measured.ranks:
        if rank.tp == 0 and rank.dp == 0:
            out += [
                Event(rank.pp, kind, name, start, end) for kind, name, start, end in rank.events
            ]
    return out


def timelines(records_to_draw: Sequence[tuple[str, PointRecord]], path: Path) -> Path | None:
    """The measured timelines of ``(title, record)`` pairs stacked on one time axis."""
    drawn = [(title, pipeline_events(r)) for title, r in records_to_draw]
    drawn = [(title, events) for title, events in drawn if events]
    if not drawn:
        return None
    plot_timelines(drawn, path, unit="s")
    return path


def loss_curves(
    point_records: Sequence[PointRecord], references: Sequence[PointRecord], path: Path
) -> Path | None:
    """Every layout's loss per iteration (left; the references black, the flushed one solid
    and the others dashed) and its relative distance from the reference of its update rule
    (right, log scale; the dashed line is the parity tolerance; none for PipeDream)."""
    done = [r for r in point_records if r.measured.losses]
    if not done:
        return None
    by_rule = references_by_rule(references)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for record in done:
        losses = record.measured.losses
        steps = range(1, len(losses) + 1)
        style = dict(lw=1)
        if record.reference:
            line = "-" if rule_of(record) == FLUSHED else "--"
            style = dict(color="black", lw=2.5, zorder=3, ls=line)
        left.plot(steps, losses, label=record.name, **style)
        reference = by_rule.get(rule_of(record))
        if reference is None or record.reference or not reference.measured.losses:
            continue
        pairs = zip(losses, reference.measured.losses, strict=False)
        # a loss equal to the reference's to the bit draws at the floor of the log axis
        rel = [max(abs(a - b) / abs(b), 1e-10) for a, b in pairs]
        right.semilogy(range(1, len(rel) + 1), rel, marker=".", lw=1)
    left.set_xlabel("iteration")
    left.set_ylabel("lm loss")
    black = "references, dashed: pipedream-2bw's" if len(by_rule) > 1 else "reference"
    left.set_title(f"Loss per iteration of {len(done)} runs (black: {black})", fontsize=10)
    if len(done) <= 12:
        left.legend(fontsize=6)
    tolerance = next((r.parity.tolerance for r in done if r.parity and r.parity.tolerance), None)
    if tolerance:
        right.axhline(tolerance, color="red", ls="--", lw=1, label="parity tolerance")
        right.legend(fontsize=7)
    right.set_xlabel("iteration")
    right.set_ylabel("|loss - reference| / reference")
    right.set_title("Distance from the single-process run of its rule (1e-10: equal)", fontsize=10)
    return _save(fig, path)
