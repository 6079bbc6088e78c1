"""The planner's activation bytes per layer equal what megapp's layer keeps for backward
(its activation audit), to the byte, for every attention backend, recompute setting,
MLP and attention shape, and under tensor and sequence parallelism."""

from __future__ import annotations

import pytest
import torch

from megapp import parallel_state as ps
from megapp.fusions.rope import rotary_freqs
from megapp.planning.activations import (
    full_recompute_layer_bytes,
    layer_activation_bytes,
    rotary_bytes,
)
from megapp.tensor_parallel.random import model_parallel_manual_seed
from megapp.testing import distributed
from megapp.transformer import TransformerConfig, TransformerLayer
from megapp.transformer.block import TransformerBlock
from megapp.transformer.memory_audit import audit_saved_activations

CASES = {  # attention dropout stays 0 with sdpa: on CPU it falls back to the math kernel
    "gpt": {},
    "llama": {
        "activation": "swiglu",
        "normalization": "RMSNorm",
        "num_query_groups": 2,
        "position_embedding_type": "rope",
    },
    "gqa": {"num_query_groups": 2},
    "rope": {"position_embedding_type": "rope", "attention_backend": "fused_softmax"},
    "selective": {"recompute_granularity": "selective", "attention_dropout": 0.1},
    "fused softmax": {"attention_backend": "fused_softmax"},
    "fused softmax + dropout": {"attention_backend": "fused_softmax", "attention_dropout": 0.1},
    "fp32, odd widths": {
        "params_dtype": torch.float32,
        "ffn_hidden_size": 200,
        "kv_channels": 8,
        "add_bias_linear": False,
    },
}


def _config(tp: int = 1, **overrides) -> TransformerConfig:
    settings = dict(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        params_dtype=torch.bfloat16,
        hidden_dropout=0.1,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
    )
    settings.update(overrides)
    return TransformerConfig(**settings)


def _audit(module, config, s, b, tp=1):
    torch.manual_seed(0)
    model_parallel_manual_seed(0)
    tokens = s // tp if config.sequence_parallel else s
    x = torch.randn(tokens, b, config.hidden_size, dtype=config.params_dtype, requires_grad=True)
    if config.position_embedding_type != "rope":
        return audit_saved_activations(module, x).total
    freqs = rotary_freqs(s, config.kv_channels)  # as GPTModel passes them
    return audit_saved_activations(module, x, rotary_freqs=freqs).total


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("s, b", [(16, 2), (24, 1)])
def test_layer_bytes_equal_the_audit(name, s, b):
    config = _config(**CASES[name])
    torch.manual_seed(0)
    layer = TransformerLayer(config, 0)
    predicted = layer_activation_bytes(config, s, b) + rotary_bytes(config, s)
    assert predicted == _audit(layer, config, s, b)


def test_full_recompute_keeps_each_group_input():
    config = _config(
        num_layers=4,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=2,
    )
    block = TransformerBlock(config, post_layer_norm=False)
    groups = 2  # four layers recomputed two at a time
    assert groups * full_recompute_layer_bytes(config, 16, 2) == _audit(block, config, 16, 2)


@distributed(world_size=2)
def test_layer_bytes_under_tensor_and_sequence_parallelism():
    ps.initialize_model_parallel(2, 1)
    group = ps.get_tensor_model_parallel_group()
    for sequence_parallel in (False, True):
        for name in ("gpt", "llama", "gqa"):
            config = _config(tp=2, sequence_parallel=sequence_parallel, **CASES[name])
            torch.manual_seed(0)
            layer = TransformerLayer(config, 0, tp_group=group)
            measured = _audit(layer, config, 16, 2, tp=2)
            predicted = layer_activation_bytes(config, 16, 2) + rotary_bytes(config, 16)
            assert predicted == measured, (name, sequence_parallel, predicted, measured)


@distributed(world_size=2)
def test_layer_bytes_under_context_parallelism():
    """Each mechanism keeps what docs/context_parallel.md says it adds, on a rank's s/cp
    tokens: the ring its log-sum-exp, the all-gather the whole sequence's keys and values
    and its probabilities, a2a the whole sequence for a cp-th of the heads; in float32 and
    bfloat16 (the arithmetic in float32), with grouped-query attention and rotary
    positions, and with selective recompute (q, k and v alone)."""
    import torch.distributed as dist

    from megapp.context_parallel import layout

    ps.initialize_model_parallel(1, 1, context_parallel_size=2)
    group, rank = ps.get_context_parallel_group(), dist.get_rank()
    s, b = 32, 2
    cases = [
        ("gpt", {}),
        ("llama", CASES["llama"]),
        ("selective", {"recompute_granularity": "selective"}),
    ]
    for dtype in (torch.float32, torch.bfloat16):
        for name, settings in cases:
            for comm_type in ("p2p", "all_gather", "a2a"):
                config = _config(
                    params_dtype=dtype,
                    hidden_dropout=0.0,
                    context_parallel_size=2,
                    cp_comm_type=comm_type,
                    **settings,
                )
                torch.manual_seed(0)
                layer = TransformerLayer(config, 0, cp_group=group)
                x = torch.randn(s // 2, b, 64, dtype=dtype, requires_grad=True)
                rope = {}
                if config.position_embedding_type == "rope":
                    freqs = rotary_freqs(s, config.kv_channels)
                    rope = {"rotary_freqs": layout.split(freqs, 2, rank)}
                measured = audit_saved_activations(layer, x, **rope).total
                predicted = layer_activation_bytes(config, s // 2, b) + rotary_bytes(config, s // 2)
                assert predicted == measured, (name, comm_type, dtype, predicted, measured)


def test_context_parallelism_divides_the_token_local_part():
    """At cp = 2 a rank holds half the tokens: everything but attention's own terms halves,
    and the ring adds nothing but its log-sum-exp, so its layer is half of cp = 1's."""
    one = _config(params_dtype=torch.float32)
    two = _config(params_dtype=torch.float32, context_parallel_size=2, attention_dropout=0.0)
    assert layer_activation_bytes(two, 64, 2) * 2 == layer_activation_bytes(one, 128, 2)
    gathered = _config(
        params_dtype=torch.float32, context_parallel_size=2, cp_comm_type="all_gather"
    )
    s, b, heads, d = 128, 2, 4, 16
    keys_values = 2 * s * b * heads * d * 4  # the whole sequence's, gathered
    # q is a view of the QKV output, which both keep, and both keep the log-sum-exp: the
    # all-gather adds the gathered keys and values and the reorder's index, and no
    # probabilities
    extra = layer_activation_bytes(gathered, s // 2, b) - layer_activation_bytes(two, s // 2, b)
    assert extra == keys_values + 8 * 2 * 2
