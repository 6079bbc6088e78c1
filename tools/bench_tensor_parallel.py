"""Benchmark one transformer layer's tensor-parallel blocks (attention + MLP) on gloo.

    python tools/bench_tensor_parallel.py                        # spawns tp = 1, 2, 4 worlds
    python tools/bench_tensor_parallel.py --seq 512 --hidden 1024 --tp 2 4 --iters 10
    torchrun --nproc-per-node 2 tools/bench_tensor_parallel.py   # tp = the world size only

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
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import platform
import shlex
import socket
import statistics
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.multiprocessing as mp
from torch import nn

from megapp import parallel_state as ps
from megapp.transformer.attention import ParallelAttention
from megapp.transformer.config import TransformerConfig
from megapp.transformer.mlp import ParallelMLP

# torch.distributed functions that communicate. Every one found is wrapped while counting,
# so a collective the analysis does not expect still shows up (as an unexpected kind).
COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_single",
    "_all_gather_base",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "_reduce_scatter_base",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "barrier",
)
# Kind of each collective: all-reduce (AR), all-gather (AG), reduce-scatter (RS).
KIND = {
    "all_reduce": "AR",
    "all_gather": "AG",
    "all_gather_into_tensor": "AG",
    "all_gather_single": "AG",
    "_all_gather_base": "AG",
    "reduce_scatter": "RS",
    "reduce_scatter_tensor": "RS",
    "reduce_scatter_single": "RS",
    "_reduce_scatter_base": "RS",
}
MIB = 1 << 20


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


# ----- shims around torch.distributed ----------------------------------------------------------
_local = threading.local()


@contextlib.contextmanager
def intercept(handler):
    """Route every collective in COLLECTIVES through ``handler(name, original, bound)``.

    Patched in ``torch.distributed``, ``distributed_c10d`` and in every loaded ``megapp``
    module that holds its own reference (``from torch.distributed import all_reduce`` or
    ``_gather = dist.all_gather_single``). A collective called from inside another one
    (torch 2.13's ``all_gather_into_tensor`` calls ``all_gather_single``) goes straight to
    the original, so each call counts once, under the name of the function called.
    """
    originals = {}
    for name in COLLECTIVES:
        for module in (dist, c10d):
            fn = getattr(module, name, None)
            if fn is not None:
                originals.setdefault(fn, name)
    shims = {fn: _shim(name, fn, handler) for fn, name in originals.items()}
    modules = [dist, c10d] + [
        m
        for name, m in list(sys.modules.items())
        if m is not None and (name == "megapp" or name.startswith("megapp."))
    ]
    saved = []
    for module in modules:
        for attr, value in list(vars(module).items()):
            try:
                shim = shims.get(value)
            except TypeError:  # unhashable
                continue
            if shim is not None:
                saved.append((module, attr, value))
                setattr(module, attr, shim)
    try:
        yield
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)


def _shim(name, original, handler):
    signature = inspect.signature(original)

    def shim(*args, **kwargs):
        if getattr(_local, "depth", 0):
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        _local.depth = 1
        try:
            return handler(name, original, bound)
        finally:
            _local.depth = 0

    return shim


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


@dataclass
class Op:
    phase: str  # "fwd" or "bwd"
    name: str  # the torch.distributed function called
    kind: str  # AR, AG, RS, or the name for anything else
    payload: int  # bytes of the full tensor (see the module docstring)
    shard: int  # bytes of the per-rank part (= payload for an all-reduce)
    world: int  # ranks in the group
    shape: list[int] = field(default_factory=list)  # shape of the full tensor
    dtype: str = ""


def _payload(name: str, a: dict) -> tuple[int, int, torch.Tensor | None]:
    """(full-tensor bytes, per-rank bytes, full tensor) of one call's bound arguments."""
    kind = KIND.get(name)
    if kind == "AR":
        return _nbytes(a["tensor"]), _nbytes(a["tensor"]), a["tensor"]
    if name == "all_gather":
        return _nbytes(a["tensor_list"]), _nbytes(a["tensor"]), None
    if name == "reduce_scatter":
        return _nbytes(a["input_list"]), _nbytes(a["output"]), None
    if kind == "AG":  # (output_tensor | output, input_tensor | input)
        out, inp = (v for k, v in a.items() if isinstance(v, torch.Tensor))
        return _nbytes(out), _nbytes(inp), out
    if kind == "RS":  # (output, input)
        return _nbytes(a["input"]), _nbytes(a["output"]), a["input"]
    total = sum(_nbytes(v) for v in a.values())
    return total, total, None


def wire_bytes(kind: str, payload: int, world: int) -> float:
    """Bytes one rank sends for a collective of ``payload`` full-tensor bytes (ring)."""
    if world == 1:
        return 0.0
    if kind == "AR":
        return 2 * (world - 1) / world * payload
    if kind in ("AG", "RS"):
        return (world - 1) / world * payload
    return float("nan")


def gloo_bytes(kind: str, payload: int, world: int) -> float:
    """Bytes one rank sends on gloo, whose reduce-scatter is an all-reduce and a slice
    (pytorch/pytorch#118911), twice a ring reduce-scatter."""
    return wire_bytes("AR" if kind == "RS" else kind, payload, world)


class Recorder:
    """Counts every collective (and passes it through to torch.distributed)."""

    def __init__(self):
        self.phase = "fwd"
        self.ops: list[Op] = []

    def __call__(self, name, original, bound):
        a = bound.arguments
        payload, shard, full = _payload(name, a)
        group = a.get("group")
        self.ops.append(
            Op(
                self.phase,
                name,
                KIND.get(name, name),
                payload,
                shard,
                dist.get_world_size(group),
                list(full.shape) if full is not None else [],
                str(full.dtype).removeprefix("torch.") if full is not None else "",
            )
        )
        return original(*bound.args, **bound.kwargs)


class _Done:
    """Stands in for the Work of an async collective that has already finished."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def no_communication(name, original, bound):
    """Do locally what a collective leaves in its outputs, with the same shapes."""
    a = bound.arguments
    kind = KIND.get(name)
    if kind == "AR":
        pass  # in place: keep the local partial
    elif name == "all_gather":
        for t in a["tensor_list"]:
            t.copy_(a["tensor"])
    elif name == "reduce_scatter":
        a["output"].copy_(a["input_list"][dist.get_rank(a.get("group"))])
    elif kind == "AG":
        out, inp = (v for k, v in a.items() if isinstance(v, torch.Tensor))
        out.view(-1, *inp.shape).copy_(
            inp.unsqueeze(0).expand(out.numel() // inp.numel(), *inp.shape)
        )
    elif kind == "RS":
        out, inp = a["output"], a["input"]
        out.copy_(inp.view(-1, *out.shape)[dist.get_rank(a.get("group"))])
    else:
        raise RuntimeError(f"no local stand-in for torch.distributed.{name}")
    return _Done() if a.get("async_op") else None


# ----- analytic count ---------------------------------------------------------------------------
def analytic_ops(t: int, sp: bool) -> list[tuple[str, str]]:
    """(phase, kind) of every collective of one layer at tp = t, in issue order; each has
    a payload of A = s·b·h·B bytes."""
    if t == 1:
        return []
    if not sp:
        # Forward: the row layers' g (proj, fc2). Backward: the column layers' f (fc1, qkv).
        return [("fwd", "AR"), ("fwd", "AR"), ("bwd", "AR"), ("bwd", "AR")]
    # Per block, forward: all-gather the sequence before the column layer, reduce-scatter
    # after the row layer. Backward (MLP first): the row layer's reduce-scatter becomes an
    # all-gather of the gradient; the column layer re-gathers its input (it saved only the
    # shard) for the weight gradient, then reduce-scatters the input gradient.
    block_fwd = [("fwd", "AG"), ("fwd", "RS")]
    block_bwd = [("bwd", "AG"), ("bwd", "AG"), ("bwd", "RS")]
    return block_fwd * 2 + block_bwd * 2


def formula(args) -> str:
    s, b, h, nb = args.seq, args.batch, args.hidden, 4
    a = s * b * h * nb
    return "\n".join(
        [
            f"A = s·b·h·B = {s}·{b}·{h}·{nb} = {a} bytes ({a / MIB:.3f} MiB), t = tp; "
            "per rank per layer (attention + MLP):",
            "  no SP: 4 all-reduces of A (fwd: after the attention projection and fc2 [g]; "
            "bwd: input grads of qkv and fc1 [f])",
            "         payload 4A, ring wire 4·2(t-1)/t·A = 8(t-1)/t·A",
            "  SP:    per block fwd all-gather + reduce-scatter, bwd all-gather (g's grad) + "
            "all-gather (column re-gathers its input for dW) + reduce-scatter (column dX):",
            "         6 all-gathers + 4 reduce-scatters of A, payload 10A, "
            "ring wire 10(t-1)/t·A (8(t-1)/t·A without the re-gathers)",
            "  payload = the full tensor (all-reduced tensor, all-gather output, reduce-scatter "
            "input); wire = bytes one rank sends: all-reduce 2(t-1)/t, all-gather and "
            "reduce-scatter (t-1)/t of the payload",
        ]
    )


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


def written_bytes() -> int | None:
    """Bytes this process has passed to write-family syscalls (Linux ``/proc/self/io``
    ``wchar``): gloo's TCP sends, so the bytes a rank really put on loopback."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def replayer(ops: list[Op], tp: int):
    """A function that issues the recorded collectives alone (same functions, shapes and
    order, no compute) and returns its time, or None if a kind cannot be replayed."""
    if tp == 1 or not ops:
        return lambda: 0.0
    group = ps.get_tensor_model_parallel_group()
    calls = []
    for op in ops:
        fn = getattr(dist, op.name)
        full = torch.randn(op.shape, dtype=getattr(torch, op.dtype or "float32"))
        shard = full.chunk(tp)[0].contiguous() if op.shape else None
        if op.kind == "AR" and op.shape:
            calls.append(lambda fn=fn, full=full: fn(full, group=group))
        elif op.kind == "AG" and op.shape and op.name != "all_gather":
            calls.append(lambda fn=fn, full=full, shard=shard: fn(full, shard, group=group))
        elif op.kind == "RS" and op.shape and op.name != "reduce_scatter":
            calls.append(lambda fn=fn, full=full, shard=shard: fn(shard, full, group=group))
        else:
            return None

    def run() -> float:
        start = time.perf_counter()
        for call in calls:
            call()
        return time.perf_counter() - start

    return run


@dataclass
class Result:
    tp: int
    sp: bool
    threads: int
    forward: list[float]  # per timed iteration, slowest rank
    backward: list[float]
    total: list[float]
    compute_only: list[float]
    collectives_alone: list[float]
    ops: list[Op]  # rank 0's collectives of one forward + backward
    analytic: list[tuple[str, str]]
    activation_bytes: int
    same_on_every_rank: bool
    written: list[int | None]  # per rank: bytes written to sockets in that forward + backward


def measure(args, tp: int, sp: bool, threads: int) -> Result:
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
    comm = replayer(ops, tp)
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


# ----- processes --------------------------------------------------------------------------------
def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def threads_for(args, tp: int) -> int:
    return args.threads or max(1, cores() // tp)


def worker(rank: int, world: int, port: int | None, args, queue) -> None:
    # torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor (older megapp
    # mappings call them); the warning would print once per rank.
    warnings.filterwarnings("ignore", r".*(all_gather_into_tensor|reduce_scatter_tensor)")
    threads = threads_for(args, world)
    if port is None:  # torchrun
        dist.init_process_group("gloo")
    else:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
    ps.initialize_model_parallel(world)
    # tp = 1 runs with the whole machine and, as the per-core baseline, with one thread.
    thread_counts = [threads, 1] if world == 1 and threads > 1 and not args.threads else [threads]
    results = []
    for n in thread_counts:
        torch.set_num_threads(n)
        for sp in args.sp_modes:
            if sp and world == 1:
                continue
            results.append(measure(args, world, sp, n))
            if rank == 0:
                print(f"  tp={world} sp={int(sp)} threads={n} done", file=sys.stderr, flush=True)
    ps.destroy_model_parallel()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        if queue is None:
            if not report(args, results):
                sys.exit(1)
        else:
            queue.put(results)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----- report -----------------------------------------------------------------------------------
def command_line() -> str:
    script = shlex.join(sys.argv)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return f"torchrun --nproc-per-node {os.environ['WORLD_SIZE']} {script}"
    return f"python {script}"


def machine() -> str:
    return (
        f"{platform.platform()}, {platform.processor() or platform.machine()}, "
        f"{cores()} cores (os.cpu_count()={os.cpu_count()}), python {platform.python_version()}, "
        f"torch {torch.__version__}, backend gloo over 127.0.0.1"
    )


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def _ops_summary(kinds: list[str]) -> str:
    counts = {k: kinds.count(k) for k in dict.fromkeys(kinds)}
    return " + ".join(f"{n} {k}" for k, n in counts.items()) or "none"


def check(r: Result) -> tuple[bool, str]:
    """Do the measured collectives equal the analytic ones, op by op, in bytes?"""
    a = r.activation_bytes
    measured = [(op.phase, op.kind, op.payload) for op in r.ops]
    expected = [(phase, kind, a) for phase, kind in r.analytic]
    if measured == expected:
        return True, ""
    return False, f"tp={r.tp} sp={int(r.sp)}: measured {measured}\n  expected {expected}"


def report(args, results: list[Result], elapsed: float | None = None) -> bool:
    """Print everything; False if a measured count differs from the formula."""
    a = args.seq * args.batch * args.hidden * 4
    print(f"$ {args.command}")
    print(f"machine: {machine()}")
    load = "/".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average (1/5/15 min) at the start: {args.load_at_start}, at the end: {load}")
    print(
        f"layer: s={args.seq} b={args.batch} h={args.hidden} heads={args.heads} "
        f"query_groups={args.query_groups or args.heads} "
        f"ffn={args.ffn} {args.activation} attention={args.attention_backend} fp32, dropout 0; "
        f"median of {args.iters} iterations after {args.warmup} warmup, slowest rank each"
    )
    print(formula(args))
    base = next((_med(r.total) for r in results if r.tp == 1), None)  # the first: all cores
    timing = [
        "tp", "SP", "threads/rank", "fwd ms", "bwd ms", "fwd+bwd ms", "(min)", "speedup",
        "no-comm ms", "(min)", "comm-alone ms", "comm share",
    ]  # fmt: skip
    traffic = [
        "tp", "SP", "collectives", "payload B measured", "payload B formula", "match",
        "ring wire MiB (counted ops)", "ring wire MiB (formula)", "socket MiB (measured)",
        "socket / ring",
    ]  # fmt: skip
    timing_rows, traffic_rows, problems = [], [], []
    for r in results:
        total, no_comm = _med(r.total), _med(r.compute_only)
        payload = sum(op.payload for op in r.ops)
        wire = sum(wire_bytes(op.kind, op.payload, op.world) for op in r.ops)
        f_payload = a * len(r.analytic)
        f_wire = sum(wire_bytes(kind, a, r.tp) for _, kind in r.analytic)
        known = [w for w in r.written if w is not None]
        socket_bytes = statistics.fmean(known) if known and r.tp > 1 else None
        ok, why = check(r)
        if not ok:
            problems.append(why)
        expected = sum(gloo_bytes(op.kind, op.payload, op.world) for op in r.ops)
        if socket_bytes is not None and socket_bytes > 1.05 * expected + 16384:
            problems.append(
                f"tp={r.tp} sp={int(r.sp)}: the ranks wrote {socket_bytes:.0f} bytes to their "
                f"sockets, more than the {expected:.0f} the counted collectives account for "
                "on gloo: some communication escaped the shims"
            )
        if not r.same_on_every_rank:
            problems.append(f"tp={r.tp} sp={int(r.sp)}: ranks issued different collectives")
        sp = "on" if r.sp else "off"
        timing_rows.append(
            [
                str(r.tp),
                sp,
                str(r.threads),
                f"{_med(r.forward) * 1e3:.1f}",
                f"{_med(r.backward) * 1e3:.1f}",
                f"{total * 1e3:.1f}",
                f"{min(r.total) * 1e3:.1f}",
                f"{base / total:.2f}" if base else "n/a",
                f"{no_comm * 1e3:.1f}",
                f"{min(r.compute_only) * 1e3:.1f}",
                f"{_med(r.collectives_alone) * 1e3:.1f}",
                f"{1 - no_comm / total:.0%}",
            ]
        )
        if any(row[:2] == [str(r.tp), sp] for row in traffic_rows):
            continue  # the same layout again, with other thread counts
        traffic_rows.append(
            [
                str(r.tp),
                sp,
                _ops_summary([op.kind for op in r.ops]),
                str(payload),
                str(f_payload),
                "exact" if ok and payload == f_payload else "NO",
                f"{wire / MIB:.3f}",
                f"{f_wire / MIB:.3f}",
                "n/a" if socket_bytes is None else f"{socket_bytes / MIB:.3f}",
                f"{socket_bytes / wire:.2f}" if socket_bytes and wire else "n/a",
            ]
        )
    print(
        "\nTime per layer (forward + backward of attention + MLP), ms; medians, and the "
        "fastest iteration in (min):"
    )
    print(_table(timing, timing_rows))
    print(
        "speedup: the first tp=1 row's fwd+bwd / this fwd+bwd (medians); no-comm: the same "
        "layer with every\ncollective replaced by a local stand-in of the same shapes; "
        "comm-alone: the recorded collectives replayed\nwithout compute (the three alternate "
        "iteration by iteration); comm share: 1 - no-comm / fwd+bwd"
    )
    print("\nBytes per rank per layer (one forward + backward):")
    print(_table(traffic, traffic_rows))
    print(
        "AR/AG/RS = all-reduce/all-gather/reduce-scatter; socket = bytes a rank wrote to its "
        "gloo sockets\n(/proc/self/io wchar, mean over ranks) during the counted iteration"
    )
    for r in results:
        if r.ops:
            seq = ", ".join(f"{op.phase} {op.kind}" for op in r.ops)
            print(f"  tp={r.tp} SP {'on' if r.sp else 'off'}: {seq}")
    if problems:
        print("\nMEASURED != ANALYTIC:\n" + "\n".join(problems))
    if elapsed is not None:
        print(f"\ntotal {elapsed:.0f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        data = {
            "command": args.command,
            "machine": machine(),
            "args": {k: v for k, v in vars(args).items() if k not in ("command", "sp_modes")},
            "results": [asdict(r) for r in results],
        }
        Path(args.json).write_text(json.dumps(data, indent=1))
        print(f"wrote {args.json}")
    sys.stdout.flush()
    return not problems


def parse_args(argv=None):
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


def main() -> None:
    args = parse_args()
    args.command = command_line()
    args.load_at_start = "/".join(f"{x:.2f}" for x in os.getloadavg())
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    problem = check_layouts(args, [int(os.environ["WORLD_SIZE"])] if torchrun else args.tp)
    if problem:
        sys.exit(f"error: {problem}")
    if torchrun:  # tp is the world size
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, args, None)
        return
    started = time.perf_counter()
    ctx = mp.get_context("spawn")
    results = []
    for tp in args.tp:
        queue = ctx.SimpleQueue()
        print(f"spawning {tp} gloo rank(s)", file=sys.stderr, flush=True)
        spawned = mp.spawn(worker, (tp, _free_port(), args, queue), nprocs=tp, join=False)
        got = None
        # Read the result while the ranks run (a big one would fill the pipe); join raises,
        # and stops the other ranks, if one of them fails.
        while not spawned.join(timeout=0.5):
            if got is None and not queue.empty():
                got = queue.get()
        if got is None:
            got = queue.get()
        results += got
    if not report(args, results, time.perf_counter() - started):
        sys.exit(1)


if __name__ == "__main__":
    main()
