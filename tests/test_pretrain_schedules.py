"""pretrain_gpt.py under three pipeline schedules trains the same model: 1F1B, zb-v (the
V, with the tied embedding's two copies on rank 0) and auto (one timed zb-h1 iteration,
then the searched schedule) give the same losses, iteration by iteration. Profiled, the
1F1B and zb-v runs peak within 5% of the planner's memory model on every rank.

Dropout is off: a schedule changes the order in which microbatches run, and with it
which dropout masks each draws. Everything else (data, initialisation, the optimizer)
is the same, so the losses agree to fp32 round-off of the reordered sums. The runs are
pretrain_gpt.py's main on the ranks of a reused gloo world
(:mod:`megapp.testing.pretrain_world`).
"""

from __future__ import annotations

import pytest

from megapp.data import ByteTokenizer
from megapp.planning.memory import predict_memory
from megapp.testing.pretrain_world import run_pretrain_in_world
from megapp.training.arguments import config_from_flags
from megapp.training.metrics import read_records

ITERS = 3
MODEL = (
    "--pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 32 --num-attention-heads 2 "
    "--seq-length 32 --micro-batch-size 1 --global-batch-size 4 --lr 1e-3 "
    "--hidden-dropout 0 --attention-dropout 0 --split 80,10,10 "
    f"--train-iters {ITERS} --log-interval 1 --eval-iters 0"
).split()
PROFILE = ["--profile-iteration", "1"]
SCHEDULES = {
    "1f1b": PROFILE,
    "zb-v": [
        "--pipeline-schedule",
        "zb-v",
        "--num-layers-per-virtual-pipeline-stage",
        "1",
        *PROFILE,
    ],
    "auto": ["--pipeline-schedule", "auto"],
}


def test_schedules_train_the_same_model(corpus, tmp_path):
    data = ["--data-path", str(corpus / "stdlib"), "--data-cache-path", str(tmp_path / "cache")]
    outputs = {}
    for name, flags in SCHEDULES.items():  # the first run builds the data cache
        metrics = ["--metrics-path", str(tmp_path / f"{name}.jsonl")]
        # a profiled run measures every live tensor of its processes: new ones, as launched
        fresh = PROFILE[0] in flags
        done = run_pretrain_in_world(
            2, [*MODEL, *data, *flags, *metrics], cwd=tmp_path, fresh=fresh
        )
        assert done.returncode == 0, f"{name}:\n{done.stderr[-3000:]}"
        outputs[name] = (done.stdout, done.stderr)
    losses = {}
    for name, flags in SCHEDULES.items():
        train = read_records(tmp_path / f"{name}.jsonl", "train")
        profiles = read_records(tmp_path / f"{name}.jsonl", "profile")
        if PROFILE[0] in flags:  # the memory model predicts every rank's measured peak
            config = config_from_flags([*MODEL, *flags, "--use-default-corpus"], world_size=2)
            predicted = predict_memory(config, ByteTokenizer().vocab_size)
            for rank in profiles[0]["ranks"]:
                peak = rank["peak_bytes"]
                assert predicted[rank["pp"]].total == pytest.approx(peak, rel=0.05), name
        losses[name] = [r["lm_loss"] for r in train]
        assert len(losses[name]) == ITERS
    for name in ("zb-v", "auto"):
        assert losses[name] == pytest.approx(losses["1f1b"], rel=1e-5), name
    assert "pipeline schedule auto: " in outputs["auto"][0]
