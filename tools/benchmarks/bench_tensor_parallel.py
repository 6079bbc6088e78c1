"""Benchmark one transformer layer's tensor-parallel blocks (attention + MLP) on gloo.

    python tools/benchmarks/bench_tensor_parallel.py            # spawns tp = 1, 2, 4 worlds
    python tools/benchmarks/bench_tensor_parallel.py --seq 512 --hidden 1024 --tp 2 4 --iters 10
    torchrun --nproc-per-node 2 tools/benchmarks/bench_tensor_parallel.py  # tp = the world size

The layer is ``y = x' + MLP(x')`` with ``x' = x + Attention(x)`` (megapp's
ParallelAttention and ParallelMLP, built from one TransformerConfig with
``tensor_model_parallel_size = tp``, dropout 0, fp32, biases on; no norms), run
with sequence parallelism off and on. For each layout it reports:

* time of forward + backward per layer: barrier, forward, backward on every rank;
  an iteration's time is its slowest rank's; median over ``--iters`` after
  ``--warmup``. Each rank uses ``--threads`` torch threads (default
  ``max(1, cores // tp)``: the tp processes share the machine's cores; tp = 1 also
  runs with one thread, the per-core baseline);
* the same with every collective replaced by a local stand-in of the same shapes
  (all-reduce: nothing; all-gather: copies of the local shard; reduce-scatter: the
  local slice), i.e. the compute and memory traffic without communication;
* the recorded collectives replayed alone (same kinds, shapes and order, no compute);
* the bytes of every collective the layer issues, counted by shims wrapped around
  ``torch.distributed``'s collectives for one extra iteration, next to the analytic
  count (see ``formula()``). "Payload" is the full, unsharded tensor of a
  collective: the all-reduced tensor, an all-gather's output, a reduce-scatter's
  input. "Wire" is what one rank sends with ring algorithms: all-reduce
  ``2(t-1)/t`` of its payload, all-gather and reduce-scatter ``(t-1)/t``.

The instruments (shims, stand-ins, replay) are in :mod:`megapp.testing.collective_count`, the
analytic count and the report in ``tp_analysis.py`` beside this file.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import warnings
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch import nn
from tp_analysis import Result, analytic_ops, report

from megapp import parallel_state as ps
from megapp.benchmarks.common import (
    Ranks,
    available_cores,
    command_line,
    launched_by_torchrun,
    load_average,
)
from megapp.testing.collective_count import (
    Recorder,
    intercept,
    no_communication,
    replayer,
    written_bytes,
)
from megapp.transformer.config import TransformerConfig
from megapp.transformer.layer import ParallelAttention, ParallelMLP


# ----- the layer --------------------------------------------------------------------------------
class Layer(nn.Module):
    """The two tensor-parallel blocks of one transformer layer, with residual adds."""

    def __init__(self, config: TransformerConfig, group):
        super().__init__()
        self.attention = ParallelAttention(config, group)
        self.mlp = ParallelMLP(config, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, bias = self.attention(x)
        x = x + out if bias is None else x + out + bias
        out, bias = self.mlp(x)
        return x + out if bias is None else x + out + bias


def make_config(args, tp: int, sp: bool) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_query_groups=args.query_groups,
        ffn_hidden_size=args.ffn,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        activation=args.activation,
        attention_backend=args.attention_backend,
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        params_dtype=torch.float32,
    )


def build(args, tp: int, sp: bool, group) -> Layer:
    config = make_config(args, tp, sp)
    torch.manual_seed(0)  # the same full weights under every layout
    return Layer(config, group)


def check_layouts(args, tps: list[int]) -> str | None:
    """Why some layout cannot be built (before any process starts), or None."""
    for tp in tps:
        for sp in args.sp_modes:
            if sp and tp == 1:
                continue
            try:
                make_config(args, tp, sp)
            except ValueError as err:
                return f"tp={tp}: {err}"
            if sp and args.seq % tp:
                return f"tp={tp}: sequence parallelism needs --seq ({args.seq}) divisible by tp"
    return None


# ----- measuring --------------------------------------------------------------------------------
def _data(args, tp: int, sp: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = args.seq // tp if sp else args.seq
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, args.batch, args.hidden, generator=g)
    return x, torch.randn(rows, args.batch, args.hidden, generator=g)


def _step(layer: Layer, x: torch.Tensor, grad: torch.Tensor, handler=None):
    """One forward + backward, collectives routed through ``handler`` if given;
    returns (forward s, backward s) on this rank."""
    for p in layer.parameters():
        p.grad = None
    x = x.detach().requires_grad_()
    with intercept(handler) if handler is not None else contextlib.nullcontext():
        start = time.perf_counter()
        out = layer(x)
        mid = time.perf_counter()
        if isinstance(handler, Recorder):
            handler.phase = "bwd"
        out.backward(grad)
        end = time.perf_counter()
    return mid - start, end - mid


def _slowest(values: list[float], tp: int) -> list[float]:
    """Each value's maximum over the ranks (one all-reduce, outside any timed region)."""
    if tp == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def measure(args, tp: int, sp: bool, threads: int) -> Result:
    """One layout on every rank of a world of ``tp`` ranks; rank 0's result is the report's."""
    # torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor (older megapp
    # mappings call them); the warning would print once per rank.
    warnings.filterwarnings("ignore", r".*(all_gather_into_tensor|reduce_scatter_tensor)")
    torch.set_num_threads(threads)
    ps.initialize_model_parallel(tp)
    group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    layer = build(args, tp, sp, group)
    rank = ps.get_tensor_model_parallel_rank()
    x, grad = _data(args, tp, sp, seed=1 + rank)

    # One counted iteration (it also warms up): every collective, and the socket bytes.
    recorder = Recorder()
    if tp > 1:
        dist.barrier()
    before = written_bytes()
    _step(layer, x, grad, recorder)
    after = written_bytes()
    mine = None if before is None or after is None else after - before
    ops, written, same = recorder.ops, [mine], True
    if tp > 1:
        everyone = [None] * tp
        dist.all_gather_object(everyone, ([asdict(op) for op in ops], mine))
        same = all(o == everyone[0][0] for o, _ in everyone)
        written = [w for _, w in everyone]

    # Timed: the three variants alternate, so load that drifts during the run hits all three.
    comm = replayer(ops, group)
    rows = []
    for i in range(args.warmup + args.iters):
        row = []
        if tp > 1:
            dist.barrier()
        f, b = _step(layer, x, grad)
        row += [f, b, f + b]
        if tp > 1:
            dist.barrier()
        row.append(sum(_step(layer, x, grad, no_communication)))
        if tp > 1:
            dist.barrier()
        row.append(comm() if comm is not None else float("nan"))
        row = _slowest(row, tp)
        if i >= args.warmup:
            rows.append(row)
    columns = list(zip(*rows, strict=True))
    return Result(
        tp=tp,
        sp=sp,
        threads=threads,
        forward=list(columns[0]),
        backward=list(columns[1]),
        total=list(columns[2]),
        compute_only=list(columns[3]),
        collectives_alone=list(columns[4]),
        ops=ops,
        analytic=analytic_ops(tp, sp),
        activation_bytes=args.seq * args.batch * args.hidden * 4,
        same_on_every_rank=same,
        written=written,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4], help="spawn mode")
    parser.add_argument(
        "--sp", choices=["both", "on", "off"], default="both", help="sequence parallelism"
    )
    parser.add_argument("--seq", type=int, default=256, help="s")
    parser.add_argument("--batch", type=int, default=2, help="b (micro-batch size)")
    parser.add_argument("--hidden", type=int, default=512, help="h")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--query-groups", type=int, help="key/value heads (default: --heads)")
    parser.add_argument("--ffn", type=int, help="MLP inner width (default 4h)")
    parser.add_argument("--activation", choices=["gelu", "swiglu"], default="gelu")
    parser.add_argument(
        "--attention-backend", default="sdpa", help="TransformerConfig.attention_backend"
    )
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, help="torch threads per rank (default max(1, cores // tp))"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the raw results as JSON")
    args = parser.parse_args(argv)
    if args.iters < 1 or args.warmup < 0 or (args.threads is not None and args.threads < 1):
        parser.error("--iters and --threads must be >= 1, --warmup >= 0")
    args.ffn = args.ffn or 4 * args.hidden
    args.sp_modes = {"both": [False, True], "on": [True], "off": [False]}[args.sp]
    return args


# ----- processes --------------------------------------------------------------------------------
def threads_for(args, tp: int) -> int:
    return args.threads or max(1, available_cores() // tp)


def main() -> None:
    args = parse_args()
    args.command = command_line()
    args.load_at_start = load_average()
    torchrun = launched_by_torchrun()
    tps = [int(os.environ["WORLD_SIZE"])] if torchrun else args.tp
    problem = check_layouts(args, tps)
    if problem:
        sys.exit(f"error: {problem}")
    started, results, reporting = time.perf_counter(), [], True
    for tp in tps:
        if not torchrun:
            print(f"spawning {tp} gloo rank(s)", file=sys.stderr, flush=True)
        threads = threads_for(args, tp)
        # tp = 1 runs with the whole machine and, as the per-core baseline, with one thread.
        counts = [threads, 1] if tp == 1 and threads > 1 and not args.threads else [threads]
        with Ranks(tp, threads=threads) as ranks:
            reporting = ranks.reporting
            for n in counts:
                for sp in args.sp_modes:
                    if sp and tp == 1:
                        continue
                    results.append(ranks.run(measure, args, tp, sp, n))
                    if reporting:
                        print(f"  tp={tp} sp={int(sp)} threads={n} done", file=sys.stderr,
                              flush=True)  # fmt: skip
    if reporting and not report(args, results, time.perf_counter() - started):
        sys.exit(1)


if __name__ == "__main__":
    main()
