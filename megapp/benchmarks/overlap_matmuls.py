"""The matmul side of ``--tp-comm-overlap`` measured on one device against the time model:

    python -m megapp.benchmarks.overlap_matmuls --hardware PROFILE [--out FILE] [--quick]

For the layers of Megatron-Core's H100 runs (one tensor-parallel rank's shapes), every pair
of :func:`~megapp.planning.tp_overlap.overlap_pairs` is timed twice: its matmul alone, and
as its overlap method runs it without the communication: ``tp`` pieces back to back (ring
exchange), ``4`` pieces on the multiprocessors ``16`` leave (pipeline), whole on those
(bulk). The multiprocessors are held back with cuBLASLt's SM-count target
(``torch._C._set_sm_carveout_experimental``); every call here runs on cuBLASLt so that both
timings share a library. Each is a single call (the pieces one call of all of them) from a
cold cache (:meth:`~megapp.planning.microbench.Timer.spaced`). Beside each, the time model's
price of the same from the profile (:func:`~megapp.planning.tp_overlap.priced_matmul`).
What the pieces and the held-back multiprocessors cost a layer, measured and predicted, is
the compute half of the overlap model; the transfers need two devices.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from megapp.models.gpt import GPTConfig
from megapp.planning.hardware import load_hardware
from megapp.planning.microbench import Timer, warm_up
from megapp.planning.tp_overlap import (
    COMMUNICATION_SMS,
    overlap_pairs,
    pair_cut,
    pair_piece,
    priced_matmul,
)

CASES = {  # Megatron-Core's H100 table (megapp.planning.models): layers, tp, tokens per rank
    "mcore-7.1b tp2 mb4": (4096, 32, 2, 4 * 4096),
    "mcore-32b tp8 mb4": (7168, 56, 8, 4 * 4096),
    "mcore-70b tp8 mb2": (8192, 64, 8, 2 * 4096),
    "mcore-462b tp8 mb1": (18432, 144, 8, 4096),
}
QUICK = {"small tp2": (256, 4, 2, 512)}


def layer(hidden: int, heads: int, tp: int) -> GPTConfig:
    return GPTConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=heads, vocab_size=128,
        tensor_model_parallel_size=tp, sequence_parallel=True, tp_comm_overlap=True,
        params_dtype=torch.bfloat16,
    )  # fmt: skip


@contextmanager
def carveout(sms: int, device: torch.device):
    """Matmuls inside run on all but ``sms`` multiprocessors (on a GPU)."""
    if device.type != "cuda":
        yield
        return
    torch._C._set_sm_carveout_experimental(sms)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(None)


def timed_matmul(timer: Timer, dtype: torch.dtype, held_back: int = 0):
    """A timer of ``[m, k] × [k, n]`` in a layout, on the multiprocessors ``held_back``
    leave, with the signature of :func:`~megapp.planning.tp_overlap.priced_matmul`'s."""
    cache: dict = {}

    def operands(m, n, k, layout):
        key = (m, n, k, layout)
        if key not in cache:

            def make(*shape):
                return torch.randn(*shape, device=timer.device, dtype=dtype)

            # forward x·Wᵀ, input gradient dy·W, weight gradient dyᵀ·x: the stored shapes
            a, b = {0: (make(m, k), make(n, k).t()), 1: (make(m, k), make(k, n)),
                    2: (make(k, m).t(), make(k, n))}[layout]  # fmt: skip
            cache[key] = (a, b)
        return cache[key]

    def seconds(m, n, k, layout, pieces: int = 1):
        a, b = operands(m * pieces, n, k, layout)
        rows = [a[i * m : (i + 1) * m] for i in range(pieces)]
        with carveout(held_back, timer.device):
            return timer.spaced(lambda: [torch.matmul(r, b) for r in rows])

    return seconds


def measure(hardware_name: str, cases: dict, device: torch.device, repeats: int) -> dict:
    """Every case's pairs: measured and predicted seconds alone and as overlapped."""
    hardware = load_hardware(hardware_name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timer = Timer(device, repeats)
    warm_up(device)
    whole, margin = timed_matmul(timer, dtype), timed_matmul(timer, dtype, COMMUNICATION_SMS)
    priced = priced_matmul(hardware, 2)
    priced_margin = priced_matmul(hardware, 2, COMMUNICATION_SMS)

    report = {}
    for name, (hidden, heads, tp, tokens) in cases.items():
        rows = []
        for pair in overlap_pairs(layer(hidden, heads, tp), tokens):
            shape = (pair.m, pair.n, pair.k, pair.layout)
            # the pieces of pair_cut, timed back to back in one call
            rows_each, pieces, beside = pair_cut(pair, tp)
            timed = margin if beside else whole
            split = timed(rows_each, pair.n, pair.k, pair.layout, pieces=pieces)
            rows.append(
                {
                    "pair": pair.name,
                    "method": pair.method,
                    "shape": list(shape[:3]),
                    "alone_s": whole(*shape),
                    "overlapped_s": split,
                    "predicted_alone_s": priced(*shape),
                    "predicted_overlapped_s": math.prod(
                        pair_piece(pair, tp, priced, priced_margin)
                    ),
                }
            )
        report[name] = {
            "pairs": rows,
            "extra_s": sum(r["overlapped_s"] - r["alone_s"] for r in rows),
            "predicted_extra_s": sum(
                r["predicted_overlapped_s"] - r["predicted_alone_s"] for r in rows
            ),
            "alone_s": sum(r["alone_s"] for r in rows),
        }
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hardware", default="h200-ops", help="profile to predict with")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, help="write the report as JSON here")
    p.add_argument("--quick", action="store_true", help="one small case (a smoke run)")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.preferred_blas_library("cublaslt")  # the carveout's library
    report = measure(args.hardware, QUICK if args.quick else CASES, device, args.repeats)
    print(f"`python -m megapp.benchmarks.overlap_matmuls --hardware {args.hardware}`")
    print("| layer | pair | method | alone us | overlapped us | ratio | predicted ratio |")
    print("|---|---|---|---:|---:|---:|---:|")
    for name, case in report.items():
        for r in case["pairs"]:
            ratio = r["overlapped_s"] / r["alone_s"]
            predicted = r["predicted_overlapped_s"] / r["predicted_alone_s"]
            print(
                f"| {name} | {r['pair']} | {r['method']} | {r['alone_s'] * 1e6:.1f} | "
                f"{r['overlapped_s'] * 1e6:.1f} | {ratio:.3f} | {predicted:.3f} |"
            )
        print(
            f"| {name} | all | | {case['alone_s'] * 1e6:.1f} | "
            f"+{case['extra_s'] * 1e6:.1f} | | +{case['predicted_extra_s'] * 1e6:.1f} |"
        )
    if args.out:
        args.out.write_text(json.dumps({"device": str(device), "cases": report}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
