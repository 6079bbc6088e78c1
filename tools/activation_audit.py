"""Activation memory of one transformer layer, term by term, against Megatron's formula.

    python tools/activation_audit.py --seq-length 256 --micro-batch-size 2 --hidden-size 512 \
        --num-attention-heads 8

Counts the bytes one TransformerLayer keeps for backward (bf16 activations)
in units of s·b·h bytes, next to Korthikanti et al. (2022): 34 + 5·a·s/h
without recompute, 34 with selective recompute. Also times forward+backward
with megapp's rebuilt linear inputs on and off (the price of the savings).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

from megapp.tensor_parallel.random import model_parallel_manual_seed
from megapp.transformer import TransformerConfig, TransformerLayer
from megapp.transformer.memory_audit import audit_saved_activations


def build(args, dtype=torch.bfloat16, **overrides) -> TransformerLayer:
    settings = {"hidden_dropout": 0.1, "attention_dropout": 0.1, **overrides}
    config = TransformerConfig(
        num_layers=1,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        params_dtype=dtype,
        **settings,
    )
    torch.manual_seed(0)
    model_parallel_manual_seed(0)
    return TransformerLayer(config, 0)


def step_time(layer: TransformerLayer, x: torch.Tensor, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        inp = x.detach().requires_grad_()
        start = time.perf_counter()
        layer(inp).float().sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])  # the first run warms up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    s, b, h, a = args.seq_length, args.micro_batch_size, args.hidden_size, args.num_attention_heads
    unit = s * b * h  # bytes of one [s, b, h] tensor at 1 byte per element: "s·b·h"
    x = torch.randn(s, b, h, dtype=torch.bfloat16)

    print("command: python " + " ".join(sys.argv))
    print(f"machine: {platform.platform()}, {os.cpu_count()} cpus, torch {torch.__version__}")
    print(f"s={s} b={b} h={h} a={a}, bf16 activations; units: s·b·h bytes\n")
    runs = [
        ("sdpa, no recompute", {"attention_backend": "sdpa"}, True),
        ("sdpa without attention dropout, no recompute", {"attention_dropout": 0.0}, True),
        ("sdpa, no recompute, linear inputs stored", {"attention_backend": "sdpa"}, False),
        ("sdpa, selective", {"recompute_granularity": "selective"}, True),
        ("fused_softmax, no recompute", {"attention_backend": "fused_softmax"}, True),
        (
            "fused_softmax, selective",
            {"attention_backend": "fused_softmax", "recompute_granularity": "selective"},
            True,
        ),
    ]
    megatron = {"no recompute": 34 + 5 * a * s / h, "selective": 34}
    for title, overrides, rebuild in runs:
        layer = build(args, **overrides)
        layer.recompute_saved_inputs = rebuild
        audit = audit_saved_activations(layer, x.detach().requires_grad_())
        print(f"{title}: {audit.total / unit:.2f} s·b·h")
        for name, value in sorted(audit.in_units(unit).items(), key=lambda kv: -kv[1]):
            print(f"    {name or '(layer)':40s} {value:8.2f}")
    print(
        f"\nMegatron (Korthikanti et al. 2022): no recompute {megatron['no recompute']:.2f}, "
        f"selective {megatron['selective']:.2f} s·b·h"
    )
    # Timed in fp32: bf16 matmuls on CPUs without bf16 units are slow and would hide the cost.
    on, off = build(args, torch.float32), build(args, torch.float32)
    off.recompute_saved_inputs = False
    xf = x.float()
    t_off, t_on = [], []
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits both alike
        t_off.append(step_time(off, xf, 1))
        t_on.append(step_time(on, xf, 1))
    t_off, t_on = statistics.median(t_off), statistics.median(t_on)
    print(
        f"forward+backward (fp32, median of {args.repeats}): {t_off * 1e3:.1f} ms storing "
        f"linear inputs, {t_on * 1e3:.1f} ms rebuilding them ({(t_on / t_off - 1) * 100:+.1f}%)"
    )


if __name__ == "__main__":
    main()
