"""The figures of tools/benchmarks/bench_pipeline.py: one :class:`Row` per configuration, and the
tables and report it prints (and writes as JSON)."""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field

from pipeline_sleep import Config

from megapp.benchmarks.common import fmt, machine, markdown_table, median, write_json


@dataclass
class Row:
    """One configuration's figures: every timed round of each implementation, the mean
    measured action times, and the simulator's and the formula's predictions."""

    config: Config
    actions_per_rank: int
    megapp: list[float] = field(default_factory=list)
    megapp_negotiated: list[float] = field(default_factory=list)
    torch: list[float] = field(default_factory=list)
    torch_error: str = ""
    forward_s: float = 0.0  # mean measured duration of one forward / backward action
    backward_s: float = 0.0  # a whole backward, or an input gradient plus a weight gradient
    simulated: float = 0.0  # simulator, nominal action times and the idle-peer latency
    simulated_measured: float = 0.0  # simulator, measured action times and the same latency
    formula: float = 0.0
    bubble: float = 0.0  # simulated with nominal times: idle share, most activations held
    peak: float = 0.0
    searched: str = ""  # auto: the candidate the search picked


def _paired(a: list[float], b: list[float]) -> float:
    """Median over rounds of ``a / b`` within the round (nan without b)."""
    return median([x / y for x, y in zip(a, b, strict=False)]) if b else float("nan")


def sleep_table(rows: list[Row]) -> str:
    header = ["schedule", "m", "v", "formula s", "sim s", "bubble", "peak"]
    header += ["megapp s", "megapp/formula"]
    header += ["F/B ms", "sim* s", "megapp/sim*", "negotiated s", "torch s", "megapp/torch"]
    header += ["paired"]
    body = []
    for r in rows:
        c, got, neg, ref = r.config, median(r.megapp), median(r.megapp_negotiated), median(r.torch)
        body.append(
            [
                c.schedule + (f" ({r.searched})" if r.searched else ""),
                str(c.m),
                str(c.v),
                f"{r.formula:.3f}",
                f"{r.simulated:.3f}",
                f"{r.bubble:.3f}",
                f"{r.peak:g}",
                f"{got:.3f}",
                f"{got / r.formula:.4f}",
                f"{r.forward_s * 1e3:.2f}/{r.backward_s * 1e3:.2f}",
                f"{r.simulated_measured:.3f}",
                f"{got / r.simulated_measured:.4f}",
                fmt(neg, ".3f"),
                fmt(ref, ".3f") if not r.torch_error else "error",
                fmt(got / ref, ".4f"),
                fmt(_paired(r.megapp, r.torch), ".4f"),
            ]
        )
    return markdown_table(header, body)


def zero_table(rows: list[Row]) -> str:
    header = ["schedule", "m", "v", "actions/rank", "megapp ms/iter", "megapp ms/action"]
    header += ["in F/B ms", "negotiated ms/action", "torch ms/action", "megapp/torch"]
    header += ["paired", "sim ms/action"]
    body = []
    for r in rows:
        c, n = r.config, r.actions_per_rank
        got, neg, ref = median(r.megapp), median(r.megapp_negotiated), median(r.torch)
        body.append(
            [
                c.schedule,
                str(c.m),
                str(c.v),
                str(n),
                f"{got * 1e3:.2f}",
                f"{got * 1e3 / n:.3f}",
                f"{(r.forward_s + r.backward_s) / 2 * 1e3:.3f}",
                fmt(neg * 1e3 / n, ".3f"),
                fmt(ref * 1e3 / n, ".3f") if not r.torch_error else "error",
                fmt(got / ref, ".3f"),
                fmt(_paired(r.megapp, r.torch), ".3f"),
                f"{r.simulated * 1e3 / n:.3f}",
            ]
        )
    return markdown_table(header, body)


def report(args, p, command, latencies, cold, sleep_rows, zero_rows, files, elapsed, load) -> None:
    hot, idle = latencies
    print(f"$ {command}")
    print(f"machine: {machine()}, gloo")
    print(
        f"p={p}, activation {args.micro_batch_size}x{args.hidden} fp32 per "
        f"microbatch; one-way p2p latency {hot * 1e3:.3f} ms back to back, {idle * 1e3:.3f} ms "
        "to an idle peer (the simulator's p2p_latency)"
    )
    print(
        f"one tiny torch op: {cold[0] * 1e6:.1f} us back to back, {cold[1] * 1e6:.1f} us after "
        "a 50 ms sleep (the cost of running code that went cold during an action's sleep)"
    )
    if sleep_rows:
        print(
            f"\nSleep mode: tf={args.forward_ms:g} ms, tb={args.backward_ms:g} ms (of which "
            f"tw={args.weight_ms:g} ms the weight gradient) per stage, /v per chunk; first/last "
            f"stage x{args.first_stage_scale:g}/x{args.last_stage_scale:g}; median of "
            f"{args.iters} rounds after {args.warmup} warmup; each round runs every "
            "implementation once, in a rotating order.\n"
            "Times are per iteration; pipedream and pipedream-2bw run "
            f"{args.iterations} iterations per call without a flush, so their formula is "
            "(k m + (p-1)/v)(tf + tb) / k for k iterations.\n"
            "formula = (m + (p-1)/v)(tf + tb); sim = simulator with the nominal sleeps, and its "
            "bubble and peak activations held per rank (microbatch-chunks); F/B = measured mean "
            "forward and backward (B, or I + W); sim* = simulator replaying every rank's "
            "measured action times; negotiated = megapp with tensor_shapes=None; paired = "
            "median over rounds of megapp/torch in the round; - = no torch peer"
        )
        print(sleep_table(sleep_rows))
    if zero_rows:
        print(
            f"\nZero-compute mode: tf = tb = 0; median of {args.zero_iters} rounds after "
            f"{args.zero_warmup} warmup; ms/action = iteration / actions per rank; in F/B = "
            "mean time inside one forward or backward (B, or I + W); sim = simulator, p2p "
            "latency only"
        )
        print(zero_table(zero_rows))
    errors = {r.config.label: r.torch_error for r in sleep_rows + zero_rows if r.torch_error}
    for label, error in errors.items():
        print(f"torch.distributed.pipelining refused {label}: {error}")
    for f in files:
        print(f"wrote {f}")
    print(
        f"total {elapsed:.0f} s; 1-minute load average {load[0]:.2f} at start, {load[1]:.2f} at end"
    )
    if args.json:
        data = {
            "command": command,
            "machine": machine(),
            "load_average": load,
            "p2p_latency_s": {"back_to_back": hot, "idle_peer": idle},
            "tiny_op_s": {"back_to_back": cold[0], "after_50ms_sleep": cold[1]},
            "sleep": [asdict(r) for r in sleep_rows],
            "zero": [asdict(r) for r in zero_rows],
        }
        write_json(args.json, data)
        print(f"wrote {args.json}")
    sys.stdout.flush()
