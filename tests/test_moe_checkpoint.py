"""A mixture-of-experts checkpoint saved under one expert-parallel layout resumes under
another: each expert is stored under its global index, its AdamW states too (gathered
over the expert-data-parallel group from ZeRO-1 on; under ZeRO-3 the expert weights
too), so the resumed run's losses and
gradient norms equal the uninterrupted run's. Dropout is off and routing dropless, so
the layouts differ by fp32 round-off only. The jobs are pretrain_gpt.py's main on the
ranks of a reused gloo world (:mod:`megapp.testing.pretrain_world`).
"""

from __future__ import annotations

import pytest

from megapp.testing.pretrain_world import run_pretrain_in_world
from tests.support import checkpoint_sources, data_flags, train_records

ITERS, SAVE_AT = 4, 2
MODEL = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --hidden-dropout 0 "
    "--attention-dropout 0 --split 90,5,5 --eval-iters 0 --log-interval 1 "
    f"--train-iters {ITERS} --num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 "
    "--swiglu"
).split()
# dp 2 and expert dp 2: ZeRO-3 slices the dense weights and the experts' over 2 ranks each
ZERO3_EDP2 = (
    "--expert-model-parallel-size 2 --expert-tensor-parallel-size 1 "
    "--tensor-model-parallel-size 2 --sequence-parallel --zero-stage 3"
)
SOURCES = {
    "ep2": (2, "--expert-model-parallel-size 2"),
    "ep1 zero1": (2, "--use-distributed-optimizer"),
}
TARGETS = [
    pytest.param("ep2", "ep 2->1", 1, "", id="ep 2->1"),
    pytest.param(
        "ep1 zero1",
        "ep 1->2, zero1 edp 2->1",
        2,
        "--expert-model-parallel-size 2 --zero-stage 1",
        id="ep 1->2, zero1 edp 2->1",
    ),
    pytest.param(
        "ep2",
        "ep 2->2 with etp 2",
        4,
        "--expert-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel",
        marks=pytest.mark.slow,
        id="ep 2->2 with etp 2",
    ),
    pytest.param(
        "ep1 zero1",
        "ep 1->2, zero1 edp 2",
        4,
        "--expert-model-parallel-size 2 --expert-tensor-parallel-size 1 "
        "--tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer",
        marks=pytest.mark.slow,
        id="ep 1->2, zero1 edp 2",
    ),
    pytest.param(
        "ep2",
        "ep 2->2, zero3 edp 2",
        4,
        ZERO3_EDP2,
        marks=pytest.mark.slow,
        id="ep 2->2, zero3 edp 2",
    ),
]


@pytest.fixture(scope="module")
def sources(corpus, tmp_path_factory):
    """Each source job's checkpoint directory and its uninterrupted training records."""
    return checkpoint_sources(SOURCES, MODEL, SAVE_AT, corpus, tmp_path_factory)


@pytest.mark.parametrize("source, name, nproc, layout", TARGETS)
def test_a_moe_checkpoint_resumes_under_another_expert_layout(
    sources, corpus, tmp_path, source, name, nproc, layout
):
    _resume(*sources[source], corpus, tmp_path, name, nproc, layout)


@pytest.mark.slow
def test_a_moe_checkpoint_saved_under_expert_zero3_resumes_under_expert_zero2(
    corpus, tmp_path, tmp_path_factory
):
    source = {"zero3": (4, ZERO3_EDP2)}
    root, full = checkpoint_sources(source, MODEL, SAVE_AT, corpus, tmp_path_factory)["zero3"]
    layout = ZERO3_EDP2.replace("--zero-stage 3", "--zero-stage 2")
    _resume(root, full, corpus, tmp_path, "zero3->zero2 edp 2", 4, layout)


def _resume(root, full, corpus, tmp_path, name, nproc, layout):
    """Resume the checkpoint of iteration SAVE_AT under ``layout``; its last iterations
    must be the uninterrupted run's ``full`` records."""
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
        for key in ("lm_loss", "grad_norm", "load_balancing_loss"):
            assert resumed[i][key] == pytest.approx(full[i][key], rel=1e-5), (name, i, key)
