"""pretrain_gpt.py with the asynchronous schedules, against single-process runs of the same
update rule.

PipeDream-2BW's rule, W(t+1) = W(t) - lr·∇f(W(t-1)), does not depend on the pipeline, so
one process running it is the oracle: two stages × two data-parallel replicas with full
recompute and flushes every third iteration give its losses, iteration by iteration.
Resumed from a checkpoint (which holds the current weights, not the stashed ones), a run
starts its delay afresh on any layout, as one process does. Profiled, 2BW and PipeDream
with vertical sync peak within 5% of the planner's memory model, stashed copies
included (PipeDream's with tensor parallelism and sequence parallelism). Dropout is off,
as in every parity test. The runs are pretrain_gpt.py's main on the ranks of a reused gloo
world (:mod:`megapp.testing.pretrain_world`).
"""

from __future__ import annotations

import shlex

import pytest

from megapp.data import ByteTokenizer
from megapp.planning.memory import predict_memory
from megapp.testing.pretrain_world import run_pretrain_in_world
from megapp.training.arguments import config_from_flags
from megapp.training.flag_groups import ArgumentsError
from megapp.training.metrics import read_records

MODEL = shlex.split(
    "--num-layers 4 --hidden-size 32 --num-attention-heads 2 --seq-length 32 "
    "--micro-batch-size 1 --global-batch-size 4 --lr 1e-3 --hidden-dropout 0 "
    "--attention-dropout 0 --split 80,10,10 --train-iters 4 --log-interval 1 --eval-iters 0 "
    "--clip-grad 0 --untie-embeddings-and-output-weights"
)
TWO_BW = "--pipeline-schedule pipedream-2bw"
PROFILED = "--profile-iteration 1 --pipeline-flush-interval 3"
RUNS = {  # name: (processes, flags)
    "one": (1, f"{TWO_BW} --save ckpt --save-interval 2"),
    "layout": (
        4,
        f"{TWO_BW} --pipeline-model-parallel-size 2 --recompute-granularity full "
        f"--recompute-method uniform --recompute-num-layers 1 {PROFILED}",
    ),
    "vsync": (
        4,
        f"--pipeline-schedule pipedream --vertical-sync --pipeline-model-parallel-size 2 "
        f"--tensor-model-parallel-size 2 --sequence-parallel {PROFILED}",
    ),
}
RESUMED = {
    "resumed-one": (1, f"{TWO_BW} --load ckpt --ckpt-step 2"),
    "resumed-layout": (2, f"{TWO_BW} --pipeline-model-parallel-size 2 --load ckpt --ckpt-step 2"),
}


def _run_all(runs, data, tmp_path) -> dict[str, list[dict]]:
    """Run every ``name: (processes, flags)`` job in the world; each one's records."""
    records = {}
    for name, (nproc, flags) in runs.items():
        metrics = ["--metrics-path", str(tmp_path / f"{name}.jsonl")]
        flags = [*MODEL, *data, *shlex.split(flags), *metrics]
        # a profiled run measures every live tensor of its processes: new ones, as launched
        fresh = "--profile-iteration" in flags
        done = run_pretrain_in_world(nproc, flags, cwd=tmp_path, fresh=fresh)
        assert done.returncode == 0, f"{name}:\n{done.stderr[-3000:]}"
        records[name] = read_records(tmp_path / f"{name}.jsonl")
    return records


def _losses(records: list[dict]) -> list[float]:
    return [r["lm_loss"] for r in records if r["kind"] == "train"]


@pytest.mark.slow  # six pretrain_gpt.py jobs; the update rules stay fast in test_pipeline_async
def test_2bw_trains_as_one_process_does_and_memory_follows_the_model(corpus, tmp_path):
    data = ["--data-path", str(corpus / "stdlib"), "--data-cache-path", str(tmp_path / "cache")]
    records = _run_all(RUNS, data, tmp_path)
    one = _losses(records["one"])
    assert len(one) == 4
    assert _losses(records["layout"]) == pytest.approx(one, rel=1e-5)
    vocab = ByteTokenizer().vocab_size
    for name in ("layout", "vsync"):
        nproc, flags = RUNS[name]
        flags = [*MODEL, *shlex.split(flags), "--use-default-corpus"]
        config = config_from_flags(flags, world_size=nproc)
        predicted = predict_memory(config, vocab)
        assert predicted[0].stashed > 0
        (profile,) = [r for r in records[name] if r["kind"] == "profile"]
        for rank in profile["ranks"]:
            want = predicted[rank["pp"]].total
            assert rank["peak_bytes"] == pytest.approx(want, rel=0.05), (name, rank["pp"])

    resumed = _run_all(RESUMED, data, tmp_path)
    restarted = _losses(resumed["resumed-one"])
    assert len(restarted) == 2
    assert _losses(resumed["resumed-layout"]) == pytest.approx(restarted, rel=1e-5)
    # the restart ran iteration 3 on the loaded weights, not on the stashed older ones
    assert restarted[0] != pytest.approx(one[2], rel=1e-6)


@pytest.mark.parametrize(
    "flags, refused",
    [
        ("--pipeline-model-parallel-size 2", "set --clip-grad to 0"),
        ("--pipeline-model-parallel-size 2 --clip-grad 0", "--untie-embeddings"),
        (
            "--pipeline-model-parallel-size 2 --clip-grad 0 --untie-embeddings-and-output-weights "
            "--use-distributed-optimizer",
            r"--zero-stage 0, no --use-distributed-optimizer",
        ),
        ("--fp16", "use --bf16"),
        (
            "--pipeline-model-parallel-size 2 --clip-grad 0 --untie-embeddings-and-output-weights "
            "--num-layers-per-virtual-pipeline-stage 1",
            "one model chunk per rank",
        ),
        (
            "--pipeline-model-parallel-size 4 --global-batch-size 2 --clip-grad 0 "
            "--untie-embeddings-and-output-weights",
            "at least p - 1 = 3",
        ),
    ],
)
def test_what_the_asynchronous_schedules_refuse(flags, refused):
    base = shlex.split(
        "--num-layers 4 --hidden-size 32 --num-attention-heads 2 --seq-length 32 "
        "--micro-batch-size 1 --global-batch-size 4 --train-iters 4 --lr 1e-3 --use-default-corpus "
        "--pipeline-schedule pipedream-2bw"
    )
    with pytest.raises(ArgumentsError, match=refused):
        config_from_flags([*base, *shlex.split(flags)], world_size=4)
    with pytest.raises(ArgumentsError, match="--vertical-sync applies to --pipeline-schedule"):
        config_from_flags([*base, "--vertical-sync"], world_size=4)
