"""``pretrain_gpt.py --context-parallel-size`` trains the model the single-process run
trains: the same training and validation losses, iteration by iteration, for each
``--cp-comm-type``, on GPT (learned positions, biases) and on a Llama-style model (RoPE
on global positions, grouped-query attention, SwiGLU, RMSNorm). Dropout is off (its
masks differ between layouts by design); everything else is the same, so the losses
agree to fp32 round-off. The runs are pretrain_gpt.py's main on the ranks of a reused
gloo world (:mod:`megapp.testing.pretrain_world`).
"""

from __future__ import annotations

import pytest

from megapp.testing.pretrain_world import run_pretrain_in_world
from megapp.training.metrics import read_records

ITERS = 3
BASE = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --hidden-dropout 0 "
    "--attention-dropout 0 --split 80,10,10 --log-interval 1 --eval-interval 3 --eval-iters 1 "
    f"--train-iters {ITERS}"
).split()
MODELS = {
    "gpt": [],
    "llama": [
        *("--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu"),
        *("--disable-bias-linear", "--untie-embeddings-and-output-weights"),
        *("--num-query-groups", "2"),
    ],
}
LAYOUTS = [
    # (model, world, context-parallel flags)
    ("gpt", 2, "--context-parallel-size 2 --cp-comm-type p2p"),
    ("gpt", 2, "--context-parallel-size 2 --cp-comm-type all_gather"),
    ("llama", 2, "--context-parallel-size 2 --cp-comm-type a2a"),
    ("llama", 4, "--context-parallel-size 2 --cp-comm-type p2p --tensor-model-parallel-size 2"),
    pytest.param(
        "llama", 4, "--context-parallel-size 4 --cp-comm-type all_gather", marks=pytest.mark.slow
    ),
    pytest.param(
        "gpt",
        4,
        "--context-parallel-size 2 --cp-comm-type a2a --pipeline-model-parallel-size 2",
        marks=pytest.mark.slow,
    ),
]


def _losses(tmp_path, corpus, model: str, world: int, flags: list[str], name: str):
    data = ["--data-path", str(corpus / "stdlib"), "--data-cache-path", str(tmp_path / "cache")]
    path = tmp_path / f"{name}.jsonl"
    done = run_pretrain_in_world(
        world, [*BASE, *MODELS[model], *data, *flags, "--metrics-path", str(path)], cwd=tmp_path
    )
    assert done.returncode == 0, f"{name}:\n{done.stderr[-3000:]}"
    train = [r["lm_loss"] for r in read_records(path, "train")]
    valid = [r["lm_loss"] for r in read_records(path, "eval")]
    assert len(train) == ITERS and valid
    return train, valid, done.stdout


@pytest.fixture(scope="module")
def single_process(corpus, tmp_path_factory):
    """Each model's losses in one process, once for the module."""
    tmp = tmp_path_factory.mktemp("cp_reference")
    return {model: _losses(tmp, corpus, model, 1, [], model)[:2] for model in MODELS}


@pytest.mark.parametrize("model, world, flags", LAYOUTS)
def test_context_parallel_trains_the_single_process_losses(
    model, world, flags, single_process, corpus, tmp_path
):
    train, valid, stdout = _losses(tmp_path, corpus, model, world, flags.split(), "cp")
    ref_train, ref_valid = single_process[model]
    assert train == pytest.approx(ref_train, rel=1e-5)
    assert valid == pytest.approx(ref_valid, rel=1e-5)
    assert "× cp " in stdout  # the layout line names the context-parallel split
