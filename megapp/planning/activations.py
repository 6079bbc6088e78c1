"""Activation bytes one transformer layer keeps for backward, from its shape.

What megapp's :class:`~megapp.transformer.TransformerLayer` saves (its activation audit,
``megapp.transformer.memory_audit``, measures the same terms), per microbatch of ``s``
tokens × ``b`` sequences, ``w`` bytes per element of the layer's dtype:

- the two norms' inputs, ``2·s·b·h`` (split over the tensor-parallel ranks under
  sequence parallelism); the norms' outputs and statistics are rebuilt in backward;
- the query, key and value fed to attention (``3·s·b·a·d`` for plain multi-head
  attention, all views of the QKV matmul's output; rotary embedding and grouped-query
  attention make copies, see :func:`_qkv_elements`), and the attention output the
  projection keeps, ``s·b·a·d``;
- inside attention, without selective recompute: ``sdpa`` keeps its fp32 log-sum-exp,
  ``4·b·a·s`` bytes (as torch's flash kernel does, with or without attention dropout on
  GPU; on CPU attention dropout falls back to torch's math kernel, which keeps the
  ``s²`` scores, and is not modelled); ``fused_softmax`` keeps the ``s²·b·a``
  probabilities, and with attention dropout its output and mask as well;
- the first MLP matmul's output, ``s·b·f`` (``2·s·b·f`` for SwiGLU).

Everything except the norms' inputs is split over the tensor-parallel ranks. Full
recompute keeps only the input of each recomputed group of layers. Rotary embedding
adds its fp32 angles once per chunk (:func:`rotary_bytes`).
"""

from __future__ import annotations

import torch

from megapp.transformer.config import TransformerConfig


def layer_activation_bytes(
    config: TransformerConfig, seq_length: int, micro_batch_size: int
) -> int:
    """Bytes one layer keeps for backward on one tensor-parallel rank, without full
    recompute (see :func:`full_recompute_layer_bytes` for that)."""
    s, b, h = seq_length, micro_batch_size, config.hidden_size
    tp = config.tensor_model_parallel_size
    heads, d = config.num_attention_heads // tp, config.kv_channels
    w = torch.empty((), dtype=config.params_dtype).element_size()
    norms = 2 * s * b * h // (tp if config.sequence_parallel else 1) * w
    attention = s * b * (_qkv_elements(config) + heads * d) * w  # q, k, v and the output
    if config.recompute_granularity != "selective":
        if config.attention_backend == "fused_softmax":
            scores = s * s * b * heads * w
            attention += scores * (3 if config.attention_dropout > 0 else 1)
        else:
            attention += 4 * b * heads * s
    fc1 = config.ffn_hidden_size * (2 if config.activation == "swiglu" else 1) // tp
    return norms + attention + s * b * fc1 * w


def _qkv_elements(config: TransformerConfig) -> int:
    """Elements per token of the storages attention keeps for q, k and v on one rank.

    q, k and v start as views of the QKV matmul's output (``(a + 2g)·d`` per token).
    Rotary embedding gives q and k storages of their own; grouped-query attention
    copies k and v to every query head, and copies q out of the output when a rank
    holds several groups of several heads. Whatever stays a view keeps the whole output.
    """
    tp, d = config.tensor_model_parallel_size, config.kv_channels
    heads, groups = config.num_attention_heads // tp, config.num_query_groups // tp
    per_group, rope = heads // groups, config.position_embedding_type == "rope"
    own, views_output = 0, False
    if rope or (per_group > 1 and groups > 1):
        own += heads * d  # q: rotated, or gathered out of its groups
    else:
        views_output = True
    for rotated in (rope, False):  # k, then v
        if per_group > 1:
            own += heads * d  # repeated to every query head
        elif rotated:
            own += groups * d
        else:
            views_output = True
    return own + ((heads + 2 * groups) * d if views_output else 0)


def rotary_bytes(config: TransformerConfig, seq_length: int) -> int:
    """The fp32 rotary angles ``[s, rot_dim]`` the layers keep for backward: one storage
    per chunk, shared by its layers (none without rotary embedding)."""
    if config.position_embedding_type != "rope":
        return 0
    return seq_length * int(config.kv_channels * config.rotary_percent) * 4


def full_recompute_layer_bytes(
    config: TransformerConfig, seq_length: int, micro_batch_size: int
) -> int:
    """Bytes a fully recomputed group of layers keeps: its input."""
    sp = config.sequence_parallel
    width = torch.empty((), dtype=config.params_dtype).element_size()
    tokens = seq_length * micro_batch_size // (config.tensor_model_parallel_size if sp else 1)
    return tokens * config.hidden_size * width
