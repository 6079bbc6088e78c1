"""The report's predicted step and memory of each point line by line, as ``python -m
megapp.plan --explain`` splits them (``megapp.planning.explain``'s rows, stored in the
point's record), next to what the point measured."""

from __future__ import annotations

from collections.abc import Sequence

from megapp.ablation.cells import MIB, by_measured_time, fmt
from megapp.ablation.records import PointRecord

STEP_HEADS = {
    "compute": "compute",
    "recompute": "recompute",
    "tensor_parallel": "tp",
    "context_parallel": "cp",
    "expert_all_to_all": "expert a2a",
    "data_parallel_actions": "dp in actions",
    "bubble": "bubble",
    "pipeline_messages": "messages",
    "data_parallel_tail": "dp after",
    "embedding_sum": "embedding sum",
    "optimizer": "optimizer",
    "unpriced": "unpriced",
    "step_overhead": "overhead",
}
"""Short column heads of the step's lines (``megapp.planning.explain.STEP_LINES``); a line
not named here is headed by its own name."""

COMMUNICATION = ("tensor_parallel", "context_parallel", "expert_all_to_all")
COMMUNICATION += ("data_parallel_actions", "data_parallel_tail", "embedding_sum")
"""The step's lines that are collectives or transfers (exposed), the counterpart of the
measured time blocked in collectives."""

MEMORY_HEADS = {
    "grads": "gradients",
    "optimizer": "optimizer state",
    "stashed": "stashed weights",
    "activations": "activations (in flight × each)",
    "working": "working buffers",
}
"""Column heads of the worst rank's memory lines that are not their own name."""

MEMORY_TOTALS = ("memory.in_flight", "memory.per_microbatch", "memory.total")
"""Memory rows that describe the lines rather than add to them."""

ROUND_OFF = 1e-9
"""A line at most this share of its whole is float round-off: shown as 0."""


def ms_cell(seconds: float | None, step: float | None = None) -> str:
    """Milliseconds to four significant digits, whole ones from a second; 0 where
    ``seconds`` is float round-off against the ``step`` it is a part of."""
    if seconds is None:
        return "-"
    if step is not None and abs(seconds) <= ROUND_OFF * abs(step):
        return "0"
    ms = seconds * 1e3
    return f"{ms:.0f}" if abs(ms) >= 1000 else f"{ms:.4g}"


def breakdown_lines(point_records: Sequence[PointRecord], group: str, whole: str) -> list[str]:
    """The ``group`` lines (``step`` or ``memory``) of the records' breakdowns in their
    order, without those that are 0 at every point (round-off against the row ``whole``)."""
    names: dict[str, bool] = {}
    for r in point_records:
        rows = r.predicted.breakdown or {}
        for key, value in rows.items():
            if key.startswith(f"{group}.") and key not in MEMORY_TOTALS:
                name = key.removeprefix(f"{group}.")
                shown = value is not None and abs(value) > ROUND_OFF * abs(rows.get(whole) or 0)
                names[name] = names.get(name, False) or shown
    return [name for name, shown in names.items() if shown]


def pair_cell(predicted: str, measured: str) -> str:
    return "-" if predicted == measured == "-" else f"{predicted} / {measured}"


def step_table(point_records: Sequence[PointRecord]) -> list[str]:
    """One row per point: the predicted step of its pipeline rank that finishes last,
    line by line (ms per iteration), the predicted and measured step, exposed
    communication and idle share."""
    names = breakdown_lines(point_records, "step", "step_seconds")
    heads = [STEP_HEADS.get(name, name) for name in names]
    lines = [
        "| layout | rank | " + " | ".join(heads) + " | predicted (ms) | measured (ms) "
        "| comm, pred. / meas. (ms) | idle share, pred. / meas. |",
        "|" + " --- |" * (len(names) + 6),
    ]
    for r in by_measured_time(point_records):
        rows, m = r.predicted.breakdown or {}, r.measured
        step = rows.get("step_seconds")
        comm = sum(rows.get(f"step.{name}") or 0.0 for name in COMMUNICATION)
        cells = [
            f"`{r.name}`",
            fmt(r.predicted.step_rank, ".0f"),
            *(ms_cell(rows.get(f"step.{name}"), step) for name in names),
            ms_cell(step),
            ms_cell(m.iteration_seconds),
            pair_cell(ms_cell(comm, step) if rows else "-", ms_cell(m.comm_seconds)),
            pair_cell(fmt(rows.get("bubble_fraction"), ".2f"), fmt(m.bubble, ".2f")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def activations_cell(rows: dict[str, float | None]) -> str:
    """Microbatch-chunks in flight × MiB each = MiB."""
    if rows.get("memory.activations") is None:
        return "-"
    flight, each = rows.get("memory.in_flight"), rows.get("memory.per_microbatch")
    total = f"{rows['memory.activations'] / MIB:.1f}"
    if flight is None or each is None:
        return total
    return f"{flight:g} × {each / MIB:.2f} = {total}"


def memory_table(point_records: Sequence[PointRecord]) -> list[str]:
    """One row per point: the predicted memory of its worst pipeline rank line by line
    (MiB), next to that rank's measured peak and the bytes it held before the iteration."""
    names = breakdown_lines(point_records, "memory", "memory.total")
    heads = [MEMORY_HEADS.get(name, name) for name in names]
    lines = [
        "| layout | rank | " + " | ".join(heads) + " | predicted (MiB) | measured (MiB) "
        "| state, pred. / meas. (MiB) |",
        "|" + " --- |" * (len(names) + 5),
    ]
    for r in by_measured_time(point_records):
        rows, stage = r.predicted.breakdown or {}, r.predicted.memory_rank
        peaks, states = r.measured.peak_per_stage(), r.measured.state_per_stage()
        measured = stage is not None and stage < len(peaks)
        state = [rows.get(f"memory.{n}") for n in ("weights", "grads", "optimizer", "stashed")]
        predicted_state = sum(v for v in state if v) if rows else None
        cells = [
            f"`{r.name}`",
            fmt(stage, ".0f"),
            *(
                activations_cell(rows)
                if n == "activations"
                else fmt(rows.get(f"memory.{n}"), ".1f", 1 / MIB)
                for n in names
            ),
            fmt(rows.get("memory.total"), ".1f", 1 / MIB),
            fmt(peaks[stage] if measured else None, ".1f", 1 / MIB),
            pair_cell(
                fmt(predicted_state, ".1f", 1 / MIB),
                fmt(states[stage] if measured else None, ".1f", 1 / MIB),
            ),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def breakdown_section(point_records: Sequence[PointRecord]) -> list[str]:
    """Each point's predicted step and memory line by line next to what it measured; one
    line saying why where no record has the breakdown."""
    if not any(r.predicted.breakdown for r in point_records):
        return [
            "No record has the predicted breakdown: the sweep predates it or ran without "
            "`--hardware`. Rerunning its `tools/ablate.py` command reuses every point and "
            "refreshes the predictions.",
            "",
        ]
    return [
        "The predicted step of the pipeline rank that finishes last (rank), split as "
        "`python -m megapp.plan --explain` splits it (`megapp.planning.explain`), in ms per "
        "iteration: the lines add up to the predicted step; a line that is 0 at every "
        "point is left out, and `-` marks a record without the breakdown. Comm: the "
        "predicted exposed collectives and transfers (tp, cp, expert, dp, embedding sum) "
        "against the longest any rank was blocked in collectives, which also counts waiting "
        "for a slower peer. Idle share: of all pipeline ranks' time, predicted and measured "
        "(the layout table's bubble).",
        "",
        *step_table(point_records),
        "",
        "The predicted memory of the worst pipeline rank (rank), line by line in MiB, "
        "against that rank's measured peak (the largest over its tensor- and data-parallel "
        "peers); state: weights, gradients, optimizer state and stashed weights predicted, "
        "against the bytes live before the iteration measured.",
        "",
        *memory_table(point_records),
        "",
    ]
