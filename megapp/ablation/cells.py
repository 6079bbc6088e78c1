"""Table cells of the ablation report: numbers as the tables print them, and the order of
the points."""

from __future__ import annotations

from collections.abc import Sequence

from megapp.ablation.records import PointRecord

MIB = 2**20


def fmt(value: float | None, spec: str = ".1f", scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def percent(error: float | None) -> str:
    return "-" if error is None else f"{100 * error:+.1f}%"


def by_measured_time(point_records: Sequence[PointRecord]) -> list[PointRecord]:
    """The records fastest first, those without a time last (the layout table's order)."""
    return sorted(point_records, key=lambda r: r.measured.iteration_seconds or float("inf"))
