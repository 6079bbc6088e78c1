"""Measure the peak memory of layouts with pretrain_gpt.py and compare it with the planner.

The command line of ``tools/check_memory_model.py``. Each layout trains three iterations of
the CPU demo's model under torchrun (gloo, dropout off) with ``--profile-iteration 2``; the
profile's peak live tensor bytes of every pipeline rank (tensor- and data-parallel rank 0)
is printed next to :func:`megapp.planning.memory.predict_memory` as a markdown table.

    python tools/check_memory_model.py            # the layouts of docs/planning.md
    python tools/check_memory_model.py --layout "Layout(tp=2, pp=2, dp=2)"
    python tools/check_memory_model.py --layout "pp=2, dp=4, zero_stage=3"
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

from megapp.planning.layout import Layout, pretrain_config
from megapp.planning.memory import predict_memory
from megapp.planning.models import MODELS
from megapp.training.launch import run_pretrain
from megapp.training.metrics import read_records

MODEL = [*MODELS["tiny"].flags, "--hidden-dropout", "0", "--attention-dropout", "0"]
EXPERTS = [
    *("--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "256"),
    "--moe-router-force-load-balancing",
]
"""A layout with ep > 1 runs the model with these experts in every layer (4 of width 256, 2
per token, the all-to-all dispatcher), routed by random logits: balanced, as the planner prices
them (an untrained router sends most pairs to one rank's experts here)."""
GLOBAL_BATCH = 16
TIMEOUT_S = 900.0
LAYOUTS = (
    Layout(),
    Layout(pp=2),
    Layout(tp=2, pp=2),
    Layout(tp=2, pp=2, dp=2, micro_batch_size=2),
    Layout(pp=4, dp=2, micro_batch_size=2),
    Layout(pp=2, dp=4, vpp=2),
    Layout(pp=2, vpp=3, embedding_in_split=True, loss_in_split=True),  # chunks of 0 and 1 layer
    Layout(tp=2, pp=2, dp=2, vpp=2, schedule="zb-v"),
    Layout(tp=2, pp=4, schedule="zb-h1"),
    Layout(pp=2, dp=2, schedule="zb-h1"),  # two layers a chunk: I's store grows through them
    Layout(tp=2, pp=2, dp=2, sequence_parallel=True, recompute="selective"),
    Layout(tp=2, pp=2, dp=2, recompute="full"),
    Layout(pp=2, dp=4, zero_stage=2),
    Layout(pp=2, dp=4, zero_stage=3),
)

_TRUE, _FALSE = ("true", "1", "on"), ("false", "0", "off")
_NONE = ("none", "")


def _field_value(field: dataclasses.Field, text: str) -> Any:
    """``text`` as a value of the Layout field ``field`` (int, an int or None, bool, or a
    word or None)."""
    word = text.strip().strip("'\"")
    if field.type == "int | None" and word.lower() in _NONE:
        return None
    if field.type in ("int", int, "int | None"):
        if not word.lstrip("-").isdigit():
            raise ValueError(f"{field.name} is an integer, got {text.strip()!r}")
        return int(word)
    if field.type in ("bool", bool):
        if word.lower() not in _TRUE + _FALSE:
            raise ValueError(f"{field.name} is true or false, got {text.strip()!r}")
        return word.lower() in _TRUE
    return None if word.lower() in _NONE else word


def parse_layout(text: str) -> Layout:
    """A :class:`Layout` from ``"Layout(tp=2, pp=2)"`` or ``"tp=2, pp=2"``: its fields as
    ``name=value`` pairs, read as data (nothing is evaluated); ValueError names what is
    wrong."""
    body = text.strip()
    if body.startswith("Layout(") and body.endswith(")"):
        body = body[len("Layout(") : -1]
    fields = {f.name: f for f in dataclasses.fields(Layout)}
    values: dict[str, Any] = {}
    for item in (part.strip() for part in body.split(",")):
        if not item:
            continue
        name, equals, value = (piece.strip() for piece in item.partition("="))
        if not equals or name not in fields:
            raise ValueError(
                f"{item!r} in {text!r} is not name=value with a Layout field ({', '.join(fields)})"
            )
        try:
            values[name] = _field_value(fields[name], value)
        except ValueError as error:
            raise ValueError(f"{item!r} in {text!r}: {error}") from None
    return Layout(**values)


def model_flags(layout: Layout) -> list[str]:
    """The model a layout is measured on: the CPU demo's, with :data:`EXPERTS` where the
    layout splits experts."""
    return [*MODEL, *EXPERTS] if layout.ep > 1 else MODEL


def measure(layout: Layout, workdir: str | Path) -> dict:
    """The profile record of one run of ``layout``; SystemExit with the run's output when
    it fails."""
    metrics = Path(workdir) / f"{layout.name}.jsonl"
    flags = [*model_flags(layout), *layout.flags(4), "--global-batch-size", str(GLOBAL_BATCH)]
    flags += ["--lr", "1e-3", "--train-iters", "3", "--profile-iteration", "2"]
    flags += ["--eval-iters", "0", "--use-default-corpus", "--metrics-path", str(metrics)]
    done = run_pretrain(layout.world_size, flags, timeout_s=TIMEOUT_S)
    if done.returncode != 0:
        why = f"stopped after {TIMEOUT_S:.0f} s" if done.timed_out else "failed"
        raise SystemExit(f"{layout.name} {why}:\n{done.stderr[-3000:]}")
    return read_records(metrics, "profile")[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="check_memory_model.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--layout", action="append", help='a layout, "Layout(tp=2, pp=2)" or "tp=2, pp=2"'
    )
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    try:
        layouts = [parse_layout(text) for text in args.layout] if args.layout else LAYOUTS
    except ValueError as error:
        parser.error(str(error))
    print("$ python tools/check_memory_model.py " + shlex.join(argv))
    print("\n| layout | pp rank | measured MB | predicted MB | error |")
    print("|:--|--:|--:|--:|--:|")
    with tempfile.TemporaryDirectory() as workdir:
        for layout in layouts:
            profile = measure(layout, workdir)
            config = pretrain_config(layout, model_flags(layout), GLOBAL_BATCH)
            predicted = predict_memory(config, MODELS["tiny"].vocab_size)
            for rank in profile["ranks"]:
                if rank["tp"] or rank["dp"]:
                    continue
                peak, guess = rank["peak_bytes"], predicted[rank["pp"]].total
                print(
                    f"| {layout.name} | {rank['pp']} | {peak / 1e6:.3f} | {guess / 1e6:.3f} "
                    f"| {100 * (guess / peak - 1):+.1f}% |",
                    flush=True,
                )
    return 0
