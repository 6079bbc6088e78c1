"""A training step measured and predicted: does the time model hold on this machine?

    python -m megapp.benchmarks.predicted_step --hardware h200_measured.json \\
        --out step.json -- --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \\
        --seq-length 2048 --micro-batch-size 4 --global-batch-size 16 --bf16 --train-iters 12

runs ``pretrain_gpt.py`` with the flags after ``--`` on ``--nproc`` ranks (torchrun), reads
its metrics records, and takes the median of its plain iterations after ``--warmup`` (a
profiled iteration, ``--profile-iteration``, and the one after it left out; the profile's
record is kept in the report). The planner predicts the same config
(``megapp.planning.explain`` on the profile ``--hardware``: a built-in name or a JSON file,
as ``python -m megapp.planning.calibrate`` writes), and the report puts the two side by side
with the prediction's lines and one layer's priced operations. Flags it adds unless given:
``--use-default-corpus``, ``--lr 1e-4``, ``--log-interval 1``, ``--eval-iters 0``. The exit
status is 1 when the job fails.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

from megapp.ablation.predict import vocab_size
from megapp.planning.explain import explain, explanation_rows
from megapp.planning.hardware import Hardware
from megapp.planning.layer_costs import moe_layer_parts
from megapp.planning.model_state import moe_layer_count
from megapp.planning.operations import layer_parts, logits_seconds
from megapp.planning.profiles import load_profile, time_model
from megapp.training.arguments import config_from_flags
from megapp.training.config import PretrainConfig
from megapp.training.iteration_profile import plain_iteration_seconds
from megapp.training.launch import run_pretrain
from megapp.training.metrics import read_records

DEFAULTS = {
    "--lr": ["--lr", "1e-4"],
    "--log-interval": ["--log-interval", "1"],
    "--eval-iters": ["--eval-iters", "0"],
}


def run_flags(flags: list[str], metrics: Path) -> list[str]:
    """``flags`` with the defaults it lacks and the metrics path."""
    out = list(flags)
    if not any(f.startswith(("--data-path", "--use-default-corpus")) for f in out):
        out.append("--use-default-corpus")
    for flag, pair in DEFAULTS.items():
        if flag not in out:
            out += pair
    return [*out, "--metrics-path", str(metrics)]


def measured_seconds(records: list[dict], warmup: int, profiled: int | None) -> list[float]:
    """Seconds of the plain iterations after the first ``warmup`` (the profiled iteration
    and the one after it left out)."""
    after = [r for r in records if r.get("kind") == "train" and r["iteration"] > warmup]
    times = plain_iteration_seconds(after, profiled)
    if not times:
        raise ValueError(f"no plain iteration after the {warmup} warm-up ones: more --train-iters")
    return times


def prediction(config: PretrainConfig, hardware_name: str) -> dict:
    """The planner's step for a checked pretrain ``config``: its seconds, its explanation's
    lines and, on a profile with operation rates and one pipeline stage, its compute by
    kind of kernel over the step (``kinds``: matmul, attention, memory, grad_accumulation,
    optimizer) and one layer's (``layer``: a mixture-of-experts layer's where the model
    has them)."""
    vocab = vocab_size(config)
    hardware = load_profile(hardware_name)
    explanation = explain(config, vocab, time_model(hardware))
    rows = dict(explanation_rows(explanation))
    out = {
        "predicted_s": float(explanation.step_time.seconds),
        "breakdown": {k: None if math.isnan(v) else v for k, v in rows.items()},
        "layer": {},
        "kinds": {},
    }
    if isinstance(hardware, Hardware) and hardware.ops is not None:
        gpt = config.gpt_config(vocab)
        seq, mbs = config.model.seq_length, config.training.micro_batch_size
        dense = layer_parts(gpt, seq, mbs, hardware.ops)
        moe = moe_layer_count(gpt, gpt.num_layers)
        layers = [(gpt.num_layers - moe, dense)]
        if moe:
            layers.append((moe, moe_layer_parts(gpt, seq, mbs, hardware)))
        out["layer"] = layers[-1][1]
        if config.parallel.pipeline_model_parallel_size == 1:
            kinds = dict.fromkeys(dense, 0.0)
            for count, parts in layers:
                for kind, seconds in parts.items():
                    kinds[kind] += count * config.num_microbatches * sum(seconds)
            output = logits_seconds(gpt, seq * mbs, gpt.padded_vocab_size, hardware.ops)
            kinds["matmul"] += config.num_microbatches * sum(vars(output).values())
            kinds["optimizer"] = rows["step.optimizer"]
            out["kinds"] = kinds
    return out


def check(args: argparse.Namespace) -> dict:
    """Run, measure, predict; the report as a dict."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        flags = run_flags(args.flags, metrics)
        job = run_pretrain(args.nproc, flags, timeout_s=args.timeout_s, log_path=args.log)
        if job.returncode != 0:
            raise RuntimeError(f"pretrain_gpt.py failed (exit {job.returncode}); see {args.log}")
        records = read_records(metrics)
    config = config_from_flags(flags, world_size=args.nproc)
    times = measured_seconds(records, args.warmup, config.logging.profile_iteration)
    seconds = statistics.median(times)
    predicted = prediction(config, args.hardware)
    return {
        "flags": args.flags,
        "nproc": args.nproc,
        "hardware": args.hardware,
        "measured_s": seconds,
        "times_s": times,
        **predicted,
        "ratio": predicted["predicted_s"] / seconds,
        "last_lm_loss": [r for r in records if r.get("kind") == "train"][-1].get("lm_loss"),
        "profile": [r for r in records if r.get("kind") == "profile"],
    }


def replay(path: str, hardware: str) -> list[dict]:
    """Predict again the steps a GPU run measured (``docs/img/h200_steps.json``): per step
    the measured and predicted seconds, and by kind of kernel the device time it measured
    (``megapp.benchmarks.kernel_time``) beside the predicted."""
    recorded = json.loads(Path(path).read_text())
    out = []
    for step in recorded["steps"]:
        flags = run_flags(step["flags"], Path(tempfile.gettempdir()) / "unused.jsonl")
        predicted = prediction(config_from_flags(flags, world_size=step.get("nproc", 1)), hardware)
        kernel_time = step.get("kernel_time", {})
        measured = kernel_time.get("kernel_seconds", {})
        out.append({
            "name": step["name"],
            "held_out": step.get("held_out", False),
            "measured_s": step["measured_s"],
            "predicted_s": predicted["predicted_s"],
            "ratio": predicted["predicted_s"] / step["measured_s"],
            "kinds": {k: (measured.get(k), v) for k, v in predicted["kinds"].items()},
            "idle_s": kernel_time.get("idle_s"),
        })  # fmt: skip
    return out


def replay_table(rows: list[dict]) -> str:
    """:func:`replay`'s rows as a markdown table: ms per step, per kind of kernel the
    device time measured / predicted (memory-bound kernels with the fp32 gradient
    accumulation, as the profiler counts them), and the time the profiled step's device ran
    no kernel / the predicted gaps between kernels."""
    kinds = ("matmul", "attention", "memory", "optimizer")
    head = "| step | measured ms | predicted ms | predicted/measured | "
    lines = [head + " | ".join(kinds) + " | idle |", "|" + "---|" * (5 + len(kinds))]
    for r in rows:
        predicted = dict(r["kinds"])
        if "grad_accumulation" in predicted:
            _, extra = predicted.pop("grad_accumulation")
            got, value = predicted["memory"]
            predicted["memory"] = (got, value + extra)
        cells = []
        for kind in kinds:
            got, value = predicted.get(kind, (None, None))
            shown = "—" if got is None else f"{got * 1e3:.1f}"
            cells.append("—" if value is None else f"{shown} / {value * 1e3:.1f}")
        name = r["name"] + (" (held out)" if r["held_out"] else "")
        idle = "—" if r.get("idle_s") is None else f"{r['idle_s'] * 1e3:.1f}"
        gaps = predicted.get("gaps", (None, None))[1]
        idle += "" if gaps is None else f" / {gaps * 1e3:.1f}"
        lines.append(f"| {name} | {r['measured_s'] * 1e3:.1f} | {r['predicted_s'] * 1e3:.1f} | "
                     f"{r['ratio']:.3f} | " + " | ".join(cells) + f" | {idle} |")  # fmt: skip
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else argv
    ours, flags = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    p = argparse.ArgumentParser(prog="python -m megapp.benchmarks.predicted_step",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--hardware", required=True, help="profile: built-in name or JSON file")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--warmup", type=int, default=3, help="iterations left out of the median")
    p.add_argument("--out", help="write the report here (JSON)")
    p.add_argument("--log", help="the job's output (default: a temporary file)")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--replay", metavar="STEPS_JSON",
                   help="predict again the steps a GPU run recorded (docs/img/h200_steps.json) "
                   "and print them beside their measurements; runs nothing")  # fmt: skip
    args = p.parse_args(ours)
    if not flags and not args.replay:
        p.error("give pretrain_gpt.py's flags after --, or --replay STEPS_JSON")
    args.flags = flags
    if args.log is None:
        args.log = str(Path(tempfile.gettempdir()) / "predicted_step.log")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replay:
        rows = replay(args.replay, args.hardware)
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
        print(f"$ python -m megapp.benchmarks.predicted_step --replay {args.replay} "
              f"--hardware {args.hardware}\n")  # fmt: skip
        print(replay_table(rows))
        return 0
    try:
        report = check(args)
    except (RuntimeError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"measured {report['measured_s'] * 1e3:.1f} ms per iteration (median of "
          f"{len(report['times_s'])}), predicted {report['predicted_s'] * 1e3:.1f} ms: "
          f"predicted/measured {report['ratio']:.3f}")  # fmt: skip
    for key, value in report["breakdown"].items():
        if key.startswith("step.") and value:
            print(f"  {key.removeprefix('step.'):<24} {value * 1e3:10.2f} ms")
    for kind, (f, i, w) in report["layer"].items():
        print(f"  one layer, {kind:<18} F {f * 1e3:8.3f}  I {i * 1e3:8.3f}  W {w * 1e3:8.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
