"""What one transformer layer keeps for backward, in units of s·b·h bytes (bf16)."""

import pytest
import torch

from megapp.tensor_parallel.random import model_parallel_manual_seed
from megapp.transformer import TransformerConfig, TransformerLayer
from megapp.transformer.memory_audit import audit_saved_activations

S, B, H, A = 32, 2, 64, 4
UNIT = S * B * H  # one [s, b, h] bf16 tensor is 2 units
# Per-row fp32 statistics of the two norms, (mean, rstd) · 4 bytes · s·b each, when they are kept.
NORM_STATS = 2 * 2 * 4 / H


def _audit(rebuild: bool = True, **overrides) -> dict[str, float]:
    config = TransformerConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=A,
        params_dtype=torch.bfloat16,
        **{"hidden_dropout": 0.1, "attention_dropout": 0.1, **overrides},
    )
    torch.manual_seed(0)
    model_parallel_manual_seed(0)
    layer = TransformerLayer(config, 0)
    layer.recompute_saved_inputs = rebuild
    x = torch.randn(S, B, H, dtype=torch.bfloat16, requires_grad=True)
    return audit_saved_activations(layer, x).in_units(UNIT)


def test_rebuilt_linear_inputs_save_exactly_what_the_linears_would_keep():
    stored, rebuilt = _audit(rebuild=False), _audit()
    # qkv and fc1 inputs (norm outputs, 2 each), the fc2 input (activation output, 8) and the
    # norms' statistics, recomputed from their kept inputs
    assert sum(stored.values()) - sum(rebuilt.values()) == pytest.approx(2 + 2 + 8 + NORM_STATS)
    assert stored["mlp.linear_fc2"] == pytest.approx(8)
    assert "mlp.linear_fc2" not in rebuilt
    for norm in ("input_layernorm", "pre_mlp_layernorm"):
        assert stored[norm] == pytest.approx(2 + NORM_STATS / 2)
        assert rebuilt[norm] == pytest.approx(2)  # the input alone


@pytest.mark.parametrize("backend", ["sdpa", "fused_softmax"])
def test_selective_recompute_keeps_at_most_20_sbh(backend):
    audit = _audit(recompute_granularity="selective", attention_backend=backend)
    # norm inputs 2 + 2, q/k/v 6, attention output 2, fc1 output 8: 20, nothing else
    assert sum(audit.values()) == pytest.approx(20)
    assert sum(audit.values()) < 34  # Megatron's selective-recompute figure


def test_no_recompute_without_attention_dropout_keeps_20_sbh():
    # torch's CPU flash attention keeps q, k, v, output and its fp32 log-sum-exp [b, a, s]: the
    # one term above 20 (4·a/h)
    audit = _audit(attention_dropout=0.0, attention_backend="sdpa")
    lse = 4 * A * S * B / UNIT
    assert sum(audit.values()) == pytest.approx(20 + lse)


def test_fused_softmax_without_recompute_is_within_megatron_formula():
    audit = _audit(attention_backend="fused_softmax")
    assert sum(audit.values()) <= 34 + 5 * A * S / H
