"""Benchmark megapp's GPT training step: framework overhead, layouts on CPU, MFU on a GPU.

    python tools/bench_gpt.py                                  # CPU: overhead + layouts
    python tools/bench_gpt.py --parts overhead --repeats 31 --profile
    python tools/bench_gpt.py --parts layouts --layouts 1,1,1,- 1,1,2,2 --iters 5
    python tools/bench_gpt.py --device cuda --seq 2048         # GPU: 125M GPT, bf16, MFU
    python tools/bench_gpt.py ... --json /tmp/bench_gpt.json

**overhead** (one process). One training step (forward, backward, AdamW step) of megapp's
single-process ``GPTModel`` against the same model written in plain PyTorch
(``tools/plain_gpt.py``: nn.Parameter tensors and torch.nn.functional only), holding copies of
the same weights, on the same batch, each with its own ``torch.optim.AdamW(foreach=True)``.
Before anything is timed the two must agree on the loss and on every gradient
(:func:`plain_gpt.compare`); the tool stops with the differences otherwise. Timed variants:

* ``megapp``: GPTModel with megapp's compiled CPU kernels (``megapp._C``) for the fused ops;
* ``megapp-ref``: the same with ``MEGAPP_FUSED=0`` (pure-PyTorch reference of every fused op),
  when the compiled tier exists;
* ``megapp-keep``: megapp with ``recompute_saved_inputs = False`` on every layer: the norm and
  GeLU outputs that the following linear layers save are kept instead of being recomputed in
  backward (more memory, the price of that recompute in time);
* ``stack``: the full single-process training stack: GPTModel in DistributedDataParallel
  (flat parameter and gradient buffers, gradient hooks), megapp's ``Optimizer`` (fp32 masters
  are the model's buffer, AdamW foreach, gradient norm, no clipping) and ``train_step``
  (pipeline engine with one stage, one microbatch); its first loss must equal the model's;
* ``plain``: the plain PyTorch model.

One round runs one step of every variant, in an order that reverses from round to round
(megapp, plain, plain, megapp, ...), so that load from other jobs hits all alike; each figure is
the median over ``--repeats`` rounds after ``--warmup``. ``overhead`` is median(variant) /
median(plain) − 1; ``paired`` is the median over rounds of the same ratio within the round
(less sensitive to slow drift of the machine). When megapp's overhead exceeds ``--target``
(5%), or with ``--profile``, one more set of steps runs under ``torch.profiler`` and the ops
whose self time differs most between megapp and plain are listed.

**layouts** (gloo, CPU). A few iterations of the full stack, wired as in
``tests/test_gpt_layouts.py`` (build_gpt_chunks, DistributedDataParallel, Optimizer with
clipping, train_step with 1F1B or interleaved 1F1B), under (dp, tp, pp, vpp) layouts over 1, 2
and 4 ranks; every layout trains the same model (same seed) on the same global batch, so the
first-iteration loss must agree across layouts (printed as a check). Each layout runs in a fresh
world of processes (``megapp.testing.World``) with ``max(1, cores // ranks)`` torch threads per
rank. Reported:

* tokens/s: global batch × sequence length / iteration time, where an iteration's time is its
  slowest rank's (barrier, ``train_step``, then max over ranks), median over ``--iters``;
* peak RSS per rank: ``resource.getrusage(RUSAGE_SELF).ru_maxrss``, the largest resident set of
  the rank's process over its life (it starts with torch imported and gloo initialized, whose
  pages count on every rank), and RSS at the start of the task (``VmRSS``), so the difference is
  what the model, its activations, gradients and optimizer state added at the peak.

With more ranks than cores the ranks share cores (oversubscription); the report says so per
layout.

**GPU** (``--device cuda``). A 125M-parameter GPT (12 layers, h 768, 12 heads, vocab 50304,
``--seq`` 1024 by default) in bf16 with fp32 master weights, trained by the same full stack on
one device (no process group: one rank). It reports the time per iteration, TFLOP/s per device
and MFU = achieved / the device's dense bf16 peak (H100 SXM and H200 989, H100 PCIe 756, A100
312 TFLOP/s; ``--peak-tflops`` for others). The FLOPs are model FLOPs (what the model needs,
recompute not counted), from the shapes, for one iteration of B sequences of s tokens,
``l`` layers, width h, vocabulary V, MLP 4h, one key/value head per query head::

    forward per layer  = 24·B·s·h² + 4·B·s²·h      (QKV 6, projection 2, MLP 16; q·kᵀ and
                                                     p·v 2 each, the full s×s, causal or not)
    logits             = 2·B·s·h·V
    training           = 3 × forward (backward = 2 × forward)
                       = 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))
                       = 6·N·T + 12·l·s·h·T     (T = B·s tokens, N = 12·l·h² + V·h)

Megatron-LM's 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) is the same count with full activation
recompute (a second forward of every layer, not of the logits). :func:`training_flops` computes
the count from a GPTConfig (any MLP width, GQA, SwiGLU), equal to the formula above for the
standard GPT. Without a usable CUDA device ``--device cuda`` stops with a message.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from megapp import parallel_state as ps
from megapp.distributed import DistributedDataParallel
from megapp.fusions import extension
from megapp.fusions.extension import built_tiers
from megapp.models import GPTConfig, GPTModel, build_gpt_chunks
from megapp.optimizer import Optimizer
from megapp.testing import World
from megapp.training import TrainGroups, train_step

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plain_gpt import PlainGPT, compare  # a sibling file: tools/ is not a package

SEED, LR, WD = 1234, 1e-4, 0.1
# Dense bf16 peak per device, TFLOP/s, matched in order against torch.cuda.get_device_name().
PEAK_BF16 = (("H200", 989.0), ("GH200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0),
             ("A100", 312.0))  # fmt: skip
LAYOUTS = ("1,1,1,-", "2,1,1,-", "1,2,1,-", "1,1,2,-", "2,2,1,-", "1,2,2,-", "1,1,2,2")


# ----- shapes and FLOPs -------------------------------------------------------------------------
def gpt_config(args, *, tp: int = 1, dtype: torch.dtype = torch.float32) -> GPTConfig:
    return GPTConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        vocab_size=args.vocab,
        max_position_embeddings=args.seq,
        hidden_dropout=0.0,  # dropout off: the plain model computes the same function
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        params_dtype=dtype,
    )


def training_flops(config: GPTConfig, batch: int, seq: int) -> float:
    """Model FLOPs of one training iteration (forward + backward, no recompute) of ``batch``
    sequences of ``seq`` tokens; see the module docstring."""
    h, d = config.hidden_size, config.kv_channels
    heads, groups = config.num_attention_heads, config.num_query_groups
    fc1 = config.ffn_hidden_size * (2 if config.activation == "swiglu" else 1)
    per_token_layer = (
        2 * h * (heads + 2 * groups) * d  # QKV
        + 2 * heads * d * h  # output projection
        + 2 * 2 * seq * heads * d  # q·kᵀ and probs·v over the full s×s
        + 2 * h * fc1
        + 2 * config.ffn_hidden_size * h  # MLP
    )
    forward = batch * seq * (config.num_layers * per_token_layer + 2 * h * config.vocab_size)
    return 3.0 * forward


def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)): the standard GPT's training model FLOPs."""
    b, s, l, h, v = batch, seq, layers, hidden, vocab
    return 72.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


def batch_of(args, step: int, sequences: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, labels) ``[sequences, s]`` of iteration ``step``, the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, args.vocab, (sequences, args.seq + 1), generator=g)
    return data[:, :-1].to(device), data[:, 1:].to(device)


def forward_step(iterator: Iterator, chunk, inputs):
    """The pipeline engine's step: the chunk's output and the mean per-token loss."""
    tokens, labels = next(iterator)
    model = chunk.module
    kwargs = {"labels": labels} if model.post_process else {}
    if model.pre_process:
        output = chunk(input_ids=tokens, **kwargs)
    else:
        output = chunk(hidden_states=inputs[0], **kwargs)
    return output, (lambda per_token: per_token.float().mean())


# ----- overhead: megapp against plain PyTorch in one process ------------------------------------
def _adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [p for p in model.parameters() if p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR, foreach=True)


def _model_step(model, optimizer, tokens, labels, fused: bool | None) -> Callable[[], float]:
    def step() -> float:
        with extension.fused(fused) if fused is not None else contextlib.nullcontext():
            optimizer.zero_grad(set_to_none=True)
            loss = model(tokens, labels=labels)
            loss = loss.mean() if loss.dim() else loss
            loss.backward()
            optimizer.step()
        return float(loss.detach())

    return step


def _stack_step(args, tokens, labels) -> Callable[[], float]:
    ddp = DistributedDataParallel(GPTModel(gpt_config(args), seed=SEED))
    optimizer = Optimizer([ddp], lr=LR, weight_decay=WD, clip_grad=None)

    def step() -> float:
        result = train_step(
            forward_step, iter([(tokens, labels)]), [ddp], optimizer,
            num_microbatches=1, groups=TrainGroups(),
        )  # fmt: skip
        return result.loss

    return step


def overhead(args) -> dict:
    torch.set_num_threads(args.threads)
    tokens, labels = batch_of(args, 0, args.batch)
    config = gpt_config(args)
    compiled = "cpu" in built_tiers()

    # The guard: same weights, same batch -> same loss and gradients, or no figures.
    model = GPTModel(config, seed=SEED)
    plain = PlainGPT.from_megapp(model)
    agreement = compare(model, plain, tokens, labels)
    if not agreement.ok:
        sys.exit(f"error: megapp and the plain model disagree, nothing timed:\n{agreement}")

    variants: dict[str, Callable[[], float]] = {}
    variants["megapp"] = _model_step(model, _adamw(model), tokens, labels, compiled or None)
    if compiled and args.reference_tier:
        reference = GPTModel(config, seed=SEED)
        variants["megapp-ref"] = _model_step(reference, _adamw(reference), tokens, labels, False)
    if args.ablation:
        keep = GPTModel(config, seed=SEED)
        for layer in keep.decoder.layers:
            layer.recompute_saved_inputs = False  # keep norm and GeLU outputs instead
        variants["megapp-keep"] = _model_step(keep, _adamw(keep), tokens, labels, compiled or None)
    variants["stack"] = _stack_step(args, tokens, labels)
    variants["plain"] = _model_step(plain, _adamw(plain), tokens, labels, None)
    first = {name: step() for name, step in variants.items()}  # first steps: same loss
    for name, loss in first.items():
        if abs(loss - agreement.loss) > 1e-5 * abs(agreement.loss):
            sys.exit(f"error: {name}'s first training loss {loss} != {agreement.loss}")

    times: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    stalls: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for round_ in range(args.warmup + args.repeats):
        for name in order if round_ % 2 == 0 else order[::-1]:
            stall, used, start = cpu_stall_us(), time.process_time(), time.perf_counter()
            variants[name]()
            elapsed = time.perf_counter() - start
            if round_ >= args.warmup:
                times[name].append(elapsed)
                cpu[name].append(time.process_time() - used)
                stalls[name].append(min(100.0, (cpu_stall_us() - stall) / 1e4 / elapsed))
    result = {
        "shape": _shape(args),
        "threads": args.threads,
        "tier": "cpu (megapp._C)" if compiled else "reference (megapp._C not built)",
        "agreement": dataclasses.asdict(agreement),
        "times_s": times,
        "cpu_times_s": cpu,
        "median_ms": {n: statistics.median(t) * 1e3 for n, t in times.items()},
        "median_cpu_ms": {n: statistics.median(t) * 1e3 for n, t in cpu.items()},
        "tokens_per_s": {n: args.batch * args.seq / statistics.median(t) for n, t in times.items()},
        "iqr_pct": {n: _iqr_pct(t) for n, t in times.items()},
        "stall_pct": {n: statistics.median(x) for n, x in stalls.items()},
        "overhead_pct": {},
        "paired_pct": {},
        "cpu_overhead_pct": {},
        "flops_per_step": training_flops(config, args.batch, args.seq),
    }
    base = statistics.median(times["plain"])
    for name in variants:
        if name != "plain":
            result["overhead_pct"][name] = (statistics.median(times[name]) / base - 1) * 100
            ratios = [a / b for a, b in zip(times[name], times["plain"], strict=True)]
            result["paired_pct"][name] = (statistics.median(ratios) - 1) * 100
            cpu_ratio = statistics.median(cpu[name]) / statistics.median(cpu["plain"])
            result["cpu_overhead_pct"][name] = (cpu_ratio - 1) * 100
    if args.profile or result["overhead_pct"]["megapp"] > args.target:
        steps = {"megapp": variants["megapp"], "plain": variants["plain"]}
        result["profile"] = profile(steps, args.profile_steps)
    return result


def cpu_stall_us() -> float:
    """Linux's CPU pressure: total µs some task waited for a CPU (nan without PSI)."""
    try:
        with open("/proc/pressure/cpu") as f:
            return float(f.readline().rsplit("total=", 1)[1])
    except (OSError, IndexError, ValueError):
        return float("nan")


def _iqr_pct(xs: list[float]) -> float:
    if len(xs) < 4:
        return float("nan")
    q = statistics.quantiles(xs, n=4)
    return (q[2] - q[0]) / statistics.median(xs) * 100


def profile(steps: dict[str, Callable[[], float]], n: int) -> dict:
    """Self CPU time (ms) and calls per op in one step of each variant, under torch.profiler:
    ``n`` steps each, one profile per step, variants alternating; per op the median over the
    ``n`` steps (a step that another job disturbed moves the median little)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    samples: dict[str, list[dict[str, tuple[float, int]]]] = {name: [] for name in steps}
    for step in steps.values():
        step()  # the profiler's first use warms up
    for _ in range(n):
        for name, step in steps.items():
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                step()
            samples[name].append(
                {e.key: (e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()}
            )
    out = {}
    for name, runs in samples.items():
        keys = set().union(*runs)
        out[name] = {
            k: (
                statistics.median(r.get(k, (0.0, 0))[0] for r in runs),
                max(r.get(k, (0.0, 0))[1] for r in runs),
            )
            for k in keys
        }
    return out


# ----- layouts: the full stack over gloo ranks --------------------------------------------------
def parse_layout(text: str) -> tuple[int, int, int, int | None]:
    """``"dp,tp,pp,vpp"`` (vpp ``-`` for none) -> (dp, tp, pp, vpp)."""
    parts = text.split(",")
    if len(parts) != 4:
        raise ValueError(f"a layout is dp,tp,pp,vpp (vpp - for none), got {text!r}")
    dp, tp, pp = (int(p) for p in parts[:3])
    vpp = None if parts[3] in ("-", "", "1") else int(parts[3])
    return dp, tp, pp, vpp


def check_layout(args, dp: int, tp: int, pp: int, vpp: int | None) -> str | None:
    """Why the layout cannot run this model and batch (before any process starts), or None."""
    stages = pp * (vpp or 1)
    if args.layers % stages:
        return f"--layers {args.layers} is not divisible by pp × vpp = {stages}"
    if args.heads % tp or (4 * args.hidden) % tp:
        return f"--heads {args.heads} and the MLP width must divide by tp = {tp}"
    if args.global_batch % (dp * args.micro_batch):
        return f"--global-batch {args.global_batch} is not divisible by dp × micro-batch"
    m = args.global_batch // (dp * args.micro_batch)
    if vpp and m % pp:
        return f"interleaved 1F1B needs the {m} microbatches per replica divisible by pp = {pp}"
    return None


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def layout_rank(args, dp: int, tp: int, pp: int, vpp: int | None) -> dict:
    """One rank of one layout (runs in a World worker): train, time, measure memory."""
    rss_start = _rss_mib()
    ps.initialize_model_parallel(tp, pp, vpp)
    groups = TrainGroups.from_parallel_state()
    config = gpt_config(args, tp=tp)
    chunks = build_gpt_chunks(
        config,
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=pp,
        vpp_size=vpp,
        tp_group=groups.tp,
        seed=SEED,
    )
    chunks = [DistributedDataParallel(c, dp_group=groups.dp) for c in chunks]
    optimizer = Optimizer(
        chunks,
        lr=LR,
        weight_decay=WD,
        clip_grad=1.0,
        tp_group=groups.tp,
        norm_group=ps.get_model_parallel_group(),
    )
    dp_rank, m = ps.get_data_parallel_rank(), args.global_batch // (dp * args.micro_batch)
    times, losses, stalls = [], [], []
    for it in range(args.warmup_iters + args.iters):
        tokens, labels = batch_of(args, it, args.global_batch)
        mine = range(dp_rank * m * args.micro_batch, (dp_rank + 1) * m * args.micro_batch)
        microbatches = [
            (tokens[i : i + args.micro_batch], labels[i : i + args.micro_batch])
            for i in mine[:: args.micro_batch]
        ]
        dist.barrier()
        stall, start = cpu_stall_us(), time.perf_counter()
        result = train_step(
            forward_step, [iter(microbatches) for _ in chunks], chunks, optimizer,
            num_microbatches=m, groups=groups,
        )  # fmt: skip
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
        losses.append(result.loss)
        if it >= args.warmup_iters:
            times.append(float(elapsed))
            stalls.append(min(100.0, (cpu_stall_us() - stall) / 1e4 / float(elapsed)))
    return {
        "rank": dist.get_rank(),
        "times_s": times,
        "stall_pct": stalls,
        "losses": losses,
        "rss_start_mib": rss_start,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "threads": torch.get_num_threads(),
    }


def layouts(args) -> list[dict]:
    cores = available_cores()
    out = []
    for text in args.layouts:
        dp, tp, pp, vpp = parse_layout(text)
        world_size = dp * tp * pp
        threads = max(1, cores // world_size)
        print(f"layout dp={dp} tp={tp} pp={pp} vpp={vpp or '-'}: {world_size} rank(s) "
              f"× {threads} thread(s)", file=sys.stderr, flush=True)  # fmt: skip
        world = World(world_size, num_threads=threads)
        world.start()
        try:
            ranks = world.run_by_name(
                "bench_gpt", "layout_rank", (args, dp, tp, pp, vpp), {}, timeout=args.timeout
            )
        finally:
            world.close()
        times = ranks[0]["times_s"]
        seconds = statistics.median(times)
        out.append(
            {
                "layout": {"dp": dp, "tp": tp, "pp": pp, "vpp": vpp},
                "ranks": world_size,
                "threads_per_rank": threads,
                "oversubscribed": world_size * threads > cores,
                "iteration_s": seconds,
                "iqr_pct": _iqr_pct(times),
                "stall_pct": statistics.median(ranks[0]["stall_pct"]),
                "tokens_per_s": args.global_batch * args.seq / seconds,
                "first_loss": ranks[0]["losses"][0],
                "peak_rss_mib": [r["peak_rss_mib"] for r in ranks],
                "rss_start_mib": [r["rss_start_mib"] for r in ranks],
                "times_s": times,
            }
        )
    return out


# ----- GPU: 125M GPT in bf16, TFLOP/s and MFU ---------------------------------------------------
def peak_tflops(name: str) -> float | None:
    return next((peak for key, peak in PEAK_BF16 if key in name), None)


def throughput(args, device: torch.device, dtype: torch.dtype, peak: float | None) -> dict:
    """The full stack on one device: time per iteration, TFLOP/s, MFU against ``peak``."""
    config = gpt_config(args, dtype=dtype)
    model = GPTModel(config, seed=SEED).to(device)
    ddp = DistributedDataParallel(model)
    optimizer = Optimizer([ddp], lr=LR, weight_decay=WD, clip_grad=1.0)
    m = args.global_batch // args.micro_batch
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for it in range(args.warmup_iters + args.iters):
        tokens, labels = batch_of(args, it, args.global_batch, device)
        microbatches = [
            (tokens[i : i + args.micro_batch], labels[i : i + args.micro_batch])
            for i in range(0, args.global_batch, args.micro_batch)
        ]
        sync()
        start = time.perf_counter()
        train_step(forward_step, iter(microbatches), [ddp], optimizer,
                   num_microbatches=m, groups=TrainGroups())  # fmt: skip
        sync()
        if it >= args.warmup_iters:
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    flops = training_flops(config, args.global_batch, args.seq)
    tflops = flops / seconds / 1e12
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "fused_tiers_built": sorted(built_tiers()),
        "parameters": sum(p.numel() for p in model.parameters()),
        "shape": _shape(args),
        "flops_per_iteration": flops,
        "flops_72bslh2": megatron_flops(
            args.global_batch, args.seq, args.layers, args.hidden, args.vocab
        ),
        "iteration_s": seconds,
        "iqr_pct": _iqr_pct(times),
        "tokens_per_s": args.global_batch * args.seq / seconds,
        "tflops_per_device": tflops,
        "peak_tflops": peak,
        "mfu": tflops / peak if peak else None,
        "max_memory_allocated_gib": (
            torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        ),
        "times_s": times,
    }


def gpu(args) -> dict:
    if not torch.cuda.is_available():
        sys.exit(
            f"error: --device cuda needs a CUDA device, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); run on a GPU "
            "machine, or leave out --device for the CPU benchmark"
        )
    device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device)
    peak = args.peak_tflops or peak_tflops(name)
    return throughput(args, device, torch.bfloat16, peak)


# ----- report -----------------------------------------------------------------------------------
def _shape(args) -> dict:
    keys = ("layers", "hidden", "heads", "seq", "vocab", "batch", "global_batch", "micro_batch")
    return {k: getattr(args, k) for k in keys}


def available_cores() -> int:
    return len(os.sched_getaffinity(0))


def cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def machine() -> str:
    return (
        f"{platform.system()} {platform.machine()}, {cpu_model()}, {available_cores()} cores, "
        f"python {platform.python_version()}, torch {torch.__version__}"
    )


def source_state() -> str:
    """The commit, uncommitted changes to what is measured, and when megapp._C was built."""
    root = Path(__file__).resolve().parents[1]
    paths = ["megapp", "csrc", "setup.py"]

    def git(*argv: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *argv], capture_output=True, text=True, check=True
        ).stdout

    try:
        commit = git("rev-parse", "--short", "HEAD").strip()
        changed = [line[3:] for line in git("status", "--porcelain", "--", *paths).splitlines()]
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"
    library = extension._library_path(extension.CPU_EXTENSION)
    built = (
        time.strftime("%Y-%m-%d %H:%M %Z", time.localtime(os.path.getmtime(library)))
        if library
        else "not built"
    )
    shown = ", ".join(changed[:6]) + (f" and {len(changed) - 6} more" if len(changed) > 6 else "")
    return f"commit {commit}, uncommitted: {shown or 'none'}; megapp._C built {built}"


def command_line() -> str:
    return "python " + shlex.join(sys.argv)


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def report_overhead(args, r: dict) -> None:
    s = r["shape"]
    print(
        f"\n## overhead: one training step, 1 process, {r['threads']} threads, fp32, "
        f"fused ops on the {r['tier']} tier\n"
        f"GPT l={s['layers']} h={s['hidden']} heads={s['heads']} s={s['seq']} V={s['vocab']}, "
        f"batch {s['batch']} ({s['batch'] * s['seq']} tokens, "
        f"{r['flops_per_step'] / 1e9:.1f} GFLOP/step); median of {args.repeats} interleaved "
        f"rounds after {args.warmup} warmup"
    )
    print(f"guard: {compare_line(r['agreement'])}")
    rows = []
    for name, ms in r["median_ms"].items():

        def pct(key: str, name: str = name) -> str:
            value = r[key].get(name)
            return "-" if value is None else f"{value:+.1f}%"

        rows.append(
            [
                name,
                f"{ms:.1f}",
                f"{min(r['times_s'][name]) * 1e3:.1f}",
                f"{r['iqr_pct'][name]:.0f}",
                f"{r['stall_pct'][name]:.0f}",
                f"{r['median_cpu_ms'][name]:.1f}",
                f"{r['tokens_per_s'][name]:.0f}",
                f"{r['flops_per_step'] / (ms / 1e3) / 1e9:.1f}",
                pct("overhead_pct"),
                pct("paired_pct"),
                pct("cpu_overhead_pct"),
            ]
        )
    header = ["variant", "median ms", "min ms", "IQR %", "stall %", "CPU ms", "tokens/s",
              "GFLOP/s", "overhead", "paired", "CPU overhead"]  # fmt: skip
    print(_table(header, rows))
    print(
        "median/min ms: wall time per step; IQR: spread of the rounds / median; stall: share of "
        "the step some task\nwaited for a CPU (Linux PSI, other jobs); CPU ms: process CPU "
        "time per step; overhead: median / plain's median − 1;\npaired: median over rounds "
        "of the ratio within the round − 1; CPU overhead: the same as overhead, on CPU time"
    )
    over = r["overhead_pct"]["megapp"]
    verdict = "within" if over <= args.target else "ABOVE"
    print(
        f"megapp / plain: {1 + over / 100:.3f} ({verdict} the {args.target:g}% target; paired "
        f"{r['paired_pct']['megapp']:+.1f}%, CPU time {r['cpu_overhead_pct']['megapp']:+.1f}%)"
    )
    if "profile" in r:
        report_profile(r["profile"], args.profile_top)


def compare_line(a: dict) -> str:
    return (
        f"loss megapp {a['loss']:.6f} plain {a['plain_loss']:.6f}; max over parameters of "
        f"max|Δgrad|/max|grad| = {a['max_grad_rel']:.2e} ({a['worst']}); "
        f"tolerance {a['tolerance']:.0e}"
    )


def report_profile(prof: dict, top: int) -> None:
    megapp, plain = prof["megapp"], prof["plain"]
    total = {n: sum(ms for ms, _ in ops.values()) for n, ops in prof.items()}
    print(
        f"\nprofile (torch.profiler, self CPU time per step): megapp {total['megapp']:.1f} ms, "
        f"plain {total['plain']:.1f} ms; the ops that differ most:"
    )
    names = set(megapp) | set(plain)
    diff = sorted(
        names,
        key=lambda k: -abs(megapp.get(k, (0, 0))[0] - plain.get(k, (0, 0))[0]),
    )[:top]
    rows = []
    for k in diff:
        a, b = megapp.get(k, (0.0, 0)), plain.get(k, (0.0, 0))
        rows.append([k[:48], f"{a[0]:.2f}", str(a[1]), f"{b[0]:.2f}", str(b[1]),
                     f"{a[0] - b[0]:+.2f}"])  # fmt: skip
    print(_table(["op", "megapp ms", "calls", "plain ms", "calls", "Δ ms"], rows))


def report_layouts(args, rows_in: list[dict]) -> None:
    cores = available_cores()
    print(
        f"\n## layouts: full stack (DDP + Optimizer + train_step), gloo, fp32; GPT "
        f"l={args.layers} h={args.hidden} heads={args.heads} s={args.seq} V={args.vocab}; "
        f"global batch {args.global_batch} × {args.seq} = {args.global_batch * args.seq} tokens, "
        f"micro-batch {args.micro_batch}; median of {args.iters} iterations after "
        f"{args.warmup_iters} warmup; {cores} cores"
    )
    rows = []
    for r in rows_in:
        lay = r["layout"]
        peak = r["peak_rss_mib"]
        added = [p - s for p, s in zip(peak, r["rss_start_mib"], strict=True)]
        rows.append(
            [
                f"{lay['dp']},{lay['tp']},{lay['pp']},{lay['vpp'] or '-'}",
                str(r["ranks"]),
                str(r["threads_per_rank"]) + (" (oversubscribed)" if r["oversubscribed"] else ""),
                f"{r['iteration_s'] * 1e3:.0f}",
                f"{r['iqr_pct']:.0f}",
                f"{r['stall_pct']:.0f}",
                f"{r['tokens_per_s']:.0f}",
                f"{max(r['rss_start_mib']):.0f}",
                f"{max(peak):.0f}",
                f"{min(added):.0f}-{max(added):.0f}",
                f"{r['first_loss']:.6f}",
            ]
        )
    header = ["dp,tp,pp,vpp", "ranks", "threads/rank", "iter ms", "IQR %", "stall %",
              "tokens/s", "start RSS MiB", "peak RSS MiB", "added MiB", "loss 1"]  # fmt: skip
    print(_table(header, rows))
    print(
        "tokens/s: global tokens per iteration / median iteration time (slowest rank); stall: "
        "share of the iteration some task waited\nfor a CPU (PSI); start RSS: VmRSS when the "
        "task starts (torch imported, gloo up), max over ranks; peak RSS: ru_maxrss,\nmax over "
        "ranks; added: peak − start per rank, min-max over ranks; loss 1: first iteration's "
        "loss (same model and data in every layout)"
    )
    losses = [r["first_loss"] for r in rows_in]
    if max(losses) - min(losses) > 1e-4 * abs(losses[0]):
        print(f"WARNING: the first-iteration losses differ across layouts: {losses}")


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
        f"FLOPs per iteration: {r['flops_per_iteration']:.4e} from the config, "
        f"{r['flops_72bslh2']:.4e} from 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))"
    )
    print(
        f"iteration {r['iteration_s'] * 1e3:.1f} ms (IQR {r['iqr_pct']:.1f}%), "
        f"{r['tokens_per_s']:.0f} tokens/s, {r['flops_per_iteration'] / 1e12:.2f} TFLOP/iteration, "
        f"{r['tflops_per_device']:.1f} TFLOP/s per device, MFU {mfu} of {r['peak_tflops']} "
        f"TFLOP/s; max allocated {r['max_memory_allocated_gib'] or 0:.2f} GiB"
    )


# ----- entry ------------------------------------------------------------------------------------
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
    load = "/".join(f"{x:.2f}" for x in os.getloadavg())
    started = time.perf_counter()
    results: dict = {
        "command": args.command,
        "machine": machine(),
        "sources": source_state(),
        "load_at_start": load,
    }
    if args.device == "cuda":
        results["gpu"] = gpu(args)
    else:
        if "overhead" in args.parts:
            results["overhead"] = overhead(args)
        if "layouts" in args.parts:
            results["layouts"] = layouts(args)
    results["load_at_end"] = "/".join(f"{x:.2f}" for x in os.getloadavg())
    results["seconds"] = time.perf_counter() - started
    print(f"$ {args.command}\nmachine: {results['machine']}\nsources: {results['sources']}")
    print(f"load average (1/5/15 min) at the start {load}, at the end {results['load_at_end']}")
    if "overhead" in results:
        report_overhead(args, results["overhead"])
    if "layouts" in results:
        report_layouts(args, results["layouts"])
    if "gpu" in results:
        report_gpu(results["gpu"])
    print(f"\ntotal {results['seconds']:.0f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        saved = {k: v for k, v in vars(args).items() if k != "command"}
        Path(args.json).write_text(json.dumps({**results, "args": saved}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
