"""Published Megatron runs against megapp's planner: the same layout predicted, and the
planner's own pick for the same model, GPUs and batch. The command line of
``tools/compare_published.py``:

    python tools/compare_published.py [--no-pick | --pick-max-gpus N] [--match gpt3-530b ...]

For every run of :data:`megapp.planning.published_runs.RUNS` the tool builds the run's
layout with :class:`~megapp.planning.layout.Layout` and the model preset, predicts its
iteration with :func:`~megapp.planning.timing.predict_step_time` on the run's GPU
profile (:mod:`megapp.planning.hardware`) and its memory per GPU with
:func:`~megapp.planning.memory.predict_memory`, and asks :class:`megapp.plan.Planner`
for its fastest layout. It prints one markdown table row per run:

- the published layout as megapp names it, and megapp's pick;
- the published TFLOP/s per GPU, megapp's prediction for the published layout counted
  the way the source counts (with recompute's rerun forward where it does) and their
  ratio;
- the same prediction with the tensor-parallel collectives taken off the critical path
  entirely ("hiding tp": no collective exposed, no matmul slowed; a run with
  ``--tp-comm-overlap``, as the H100 table's, is predicted with what the overlap leaves);
- the predicted memory of the fullest GPU against the GPU's memory.

A source that counts causal attention over half the ``s × s`` square
(``counts_causal_half``) is compared with a prediction counted the same way.

What a source leaves open is filled in and listed under "assumed": sequence parallelism
with tp > 1, the distributed optimizer with dp > 1 (or cp > 1: it shards over dp × cp),
the ring (``p2p``) for context parallelism, and the micro-batch size (1 to 8) and
recompute (none, selective, full) megapp predicts fastest among those whose predicted
memory fits, as a tuned run would have them. A run whose source splits the layers
unevenly over the pipeline (``stage_layers``) runs with
``--decoder-first/last-pipeline-num-layers``, one whose source counts the embedding and the
loss as layers of the split with ``--account-for-embedding/loss-in-pipeline-split``.
FP8 runs are predicted in 16-bit, so their ratio is not a test of the model. The planner's
search takes minutes past a thousand GPUs; ``--pick-max-gpus`` bounds where it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from megapp.models.gpt import GPTConfig
from megapp.plan import Planner
from megapp.planning.hardware import PROFILES, Hardware
from megapp.planning.layout import RECOMPUTE, Layout, pretrain_config
from megapp.planning.memory import peak_bytes, predict_memory
from megapp.planning.models import MODELS, ModelPreset
from megapp.planning.published_runs import (
    KORTHIKANTI_2022,
    MT_NLG,
    NARAYANAN_2021,
    RUNS,
    STACKS,
    PublishedRun,
    source_label,
)
from megapp.planning.timing import predict_step_time
from megapp.training.config import PretrainConfig
from megapp.training.flag_groups import ArgumentsError
from megapp.training.flops import layer_flops

GIB = 2**30
GPUS_PER_NODE = 8
MICRO_BATCH_SIZES = [1, 2, 4, 8]


def hardware_for(run: PublishedRun, ops: bool = False) -> Hardware:
    """The built-in profile of ``run.gpu`` (``a100-80gb``: ``a100``); with ``ops`` the same
    device priced operation by operation (``a100-ops``, ...)."""
    part, memory = run.gpu.split("-")
    hardware = PROFILES[f"{part}-ops" if ops else part]
    if abs(hardware.memory_bytes - int(memory.removesuffix("gb")) * GIB) > 2 * GIB:
        raise ValueError(f"{run.name}: no built-in profile of {run.gpu}")
    return hardware


def peak_memory(config: PretrainConfig, vocab_size: int, hardware: Hardware) -> float:
    """Predicted bytes on the fullest GPU of ``config`` on ``hardware``."""
    return peak_bytes(predict_memory(config, vocab_size, hardware.transport))


MATERIALIZED_ATTENTION = (NARAYANAN_2021, KORTHIKANTI_2022, MT_NLG)
"""Sources whose runs (2021-2022) computed attention with materialized scores and apex's
fused softmax, before flash attention (Korthikanti et al.'s selective recompute reruns just
those scores): priced so by the operation model."""


FIT_SOURCE = NARAYANAN_2021
"""The one source a constant of the operation model is fitted on (the A100's compute share,
:data:`megapp.planning.op_profiles.A100_COMPUTE_FIT`); every other run is held out."""


REDUCE_AFTER_BACKWARD = (NARAYANAN_2021, MT_NLG)
"""Sources whose code reduced the data-parallel gradients after the whole backward, not
bucket by bucket under it: Megatron-LM of 2021 (``--DDP-impl local``, its default, calls
``allreduce_gradients`` once ``forward_backward_func`` returns) and DeepSpeed's pipeline
engine (``ReduceGrads`` after the schedule's last step). Their runs are predicted with
``--no-overlap-grad-reduce``."""


def model_flags(run: PublishedRun, model: ModelPreset, ops: bool = False) -> tuple[str, ...]:
    """The model's flags for ``run``: the preset's, with the run's token dispatcher (and
    its node) where it is not the all-to-all, the source's uneven first and last
    pipeline stages where it gives them, ``--no-overlap-grad-reduce`` for the runs of
    :data:`REDUCE_AFTER_BACKWARD`, ``--tp-comm-overlap`` where the run overlapped; with
    ``ops``, the materialized attention of the runs of :data:`MATERIALIZED_ATTENTION`."""
    flags = model.flags
    if run.dispatcher != "alltoall":  # its node: the GPUs a node holds, over etp
        node = hardware_for(run).gpus_per_node // (run.etp or run.tp)
        flags = (*flags, "--moe-token-dispatcher-type", run.dispatcher)
        flags = (*flags, "--moe-dispatch-node-size", str(node))
    if ops and run.source in MATERIALIZED_ATTENTION:
        flags = (*flags, "--attention-backend", "fused_softmax")
    if run.source in REDUCE_AFTER_BACKWARD:
        flags = (*flags, "--no-overlap-grad-reduce")
    if run.tp_comm_overlap:
        flags = (*flags, "--tp-comm-overlap")
    if run.stage_layers is None:
        return flags
    first, last = run.stage_layers
    return (
        *flags,
        *("--decoder-first-pipeline-num-layers", str(first)),
        *("--decoder-last-pipeline-num-layers", str(last)),
    )


def published_layout(
    run: PublishedRun, model: ModelPreset, hardware: Hardware
) -> tuple[Layout, PretrainConfig, list[str]]:
    """The run's layout, its checked config and the fields assumed where the source is
    silent; raises :class:`ArgumentsError` where ``pretrain_gpt.py`` would refuse it.
    An unstated micro-batch size or recompute is the fastest predicted choice that fits,
    as a tuned run would have it."""
    assumed = []
    sp = run.sequence_parallel
    if sp is None:
        sp = run.tp > 1
        assumed.append("sp" if sp else "no sp")
    zero = run.distributed_optimizer
    if zero is None:
        zero = run.dp * run.cp > 1
        assumed.append("distributed optimizer" if zero else "no ZeRO")
    comm_type = run.cp_comm_type
    if comm_type is None:
        comm_type = "p2p"
        if run.cp > 1:
            assumed.append("cp p2p")
    base = Layout(
        tp=run.tp,
        pp=run.pp,
        dp=run.dp,
        vpp=run.vpp,
        sequence_parallel=sp,
        zero_stage=int(zero),
        cp=run.cp,
        cp_comm_type=comm_type,
        ep=run.ep,
        etp=run.etp,
        embedding_in_split=run.counts_embedding_and_loss,
        loss_in_split=run.counts_embedding_and_loss,
    )
    flags = model_flags(run, model, ops=hardware.ops is not None)
    per_replica = run.global_batch_size // run.dp
    sizes = [run.micro_batch_size] if run.micro_batch_size else MICRO_BATCH_SIZES
    stated = run.recompute is not None
    recomputes = [None if run.recompute == "none" else run.recompute] if stated else RECOMPUTE
    candidates = [
        dataclasses.replace(base, micro_batch_size=mbs, recompute=recompute)
        for mbs in sizes
        if per_replica % mbs == 0
        for recompute in recomputes
    ]
    best = None
    for layout in candidates:
        try:
            config = pretrain_config(layout, flags, run.global_batch_size)
        except ArgumentsError:  # e.g. too few microbatches for the schedule; where every
            continue  # candidate is refused, the fallback below raises the refusal
        fits = peak_memory(config, model.vocab_size, hardware) <= hardware.usable_memory
        if len(candidates) > 1 and not fits:
            continue
        seconds = predict_step_time(config, model.vocab_size, hardware).seconds
        if best is None or seconds < best[0]:
            best = (seconds, layout, config)
    if best is None:  # nothing fits: the heaviest recompute at the smallest microbatch
        layout = candidates[len(recomputes) - 1]
        best = (0.0, layout, pretrain_config(layout, flags, run.global_batch_size))
    _, layout, config = best
    if not run.micro_batch_size:
        assumed.append(f"mb{layout.micro_batch_size}")
    if not stated:
        assumed.append(f"recompute {layout.recompute or 'none'}")
    return layout, config, assumed


def causal_half_flops(gpt: GPTConfig, run: PublishedRun) -> float:
    """The FLOPs of one iteration's causal attention cores over the half of the ``s × s``
    square that megapp's count has and a source counting only the causal half does not:
    forward and backward (three times the forward's)."""
    core = layer_flops(gpt, run.seq_length)[1]  # per token and layer, the whole square
    return 3 * gpt.num_layers * core / 2 * run.global_batch_size * run.seq_length


@dataclass
class Row:
    """One line of the comparison."""

    run: PublishedRun
    layout: str = ""
    assumed: str = ""
    predicted: float | None = None  # TFLOP/s per GPU, counted as the source counts
    hiding_tp: float | None = None  # the same with tensor-parallel collectives hidden
    memory: float | None = None  # bytes on the fullest GPU
    capacity: float = 0.0
    pick: str = ""
    pick_tflops: float | None = None
    pick_speedup: float | None = None  # published layout's predicted time / pick's
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.predicted is None:
            return None
        return self.predicted / self.run.tflops_per_gpu


def compare(
    run: PublishedRun, pick: bool, ops: bool = False, hardware: Hardware | None = None
) -> Row:
    """Predict ``run``'s layout and, with ``pick``, the planner's best layout; ``ops``: on
    the profile priced operation by operation; ``hardware``: on this profile instead of
    the run's GPU's built-in one."""
    hardware = hardware or hardware_for(run, ops)
    model = MODELS[run.model].with_seq_length(run.seq_length)
    row = Row(run, capacity=hardware.memory_bytes)
    seconds = None
    try:
        layout, config, assumed = published_layout(run, model, hardware)
    except (ArgumentsError, ValueError) as error:
        row.note = f"megapp refuses the layout: {' '.join(str(error).split())}"
    else:
        step = predict_step_time(config, model.vocab_size, hardware)
        seconds = step.seconds
        recompute = step.breakdown["recompute_flops"] / step.seconds / run.gpus / 1e12
        row.predicted = step.tflops_per_gpu + (recompute if run.counts_recompute else 0.0)
        if run.counts_causal_half:
            half = causal_half_flops(config.gpt_config(model.vocab_size), run)
            row.predicted -= half / step.seconds / run.gpus / 1e12
        hidden = step.seconds - step.breakdown["tensor_parallel"]
        row.hiding_tp = row.predicted * step.seconds / hidden
        row.memory = peak_memory(config, model.vocab_size, hardware)
        row.layout, row.assumed = layout.name, ", ".join(assumed)
        if run.stage_layers is not None:
            row.layout += " ({}, ..., {} layers)".format(*run.stage_layers)
        if row.memory > hardware.usable_memory:
            row.note = "over memory"
    if run.precision == "fp8":
        row.note = "; ".join(filter(None, [row.note, "FP8 run, predicted in 16-bit"]))
    if pick:
        planner = Planner(model, hardware, run.global_batch_size, run.gpus)
        result = planner.plan(GPUS_PER_NODE, top_k=1)
        if result.best:
            best = result.best[0]
            row.pick, row.pick_tflops = best.layout.name, best.step.tflops_per_gpu
            if seconds is not None:
                row.pick_speedup = seconds / best.step.seconds
        else:
            row.pick = (
                f"nothing fits: {result.over_memory} of {result.enumerated} layouts over "
                f"memory, {result.invalid} refused"
            )
    else:
        row.pick = "not searched"
    return row


def _num(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def markdown(rows: list[Row]) -> str:
    """The comparison as a markdown table."""
    lines = [
        "| run | published layout (megapp's name) | assumed | published TFLOP/s | "
        "predicted | pred / pub | hiding tp | memory GiB (of) | megapp's pick | "
        "pick TFLOP/s | pick speed-up | note |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    for row in rows:
        run = row.run
        counted = " (hw)" if run.counts_recompute else " (½)" if run.counts_causal_half else ""
        gib = None if row.memory is None else row.memory / GIB
        memory = f"{_num(gib, '.1f')} ({row.capacity / GIB:.0f})"
        lines.append(
            f"| {run.name} | {row.layout or _stated(run)} | {row.assumed} | "
            f"{run.tflops_per_gpu:g}{counted} | {_num(row.predicted, '.1f')} | "
            f"{_num(row.ratio, '.2f')} | {_num(row.hiding_tp, '.1f')} | {memory} | {row.pick} | "
            f"{_num(row.pick_tflops, '.1f')} | {_num(row.pick_speedup, '.2f')} | {row.note} |"
        )
    return "\n".join(lines)


def error_summary(rows: list[Row], ops: bool = False) -> str:
    """Mean and worst ``|predicted / published − 1|`` over the 16-bit runs predicted, and
    over the dense ones among them (FP8 runs are listed, not counted); with ``ops``, also
    over the runs of :data:`FIT_SOURCE` and the dense ones held out, apart; then source by
    source, each with the software its runs ran on
    (:data:`~megapp.planning.published_runs.STACKS`)."""
    groups = [("16-bit runs", lambda r: True), ("dense 16-bit runs", _dense)]
    if ops:
        groups += [
            (f"fitted on ({source_label(FIT_SOURCE)})", lambda r: r.run.source == FIT_SOURCE),
            ("held out, dense", lambda r: _dense(r) and r.run.source != FIT_SOURCE),
        ]
    lines = [line for label, keep in groups if (line := _error_line(label, rows, keep))]
    by_source = [
        _error_line(
            f"- {source_label(source)} ({STACKS[source]})",
            rows,
            lambda r, s=source: r.run.source == s,
        )
        for source in dict.fromkeys(r.run.source for r in rows)
    ]
    if any(by_source):
        lines += ["by source, on the software it names:", *filter(None, by_source)]
    return "\n".join(lines)


def _error_line(label: str, rows: list[Row], keep: Callable[[Row], bool]) -> str:
    """``label: mean ..., worst ... (n runs)`` over the 16-bit rows ``keep`` takes, or ""
    without one."""
    errors = [
        abs(r.ratio - 1)
        for r in rows
        if r.ratio is not None and r.run.precision != "fp8" and keep(r)
    ]
    if not errors:
        return ""
    return (
        f"{label}: mean |pred/pub - 1| {sum(errors) / len(errors):.1%}, worst "
        f"{max(errors):.1%} ({len(errors)} run{'s' * (len(errors) > 1)})"
    )


def _dense(row: Row) -> bool:
    return MODELS[row.run.model].value("--num-experts") is None


def _stated(run: PublishedRun) -> str:
    return f"tp{run.tp} cp{run.cp} pp{run.pp} dp{run.dp}"


PROG = "tools/compare_published.py"
"""The command as the docs name it; ``python -m megapp.ablation.published`` passes its own."""


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """Print the comparison for the runs ``argv`` selects (default: ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(
        prog=prog.split()[-1].rsplit("/", 1)[-1], description=__doc__.split("\n")[0]
    )
    parser.add_argument("--no-pick", action="store_true", help="skip the planner's search")
    parser.add_argument(
        "--pick-max-gpus",
        type=int,
        default=1024,
        help="ask the planner only for runs of at most this many GPUs (default 1024)",
    )
    parser.add_argument(
        "--match", nargs="+", metavar="TEXT", help="only runs whose name contains one of these"
    )
    parser.add_argument(
        "--ops",
        action="store_true",
        help="price layers operation by operation (h100-ops, a100-ops, h200-ops profiles: "
        "megapp.planning.op_profiles) instead of FLOPs at one sustained rate",
    )
    args = parser.parse_args(argv)
    runs = [run for run in RUNS if args.match is None or any(m in run.name for m in args.match)]
    rows = []
    for i, run in enumerate(runs, 1):
        start = time.perf_counter()
        pick = not args.no_pick and run.gpus <= args.pick_max_gpus
        rows.append(compare(run, pick, args.ops))
        seconds = time.perf_counter() - start
        print(f"[{i}/{len(runs)}] {run.name}: {seconds:.1f} s", file=sys.stderr, flush=True)
    flags = sys.argv[1:] if argv is None else argv
    command = " ".join(["python", prog, shlex.join(flags)]).rstrip()
    print(f"`{command}`\n")
    print(markdown(rows))
    print("\n" + error_summary(rows, args.ops))
    print(
        "\n(hw): the source counts recompute's rerun forward, and so does the prediction "
        "beside it; (½): the source counts causal attention over half the s × s square, and "
        "so does the prediction beside it; hiding tp: the prediction with the tensor-parallel "
        "collectives off the critical path entirely; pick speed-up: the published layout's "
        "predicted iteration time over the pick's."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(prog="-m megapp.ablation.published"))
