"""Benchmark the pipeline engine against its simulator, the bubble formula and torch.

    python tools/bench_pipeline.py                         # spawns 4 gloo ranks itself
    torchrun --nproc-per-node 4 tools/bench_pipeline.py    # the same under torchrun
    python tools/bench_pipeline.py --timeline docs/img     # also a timeline PNG and trace

Every model chunk is a tiny autograd Function that sleeps ``tf / v`` in its
forward and ``tb / v`` in its backward and adds a scalar weight to a small
activation, so the schedule, the point-to-point messages and the autograd
bookkeeping are real while compute is a fixed, contention-free sleep.

Sleep mode compares the measured iteration with the simulator and with the
ideal ``(m + (p - 1) / v)(tf + tb)``; zero-compute mode (tf = tb = 0) gives
the cost per action. Both run the same chunks, activations and microbatches
under ``torch.distributed.pipelining`` (PipelineStage with ScheduleGPipe,
Schedule1F1B, ScheduleInterleaved1F1B). An iteration is timed the same way for
both: barrier, one forward/backward call on every rank, the slowest rank's
time. One extra untimed megapp iteration with ``record=True`` gives the
measured per-action times."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

from megapp.pipeline_parallel import (
    CostModel,
    TensorSpec,
    build_schedule,
    forward_backward,
    simulate,
)
from megapp.pipeline_parallel.timeline import plot_timelines, write_chrome_trace

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
}


# ----- the model: sleeps instead of compute -----------------------------------------------------
SPIN_S = 0.0005  # the last part of a sleep is spent polling the clock


def precise_sleep(seconds: float) -> None:
    """Sleep for ``seconds``, overshooting by microseconds rather than the scheduler's slack.

    ``time.sleep`` wakes 0.2 ms late on an idle VM and later on a busy one, which would be
    counted as compute. So the thread sleeps until ``SPIN_S`` before the deadline and polls
    the clock for the rest: at most 0.5 ms of CPU per action, while the rank would compute.
    """
    deadline = time.perf_counter() + seconds
    if seconds > SPIN_S:
        time.sleep(seconds - SPIN_S)
    while time.perf_counter() < deadline:
        pass


class _Sleep(torch.autograd.Function):
    """``x + w`` that sleeps ``forward_s`` in forward and ``backward_s`` in backward."""

    @staticmethod
    def forward(ctx, x, weight, forward_s, backward_s):
        ctx.backward_s = backward_s
        if forward_s > 0:
            precise_sleep(forward_s)
        return x + weight

    @staticmethod
    def backward(ctx, grad):
        if ctx.backward_s > 0:
            precise_sleep(ctx.backward_s)
        grad_x = grad if ctx.needs_input_grad[0] else None
        return grad_x, grad.sum(), None, None


class SleepChunk(nn.Module):
    """One model chunk: a fixed forward and backward time and one scalar parameter."""

    def __init__(self, forward_s: float, backward_s: float):
        super().__init__()
        self.forward_s, self.backward_s = forward_s, backward_s
        self.weight = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.weight, self.forward_s, self.backward_s)


@dataclass
class Config:
    schedule: str
    m: int
    v: int
    tf: float  # per pipeline stage (all its chunks together), seconds
    tb: float

    @property
    def label(self) -> str:
        return f"{self.schedule} m={self.m} v={self.v}"


@dataclass
class Row:
    config: Config
    actions_per_rank: int
    megapp: list[float] = field(default_factory=list)
    megapp_negotiated: list[float] = field(default_factory=list)
    torch: list[float] = field(default_factory=list)
    torch_error: str = ""
    forward_s: float = 0.0  # mean measured duration of one forward / backward action
    backward_s: float = 0.0
    simulated: float = 0.0  # simulator, nominal action times and the idle-peer latency
    simulated_measured: float = 0.0  # simulator, measured action times and the same latency
    formula: float = 0.0


# ----- timing ---------------------------------------------------------------------------------
def _iteration(run, record: bool = False):
    """One iteration on every rank: barrier, the call, the slowest rank's time."""
    dist.barrier()
    start = time.perf_counter()
    out = run(record=record)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item(), out


def _rounds(runs: dict, iters: int, warmup: int) -> dict[str, list[float]]:
    """Time every implementation once per round, in an order that rotates each round, so a
    slow spell of the machine falls on all of them alike; ``warmup`` rounds are untimed."""
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(warmup + iters):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            elapsed, _ = _iteration(runs[name])
            if i >= warmup:
                times[name].append(elapsed)
    return times


def _mean_action_times(result) -> tuple[float, float]:
    """Mean forward and backward action durations over every rank of a recorded iteration."""
    stats = torch.zeros(4, dtype=torch.float64)
    for e in result.events:
        if e.kind == "compute":
            k = 0 if e.name.startswith("F") else 2
            stats[k] += e.end - e.start
            stats[k + 1] += 1
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item(), (stats[2] / stats[3]).item()


def _data(cfg: Config, args) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (cfg.m * args.micro_batch_size, args.hidden)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _chunks(cfg: Config) -> list[SleepChunk]:
    return [SleepChunk(cfg.tf / cfg.v, cfg.tb / cfg.v) for _ in range(cfg.v)]


def _forward_step(iterator, chunk, inputs):
    x, target = next(iterator)
    out = chunk(x if inputs is None else inputs[0])
    return out, lambda output: F.mse_loss(output, target)


def megapp_runner(cfg: Config, args, declared: bool = True):
    """``run(record)``: one megapp iteration on this rank, returning its PipelineResult.

    ``declared`` passes the activation shape as ``tensor_shapes``; otherwise the engine
    negotiates shapes per message (its default)."""
    x, target = _data(cfg, args)
    size = args.micro_batch_size
    batches = list(zip(x.split(size), target.split(size), strict=True))
    chunks = _chunks(cfg)
    shapes = [TensorSpec((args.micro_batch_size, args.hidden), torch.float32)] if declared else None

    def run(record: bool = False):
        return forward_backward(
            _forward_step,
            [iter(batches) for _ in chunks],
            chunks,
            cfg.m,
            schedule=cfg.schedule,
            tensor_shapes=shapes,
            record=record,
        )

    return run


def torch_runner(cfg: Config, args):
    """``run(record)``: one torch.distributed.pipelining iteration on this rank (never records).

    Shapes are static (``input_args``/``output_args``), as megapp's ``tensor_shapes``."""
    from torch.distributed import pipelining

    rank, p = dist.get_rank(), dist.get_world_size()
    x, target = _data(cfg, args)
    chunks = _chunks(cfg)

    def example(needs_grad: bool) -> torch.Tensor:
        return torch.empty(args.micro_batch_size, args.hidden, requires_grad=needs_grad)

    stages = [
        pipelining.PipelineStage(
            chunk,
            c * p + rank,
            p * cfg.v,
            torch.device("cpu"),
            input_args=example(c * p + rank > 0),
            output_args=example(True),
        )
        for c, chunk in enumerate(chunks)
    ]
    cls = getattr(pipelining, TORCH_SCHEDULES[cfg.schedule])
    schedule = cls(stages if cfg.v > 1 else stages[0], cfg.m, loss_fn=F.mse_loss)
    first, last = rank == 0, rank == p - 1

    def run(record: bool = False):
        inputs = (x,) if first else ()
        schedule.step(*inputs, target=target if last else None, return_outputs=False)

    return run


def p2p_latency(args, pause: float, rounds: int) -> float:
    """One-way latency of one activation between ranks 0 and 1: half the median round trip.

    With ``pause`` > 0 rank 0 sleeps before each round, so the message finds its peer idle
    in a wait, as in a pipeline whose ranks sleep; on a VM waking an idle peer costs far
    more than a back-to-back ping-pong shows.
    """
    rank = dist.get_rank()
    buf = torch.zeros(args.micro_batch_size, args.hidden)

    def one(op, peer):
        for work in dist.batch_isend_irecv([dist.P2POp(op, buf, peer)]):
            work.wait()

    times = []
    for _ in range(rounds):
        if rank == 0 and pause > 0:
            time.sleep(pause)
        start = time.perf_counter()
        if rank == 0:
            one(dist.isend, 1)
            one(dist.irecv, 1)
        elif rank == 1:
            one(dist.irecv, 0)
            one(dist.isend, 0)
        times.append(time.perf_counter() - start)
    dist.barrier()
    latency = torch.tensor([statistics.median(times) / 2 if rank == 0 else 0.0])
    dist.broadcast(latency, 0)
    return latency.item()


def simulated(cfg: Config, forward_s: float, backward_s: float, latency: float) -> float:
    sched = build_schedule(cfg.schedule, dist.get_world_size(), cfg.m, cfg.v)
    return simulate(sched, CostModel(forward_s, backward_s, latency)).makespan


def configs(args, tf: float, tb: float) -> list[Config]:
    out = []
    for m in args.microbatches:
        for name in args.schedules:
            v = args.chunks if name == "interleaved-1f1b" else 1
            out.append(Config(name, m, v, tf, tb))
    return out


def bench(cfg: Config, args, latency: float, iters: int, warmup: int, negotiated: bool) -> Row:
    """megapp (declared and, with ``negotiated``, negotiated shapes) and torch, timed in
    alternating rounds; then one untimed megapp iteration with ``record=True``."""
    p = dist.get_world_size()
    row = Row(cfg, 2 * cfg.m * cfg.v)
    row.formula = (cfg.m + (p - 1) / cfg.v) * (cfg.tf + cfg.tb)
    row.simulated = simulated(cfg, cfg.tf / cfg.v, cfg.tb / cfg.v, latency)
    runs = {"megapp": megapp_runner(cfg, args)}
    if negotiated:
        runs["negotiated"] = megapp_runner(cfg, args, declared=False)
    if not args.no_torch:
        try:
            runs["torch"] = torch_runner(cfg, args)
        except Exception as err:  # a configuration torch refuses (on every rank): report it
            row.torch_error = f"{type(err).__name__}: {err}".splitlines()[0][:120]
    times = _rounds(runs, iters, warmup)
    row.megapp = times["megapp"]
    row.megapp_negotiated = times.get("negotiated", [])
    row.torch = times.get("torch", [])
    _, recorded = _iteration(runs["megapp"], record=True)
    row.forward_s, row.backward_s = _mean_action_times(recorded)
    row.simulated_measured = simulated(cfg, row.forward_s, row.backward_s, latency)
    return row


def _paired(a: list[float], b: list[float]) -> float:
    """Median over rounds of ``a / b`` within the round (nan without b)."""
    return _med([x / y for x, y in zip(a, b, strict=False)]) if b else float("nan")


def cold_op_cost(pause: float, rounds: int = 30) -> float:
    """Median time of one tiny torch op (``x + w`` on an 8 x 256 tensor) run right after
    ``pause`` seconds of sleep, as every action of a sleep-mode iteration runs.

    On some VMs code and data not touched for a few milliseconds come back slowly (this
    one: about 2 us back to back, about 0.1 ms after 10 ms or more), so an action's own
    Python and torch work costs several times more after its sleep than in a loop; this
    puts that figure next to the results it explains."""
    x, w = torch.randn(8, 256), torch.zeros(())
    times = []
    for _ in range(rounds):
        if pause:
            time.sleep(pause)
        start = time.perf_counter()
        x + w
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ----- timelines ------------------------------------------------------------------------------
def draw_timeline(args, latency: float) -> list[str]:
    """Predicted and measured timelines of one sleep-mode configuration, on rank 0."""
    name, m = args.timeline_schedule, args.timeline_microbatches or args.microbatches[0]
    v = args.chunks if name == "interleaved-1f1b" else 1
    cfg = Config(name, m, v, args.forward_ms / 1e3, args.backward_ms / 1e3)
    run = megapp_runner(cfg, args)
    run()  # warmup
    events = run(record=True).events
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, events)
    if dist.get_rank() != 0:
        return []
    measured = [e for rank_events in gathered for e in rank_events]
    sched = build_schedule(name, dist.get_world_size(), m, v)
    predicted = simulate(sched, CostModel(cfg.tf / v, cfg.tb / v, latency)).events
    out = Path(args.timeline)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{name}_p{dist.get_world_size()}_m{m}_v{v}"
    png, trace = out / f"timeline_{stem}.png", out / f"trace_{stem}.json"
    plot_timelines(
        [
            (f"predicted (simulator, p2p latency {latency * 1e3:.2f} ms): {cfg.label}", predicted),
            (f"measured (megapp, gloo): {cfg.label}", measured),
        ],
        png,
    )
    write_chrome_trace(measured, trace)
    return [str(png), str(trace)]


# ----- report ---------------------------------------------------------------------------------
def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _fmt(value: float, spec: str) -> str:
    return "-" if value != value else format(value, spec)  # NaN: not measured


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def sleep_table(rows: list[Row]) -> str:
    header = ["schedule", "m", "v", "formula s", "sim s", "megapp s", "megapp/formula"]
    header += ["F/B ms", "sim* s", "megapp/sim*", "negotiated s", "torch s", "megapp/torch"]
    header += ["paired"]
    body = []
    for r in rows:
        c, got, neg, ref = r.config, _med(r.megapp), _med(r.megapp_negotiated), _med(r.torch)
        body.append(
            [
                c.schedule,
                str(c.m),
                str(c.v),
                f"{r.formula:.3f}",
                f"{r.simulated:.3f}",
                f"{got:.3f}",
                f"{got / r.formula:.4f}",
                f"{r.forward_s * 1e3:.2f}/{r.backward_s * 1e3:.2f}",
                f"{r.simulated_measured:.3f}",
                f"{got / r.simulated_measured:.4f}",
                _fmt(neg, ".3f"),
                _fmt(ref, ".3f") if not r.torch_error else "error",
                _fmt(got / ref, ".4f"),
                _fmt(_paired(r.megapp, r.torch), ".4f"),
            ]
        )
    return _table(header, body)


def zero_table(rows: list[Row]) -> str:
    header = ["schedule", "m", "v", "actions/rank", "megapp ms/iter", "megapp ms/action"]
    header += ["in F/B ms", "negotiated ms/action", "torch ms/action", "megapp/torch"]
    header += ["paired", "sim ms/action"]
    body = []
    for r in rows:
        c, n = r.config, r.actions_per_rank
        got, neg, ref = _med(r.megapp), _med(r.megapp_negotiated), _med(r.torch)
        body.append(
            [
                c.schedule,
                str(c.m),
                str(c.v),
                str(n),
                f"{got * 1e3:.2f}",
                f"{got * 1e3 / n:.3f}",
                f"{(r.forward_s + r.backward_s) / 2 * 1e3:.3f}",
                _fmt(neg * 1e3 / n, ".3f"),
                _fmt(ref * 1e3 / n, ".3f") if not r.torch_error else "error",
                _fmt(got / ref, ".3f"),
                _fmt(_paired(r.megapp, r.torch), ".3f"),
                f"{r.simulated * 1e3 / n:.3f}",
            ]
        )
    return _table(header, body)


def command_line() -> str:
    script = shlex.join(sys.argv)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return f"torchrun --nproc-per-node {os.environ['WORLD_SIZE']} {script}"
    return f"python {script}"


def machine() -> str:
    return (
        f"{platform.platform()}, {platform.machine()}, os.cpu_count()={os.cpu_count()}, "
        f"python {platform.python_version()}, torch {torch.__version__}, gloo"
    )


def report(args, command, latencies, cold, sleep_rows, zero_rows, files, elapsed, load) -> None:
    hot, idle = latencies
    print(f"$ {command}")
    print(f"machine: {machine()}")
    print(
        f"p={dist.get_world_size()}, activation {args.micro_batch_size}x{args.hidden} fp32 per "
        f"microbatch; one-way p2p latency {hot * 1e3:.3f} ms back to back, {idle * 1e3:.3f} ms "
        "to an idle peer (the simulator's p2p_latency)"
    )
    print(
        f"one tiny torch op: {cold[0] * 1e6:.1f} us back to back, {cold[1] * 1e6:.1f} us after "
        "a 50 ms sleep (the cost of running code that went cold during an action's sleep)"
    )
    if sleep_rows:
        print(
            f"\nSleep mode: tf={args.forward_ms:g} ms, tb={args.backward_ms:g} ms per stage, "
            f"tf/v and tb/v per chunk; median of {args.iters} rounds after {args.warmup} "
            "warmup; each round runs every implementation once, in a rotating order.\n"
            "formula = (m + (p-1)/v)(tf + tb); sim = simulator with tf/v, tb/v; "
            "F/B = measured mean action times; sim* = simulator with those; negotiated = megapp "
            "with tensor_shapes=None; paired = median over rounds of megapp/torch in the round"
        )
        print(sleep_table(sleep_rows))
    if zero_rows:
        print(
            f"\nZero-compute mode: tf = tb = 0; median of {args.zero_iters} rounds after "
            f"{args.zero_warmup} warmup; ms/action = iteration / (2 m v); in F/B = mean time "
            "inside one forward or backward action; sim = simulator, p2p latency only"
        )
        print(zero_table(zero_rows))
    errors = {r.config.label: r.torch_error for r in sleep_rows + zero_rows if r.torch_error}
    for label, error in errors.items():
        print(f"torch.distributed.pipelining refused {label}: {error}")
    for f in files:
        print(f"wrote {f}")
    print(
        f"total {elapsed:.0f} s; 1-minute load average {load[0]:.2f} at start, {load[1]:.2f} at end"
    )
    if args.json:
        data = {
            "command": command,
            "machine": machine(),
            "load_average": load,
            "p2p_latency_s": {"back_to_back": hot, "idle_peer": idle},
            "tiny_op_s": {"back_to_back": cold[0], "after_50ms_sleep": cold[1]},
            "sleep": [asdict(r) for r in sleep_rows],
            "zero": [asdict(r) for r in zero_rows],
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {args.json}")
    sys.stdout.flush()


# ----- processes ------------------------------------------------------------------------------
def worker(rank: int, world_size: int, port: int | None, args, command: str) -> None:
    torch.set_num_threads(1)  # p ranks share few cores
    if port is None:  # torchrun set the environment
        dist.init_process_group("gloo")
    else:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    p2p_latency(args, pause=0.0, rounds=50)  # connect and warm up
    hot = p2p_latency(args, pause=0.0, rounds=200)
    idle = p2p_latency(args, pause=0.02, rounds=50)
    cold = (cold_op_cost(0.0), cold_op_cost(0.05))
    tf, tb = args.forward_ms / 1e3, args.backward_ms / 1e3
    first_m = args.microbatches[0]
    sleep_rows, zero_rows = [], []
    for cfg in [] if args.no_sleep else configs(args, tf, tb):
        negotiated = args.negotiated == "all" or (args.negotiated == "first" and cfg.m == first_m)
        sleep_rows.append(bench(cfg, args, idle, args.iters, args.warmup, negotiated))
        if rank == 0:
            row = sleep_rows[-1]
            print(
                f"  sleep {cfg.label}: megapp {_med(row.megapp):.3f} s, "
                f"torch {_med(row.torch):.3f} s",
                file=sys.stderr,
                flush=True,
            )
    for cfg in [] if args.no_zero else configs(args, 0.0, 0.0):
        zero_rows.append(bench(cfg, args, idle, args.zero_iters, args.zero_warmup, True))
    files = draw_timeline(args, idle) if args.timeline else []
    dist.barrier()
    if rank == 0:
        elapsed = time.perf_counter() - started
        load = (load_before, os.getloadavg()[0])
        report(args, command, (hot, idle), cold, sleep_rows, zero_rows, files, elapsed, load)
    dist.destroy_process_group()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=4, help="pipeline ranks p (without torchrun)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16], help="values of m")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    parser.add_argument("--chunks", type=int, default=2, help="v for interleaved-1f1b")
    parser.add_argument("--forward-ms", type=float, default=100.0, help="tf per pipeline stage")
    parser.add_argument("--backward-ms", type=float, default=200.0, help="tb per pipeline stage")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="activation rows")
    parser.add_argument("--hidden", type=int, default=256, help="activation columns")
    parser.add_argument("--iters", type=int, default=3, help="timed sleep-mode iterations")
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed iterations first (>= 1); megapp then runs one more, untimed, with\n"
        "record=True, for the measured per-action times",
    )
    parser.add_argument("--zero-iters", type=int, default=20)
    parser.add_argument("--zero-warmup", type=int, default=3)
    parser.add_argument(
        "--negotiated",
        choices=["none", "first", "all"],
        default="first",
        help="also time megapp with negotiated shapes in sleep mode: never, for the first\n"
        "--microbatches value, or always (zero-compute mode always does)",
    )
    parser.add_argument("--no-sleep", action="store_true", help="skip sleep mode")
    parser.add_argument("--no-zero", action="store_true", help="skip zero-compute mode")
    parser.add_argument("--no-torch", action="store_true", help="skip torch.distributed.pipelining")
    parser.add_argument("--timeline", metavar="DIR", help="write a timeline PNG and Chrome trace")
    parser.add_argument("--timeline-schedule", default="interleaved-1f1b", choices=SCHEDULES)
    parser.add_argument("--timeline-microbatches", type=int, help="default: first --microbatches")
    parser.add_argument("--json", metavar="PATH", help="also write the raw results as JSON")
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.zero_warmup < 1:
        parser.error("--warmup and --zero-warmup must be at least 1")
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    args = parse_args()
    command = command_line()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, args, command)
    else:
        mp.spawn(worker, (args.nproc, _free_port(), args, command), nprocs=args.nproc)


if __name__ == "__main__":
    main()
