"""Pictures of pipeline timelines: Chrome traces and Gantt charts.

The simulator's predicted events and the engine's measured events share one
type (:class:`megapp.pipeline_parallel.simulate.Event`), so both are drawn by
the same code and can be put side by side.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from megapp.pipeline_parallel.simulate import Event


def chrome_trace(events: Sequence[Event], time_unit_s: float = 1.0) -> dict:
    """Events as a Chrome trace (open in chrome://tracing or ui.perfetto.dev).

    One process row per rank; ``time_unit_s`` converts event times to seconds
    (1.0 for measured timelines, e.g. 0.1 for a simulator run in units of 100 ms).
    """
    trace = []
    for rank in sorted({e.rank for e in events}):
        trace.append(
            {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}}
        )
    for e in events:
        trace.append(
            {
                "name": e.name,
                "cat": e.kind,
                "ph": "X",
                "pid": e.rank,
                "tid": 0 if e.kind == "compute" else 1,
                "ts": e.start * time_unit_s * 1e6,
                "dur": (e.end - e.start) * time_unit_s * 1e6,
            }
        )
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(events: Sequence[Event], path: str | Path, time_unit_s: float = 1.0) -> None:
    Path(path).write_text(json.dumps(chrome_trace(events, time_unit_s)))


_COLORS = {"F": "#4c78a8", "B": "#f58518", "I": "#e45756", "W": "#54a24b", "U": "#b279a2"}


def _color(name: str) -> str:
    """Forwards blue, whole backwards orange, input gradients red, weight gradients green."""
    return _COLORS.get(name[:1], "#bbbbbb")


def plot_timelines(
    timelines: Sequence[tuple[str, Sequence[Event]]], path: str | Path, unit: str = "s"
) -> None:
    """A Gantt chart per (title, events), stacked with a shared time axis, saved as PNG.

    Forwards are blue, backwards orange (split: input gradients red, weight gradients
    green), optimizer steps of the asynchronous schedules purple, communication waits
    grey hatches.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # matplotlib is a dev extra
        raise ImportError("plotting timelines needs matplotlib: pip install matplotlib") from err
    fig, axes = plt.subplots(
        len(timelines),
        1,
        figsize=(12, 1.2 + 0.5 * sum(_ranks(ev) for _, ev in timelines)),
        sharex=True,
        squeeze=False,
    )
    for ax, (title, events) in zip(axes[:, 0], timelines, strict=True):
        num_ranks = _ranks(events)
        for e in events:
            y = num_ranks - 1 - e.rank
            if e.kind == "compute":
                ax.barh(y, e.end - e.start, left=e.start, color=_color(e.name), edgecolor="white")
                if e.end - e.start > 0:
                    ax.text(
                        (e.start + e.end) / 2,
                        y,
                        e.name,
                        ha="center",
                        va="center",
                        fontsize=6,
                        color="white",
                        clip_on=True,
                    )
            else:
                ax.barh(
                    y,
                    e.end - e.start,
                    left=e.start,
                    height=0.3,
                    color="#dddddd",
                    hatch="///",
                    edgecolor="#999999",
                )
        ax.set_yticks(range(num_ranks), [f"rank {r}" for r in reversed(range(num_ranks))])
        ax.set_title(title, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel(f"time ({unit})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _ranks(events: Sequence[Event]) -> int:
    return max((e.rank for e in events), default=0) + 1
