"""TransformerLayer and TransformerBlock: fused against plain torch, TP against one
process, and every recompute setting against none.

Float64 throughout: fused and plain layers differ only in the order of
floating-point operations (fused kernels, partial sums over TP ranks). The
values are O(1) and gradients sum over hundreds of terms with cancellation,
so 1e-10 absolute (~1e6 ulps) is safely above round-off and still many orders
below any real difference (a wrong mask or scale moves values by > 1e-3).
Recompute is compared bit for bit: it must replay exactly the same ops.
"""

import pytest
import torch

from megapp import parallel_state as ps
from megapp.fusions.rope import rotary_freqs
from megapp.tensor_parallel.random import model_parallel_manual_seed
from megapp.testing import distributed
from megapp.testing.plain_gpt import plain_layer
from megapp.transformer import TransformerBlock, TransformerConfig, TransformerLayer
from tests.support import full_grad, gather

TOL = {"rtol": 1e-9, "atol": 1e-10}
S, B, H = 8, 2, 16


def _config(tp: int = 1, sp: bool = False, **kw) -> TransformerConfig:
    base = dict(
        num_layers=3,
        hidden_size=H,
        num_attention_heads=4,
        ffn_hidden_size=32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float64,
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
    )
    base.update(kw)
    return TransformerConfig(**base)


def _input(seed: int = 0) -> torch.Tensor:
    return torch.randn(S, B, H, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


VARIANTS = [
    {},
    {"activation": "swiglu", "normalization": "RMSNorm"},
    {"position_embedding_type": "rope", "num_query_groups": 2},
    {"attention_backend": "fused_softmax", "add_bias_linear": False},
]


@pytest.mark.parametrize(
    "variant", VARIANTS, ids=lambda v: "-".join(map(str, v.values())) or "base"
)
def test_fused_layer_equals_plain_torch(variant):
    config = _config(**variant)
    torch.manual_seed(0)
    layer = TransformerLayer(config, 0)
    rope = config.position_embedding_type == "rope"
    freqs = rotary_freqs(S, config.kv_channels) if rope else None
    x = _input().requires_grad_()
    out = layer(x, freqs)
    ref_x = _input().requires_grad_()
    ref_out = plain_layer(layer, ref_x, config, freqs)
    torch.testing.assert_close(out, ref_out, **TOL)
    upstream = _input(1)
    grads = torch.autograd.grad(out, [x, *layer.parameters()], upstream)
    ref_grads = torch.autograd.grad(ref_out, [ref_x, *layer.parameters()], upstream)
    for (name, _), got, want in zip(
        [("input", None), *layer.named_parameters()], grads, ref_grads, strict=True
    ):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, n=name: f"{n}: {m}")


# 2 query groups cannot split over 4 ranks (test_tensor_parallel checks the error);
# fast: the base layer under tp 2, with and without sequence parallelism
LAYER_CASES = [
    pytest.param(
        tp,
        sp,
        variant,
        id=f"{name}-tp{tp}-{'sp' if sp else 'nosp'}",
        marks=pytest.mark.slow if tp == 4 or name != "base" else (),
    )
    for variant, name in zip(VARIANTS[:3], ["base", "swiglu-rms", "rope-gqa"], strict=True)
    for tp, sp in [(2, False), (2, True), (4, True)]
    if variant.get("num_query_groups", 4) % tp == 0
]


@pytest.mark.parametrize("tp, sp, variant", LAYER_CASES)
@distributed(world_size=4)
def test_tensor_parallel_layer_equals_one_process(tp, sp, variant):
    ps.initialize_model_parallel(tp)
    group, rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    torch.manual_seed(0)
    layer = TransformerLayer(_config(tp, sp, **variant), 0, group)
    torch.manual_seed(0)
    reference = TransformerLayer(_config(**variant), 0)
    rope = variant.get("position_embedding_type") == "rope"
    freqs = rotary_freqs(S, H // 4) if rope else None
    x, upstream = _input(), _input(1)
    ref_x = x.clone().requires_grad_()
    reference(ref_x, freqs).backward(upstream)
    my_x = (x.chunk(tp)[rank] if sp else x).clone().requires_grad_()
    out = layer(my_x, freqs)
    out.backward(upstream.chunk(tp)[rank] if sp else upstream)
    if sp:
        out, x_grad = gather(out, group, 0), gather(my_x.grad, group, 0)
    else:
        x_grad = my_x.grad
    torch.testing.assert_close(out, reference(x.clone(), freqs), **TOL)
    torch.testing.assert_close(x_grad, ref_x.grad, **TOL)
    for (name, param), ref_param in zip(
        layer.named_parameters(), reference.parameters(), strict=True
    ):
        got = full_grad(param, group)
        torch.testing.assert_close(got, ref_param.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")


RECOMPUTE = [
    # fast: selective and full (uniform) recompute, on the sdpa backend
    {"recompute_granularity": "selective"},
    {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    pytest.param(
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2},
        marks=pytest.mark.slow,
    ),
    pytest.param(
        {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
        marks=pytest.mark.slow,
    ),
    pytest.param(
        {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 3},
        marks=pytest.mark.slow,
    ),
]


def _block_grads(config: TransformerConfig) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    block = TransformerBlock(config)
    model_parallel_manual_seed(1234)
    torch.manual_seed(42)  # the dropout masks come from here
    x = _input().requires_grad_()
    out = block(x)
    out.backward(_input(1))
    return out.detach(), [x.grad, *(p.grad for p in block.parameters())]


@pytest.mark.parametrize("setting", RECOMPUTE, ids=lambda s: "-".join(map(str, s.values())))
@pytest.mark.parametrize("backend", ["sdpa", pytest.param("fused_softmax", marks=pytest.mark.slow)])
def test_recompute_is_bit_identical_with_dropout(setting, backend):
    dropouts = {"hidden_dropout": 0.1, "attention_dropout": 0.1, "attention_backend": backend}
    out, grads = _block_grads(_config(**dropouts))
    out_r, grads_r = _block_grads(_config(**dropouts, **setting))
    assert torch.equal(out, out_r)
    for got, want in zip(grads_r, grads, strict=True):
        assert torch.equal(got, want)


def test_dropout_is_active():
    # guards the test above: with dropout on, two different seeds give different outputs
    config = _config(hidden_dropout=0.1, attention_dropout=0.1)
    torch.manual_seed(0)
    block = TransformerBlock(config)
    model_parallel_manual_seed(1)
    torch.manual_seed(1)
    first = block(_input())
    torch.manual_seed(2)
    assert not torch.equal(first, block(_input()))


def test_block_slices_and_errors():
    block = TransformerBlock(_config(), first_layer=1, num_layers=2, post_layer_norm=False)
    assert [layer.layer_number for layer in block.layers] == [1, 2]
    assert block.final_layernorm is None
    with pytest.raises(ValueError, match=r"layers 2\.\.3 are outside the model's 3 layers"):
        TransformerBlock(_config(), first_layer=2, num_layers=2)
    with pytest.raises(ValueError, match="needs recompute_method"):
        _config(recompute_granularity="full")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        _config(attention_backend="flash")
