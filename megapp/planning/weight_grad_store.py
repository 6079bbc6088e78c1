"""What a split backward keeps from its ``I`` to its ``W``, and what ``W`` works with.

``I`` defers the weight gradient of every matmul built from megapp's tensor-parallel
linears (:mod:`megapp.autograd.deferred`): QKV and the projection, a dense layer's two MLP
matmuls or a mixture-of-experts layer's shared expert's, the output layer on the last
stage. Each keeps its input and its output gradient until ``W``. The routed experts'
grouped matmuls, the router, norms, biases and embeddings get their gradients in ``I``;
the kept inputs hold no graph, so the chunk's input and its gradient are freed at ``I``.

``W`` runs the matmuls in ``I``'s order and drops each one's kept tensors once its weight
gradient is made, and each gradient once accumulated: it works with one weight's gradient
(and autograd's copy of it) at a time while the store shrinks.
"""

from __future__ import annotations

from dataclasses import dataclass

from megapp.models.gpt import GPTConfig
from megapp.planning.model_state import moe_layer_count

__all__ = [
    "DeferredMatmul",
    "deferred_matmuls",
    "weight_grad_store_bytes",
    "weight_grad_working_bytes",
]


@dataclass(frozen=True)
class DeferredMatmul:
    """One matmul whose weight gradient ``W`` makes, on one tensor-parallel rank."""

    weight: int  # elements of its weight (and of its weight's gradient)
    kept: int  # elements per token the store keeps for it: its input and output gradient
    gathered: bool  # its input is re-gathered at W (column-parallel, sequence parallelism)


def deferred_matmuls(config: GPTConfig, experts: bool = False) -> list[DeferredMatmul]:
    """One layer's deferred matmuls in the order ``I`` meets them (the MLP's second and
    first, or the shared expert's, then the projection and QKV); ``experts``: a
    mixture-of-experts layer."""
    h, tp, sp = config.hidden_size, config.tensor_model_parallel_size, config.sequence_parallel
    heads, groups, d = config.num_attention_heads, config.num_query_groups, config.kv_channels
    n = 2 if config.activation == "swiglu" else 1
    gathered = sp and tp > 1
    normed = h // tp if gathered else h  # a norm's output, the shard kept under sp

    def mlp(width: int) -> list[DeferredMatmul]:
        f = width // tp
        return [
            DeferredMatmul(h * f, f + h, False),  # its input the activation
            DeferredMatmul(h * n * f, normed + n * f, gathered),
        ]

    matmuls = []
    if not experts:
        matmuls += mlp(config.ffn_hidden_size)
    elif config.moe_shared_expert_intermediate_size:
        matmuls += mlp(config.moe_shared_expert_intermediate_size)
    a, qkv = heads * d // tp, (heads + 2 * groups) * d // tp
    matmuls += [
        DeferredMatmul(a * h, a + h, False),
        DeferredMatmul(h * qkv, normed + qkv, gathered),
    ]
    return matmuls


def _output_layer(config: GPTConfig) -> DeferredMatmul:
    """The output layer's: its gathered input and the logits' gradient."""
    h, vocab = config.hidden_size, config.padded_vocab_size // config.tensor_model_parallel_size
    return DeferredMatmul(h * vocab, h + vocab, False)


def weight_grad_store_bytes(
    config: GPTConfig, num_layers: int, last: bool, seq_length: int, mbs: int
) -> int:
    """Bytes the store keeps from ``I`` to ``W`` for one microbatch through a chunk of
    ``num_layers`` layers (``last``: with the output layer), on one tensor-parallel rank."""
    moe_layers = moe_layer_count(config, num_layers)
    per_token = (num_layers - moe_layers) * sum(m.kept for m in deferred_matmuls(config))
    per_token += moe_layers * sum(m.kept for m in deferred_matmuls(config, experts=True))
    if last:
        per_token += _output_layer(config).kept
    return seq_length * mbs * per_token * config.params_dtype.itemsize


def weight_grad_working_bytes(
    config: GPTConfig, num_layers: int, last: bool, seq_length: int, mbs: int
) -> int:
    """The most ``W`` works with above what the chunk held when it began: a weight's
    gradient and autograd's copy of it for the parameter's ``.grad`` (a gradient handed to
    autograd from outside is not stolen), and under sequence parallelism the input
    re-gathered for it (``t·h``), less the kept tensors already dropped. The first
    matmuls decide: the output layer's on the last stage, then the chunk's last layer's
    (a later one repeats a weight with more of the store gone)."""
    t, h, w = seq_length * mbs, config.hidden_size, config.params_dtype.itemsize
    matmuls = [_output_layer(config)] if last else []
    if num_layers:
        experts = moe_layer_count(config, num_layers) == num_layers  # the last layer's kind
        matmuls += deferred_matmuls(config, experts)
    most, dropped = 0, 0
    for m in matmuls:
        most = max(most, 2 * m.weight + (t * h if m.gathered else 0) - dropped)
        dropped += t * m.kept
    return most * w
