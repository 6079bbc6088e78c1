"""One markdown report with PNG plots from a sweep directory written by tools/ablate.py.

The command line of ``tools/ablation_report.py`` (also ``python -m megapp.ablation.report``):

    python tools/ablation_report.py runs/ablation                  # runs/ablation/report/
    python tools/ablation_report.py runs/ablation --out docs/ablation

The report opens with the parity alarm when a layout's losses left those of the
single-process run of its update rule, then a table per layout (time, tokens/s, memory per
pipeline rank, bubble, communication, prediction errors, parity; a model with experts also
its tokens/s over its dense twin's), each point's predicted step and memory line by line
(``megapp.planning.explain``'s rows, stored in its record) next to what it measured, the
plots (throughput, memory, predicted against measured, the timelines of the fastest and
slowest layout, loss curves), the failed points with their errors and the points the sweep
refused.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from megapp.ablation.breakdown_tables import breakdown_section
from megapp.ablation.cells import MIB, by_measured_time, fmt, percent
from megapp.ablation.parity import (
    NOT_APPLICABLE,
    NOT_APPLICABLE_WHY,
    PASS,
    deviating,
    references_by_rule,
    rule_of,
)
from megapp.ablation.points import FLUSHED, PIPEDREAM, TWO_BW, UPDATE_RULES
from megapp.ablation.records import OK, PointRecord, load_all


def time_error(record: PointRecord) -> float | None:
    """Predicted over measured iteration time, minus one."""
    measured, predicted = record.measured.iteration_seconds, record.predicted.iteration_seconds
    return predicted / measured - 1 if measured and predicted else None


def memory_error(record: PointRecord) -> float | None:
    """The largest relative error of the predicted memory over the pipeline ranks (signed)."""
    pairs = zip(
        record.measured.peak_per_stage(), record.predicted.memory_per_stage or [], strict=False
    )
    errors = [p / m - 1 for m, p in pairs if m]
    return max(errors, key=abs) if errors else None


def parity_cell(record: PointRecord) -> str:
    if record.reference:
        return "reference"
    if record.dense_twin:
        return "dense twin"
    parity = record.parity
    if parity is None:
        return "-"
    if parity.max_rel_diff is None:
        return parity.status
    bold = "**" if parity.status != "pass" else ""
    return f"{bold}{parity.status}{bold} ({parity.max_rel_diff:.1e})"


def iteration_cell(seconds: float | None, launches: Sequence[float]) -> str:
    """Milliseconds, with the range over the launches when there were several."""
    if seconds is None or len(launches) < 2:
        return fmt(seconds, ".1f", 1e3)
    return f"{seconds * 1e3:.1f} ({min(launches) * 1e3:.0f}–{max(launches) * 1e3:.0f})"


def dense_ratios(point_records: Sequence[PointRecord]) -> dict[str, float | None]:
    """Each mixture-of-experts point's tokens/s over its dense twin's, by name (None where
    either has no time); empty for a sweep without experts."""
    by_name = {r.name: r for r in point_records}
    out: dict[str, float | None] = {}
    for r in point_records:
        if r.twin is None:
            continue
        twin = by_name.get(r.twin)
        ours = r.measured.tokens_per_second
        theirs = twin.measured.tokens_per_second if twin and twin.status == OK else None
        out[r.name] = ours / theirs if ours and theirs and r.status == OK else None
    return out


def layout_table(point_records: Sequence[PointRecord]) -> list[str]:
    """One row per layout, fastest first; failed points last. A sweep with experts has a
    column of each point's tokens/s over its dense twin's."""
    ratios = dense_ratios(point_records)
    vs_dense = " tokens/s vs dense |" if ratios else ""
    head = (
        f"| layout | status | iteration (ms) | tokens/s |{vs_dense} peak MiB per pipeline rank "
        "| predicted MiB | bubble | comm (ms) | predicted (ms) | time error | memory error "
        "| parity (max rel. diff) |"
    )
    lines = [head, "|" + " --- |" * (13 if ratios else 12)]
    for r in by_measured_time(point_records):
        m = r.measured
        peaks = " / ".join(f"{p / MIB:.1f}" for p in m.peak_per_stage()) or "-"
        predicted = r.predicted.memory_per_stage or []
        predicted_peaks = " / ".join(f"{p / MIB:.1f}" for p in predicted) or "-"
        ratio = [fmt(ratios.get(r.name), ".2f")] if ratios else []
        cells = [
            f"`{r.name}`",
            r.status,
            iteration_cell(m.iteration_seconds, m.launch_seconds),
            fmt(m.tokens_per_second, ".0f"),
            *ratio,
            peaks,
            predicted_peaks,
            fmt(m.bubble, ".2f"),
            fmt(m.comm_seconds, ".1f", 1e3),
            fmt(r.predicted.iteration_seconds, ".2f", 1e3),
            percent(time_error(r)),
            percent(memory_error(r)),
            parity_cell(r),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def alarm(point_records: Sequence[PointRecord]) -> list[str]:
    """The loud block on top when a layout trained another model than the reference of its
    update rule, each line naming that reference."""
    bad = deviating(point_records)
    if not bad:
        return []
    tolerance = bad[0].parity.tolerance
    lines = [
        f"> **PARITY ALARM: {len(bad)} layout(s) trained a different model than the "
        f"single-process run of their update rule** (relative tolerance {tolerance:g} per "
        "iteration's loss).",
        ">",
    ]
    for r in bad:
        p = r.parity
        lines.append(
            f"> - `{r.name}`: max relative difference {p.max_rel_diff:.3g} from "
            f"`{p.reference}`, first past the tolerance at iteration {p.first_bad_iteration}"
        )
    return [*lines, ""]


RULE_TEXT = {
    FLUSHED: "",
    TWO_BW: " of pipedream-2bw (W(t+1) = W(t) − lr·∇f(W(t−1)), the same for every layout)",
}
"""How the parity section names each update rule that has a reference."""


def rule_parity(rule: str, of_rule: Sequence[PointRecord], reference: PointRecord | None) -> str:
    """The parity line of the layouts ``of_rule`` of one update rule against ``reference``."""
    if rule == PIPEDREAM:
        count = sum(r.parity.status == NOT_APPLICABLE for r in of_rule)
        head = "Parity of pipedream (with or without vertical sync)"
        return f"{head}: {NOT_APPLICABLE} for {count} layout(s). {NOT_APPLICABLE_WHY}."
    if reference is None or reference.status != OK:
        name = f" `{reference.name}`" if reference else ""
        return (
            f"No finished single-process reference{name}{RULE_TEXT[rule]}: parity was not checked."
        )
    worst = max(of_rule, key=lambda r: r.parity.max_rel_diff or 0.0)
    passed = sum(r.parity.status == PASS for r in of_rule)
    return (
        f"Parity{RULE_TEXT[rule]}: {passed} of {len(of_rule)} finished layouts equal the "
        f"single-process run `{reference.name}` within a relative {worst.parity.tolerance:g} "
        f"at every one of {len(reference.measured.losses)} iterations; the largest difference "
        f"is {worst.parity.max_rel_diff:.2e} (`{worst.name}`)."
    )


def parity_summary(point_records: Sequence[PointRecord]) -> list[str]:
    """One line per update rule of the finished layouts, naming the reference each was
    compared against; PipeDream's says why it has none."""
    compared = [r for r in point_records if r.parity and not r.reference]
    references = references_by_rule(point_records)
    if not compared:
        reference = references.get(FLUSHED)
        if reference is None or reference.status != OK:
            return ["No finished single-process reference: parity was not checked.", ""]
        return ["No finished layout to compare with the reference.", ""]
    lines = []
    for rule in UPDATE_RULES:
        of_rule = [r for r in compared if rule_of(r) == rule]
        if of_rule:
            lines += [rule_parity(rule, of_rule, references.get(rule)), ""]
    return lines


AXES = ("tp", "cp", "cp_comm_type", "ep", "pp", "vpp", "schedule", "micro_batch_size")
AXES += ("recompute", "zero_stage")


def twin_note(manifest: dict, point_records: Sequence[PointRecord]) -> list[str]:
    """What the dense twin is and what the ratio says; nothing for a sweep without
    experts."""
    if not dense_ratios(point_records):
        return []
    what = manifest.get("dense_twin", "a dense model of the same active size")
    return [
        "Tokens/s vs dense: the point's tokens/s over those of its dense twin "
        "(`dense-<layout>`: the same layout at ep 1, the same batch, iterations and "
        f"processes), {what}. The twin does the work a token's experts do, so a ratio "
        "below 1 is the time the experts cost beyond their arithmetic: the router, "
        "sorting tokens to their experts and back, small per-expert products and, with "
        "ep > 1, the all-to-all.",
        "",
    ]


def sweep_section(manifest: dict, point_records: Sequence[PointRecord]) -> list[str]:
    """What the sweep ran: model, batch, iterations, world size and the axes; where the
    predictions come from."""
    spec = manifest.get("spec")
    if not spec:
        return []
    world = spec["nproc"] * spec["nnodes"]
    lines = [
        f"Model: `{' '.join(spec['model_flags'])}`; global batch {spec['global_batch_size']}, "
        f"{spec['train_iters']} iterations, world size {world} "
        f"({spec['nnodes']} node(s) × {spec['nproc']}), seed {spec['seed']}, dropout off.",
        "",
        "| axis | values |",
        "| --- | --- |",
    ]
    for axis in (*AXES, "sequence_parallel"):
        if axis in spec:  # a sweep recorded before the axis existed has none
            lines.append(f"| {axis} | {', '.join(str(v) for v in spec[axis])} |")
    notes = {part for r in point_records for part in (r.predicted.note or "").split("; ")}
    source = f"hardware profile `{spec['hardware']}`" if spec.get("hardware") else None
    lines += ["", f"Predicted step time on: {source or 'no hardware profile (--hardware)'}."]
    if notes - {""}:
        lines.append(f"Prediction notes: {'; '.join(sorted(notes - {''}))}.")
    return [*lines, ""]


def failures(point_records: Sequence[PointRecord]) -> list[str]:
    failed = [r for r in point_records if r.status != OK]
    lines = []
    for r in failed:
        lines += [
            f"**`{r.name}`** ({r.status}, log `{r.log}`):",
            "",
            "```text",
            r.error or "",
            "```",
            "",
        ]
    return lines


def dropped_summary(manifest: dict) -> list[str]:
    dropped = manifest.get("dropped", [])
    if not dropped:
        return []
    reasons = Counter(d["reason"].splitlines()[0] for d in dropped)
    lines = [f"{len(dropped)} points of the cross product were refused before launch:", ""]
    lines += [f"- {count} × {reason}" for reason, count in reasons.most_common()]
    return [*lines, ""]


def make_plots(point_records: Sequence[PointRecord], out: Path) -> list[tuple[str, Path]]:
    """Every picture of the report as ``(caption, path)``."""
    from megapp.ablation import plots  # matplotlib: imported only to draw

    done = [r for r in point_records if r.status == OK and r.measured.iteration_seconds]
    by_time = sorted(
        (r for r in done if not r.reference), key=lambda r: r.measured.iteration_seconds
    )
    references = [r for r in point_records if r.reference]
    pictures = [
        ("Throughput", plots.throughput_bars(point_records, out / "throughput.png")),
        ("Memory", plots.memory_bars(point_records, out / "memory.png")),
        (
            "Predicted against measured",
            plots.prediction_scatter(point_records, out / "prediction.png"),
        ),
        ("Loss curves", plots.loss_curves(point_records, references, out / "loss.png")),
    ]
    if by_time:
        best, worst = by_time[0], by_time[-1]
        pair = [
            (f"fastest: {best.name} ({best.measured.iteration_seconds * 1e3:.0f} ms)", best),
            (f"slowest: {worst.name} ({worst.measured.iteration_seconds * 1e3:.0f} ms)", worst),
        ][: 1 if best is worst else 2]
        caption = "Measured timelines of the fastest and the slowest layout (pipeline ranks)"
        pictures.append((caption, plots.timelines(pair, out / "timelines.png")))
    return [(caption, path) for caption, path in pictures if path is not None]


def read_manifest(sweep_dir: Path) -> dict:
    """``sweep.json`` of the sweep (empty without one)."""
    path = sweep_dir / "sweep.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def manifest_references(manifest: dict) -> list[str] | None:
    """The names of the sweep's references: ``references`` (the flushed one first), or the
    one ``reference`` of a sweep written before there were several; None when it names
    none."""
    if "references" in manifest:
        return list(manifest["references"])
    if manifest.get("reference"):
        return [manifest["reference"]]
    return None


def current_records(sweep_dir: Path, manifest: dict) -> list[PointRecord]:
    """The records of the sweep's current points and references: a directory reused with
    another spec keeps the old points' files, which are not part of this sweep."""
    point_records = load_all(sweep_dir / "points")
    if "points" not in manifest:
        return point_records
    points, references = set(manifest["points"]), manifest_references(manifest)
    return [
        r
        for r in point_records
        if r.name in points or (r.name in references if references is not None else r.reference)
    ]


def write_report(sweep_dir: Path, out: Path, command: str) -> Path:
    """Write ``report.md`` and its PNGs into ``out``; returns the markdown's path."""
    manifest = read_manifest(sweep_dir)
    point_records = current_records(sweep_dir, manifest)
    if not point_records:
        raise ValueError(f"no records in {sweep_dir / 'points'}; run tools/ablate.py first")
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# Ablation report", "", *alarm(point_records)]
    lines += [f"Made by `{command}` from the sweep `{manifest.get('command', '?')}`.", ""]
    lines += parity_summary(point_records)
    lines += ["## Sweep", "", *sweep_section(manifest, point_records)]
    lines += ["## Layouts", "", *layout_table(point_records), ""]
    lines += [
        "Iteration: median wall time after the first iteration, without the two profiled "
        "ones (of a point launched several times, the fastest launch's, the range of all "
        "launches in brackets). Memory: peak live tensor bytes of the profiled iteration, the "
        "largest over each pipeline rank's tensor- and data-parallel peers. Comm: the "
        "longest any rank waited in collectives in the profiled iteration. Errors: "
        "predicted / measured − 1.",
        "",
        *twin_note(manifest, point_records),
    ]
    lines += ["## Predicted, line by line", "", *breakdown_section(point_records)]
    for caption, path in make_plots(point_records, out):
        lines += [f"## {caption}", "", f"![{caption}]({path.name})", ""]
    lines += ["## Failed points", "", *(failures(point_records) or ["None.", ""])]
    lines += ["## Refused points", "", *(dropped_summary(manifest) or ["None.", ""])]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return report


PROG = "tools/ablation_report.py"
"""The command as the docs name it; ``python -m megapp.ablation.report`` passes its own."""


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """Write the report of the sweep named in ``argv`` (default: ``sys.argv[1:]``); returns
    the exit status (1 when a layout deviates). ``prog``: the command as echoed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name = prog.split()[-1].rsplit("/", 1)[-1]
    parser = argparse.ArgumentParser(prog=name, description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", help="sweep directory (tools/ablate.py --out)")
    parser.add_argument("--out", help="report directory (default: SWEEP/report)")
    args = parser.parse_args(argv)
    command = " ".join(["python", prog, shlex.join(argv)]).rstrip()
    print(f"$ {command}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"{name}: error: the plots need matplotlib: pip install matplotlib")
        return 2
    sweep_dir = Path(args.sweep)
    try:
        report = write_report(sweep_dir, Path(args.out or sweep_dir / "report"), command)
    except ValueError as error:
        print(f"{name}: error: {error}")
        return 2
    print(f"wrote {report}")
    return 1 if deviating(current_records(sweep_dir, read_manifest(sweep_dir))) else 0


if __name__ == "__main__":
    sys.exit(main(prog="-m megapp.ablation.report"))
