"""How long one small gloo collective takes on this machine, by world size: the price an
in-world test pays for every collective it issues.

    python tools/benchmarks/gloo_latency.py --world-sizes 2 4 8 --iterations 200

Each world is the pool of processes the tests use (:mod:`megapp.testing`). Its ranks run
``iterations`` all-reduces, all-gathers and reduce-scatters of a 256-float tensor back to
back, over the whole world and, in an even world, over pairs of neighbouring ranks
(every pair at once, as the tensor-parallel groups of size 2 of a larger layout do), after
a warm-up. A row is the slowest rank's time per call. A parity test multiplies it by its
collective count (``megapp.testing.collective_count.Recorder`` counts them).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import torch
import torch.distributed as dist

from megapp.testing.world import get_world, shutdown_worlds

OPS = ("all_reduce", "all_gather", "reduce_scatter")
NUMEL = 256


def _call(op: str, group, x: torch.Tensor, whole: torch.Tensor) -> None:
    if op == "all_reduce":
        dist.all_reduce(x, group=group)
    elif op == "all_gather":
        dist.all_gather_into_tensor(whole, x, group=group)
    else:
        dist.reduce_scatter_tensor(x, whole, group=group)


def time_collectives(iterations: int, warmup: int = 10) -> dict[tuple[str, str], float]:
    """On every rank of the world: seconds per call of each op over the world and, in an
    even world of more than two ranks, over pairs of neighbouring ranks."""
    world, rank = dist.get_world_size(), dist.get_rank()
    pairs = []
    if world > 2 and world % 2 == 0:
        pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    groups = {"world": (None, world), **({"pairs": (pairs[rank // 2], 2)} if pairs else {})}
    seconds = {}
    try:
        for name, (group, size) in groups.items():
            x, whole = torch.ones(NUMEL), torch.ones(NUMEL * size)
            for op in OPS:
                for _ in range(warmup):
                    _call(op, group, x, whole)
                dist.barrier()
                start = time.perf_counter()
                for _ in range(iterations):
                    _call(op, group, x, whole)
                seconds[(op, name)] = (time.perf_counter() - start) / iterations
                dist.barrier()
    finally:
        for group in pairs:
            dist.destroy_process_group(group)
    return seconds


def measure(world_sizes: list[int], iterations: int) -> list[tuple[int, str, str, float]]:
    """``(world size, op, group, seconds per call)``: the slowest rank's, every world."""
    rows = []
    for size in world_sizes:
        results = get_world(size).run(time_collectives, iterations, timeout=600)
        for op, group in results[0]:
            rows.append((size, op, group, max(r[(op, group)] for r in results)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--iterations", type=int, default=200)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if min(args.world_sizes) < 2 or args.iterations < 1:
        parser.error("world sizes start at 2 and --iterations at 1")
    print(f"# python tools/benchmarks/gloo_latency.py {' '.join(argv)}".rstrip())
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}")
    print("| ranks | op | group | ms per call |")
    print("|---:|---|---|---:|")
    for size, op, group, seconds in measure(args.world_sizes, args.iterations):
        print(f"| {size} | {op} | {group} | {seconds * 1e3:.2f} |")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        shutdown_worlds()
