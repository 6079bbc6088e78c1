"""GPTModel trained under every pipeline schedule against the single-process run.

The same clipped AdamW steps as ``test_gpt_layouts`` (whose tolerances and
reasons apply), with the split-backward and V-shaped schedules, tensor and sequence
parallelism, recompute and the distributed optimizer. A V puts the first and last
stage on rank 0: the tied embedding's two copies are summed there. The chunks are built
for the schedule's placement, and uneven first/last pipeline stages (Megatron's
``--decoder-first/last-pipeline-num-layers``) train the same model, with virtual stages
too.
"""

from __future__ import annotations

import dataclasses

import pytest

from megapp import parallel_state as ps
from megapp.models import build_gpt_chunks
from megapp.pipeline_parallel import build_schedule, forward_backward
from megapp.testing import distributed
from tests.support import SEED, check_against_reference, gpt_config, train_layout

FULL_RECOMPUTE = {
    "recompute_granularity": "full",
    "recompute_method": "uniform",
    "recompute_num_layers": 1,
}
SELECTIVE = {"recompute_granularity": "selective"}
SLOW = pytest.mark.slow
CASES = [
    # (world, tp, pp, vpp, schedule, distributed optimizer, config)
    # slow: the zero-bubble and V schedules stay in the fast tier on the engine's blocks
    # (test_pipeline_split_backward)
    pytest.param(
        8,
        2,
        2,
        None,
        "zb-h1",
        True,
        {"sequence_parallel": True, "recompute_granularity": "selective"},
        marks=SLOW,
    ),
    pytest.param(
        8, 2, 2, 2, "zb-v", True, {"sequence_parallel": True, **FULL_RECOMPUTE}, marks=SLOW
    ),
    pytest.param(4, 1, 4, 2, "zb-v", False, {"position_embedding_type": "rope"}, marks=SLOW),
    pytest.param(8, 1, 4, None, "zb-h2", True, {"activation": "swiglu"}, marks=SLOW),
    pytest.param(
        4,
        1,
        2,
        2,
        "dualpipev",
        True,
        {"share_embeddings_and_output_weights": False},
        marks=SLOW,
    ),
    pytest.param(4, 1, 4, 2, "zb-h1", False, SELECTIVE, marks=SLOW),
    # fast: looped-bfs, the only in-world check of that schedule (pp 2, vpp 2, dp 2)
    (4, 1, 2, 2, "looped-bfs", False, {}),
]


@pytest.mark.parametrize("world_size, tp, pp, vpp, schedule, distopt, config", CASES)
@distributed(timeout=240)
def test_schedule_matches_single_process(world_size, tp, pp, vpp, schedule, distopt, config):
    chunks, losses, norms, first_grads = train_layout(
        tp, pp, vpp, schedule=schedule, distributed_optimizer=distopt, **config
    )
    check_against_reference(chunks, losses, norms, first_grads, config)


UNEVEN_FIRST_LAST = {
    "num_layers_in_first_pipeline_stage": 1,
    "num_layers_in_last_pipeline_stage": 3,
}
UNEVEN = [
    # (world, tp, pp, vpp, schedule, config): layers per virtual stage in the comments
    (4, 1, 4, None, "1f1b", UNEVEN_FIRST_LAST),  # 1 2 2 3
    (
        4,
        1,
        4,
        2,
        "interleaved-1f1b",
        {
            "num_layers": 12,
            "num_layers_in_first_pipeline_stage": 2,
            "num_layers_in_last_pipeline_stage": 2,
        },
    ),  # 1 2 2 1 1 2 2 1
    (4, 1, 2, 2, "zb-v", {"num_layers_in_first_pipeline_stage": 2}),  # 1 3 3 1: rank 0 holds 2
]


# slow: uneven stages stay in the fast tier on the engine's blocks
# (test_pipeline_engine's test_uneven_stages_and_single_stage)
@pytest.mark.slow
@pytest.mark.parametrize("world_size, tp, pp, vpp, schedule, config", UNEVEN)
@distributed(timeout=240)
def test_uneven_first_and_last_stages_match_single_process(
    world_size, tp, pp, vpp, schedule, config
):
    chunks, losses, norms, first_grads = train_layout(tp, pp, vpp, schedule=schedule, **config)
    layers = [len(chunk.module.decoder.layers) for chunk in chunks]
    first = config["num_layers_in_first_pipeline_stage"]
    if ps.get_pipeline_model_parallel_rank() == 0:
        assert layers == [first // (vpp or 1)] * len(chunks)
    check_against_reference(chunks, losses, norms, first_grads, config)


COUNTED = {
    "account_for_embedding_in_pipeline_split": True,
    "account_for_loss_in_pipeline_split": True,
}
EMBEDDING_AND_LOSS = [
    # (world, tp, pp, vpp, schedule, config, layers of every virtual stage)
    # fast: the only in-world check of chunks that hold no layer
    (4, 1, 2, 2, "interleaved-1f1b", {"num_layers": 2, **COUNTED}, [0, 1, 1, 0]),
    # a V places virtual stages 0 and 3 on rank 0: both its chunks hold no layer
    pytest.param(4, 1, 2, 2, "dualpipev", {"num_layers": 2, **COUNTED}, [0, 1, 1, 0], marks=SLOW),
    pytest.param(4, 1, 2, 2, "zb-v", {"num_layers": 2, **COUNTED}, [0, 1, 1, 0], marks=SLOW),
    pytest.param(
        4,
        1,
        4,
        None,
        "1f1b",
        {"num_layers": 7, "account_for_loss_in_pipeline_split": True},
        [2, 2, 2, 1],
        marks=SLOW,
    ),
]


@pytest.mark.parametrize("world_size, tp, pp, vpp, schedule, config, stages", EMBEDDING_AND_LOSS)
@distributed(timeout=240)
def test_embedding_and_loss_counted_in_the_split_match_single_process(
    world_size, tp, pp, vpp, schedule, config, stages
):
    """Megatron's --account-for-embedding/loss-in-pipeline-split: the first (last) virtual
    stage holds one layer fewer, none where the stages hold one each, so a chunk may run
    only the embedding, or only the final norm, the output layer and the loss; the model
    trains as the single process does."""
    chunks, losses, norms, first_grads = train_layout(tp, pp, vpp, schedule=schedule, **config)
    placement = build_schedule(schedule, pp, 4, vpp or 1).placement
    rank = ps.get_pipeline_model_parallel_rank()
    assert [len(c.module.decoder.layers) for c in chunks] == [stages[s] for s in placement[rank]]
    check_against_reference(chunks, losses, norms, first_grads, config)


def _never_called(iterator, chunk, inputs):
    raise AssertionError("no microbatch may run on chunks built for another placement")


@pytest.mark.slow  # starts a world of 3 ranks, which no fast test uses
@distributed(world_size=3)
def test_chunks_built_for_another_placement_fail_on_every_rank_before_sending():
    """zb-v on chunks built for the looped placement: every rank refuses before a message
    goes out, rank 1 too, whose chunks (virtual stages 1 and 4) sit where the V wants
    them; built for the schedule, each chunk is the stage the V places there."""
    ps.initialize_model_parallel(1, 3, 2)
    rank, group = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_group()
    config = gpt_config(num_layers=6)
    looped = build_gpt_chunks(config, pp_rank=rank, pp_size=3, vpp_size=2, seed=SEED)
    assert [c.pipeline_stage for c in looped] == [rank, 3 + rank]
    with pytest.raises(ValueError, match="build the chunks for the schedule"):
        forward_backward(_never_called, None, looped, 6, schedule="zb-v", pp_group=group)
    v = build_gpt_chunks(config, pp_rank=rank, pp_size=3, vpp_size=2, seed=SEED, schedule="zb-v")
    assert [c.pipeline_stage for c in v] == [rank, 5 - rank]
    assert (v[0].pre_process, v[1].post_process) == (rank == 0, rank == 0)


def test_build_gpt_chunks_takes_its_stages_from_the_schedule():
    config = gpt_config()  # 8 layers
    zb_v = build_schedule("zb-v", 2, 4, 2)
    for schedule in ("zb-v", zb_v):
        chunks = build_gpt_chunks(config, pp_rank=1, pp_size=2, vpp_size=2, schedule=schedule)
        assert [c.pipeline_stage for c in chunks] == [1, 2]
        assert chunks[0].pipeline_placement == zb_v.placement
    with pytest.raises(ValueError, match="give schedule= or stages=, not both"):
        build_gpt_chunks(config, pp_size=2, vpp_size=2, schedule="zb-v", stages=(0, 3))
    with pytest.raises(ValueError, match="zb-v is for 2 pipeline stages × 2 chunks, the model"):
        build_gpt_chunks(config, pp_size=4, vpp_size=2, schedule=zb_v)
    with pytest.raises(ValueError, match="zb-v places two model chunks on every rank"):
        build_gpt_chunks(config, pp_size=2, schedule="zb-v")
    uneven = dataclasses.replace(config, num_layers_in_first_pipeline_stage=2)
    with pytest.raises(ValueError, match=r"\(the whole placement\) instead of stages="):
        build_gpt_chunks(uneven, pp_size=2, vpp_size=2, stages=(0, 3))
    # one stage holds every layer: a first/last count does not apply
    (whole,) = build_gpt_chunks(uneven)
    assert len(whole.decoder.layers) == 8
