"""PipeDream and PipeDream-2BW on real gloo processes against single-process runs of the
same update rules.

The reference holds the whole model, and for every optimizer step takes the gradient of
each of its microbatches at the weights version each stage's rule gives, then steps
every stage: PipeDream's stage ``s`` runs microbatch ``g`` on its weights after
``max(0, g - (p - 1 - s))`` steps (``max(0, g - (p - 1))`` on every stage with vertical
sync) and steps after every microbatch; 2BW runs iteration ``t`` on the weights of step
``t - 1`` (step 0's for the first) and steps once per iteration. The rules are written
here from their definitions, not read from the schedules. Everything is float64.
"""

import pytest
import torch
from torch import nn
from torch.func import functional_call

from megapp import parallel_state as ps
from megapp.pipeline_parallel import (
    PipelineHooks,
    WeightStash,
    build_schedule,
    forward_backward,
    held_versions,
    one_f_one_b,
    stash_profile,
)
from megapp.pipeline_parallel.partition import split_layers
from megapp.testing import distributed
from megapp.training.async_step import train_run
from megapp.training.flag_groups import OptimizerArgs, PrecisionArgs
from megapp.training.live_memory import LiveTensorMemory
from megapp.training.setup import build_training_setup
from tests.support import Block, gpt_config
from tests.support import block_forward_step as forward_step

HIDDEN, BATCH, SEQ = 8, 3, 5
TOL = {"rtol": 1e-12, "atol": 1e-12}


def _model(num_layers: int, hidden: int = HIDDEN) -> nn.ModuleList:
    torch.manual_seed(1234)
    return nn.ModuleList(Block(hidden) for _ in range(num_layers))


def _microbatches(n: int, hidden: int = HIDDEN, seq: int = SEQ):
    g = torch.Generator().manual_seed(7)
    return [
        (
            torch.randn(seq, BATCH, hidden, generator=g, dtype=torch.float64),
            torch.randn(seq, BATCH, hidden, generator=g, dtype=torch.float64),
        )
        for _ in range(n)
    ]


def _optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def version_rule(kind: str, p: int, m: int, runs: tuple[int, ...]):
    """``(stage, microbatch) -> version`` of the reference, from each rule's definition.
    PipeDream's runs end with a flush, so each starts afresh on the weights of every
    step so far; 2BW's delay spans runs."""
    starts = [m * sum(runs[:k]) for k in range(len(runs))]

    def start(g: int) -> int:
        return max(s for s in starts if s <= g)

    if kind == "pipedream":
        return lambda s, g: start(g) + max(0, g - start(g) - (p - 1 - s))
    if kind == "pipedream-vsync":
        return lambda s, g: start(g) + max(0, g - start(g) - (p - 1))
    return lambda s, g: max(0, g // m - 1)


def reference(layers, batches, p: int, kind: str, m: int, runs: tuple[int, ...]):
    """Per-microbatch losses and every stage's final weights under ``kind``'s rule."""
    stages = [nn.Sequential(*(layers[i] for i in r)) for r in split_layers(len(layers), p)]
    optimizers = [_optimizer(s.parameters()) for s in stages]
    history = [{0: {k: t.detach().clone() for k, t in s.named_parameters()}} for s in stages]
    version = version_rule(kind, p, m, runs)
    per_step = 1 if kind.startswith("pipedream") and kind != "pipedream-2bw" else m
    losses = []
    for first in range(0, len(batches), per_step):
        group = range(first, first + per_step)
        grads = [None] * p
        for g in group:
            x, target = batches[g]
            leaves = []
            for s, stage in enumerate(stages):
                weights = {
                    k: t.clone().requires_grad_() for k, t in history[s][version(s, g)].items()
                }
                leaves.append(weights)
                x = functional_call(stage, weights, (x,))
            loss = nn.functional.mse_loss(x, target)
            losses.append(loss.detach())
            (loss / per_step).backward()
            for s in range(p):
                got = [w.grad for w in leaves[s].values()]
                grads[s] = (
                    got if grads[s] is None else [a + b for a, b in zip(grads[s], got, strict=True)]
                )
        for s, stage in enumerate(stages):
            for param, grad in zip(stage.parameters(), grads[s], strict=True):
                param.grad = grad
            optimizers[s].step()
            step = len(history[s])
            history[s][step] = {k: t.detach().clone() for k, t in stage.named_parameters()}
    return torch.stack(losses), stages


def _run_pipeline(kind: str, p: int, m: int, runs: tuple[int, ...], num_layers: int):
    """Run ``runs`` (iterations per call) of ``kind``; return losses, chunk, stage, results."""
    ps.initialize_model_parallel(1, p)
    group, stage = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_rank()
    layers = _model(num_layers)
    chunk = nn.Sequential(*(layers[i] for i in split_layers(num_layers, p)[stage]))
    optimizer = _optimizer(chunk.parameters())
    steps = []

    def update(step: int) -> None:
        steps.append(step)
        optimizer.step()
        optimizer.zero_grad()

    name, vsync = ("pipedream", True) if kind == "pipedream-vsync" else (kind, False)
    per_microbatch = m * sum(runs)
    iterator = iter(_microbatches(per_microbatch))
    stash, losses, results = WeightStash(), [], []
    for iterations in runs:
        schedule = build_schedule(name, p, m, 1, iterations=iterations, vertical_sync=vsync)
        result = forward_backward(
            forward_step,
            iterator,
            [chunk],
            m * iterations,
            schedule=schedule,
            pp_group=group,
            hooks=PipelineHooks(update=update),
            weight_stash=stash,
        )
        losses += result.microbatch_losses
        results.append((schedule, result))
    return losses, chunk, stage, results, steps


SLOW = pytest.mark.slow
CASES = [
    # fast: one case of each update rule (pipedream, pipedream-vsync, pipedream-2bw)
    ("pipedream", 2, 2, (3,)),
    pytest.param("pipedream", 4, 4, (2,), marks=SLOW),
    pytest.param("pipedream", 4, 2, (2, 3), marks=SLOW),
    ("pipedream-vsync", 4, 3, (3,)),
    ("pipedream-2bw", 2, 2, (2, 3)),
    pytest.param("pipedream-2bw", 4, 3, (3, 2), marks=SLOW),
    pytest.param("pipedream-2bw", 4, 4, (1, 1, 2), marks=SLOW),
]


@pytest.mark.parametrize("kind, p, m, runs", CASES)
@distributed(world_size=4)
def test_asynchronous_pipeline_equals_its_update_rule(kind, p, m, runs):
    num_layers = 2 * p
    losses, chunk, stage, results, steps = _run_pipeline(kind, p, m, runs, num_layers)
    batches = _microbatches(m * sum(runs))
    want_losses, stages = reference(_model(num_layers), batches, p, kind, m, runs)
    if stage == p - 1:
        torch.testing.assert_close(torch.stack(losses), want_losses, **TOL)
    for got, want in zip(chunk.parameters(), stages[stage].parameters(), strict=True):
        torch.testing.assert_close(got, want, **TOL)
    per_step = m if kind == "pipedream-2bw" else 1
    assert steps == [k for n in runs for k in range(n * m // per_step)]
    # the versions held are the schedule's count (2BW's first run holds its version -1
    # as version 0, so it is left out)
    for schedule, result in results[1:] if kind == "pipedream-2bw" else results:
        assert result.weight_versions == held_versions(schedule)[stage]


@pytest.mark.slow  # three runs each with every allocation tracked
@pytest.mark.parametrize("kind", ["pipedream", "pipedream-2bw"])
@distributed(world_size=4)
def test_stashed_versions_hold_their_bytes(kind):
    """Measured peak tensor bytes of a run against the same 1F1B order with no steps: the
    difference is the stashed copies of the stage's weights, as many as the schedule says."""
    p, m, hidden = 4, 4, 128
    ps.initialize_model_parallel(1, p)
    group, stage = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_rank()
    layers = _model(2 * p, hidden)
    chunk = nn.Sequential(*(layers[i] for i in split_layers(2 * p, p)[stage]))
    optimizer = torch.optim.SGD(chunk.parameters(), lr=0.01)  # no state of its own

    def update(step: int) -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # gradients stay allocated, as in 1F1B

    batches = _microbatches(2 * m, hidden, seq=2)
    stash, peaks = WeightStash(), {}
    for name in ("1f1b", "warm-up", kind):  # 2BW's stash then carries a version -1
        if name == "1f1b":
            schedule, hooks = one_f_one_b(p, 2 * m), None
        else:
            schedule, hooks = build_schedule(kind, p, m, iterations=2), PipelineHooks(update=update)
        for param in chunk.parameters():
            param.grad = torch.zeros_like(param)
        carried = sum(t.numel() * t.element_size() for c in stash.carried or [] for t in c)
        with LiveTensorMemory() as memory:
            result = forward_backward(
                forward_step,
                iter(batches),
                [chunk],
                2 * m,
                schedule=schedule,
                pp_group=group,
                hooks=hooks,
                weight_stash=stash,
            )
        peaks[name] = memory.peak - memory.start + carried  # a kept copy counts, too
    weights = sum(t.numel() * t.element_size() for t in chunk.parameters())
    versions, copies = stash_profile(schedule, stage)
    assert (result.weight_versions, result.weight_copies) == (versions, copies)
    assert versions == (p - stage if kind == "pipedream" else 2)
    extra = peaks[kind] - peaks["1f1b"]
    assert abs(extra - copies * weights) <= 0.05 * weights, (extra, copies, weights)


def _gpt_setup(clip_grad=0.0, per_stage_steps=True, precision=None, zero_stage=0, **config):
    """This rank's GPT chunk and optimizer over the current layout, for per-stage steps."""
    return build_training_setup(
        gpt_config(num_layers=4, **config),
        OptimizerArgs(lr=1e-3, clip_grad=clip_grad, lr_decay_iters=1),
        precision=precision,
        zero_stage=zero_stage,
        per_stage_steps=per_stage_steps,
    )


@distributed(world_size=4)
def test_per_stage_steps_refuse_on_every_rank_what_the_flags_refuse():
    """Through the Python API as through pretrain_gpt.py's flags: every stage of the
    pipeline, the middle ones too (which hold no tied copy), refuses before training."""
    ps.initialize_model_parallel(1, 4)
    untied = {"share_embeddings_and_output_weights": False}
    refusals = [
        ({"clip_grad": 1.0, **untied}, r"clipping by the global gradient norm \(clip_grad\)"),
        ({}, r"tied .* \(share_embeddings_and_output_weights\)"),
        ({"precision": PrecisionArgs(fp16=True), **untied}, "fp16 loss scaling"),
    ]
    for kwargs, refused in refusals:
        with pytest.raises(ValueError, match=rf"Optimizer\(per_stage=True\) .*{refused}"):
            _gpt_setup(**kwargs)
    # the same settings step the whole model at once: accepted
    _gpt_setup(clip_grad=1.0, per_stage_steps=False)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 2)  # dp 2: ZeRO shards over it
    with pytest.raises(ValueError, match=r"sharded optimizer \(zero_stage"):
        _gpt_setup(zero_stage=1, **untied)
    # an asynchronous run needs an optimizer that steps each stage on its own
    setup = _gpt_setup(per_stage_steps=False, **untied)
    with pytest.raises(ValueError, match="build the optimizer with per_stage=True"):
        train_run(
            lambda iterator, chunk, inputs: None,
            iter([]),
            setup.chunks,
            setup.optimizer,
            schedule=build_schedule("pipedream-2bw", 2, 2),
            iterations=1,
            groups=setup.groups,
            stash=WeightStash(),
        )
    # with one stage the stage's norm is the global one: clipping stays
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1)
    _gpt_setup(clip_grad=1.0)
