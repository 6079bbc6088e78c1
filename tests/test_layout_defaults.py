"""APIs left without their process groups take the layout's or refuse; they never guess.

Before, ``Optimizer(norm_group=None)`` meant "this rank alone": a tp × pp layout that left
it out computed a different gradient norm on every rank, and the replicas drifted apart.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megapp import comm
from megapp import parallel_state as ps
from megapp.distributed import DistributedDataParallel, finalize_model_grads
from megapp.models import build_gpt_chunks
from megapp.optimizer import Optimizer
from megapp.testing import distributed
from megapp.training import TrainGroups, train_step
from tests.support import SEED, global_batch, gpt_config
from tests.support import gpt_forward_step as forward_step


def _chunks(tp, pp, **config):
    ps.initialize_model_parallel(tp, pp)
    groups = TrainGroups.from_parallel_state()
    config = gpt_config(tensor_model_parallel_size=tp, num_layers=4, **config)
    chunks = build_gpt_chunks(
        config, pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=pp, tp_group=groups.tp
    )
    return [DistributedDataParallel(c, dp_group=groups.dp, bucket_size=2000) for c in chunks]


def _grad_norm(chunks, optimizer) -> float:
    groups = TrainGroups.from_parallel_state()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    batch = global_batch(0, dp)
    mine = batch[dp_rank * len(batch) // dp : (dp_rank + 1) * len(batch) // dp]
    result = train_step(
        forward_step, iter(mine), chunks, optimizer, num_microbatches=len(mine), groups=groups
    )
    return result.grad_norm


@pytest.mark.slow  # two GPT train steps under tp 2 × pp 2; the refusals below stay fast
@distributed(world_size=4, timeout=240)
def test_the_optimizer_takes_the_layouts_groups():
    with torch.random.fork_rng():
        chunks = _chunks(2, 2, sequence_parallel=True)
        explicit = Optimizer(
            chunks,
            lr=1e-3,
            tp_group=ps.get_tensor_model_parallel_group(),
            norm_group=ps.get_model_parallel_group(),
        )
        expected = _grad_norm(chunks, explicit)
    ps.destroy_model_parallel()
    chunks = _chunks(2, 2, sequence_parallel=True)
    norm = _grad_norm(chunks, Optimizer(chunks, lr=1e-3))  # no groups given
    everyone = [None] * 4
    dist.all_gather_object(everyone, norm)
    assert norm == expected and len(set(everyone)) == 1, everyone
    ps.destroy_model_parallel()


@distributed(world_size=4, timeout=240)
def test_groups_that_contradict_the_layout_are_refused():
    chunks = _chunks(2, 1)  # tp 2 × dp 2: the norm group is the 2 ranks of a tp pair
    with pytest.raises(ValueError, match="norm_group has 4 ranks, but this layout's model-par"):
        Optimizer(chunks, lr=1e-3, norm_group=dist.group.WORLD)
    with pytest.raises(ValueError, match="tp_group has 4 ranks, but this layout's tensor-par"):
        Optimizer(chunks, lr=1e-3, tp_group=dist.group.WORLD)
    with pytest.raises(ValueError, match=r"groups.dp_cp has 1 ranks but the model chunk is rep"):
        train_step(forward_step, iter([]), chunks, Optimizer(chunks, lr=1e-3),
                   num_microbatches=1, groups=TrainGroups())  # fmt: skip
    ps.destroy_model_parallel()


@distributed(world_size=4, timeout=240)
def test_without_a_layout_a_multi_rank_job_must_name_its_groups():
    """tp 2 × pp 2 built by hand, with no megapp.parallel_state layout."""
    rank = dist.get_rank()
    tp_groups = [comm.new_group(r, "tensor-parallel") for r in ([0, 1], [2, 3])]
    alone = [comm.new_group([r], "data-parallel") for r in range(4)]
    tp = tp_groups[rank // 2]
    config = gpt_config(tensor_model_parallel_size=2, sequence_parallel=True, num_layers=4)
    (chunk,) = build_gpt_chunks(config, pp_rank=rank // 2, pp_size=2, tp_group=tp, seed=SEED)
    with pytest.raises(ValueError, match=r"DistributedDataParallel needs dp_group .* 4 ranks"):
        DistributedDataParallel(chunk)
    chunks = [DistributedDataParallel(chunk, dp_group=alone[rank])]
    with pytest.raises(ValueError, match=r"Optimizer needs norm_group .* job of 4 ranks"):
        Optimizer(chunks, lr=1e-3)
    Optimizer(chunks, lr=1e-3, tp_group=tp, norm_group=dist.group.WORLD)
    with pytest.raises(ValueError, match="sequence parallel but no tp_group was given"):
        finalize_model_grads(chunks)
    # pp 2: every rank holds the first or the last stage, so a copy of the tied embedding
    with pytest.raises(ValueError, match="tied across pipeline stages but no embedding_group"):
        finalize_model_grads(chunks, tp_group=tp)
