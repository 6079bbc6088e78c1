"""One context-parallel rank's attention, fused blocks against materialized tiles.

    python tools/benchmarks/cp_blocks.py --seq-length 1024 --cp 2 --heads 4 --head-dim 16

Times forward + backward of cp rank 0's attention as the all-gather runs it (its two
query chunks, each against the keys up to its end: ``blocks.attend_in_tiles``) with the
blocks fused (torch's flash-attention kernel for the CPU) and materialized (plain-PyTorch
tiles of ``s/(2cp)`` on a side), next to ``1/cp`` of one process's causal
``scaled_dot_product_attention`` over the whole sequence: the share of the work a rank
does. One thread, float32; the median of each over interleaved rounds, and of the
per-round ratios.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from megapp.context_parallel.blocks import attend_in_tiles
from megapp.context_parallel.layout import chunks_of_rank


def _seconds(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    s, cp, a, d = args.seq_length, args.cp, args.heads, args.head_dim
    if s % (2 * cp):
        parser.error(f"--seq-length {s} is not a multiple of 2·cp = {2 * cp}")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    whole = [torch.randn(1, a, s, d, requires_grad=True) for _ in range(3)]
    q = torch.randn(1, a, s // cp, d, requires_grad=True)
    kv = torch.randn(2, 1, a, s, d, requires_grad=True)
    chunk = s // (2 * cp)
    ends = tuple((c + 1) * chunk for c in chunks_of_rank(cp, 0))

    def single() -> None:
        F.scaled_dot_product_attention(*whole, is_causal=True).sum().backward()

    def blocks(fused: bool) -> Callable[[], None]:
        return lambda: attend_in_tiles(q, kv, 0.25, True, chunk, ends, fused).sum().backward()

    cases = {"single process / cp": single, "fused": blocks(True), "materialized": blocks(False)}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():
        fn()  # warm up
    for _ in range(args.rounds):
        for name, fn in cases.items():
            times[name].append(_seconds(fn) / (cp if name.startswith("single") else 1))
    given = sys.argv[1:] if argv is None else argv
    print(f"$ python tools/benchmarks/cp_blocks.py {' '.join(given)}")
    machine = platform.processor() or platform.machine()
    print(f"machine: {machine}, torch {torch.__version__}, 1 thread")
    share = times["single process / cp"]
    for name, values in times.items():
        ratio = statistics.median(t / u for t, u in zip(values, share, strict=True))
        print(f"{name:>20}: {statistics.median(values) * 1e3:8.2f} ms  ({ratio:.2f}× the share)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
