"""Benchmark megapp's fused ops against their PyTorch reference and the plain eager expression.

    python tools/benchmarks/bench_kernels.py           # CPU (and CUDA too when a GPU is usable)
    python tools/benchmarks/bench_kernels.py --ops bias_gelu rope --dtypes bf16 --repeats 31
    python tools/benchmarks/bench_kernels.py --device cuda --json /tmp/kernels.json

For each op (bias_gelu, bias_swiglu, bias_dropout_add in training with p = 0.1, causal
scaled_masked_softmax, layer_norm, rms_norm, rope, cross_entropy), dtype (fp32, bf16) and pass
(the training forward alone, and forward + backward) it times three implementations on the same
inputs:

* ``megapp``: the public function (``megapp.fusions.bias_gelu`` ...), i.e. its autograd Function
  calling the compiled kernel of the tensor's device (``torch.ops.megapp.*``);
* ``reference``: the same public function with ``MEGAPP_FUSED=0``, which makes the autograd
  Function run megapp's pure-PyTorch reference forward and backward;
* ``eager``: the plain PyTorch expression a user would write instead (the ``eager`` field of
  each case in ``cases()``: ``F.gelu(x + b, approximate="tanh")``, ``F.layer_norm``,
  ``F.cross_entropy`` ...), with autograd.

With ``--compile`` (on by default on CUDA only) it adds ``compile``: ``torch.compile`` of that
same eager expression, compiled before the timed rounds.

"forward" is the training forward: the inputs require grad and autograd records the graph (the
megapp Functions save what their backward needs). "fwd+bwd" is that forward followed by
``torch.autograd.grad`` with a fixed random output gradient. Every implementation runs once per
round, in an order that rotates from round to round so that background load (other jobs on the
machine) hits all of them alike; each cell is the median over the rounds, and ``IQR%`` is the
interquartile range of megapp's rounds over their median, a measure of the noise. Speedups are
``median(other) / median(megapp)``: above 1 means megapp is faster. The number of rounds adapts
to ``--budget-s`` per (op, dtype, pass) between ``--min-repeats`` and ``--repeats`` (see
``measure``); the default CPU run takes about two minutes on 2 cores. Before timing, each op's
output and input gradients are compared with the reference (max |difference|, same dropout
seed), so the table cannot compare an op with something it does not compute.

Effective bandwidth is the op's minimal memory traffic (every input read once, every output
written once; the counts are printed per op) divided by the median time. On CUDA it is also
given as a fraction of the GPU's HBM peak (``megapp.training.flops.hbm_peak_tbps`` of
``torch.cuda.get_device_name()``; ``--peak-tbps`` overrides), against a target of 85%.

CPU timing is ``time.perf_counter`` around each call on ``--threads`` torch threads (default: the
cores this process may run on); the header gives the machine, the sources measured (commit,
uncommitted kernel changes), the load and Linux's CPU pressure before and after (other jobs on
the machine), and a copy roof (``y.copy_(x)``, GB/s) to read the CPU bandwidths against. Each
CPU cell records the share of its time some task waited for a CPU ("stall %", Linux PSI: other
jobs); a cell above ``--max-stall`` is measured again (``--retries`` times at most, within
``--retry-budget-s`` for the run) and the least disturbed attempt is kept.

CUDA timing is a pair of ``torch.cuda.Event`` around each call, the L2 flushed before it and the
host's launch overhead kept out (``kernel_timing.py`` beside this file); the GPU shapes are
large (0.5-2 GiB per fp32 tensor) so the kernels, not launch latency or the L2, set the time.
Without a usable GPU and megapp._C_cuda the CUDA part is skipped with a line saying why. The
ops, their eager expressions and byte counts are in ``kernel_cases.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from kernel_cases import DTYPES, SHAPES, cases, check_against_reference, randn
from kernel_timing import (
    CpuTimer,
    CudaTimer,
    Row,
    copy_roof_gbps,
    implementations,
    measure_least_disturbed,
)

from megapp import fusions
from megapp.benchmarks.common import (
    available_cores,
    command_line,
    cpu_pressure,
    fmt,
    iqr_pct,
    load_average,
    machine,
    markdown_table,
    source_state,
    write_json,
)
from megapp.fusions import extension
from megapp.training.flops import hbm_peak_tbps

PASSES = ("fwd", "fwd+bwd")
HBM_TARGET = 0.85
SOURCES = ("csrc", "megapp/fusions", "setup.py")  # what the kernels are built from


def bench_device(
    device_kind: str, args: argparse.Namespace, peak_tbps: float | None
) -> tuple[list[Row], dict]:
    sh = SHAPES[device_kind]
    timer = CpuTimer() if device_kind == "cpu" else CudaTimer()
    device = timer.device
    use_compile = args.compile == "on" or (args.compile == "auto" and device_kind == "cuda")
    rows: list[Row] = []
    notes: dict[str, dict] = {}
    retry_spent = 0.0
    for case in cases(sh):
        if args.ops and case.op not in args.ops:
            continue
        notes[case.op] = {"shape": case.shape, "traffic": case.traffic, "checks": {}}
        compiled = None
        if use_compile:
            compiled = torch.compile(case.eager, dynamic=False)
        for dname in args.dtypes:
            dtype = DTYPES[dname]
            torch.manual_seed(0)
            inputs = case.make(sh, device, dtype)
            for name in case.grad_inputs:
                inputs[name].requires_grad_(True)
            with torch.no_grad():
                out_shape = case.eager(inputs).shape
            grad_out = randn(out_shape, device, dtype)
            fwd_bytes, bwd_bytes = case.nbytes(inputs)
            tier = extension.select_tier(case.op, inputs[case.tier_input])
            notes[case.op]["checks"][dname] = check_against_reference(case, inputs, grad_out)
            for pass_ in args.passes:
                impls = implementations(case, compiled, inputs, grad_out, pass_)
                samples, stall, spent = measure_least_disturbed(
                    impls, timer, args, retry_spent if device_kind == "cpu" else None
                )
                retry_spent += spent
                nbytes = fwd_bytes if pass_ == "fwd" else fwd_bytes + bwd_bytes
                row = Row(case.op, dname, pass_, tier, nbytes, samples, stall)
                rows.append(row)
                print_progress(row)
            del inputs, grad_out
            if device_kind == "cuda":
                torch.cuda.empty_cache()
    return rows, notes


# Output -------------------------------------------------------------------------------------------


def ratio(row: Row, name: str) -> float | None:
    mine, other = row.median("megapp"), row.median(name)
    return other / mine if mine and other else None


def print_progress(row: Row) -> None:
    parts = [f"{name} {fmt(row.median(name) * 1e3, '.3f')} ms" for name in row.samples]
    print(f"  {row.op:22s} {row.dtype:4s} {row.pass_:8s} " + ", ".join(parts), flush=True)


def hbm_pct(row: Row, peak_tbps: float | None) -> float | None:
    """megapp's GB/s as a share (%) of the HBM peak, or None without a peak."""
    gbps = row.gbps("megapp")
    return 100.0 * gbps / (peak_tbps * 1e3) if peak_tbps and gbps else None


def table(rows: list[Row], device_kind: str, peak_tbps: float | None) -> str:
    head = ["op", "dtype", "pass", "megapp ms", "GB/s"]
    with_compile = any("compile" in r.samples for r in rows)
    ms = ".3f" if device_kind == "cuda" else ".2f"  # GPU calls take well under a millisecond
    if device_kind == "cuda":
        head += ["% peak"]
    if with_compile:
        head += ["compile ms", "× compile"]
    head += ["reference ms", "× ref", "eager ms", "× eager", "IQR %", "rounds"]
    if device_kind == "cpu":
        head.append("stall %")
    body = []
    for r in rows:
        cells = [r.op, r.dtype, r.pass_, fmt(r.median("megapp") * 1e3, ms)]
        cells.append(fmt(r.gbps("megapp"), ".1f"))
        if device_kind == "cuda":
            pct = hbm_pct(r, peak_tbps)
            flag = "" if pct is None or pct >= 100 * HBM_TARGET else " (<85)"
            cells.append(fmt(pct, ".0f") + flag)
        if with_compile:
            compile_ms = r.median("compile")
            cells += [fmt(compile_ms and compile_ms * 1e3, ms), fmt(ratio(r, "compile"), ".2f")]
        cells += [
            fmt(r.median("reference") * 1e3, ms),
            fmt(ratio(r, "reference"), ".2f"),
            fmt(r.median("eager") * 1e3, ms),
            fmt(ratio(r, "eager"), ".2f"),
            fmt(iqr_pct(r.samples["megapp"]), ".0f"),
            str(len(r.samples["megapp"])),
        ]
        if device_kind == "cpu":
            cells.append(fmt(r.stall, ".0f"))
        body.append(cells)
    return markdown_table(head, body)


def load_line() -> str:
    return f"load average {load_average().replace('/', ' ')}; {cpu_pressure()}"


def header(args: argparse.Namespace) -> None:
    """The command, machine, compiled tiers, sources and load before anything runs."""
    print(f"$ {command_line()}")
    print(
        f"machine: {machine()}; CPU capability {torch.backends.cpu.get_cpu_capability()}; "
        f"torch.set_num_threads({args.threads}) -> {torch.get_num_threads()} threads"
    )
    tiers = extension.built_tiers()
    isa = f", CPU kernels' vector ISA {extension.cpu_kernels_isa()}" if "cpu" in tiers else ""
    print(f"megapp compiled tiers: {sorted(tiers) or 'none'}{isa}")
    # The import path says which tree is measured (an installed megapp may live elsewhere).
    print(f"megapp imported from: {os.path.dirname(fusions.__file__)}")
    print(f"sources: {source_state(SOURCES)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", nargs="+", choices=[c.op for c in cases(SHAPES["cpu"])])
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES))
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: CPU, and CUDA as well when a GPU and megapp's CUDA kernels are usable",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=available_cores(),
        help="torch.set_num_threads (default: the cores this process may run on)",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds")
    parser.add_argument("--repeats", type=int, default=25, help="at most this many timed rounds")
    parser.add_argument("--min-repeats", type=int, default=7, help="at least this many")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=3.0,
        help="rounds per (op, dtype, pass) are cut to about this many seconds (the default CPU "
        "run takes about 1.5-2 minutes on 2 cores)",
    )
    parser.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        default="auto",
        help="also time torch.compile of the eager expression (auto: on CUDA only; on CPU it "
        "adds tens of seconds of compilation per op and dtype)",
    )
    parser.add_argument("--peak-tbps", type=float, help="CUDA: HBM peak, TB/s (default: by name)")
    parser.add_argument(
        "--max-stall",
        type=float,
        default=10.0,
        help="CPU: measure a cell again when some task waited for a CPU more than this %% of its "
        "time (Linux PSI: other jobs on the machine); the least disturbed attempt is kept",
    )
    parser.add_argument("--retries", type=int, default=2, help="CPU: at most this many per cell")
    parser.add_argument(
        "--retry-budget-s",
        type=float,
        default=60.0,
        help="CPU: seconds the whole run may spend on such repeats",
    )
    parser.add_argument("--json", help="also write the samples and settings here")
    args = parser.parse_args(argv)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cuda_ok = torch.cuda.is_available() and extension.cuda_ops_available()
    kinds = ["cpu"] if args.device in ("auto", "cpu") else []
    if args.device == "cuda" or (args.device == "auto" and cuda_ok):
        kinds.append("cuda")
    header(args)
    if args.device == "auto" and not torch.cuda.is_available():
        print("CUDA: not available, skipping the GPU measurements")
    elif args.device != "cpu" and torch.cuda.is_available() and not cuda_ok:
        print(
            "CUDA: a GPU is present but megapp._C_cuda is not built/loaded"
            + ("; skipping the GPU measurements" if args.device == "auto" else "")
        )
    peak = None
    if "cuda" in kinds:
        if not torch.cuda.is_available():
            print("error: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
            return 2
        gpu = torch.cuda.get_device_name()
        peak = args.peak_tbps or hbm_peak_tbps(gpu)
        print(
            f"GPU: {gpu}; CUDA {torch.version.cuda}; HBM peak "
            f"{fmt(peak, '.2f')} TB/s (target {HBM_TARGET:.0%} of it)"
        )
    print(f"before: {load_line()}")
    if "cpu" in kinds:
        print(f"CPU copy roof: y.copy_(x), 16 MiB fp32, {copy_roof_gbps():.1f} GB/s (read + write)")

    report: dict = {"command": command_line(), "machine": machine(), "devices": {}}
    started = time.perf_counter()
    for kind in kinds:
        print(f"\n== {kind}: {SHAPES[kind]} ==")
        rows, notes = bench_device(kind, args, peak)
        print(f"\n### {kind}\n")
        for op, note in notes.items():
            checks = "; ".join(f"{d}: {c}" for d, c in note["checks"].items())
            print(f"- {op}: {note['shape']}. Bytes: {note['traffic']}.")
            print(f"  max|megapp - reference| (and - eager): {checks}")
        print()
        print(table(rows, kind, peak))
        device_peak = peak if kind == "cuda" else None
        report["devices"][kind] = {
            "shapes": SHAPES[kind],
            "device": torch.cuda.get_device_name() if kind == "cuda" else "cpu",
            "hbm_peak_tbps": device_peak,
            "notes": notes,
            "rows": [
                {
                    "op": r.op,
                    "dtype": r.dtype,
                    "pass": r.pass_,
                    "tier": r.tier,
                    "bytes": r.nbytes,
                    "gbps": r.gbps("megapp"),
                    "hbm_pct": hbm_pct(r, device_peak),
                    "cpu_stall_pct": r.stall,
                    "samples_s": r.samples,
                }
                for r in rows
            ],
        }
        tiers = {r.tier for r in rows}
        if tiers != {kind}:
            print(f"\nnote: megapp ran the {sorted(tiers)} tier(s) here, not only {kind!r}")
    print(f"\nelapsed {time.perf_counter() - started:.0f} s; after: {load_line()}")
    print(
        "× = median(other) / median(megapp): > 1 means megapp is faster. GB/s = minimal bytes "
        "(fwd, or fwd + bwd) / megapp's median time. IQR % = megapp's interquartile range / median."
        " stall % = share of the cell's time some task waited for a CPU (Linux PSI): other jobs;"
        " high values inflate multi-kernel eager/reference times most (each op's threads wait)."
    )
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
