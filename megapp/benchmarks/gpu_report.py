"""The markdown page of the GPU check (``tools/gpu_check.sh``): one table of stages, then each
stage's figures and the end of the output of every stage that did not succeed."""

from __future__ import annotations

import os
from pathlib import Path

from megapp.benchmarks.common import ROOT, fmt, markdown_table


def shown_path(path: Path) -> str:
    """``path`` relative to the repository when it lies inside it."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _kernels(details: dict) -> list[str]:
    rows = [
        [r["op"], r["dtype"], r["pass"], fmt(r["gbps"], ".0f"), fmt(r["hbm_pct"], ".0f")]
        for r in details.get("rows", [])
    ]
    peak = fmt(details.get("hbm_peak_tbps"), "g")
    return [
        f"megapp's fused ops on {details.get('device')}, GB/s of the minimal traffic (every "
        f"input read once, every output written once) and its share of the {peak} TB/s HBM "
        "peak (`megapp.training.flops`); 85% is the target:",
        "",
        markdown_table(["op", "dtype", "pass", "GB/s", "% of HBM peak"], rows, align="lllrr"),
    ]


def _gpt(d: dict) -> list[str]:
    mfu = "unknown (no peak for this device)" if d.get("mfu") is None else f"{d['mfu']:.1%}"
    return [
        f"- device {d['device']}, {d['dtype']}, {d['parameters'] / 1e6:.1f}M parameters",
        f"- {d['iteration_s'] * 1e3:.1f} ms per iteration, {d['tokens_per_s']:.0f} tokens/s, "
        f"{d['flops_per_iteration'] / 1e12:.2f} TFLOP per iteration (model FLOPs)",
        f"- {d['tflops_per_device']:.1f} TFLOP/s; MFU {mfu} of {d['peak_tflops']} TFLOP/s",
        f"- max memory allocated {fmt(d['max_memory_allocated_gib'], '.2f')} GiB",
    ]


def _tests(details: dict) -> list[str]:
    failures = details.get("failures", [])
    return [f"- {f}" for f in failures] or ["Every selected CUDA test passed or was skipped."]


def _nccl(details: dict) -> list[str]:
    return [
        f"- {name}: iteration {d['iteration']}, lm loss {fmt(d['lm_loss'], '.4f')}, "
        f"{fmt(d['tflops_per_device'], '.2f')} TFLOP/s per GPU"
        for name, d in details.items()
    ]


SECTIONS = {
    "tests": ("CUDA tests", _tests),
    "kernels": ("Kernel bandwidth", _kernels),
    "gpt": ("GPT training step: MFU", _gpt),
    "nccl": ("NCCL smoke run", _nccl),
}


def markdown_report(report: dict, figures: Path) -> str:
    """The page for ``report`` (the JSON that the GPU check writes to ``figures``)."""
    lines = [
        "# GPU check",
        "",
        f"Written by `tools/gpu_check.sh` (`megapp.benchmarks.gpu_check`); every figure is also in "
        f"`{shown_path(figures)}`, and each command's whole output was in `{report['logs']}` "
        "on the machine that ran it.",
        "",
        f"- command: `{report['command']}`",
        f"- started {report['started']}, {report['seconds']:.0f} s in all",
        f"- machine: {report['machine']}",
        f"- GPUs: {', '.join(report['gpus']) or 'none'}",
        f"- sources: {report['sources']}",
        "",
    ]
    rows = [
        [s["name"], s["status"], f"{s['seconds']:.1f}", fmt(s["limit_s"], ".0f"), s["summary"]]
        for s in report["stages"]
    ]
    header = ["stage", "status", "seconds", "limit s", "summary"]
    lines += [markdown_table(header, rows, align="llrrl"), ""]
    for s in report["stages"]:
        if (s["name"] in SECTIONS and s["status"] == "ok") or (
            s["name"] == "tests" and s["details"]
        ):
            title, render = SECTIONS[s["name"]]
            lines += [f"## {title}", "", *render(s["details"]), ""]
    failed = [s for s in report["stages"] if s["status"] in ("failed", "timeout")]
    if failed:
        lines += ["## Output of the stages that did not succeed", ""]
        for s in failed:
            commands = os.linesep.join(f"$ {c}" for c in s["commands"])
            lines += [f"### {s['name']} ({s['status']})", "", "```text", commands, s["tail"]]
            lines += ["```", ""]
    return "\n".join(lines)
