"""Every schedule under each transport's point-to-point rules, simulated.

    python tools/benchmarks/p2p_rules.py              # the p = 4, m = 8 table and the sweep
    python tools/benchmarks/p2p_rules.py --no-sweep   # the table only

Uniform costs (a stage's forward 1, input gradient 1, weight gradient 1, split over the
chunks; no latency). For each schedule the table gives the bubble and the peak
activations per rank under gloo's rules, under NCCL's with megapp's posting (one
communicator per direction of each pair of ranks), and under NCCL's with a step's
messages as one batch on one communicator (Megatron-Core's ``batch_isend_irecv``) or
each on its own on one communicator. The sweep runs every schedule for p from 2 to 8 and
every m from 1 to 4p it accepts, and counts the cases where a discipline deadlocks or
loses more than 0.01 of bubble against gloo.
"""

from __future__ import annotations

import argparse
import sys

from megapp.pipeline_parallel.catalog import SCHEDULE_KINDS
from megapp.pipeline_parallel.messages import ScheduleError
from megapp.pipeline_parallel.network import Rules
from megapp.pipeline_parallel.schedules import Schedule
from megapp.pipeline_parallel.simulate import CostModel, simulate

CHUNKS = {"interleaved-1f1b": (2,), "looped-bfs": (2,), "zb-h1": (1, 2), "zb-v": (2,)}
CHUNKS["dualpipev"] = (2,)


def costs(rules: Rules, chunks: int) -> CostModel:
    """Uniform costs per chunk; activations in units of one stage's microbatch."""
    return CostModel(forward=1 / chunks, backward=2 / chunks, activation=1 / chunks, rules=rules)


def outcome(schedule: Schedule, rules: Rules) -> tuple[float, list[float]] | None:
    """(bubble, peak per rank), or None on a deadlock."""
    try:
        timeline = simulate(schedule, costs(rules, schedule.num_chunks))
    except ScheduleError:
        return None
    return timeline.bubble_fraction, timeline.peak_in_flight


def table(p: int, m: int) -> list[str]:
    head = "| schedule | v | " + " | ".join(f"bubble, {r.value}" for r in Rules)
    lines = [head + " | peak per rank (nccl) |", "|---|--:|" + "--:|" * len(Rules) + "---|"]
    for name in SCHEDULE_KINDS:
        for v in CHUNKS.get(name, (1,)):
            try:
                schedule = SCHEDULE_KINDS[name].build(p, m, v)
            except ValueError:
                continue
            results = {rules: outcome(schedule, rules) for rules in Rules}
            cells = ["deadlock" if r is None else f"{r[0]:.3f}" for r in results.values()]
            nccl = results[Rules.NCCL]
            peak = "-" if nccl is None else " / ".join(f"{x:g}" for x in nccl[1])
            lines.append(f"| `{name}` | {v} | " + " | ".join(cells) + f" | {peak} |")
    return lines


def sweep() -> list[str]:
    total, worse = 0, dict.fromkeys(Rules, 0)
    for name in SCHEDULE_KINDS:
        for v, p in ((v, p) for v in CHUNKS.get(name, (1,)) for p in range(2, 9)):
            for m in range(1, 4 * p + 1):
                try:
                    schedule = SCHEDULE_KINDS[name].build(p, m, v)
                except ValueError:
                    continue
                total += 1
                gloo = outcome(schedule, Rules.GLOO)
                for rules in Rules:
                    got = gloo if rules is Rules.GLOO else outcome(schedule, rules)
                    if got is None or gloo is None or got[0] > gloo[0] + 0.01:
                        worse[rules] += 1
    lines = [f"{total} cases (every schedule, p = 2..8, every m = 1..4p it accepts):"]
    lines += [
        f"  {r.value}: {n} deadlock or lose more than 0.01 of bubble" for r, n in worse.items()
    ]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--no-sweep", action="store_true")
    args = parser.parse_args(argv)
    print("$ python " + " ".join(["tools/benchmarks/p2p_rules.py", *sys.argv[1:]]))
    print(f"p = {args.stages}, m = {args.microbatches}:")
    print("\n".join(table(args.stages, args.microbatches)))
    if not args.no_sweep:
        print("\n".join(sweep()))


if __name__ == "__main__":
    main()
