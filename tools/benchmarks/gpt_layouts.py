"""The layouts part of ``tools/benchmarks/bench_gpt.py``: the full training stack over gloo ranks.

A few iterations of the full stack (:func:`gpt_stack.build_stack`: build_gpt_chunks,
DistributedDataParallel, Optimizer with clipping; train_step with 1F1B or interleaved 1F1B),
wired as in ``tests/test_gpt_layouts.py``, under (dp, tp, pp, vpp) layouts over 1, 2 and 4
ranks; every layout trains the same model (same seed) on the same global batch, so the
first-iteration loss must agree across layouts (printed as a check). Each layout runs in a
fresh world of processes (``megapp.testing.World`` through ``common.Ranks``) with
``max(1, cores // ranks)`` torch threads per rank. Reported:

* tokens/s: global batch × sequence length / iteration time, where an iteration's time is its
  slowest rank's (barrier, ``train_step``, then max over ranks), median over ``--iters``;
* peak RSS per rank: ``resource.getrusage(RUSAGE_SELF).ru_maxrss``, the largest resident set of
  the rank's process over its life (it starts with torch imported and gloo initialized, whose
  pages count on every rank), and RSS at the start of the task (``VmRSS``), so the difference is
  what the model, its activations, gradients and optimizer state added at the peak.

With more ranks than cores the ranks share cores (oversubscription); the report says so per
layout.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

from megapp import parallel_state as ps
from megapp.benchmarks.common import (
    Ranks,
    available_cores,
    cpu_stall_us,
    fmt,
    iqr_pct,
    markdown_table,
    median,
    stall_pct,
)
from megapp.benchmarks.gpt_stack import batch_of, build_stack, forward_step, microbatches_of
from megapp.training import train_step

LAYOUTS = ("1,1,1,-", "2,1,1,-", "1,2,1,-", "1,1,2,-", "2,2,1,-", "1,2,2,-", "1,1,2,2")


def parse_layout(text: str) -> tuple[int, int, int, int | None]:
    """``"dp,tp,pp,vpp"`` (vpp ``-`` for none) -> (dp, tp, pp, vpp)."""
    parts = text.split(",")
    if len(parts) != 4:
        raise ValueError(f"a layout is dp,tp,pp,vpp (vpp - for none), got {text!r}")
    dp, tp, pp = (int(p) for p in parts[:3])
    vpp = None if parts[3] in ("-", "", "1") else int(parts[3])
    return dp, tp, pp, vpp


def check_layout(args, dp: int, tp: int, pp: int, vpp: int | None) -> str | None:
    """Why the layout cannot run this model and batch (before any process starts), or None."""
    stages = pp * (vpp or 1)
    if args.layers % stages:
        return f"--layers {args.layers} is not divisible by pp × vpp = {stages}"
    if args.heads % tp or (4 * args.hidden) % tp:
        return f"--heads {args.heads} and the MLP width must divide by tp = {tp}"
    if args.global_batch % (dp * args.micro_batch):
        return f"--global-batch {args.global_batch} is not divisible by dp × micro-batch"
    m = args.global_batch // (dp * args.micro_batch)
    if vpp and m % pp:
        return f"interleaved 1F1B needs the {m} microbatches per replica divisible by pp = {pp}"
    return None


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def layout_rank(args, dp: int, tp: int, pp: int, vpp: int | None) -> dict:
    """One rank of one layout (runs in a World worker): train, time, measure memory."""
    rss_start = _rss_mib()
    ps.initialize_model_parallel(tp, pp, vpp)
    chunks, optimizer, groups = build_stack(args, layout=True)
    dp_rank, m = ps.get_data_parallel_rank(), args.global_batch // (dp * args.micro_batch)
    times, losses, stalls = [], [], []
    for it in range(args.warmup_iters + args.iters):
        tokens, labels = batch_of(args, it, args.global_batch)
        mine = slice(dp_rank * m * args.micro_batch, (dp_rank + 1) * m * args.micro_batch)
        microbatches = microbatches_of(tokens[mine], labels[mine], args.micro_batch)
        dist.barrier()
        stall, start = cpu_stall_us(), time.perf_counter()
        result = train_step(
            forward_step, [iter(microbatches) for _ in chunks], chunks, optimizer,
            num_microbatches=m, groups=groups,
        )  # fmt: skip
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
        losses.append(result.loss)
        if it >= args.warmup_iters:
            times.append(float(elapsed))
            stalled = stall_pct(stall, cpu_stall_us(), float(elapsed))
            stalls.append(float("nan") if stalled is None else stalled)
    return {
        "rank": dist.get_rank(),
        "times_s": times,
        "stall_pct": stalls,
        "losses": losses,
        "rss_start_mib": rss_start,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "threads": torch.get_num_threads(),
    }


def layouts(args: argparse.Namespace) -> list[dict]:
    """Every ``--layouts`` entry in a fresh world; one summary per layout."""
    cores = available_cores()
    out = []
    for text in args.layouts:
        dp, tp, pp, vpp = parse_layout(text)
        world_size = dp * tp * pp
        threads = max(1, cores // world_size)
        print(f"layout dp={dp} tp={tp} pp={pp} vpp={vpp or '-'}: {world_size} rank(s) "
              f"× {threads} thread(s)", file=sys.stderr, flush=True)  # fmt: skip
        with Ranks(world_size, threads=threads, timeout=args.timeout) as world:
            ranks = world.run_all(layout_rank, args, dp, tp, pp, vpp)
        times = ranks[0]["times_s"]
        seconds = statistics.median(times)
        out.append(
            {
                "layout": {"dp": dp, "tp": tp, "pp": pp, "vpp": vpp},
                "ranks": world_size,
                "threads_per_rank": threads,
                "oversubscribed": world_size * threads > cores,
                "iteration_s": seconds,
                "iqr_pct": iqr_pct(times),
                "stall_pct": median(ranks[0]["stall_pct"]),
                "tokens_per_s": args.global_batch * args.seq / seconds,
                "first_loss": ranks[0]["losses"][0],
                "peak_rss_mib": [r["peak_rss_mib"] for r in ranks],
                "rss_start_mib": [r["rss_start_mib"] for r in ranks],
                "times_s": times,
            }
        )
    return out


def report_layouts(args, rows_in: list[dict]) -> None:
    cores = available_cores()
    print(
        f"\n## layouts: full stack (DDP + Optimizer + train_step), gloo, fp32; GPT "
        f"l={args.layers} h={args.hidden} heads={args.heads} s={args.seq} V={args.vocab}; "
        f"global batch {args.global_batch} × {args.seq} = {args.global_batch * args.seq} tokens, "
        f"micro-batch {args.micro_batch}; median of {args.iters} iterations after "
        f"{args.warmup_iters} warmup; {cores} cores"
    )
    rows = []
    for r in rows_in:
        lay = r["layout"]
        peak = r["peak_rss_mib"]
        added = [p - s for p, s in zip(peak, r["rss_start_mib"], strict=True)]
        rows.append(
            [
                f"{lay['dp']},{lay['tp']},{lay['pp']},{lay['vpp'] or '-'}",
                str(r["ranks"]),
                str(r["threads_per_rank"]) + (" (oversubscribed)" if r["oversubscribed"] else ""),
                f"{r['iteration_s'] * 1e3:.0f}",
                fmt(r["iqr_pct"], ".0f"),
                fmt(r["stall_pct"], ".0f"),
                f"{r['tokens_per_s']:.0f}",
                f"{max(r['rss_start_mib']):.0f}",
                f"{max(peak):.0f}",
                f"{min(added):.0f}-{max(added):.0f}",
                f"{r['first_loss']:.6f}",
            ]
        )
    header = ["dp,tp,pp,vpp", "ranks", "threads/rank", "iter ms", "IQR %", "stall %",
              "tokens/s", "start RSS MiB", "peak RSS MiB", "added MiB", "loss 1"]  # fmt: skip
    print(markdown_table(header, rows))
    print(
        "tokens/s: global tokens per iteration / median iteration time (slowest rank); stall: "
        "share of the iteration some task waited\nfor a CPU (PSI); start RSS: VmRSS when the "
        "task starts (torch imported, gloo up), max over ranks; peak RSS: ru_maxrss,\nmax over "
        "ranks; added: peak − start per rank, min-max over ranks; loss 1: first iteration's "
        "loss (same model and data in every layout)"
    )
    losses = [r["first_loss"] for r in rows_in]
    if max(losses) - min(losses) > 1e-4 * abs(losses[0]):
        print(f"WARNING: the first-iteration losses differ across layouts: {losses}")
