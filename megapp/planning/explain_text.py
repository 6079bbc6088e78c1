"""The text of ``python -m megapp.plan --explain``, ``--layout`` and ``--compare``: an
:class:`~megapp.planning.explain.Explanation` as aligned lines, one layout or two side by
side with their difference."""

from __future__ import annotations

from megapp.planning.explain import (
    MEMORY_LINES,
    STEP_LINES,
    Explanation,
    MemoryBreakdown,
    StepBreakdown,
    comparison_rows,
)

_GIB = 2**30


_HEADLINE = {
    "step_seconds": ("step (s)", 1.0),
    "tokens_per_second_per_gpu": ("tokens/s per GPU", 1.0),
    "mfu": ("MFU (%)", 100.0),
    "bubble_fraction": ("bubble, all ranks (%)", 100.0),
    "memory.in_flight": ("  activations: microbatch-chunks in flight", 1.0),
    "memory.per_microbatch": ("  activations: GiB per chunk (mean)", 1 / _GIB),
    "memory.total": ("  total", 1 / _GIB),
}


def _label(key: str) -> tuple[str, float]:
    if key in _HEADLINE:
        return _HEADLINE[key]
    group, name = key.split(".")
    if group == "step":
        return "  " + STEP_LINES[name], 1.0
    return "  " + MEMORY_LINES[name], 1 / _GIB


def _shown(value: float, scale: float) -> bool:
    """Whether ``value`` is more than float round-off against ``scale``."""
    return abs(value) > 1e-12 * abs(scale)


def format_step(breakdown: StepBreakdown) -> list[str]:
    """The step's lines (those that are not 0), each with its share, and their total."""
    out = [f"time of pipeline rank {breakdown.rank}, which finishes last (s per iteration):"]
    for name, value in breakdown.lines():
        if _shown(value, breakdown.seconds):
            share = 100 * value / breakdown.seconds
            out.append(f"  {STEP_LINES[name]:<52} {value:>11.4g} {share:>6.1f}%")
    if abs(breakdown.residual) > 1e-9 * breakdown.seconds:
        out.append(f"  {'difference (float round-off)':<52} {breakdown.residual:>11.4g}")
    out.append(f"  {'predicted step':<52} {breakdown.seconds:>11.4g} {100.0:>6.1f}%")
    notes = [f"lines not shown are 0; a pipeline message costs {breakdown.p2p_message:.3g} s"]
    if breakdown.grad_reduce:
        notes.append(
            f"its gradient reduction takes {breakdown.grad_reduce:.4g} s, run under its last "
            "backward but for the exposed part in the data-parallel line"
        )
    notes.append(
        f"idle share of all pipeline ranks' time, the table's bubble: "
        f"{100 * breakdown.bubble_fraction:.1f}%"
    )
    return out + [f"  ({note})" for note in notes]


def format_memory(memory: list[MemoryBreakdown], usable: float) -> list[str]:
    """Every pipeline rank's memory lines in GiB, worst first; activations as
    microbatch-chunks in flight × mean GiB each."""
    names = [name for name in MEMORY_LINES if name != "activations"]
    heads = [_SHORT.get(name, name) for name in names]
    out = [
        f"memory per pipeline rank (GiB of {usable / _GIB:.1f} usable), worst first:",
        "  rank"
        + "".join(f"{h:>10}" for h in heads)
        + f"{'activations (in flight × each)':>34}"
        + f"{'total':>9}",
    ]
    for m in memory:
        values = "".join(f"{getattr(m, name) / _GIB:>10.2f}" for name in names)
        flight = f"{m.in_flight:g} × {m.per_microbatch / _GIB:.3g} = {m.activations / _GIB:.2f}"
        out.append(f"  {m.pp_rank:>4}{values}{flight:>34}{m.total / _GIB:>9.2f}")
    return out


_SHORT = {"optimizer": "optimizer", "grads": "gradients"}


def format_explanation(explanation: Explanation) -> str:
    """The step's and the memory's breakdown of one layout as text."""
    step, peak = explanation.step_time, explanation.peak
    mfu = "" if step.mfu is None else f", MFU {100 * step.mfu:.1f}%"
    fits = "" if peak.total <= explanation.usable_memory else " (over the usable memory)"
    head = (
        f"{explanation.name}: step {step.seconds:.4g} s, "
        f"{step.tokens_per_second_per_gpu:.1f} tok/s/GPU{mfu}, "
        f"peak {peak.total / _GIB:.1f} GiB on pipeline rank {peak.pp_rank}{fits}"
    )
    lines = [head, *format_step(explanation.step)]
    lines += format_memory(explanation.memory, explanation.usable_memory)
    return "\n".join(lines)


def format_comparison(a: Explanation, b: Explanation) -> str:
    """Two layouts side by side: every row of :func:`comparison_rows` with B − A."""
    lines = [
        f"A: {a.name} (rank {a.step.rank} finishes last, peak memory on rank {a.peak.pp_rank})",
        f"B: {b.name} (rank {b.step.rank} finishes last, peak memory on rank {b.peak.pp_rank})",
        f"{'':<54}{'A':>12}{'B':>12}{'B − A':>12}",
    ]
    whole = {"step": max(a.step.seconds, b.step.seconds), "memory": max(a.peak.total, b.peak.total)}
    for key, x, y, diff in comparison_rows(a, b):
        if key == "step.compute":
            lines.append("time (s per iteration):")
        elif key == "memory.weights":
            lines.append("memory of the worst rank (GiB):")
        label, scale = _label(key)
        group = key.split(".")[0]
        if group in whole and not (_shown(x, whole[group]) or _shown(y, whole[group])):
            continue  # a term neither layout has
        lines.append(f"{label:<54}{x * scale:>12.4g}{y * scale:>12.4g}{diff * scale:>+12.4g}")
    return "\n".join(lines)
