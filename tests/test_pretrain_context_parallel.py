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
import torch

from megapp.models.hf_checkpoint import hf_gpt_config
from megapp.testing.pretrain_world import run_pretrain_in_world
from megapp.training.hf_start import pretrain_flags
from megapp.training.metrics import read_records
from tests.support import hf_tensors

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
# slow but the first: the in-world parity tests of tests/test_context_parallel_training.py
# hold each mechanism and layout to the single-process model in the fast tier
SLOW = pytest.mark.slow
LAYOUTS = [
    # (model, world, context-parallel flags)
    ("gpt", 2, "--context-parallel-size 2 --cp-comm-type p2p"),
    pytest.param("gpt", 2, "--context-parallel-size 2 --cp-comm-type all_gather", marks=SLOW),
    pytest.param("llama", 2, "--context-parallel-size 2 --cp-comm-type a2a", marks=SLOW),
    pytest.param(
        "llama",
        4,
        "--context-parallel-size 2 --cp-comm-type p2p --tensor-model-parallel-size 2",
        marks=SLOW,
    ),
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
    """A model's losses in one process, run once for the module when first asked for."""
    tmp, runs = tmp_path_factory.mktemp("cp_reference"), {}

    def losses(model: str):
        if model not in runs:
            runs[model] = _losses(tmp, corpus, model, 1, [], model)[:2]
        return runs[model]

    return losses


@pytest.mark.parametrize("model, world, flags", LAYOUTS)
def test_context_parallel_trains_the_single_process_losses(
    model, world, flags, single_process, corpus, tmp_path
):
    train, valid, stdout = _losses(tmp_path, corpus, model, world, flags.split(), "cp")
    ref_train, ref_valid = single_process(model)
    assert train == pytest.approx(ref_train, rel=1e-5)
    assert valid == pytest.approx(ref_valid, rel=1e-5)
    assert "× cp " in stdout  # the layout line names the context-parallel split


def test_a_hugging_face_model_loads_and_exports_under_context_parallelism(corpus, tmp_path):
    """A Llama folder through ``--load-hf`` under cp 2 and back out with ``--save-hf``
    (learning rate 0): the exported tensors are the original's bit for bit, and the loss
    is the single-process run's."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(5)
    config = transformers.LlamaConfig(
        vocab_size=300,  # the byte tokenizer's 257 ids fit
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    source = tmp_path / "hf"
    transformers.LlamaForCausalLM(config).save_pretrained(source)
    model, _ = hf_gpt_config(source)
    run = [
        *pretrain_flags(model),
        *("--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2"),
        *("--lr", "0", "--min-lr", "0", "--train-iters", "1", "--eval-iters", "0"),
        *("--log-interval", "1", "--load-hf", str(source)),
        *("--data-path", str(corpus / "stdlib"), "--data-cache-path", str(tmp_path / "cache")),
    ]
    losses = {}
    for name, world, flags in (("single", 1, []), ("cp2", 2, ["--context-parallel-size", "2"])):
        out = tmp_path / name
        done = run_pretrain_in_world(
            world,
            [*run, *flags, "--save-hf", str(out), "--metrics-path", str(out) + ".jsonl"],
            cwd=tmp_path,
        )
        assert done.returncode == 0, f"{name}:\n{done.stderr[-3000:]}"
        losses[name] = [r["lm_loss"] for r in read_records(str(out) + ".jsonl", "train")]
        ours, theirs = hf_tensors(out), hf_tensors(source)
        assert sorted(ours) == sorted(theirs)
        for key, tensor in theirs.items():
            assert torch.equal(ours[key], tensor), (name, key)
    assert losses["cp2"] == pytest.approx(losses["single"], rel=1e-5)
