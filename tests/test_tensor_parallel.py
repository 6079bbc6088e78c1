"""Tensor-parallel layers on gloo against the same module in one process.

Everything runs in float64 with the same full weights (built from one seed
under every layout) and the same inputs; tensor parallelism only changes the
order of additions (partial sums over ranks), so 1e-10 relative / 1e-12
absolute is far above round-off and far below any real mistake.
"""

import pytest
import torch

from megapp import parallel_state as ps
from megapp.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from megapp.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megapp.tensor_parallel.overlap import matmul_ring_scatter, ring_gather_matmul
from megapp.testing import distributed
from megapp.transformer.config import TransformerConfig
from megapp.transformer.layer import ParallelAttention, ParallelMLP
from tests.support import full_grad as _full_grad
from tests.support import gather as _gather

TOL = {"rtol": 1e-10, "atol": 1e-12}
F64 = torch.float64
S, B, H = 8, 2, 16


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


# ----- mappings ------------------------------------------------------------------


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
@distributed(world_size=4)
def test_mappings_forward_and_backward(tp):
    ps.initialize_model_parallel(tp)
    group, rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    full = _randn(S, B, H, seed=1)  # the same on every rank
    per_rank = [_randn(S, B, H, seed=10 + r) for r in range(tp)]  # rank r's own tensor
    mine = per_rank[rank].clone().requires_grad_()
    upstream = _randn(S, B, H, seed=2)
    cases = [
        # (mapping, input, expected output, upstream grad, expected input grad)
        (copy_to_tensor_model_parallel_region, mine, per_rank[rank], upstream, upstream * tp),
        (reduce_from_tensor_model_parallel_region, mine, sum(per_rank), upstream, upstream),
        (
            scatter_to_tensor_model_parallel_region,
            full,
            full.chunk(tp, -1)[rank],
            upstream.chunk(tp, -1)[rank],
            upstream,  # all-gather of every rank's slice of the same upstream
        ),
        (
            gather_from_tensor_model_parallel_region,
            mine,
            torch.cat(per_rank, -1),
            torch.cat([upstream] * tp, -1),
            upstream,
        ),
        (
            scatter_to_sequence_parallel_region,
            full,
            full.chunk(tp, 0)[rank],
            upstream.chunk(tp, 0)[rank],
            upstream,
        ),
        (
            gather_from_sequence_parallel_region,
            mine,
            torch.cat(per_rank, 0),
            torch.cat([upstream] * tp, 0),
            upstream * tp,  # reduce-scatter of tp identical gradients
        ),
        (
            reduce_scatter_to_sequence_parallel_region,
            mine,
            sum(per_rank).chunk(tp, 0)[rank],
            upstream.chunk(tp, 0)[rank],
            upstream,  # all-gather of every rank's slice of the same upstream
        ),
    ]
    for mapping, inp, expected, grad_out, expected_grad in cases:
        inp = inp.detach().clone().requires_grad_()
        out = mapping(inp, group)
        torch.testing.assert_close(out, expected, **TOL, msg=mapping.__name__)
        out.backward(grad_out)
        torch.testing.assert_close(inp.grad, expected_grad, **TOL, msg=mapping.__name__)


# ----- linear layers, MLP, attention ----------------------------------------------


def _compare_module(build, tp: int, sequence_parallel: bool, seed: int = 0) -> None:
    """Build the module under tp and in one process from the same seed; run the same
    input and upstream gradient; compare outputs, input gradients and every gradient."""
    group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    torch.manual_seed(seed)
    module = build(group)
    torch.manual_seed(seed)
    reference = build(None)
    x = _randn(S, B, H, seed=3)
    upstream = _randn(S, B, H, seed=4)
    ref_x = x.clone().requires_grad_()
    ref_out, ref_bias = reference(ref_x)
    (ref_out if ref_bias is None else ref_out + ref_bias).backward(upstream)
    if sequence_parallel:
        rank = ps.get_tensor_model_parallel_rank()
        my_x = x.chunk(tp, 0)[rank].clone().requires_grad_()
        my_up = upstream.chunk(tp, 0)[rank]
    else:
        my_x, my_up = x.clone().requires_grad_(), upstream
    out, bias = module(my_x)
    (out if bias is None else out + bias).backward(my_up)
    if sequence_parallel:
        out, x_grad = _gather(out, group, 0), _gather(my_x.grad, group, 0)
    else:
        x_grad = my_x.grad
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(x_grad, ref_x.grad, **TOL)
    for (name, param), ref_param in zip(
        module.named_parameters(), reference.parameters(), strict=True
    ):
        got = _full_grad(param, group)
        torch.testing.assert_close(
            got, ref_param.grad, **TOL, msg=lambda m, name=name: f"gradient of {name}: {m}"
        )


def _config(tp: int, sp: bool, **kw) -> TransformerConfig:
    base = dict(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=4,
        ffn_hidden_size=32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=F64,
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
    )
    base.update(kw)
    return TransformerConfig(**base)


LAYOUTS = [(1, False), (2, False), (2, True), (4, False), (4, True)]


def _tp2_fast(cases):
    """``cases`` with those of tp 2 in the fast tier, tp 1 and 4 in the slow one."""
    return [case if case[0] == 2 else pytest.param(*case, marks=pytest.mark.slow) for case in cases]


class _ColumnRow(torch.nn.Module):
    """Column -> Row with a bias handed back to the caller, the plain Megatron pair."""

    def __init__(self, group, sp, overlap=False):
        super().__init__()
        self.column = ColumnParallelLinear(
            H, 24, tp_group=group, sequence_parallel=sp, tp_comm_overlap=overlap,
            params_dtype=F64,
        )  # fmt: skip
        self.row = RowParallelLinear(
            24, H, tp_group=group, sequence_parallel=sp, tp_comm_overlap=overlap,
            skip_bias_add=True, params_dtype=F64,
        )  # fmt: skip

    def forward(self, x):
        hidden, _ = self.column(x)
        return self.row(torch.tanh(hidden))


@pytest.mark.parametrize("tp, sp", _tp2_fast(LAYOUTS))
@distributed(world_size=4)
def test_column_then_row(tp, sp):
    ps.initialize_model_parallel(tp)
    _compare_module(lambda g: _ColumnRow(g, sp and g is not None), tp, sp)


# --tp-comm-overlap: the collectives as rings of pieces beside the matmuls
OVERLAPPED = [2, pytest.param(4, marks=pytest.mark.slow)]


@pytest.mark.parametrize("tp", OVERLAPPED)
@distributed(world_size=4)
def test_overlapped_column_then_row(tp):
    ps.initialize_model_parallel(tp)
    _compare_module(lambda g: _ColumnRow(g, g is not None, overlap=g is not None), tp, True)


@pytest.mark.parametrize("tp", OVERLAPPED)
@distributed(world_size=4)
def test_overlapped_rings_equal_the_collectives(tp):
    ps.initialize_model_parallel(tp)
    group, rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    full = _randn(S, B, H, seed=8)
    weight = _randn(6, H, seed=9)
    shard = full.chunk(tp, 0)[rank]
    out, gathered = ring_gather_matmul(shard, lambda x: x @ weight.t(), group, keep=True)
    assert torch.equal(gathered, full)  # every shard in its place, bit for bit
    torch.testing.assert_close(out, full @ weight.t(), **TOL)
    mine = _randn(S, B, H, seed=20 + rank)  # each rank's own partial input
    scattered = matmul_ring_scatter(mine, lambda x: x @ weight.t(), group)
    total = sum(_randn(S, B, H, seed=20 + r) @ weight.t() for r in range(tp))
    torch.testing.assert_close(scattered, total.chunk(tp, 0)[rank], **TOL)


@pytest.mark.parametrize("tp", OVERLAPPED)
@distributed(world_size=4)
def test_overlapped_mlp_and_attention(tp):
    ps.initialize_model_parallel(tp)

    def config(g, **kw):
        return _config(tp if g else 1, g is not None, tp_comm_overlap=g is not None, **kw)

    _compare_module(lambda g: ParallelMLP(config(g, activation="swiglu"), g), tp, True)
    _compare_module(
        lambda g: ParallelAttention(config(g, num_query_groups=2 if tp == 2 else 4), g), tp, True
    )


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("tp, sp", _tp2_fast(LAYOUTS))
@distributed(world_size=4)
def test_parallel_mlp(tp, sp, activation):
    ps.initialize_model_parallel(tp)
    _compare_module(
        lambda g: ParallelMLP(
            _config(tp if g else 1, sp and g is not None, activation=activation), g
        ),
        tp,
        sp,
    )


# multi-head (4 query groups) and grouped-query (2) attention; 2 groups cannot split over
# 4 ranks (test_bad_layouts checks the error), so that case is not listed
ATTENTION_CASES = [(tp, sp, groups) for groups in (4, 2) for tp, sp in LAYOUTS if groups % tp == 0]


@pytest.mark.parametrize("tp, sp, groups", _tp2_fast(ATTENTION_CASES))
@distributed(world_size=4)
def test_parallel_attention(tp, sp, groups):
    ps.initialize_model_parallel(tp)
    _compare_module(
        lambda g: ParallelAttention(
            _config(tp if g else 1, sp and g is not None, num_query_groups=groups), g
        ),
        tp,
        sp,
    )


# ----- embedding --------------------------------------------------------------------


@pytest.mark.parametrize("tp, sp", _tp2_fast(LAYOUTS))
@distributed(world_size=4)
def test_vocab_parallel_embedding_with_padded_vocabulary(tp, sp):
    ps.initialize_model_parallel(tp)
    group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    vocab = 50257  # not divisible by 2 or 4
    torch.manual_seed(5)
    embedding = VocabParallelEmbedding(
        vocab, 8, tp_group=group, sequence_parallel=sp, params_dtype=F64
    )
    torch.manual_seed(5)
    reference = VocabParallelEmbedding(vocab, 8, params_dtype=F64)
    assert embedding.padded_num_embeddings % tp == 0
    ids = torch.randint(0, vocab, (S, B), generator=torch.Generator().manual_seed(6))
    ids[0, 0], ids[1, 1] = 0, vocab - 1  # both ends of the vocabulary
    upstream = _randn(S, B, 8, seed=7)
    ref_out = reference(ids)
    ref_out.backward(upstream)
    out = embedding(ids)
    rank = ps.get_tensor_model_parallel_rank()
    out.backward(upstream.chunk(tp, 0)[rank] if sp else upstream)
    if sp:
        out = _gather(out, group, 0)
    torch.testing.assert_close(out, ref_out, **TOL)
    grad = _full_grad(embedding.weight, group)
    torch.testing.assert_close(grad[:vocab], reference.weight.grad, **TOL)
    assert torch.all(grad[vocab:] == 0)  # padded rows are never used


# ----- bad layouts ------------------------------------------------------------------


@distributed(world_size=4)
def test_bad_layouts():
    ps.initialize_model_parallel(4)
    group = ps.get_tensor_model_parallel_group()
    with pytest.raises(ValueError, match=r"output_size \(10\) is not divisible by the tensor"):
        ColumnParallelLinear(8, 10, tp_group=group)
    with pytest.raises(ValueError, match=r"input_size \(6\) is not divisible"):
        RowParallelLinear(6, 8, tp_group=group)
    with pytest.raises(ValueError, match=r"num_query_groups \(2\) is not divisible"):
        ParallelAttention(_config(1, False, num_query_groups=2), group)
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\) is not divisible"):
        ParallelAttention(_config(1, False, num_attention_heads=6, kv_channels=4), group)
    with pytest.raises(ValueError, match="sequence length 6 is not divisible by the 4 TP ranks"):
        scatter_to_sequence_parallel_region(torch.zeros(6, 1, 4), group)


def test_config_errors():
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\) is not divisible by tensor_"):
        _config(4, False, num_attention_heads=6, kv_channels=4)
    with pytest.raises(ValueError, match=r"ffn_hidden_size \(30\) is not divisible"):
        _config(4, False, ffn_hidden_size=30)
    with pytest.raises(ValueError, match="is not a multiple of num_query_groups"):
        _config(1, False, num_query_groups=3)
    with pytest.raises(ValueError, match="hidden_size \\(16\\) is not divisible by"):
        _config(1, False, num_attention_heads=3, num_query_groups=3)
    with pytest.raises(ValueError, match="sequence_parallel needs tensor_model_parallel_size"):
        _config(1, True)
