"""GPTModel trained under many (dp, tp, pp, vpp) layouts against the single-process run.

Each case builds the model from one seed under its layout, runs five training
steps (train_step: pipeline schedule, data-parallel buckets, finalize, clipped
AdamW) and holds them to the same five steps of the single-process model with
plain torch AdamW and clip_grad_norm_:

- step 1: loss, gradient norm and every gathered (clipped) gradient;
- every step: the loss; at the end: every gathered parameter.

Everything is fp32; layouts sum the same terms in other orders (tensor-parallel
partial matmuls, microbatch and data-parallel accumulation), which moves
results by a few ulps per op; after five Adam steps (whose update divides by
sqrt(v)) that stays below 1e-4 relative, so the tolerances are 1e-4 / 1e-6.
Parameters are compared with atol 1e-4, 1/100 of one Adam step (lr 1e-2):
Adam moves every element by about lr whatever its gradient's size, so where a
gradient is round-off (the key biases' true gradient is zero: softmax ignores
a shift shared by all keys) or nearly cancels, a few ulps of difference in the
gradient become up to a few 1e-5 in the parameter. A misrouted or missing
gradient moves parameters by a whole step and still fails.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from megapp import parallel_state as ps
from megapp.testing import distributed
from megapp.training import train_step
from megapp.training.flag_groups import OptimizerArgs
from megapp.training.setup import build_training_setup
from tests.support import (
    SEED,
    VOCAB,
    full_tensor,
    global_batch,
    gpt_config,
    masked_mean,
    reference_name,
    reference_run,
)

STEPS, LR, WD, CLIP = 5, 1e-2, 0.1, 0.5
TOL = dict(rtol=1e-4, atol=1e-6)
PARAM_TOL = dict(rtol=1e-4, atol=1e-4)


def forward_step(iterator, chunk, inputs):
    tokens, labels, mask = next(iterator)
    model = chunk.module
    kwargs = {"labels": labels} if model.post_process else {}
    if model.pre_process:
        output = chunk(input_ids=tokens, **kwargs)
    else:
        output = chunk(hidden_states=inputs[0], **kwargs)
    return output, (lambda per_token: masked_mean(per_token, mask))


def train_layout(
    tp,
    pp,
    vpp,
    *,
    distributed_optimizer=False,
    zero_stage=0,
    bucket_size=2000,
    schedule=None,
    **config,
):
    """Train STEPS steps under the layout (and pipeline ``schedule``, a name; default 1F1B
    or interleaved); return (chunks, losses, grad norms, step-1 grads)."""
    ps.initialize_model_parallel(tp, pp, vpp)
    setup = build_training_setup(
        gpt_config(tensor_model_parallel_size=tp, **config),
        OptimizerArgs(
            lr=LR, weight_decay=WD, clip_grad=CLIP, lr_decay_style="constant", lr_decay_iters=STEPS
        ),
        bucket_size=bucket_size,
        zero_stage=max(zero_stage, int(distributed_optimizer)),
        seed=SEED,
        schedule=schedule,
    )
    chunks, optimizer, groups = setup.chunks, setup.optimizer, setup.groups
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    losses, norms, first_grads = [], [], None
    for step in range(STEPS):
        batch = global_batch(step, dp)
        mine = batch[dp_rank * len(batch) // dp : (dp_rank + 1) * len(batch) // dp]
        result = train_step(
            forward_step,
            [iter(mine) for _ in chunks],
            chunks,
            optimizer,
            num_microbatches=len(mine),
            groups=groups,
            schedule=schedule,
        )
        assert not result.skipped
        losses.append(result.loss)
        norms.append(result.grad_norm)
        if first_grads is None:  # under the distributed optimizer too: the slices gathered
            first_grads = _gathered(chunks, lambda c, p: c.reduced_grad(p), groups.tp)
    return chunks, losses, norms, first_grads


def _gathered(chunks, what, tp_group) -> dict[str, torch.Tensor]:
    out = {}
    for chunk in chunks:
        model = chunk.module
        for name, p in model.named_parameters():
            ref = reference_name(model, name)
            vocab = VOCAB if ref in ("embedding.word_embeddings.weight", "output_weight") else None
            out[ref] = full_tensor(what(chunk, p).detach().clone(), p, tp_group, vocab)
    return out


def check_against_reference(chunks, losses, norms, first_grads, config_kw):
    dp = ps.get_data_parallel_world_size()
    single = {k: v for k, v in config_kw.items() if k != "sequence_parallel"}
    reference, ref_losses, ref_norms, ref_grads = reference_run(
        gpt_config(**single), STEPS, dp, LR, WD, CLIP
    )
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), **TOL)
    if first_grads is not None:
        for name, grad in first_grads.items():
            torch.testing.assert_close(
                grad, ref_grads[name], **TOL, msg=lambda m, n=name: f"grad of {n}: {m}"
            )
    ref_params = dict(reference.named_parameters())
    with contextlib.ExitStack() as stack:  # ZeRO-3 keeps slices: see the weights whole
        for chunk in chunks:
            stack.enter_context(chunk.full_weights())
        params = _gathered(chunks, lambda c, p: p.data, ps.get_tensor_model_parallel_group())
    for name, value in params.items():
        torch.testing.assert_close(
            value, ref_params[name].detach(), **PARAM_TOL, msg=lambda m, n=name: f"{n}: {m}"
        )


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
