"""The pipeline engine on real gloo processes against the single-process model.

Every case runs in float64 with the same weights and microbatches as the
reference; the only difference is the order in which per-microbatch gradient
contributions are summed, so 1e-12 relative is ample and still catches any
lost, doubled or misrouted microbatch.
"""

import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megapp import parallel_state as ps
from megapp.pipeline_parallel import (
    Op,
    PipelineHooks,
    TensorSpec,
    build_schedule,
    forward_backward,
    simulate,
)
from megapp.pipeline_parallel.partition import split_layers
from megapp.testing import distributed
from tests.support import Block
from tests.support import block_forward_step as forward_step
from tests.support import block_reference_loss as reference_loss

HIDDEN, BATCH = 8, 3
TOL = {"rtol": 1e-12, "atol": 1e-12}


def _model(num_layers: int) -> nn.ModuleList:
    torch.manual_seed(1234)  # the same full model on every rank and in the reference
    return nn.ModuleList(Block(HIDDEN) for _ in range(num_layers))


def _microbatches(m: int, seq: int = 5):
    g = torch.Generator().manual_seed(99)
    return [
        (
            torch.randn(seq, BATCH, HIDDEN, generator=g, dtype=torch.float64),
            torch.randn(seq, BATCH, HIDDEN, generator=g, dtype=torch.float64),
        )
        for _ in range(m)
    ]


def _chunks_of(layers, p: int, v: int, stage: int) -> list[nn.Sequential]:
    ranges = split_layers(len(layers), p * v)
    return [nn.Sequential(*(layers[i] for i in ranges[c * p + stage])) for c in range(v)]


def _run(p: int, v: int, m: int, schedule: str, num_layers: int | None = None, **kwargs):
    """Run one iteration; return (result, this rank's chunks, stage, full-model reference copy)."""
    ps.initialize_model_parallel(1, p)
    group, stage = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_rank()
    layers = _model(num_layers or 2 * p * v)
    reference = _model(num_layers or 2 * p * v)
    batches = _microbatches(m)
    chunks = _chunks_of(layers, p, v, stage)
    iterators = [iter(batches) for _ in range(v)]
    result = forward_backward(
        forward_step, iterators, chunks, m, schedule=schedule, pp_group=group, **kwargs
    )
    return result, layers, reference, batches, stage


SLOW = pytest.mark.slow
CASES = [
    # fast: one case of each schedule (gpipe, 1f1b, interleaved-1f1b)
    pytest.param("gpipe", 2, 1, 1, marks=SLOW),
    ("gpipe", 2, 1, 3),
    pytest.param("gpipe", 4, 1, 4, marks=SLOW),
    pytest.param("1f1b", 2, 1, 1, marks=SLOW),
    pytest.param("1f1b", 2, 1, 5, marks=SLOW),
    pytest.param("1f1b", 4, 1, 2, marks=SLOW),
    ("1f1b", 4, 1, 8),
    pytest.param("interleaved-1f1b", 2, 2, 2, marks=SLOW),
    pytest.param("interleaved-1f1b", 2, 2, 6, marks=SLOW),
    ("interleaved-1f1b", 4, 2, 4),
    pytest.param("interleaved-1f1b", 4, 2, 8, marks=SLOW),
    pytest.param("interleaved-1f1b", 2, 3, 4, marks=SLOW),
]


SHAPE = [TensorSpec((5, BATCH, HIDDEN), torch.float64)]


@pytest.mark.parametrize("declared", [False, True], ids=["negotiated", "declared"])
@pytest.mark.parametrize("schedule, p, v, m", CASES)
@distributed(world_size=4)
def test_loss_and_gradients_equal_single_process(schedule, p, v, m, declared):
    shapes = SHAPE if declared else None
    result, layers, reference, batches, stage = _run(p, v, m, schedule, tensor_shapes=shapes)
    expected_loss = reference_loss(reference, batches)
    # every rank reports the iteration's loss, not only the last stage
    torch.testing.assert_close(result.loss.double(), expected_loss, rtol=1e-6, atol=0)
    if stage == p - 1:
        losses = torch.stack(result.microbatch_losses)
        torch.testing.assert_close(losses.mean(), expected_loss, **TOL)
    owned = [i for c in range(v) for i in split_layers(len(layers), p * v)[c * p + stage]]
    for i in owned:
        for (name, got), want in zip(
            layers[i].named_parameters(), reference[i].parameters(), strict=True
        ):
            torch.testing.assert_close(got.grad, want.grad, **TOL, msg=f"layer {i} {name}")
    for i in set(range(len(layers))) - set(owned):  # other stages' layers are untouched
        assert all(prm.grad is None for prm in layers[i].parameters())
    # memory follows the theory: held activations peak where the simulator says
    predicted = simulate(build_schedule(schedule, p, m, v)).peak_in_flight[stage]
    assert result.peak_in_flight == predicted


@distributed(world_size=4)
def test_tuple_outputs_and_changing_sequence_length():
    ps.initialize_model_parallel(1, 4)
    group, stage = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_rank()
    torch.manual_seed(0)
    scale = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

    def step(iterator, chunk, inputs):
        x, target = next(iterator)
        if inputs is None:  # the first stage sends (hidden, positions): a float and an int
            hidden, positions = x, torch.arange(x.shape[0])
        else:
            hidden, positions = inputs
        hidden = hidden * scale + positions[:, None, None].to(hidden.dtype)
        return (hidden, positions), lambda out: nn.functional.mse_loss(out[0], target)

    for seq in (5, 9, 2):  # shapes are negotiated afresh every iteration
        scale.grad = None
        batches = _microbatches(4, seq)
        result = forward_backward(step, iter(batches), nn.Identity(), 4, pp_group=group)
        # reference: four stages of hidden * scale + position
        ref_scale = scale.detach().clone().requires_grad_()
        losses = []
        for x, target in batches:
            h = x
            for _ in range(4):
                h = h * ref_scale + torch.arange(seq)[:, None, None].to(h.dtype)
            losses.append(nn.functional.mse_loss(h, target))
        loss = torch.stack(losses).mean()
        loss.backward()
        torch.testing.assert_close(result.loss.double(), loss.detach(), rtol=1e-6, atol=0)
        # scale's gradient is spread over the stages; their sum is the reference's
        total = scale.grad.detach().clone()
        dist.all_reduce(total, group=group)
        torch.testing.assert_close(total, ref_scale.grad, **TOL)
    assert stage in range(4)


@distributed(world_size=4)
def test_declared_shapes_and_mismatch():
    ps.initialize_model_parallel(1, 2)
    group = ps.get_pipeline_model_parallel_group()
    layers = _model(4)
    chunks = _chunks_of(layers, 2, 1, ps.get_pipeline_model_parallel_rank())
    batches = _microbatches(3)
    shape = [TensorSpec((5, BATCH, HIDDEN), torch.float64)]
    declared = forward_backward(
        forward_step, iter(batches), chunks, 3, pp_group=group, tensor_shapes=shape
    )
    reference = _model(4)
    torch.testing.assert_close(
        declared.loss.double(), reference_loss(reference, batches), rtol=1e-6, atol=0
    )
    if ps.is_pipeline_first_stage():
        wrong = [TensorSpec((7, BATCH, HIDDEN), torch.float64)]
        with pytest.raises(ValueError, match="tensor_shapes declares"):
            forward_backward(
                forward_step, iter(batches), chunks, 3, pp_group=group, tensor_shapes=wrong
            )


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved-1f1b", 2)])
@distributed(world_size=4)
def test_forward_only_matches_reference_and_keeps_no_graph(schedule, v):
    result, layers, reference, batches, _ = _run(2, v, 4, schedule, forward_only=True)
    with torch.no_grad():
        losses = []
        for x, target in batches:
            for layer in reference:
                x = layer(x)
            losses.append(nn.functional.mse_loss(x, target))
    torch.testing.assert_close(result.loss.double(), torch.stack(losses).mean(), rtol=1e-6, atol=0)
    assert result.peak_in_flight == 0
    assert all(prm.grad is None for prm in layers.parameters())


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved-1f1b", 2)])
@distributed(world_size=2)
def test_hooks_see_last_microbatch_per_chunk_and_post_backward(schedule, v):
    calls, posts = [], []
    hooks = PipelineHooks(
        before_backward=lambda chunk, last: calls.append((chunk, last)),
        post_backward=lambda: posts.append(len(calls)),
    )
    _run(2, v, 4, schedule, hooks=hooks)
    assert len(calls) == 4 * v
    for chunk in range(v):
        flags = [last for c, last in calls if c == chunk]
        assert flags == [False, False, False, True]
    assert posts == [4 * v]  # once, after every backward


@distributed(world_size=2)
def test_uneven_stages_and_single_stage():
    result, _, reference, batches, _ = _run(2, 1, 3, "1f1b", num_layers=5)
    torch.testing.assert_close(
        result.loss.double(), reference_loss(reference, batches), rtol=1e-6, atol=0
    )


def test_single_process_without_distributed():
    layers, reference = _model(3), _model(3)
    batches = _microbatches(4)
    result = forward_backward(forward_step, iter(batches), nn.Sequential(*layers), 4)
    expected = reference_loss(reference, batches)
    torch.testing.assert_close(result.loss.double(), expected, rtol=1e-6, atol=0)
    for got, want in zip(layers.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, **TOL)


def test_bad_arguments():
    with pytest.raises(ValueError, match="2 data iterators for 1 model chunks"):
        forward_backward(forward_step, [iter([]), iter([])], nn.Identity(), 2)
    with pytest.raises(ValueError, match="schedule is for p=2"):
        forward_backward(
            forward_step, iter([]), nn.Identity(), 2, schedule=build_schedule("1f1b", 2, 2)
        )
    with pytest.raises(ValueError, match="no loss function"):
        forward_backward(lambda it, chunk, inp: (torch.ones(1), None), None, nn.Identity(), 1)


@distributed(world_size=2)
def test_recorded_timeline_follows_the_schedule():
    result, *_, stage = _run(2, 2, 4, "interleaved-1f1b", record=True)
    computes = [e for e in result.events if e.kind == "compute"]
    expected = [str(a) for a in build_schedule("interleaved-1f1b", 2, 4, 2).actions[stage]]
    assert [e.name for e in computes] == expected
    assert all(e.rank == stage and e.end >= e.start for e in result.events)
    assert all(a.end <= b.start for a, b in itertools.pairwise(computes))
    assert any(e.kind == "wait" for e in result.events)


def test_sent_activation_storage_is_dropped_only_when_backward_does_not_need_it():
    from megapp.autograd.saved import SavedStorages

    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 4, dtype=torch.float64)
    saved = SavedStorages()
    with saved.recording():
        residual = x + torch.tanh(x @ w)  # AddBackward keeps nothing: droppable
        squashed = torch.tanh(x @ w)  # TanhBackward keeps its output
        view = (x @ w).view(12)  # shares storage with its base
        hidden = x @ w + 1.0
        scaled = hidden * w.sum()  # MulBackward keeps hidden: a sibling output needs it
    outputs = (residual, squashed, view, hidden, scaled)
    assert saved.droppable(outputs) == (residual, scaled)


@distributed(world_size=2)
def test_sibling_outputs_keep_what_the_other_backward_needs():
    """A stage sending (h, h * s) must keep h: the product's backward reads it."""
    ps.initialize_model_parallel(1, 2)
    group, stage = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_rank()
    torch.manual_seed(0)
    layers = _model(2)
    reference = _model(2)
    scale = nn.Parameter(torch.tensor(0.75, dtype=torch.float64))
    ref_scale = scale.detach().clone().requires_grad_()
    batches = _microbatches(3)

    def step(iterator, chunk, inputs):
        x, target = next(iterator)
        if inputs is None:
            h = layers[0](x)
            return (h, h * scale), None
        h, hs = inputs
        return layers[1](h + hs), lambda out: nn.functional.mse_loss(out, target)

    forward_backward(step, iter(batches), nn.Identity(), 3, schedule="1f1b", pp_group=group)
    losses = []
    for x, target in batches:
        h = reference[0](x)
        losses.append(nn.functional.mse_loss(reference[1](h + h * ref_scale), target))
    torch.stack(losses).mean().backward()
    if stage == 0:
        torch.testing.assert_close(scale.grad, ref_scale.grad, **TOL)
    for got, want in zip(layers[stage].parameters(), reference[stage].parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, **TOL)


@pytest.mark.parametrize("declared", [False, True], ids=["negotiated", "declared"])
@distributed(world_size=4)
def test_gloo_posts_receives_one_step_ahead(declared):
    """Every receive whose shapes are known a step early goes out a step early; activations
    with negotiated shapes wait for their headers."""
    from megapp.pipeline_parallel.messages import Op
    from megapp.pipeline_parallel.runner import StageRunner

    seen = []  # (kinds of the step's receives, whether they were already posted)
    original = StageRunner._communicate

    def spy(self, step, upcoming, delivered):
        if step.recvs:
            seen.append(({m.op for m in step.recvs}, self.early.posted is not None))
        return original(self, step, upcoming, delivered)

    StageRunner._communicate = spy
    try:
        shapes = SHAPE if declared else None
        result, _, reference, batches, _ = _run(4, 2, 8, "interleaved-1f1b", tensor_shapes=shapes)
    finally:
        StageRunner._communicate = original
    torch.testing.assert_close(
        result.loss.double(), reference_loss(reference, batches), rtol=1e-6, atol=0
    )
    early = [ahead for _, ahead in seen]
    if declared:  # a rank's first step may be one that receives: nothing precedes it
        assert all(early[1:])
    else:
        assert not any(ahead for kinds, ahead in seen if Op.FORWARD in kinds)
        gradient_only = [ahead for kinds, ahead in seen[1:] if kinds == {Op.BACKWARD}]
        assert gradient_only and all(gradient_only)


@pytest.mark.parametrize("schedule, v, m", [("1f1b", 1, 8), ("interleaved-1f1b", 2, 8)])
@distributed(world_size=4)
def test_sent_activations_are_freed_during_the_iteration(schedule, v, m):
    """A sent activation's storage goes once the plan proves it delivered, not at the end of
    the iteration: the outputs a rank holds stay within its in-flight microbatches, whatever
    m (gloo's sends cannot be polled, so this rests on the plan's proofs)."""
    from megapp.pipeline_parallel.messages import communication_plan, delivered_sends
    from megapp.pipeline_parallel.runner import StageRunner

    held = []  # after every forward: sent outputs whose storage is still there
    original = StageRunner.act

    def spy(self, action):
        original(self, action)
        if action.op is not Op.FORWARD:
            return
        pending = self.sends.pending.values()
        alive = [t for _, droppable in pending for t in droppable if t.numel() > 1]
        unposted = [msg for msg in self.compute.outbox if msg.op is Op.FORWARD]
        held.append(len(alive) + len(unposted))

    StageRunner.act = spy
    try:
        result, _, reference, batches, stage = _run(4, v, m, schedule)
    finally:
        StageRunner.act = original
    torch.testing.assert_close(
        result.loss.double(), reference_loss(reference, batches), rtol=1e-6, atol=0
    )
    plan = communication_plan(build_schedule(schedule, 4, m, v))
    proven = delivered_sends(plan)[stage]
    expected, outstanding = 0, 0  # the plan's bound: sent, not yet proven delivered
    for index, step in enumerate(plan[stage]):
        outstanding += sum(msg.op is Op.FORWARD for msg in step.sends)
        outstanding -= sum(msg.op is Op.FORWARD for msg in proven[index])
        if step.action is not None and step.action.op is Op.FORWARD:
            expected = max(expected, outstanding + 1)  # + the one just produced
    assert max(held) <= expected
    assert max(held) < m * v  # the whole iteration's outputs were held before
    assert max(held) <= simulate(build_schedule(schedule, 4, m, v)).peak_in_flight[stage]
