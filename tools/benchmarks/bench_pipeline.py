"""Benchmark the pipeline engine against its simulator, the bubble formula and torch.

    python tools/benchmarks/bench_pipeline.py                       # spawns 4 gloo ranks itself
    torchrun --nproc-per-node 4 tools/benchmarks/bench_pipeline.py  # the same under torchrun
    python tools/benchmarks/bench_pipeline.py --timeline docs/img   # also timelines, traces
    python tools/benchmarks/bench_pipeline.py --strict-p2p          # megapp under NCCL's rules

The model chunks sleep ``tf / v`` in their forward, ``(tb - tw) / v`` in their input
gradient and ``tw / v`` in their weight gradient (``pipeline_sleep.py``), so the
schedule, the point-to-point messages and the autograd bookkeeping are real while compute
is a fixed, contention-free sleep. ``--first-stage-scale`` / ``--last-stage-scale``
stretch the first and last virtual stage (an embedding; an output layer and the loss).

Sleep mode compares the measured iteration with the simulator and with the
ideal ``(m + (p - 1) / v)(tf + tb)``; zero-compute mode (tf = tb = 0) gives
the cost per action. Each schedule with a peer in ``torch.distributed.pipelining``
(ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleLoopedBFS,
ScheduleInterleavedZeroBubble for zb-h1, ScheduleZBVZeroBubble, ScheduleDualPipeV)
runs the same chunks, activations and microbatches there too. ``auto`` is the
schedule search, fed with the per-action times of one recorded zb-h1 iteration.
``pipedream`` and ``pipedream-2bw`` run ``--iterations`` iterations per call with no
flush between them (their steps do nothing here); every time is per iteration.
An iteration is timed the same way for both: barrier, one forward/backward call on
every rank, the slowest rank's time. One extra untimed megapp iteration with
``record=True`` gives the measured per-action times, which the simulator replays
(sends finishing in the background, as on gloo) for the prediction ``sim*``."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist
from bench_pipeline_report import Row, report
from pipeline_sleep import (
    TORCH_SCHEDULES,
    Config,
    cold_op_cost,
    iteration,
    megapp_runner,
    p2p_latency,
    torch_runner,
)

from megapp.benchmarks.common import (
    Ranks,
    command_line,
    interleaved,
    median,
)
from megapp.pipeline_parallel import CostModel, Schedule, build_schedule, simulate
from megapp.pipeline_parallel.catalog import ASYNC_SCHEDULES, SCHEDULE_KINDS
from megapp.pipeline_parallel.catalog import SCHEDULES as BUILT_IN
from megapp.pipeline_parallel.schedule_search import costs_from_events, search_schedule
from megapp.pipeline_parallel.timeline import plot_timelines, write_chrome_trace

SCHEDULES = (*BUILT_IN, *ASYNC_SCHEDULES, "auto")
ONE_CHUNK = ("gpipe", "1f1b", "zb-h2", *ASYNC_SCHEDULES)  # the rest take --chunks (the V: two)


# ----- on every rank --------------------------------------------------------------------------
def probe(args) -> tuple[tuple[float, float], tuple[float, float]]:
    """((back-to-back, idle-peer) p2p latency, (tiny op back to back, after a 50 ms sleep))."""
    size, hidden = args.micro_batch_size, args.hidden
    p2p_latency(size, hidden, pause=0.0, rounds=50)  # connect and warm up
    hot = p2p_latency(size, hidden, pause=0.0, rounds=200)
    idle = p2p_latency(size, hidden, pause=0.02, rounds=50)
    return (hot, idle), (cold_op_cost(0.0), cold_op_cost(0.05))


def _gathered_events(result) -> list:
    """Every rank's compute events of a recorded iteration, on every rank."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [e for e in result.events if e.kind == "compute"])
    return [e for rank_events in gathered for e in rank_events]


def _mean_times(events) -> tuple[float, float]:
    """Mean forward and backward (``B``, or ``I`` + ``W``) durations over every rank."""
    total: dict[str, list[float]] = {"F": [], "B": [], "I": [], "W": [], "U": []}
    for e in events:
        total[e.name[0]].append(e.end - e.start)
    mean = {k: sum(v) / len(v) if v else 0.0 for k, v in total.items()}
    whole = mean["B"] if total["B"] else mean["I"] + mean["W"]
    return mean["F"], whole


def nominal_costs(cfg: Config, p: int, latency: float) -> CostModel:
    """The chunks' sleeps as a cost model (the first and last stage stretched)."""
    v = cfg.v

    def table(seconds: float) -> list[list[float]]:
        rows = []
        for rank in range(p):
            row = []
            for c in range(v):
                stage = (rank if c == 0 else 2 * p - 1 - rank) if cfg.v_shape else c * p + rank
                scale = (cfg.first_scale if stage == 0 else 1.0) * (
                    cfg.last_scale if stage == p * v - 1 else 1.0
                )
                row.append(seconds / v * scale)
            rows.append(row)
        return rows

    return CostModel(
        forward=table(cfg.tf),
        backward=table(cfg.tb),
        input_grad=table(cfg.tb - cfg.tw),
        weight_grad=table(cfg.tw),
        p2p_latency=latency,
    )


def searched_schedule(cfg: Config, args, latency: float) -> tuple[Schedule, str]:
    """``auto``: the search's pick for the costs of one recorded zb-h1 iteration, and the
    candidate's label."""
    probe_cfg = Config("zb-h1", cfg.m, cfg.v, cfg.tf, cfg.tb, cfg.tw, cfg.first_scale,
                       cfg.last_scale)  # fmt: skip
    run = megapp_runner(probe_cfg, args.micro_batch_size, args.hidden)
    run()
    recorded = build_schedule("zb-h1", dist.get_world_size(), cfg.m, cfg.v)
    events = _gathered_events(run(record=True))
    costs = costs_from_events(recorded, events, p2p_latency=latency)
    limit = args.auto_memory_limit
    result = search_schedule(dist.get_world_size(), cfg.m, costs, num_chunks=cfg.v,
                             memory_limit=limit)  # fmt: skip
    return result.schedule, result.candidates[0][0]


def schedule_for(cfg: Config, args, latency: float) -> tuple[Schedule, str]:
    if cfg.schedule == "auto":
        return searched_schedule(cfg, args, latency)
    runs = {"iterations": cfg.iterations} if cfg.asynchronous else {}
    return build_schedule(cfg.schedule, dist.get_world_size(), cfg.m, cfg.v, **runs), ""


def bench(cfg: Config, args, latency: float, iters: int, warmup: int, negotiated: bool) -> Row:
    """megapp (declared and, with ``negotiated``, negotiated shapes) and torch, timed in
    alternating rounds; then one untimed megapp iteration with ``record=True``. Times are
    per iteration: an asynchronous schedule's call runs ``cfg.iterations`` of them."""
    p, size, hidden = dist.get_world_size(), args.micro_batch_size, args.hidden
    row = Row(cfg, 2 * cfg.m * cfg.v)
    k = cfg.iterations if cfg.asynchronous else 1
    row.formula = (k * cfg.m + (p - 1) / cfg.v) * (cfg.tf + cfg.tb) / k
    schedule, row.searched = schedule_for(cfg, args, latency)
    row.actions_per_rank = len(schedule.actions[0])
    nominal = simulate(schedule, nominal_costs(cfg, p, latency))
    row.simulated, row.bubble = nominal.makespan / k, nominal.bubble_fraction
    row.peak = max(nominal.peak_in_flight)
    strict = args.strict_p2p
    runs = {"megapp": megapp_runner(cfg, size, hidden, schedule=schedule, strict_p2p=strict)}
    if negotiated:
        runs["negotiated"] = megapp_runner(
            cfg, size, hidden, declared=False, schedule=schedule, strict_p2p=strict
        )
    if not args.no_torch and cfg.schedule in TORCH_SCHEDULES:
        try:
            runs["torch"] = torch_runner(cfg, size, hidden)
        except Exception as err:  # a configuration torch refuses (on every rank): report it
            row.torch_error = f"{type(err).__name__}: {err}".splitlines()[0][:120]
    calls = {name: (lambda run=run: iteration(run)[0] / k) for name, run in runs.items()}
    times = interleaved(calls, iters, warmup=warmup)
    row.megapp = times["megapp"]
    row.megapp_negotiated = times.get("negotiated", [])
    row.torch = times.get("torch", [])
    _, recorded = iteration(runs["megapp"], record=True)
    events = _gathered_events(recorded)
    row.forward_s, row.backward_s = _mean_times(events)
    measured = costs_from_events(schedule, events, p2p_latency=latency)
    row.simulated_measured = simulate(schedule, measured).makespan / k
    return row


def record_timeline(cfg: Config, args, latency: float) -> tuple[list, list]:
    """One recorded megapp iteration (after a warmup): every rank's events, on every rank,
    and the simulator's replay of them with their measured per-action times."""
    schedule, _ = schedule_for(cfg, args, latency)
    run = megapp_runner(cfg, args.micro_batch_size, args.hidden, schedule=schedule)
    run()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, run(record=True).events)
    events = [e for rank_events in gathered for e in rank_events]
    costs = costs_from_events(schedule, events, p2p_latency=latency)
    return simulate(schedule, costs).events, events


# ----- on the reporting process ---------------------------------------------------------------
def configs(args, tf: float, tb: float, tw: float) -> list[Config]:
    out = []
    for m in args.microbatches:
        for name in args.schedules:
            kind = SCHEDULE_KINDS.get(name)
            v = 1 if name in ONE_CHUNK else (kind.fixed_chunks if kind else None) or args.chunks
            scales = (args.first_stage_scale, args.last_stage_scale)
            out.append(Config(name, m, v, tf, tb, tw, *scales, iterations=args.iterations))
    return out


def draw_timeline(args, p: int, cfg: Config, predicted: list, measured: list) -> list[str]:
    """Predicted (measured action times replayed) and measured timelines: PNG and trace."""
    out = Path(args.timeline)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{cfg.schedule}_p{p}_m{cfg.m}_v{cfg.v}"
    png, trace = out / f"timeline_{stem}.png", out / f"trace_{stem}.json"
    plot_timelines(
        [
            (f"predicted (simulator, measured action times): {cfg.label}", predicted),
            (f"measured (megapp, gloo): {cfg.label}", measured),
        ],
        png,
    )
    write_chrome_trace(measured, trace)
    return [str(png), str(trace)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=4, help="pipeline ranks p (without torchrun)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16], help="values of m")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    parser.add_argument("--chunks", type=int, default=2, help="v for interleaved-1f1b")
    parser.add_argument(
        "--iterations",
        type=int,
        default=4,
        help="pipedream, pipedream-2bw: iterations per call, run without a flush (times\n"
        "are per iteration; every other schedule flushes after each)",
    )
    parser.add_argument("--forward-ms", type=float, default=100.0, help="tf per pipeline stage")
    parser.add_argument("--backward-ms", type=float, default=200.0, help="tb per pipeline stage")
    parser.add_argument(
        "--weight-ms", type=float, help="tw: the weight-gradient part of tb (default tb / 2)"
    )
    parser.add_argument(
        "--first-stage-scale", type=float, default=1.0, help="the first virtual stage's times x"
    )
    parser.add_argument(
        "--last-stage-scale", type=float, default=1.0, help="the last virtual stage's times x"
    )
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
    parser.add_argument(
        "--strict-p2p",
        action="store_true",
        help="megapp's messages under NCCL's point-to-point rules (strict gloo channels)",
    )
    parser.add_argument("--no-sleep", action="store_true", help="skip sleep mode")
    parser.add_argument("--no-zero", action="store_true", help="skip zero-compute mode")
    parser.add_argument("--no-torch", action="store_true", help="skip torch.distributed.pipelining")
    parser.add_argument(
        "--auto-memory-limit",
        type=float,
        help="auto: microbatch-chunks of activations a rank may hold (default: 1F1B's peak)",
    )
    parser.add_argument("--timeline", metavar="DIR", help="write timeline PNGs and Chrome traces")
    parser.add_argument(
        "--timeline-schedules", nargs="+", default=["interleaved-1f1b"], choices=SCHEDULES
    )
    parser.add_argument("--timeline-microbatches", type=int, help="default: first --microbatches")
    parser.add_argument("--json", metavar="PATH", help="also write the raw results as JSON")
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.zero_warmup < 1:
        parser.error("--warmup and --zero-warmup must be at least 1")
    if args.weight_ms is None:
        args.weight_ms = args.backward_ms / 2
    if not 0 <= args.weight_ms <= args.backward_ms:
        parser.error("--weight-ms must lie between 0 and --backward-ms")
    return args


def main() -> None:
    args = parse_args()
    command = command_line()
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    tf, tb, tw = args.forward_ms / 1e3, args.backward_ms / 1e3, args.weight_ms / 1e3
    first_m = args.microbatches[0]
    sleep_rows, zero_rows, files = [], [], []
    with Ranks(args.nproc, threads=1) as ranks:  # p ranks share few cores
        p = ranks.world_size
        latencies, cold = ranks.run(probe, args)
        idle = latencies[1]
        for cfg in [] if args.no_sleep else configs(args, tf, tb, tw):
            negotiated = args.negotiated == "all" or (args.negotiated, cfg.m) == ("first", first_m)
            row = ranks.run(bench, cfg, args, idle, args.iters, args.warmup, negotiated)
            sleep_rows.append(row)
            if ranks.reporting:
                print(f"  sleep {cfg.label}: megapp {median(row.megapp):.3f} s, "
                      f"torch {median(row.torch):.3f} s", file=sys.stderr, flush=True)  # fmt: skip
        for cfg in [] if args.no_zero else configs(args, 0.0, 0.0, 0.0):
            zero_rows.append(
                ranks.run(bench, cfg, args, idle, args.zero_iters, args.zero_warmup, True)
            )
        if args.timeline:
            m = args.timeline_microbatches or first_m
            for cfg in configs(argparse.Namespace(**{**vars(args), "microbatches": [m],
                                                    "schedules": args.timeline_schedules}),
                               tf, tb, tw):  # fmt: skip
                predicted, measured = ranks.run(record_timeline, cfg, args, idle)
                if ranks.reporting:
                    files += draw_timeline(args, p, cfg, predicted, measured)
        if ranks.reporting:
            elapsed, load = time.perf_counter() - started, (load_before, os.getloadavg()[0])
            report(args, p, command, latencies, cold, sleep_rows, zero_rows, files, elapsed, load)


if __name__ == "__main__":
    main()
