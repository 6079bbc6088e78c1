"""The overhead part of ``bench_gpt.py``: megapp against plain PyTorch in one process.

One training step (forward, backward, AdamW step) of megapp's single-process ``GPTModel``
against the same model written in plain PyTorch (:mod:`megapp.testing.plain_gpt`:
nn.Parameter tensors and torch.nn.functional only), holding copies of the same weights, on the
same batch, each with its own ``torch.optim.AdamW(foreach=True)``. Before anything is timed
the two must agree on the loss and on every gradient
(:func:`~megapp.testing.plain_gpt.compare`); the tool stops with the differences otherwise.
Timed variants:

* ``megapp``: GPTModel with megapp's compiled CPU kernels (``megapp._C``) for the fused ops;
* ``megapp-ref``: the same with ``MEGAPP_FUSED=0`` (pure-PyTorch reference of every fused op),
  when the compiled tier exists;
* ``megapp-keep``: megapp with ``recompute_saved_inputs = False`` on every layer: the norm and
  GeLU outputs that the following linear layers save are kept instead of being recomputed in
  backward (more memory, the price of that recompute in time);
* ``stack``: the full single-process training stack (:func:`gpt_stack.build_stack`:
  GPTModel in DistributedDataParallel, megapp's ``Optimizer`` without clipping) and
  ``train_step`` (pipeline engine with one stage, one microbatch); its first loss must equal
  the model's;
* ``plain``: the plain PyTorch model.

One round runs one step of every variant, in an order that reverses from round to round
(megapp, plain, plain, megapp, ...), so that load from other jobs hits all alike; each figure is
the median over ``--repeats`` rounds after ``--warmup``. ``overhead`` is median(variant) /
median(plain) − 1; ``paired`` is the median over rounds of the same ratio within the round
(less sensitive to slow drift of the machine). When megapp's overhead exceeds ``--target``
(5%), or with ``--profile``, one more set of steps runs under ``torch.profiler`` and the ops
whose self time differs most between megapp and plain are listed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable

import torch

from megapp.benchmarks.common import (
    cpu_stall_us,
    fmt,
    interleaved,
    iqr_pct,
    markdown_table,
    stall_pct,
)
from megapp.benchmarks.gpt_stack import (
    LR,
    SEED,
    WD,
    batch_of,
    build_stack,
    forward_step,
    gpt_config,
    model_flops,
    shape,
)
from megapp.fusions import extension
from megapp.fusions.extension import built_tiers
from megapp.models import GPTModel
from megapp.testing.plain_gpt import PlainGPT, compare
from megapp.training import train_step


def _adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [p for p in model.parameters() if p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR, foreach=True)


def _model_step(model, optimizer, tokens, labels, fused: bool | None) -> Callable[[], float]:
    def step() -> float:
        with extension.fused(fused) if fused is not None else contextlib.nullcontext():
            optimizer.zero_grad(set_to_none=True)
            loss = model(tokens, labels=labels)
            loss = loss.mean() if loss.dim() else loss
            loss.backward()
            optimizer.step()
        return float(loss.detach())

    return step


def _stack_step(args: argparse.Namespace, tokens, labels) -> Callable[[], float]:
    chunks, optimizer, groups = build_stack(args, clip_grad=None)

    def step() -> float:
        result = train_step(
            forward_step, iter([(tokens, labels)]), chunks, optimizer,
            num_microbatches=1, groups=groups,
        )  # fmt: skip
        return result.loss

    return step


def _timed(step: Callable[[], float]) -> Callable[[], tuple[float, float, float]]:
    """A call of ``step`` that returns its (wall s, process CPU s, stall %)."""

    def call() -> tuple[float, float, float]:
        stall, used, start = cpu_stall_us(), time.process_time(), time.perf_counter()
        step()
        elapsed = time.perf_counter() - start
        stalled = stall_pct(stall, cpu_stall_us(), elapsed)
        return elapsed, time.process_time() - used, float("nan") if stalled is None else stalled

    return call


def overhead(args: argparse.Namespace) -> dict:
    """Guard, then time every variant; the figures of the report (see the module docstring)."""
    torch.set_num_threads(args.threads)
    tokens, labels = batch_of(args, 0, args.batch)
    config = gpt_config(args)
    compiled = "cpu" in built_tiers()

    # The guard: same weights, same batch -> same loss and gradients, or no figures.
    model = GPTModel(config, seed=SEED)
    plain = PlainGPT.from_megapp(model)
    agreement = compare(model, plain, tokens, labels)
    if not agreement.ok:
        sys.exit(f"error: megapp and the plain model disagree, nothing timed:\n{agreement}")

    variants: dict[str, Callable[[], float]] = {}
    variants["megapp"] = _model_step(model, _adamw(model), tokens, labels, compiled or None)
    if compiled and args.reference_tier:
        reference = GPTModel(config, seed=SEED)
        variants["megapp-ref"] = _model_step(reference, _adamw(reference), tokens, labels, False)
    if args.ablation:
        keep = GPTModel(config, seed=SEED)
        for layer in keep.decoder.layers:
            layer.recompute_saved_inputs = False  # keep norm and GeLU outputs instead
        variants["megapp-keep"] = _model_step(keep, _adamw(keep), tokens, labels, compiled or None)
    variants["stack"] = _stack_step(args, tokens, labels)
    variants["plain"] = _model_step(plain, _adamw(plain), tokens, labels, None)
    first = {name: step() for name, step in variants.items()}  # first steps: same loss
    for name, loss in first.items():
        if abs(loss - agreement.loss) > 1e-5 * abs(agreement.loss):
            sys.exit(f"error: {name}'s first training loss {loss} != {agreement.loss}")

    calls = {name: _timed(step) for name, step in variants.items()}
    rounds = interleaved(calls, args.repeats, warmup=args.warmup, order="reverse")
    times = {name: [wall for wall, _, _ in r] for name, r in rounds.items()}
    cpu = {name: [used for _, used, _ in r] for name, r in rounds.items()}
    stalls = {name: [stall for _, _, stall in r] for name, r in rounds.items()}
    result = {
        "shape": shape(args),
        "threads": args.threads,
        "tier": "cpu (megapp._C)" if compiled else "reference (megapp._C not built)",
        "agreement": dataclasses.asdict(agreement),
        "times_s": times,
        "cpu_times_s": cpu,
        "median_ms": {n: statistics.median(t) * 1e3 for n, t in times.items()},
        "median_cpu_ms": {n: statistics.median(t) * 1e3 for n, t in cpu.items()},
        "tokens_per_s": {n: args.batch * args.seq / statistics.median(t) for n, t in times.items()},
        "iqr_pct": {n: iqr_pct(t) for n, t in times.items()},
        "stall_pct": {n: statistics.median(x) for n, x in stalls.items()},
        "overhead_pct": {},
        "paired_pct": {},
        "cpu_overhead_pct": {},
        "flops_per_step": model_flops(config, args.batch, args.seq),
    }
    base = statistics.median(times["plain"])
    for name in variants:
        if name != "plain":
            result["overhead_pct"][name] = (statistics.median(times[name]) / base - 1) * 100
            ratios = [a / b for a, b in zip(times[name], times["plain"], strict=True)]
            result["paired_pct"][name] = (statistics.median(ratios) - 1) * 100
            cpu_ratio = statistics.median(cpu[name]) / statistics.median(cpu["plain"])
            result["cpu_overhead_pct"][name] = (cpu_ratio - 1) * 100
    if args.profile or result["overhead_pct"]["megapp"] > args.target:
        steps = {"megapp": variants["megapp"], "plain": variants["plain"]}
        result["profile"] = profile(steps, args.profile_steps)
    return result


def profile(steps: dict[str, Callable[[], float]], n: int) -> dict:
    """Self CPU time (ms) and calls per op in one step of each variant, under torch.profiler:
    ``n`` steps each, one profile per step, variants alternating; per op the median over the
    ``n`` steps (a step that another job disturbed moves the median little)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    samples: dict[str, list[dict[str, tuple[float, int]]]] = {name: [] for name in steps}
    for step in steps.values():
        step()  # the profiler's first use warms up
    for _ in range(n):
        for name, step in steps.items():
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                step()
            samples[name].append(
                {e.key: (e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()}
            )
    out = {}
    for name, runs in samples.items():
        keys = set().union(*runs)
        out[name] = {
            k: (
                statistics.median(r.get(k, (0.0, 0))[0] for r in runs),
                max(r.get(k, (0.0, 0))[1] for r in runs),
            )
            for k in keys
        }
    return out


def report_overhead(args, r: dict) -> None:
    s = r["shape"]
    print(
        f"\n## overhead: one training step, 1 process, {r['threads']} threads, fp32, "
        f"fused ops on the {r['tier']} tier\n"
        f"GPT l={s['layers']} h={s['hidden']} heads={s['heads']} s={s['seq']} V={s['vocab']}, "
        f"batch {s['batch']} ({s['batch'] * s['seq']} tokens, "
        f"{r['flops_per_step'] / 1e9:.1f} GFLOP/step); median of {args.repeats} interleaved "
        f"rounds after {args.warmup} warmup"
    )
    print(f"guard: {compare_line(r['agreement'])}")
    rows = []
    for name, ms in r["median_ms"].items():

        def pct(key: str, name: str = name) -> str:
            value = r[key].get(name)
            return "-" if value is None else f"{value:+.1f}%"

        rows.append(
            [
                name,
                f"{ms:.1f}",
                f"{min(r['times_s'][name]) * 1e3:.1f}",
                fmt(r["iqr_pct"][name], ".0f"),
                fmt(r["stall_pct"][name], ".0f"),
                f"{r['median_cpu_ms'][name]:.1f}",
                f"{r['tokens_per_s'][name]:.0f}",
                f"{r['flops_per_step'] / (ms / 1e3) / 1e9:.1f}",
                pct("overhead_pct"),
                pct("paired_pct"),
                pct("cpu_overhead_pct"),
            ]
        )
    header = ["variant", "median ms", "min ms", "IQR %", "stall %", "CPU ms", "tokens/s",
              "GFLOP/s", "overhead", "paired", "CPU overhead"]  # fmt: skip
    print(markdown_table(header, rows))
    print(
        "median/min ms: wall time per step; IQR: spread of the rounds / median; stall: share of "
        "the step some task\nwaited for a CPU (Linux PSI, other jobs); CPU ms: process CPU "
        "time per step; overhead: median / plain's median − 1;\npaired: median over rounds "
        "of the ratio within the round − 1; CPU overhead: the same as overhead, on CPU time"
    )
    over = r["overhead_pct"]["megapp"]
    verdict = "within" if over <= args.target else "ABOVE"
    print(
        f"megapp / plain: {1 + over / 100:.3f} ({verdict} the {args.target:g}% target; paired "
        f"{r['paired_pct']['megapp']:+.1f}%, CPU time {r['cpu_overhead_pct']['megapp']:+.1f}%)"
    )
    if "profile" in r:
        report_profile(r["profile"], args.profile_top)


def compare_line(a: dict) -> str:
    return (
        f"loss megapp {a['loss']:.6f} plain {a['plain_loss']:.6f}; max over parameters of "
        f"max|Δgrad|/max|grad| = {a['max_grad_rel']:.2e} ({a['worst']}); "
        f"tolerance {a['tolerance']:.0e}"
    )


def report_profile(prof: dict, top: int) -> None:
    megapp, plain = prof["megapp"], prof["plain"]
    total = {n: sum(ms for ms, _ in ops.values()) for n, ops in prof.items()}
    print(
        f"\nprofile (torch.profiler, self CPU time per step): megapp {total['megapp']:.1f} ms, "
        f"plain {total['plain']:.1f} ms; the ops that differ most:"
    )
    names = set(megapp) | set(plain)
    diff = sorted(
        names,
        key=lambda k: -abs(megapp.get(k, (0, 0))[0] - plain.get(k, (0, 0))[0]),
    )[:top]
    rows = []
    for k in diff:
        a, b = megapp.get(k, (0.0, 0)), plain.get(k, (0.0, 0))
        rows.append([k[:48], f"{a[0]:.2f}", str(a[1]), f"{b[0]:.2f}", str(b[1]),
                     f"{a[0] - b[0]:+.2f}"])  # fmt: skip
    print(markdown_table(["op", "megapp ms", "calls", "plain ms", "calls", "Δ ms"], rows))
