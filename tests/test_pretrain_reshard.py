"""pretrain_gpt.py resumes under another layout with default flags and continues the run.

Two jobs train 4 iterations and save after 2; jobs under other layouts load that
checkpoint and train iterations 3 and 4. Their losses and gradient norms equal the
uninterrupted job's to fp32 round-off: the layouts sum in different orders, so the
comparison is the layout tests' tolerance, not bitwise. Dropout is off: the RNG streams
belong to a rank's place in the grid and are restored only under the same layout (a
resharded run draws its dropout masks from its own seeds). The jobs are pretrain_gpt.py's
main on the ranks of a reused gloo world (:mod:`megapp.testing.pretrain_world`).
"""

from __future__ import annotations

import pytest

from megapp.testing.pretrain_world import run_pretrain_in_world
from tests.support import checkpoint_sources, data_flags, train_records

ITERS, SAVE_AT = 4, 2
MODEL = (
    "--num-layers 8 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --lr-decay-style cosine "
    "--hidden-dropout 0 --attention-dropout 0 --split 90,5,5 --eval-iters 0 --log-interval 1 "
    f"--train-iters {ITERS}"
).split()
SOURCES = {
    "tp2 pp2": (4, "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2"),
    "dp2 zero1": (2, "--use-distributed-optimizer"),
}
TARGETS = [
    ("tp2 pp2", "tp 2->1", 4, "--pipeline-model-parallel-size 2"),
    (
        "tp2 pp2",
        "pp 2->4 with vpp",
        4,
        "--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 1",
    ),
    ("dp2 zero1", "tp 1->4", 4, "--tensor-model-parallel-size 4"),
    ("dp2 zero1", "dp 2->4, zero 1->2", 4, "--zero-stage 2"),
    ("dp2 zero1", "dp 2->4, zero 1->3", 4, "--zero-stage 3"),
    ("dp2 zero1", "cp 1->2", 4, "--context-parallel-size 2 --use-distributed-optimizer"),
]
KEYS = ("iteration", "consumed_samples", "lm_loss", "grad_norm", "learning_rate")


@pytest.fixture(scope="module")
def sources(corpus, tmp_path_factory):
    """Each source job's checkpoint directory and its training records."""
    return checkpoint_sources(SOURCES, MODEL, SAVE_AT, corpus, tmp_path_factory)


@pytest.mark.slow  # pretrain_gpt.py jobs: checkpoints load across layouts in test_checkpoint
@pytest.mark.parametrize("source, name, nproc, layout", TARGETS, ids=[t[1] for t in TARGETS])
def test_a_checkpoint_resumes_under_another_layout(
    sources,
    corpus,
    tmp_path,
    source,
    name,
    nproc,
    layout,
):
    root, full = sources[source]
    job = run_pretrain_in_world(
        nproc,
        [
            *MODEL,
            *layout.split(),
            *data_flags(corpus, tmp_path),
            *("--load", str(root / "ckpt"), "--ckpt-step", str(SAVE_AT)),
            *("--metrics-path", str(tmp_path / "metrics.jsonl")),
        ],
        cwd=tmp_path,
    )
    assert job.returncode == 0, job.stderr[-4000:]
    assert f"loaded checkpoint {root / 'ckpt' / 'iter_0000002'}" in job.stdout
    resumed = train_records(tmp_path / "metrics.jsonl")
    assert sorted(resumed) == [3, 4]
    for i in (3, 4):
        for key in ("iteration", "consumed_samples", "learning_rate"):
            assert resumed[i][key] == full[i][key], (name, i, key)
        for key in ("lm_loss", "grad_norm"):
            assert resumed[i][key] == pytest.approx(full[i][key], rel=1e-5), (name, i, key)
