"""``python -m megapp.plan``: the fastest layouts of a model on N devices that fit, and the
``torchrun`` line of each.

``python -m megapp.plan --model gpt3-175b --gpus 1024 --gpus-per-node 8 --gpu h100
--global-batch-size 1536 --seq-length 2048 --top-k 5`` prints the fastest layouts that fit
(memory per device, iteration time, throughput, MFU, bubble) and the ``torchrun`` line of
each; ``--explain`` adds where each one's time and memory go
(:mod:`megapp.planning.explain`), ``--layout NAME`` explains one layout without searching,
``--compare A B`` puts two side by side (names as the table's ``layout`` column prints
them). The search is :class:`~megapp.planning.search.Planner`'s; ``--gpu`` takes a device
profile or a CPU machine's (:func:`~megapp.planning.profiles.load_profile`). Context
parallelism is searched for sequences over
:data:`~megapp.planning.layout_space.LONG_SEQUENCE` tokens, or at the sizes ``--cp`` gives.
"""

from __future__ import annotations

import argparse
import gc
import shlex
import sys
from collections.abc import Sequence

from megapp.pipeline_parallel.catalog import SCHEDULES
from megapp.planning import explain, explain_text
from megapp.planning.layout import CP_COMM_TYPES, Layout
from megapp.planning.layout_space import LONG_SEQUENCE, MAX_AUTO_CP, Space, why_empty
from megapp.planning.models import BYTE_VOCAB, ModelPreset, load_model
from megapp.planning.profiles import load_profile, time_model
from megapp.planning.search import Planner, PlanResult
from megapp.training.flag_groups import ArgumentsError

__all__ = ["Planner", "build_parser", "command_line", "format_table", "main"]

_GIB = 2**30

RUN_FLAGS = ("--lr", "1e-4", "--train-iters", "1000")
"""What ``pretrain_gpt.py`` needs besides the model and the layout; ``--run-flags`` replaces
it (data and tokenizer flags belong there)."""


def command_line(
    layout: Layout,
    model: ModelPreset,
    gpus: int,
    gpus_per_node: int,
    global_batch_size: int,
    run_flags: Sequence[str] = RUN_FLAGS,
) -> str:
    """The ``torchrun`` line that trains ``model`` under ``layout``; a model on megapp's
    byte tokens trains on the built-in corpus."""
    per_node = min(gpus, gpus_per_node)
    launch = ["torchrun", "--nproc-per-node", str(per_node)]
    if gpus > per_node:
        launch += ["--nnodes", str(gpus // per_node)]
    flags = [*model.flags, *layout.flags(model.num_layers)]
    flags += ["--global-batch-size", str(global_batch_size), *run_flags]
    if model.vocab_size == BYTE_VOCAB and not any(f.startswith("--data-path") for f in run_flags):
        flags.append("--use-default-corpus")
    return shlex.join([*launch, "pretrain_gpt.py", *flags])


def format_table(
    result: PlanResult,
    model: ModelPreset,
    gpus: int,
    gpus_per_node: int,
    global_batch_size: int,
    run_flags: Sequence[str] = RUN_FLAGS,
) -> str:
    """The top-k table, a command line under each row."""
    head = (
        f"{'#':>2}  {'layout':<48} {'mem GiB':>8} {'step s':>9} {'tok/s/GPU':>10} "
        f"{'TFLOP/s':>8} {'MFU':>6} {'bubble':>7}"
    )
    lines = [head]
    for i, planned in enumerate(result.best, 1):
        step = planned.step
        mfu = "-" if step.mfu is None else f"{100 * step.mfu:.1f}%"
        lines.append(
            f"{i:>2}  {planned.layout.name:<48} {planned.memory_bytes / _GIB:>8.1f} "
            f"{step.seconds:>9.4g} {step.tokens_per_second_per_gpu:>10.1f} "
            f"{step.tflops_per_gpu:>8.4g} {mfu:>6} {100 * step.bubble:>6.1f}%"
        )
        cmd = command_line(planned.layout, model, gpus, gpus_per_node, global_batch_size, run_flags)
        lines.append(f"    {cmd}")
    return "\n".join(lines)


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="python -m megapp.plan", description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--model", required=True, help="a preset (megapp.planning.models) or a flags file")
    add("--vocab-size", type=_positive, help="tokenizer vocabulary (flag files)")
    add("--gpus", type=_positive, required=True, help="devices in the job")
    add("--gpus-per-node", type=_positive, help="default: the hardware's")
    add(
        "--gpu",
        default="h100",
        help="h100, h200, a100 (with -ops: priced by operation) or a JSON profile",
    )
    add("--global-batch-size", type=_positive, required=True)
    add("--seq-length", type=_positive, help="default: the model's")
    add("--top-k", type=_positive, default=5)
    add("--max-micro-batch-size", type=_positive, default=8)
    add("--max-chunks", type=_positive, default=8, help="virtual stages per rank")
    add("--schedules", nargs="+", choices=list(SCHEDULES), default=list(SCHEDULES))
    add(
        "--cp",
        type=_positive,
        nargs="+",
        help=f"context-parallel sizes (default: 1, and for sequences over {LONG_SEQUENCE} "
        f"tokens every divisor of --gpus up to {MAX_AUTO_CP})",
    )
    add("--cp-comm-types", nargs="+", choices=CP_COMM_TYPES, default=list(CP_COMM_TYPES))
    add(
        "--ep",
        type=_positive,
        nargs="+",
        help="expert-parallel sizes of a --num-experts model (default: every divisor of its "
        "experts that the layout's ranks allow; a dense model runs ep 1 alone)",
    )
    add("--run-flags", default=shlex.join(RUN_FLAGS), help="appended to every command (data)")
    add("--explain", action="store_true", help="break down each layout's time and memory")
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--layout",
        metavar="NAME",
        help="explain this layout alone, no search (a name as the table's layout column "
        f"prints it: {explain.LAYOUT_FORMAT})",
    )
    which.add_argument(
        "--compare",
        nargs=2,
        metavar=("A", "B"),
        help="two layouts' breakdowns side by side with B − A, no search (names as --layout)",
    )
    add("--calibrate", action="store_true", help="measure this machine (--gpus processes)")
    add("--hardware-out", default="runs/calibration/hardware.json", help="--calibrate's file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    frozen_before = gc.get_freeze_count()
    try:
        return _run(build_parser().parse_args(argv))
    finally:
        if not frozen_before:  # what the run froze is the collector's again (in-process)
            gc.unfreeze()


def _run(args: argparse.Namespace) -> int:
    try:
        model = load_model(args.model, args.vocab_size)
        if args.seq_length is not None:
            model = model.with_seq_length(args.seq_length)
        if args.calibrate:  # a CPU machine whose processes share its cores
            from megapp.planning.shared_cores.calibrate import calibrate

            profile = time_model(calibrate(args.gpus, args.hardware_out))
        else:
            profile = time_model(load_profile(args.gpu))
        gpn = args.gpus_per_node or profile.hardware.gpus_per_node
        if args.gpus > gpn and args.gpus % gpn:
            raise ValueError(f"--gpus {args.gpus} is not a whole number of {gpn}-GPU nodes")
        profile = profile.with_gpus_per_node(gpn)
        planner = Planner(model, profile, args.global_batch_size, args.gpus)
        if args.layout or args.compare:
            run_flags = shlex.split(args.run_flags)
            return _explain_named(planner, args.layout, args.compare, run_flags)
        space = Space(
            args.max_micro_batch_size,
            args.max_chunks,
            tuple(args.schedules),
            cp=tuple(args.cp) if args.cp else None,
            cp_comm_types=tuple(args.cp_comm_types),
            ep=tuple(args.ep) if args.ep else None,
        )
        bar = _ProgressBar() if sys.stderr.isatty() else None
        try:
            result = planner.plan(gpn, args.top_k, space, progress=bar)
        finally:
            if bar is not None:
                bar.close()
        # The search left millions of small objects in the planner's caches: keep the
        # collector from scanning them again while the answer is printed.
        gc.freeze()
    except (ArgumentsError, ValueError) as error:  # a ScheduleError too: a layout's deadlock
        print(f"python -m megapp.plan: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    hardware = planner.hardware
    cp = space.cp_sizes(model.seq_length, args.gpus)
    cp_text = "" if cp == (1,) else ", cp " + " ".join(map(str, cp))
    if cp != (1,) and planner.base.attention_dropout:
        cp_text += f" (refused: attention dropout {planner.base.attention_dropout})"
    print(
        f"{args.model} on {args.gpus} × {hardware.name} ({gpn} per node), global batch "
        f"{args.global_batch_size}, sequence {model.seq_length}{cp_text}: "
        f"{result.enumerated} layouts, "
        f"{result.over_memory} over {hardware.usable_memory / _GIB:.1f} GiB, "
        f"{result.invalid} refused, {result.deadlocks} deadlock on this transport, "
        f"{result.timed} simulated"
        + (f", {result.rescaled} bounded by their schedule's run" if result.rescaled else "")
        + f" in {result.seconds:.1f} s"
    )
    if not result.enumerated:  # the arithmetic left nothing to check or fit
        why = why_empty(
            planner.base, args.gpus, gpn, args.global_batch_size, space, seq_length=model.seq_length
        )
        print(f"python -m megapp.plan: error: no layout: {why}", file=sys.stderr)
        return 2
    if not result.best:
        why = "no layout fits in memory"
        if result.invalid or result.deadlocks:
            why = (
                f"no layout can run: {result.over_memory} over memory, {result.invalid} "
                f"refused by pretrain_gpt.py's checks, {result.deadlocks} deadlock on this "
                "transport"
            )
        print(f"python -m megapp.plan: error: {why}", file=sys.stderr)
        return 1
    run_flags = shlex.split(args.run_flags)
    print(format_table(result, model, args.gpus, gpn, args.global_batch_size, run_flags))
    if args.explain:
        for i, planned in enumerate(result.best, 1):
            print(f"\n#{i} {explain_text.format_explanation(_explained(planner, planned.layout))}")
    return 0


class _ProgressBar:
    """A tqdm counter on stderr for each phase of the search (layouts bounded, then
    simulated), gone once the search ends; for a terminal only."""

    def __init__(self) -> None:
        self.bar, self.phase = None, None

    def __call__(self, phase: str) -> None:
        if phase != self.phase:
            from tqdm import tqdm

            self.close()
            self.bar = tqdm(desc=phase, unit=" layouts", file=sys.stderr, leave=False)
            self.phase = phase
        self.bar.update()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _explained(planner: Planner, layout: Layout) -> explain.Explanation:
    """:func:`~megapp.planning.explain.explain_layout` of ``layout`` on ``planner``'s
    model, batch, devices and time model."""
    model = planner.model
    return explain.explain_layout(
        layout, model.flags, model.vocab_size, planner.gbs, planner.gpus, planner.time
    )


def _explain_named(
    planner: Planner, name: str | None, pair: Sequence[str] | None, run_flags: Sequence[str]
) -> int:
    """Print the breakdown and the command of the layout called ``name``, or the
    comparison of the ``pair``; raises ``ValueError`` in one line where one is not valid."""
    if name is not None:
        layout = explain.parse_layout(name)
        print(explain_text.format_explanation(_explained(planner, layout)))
        model, hardware = planner.model, planner.hardware
        gpn = hardware.gpus_per_node
        print(command_line(layout, model, planner.gpus, gpn, planner.gbs, run_flags))
        return 0
    a, b = (_explained(planner, explain.parse_layout(n)) for n in pair)
    print(explain_text.format_comparison(a, b))
    return 0


if __name__ == "__main__":
    status = main()
    # The search's caches hold millions of small objects until the process ends: keep the
    # interpreter's last collection from scanning them all (seconds on a large search).
    gc.freeze()
    sys.exit(status)
