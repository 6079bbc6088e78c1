"""Every schedule under NCCL's point-to-point rules, proven on gloo.

Under strict channels (``initialize_model_parallel(strict_p2p=True)``,
``pretrain_gpt.py --strict-p2p``) gloo runs the pipeline's messages as NCCL does: one
group per direction of each pair of ranks, each group's operations one at a time in
posting order, a send done only once its receive runs
(:mod:`megapp.pipeline_parallel.strict_p2p`). Every schedule then trains the same model
as the single-process run, and the same messages on one shared communicator, which is
what deadlocks on NCCL, deadlock here too and are reported by the transport's timeout
with the ranks and messages they wait on.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megapp import parallel_state as ps
from megapp.comm import CollectiveError
from megapp.pipeline_parallel import TensorSpec, forward_backward, strict_p2p
from megapp.pipeline_parallel.channels import Channels, make_channels
from megapp.testing import distributed, get_world
from megapp.testing.pretrain_world import run_pretrain_in_world
from megapp.training.metrics import read_records
from tests.support import check_against_reference, train_layout

FULL_RECOMPUTE = {
    "recompute_granularity": "full",
    "recompute_method": "uniform",
    "recompute_num_layers": 1,
}
SLOW = pytest.mark.slow
CASES = [
    # (world, tp, pp, vpp, schedule, zero stage, config)
    # fast: two ranks sending to each other at once (the V), with full recompute; the
    # same with tp 2, sequence parallelism and ZeRO-2 on eight ranks in the full suite
    (4, 1, 2, 2, "zb-v", 0, FULL_RECOMPUTE),
    pytest.param(8, 2, 2, 2, "zb-v", 2, {"sequence_parallel": True, **FULL_RECOMPUTE}, marks=SLOW),
    pytest.param(4, 1, 2, 2, "dualpipev", 1, {}, marks=SLOW),
    pytest.param(4, 1, 4, None, "zb-h2", 0, {"recompute_granularity": "selective"}, marks=SLOW),
    pytest.param(4, 1, 4, 2, "zb-h1", 1, {}, marks=SLOW),
    pytest.param(4, 1, 2, 2, "interleaved-1f1b", 3, {}, marks=SLOW),
    pytest.param(4, 1, 4, 2, "looped-bfs", 0, {}, marks=SLOW),
    pytest.param(8, 2, 4, None, "1f1b", 1, {"sequence_parallel": True}, marks=SLOW),
    pytest.param(4, 1, 2, None, "gpipe", 0, {}, marks=SLOW),
]


@pytest.mark.parametrize("world_size, tp, pp, vpp, schedule, zero, config", CASES)
@distributed(timeout=240)
def test_every_schedule_trains_as_one_process_does(world_size, tp, pp, vpp, schedule, zero, config):
    chunks, losses, norms, first_grads = train_layout(
        tp, pp, vpp, schedule=schedule, zero_stage=zero, strict_p2p=True, **config
    )
    assert ps.TrainGroups.from_parallel_state().pp_channels.strict
    check_against_reference(chunks, losses, norms, first_grads, config)


MODEL = [
    "--pipeline-model-parallel-size",
    "2",
    "--num-layers",
    "4",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "2",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "4",
    "--lr",
    "1e-3",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--train-iters",
    "3",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
    "--use-default-corpus",
]


@pytest.mark.parametrize(
    "schedule",
    ["pipedream-2bw", pytest.param("pipedream", marks=SLOW), pytest.param("auto", marks=SLOW)],
)
def test_pretrain_gpt_under_nccl_rules_trains_as_on_gloo(schedule, tmp_path):
    """The asynchronous schedules (their reference is their own update rule, held to it in
    test_pipeline_async) and the searched one: ``--strict-p2p`` changes how the messages
    travel, not what is computed, so the losses are bitwise those of the plain run."""
    losses = {}
    for strict in (False, True):
        metrics = tmp_path / f"{strict}.jsonl"
        flags = [*MODEL, "--pipeline-schedule", schedule, "--metrics-path", str(metrics)]
        if schedule.startswith("pipedream"):  # what steps each stage on its own needs
            flags += ["--clip-grad", "0", "--untie-embeddings-and-output-weights"]
        done = run_pretrain_in_world(2, [*flags, *(["--strict-p2p"] if strict else [])])
        assert done.returncode == 0, done.stderr[-3000:]
        losses[strict] = [r["lm_loss"] for r in read_records(metrics, "train")]
    assert len(losses[True]) == 3 and losses[True] == losses[False]


HIDDEN = 4
SHAPES = [TensorSpec((2, HIDDEN), torch.float64)]


def _step(iterator, chunk, inputs):
    x = next(iterator) if inputs is None else inputs[0]
    return chunk(x), lambda out: out.square().mean()


def _one_communicator_for_both_directions() -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    chunk = nn.Linear(HIDDEN, HIDDEN, dtype=torch.float64)
    batches = [torch.randn(2, HIDDEN, dtype=torch.float64) for _ in range(2)]

    def run(channels: Channels, timeout: float):
        return forward_backward(
            _step,
            iter(batches),
            chunk,
            2,
            tensor_shapes=SHAPES,
            channels=channels,
            schedule="1f1b",
            timeout=timeout,
        )

    own = make_channels([[0, 1]], strict=True)
    assert torch.isfinite(run(own, 30).loss)
    shared_group = dist.new_group([0, 1])
    shared = Channels(strict=True)
    for src, dst in ((0, 1), (1, 0)):
        shared.data[(src, dst)] = shared.headers[(src, dst)] = shared_group
    with pytest.raises(CollectiveError) as failure:
        run(shared, 3)
    message = str(failure.value)
    assert f"rank {rank}: pipeline rank {rank} before " in message
    waits = "gradient of microbatch 0" if rank == 0 else "activation of microbatch 1"
    assert f"receive of the {waits}" in message, message
    assert "behind an earlier operation on the same communicator" in message, message


@pytest.mark.slow  # waits out a timeout in a world of its own
def test_one_communicator_for_both_directions_deadlocks_and_is_reported():
    """1F1B on two ranks with both directions on one strict group (what one NCCL
    communicator per pipeline does): rank 0's receive of the first gradient queues behind
    its send of the second activation, and rank 1's receive of that activation behind its
    send of the gradient; neither is ever matched. Each rank's error names it, the step
    and the messages it waits for. On a group per direction the same iteration runs.
    The stuck operations keep their threads waiting: the world is closed afterwards."""
    world = get_world(2, fresh=True)
    try:
        world.run(_one_communicator_for_both_directions, timeout=120)
    finally:
        world.close()


@distributed(world_size=2)
def test_a_strict_group_orders_only_its_own_operations():
    """A strict group's operation waits only for those posted before it on the same group:
    a send on another group completes while the first still waits for its receive."""
    rank = dist.get_rank()
    channels = make_channels([[0, 1]], strict=True)
    first_group, second_group = channels.group(0, 1), channels.group(0, 1, header=True)
    wait = timedelta(seconds=30)
    if rank == 0:
        first = strict_p2p.post([dist.P2POp(dist.isend, torch.ones(1), 1, first_group)])[0]
        second = strict_p2p.post([dist.P2POp(dist.isend, torch.ones(1), 1, second_group)])[0]
        second.wait(wait)
        assert not first.is_completed()  # its receive is posted only after the barrier
        dist.barrier()
        first.wait(wait)
    else:
        got = torch.zeros(1)
        strict_p2p.post([dist.P2POp(dist.irecv, got, 0, second_group)])[0].wait(wait)
        dist.barrier()
        strict_p2p.post([dist.P2POp(dist.irecv, got, 0, first_group)])[0].wait(wait)
    channels.destroy()
