"""The GPU part of ``tools/benchmarks/bench_gpt.py``: TFLOP/s and MFU of the full stack on one
device.

A 125M-parameter GPT by default (12 layers, h 768, 12 heads, vocab 50304, ``--seq`` 1024) in
bf16 with fp32 master weights, trained by the same stack as the other parts
(:func:`~megapp.benchmarks.gpt_stack.build_stack`) on one device, with no process group. It
reports the time per iteration, TFLOP/s per device and MFU = achieved / the device's dense
16-bit peak (``megapp.training.flops.peak_16bit_tflops`` of ``torch.cuda.get_device_name()``;
``--peak-tflops`` for others). The FLOPs are model FLOPs (what the model needs, recompute not
counted) from ``megapp.training.flops.gpt_training_flops``: for the standard GPT with B
sequences of s tokens, l layers, width h and vocabulary V that is
``72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))``. :func:`throughput` runs on any device (the tests
run it on the CPU); without a usable CUDA device ``--device cuda`` stops with a message.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from megapp.benchmarks.common import iqr_pct, median
from megapp.benchmarks.gpt_stack import (
    batch_of,
    build_stack,
    forward_step,
    gpt_config,
    microbatches_of,
    model_flops,
    shape,
)
from megapp.fusions.extension import built_tiers
from megapp.training import train_step
from megapp.training.flops import peak_16bit_tflops


def throughput(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype, peak: float | None
) -> dict:
    """The full stack on one device: time per iteration, TFLOP/s, MFU against ``peak``
    (TFLOP/s, or None: no MFU)."""
    chunks, optimizer, groups = build_stack(args, device=device, dtype=dtype)
    m = args.global_batch // args.micro_batch
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for it in range(args.warmup_iters + args.iters):
        tokens, labels = batch_of(args, it, args.global_batch, device)
        microbatches = microbatches_of(tokens, labels, args.micro_batch)
        sync()
        start = time.perf_counter()
        train_step(forward_step, iter(microbatches), chunks, optimizer,
                   num_microbatches=m, groups=groups)  # fmt: skip
        sync()
        if it >= args.warmup_iters:
            times.append(time.perf_counter() - start)
    seconds = median(times)
    flops = model_flops(gpt_config(args, dtype=dtype), args.global_batch, args.seq)
    tflops = flops / seconds / 1e12
    return {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "fused_tiers_built": sorted(built_tiers()),
        "parameters": sum(p.numel() for c in chunks for p in c.module.parameters()),
        "shape": shape(args),
        "flops_per_iteration": flops,
        "iteration_s": seconds,
        "iqr_pct": iqr_pct(times),
        "tokens_per_s": args.global_batch * args.seq / seconds,
        "tflops_per_device": tflops,
        "peak_tflops": peak,
        "mfu": tflops / peak if peak else None,
        "max_memory_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30
        if cuda
        else None,
        "times_s": times,
    }


def gpu(args: argparse.Namespace) -> dict:
    """:func:`throughput` in bf16 on the current CUDA device, or exit with why not."""
    if not torch.cuda.is_available():
        sys.exit(
            f"error: --device cuda needs a CUDA device, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); run on a GPU "
            "machine, or leave out --device for the CPU benchmark"
        )
    device = torch.device("cuda", torch.cuda.current_device())
    peak = args.peak_tflops or peak_16bit_tflops(torch.cuda.get_device_name(device))
    return throughput(args, device, torch.bfloat16, peak)


def report_gpu(r: dict) -> None:
    s = r["shape"]
    print(
        f"\n## GPU: {r['device']}, {r['dtype']}, {r['parameters'] / 1e6:.1f}M parameters, "
        f"l={s['layers']} h={s['hidden']} s={s['seq']} V={s['vocab']}, global batch "
        f"{s['global_batch']} (micro-batch {s['micro_batch']}); compiled fused-op tiers: "
        f"{', '.join(r['fused_tiers_built']) or 'none (PyTorch reference)'}"
    )
    mfu = "n/a (unknown peak: --peak-tflops)" if r["mfu"] is None else f"{r['mfu']:.1%}"
    print(
        f"FLOPs per iteration: {r['flops_per_iteration']:.4e} (model FLOPs, "
        "megapp.training.flops.gpt_training_flops; recompute not counted)"
    )
    print(
        f"iteration {r['iteration_s'] * 1e3:.1f} ms (IQR {r['iqr_pct']:.1f}%), "
        f"{r['tokens_per_s']:.0f} tokens/s, {r['flops_per_iteration'] / 1e12:.2f} TFLOP/iteration, "
        f"{r['tflops_per_device']:.1f} TFLOP/s per device, MFU {mfu} of {r['peak_tflops']} "
        f"TFLOP/s; max allocated {r['max_memory_allocated_gib'] or 0:.2f} GiB"
    )
