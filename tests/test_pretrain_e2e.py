"""pretrain_gpt.py end to end under torchrun: 4 ranks (tp 2 × pp 2) train, evaluate, save;
a second launch resumes from the middle checkpoint and continues with exactly the losses
of the uninterrupted run; bad data and a bad batch size stop the job with a clear error.

Dropout stays on (Megatron's 0.1), so exact equality also needs the RNG streams restored
and nothing outside the iterations drawing from them. Everything runs in fp32 on CPU with
the same reduction order in both launches, so the comparison is bitwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megapp.data import ByteTokenizer, build_default_corpus

ROOT = Path(__file__).resolve().parents[1]
ITERS, SAVE_AT = 6, 3
MODEL = (
    "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers 2 "
    "--hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 "
    "--global-batch-size 8 --lr 1e-3 --lr-decay-style cosine --split 90,5,5 "
    f"--train-iters {ITERS} --log-interval 1 --eval-interval {SAVE_AT} --eval-iters 2"
).split()

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def torchrun(nproc: int, *flags: str) -> list[str]:
    """``torchrun --standalone`` (a free port, so launches can run side by side)."""
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*run, "--nproc-per-node", str(nproc), str(ROOT / "pretrain_gpt.py"), *flags]


def launch(nproc: int, *flags: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        torchrun(nproc, *flags),
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A small dataset: the first ~400 kB of the standard-library corpus, byte tokens."""
    root = tmp_path_factory.mktemp("pretrain_data")
    build_default_corpus(str(root / "stdlib"), ByteTokenizer(), max_bytes=400_000)
    return root


def test_train_save_resume_continues_exactly(corpus, tmp_path):
    data = ["--data-path", str(corpus / "stdlib"), "--data-cache-path", str(tmp_path / "cache")]
    ckpt = tmp_path / "checkpoints"
    full = launch(
        4,
        *MODEL,
        *data,
        *("--save", str(ckpt), "--save-interval", str(SAVE_AT)),
        *("--metrics-path", str(tmp_path / "full.jsonl")),
        cwd=tmp_path,
    )
    assert full.returncode == 0, full.stderr[-4000:]
    resumed = launch(
        4,
        *MODEL,
        *data,
        *("--load", str(ckpt), "--ckpt-step", str(SAVE_AT), "--save", str(tmp_path / "resumed")),
        *("--metrics-path", str(tmp_path / "resumed.jsonl")),
        cwd=tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]

    full_records, resumed_records = (
        records(tmp_path / "full.jsonl"),
        records(tmp_path / "resumed.jsonl"),
    )
    train = {r["iteration"]: r for r in full_records if r["kind"] == "train"}
    assert sorted(train) == list(range(1, ITERS + 1))
    assert [train[i]["consumed_samples"] for i in train] == [8 * i for i in train]
    losses = [train[i]["lm_loss"] for i in sorted(train)]
    assert losses[-1] < losses[0] - 0.3, losses  # it learns
    saved = [r["iteration"] for r in full_records if r["kind"] == "checkpoint"]
    assert saved == [SAVE_AT, ITERS]

    # The resumed run starts after the checkpoint and repeats the rest bit for bit:
    # training losses, gradient norms, learning rates, and every evaluation after it.
    assert resumed_records[0] == {**resumed_records[0], "kind": "run", "iteration": SAVE_AT}
    again = [r for r in resumed_records if r["kind"] in ("train", "eval")]
    tail = [r for r in full_records if r["kind"] in ("train", "eval") and r["iteration"] > SAVE_AT]
    keys = ("kind", "iteration", "consumed_samples", "lm_loss", "grad_norm", "learning_rate")
    assert [{k: r.get(k) for k in keys} for r in again] == [
        {k: r.get(k) for k in keys} for r in tail
    ]
    assert [r["split"] for r in again if r["kind"] == "eval"] == ["valid", "valid", "test"]

    # The last rank printed Megatron's line for every iteration and the evaluations.
    assert f" iteration {ITERS:8d}/{ITERS:8d} | consumed samples: {8 * ITERS:12d} |" in full.stdout
    assert f" validation loss at iteration {SAVE_AT} | lm loss value: " in full.stdout
    assert f"lm loss: {train[ITERS]['lm_loss']:.6E} |" in full.stdout
    assert "loaded checkpoint" in resumed.stdout


def test_bad_data_and_batch_fail_with_clear_errors(corpus, tmp_path):
    """Three broken launches, run side by side: each exits nonzero naming the problem."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for suffix in (".bin", ".idx"):
        shutil.copy(corpus / f"stdlib{suffix}", broken / f"stdlib{suffix}")
    idx = broken / "stdlib.idx"
    idx.write_bytes(idx.read_bytes()[:-8])  # a truncated index
    small = "--tensor-model-parallel-size 2 --num-layers 2 --hidden-size 32 "
    small += "--num-attention-heads 2 --seq-length 16 --micro-batch-size 2 --lr 1e-3 "
    small += "--train-iters 2"
    cache = ["--data-cache-path", str(tmp_path / "cache")]
    cases = {
        "missing": (
            2,
            [*small.split(), "--data-path", str(tmp_path / "nowhere"), *cache],
            f"--data-path {tmp_path / 'nowhere'}: {tmp_path / 'nowhere'}.bin / ",
        ),
        "corrupt": (
            2,
            [*small.split(), "--data-path", str(broken / "stdlib"), *cache],
            f"--data-path: {idx}: header says",
        ),
        "batch": (
            2,
            [
                *small.replace("--tensor-model-parallel-size 2", "").split(),
                *("--global-batch-size", "6", "--use-default-corpus"),
            ],
            "--global-batch-size (6) is not divisible by --micro-batch-size × data-parallel "
            "size (2 × 2 = 4); use a global batch of 4 or 8",
        ),
    }
    running = {
        name: subprocess.Popen(
            torchrun(n, *flags),
            cwd=tmp_path,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, (n, flags, _) in cases.items()
    }
    for name, process in running.items():
        _, stderr = process.communicate(timeout=300)
        message = cases[name][2]
        assert process.returncode != 0, f"{name}: exited 0"
        assert f"pretrain_gpt.py: error: {message}" in stderr, (
            f"{name}: {message!r} not in stderr:\n{stderr[-3000:]}"
        )
