"""Measure the peak memory of layouts with pretrain_gpt.py and compare it with the planner.

Each layout trains three iterations of the CPU demo's model under torchrun (gloo, dropout
off) with ``--profile-iteration 2``; the profile's peak live tensor bytes of every
pipeline rank (tensor- and data-parallel rank 0) is printed next to
:func:`megapp.planning.memory.predict_memory` as a markdown table.

    python tools/check_memory_model.py            # the layouts of docs/planning.md
    python tools/check_memory_model.py --layout "Layout(tp=2, pp=2, dp=2)"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from megapp.planning.layout import Layout, pretrain_config
from megapp.planning.memory import predict_memory
from megapp.planning.models import MODELS

ROOT = Path(__file__).resolve().parents[1]
MODEL = [*MODELS["tiny"].flags, "--hidden-dropout", "0", "--attention-dropout", "0"]
GLOBAL_BATCH = 16
LAYOUTS = (
    Layout(),
    Layout(pp=2),
    Layout(tp=2, pp=2),
    Layout(tp=2, pp=2, dp=2, micro_batch_size=2),
    Layout(pp=4, dp=2, micro_batch_size=2),
    Layout(pp=2, dp=4, vpp=2),
    Layout(tp=2, pp=2, dp=2, vpp=2, schedule="zb-v"),
    Layout(tp=2, pp=4, schedule="zb-h1"),
    Layout(tp=2, pp=2, dp=2, sequence_parallel=True, recompute="selective"),
    Layout(tp=2, pp=2, dp=2, recompute="full"),
    Layout(pp=2, dp=4, zero_stage=2),
    Layout(pp=2, dp=4, zero_stage=3),
)


def measure(layout: Layout, workdir: str) -> dict:
    """The profile record of one run of ``layout``."""
    metrics = os.path.join(workdir, f"{layout.name}.jsonl")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(layout.world_size), str(ROOT / "pretrain_gpt.py")]
    command += [*MODEL, *layout.flags(4), "--global-batch-size", str(GLOBAL_BATCH)]
    command += ["--lr", "1e-3", "--train-iters", "3", "--profile-iteration", "2"]
    command += ["--eval-iters", "0", "--use-default-corpus", "--metrics-path", metrics]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if run.returncode:
        raise SystemExit(f"{layout.name} failed:\n{run.stderr[-3000:]}")
    records = [json.loads(line) for line in Path(metrics).read_text().splitlines()]
    return next(r for r in records if r["kind"] == "profile")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layout", action="append", help="a Layout(...) expression")
    args = parser.parse_args()
    layouts = [eval(text, {"Layout": Layout}) for text in args.layout] if args.layout else LAYOUTS
    print("$ python " + " ".join(sys.argv))
    print("\n| layout | pp rank | measured MB | predicted MB | error |")
    print("|:--|--:|--:|--:|--:|")
    with tempfile.TemporaryDirectory() as workdir:
        for layout in layouts:
            profile = measure(layout, workdir)
            config = pretrain_config(layout, MODEL, GLOBAL_BATCH)
            predicted = predict_memory(config, MODELS["tiny"].vocab_size)
            for rank in profile["ranks"]:
                if rank["tp"] or rank["dp"]:
                    continue
                peak, guess = rank["peak_bytes"], predicted[rank["pp"]].total
                print(
                    f"| {layout.name} | {rank['pp']} | {peak / 1e6:.3f} | {guess / 1e6:.3f} "
                    f"| {100 * (guess / peak - 1):+.1f}% |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
