"""What ``tools/benchmarks/bench_tensor_parallel.py`` should measure, and its report.

:func:`analytic_ops` and :func:`formula` say which collectives one transformer layer issues
under tensor parallelism, with and without sequence parallelism, and how many bytes each
moves; :func:`report` prints the measured :class:`Result` next to them and flags any
difference.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import asdict, dataclass

from megapp.benchmarks.common import load_average, machine, markdown_table, median, write_json
from megapp.testing.collective_count import Op, gloo_bytes, wire_bytes

MIB = 1 << 20


@dataclass
class Result:
    tp: int
    sp: bool
    threads: int
    forward: list[float]  # per timed iteration, slowest rank
    backward: list[float]
    total: list[float]
    compute_only: list[float]
    collectives_alone: list[float]
    ops: list[Op]  # rank 0's collectives of one forward + backward
    analytic: list[tuple[str, str]]
    activation_bytes: int
    same_on_every_rank: bool
    written: list[int | None]  # per rank: bytes written to sockets in that forward + backward


def analytic_ops(t: int, sp: bool) -> list[tuple[str, str]]:
    """(phase, kind) of every collective of one layer at tp = t, in issue order; each has
    a payload of A = s·b·h·B bytes."""
    if t == 1:
        return []
    if not sp:
        # Forward: the row layers' g (proj, fc2). Backward: the column layers' f (fc1, qkv).
        return [("fwd", "AR"), ("fwd", "AR"), ("bwd", "AR"), ("bwd", "AR")]
    # Per block, forward: all-gather the sequence before the column layer, reduce-scatter
    # after the row layer. Backward (MLP first): the row layer's reduce-scatter becomes an
    # all-gather of the gradient; the column layer re-gathers its input (it saved only the
    # shard) for the weight gradient, then reduce-scatters the input gradient.
    block_fwd = [("fwd", "AG"), ("fwd", "RS")]
    block_bwd = [("bwd", "AG"), ("bwd", "AG"), ("bwd", "RS")]
    return block_fwd * 2 + block_bwd * 2


def formula(args) -> str:
    s, b, h, nb = args.seq, args.batch, args.hidden, 4
    a = s * b * h * nb
    return "\n".join(
        [
            f"A = s·b·h·B = {s}·{b}·{h}·{nb} = {a} bytes ({a / MIB:.3f} MiB), t = tp; "
            "per rank per layer (attention + MLP):",
            "  no SP: 4 all-reduces of A (fwd: after the attention projection and fc2 [g]; "
            "bwd: input grads of qkv and fc1 [f])",
            "         payload 4A, ring wire 4·2(t-1)/t·A = 8(t-1)/t·A",
            "  SP:    per block fwd all-gather + reduce-scatter, bwd all-gather (g's grad) + "
            "all-gather (column re-gathers its input for dW) + reduce-scatter (column dX):",
            "         6 all-gathers + 4 reduce-scatters of A, payload 10A, "
            "ring wire 10(t-1)/t·A (8(t-1)/t·A without the re-gathers)",
            "  payload = the full tensor (all-reduced tensor, all-gather output, reduce-scatter "
            "input); wire = bytes one rank sends: all-reduce 2(t-1)/t, all-gather and "
            "reduce-scatter (t-1)/t of the payload",
        ]
    )


def _ops_summary(kinds: list[str]) -> str:
    counts = {k: kinds.count(k) for k in dict.fromkeys(kinds)}
    return " + ".join(f"{n} {k}" for k, n in counts.items()) or "none"


def check(r: Result) -> tuple[bool, str]:
    """Do the measured collectives equal the analytic ones, op by op, in bytes?"""
    a = r.activation_bytes
    measured = [(op.phase, op.kind, op.payload) for op in r.ops]
    expected = [(phase, kind, a) for phase, kind in r.analytic]
    if measured == expected:
        return True, ""
    return False, f"tp={r.tp} sp={int(r.sp)}: measured {measured}\n  expected {expected}"


def report(args, results: list[Result], elapsed: float | None = None) -> bool:
    """Print everything; False if a measured count differs from the formula."""
    a = args.seq * args.batch * args.hidden * 4
    print(f"$ {args.command}")
    print(f"machine: {machine()}, backend gloo over 127.0.0.1")
    load = load_average()
    print(f"load average (1/5/15 min) at the start: {args.load_at_start}, at the end: {load}")
    print(
        f"layer: s={args.seq} b={args.batch} h={args.hidden} heads={args.heads} "
        f"query_groups={args.query_groups or args.heads} "
        f"ffn={args.ffn} {args.activation} attention={args.attention_backend} fp32, dropout 0; "
        f"median of {args.iters} iterations after {args.warmup} warmup, slowest rank each"
    )
    print(formula(args))
    base = next((median(r.total) for r in results if r.tp == 1), None)  # the first: all cores
    timing = [
        "tp", "SP", "threads/rank", "fwd ms", "bwd ms", "fwd+bwd ms", "(min)", "speedup",
        "no-comm ms", "(min)", "comm-alone ms", "comm share",
    ]  # fmt: skip
    traffic = [
        "tp", "SP", "collectives", "payload B measured", "payload B formula", "match",
        "ring wire MiB (counted ops)", "ring wire MiB (formula)", "socket MiB (measured)",
        "socket / ring",
    ]  # fmt: skip
    timing_rows, traffic_rows, problems = [], [], []
    for r in results:
        total, no_comm = median(r.total), median(r.compute_only)
        payload = sum(op.payload for op in r.ops)
        wire = sum(wire_bytes(op.kind, op.payload, op.world) for op in r.ops)
        f_payload = a * len(r.analytic)
        f_wire = sum(wire_bytes(kind, a, r.tp) for _, kind in r.analytic)
        known = [w for w in r.written if w is not None]
        socket_bytes = statistics.fmean(known) if known and r.tp > 1 else None
        ok, why = check(r)
        if not ok:
            problems.append(why)
        expected = sum(gloo_bytes(op.kind, op.payload, op.world) for op in r.ops)
        if socket_bytes is not None and socket_bytes > 1.05 * expected + 16384:
            problems.append(
                f"tp={r.tp} sp={int(r.sp)}: the ranks wrote {socket_bytes:.0f} bytes to their "
                f"sockets, more than the {expected:.0f} the counted collectives account for "
                "on gloo: some communication escaped the shims"
            )
        if not r.same_on_every_rank:
            problems.append(f"tp={r.tp} sp={int(r.sp)}: ranks issued different collectives")
        sp = "on" if r.sp else "off"
        timing_rows.append(
            [
                str(r.tp),
                sp,
                str(r.threads),
                f"{median(r.forward) * 1e3:.1f}",
                f"{median(r.backward) * 1e3:.1f}",
                f"{total * 1e3:.1f}",
                f"{min(r.total) * 1e3:.1f}",
                f"{base / total:.2f}" if base else "n/a",
                f"{no_comm * 1e3:.1f}",
                f"{min(r.compute_only) * 1e3:.1f}",
                f"{median(r.collectives_alone) * 1e3:.1f}",
                f"{1 - no_comm / total:.0%}",
            ]
        )
        if any(row[:2] == [str(r.tp), sp] for row in traffic_rows):
            continue  # the same layout again, with other thread counts
        traffic_rows.append(
            [
                str(r.tp),
                sp,
                _ops_summary([op.kind for op in r.ops]),
                str(payload),
                str(f_payload),
                "exact" if ok and payload == f_payload else "NO",
                f"{wire / MIB:.3f}",
                f"{f_wire / MIB:.3f}",
                "n/a" if socket_bytes is None else f"{socket_bytes / MIB:.3f}",
                f"{socket_bytes / wire:.2f}" if socket_bytes and wire else "n/a",
            ]
        )
    print(
        "\nTime per layer (forward + backward of attention + MLP), ms; medians, and the "
        "fastest iteration in (min):"
    )
    print(markdown_table(timing, timing_rows))
    print(
        "speedup: the first tp=1 row's fwd+bwd / this fwd+bwd (medians); no-comm: the same "
        "layer with every\ncollective replaced by a local stand-in of the same shapes; "
        "comm-alone: the recorded collectives replayed\nwithout compute (the three alternate "
        "iteration by iteration); comm share: 1 - no-comm / fwd+bwd"
    )
    print("\nBytes per rank per layer (one forward + backward):")
    print(markdown_table(traffic, traffic_rows))
    print(
        "AR/AG/RS = all-reduce/all-gather/reduce-scatter; socket = bytes a rank wrote to its "
        "gloo sockets\n(/proc/self/io wchar, mean over ranks) during the counted iteration"
    )
    for r in results:
        if r.ops:
            seq = ", ".join(f"{op.phase} {op.kind}" for op in r.ops)
            print(f"  tp={r.tp} SP {'on' if r.sp else 'off'}: {seq}")
    if problems:
        print("\nMEASURED != ANALYTIC:\n" + "\n".join(problems))
    if elapsed is not None:
        print(f"\ntotal {elapsed:.0f} s")
    if args.json:
        data = {
            "command": args.command,
            "machine": machine(),
            "args": {k: v for k, v in vars(args).items() if k not in ("command", "sp_modes")},
            "results": [asdict(r) for r in results],
        }
        write_json(args.json, data)
        print(f"wrote {args.json}")
    sys.stdout.flush()
    return not problems
