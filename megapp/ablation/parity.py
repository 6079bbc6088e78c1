"""The parity alarm: every layout must train the model the single-process run of its update
rule trains.

With dropout off, the same seed and the same global batch, a layout changes only the order
of floating-point sums (tensor-parallel all-reduces, data-parallel gradient reduction,
microbatch accumulation), so its loss per iteration equals the reference's to fp32
round-off. :func:`compare_losses` checks that within :data:`DEFAULT_RTOL`; a layout past it
computes something else (a dropped layer, a wrong gradient) and is flagged. The flushed
schedules and PipeDream-2BW each have a single-process reference
(:func:`ablation_points.update_rule`); PipeDream has none, so its layouts get
:data:`NOT_APPLICABLE`.
"""

from __future__ import annotations

from collections.abc import Sequence

from megapp.ablation.points import PIPEDREAM, update_rule
from megapp.ablation.records import OK, Parity, PointRecord

PASS, FAIL, UNKNOWN, NOT_APPLICABLE = "pass", "FAIL", "unknown", "n/a"

NOT_APPLICABLE_WHY = (
    "PipeDream's weight versions depend on the pipeline depth; its semantics are checked by "
    "the test suite against its own single-process rule"
)
"""Why a PipeDream layout (with or without vertical sync) has no parity verdict."""

DEFAULT_RTOL = 1e-5
"""Largest relative difference of a loss from the reference's at the same iteration.

Measured on the tiny CPU model (docs/ablation/README.md): twelve layouts (tp 1-2, 1F1B,
interleaved 1F1B, ZB-V, with and without full recompute) stay within 1.3e-7 of the
single-process run over 8 iterations, and ZB-V with full recompute within 1.4e-7 over 30,
without growth: one unit in the last place of an fp32 loss near 4-5. Another seed moves
the first loss by 8e-4. 1e-5 keeps about 70× of margin on both sides: longer runs and
wider models pass, a dropped layer, a missing reduction or a changed initialisation fails
in the first iteration."""


def compare_losses(
    losses: Sequence[float],
    reference: Sequence[float],
    rtol: float = DEFAULT_RTOL,
    reference_name: str | None = None,
) -> Parity:
    """``losses`` against ``reference``, iteration by iteration. A missing or non-finite
    loss, or a run that stopped earlier than the reference, fails."""
    if not reference:
        return Parity(UNKNOWN, tolerance=rtol, reference=reference_name)
    worst, first_bad = 0.0, None
    for i, ref in enumerate(reference):
        value = losses[i] if i < len(losses) else None
        if value is None or value != value or ref == 0:
            rel = float("inf")
        else:
            rel = abs(value - ref) / abs(ref)
        worst = max(worst, rel)
        if rel > rtol and first_bad is None:
            first_bad = i + 1
    status = PASS if first_bad is None else FAIL
    return Parity(status, worst, first_bad, rtol, reference_name)


def rule_of(record: PointRecord) -> str:
    """The update rule ``record``'s layout trains under."""
    return update_rule(record.layout.get("schedule"))


def references_by_rule(records: Sequence[PointRecord]) -> dict[str, PointRecord]:
    """The reference records among ``records`` by update rule (the first of each)."""
    out: dict[str, PointRecord] = {}
    for record in records:
        if record.reference:
            out.setdefault(rule_of(record), record)
    return out


def apply_parity(
    records: Sequence[PointRecord],
    references: Sequence[PointRecord],
    rtol: float = DEFAULT_RTOL,
) -> None:
    """Set every finished record's ``parity`` against the reference of its update rule
    among ``references`` (``unknown`` without a finished one, ``n/a`` for PipeDream); a
    failed run gets no verdict, nor does a dense twin, which trains another model."""
    by_rule = references_by_rule(references)
    for record in records:
        rule = rule_of(record)
        reference = by_rule.get(rule)
        if record.status != OK or record.dense_twin:
            record.parity = None
        elif rule == PIPEDREAM:
            record.parity = Parity(NOT_APPLICABLE, tolerance=rtol)
        elif reference is None or reference.status != OK:
            record.parity = Parity(UNKNOWN, tolerance=rtol)
        else:
            losses = record.measured.losses
            record.parity = compare_losses(losses, reference.measured.losses, rtol, reference.name)


def deviating(records: Sequence[PointRecord]) -> list[PointRecord]:
    """The records whose losses left their reference's."""
    return [r for r in records if r.parity is not None and r.parity.status == FAIL]
