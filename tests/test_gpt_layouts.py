"""GPTModel trained under many (dp, tp, pp, vpp) layouts against the single-process run.

Each case builds the model from one seed under its layout, runs three training
steps (train_step: pipeline schedule, data-parallel buckets, finalize, clipped
AdamW) and holds them to the same three steps of the single-process model with
plain torch AdamW and clip_grad_norm_:

- step 1: loss, gradient norm and every gathered (clipped) gradient;
- every step: the loss; at the end: every gathered parameter.

Everything is fp32; layouts sum the same terms in other orders (tensor-parallel
partial matmuls, microbatch and data-parallel accumulation), which moves
results by a few ulps per op; after the Adam steps (whose update divides by
sqrt(v)) that stays below 1e-4 relative, so the tolerances are 1e-4 / 1e-6.
Parameters are compared with atol 1e-4, 1/100 of one Adam step (lr 1e-2):
Adam moves every element by about lr whatever its gradient's size, so where a
gradient is round-off (the key biases' true gradient is zero: softmax ignores
a shift shared by all keys) or nearly cancels, a few ulps of difference in the
gradient become up to a few 1e-5 in the parameter. A misrouted or missing
gradient moves parameters by a whole step and still fails.
"""

from __future__ import annotations

import pytest

from megapp.testing import distributed
from tests.support import check_against_reference, train_layout

LAYOUTS = [
    # (world, tp, pp, vpp, config)
    (4, 2, 2, None, {}),
    (4, 2, 2, None, {"sequence_parallel": True, "recompute_granularity": "selective"}),
    (4, 1, 2, 2, {"share_embeddings_and_output_weights": False}),
    (
        4,
        1,
        2,
        2,
        {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
            "position_embedding_type": "rope",
        },
    ),
    (4, 1, 4, 2, {"normalization": "RMSNorm", "activation": "swiglu"}),
    (4, 4, 1, None, {"sequence_parallel": True, "position_embedding_type": "rope"}),
    (
        8,
        2,
        2,
        None,
        {
            "sequence_parallel": True,
            "recompute_granularity": "full",
            "recompute_method": "block",
            "recompute_num_layers": 1,
        },
    ),
    (8, 4, 2, None, {"sequence_parallel": True, "share_embeddings_and_output_weights": False}),
    (
        4,
        2,
        2,
        None,
        {
            "sequence_parallel": True,
            "tp_comm_overlap": True,
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
            "activation": "swiglu",
        },
    ),
]


# slow: tp, pp, vpp, dp and sequence parallelism each stay in the fast tier through the
# ZeRO-3 and distributed-optimizer cases below and test_gpt_schedules' looped-bfs case
@pytest.mark.slow
@pytest.mark.parametrize("world_size, tp, pp, vpp, config", LAYOUTS)
@distributed(timeout=240)
def test_training_matches_single_process(world_size, tp, pp, vpp, config):
    chunks, losses, norms, first_grads = train_layout(tp, pp, vpp, **config)
    check_against_reference(chunks, losses, norms, first_grads, config)


@pytest.mark.parametrize(
    "world_size, tp, pp, vpp",
    [
        (4, 1, 1, None),  # fast: the distributed optimizer (ZeRO-1) under dp 4
        pytest.param(8, 2, 2, None, marks=pytest.mark.slow),
    ],
)
@distributed(timeout=240)
def test_distributed_optimizer_matches_single_process(world_size, tp, pp, vpp):
    chunks, losses, norms, first_grads = train_layout(tp, pp, vpp, distributed_optimizer=True)
    check_against_reference(chunks, losses, norms, first_grads, {})


@pytest.mark.parametrize("world_size, tp, pp, vpp", [(4, 1, 2, None)])
@distributed(timeout=240)
def test_reducing_after_the_backward_matches_single_process(world_size, tp, pp, vpp):
    """``--no-overlap-grad-reduce``: every bucket, the tied embedding's late one included,
    reduced once the last backward is over (dp 2 × pp 2, ZeRO-1)."""
    chunks, losses, norms, first_grads = train_layout(
        tp, pp, vpp, distributed_optimizer=True, overlap_grad_reduce=False
    )
    check_against_reference(chunks, losses, norms, first_grads, {})


# ZeRO-2: gradients reduce-scattered every microbatch into each rank's slice. Layouts with
# late buckets (sequence parallelism; the tied embedding across stages) and recompute.
ZERO2_LAYOUTS = [
    (4, 2, 1, None, {"sequence_parallel": True}),
    (8, 1, 2, 2, {"recompute_granularity": "selective"}),
    (8, 2, 2, None, {"sequence_parallel": True, "activation": "swiglu"}),
]


# slow: ZeRO-2 stays in the fast tier through test_pipeline_split_backward's
# test_data_parallel_reduces_each_gradient_once[parallel-2]
@pytest.mark.slow
@pytest.mark.parametrize("world_size, tp, pp, vpp, config", ZERO2_LAYOUTS)
@distributed(timeout=240)
def test_zero2_matches_single_process(world_size, tp, pp, vpp, config):
    chunks, losses, norms, first_grads = train_layout(tp, pp, vpp, zero_stage=2, **config)
    for chunk in chunks:  # this rank's slice of every bucket, and the late buckets whole
        buckets = chunk.buffer.buckets
        slices = sum((b.end - b.start) // chunk.dp_size for b in buckets)
        late = sum(b.end - b.start for b in buckets if b.late)
        assert chunk.grad_bytes() == 4 * (slices + late)
        assert slices + late < buckets[-1].end  # less than ZeRO-1's whole buffer
    check_against_reference(chunks, losses, norms, first_grads, config)


# ZeRO-3: weights sharded too, each layer gathered for its forward and again for its
# backward (also inside recompute), the rest of a chunk around the chunk's forward.
ZERO3_LAYOUTS = [
    # fast: ZeRO-3 with tp 2, dp 2 and sequence parallelism
    (4, 2, 1, None, {"sequence_parallel": True}),
    pytest.param(
        8,
        1,
        2,
        2,
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
        marks=pytest.mark.slow,
    ),
    pytest.param(
        8,
        2,
        2,
        None,
        {"sequence_parallel": True, "share_embeddings_and_output_weights": False},
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize("world_size, tp, pp, vpp, config", ZERO3_LAYOUTS)
@distributed(timeout=240)
def test_zero3_matches_single_process(world_size, tp, pp, vpp, config):
    chunks, losses, norms, first_grads = train_layout(tp, pp, vpp, zero_stage=3, **config)
    for chunk in chunks:  # between steps only this rank's slice of the weights is held
        slices = sum((b.end - b.start) // chunk.dp_size for b in chunk.buffer.buckets)
        assert chunk.sharded_params.weight_bytes() == 4 * slices
    check_against_reference(chunks, losses, norms, first_grads, config)
