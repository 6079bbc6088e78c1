"""Benchmark megapp's GPT training step: framework overhead, layouts on CPU, MFU on a GPU.

    python tools/benchmarks/bench_gpt.py                           # CPU: overhead + layouts
    python tools/benchmarks/bench_gpt.py --parts overhead --repeats 31 --profile
    python tools/benchmarks/bench_gpt.py --parts layouts --layouts 1,1,1,- 1,1,2,2 --iters 5
    python tools/benchmarks/bench_gpt.py --device cuda --seq 2048  # GPU: 125M GPT, bf16, MFU
    python tools/benchmarks/bench_gpt.py ... --json /tmp/bench_gpt.json

* **overhead** (one process, ``gpt_overhead.py`` beside this file): one training step of
  megapp's ``GPTModel`` against the same model in plain PyTorch
  (:mod:`megapp.testing.plain_gpt`), same weights, batch and optimizer, guarded by a
  comparison of the loss and every gradient;
* **layouts** (gloo, CPU, ``gpt_layouts.py`` beside this file): the full training stack
  under (dp, tp, pp, vpp) layouts over 1, 2 and 4 ranks, tokens/s and peak memory per rank;
* **GPU** (``--device cuda``, :mod:`megapp.benchmarks.gpt_mfu`): a 125M GPT in bf16 on one
  device, TFLOP/s and MFU against the device's peak from ``megapp.training.flops``.

Every part builds the model, DistributedDataParallel and the Optimizer through one function,
:func:`megapp.benchmarks.gpt_stack.build_stack`. The report starts with the command, the
machine, the sources measured and the load; ``--json`` writes every figure.
"""

from __future__ import annotations

import argparse
import time

from gpt_layouts import LAYOUTS, check_layout, layouts, parse_layout, report_layouts
from gpt_overhead import overhead, report_overhead

from megapp.benchmarks.common import (
    available_cores,
    command_line,
    load_average,
    machine,
    source_state,
    write_json,
)
from megapp.benchmarks.gpt_mfu import gpu, report_gpu

SOURCES = ("megapp", "csrc", "setup.py")  # what a run measures


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--parts", nargs="+", choices=["overhead", "layouts"],
                   default=["overhead", "layouts"], help="CPU parts to run")  # fmt: skip
    p.add_argument("--layers", type=int, help="default 4 on CPU, 12 on cuda")
    p.add_argument("--hidden", type=int, help="default 256 on CPU, 768 on cuda")
    p.add_argument("--heads", type=int, help="default 8 on CPU, 12 on cuda")
    p.add_argument("--seq", type=int, help="default 256 on CPU, 1024 on cuda")
    p.add_argument("--vocab", type=int, help="default 4096 on CPU, 50304 on cuda")
    p.add_argument("--batch", type=int, default=4, help="sequences per overhead step")
    p.add_argument("--global-batch", type=int, help="sequences per iteration (layouts, cuda)")
    p.add_argument("--micro-batch", type=int, help="sequences per microbatch (layouts, cuda)")
    p.add_argument("--repeats", type=int, default=21, help="overhead: timed rounds")
    p.add_argument("--warmup", type=int, default=3, help="overhead: untimed rounds")
    p.add_argument("--threads", type=int, help="overhead: torch threads (default: all cores)")
    p.add_argument("--no-reference-tier", dest="reference_tier", action="store_false",
                   help="overhead: skip megapp's pure-PyTorch tier")  # fmt: skip
    p.add_argument("--no-ablation", dest="ablation", action="store_false",
                   help="overhead: skip megapp-keep (no recompute of saved inputs)")  # fmt: skip
    p.add_argument("--target", type=float, default=5.0, help="overhead target, %%")
    p.add_argument("--profile", action="store_true", help="profile even within the target")
    p.add_argument("--profile-steps", type=int, default=9)
    p.add_argument("--profile-top", type=int, default=15)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), help="dp,tp,pp,vpp each")
    p.add_argument("--iters", type=int, help="layouts, cuda: timed iterations (4; cuda 10)")
    p.add_argument("--warmup-iters", type=int, help="layouts, cuda: untimed (1; cuda 3)")
    p.add_argument("--timeout", type=float, default=600.0, help="layouts: seconds per layout")
    p.add_argument("--peak-tflops", type=float, help="cuda: the device's dense bf16 peak")
    p.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    defaults = dict(layers=(4, 12), hidden=(256, 768), heads=(8, 12), seq=(256, 1024),
                    vocab=(4096, 50304), global_batch=(8, 32), micro_batch=(2, 8), iters=(4, 10),
                    warmup_iters=(1, 3))  # fmt: skip
    for key, (cpu_value, cuda_value) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, cuda_value if cuda else cpu_value)
    args.threads = args.threads or available_cores()
    positive = ("layers", "hidden", "heads", "seq", "vocab", "batch", "global_batch",
                "micro_batch", "repeats", "iters", "threads", "profile_steps")  # fmt: skip
    for key in positive:
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.warmup_iters < 0:
        p.error("--warmup-iters must be >= 0")
    if args.global_batch % args.micro_batch:
        p.error("--global-batch must be a multiple of --micro-batch")
    if not cuda and "layouts" in args.parts:
        for text in args.layouts:
            try:
                problem = check_layout(args, *parse_layout(text))
            except ValueError as err:
                problem = str(err)
            if problem:
                p.error(f"layout {text}: {problem}")
    return args


def main() -> None:
    args = parse_args()
    args.command = command_line()
    started = time.perf_counter()
    results: dict = {
        "command": args.command,
        "machine": machine(),
        "sources": source_state(SOURCES),
        "load_at_start": load_average(),
    }
    if args.device == "cuda":
        results["gpu"] = gpu(args)
    else:
        if "overhead" in args.parts:
            results["overhead"] = overhead(args)
        if "layouts" in args.parts:
            results["layouts"] = layouts(args)
    results["load_at_end"] = load_average()
    results["seconds"] = time.perf_counter() - started
    print(f"$ {args.command}\nmachine: {results['machine']}\nsources: {results['sources']}")
    print(
        f"load average (1/5/15 min) at the start {results['load_at_start']}, at the end "
        f"{results['load_at_end']}"
    )
    if "overhead" in results:
        report_overhead(args, results["overhead"])
    if "layouts" in results:
        report_layouts(args, results["layouts"])
    if "gpu" in results:
        report_gpu(results["gpu"])
    print(f"\ntotal {results['seconds']:.0f} s")
    if args.json:
        saved = {k: v for k, v in vars(args).items() if k != "command"}
        write_json(args.json, {**results, "args": saved})
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
