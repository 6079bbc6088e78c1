"""Split backward (``I`` then ``W``) on real gloo processes against the single-process model.

Zero-bubble schedules run every backward as an input-gradient action followed, later,
by a weight-gradient action. Two models cover the two mechanisms: blocks of plain
``nn.Linear`` (the graph split: ``I`` computes input gradients only) and blocks of
megapp's column/row-parallel linears (the deferred store: ``I`` computes all but the
linears' weight gradients). Float64 and 1e-12, as in test_pipeline_engine.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megapp import parallel_state as ps
from megapp.autograd.deferred import weight_grad_memory
from megapp.distributed.ddp import DistributedDataParallel
from megapp.param_attributes import shard
from megapp.pipeline_parallel import (
    CostModel,
    Op,
    PipelineHooks,
    TensorSpec,
    build_schedule,
    forward_backward,
    simulate,
)
from megapp.pipeline_parallel.compute import StageCompute, sync_actions
from megapp.pipeline_parallel.network import Rules
from megapp.pipeline_parallel.partition import split_layers
from megapp.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megapp.testing import distributed
from tests.support import block_reference_loss as reference_loss

HIDDEN, BATCH, SEQ = 8, 3, 4
# Declared: negotiated headers deadlock under some split schedules (see the report).
SHAPES = [TensorSpec((SEQ, BATCH, HIDDEN), torch.float64)]
TOL = {"rtol": 1e-12, "atol": 1e-12}
F64 = torch.float64


class PlainBlock(nn.Module):
    def __init__(self, tp_group=None, sequence_parallel=False):
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN, dtype=F64)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


class ParallelBlock(nn.Module):
    """x + Row(tanh(Column(norm(x)))): two deferred weights, the rest computed in ``I``."""

    def __init__(self, tp_group=None, sequence_parallel=False):
        super().__init__()
        self.norm = None if sequence_parallel else nn.LayerNorm(HIDDEN, dtype=F64)
        common = {"tp_group": tp_group, "sequence_parallel": sequence_parallel}
        self.fc1 = ColumnParallelLinear(HIDDEN, 2 * HIDDEN, params_dtype=F64, **common)
        self.fc2 = RowParallelLinear(
            2 * HIDDEN, HIDDEN, bias=not sequence_parallel, params_dtype=F64, **common
        )

    def forward(self, x):
        h, _ = self.fc1(x if self.norm is None else self.norm(x))
        out, _ = self.fc2(torch.tanh(h))
        return x + out


KINDS = {"plain": PlainBlock, "parallel": ParallelBlock}


def _layers(kind, n, tp_group=None, sequence_parallel=False) -> nn.ModuleList:
    torch.manual_seed(1234)  # the same full model on every rank and in the reference
    return nn.ModuleList(KINDS[kind](tp_group, sequence_parallel) for _ in range(n))


def _microbatches(m: int, seed: int = 99):
    g = torch.Generator().manual_seed(seed)
    return [
        tuple(torch.randn(SEQ, BATCH, HIDDEN, generator=g, dtype=F64) for _ in range(2))
        for _ in range(m)
    ]


def _step(tp: int, sequence_parallel: bool):
    """The forward step; with sequence parallelism each TP rank takes its sequence shard
    and its share of the loss (the TP ranks' losses sum to the microbatch's)."""
    rank = ps.get_tensor_model_parallel_rank()

    def cut(t):
        return t.chunk(tp)[rank] if sequence_parallel else t

    def step(iterator, chunk, inputs):
        x, target = next(iterator)
        h = cut(x) if inputs is None else inputs[0]
        scale = 1.0 / tp if sequence_parallel else 1.0
        return chunk(h), lambda out: nn.functional.mse_loss(out, cut(target)) * scale

    return step


def _setup(name, p, v, m, kind, tp=1, sequence_parallel=False):
    """This rank's schedule, full model, chunks (built for the stages the schedule places
    here) and microbatches."""
    ps.initialize_model_parallel(tp, p)
    stage = ps.get_pipeline_model_parallel_rank()
    tp_group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    schedule = build_schedule(name, p, m, v)
    layers = _layers(kind, 2 * p * v, tp_group, sequence_parallel)
    ranges = split_layers(len(layers), p * v)
    owned = [i for c in range(v) for i in ranges[schedule.virtual_stage(stage, c)]]
    chunks = [
        nn.Sequential(*(layers[i] for i in ranges[schedule.virtual_stage(stage, c)]))
        for c in range(v)
    ]
    return schedule, stage, layers, owned, chunks


SLOW = pytest.mark.slow
CASES = [  # (schedule, p, v, m, model); in a V, stage p-1 hands stage p over in memory
    # fast: one case of each schedule on two stages (zb-h1, zb-h2, zb-v, dualpipev)
    ("zb-h1", 2, 1, 4, "plain"),
    pytest.param("zb-h1", 4, 1, 6, "parallel", marks=SLOW),
    ("zb-h2", 2, 1, 3, "parallel"),
    pytest.param("zb-h2", 2, 2, 4, "plain", marks=SLOW),
    pytest.param("zb-h2", 4, 2, 4, "parallel", marks=SLOW),
    ("zb-v", 2, 2, 3, "parallel"),
    pytest.param("zb-v", 4, 2, 8, "plain", marks=SLOW),
    ("dualpipev", 2, 2, 4, "parallel"),
    pytest.param("dualpipev", 4, 2, 8, "plain", marks=SLOW),
]


@pytest.mark.parametrize("name, p, v, m, kind", CASES)
@distributed(world_size=4)
def test_split_schedules_equal_single_process(name, p, v, m, kind):
    """Losses and every parameter gradient equal the single-process model; weight
    gradients appear only once a ``W`` (or a whole ``B``) of their chunk has run."""
    schedule, stage, layers, owned, chunks = _setup(name, p, v, m, kind)
    deferred = {id(prm) for prm in layers.parameters()}  # the graph split defers all
    if kind == "parallel":  # the store defers the linears' weights; norms, biases go in I
        deferred = {id(c.fc1.weight) for c in layers} | {id(c.fc2.weight) for c in layers}
    seen = []  # per action: (action, whether a deferred weight of its chunk has a gradient)
    original = StageCompute.run

    def spy(compute, action):
        original(compute, action)
        params = compute.chunks[action.chunk].parameters()
        seen.append((action, any(prm.grad is not None for prm in params if id(prm) in deferred)))

    StageCompute.run = spy
    try:
        batches = _microbatches(m)
        result = forward_backward(
            _step(1, False),
            [iter(batches) for _ in range(v)],
            chunks,
            m,
            schedule=schedule,
            pp_group=ps.get_pipeline_model_parallel_group(),
            tensor_shapes=SHAPES,
        )
    finally:
        StageCompute.run = original
    reference = _layers(kind, len(layers))
    expected = reference_loss(reference, batches)
    torch.testing.assert_close(result.loss.double(), expected, rtol=1e-6, atol=0)
    if schedule.rank_of(schedule.num_virtual_stages - 1) == stage:
        torch.testing.assert_close(torch.stack(result.microbatch_losses).mean(), expected, **TOL)
    for i in owned:
        for (n, got), want in zip(
            layers[i].named_parameters(), reference[i].parameters(), strict=True
        ):
            torch.testing.assert_close(got.grad, want.grad, **TOL, msg=f"layer {i} {n}")
    for i in set(range(len(layers))) - set(owned):
        assert all(prm.grad is None for prm in layers[i].parameters())
    for chunk in range(v):
        flags = [(a.op, has) for a, has in seen if a.chunk == chunk]
        first = next(k for k, (op, _) in enumerate(flags) if op in (Op.WEIGHT_GRAD, Op.BACKWARD))
        assert not any(has for _, has in flags[:first])  # every I before it left them
        assert any(op is Op.INPUT_GRAD for op, _ in flags[:first]) or name == "dualpipev"
        assert flags[first][1] and flags[-1][1]
    # held from F to W, as the simulator's default weight_grad_memory=1.0 counts it
    gloo = CostModel(rules=Rules.GLOO)
    assert result.peak_in_flight == simulate(schedule, gloo).peak_in_flight[stage]


@pytest.mark.parametrize("name, v", [("zb-h1", 1), ("zb-h2", 2)])
@distributed(world_size=4)
def test_tensor_and_sequence_parallel_store(name, v):
    """pp2 × tp2 with sequence parallelism: the column layer's input is gathered again
    at ``W``, on every TP rank in the same order."""
    tp, p, m = 2, 2, 4
    schedule, _, layers, owned, chunks = _setup(name, p, v, m, "parallel", tp, True)
    tp_group = ps.get_tensor_model_parallel_group()
    batches = _microbatches(m)
    result = forward_backward(
        _step(tp, True),
        [iter(batches) for _ in range(v)],
        chunks,
        m,
        schedule=schedule,
        pp_group=ps.get_pipeline_model_parallel_group(),
        tensor_shapes=[TensorSpec((SEQ // tp, BATCH, HIDDEN), torch.float64)],
    )
    reference = _layers("parallel", len(layers), None, True)  # one rank: nothing to gather
    expected = reference_loss(reference, batches)
    total = result.loss.double().clone()
    dist.all_reduce(total, group=tp_group)  # each TP rank holds its shard's share
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    rank = ps.get_tensor_model_parallel_rank()
    for i in owned:
        got, want = layers[i], reference[i]
        pairs = [
            (got.fc1.weight.grad, shard(want.fc1.weight.grad, 0, rank, tp)),
            (got.fc1.bias.grad, shard(want.fc1.bias.grad, 0, rank, tp)),
            (got.fc2.weight.grad, shard(want.fc2.weight.grad, 1, rank, tp)),
        ]
        for have, expect in pairs:
            torch.testing.assert_close(have, expect, **TOL)


@pytest.mark.parametrize("kind, zero", [("parallel", 0), ("plain", 0), ("parallel", 2)])
@distributed(world_size=4)
def test_data_parallel_reduces_each_gradient_once(kind, zero):
    """dp2 × pp2 under zb-h2 with two chunks: every gradient reaches the data-parallel
    mean once; buckets reduce during the iteration (overlap) or in finish_grad_sync."""
    p, v, m = 2, 2, 4
    schedule, _, layers, _, chunks = _setup("zb-h2", p, v, m, kind)
    dp_group, dp_rank = ps.get_data_parallel_group(), ps.get_data_parallel_rank()
    wrapped = [
        DistributedDataParallel(
            c,
            dp_group=dp_group,
            bucket_size=2 * HIDDEN * HIDDEN,
            zero_stage=zero,
        )
        for c in chunks
    ]
    for w in wrapped:
        w.zero_grad_buffer()
    hooks = PipelineHooks(before_backward=lambda c, last: wrapped[c].set_grad_sync(last))
    batches = _microbatches(m, seed=dp_rank)
    forward_backward(
        _step(1, False),
        [iter(batches) for _ in range(v)],
        wrapped,
        m,
        schedule=schedule,
        pp_group=ps.get_pipeline_model_parallel_group(),
        tensor_shapes=SHAPES,
        hooks=hooks,
    )
    overlapped = [b.work is not None for w in wrapped for b in w.buffer.buckets]
    for w in wrapped:
        w.finish_grad_sync()
    if zero == 0 and kind == "plain":  # every gradient comes in the last W: it overlaps
        assert any(overlapped)
    references = [_layers(kind, len(layers)) for _ in range(2)]
    for d, ref in enumerate(references):
        reference_loss(ref, _microbatches(m, seed=d))
    for w, chunk in zip(wrapped, chunks, strict=True):
        for prm in chunk.parameters():
            name = next(n for n, q in layers.named_parameters() if q is prm)
            want = sum(dict(r.named_parameters())[name].grad for r in references) / 2
            got = w.reduced_grad(prm)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7, msg=name)


def test_sync_is_enabled_only_where_no_parameter_gets_a_second_gradient():
    for name, p, m in [("zb-v", 4, 8), ("dualpipev", 4, 8), ("zb-h2", 4, 6), ("zb-h1", 2, 4)]:
        schedule = build_schedule(name, p, m, 2 if name in ("zb-v", "dualpipev") else 1)
        for rank, actions in enumerate(schedule.actions):
            enabled = sync_actions(actions, schedule.num_chunks, False)
            for chunk in range(schedule.num_chunks):
                grads = [a for a in actions if a.chunk == chunk and a.op is not Op.FORWARD]
                on = [a for a in grads if a in enabled]
                assert on == grads[-len(on) :], (name, rank, chunk)  # a suffix
                ops = [a.op for a in on]
                assert ops in ([Op.BACKWARD], [Op.WEIGHT_GRAD], [Op.INPUT_GRAD, Op.WEIGHT_GRAD])
    single = build_schedule("zb-h1", 1, 3)
    assert sync_actions(single.actions[0], 1, True) == {single.actions[0][-1]}


def test_weight_grad_memory_of_a_gpt_layer():
    """What a deferred W keeps of a transformer layer's activations: the inputs of its four
    linears and their output gradients."""
    from megapp.transformer.layer import TransformerLayer
    from tests.support import gpt_config

    config = gpt_config(num_layers=1, params_dtype=F64, hidden_size=32, ffn_hidden_size=128)
    layer = TransformerLayer(config, layer_number=1)
    x = torch.randn(16, 2, 32, dtype=F64, requires_grad=True)
    reference = TransformerLayer(config, layer_number=1)
    reference.load_state_dict(layer.state_dict())
    reference(x).sum().backward()
    measured = weight_grad_memory(lambda: layer(x), list(layer.parameters()))
    assert measured.held > 0 and measured.activations > 0
    for got, want in zip(layer.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, **TOL)
