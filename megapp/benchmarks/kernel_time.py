"""Where a single-GPU training step's device time goes, kernel by kernel.

    python -m megapp.benchmarks.kernel_time --out kernels.json -- --num-layers 24 \\
        --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 \\
        --micro-batch-size 4 --global-batch-size 16 --bf16 --lr 1e-4

builds the model and optimizer ``pretrain_gpt.py``'s flags describe (one process, the whole
model, ``megapp.training.build_training_setup``), runs ``--warmup`` training steps on random
tokens, then one under ``torch.profiler``, and sums the device time of its kernels by kind:
``matmul`` (cuBLAS/CUTLASS GEMMs), ``attention`` (fused attention), ``optimizer`` (the Adam
and multi-tensor kernels), ``memory`` (every other kernel: norms, activations, copies,
reductions), with the time the device ran none of them (its idle gaps). On a GPU a second
profiled step records the host's operators and their input shapes: which operator, on which
shapes, launched each kernel (``operators``). It also times the step's wall clock. The
planner's operation model (:func:`megapp.planning.operations.layer_parts`) prices the same
kinds, so the two can be set side by side kind by kind.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from megapp.benchmarks.common import median
from megapp.benchmarks.gpt_stack import forward_step, microbatches_of
from megapp.tensor_parallel.random import model_parallel_manual_seed
from megapp.training import build_training_setup, train_step
from megapp.training.arguments import config_from_flags

KINDS = {
    "attention": ("flash", "fmha", "attention", "sdpa", "cudnn"),
    "optimizer": ("adam", "multi_tensor", "foreach"),
    "matmul": ("gemm", "cutlass", "nvjet", "xmma", "sm90_", "sm80_", "cublas"),
}


def kind_of(kernel: str) -> str:
    """The kind a kernel's name says it is (first match of :data:`KINDS`), else memory."""
    name = kernel.lower()
    return next((k for k, keys in KINDS.items() if any(key in name for key in keys)), "memory")


def idle_time(intervals: list[tuple[float, float, str]], top: int = 12) -> dict:
    """From kernels' ``(start, end, name)`` seconds: the span from the first start to the
    last end, the time in it when no kernel ran (``idle_s``), and the longest idle gaps with
    the kernels on either side."""
    if not intervals:
        return {"span_s": 0.0, "idle_s": 0.0, "gap_count": 0, "gaps": []}
    ordered = sorted(intervals)
    gaps, reach, before = [], ordered[0][1], ordered[0][2]
    for start, end, name in ordered[1:]:
        if start > reach:
            gaps.append((start - reach, before, name))
        if end > reach:
            reach, before = end, name
    longest = sorted(gaps, reverse=True)[:top]
    return {
        "span_s": reach - ordered[0][0],
        "idle_s": sum(g for g, _, _ in gaps),
        "gap_count": len(gaps),
        "gaps": [{"seconds": g, "after": a[:100], "before": b[:100]} for g, a, b in longest],
    }


def kernel_times(flags: list[str], warmup: int, vocab: int, device: torch.device) -> dict:
    """Build, warm up, profile one step; the figures as a dict. On a CPU ``device`` the
    "kernels" are the profiler's operator events (a check of this module, not a measure)."""
    config = config_from_flags([*flags, "--use-default-corpus"], world_size=1)
    gpt = config.gpt_config(vocab)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model_parallel_manual_seed(1234)  # the dropout streams, as pretrain_gpt.py seeds them
    setup = build_training_setup(
        gpt, config.optimizer, precision=config.precision, seed=1234, device=device
    )
    mbs = config.training.micro_batch_size
    gbs = config.training.global_batch_size
    seq = config.model.seq_length

    def step(index: int) -> float:
        g = torch.Generator().manual_seed(index)
        data = torch.randint(0, vocab, (gbs, seq + 1), generator=g).to(device)
        batches = microbatches_of(data[:, :-1], data[:, 1:], mbs)
        sync()
        start = time.perf_counter()
        train_step(forward_step, iter(batches), setup.chunks, setup.optimizer,
                   num_microbatches=gbs // mbs, groups=setup.groups)  # fmt: skip
        sync()
        return time.perf_counter() - start

    walls = [step(i) for i in range(warmup)]
    where = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    activities = [
        torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    ]
    with torch.profiler.profile(activities=activities) as prof:
        profiled_wall = step(warmup)
    operators = []
    if cuda:  # again with the operators and their input shapes: what launched each kernel
        host = [torch.profiler.ProfilerActivity.CPU, *activities]
        with torch.profiler.profile(activities=host, record_shapes=True) as shaped:
            step(warmup + 1)
        operators = operator_kernels(_chrome_trace(shaped))
    walls.append(step(warmup + 2))
    totals: dict[str, float] = {}
    intervals: list[tuple[float, float, str]] = []
    counts: dict[str, int] = {}
    top: dict[str, float] = {}
    calls: dict[str, int] = {}
    for event in prof.events():
        total = event.device_time_total if cuda else event.self_cpu_time_total
        seconds = total / 1e6
        if event.device_type != where or seconds <= 0:
            continue
        intervals.append((event.time_range.start / 1e6, event.time_range.end / 1e6, event.name))
        kind = kind_of(event.name)
        totals[kind] = totals.get(kind, 0.0) + seconds
        counts[kind] = counts.get(kind, 0) + 1
        top[event.name] = top.get(event.name, 0.0) + seconds
        calls[event.name] = calls.get(event.name, 0) + event.count
    heaviest = sorted(top.items(), key=lambda kv: -kv[1])
    return {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "flags": flags,
        "wall_s": median(walls[1:]) if len(walls) > 1 else walls[0],
        "profiled_wall_s": profiled_wall,
        "kernel_seconds": totals,
        "kernel_counts": counts,
        "kernel_total_s": sum(totals.values()),
        **idle_time(intervals),
        "heaviest": [
            {"name": n[:160], "seconds": s, "calls": calls[n], "kind": kind_of(n)}
            for n, s in heaviest
        ],
        "operators": operators,
    }


def _chrome_trace(prof: torch.profiler.profile) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())


def operator_kernels(trace: dict) -> list[dict]:
    """The kernels each operator launched, from a profiler's Chrome trace (``trace``, as
    ``export_chrome_trace`` writes it): a kernel names the operator that launched it by its
    ``External id``, or the runtime or driver call that launched it by their correlation id,
    and that call the operator around it (its ``External id``, else the innermost operator
    around it on its host thread). Rows of operator name, input shapes and strides, kernel
    name, calls and device seconds, heaviest first."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    by_id = {e["args"]["External id"]: e for e in ops if "External id" in e.get("args", {})}
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    threads: dict[tuple, list[dict]] = {}
    for e in ops:
        threads.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    starts = {}
    for thread, spans in threads.items():
        spans.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        starts[thread] = [e["ts"] for e in spans]

    def launcher(kernel: dict) -> dict | None:
        args = kernel.get("args", {})
        if args.get("External id") in by_id:
            return by_id[args["External id"]]
        launch = launches.get(args.get("correlation"))
        if launch is None:
            return None
        if launch.get("args", {}).get("External id") in by_id:
            return by_id[launch["args"]["External id"]]
        thread = (launch.get("pid"), launch.get("tid"))
        if thread not in threads:
            return None
        return _innermost(threads[thread], starts[thread], launch["ts"])

    rows: dict[tuple, dict] = {}
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memset", "gpu_memcpy"):
            continue
        op = launcher(e)
        name = op["name"] if op else "(no operator)"
        shapes = op.get("args", {}).get("Input Dims", []) if op else []
        strides = op.get("args", {}).get("Input Strides", []) if op else []
        key = (name, json.dumps([shapes, strides]), e["name"][:160])
        row = rows.setdefault(key, {"op": name, "shapes": shapes, "strides": strides,
                                    "kernel": e["name"][:160], "calls": 0,
                                    "seconds": 0.0})  # fmt: skip
        row["calls"] += 1
        row["seconds"] += e.get("dur", 0) / 1e6
    return sorted(rows.values(), key=lambda r: -r["seconds"])


def _innermost(spans: list[dict], starts: list[float], ts: float) -> dict | None:
    """The latest-starting of ``spans`` (sorted by start, ``starts`` their starts) that
    contains ``ts``: walking back from the last one that starts by then."""
    for index in range(bisect.bisect_right(starts, ts) - 1, -1, -1):
        span = spans[index]
        if span["ts"] + span.get("dur", 0) >= ts:
            return span
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(prog="python -m megapp.benchmarks.kernel_time",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", help="write the figures here (JSON)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--vocab", type=int, default=257, help="the tokenizer's vocabulary")
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv[:cut])
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: no CUDA device here; --device cpu checks the module",
              file=sys.stderr)  # fmt: skip
        return 2
    report = kernel_times(argv[cut + 1 :], args.warmup, args.vocab, device)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    idle, span = report["idle_s"] * 1e3, report["span_s"] * 1e3
    print(f"{report['device']}: step {report['wall_s'] * 1e3:.1f} ms wall, kernels "
          f"{report['kernel_total_s'] * 1e3:.1f} ms, idle {idle:.1f} ms in "
          f"{report['gap_count']} gaps of the profiled step's {span:.1f}")  # fmt: skip
    for kind, seconds in sorted(report["kernel_seconds"].items(), key=lambda kv: -kv[1]):
        print(f"  {kind:<10} {seconds * 1e3:9.2f} ms  {report['kernel_counts'][kind]:6d} kernels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
