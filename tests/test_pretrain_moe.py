"""``pretrain_gpt.py --num-experts`` trains the model the single-process run trains: the
same training and validation losses, iteration by iteration, with the experts split over
expert-parallel ranks, and the log line reports the auxiliary losses and the expert load.
Dropout is off (its masks differ between layouts by design) and routing is dropless, so
the losses agree to fp32 round-off. The runs are pretrain_gpt.py's main on the ranks of a
reused gloo world (:mod:`megapp.testing.pretrain_world`).
"""

from __future__ import annotations

import pytest

from megapp.testing.pretrain_world import run_pretrain_in_world
from megapp.training.metrics import read_records
from tests.support import args_for

ITERS = 3
BASE = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --hidden-dropout 0 "
    "--attention-dropout 0 --split 80,10,10 --log-interval 1 --eval-interval 3 --eval-iters 1 "
    f"--train-iters {ITERS} --num-experts 8 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 "
    "--moe-z-loss-coeff 1e-3"
).split()
LAYOUTS = [
    # (world, expert-parallel flags)
    (2, "--expert-model-parallel-size 2"),
    pytest.param(
        4,
        "--expert-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel "
        "--moe-token-dispatcher-type allgather",
        marks=pytest.mark.slow,
    ),
    pytest.param(4, "--expert-model-parallel-size 4", marks=pytest.mark.slow),
    # ep 4 over tp 2 × dp 2, with two pipeline stages
    pytest.param(
        8,
        "--expert-model-parallel-size 4 --expert-tensor-parallel-size 1 "
        "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2",
        marks=pytest.mark.slow,
    ),
    # ZeRO-3: the dense weights sliced over 2 data-parallel ranks, the experts' over 2
    # expert-data-parallel ranks
    pytest.param(
        4,
        "--expert-model-parallel-size 2 --expert-tensor-parallel-size 1 "
        "--tensor-model-parallel-size 2 --sequence-parallel --zero-stage 3",
        marks=pytest.mark.slow,
    ),
]


def _run(tmp_path, corpus, world: int, flags: list[str], name: str):
    data = ["--data-path", str(corpus / "stdlib"), "--data-cache-path", str(tmp_path / "cache")]
    path = tmp_path / f"{name}.jsonl"
    done = run_pretrain_in_world(
        world, [*BASE, *data, *flags, "--metrics-path", str(path)], cwd=tmp_path
    )
    assert done.returncode == 0, f"{name}:\n{done.stderr[-3000:]}"
    train = list(read_records(path, "train"))
    valid = [r["lm_loss"] for r in read_records(path, "eval")]
    assert len(train) == ITERS and valid
    return train, valid, done.stdout


@pytest.fixture(scope="module")
def single_process(corpus, tmp_path_factory):
    """The losses in one process, run once for the module."""
    return _run(tmp_path_factory.mktemp("moe_reference"), corpus, 1, [], "single")


@pytest.mark.parametrize("world, flags", LAYOUTS)
def test_expert_parallel_trains_the_single_process_losses(
    world, flags, single_process, corpus, tmp_path
):
    train, valid, stdout = _run(tmp_path, corpus, world, flags.split(), "ep")
    ref_train, ref_valid, _ = single_process
    # the tokens per expert summed over the ranks are the single process's: the same load
    exact = ("expert_load_max", "expert_load_min")
    for key in ("lm_loss", "load_balancing_loss", "z_loss", *exact):
        ours, theirs = [r[key] for r in train], [r[key] for r in ref_train]
        assert ours == (theirs if key in exact else pytest.approx(theirs, rel=1e-5)), key
    assert all(r["expert_load_max"] > 1.0 > r["expert_load_min"] for r in train)
    assert valid == pytest.approx(ref_valid, rel=1e-5)
    for name in ("load_balancing_loss", "z_loss", "expert_load_max", "expert_load_min"):
        assert f" {name}: " in stdout, name


TWO_BW = "--pipeline-schedule pipedream-2bw --clip-grad 0 --untie-embeddings-and-output-weights"


@pytest.mark.slow
def test_pipedream_2bw_with_experts_trains_its_update_rule(corpus, tmp_path):
    """PipeDream-2BW's update rule does not depend on the pipeline: two stages × two
    replicas with ep 2 give one process's losses under the same rule, the auxiliary losses
    and the expert load included (each iteration reports its run's mean)."""
    (tmp_path / "one").mkdir()
    (tmp_path / "layout").mkdir()
    one, _, _ = _run(tmp_path / "one", corpus, 1, TWO_BW.split(), "2bw-one")
    flags = f"{TWO_BW} --pipeline-model-parallel-size 2 --expert-model-parallel-size 2"
    layout, _, stdout = _run(tmp_path / "layout", corpus, 4, flags.split(), "2bw-layout")
    for key in ("lm_loss", "load_balancing_loss", "z_loss", "expert_load_max"):
        ours, theirs = [r[key] for r in layout], [r[key] for r in one]
        assert ours == pytest.approx(theirs, rel=1e-5), key
    assert "load_balancing_loss: " in stdout


@pytest.mark.parametrize(
    "extra, message",
    [
        ("--num-experts 6 --expert-model-parallel-size 4", "divisible by --expert-model"),
        ("--expert-model-parallel-size 2", "give --num-experts"),
        ("--num-experts 4 --tensor-model-parallel-size 2", "--sequence-parallel"),
        ("--num-experts 4 --expert-model-parallel-size 3", "expert"),
        ("--num-experts 4 --moe-router-enable-expert-bias", "--moe-router-score-function 'sig"),
        (
            "--num-experts 4 --moe-router-score-function sigmoid --moe-router-enable-expert-bias "
            "--pipeline-schedule pipedream-2bw --pipeline-model-parallel-size 2",
            "drop --moe-router-enable-expert-bias",
        ),
    ],
)
def test_bad_expert_flags_fail_at_start_up_in_one_line(extra, message):
    with pytest.raises(ValueError, match=message) as error:
        args_for(extra, world_size=8)
    assert "\n" not in str(error.value)
