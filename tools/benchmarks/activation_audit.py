"""Activation memory of one transformer layer, term by term, against Megatron's formula.

    python tools/benchmarks/activation_audit.py --seq-length 256 --micro-batch-size 2 \
        --hidden-size 512 --num-attention-heads 8

Counts the bytes one TransformerLayer keeps for backward (bf16 activations)
in units of s·b·h bytes, next to Korthikanti et al. (2022): 34 + 5·a·s/h
without recompute, 34 with selective recompute. Also times forward+backward
(fp32) with everything stored, with the linear inputs rebuilt, and with the
norm statistics recomputed as well (megapp's default): the price of the
savings, as the median of per-round ratios over interleaved rounds.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

from megapp.fusions.extension import select_tier
from megapp.fusions.norm import LayerNorm, layer_norm_reference_stats
from megapp.fusions.rms_norm import rms_norm_reference_stats
from megapp.tensor_parallel.random import model_parallel_manual_seed
from megapp.transformer import TransformerConfig, TransformerLayer
from megapp.transformer.layer import merge_heads
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


def step_time(layer: TransformerLayer, x: torch.Tensor) -> float:
    """Seconds for one forward + backward of ``layer`` on a fresh leaf copy of x."""
    inp = x.detach().requires_grad_()
    start = time.perf_counter()
    layer(inp).float().sum().backward()
    return time.perf_counter() - start


def variants(args, **overrides) -> dict[str, TransformerLayer]:
    """The same fp32 layer with everything stored, with the linear inputs rebuilt, and with the
    linear inputs rebuilt and the norm statistics recomputed (the default)."""
    stored, rebuilt, default = (build(args, torch.float32, **overrides) for _ in range(3))
    stored.recompute_saved_inputs = False
    rebuilt.recompute_saved_inputs = True
    for norm in (rebuilt.input_layernorm, rebuilt.pre_mlp_layernorm):
        norm.recompute_stats = False
    return {"stored": stored, "rebuilt": rebuilt, "default": default}


def extra_work(layer: TransformerLayer, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    """What the savings add to backward, as separately timeable calls on tensors of the layer's
    shapes: the rebuilt linear inputs (both norms' outputs, the activation's output, the attention
    output's relayout) and the two norms' recomputed statistics."""
    s, b, _ = x.shape
    config = layer.config
    heads = torch.randn(b, config.num_attention_heads, s, config.kv_channels, dtype=x.dtype)
    fc1 = layer.mlp.linear_fc1
    inner = torch.randn(s, b, fc1.weight.shape[0], dtype=x.dtype)
    norms = (layer.input_layernorm, layer.pre_mlp_layernorm)

    def rebuild() -> None:
        with torch.no_grad():
            for norm in norms:
                norm(x)
            layer.mlp.activation(inner, fc1.bias)
            merge_heads(heads).contiguous()

    def stats() -> None:
        # What the norms' backward runs on CPU (the compiled kernel, else the reference).
        for norm in norms:
            layer_norm = isinstance(norm, LayerNorm)
            if select_tier("layer_norm" if layer_norm else "rms_norm", x) == "cpu":
                kernel = (
                    torch.ops.megapp.layer_norm_stats
                    if layer_norm
                    else torch.ops.megapp.rms_norm_stats
                )
                kernel(x, norm.eps)
            elif layer_norm:
                layer_norm_reference_stats(x, norm.eps)
            else:
                rms_norm_reference_stats(x, norm.eps)

    return {"rebuild": rebuild, "stats": stats}


def time_variants(layers: dict[str, TransformerLayer], x: torch.Tensor, rounds: int) -> dict:
    """Interleaved rounds, each variant once per round in a rotating order, so load from other
    jobs falls on all alike, then the extra work alone. Returns per variant the times and the
    per-round ratios to "stored", and the extra work's times."""
    names = list(layers)
    extra = extra_work(layers["stored"], x)
    for name in names:  # warm up (allocator, kernels, the tier log line)
        step_time(layers[name], x)
    for fn in extra.values():
        fn()
    times = {name: [] for name in [*names, *extra]}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(step_time(layers[name], x))
        for name, fn in extra.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    ratios = {
        name: [t / base for t, base in zip(times[name], times["stored"], strict=True)]
        for name in names
    }
    return {"times": times, "ratios": ratios}


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return q1, q2, q3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=21, help="timed rounds")
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
    print(
        f"\nforward + backward of one fp32 layer, {args.repeats} interleaved rounds "
        f"({torch.get_num_threads()} threads); per variant: median ms, and the median "
        "(quartiles) of its per-round ratio to everything stored"
    )
    xf = x.float()
    for title, overrides in (
        ("sdpa without attention dropout", {"attention_dropout": 0.0}),
        ("sdpa + attention dropout", {}),
    ):
        result = time_variants(variants(args, **overrides), xf, args.repeats)
        print(f"{title}:")
        for name, label in (
            ("stored", "linear inputs and norm statistics stored"),
            ("rebuilt", "linear inputs rebuilt, statistics stored"),
            ("default", "linear inputs rebuilt, statistics recomputed"),
        ):
            q1, q2, q3 = quartiles(result["ratios"][name])
            ms = statistics.median(result["times"][name]) * 1e3
            print(
                f"    {label:52s} {ms:8.1f} ms   {(q2 - 1) * 100:+5.1f}% "
                f"({(q1 - 1) * 100:+.1f} to {(q3 - 1) * 100:+.1f})"
            )
        base = statistics.median(result["times"]["stored"])
        for name, label in (
            ("rebuild", "the rebuilds alone (2 norms, activation, relayout)"),
            ("stats", "the statistics alone (2 norms)"),
        ):
            ms = statistics.median(result["times"][name]) * 1e3
            print(f"    {label:52s} {ms:8.2f} ms   {ms / base / 10:+5.2f}% of everything stored")


if __name__ == "__main__":
    main()
