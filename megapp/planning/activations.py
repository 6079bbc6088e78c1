"""Activation bytes one transformer layer keeps for backward, from its shape.

What megapp's :class:`~megapp.transformer.TransformerLayer` saves (its activation audit,
``megapp.transformer.memory_audit``, measures the same terms), per microbatch of ``s``
tokens × ``b`` sequences, ``w`` bytes per element of the layer's dtype:

- the two norms' inputs, ``2·s·b·h`` (split over the tensor-parallel ranks under
  sequence parallelism); the norms' outputs and statistics are rebuilt in backward;
- the query, key and value fed to attention (``3·s·b·a·d`` for plain multi-head
  attention, all views of the QKV matmul's output; rotary embedding and grouped-query
  attention make copies, see :func:`qkv_elements`), and the attention output the
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

A mixture-of-experts layer (:func:`moe_activation_bytes`) keeps, in place of the dense
MLP's matmul output, the router's fp32 logits and probabilities (``2·T·E``, ``T`` the
tokens the rank routes: ``s·b``, ``/tp`` under sequence parallelism) and its fp32 copy of
a 16-bit input (``T·h``), and for the ``R = T·k`` routed rows (dropless, balanced: as many
arrive as leave) the permuted input ``R·h``, the experts' first matmul output
``R·f_e/etp`` (``2·`` for SwiGLU; the activation's output is rebuilt from it in backward)
and the experts' output ``R·h`` in pair order, which the combine weights by the
probabilities (in its own dtype). The rows moved into place (the all-to-alls' buffers, the
un-permutation) keep only their indices. With expert tensor parallelism the experts take
their ``etp`` ranks' rows gathered: the permuted input and the first matmul's output are
of ``etp·R`` rows.

Under context parallelism ``s`` is the ``s/cp`` tokens of a sequence one rank holds, and
attention is the mechanism's of ``megapp.context_parallel`` whatever the backend
(:func:`context_parallel_attention_bytes`, with the volumes of docs/context_parallel.md).
"""

from __future__ import annotations

import torch

from megapp.transformer.config import TransformerConfig


def layer_activation_bytes(
    config: TransformerConfig, seq_length: int, micro_batch_size: int
) -> int:
    """Bytes one layer keeps for backward on one tensor-parallel rank, without full
    recompute (see :func:`full_recompute_layer_bytes` for that). ``seq_length``: the
    tokens of a sequence this rank holds (``s/cp`` under context parallelism)."""
    s, b, h = seq_length, micro_batch_size, config.hidden_size
    tp = config.tensor_model_parallel_size
    heads, d = config.num_attention_heads // tp, config.kv_channels
    w = config.params_dtype.itemsize
    norms = 2 * s * b * h // (tp if config.sequence_parallel else 1) * w
    fc1 = config.ffn_hidden_size * (2 if config.activation == "swiglu" else 1) // tp
    if config.context_parallel_size > 1:
        attention = context_parallel_attention_bytes(config, s, b)
        return norms + attention + s * b * (heads * d + fc1) * w  # with the output
    attention = s * b * (qkv_elements(config) + heads * d) * w  # q, k, v and the output
    if config.recompute_granularity != "selective":
        if config.attention_backend == "fused_softmax":
            scores = s * s * b * heads * w
            attention += scores * (3 if config.attention_dropout > 0 else 1)
        else:
            attention += 4 * b * heads * s
    return norms + attention + s * b * fc1 * w


def moe_routed_rows(config: TransformerConfig, seq_length: int, micro_batch_size: int) -> int:
    """Rows one rank's experts take per mixture-of-experts layer: its ``T`` tokens (``s·b``,
    ``/tp`` under sequence parallelism) times ``k``, the load balanced."""
    tokens = seq_length * micro_batch_size
    if config.sequence_parallel:
        tokens //= config.tensor_model_parallel_size
    return tokens * config.moe_router_topk


def moe_activation_bytes(config: TransformerConfig, seq_length: int, micro_batch_size: int) -> int:
    """Bytes a mixture-of-experts layer keeps beyond a dense layer of the same model
    (:func:`layer_activation_bytes` counts the dense MLP's matmul output, taken off here);
    0 for a dense model."""
    if config.num_moe_experts is None:
        return 0
    s, b, h = seq_length, micro_batch_size, config.hidden_size
    w = config.params_dtype.itemsize
    moe = config.moe_config()
    rows = moe_routed_rows(config, s, b)
    tokens = rows // config.moe_router_topk
    router = 2 * tokens * config.num_moe_experts * 4 + (tokens * h * 4 if w < 4 else 0)
    etp = moe.expert_tensor_parallel_size
    # with etp > 1 the experts take the etp ranks' rows gathered: etp·R of them
    experts = etp * rows * (h + moe.fc1_width // etp) * w + rows * h * w
    dense = config.ffn_hidden_size * (2 if config.activation == "swiglu" else 1)
    return router + experts - s * b * dense // config.tensor_model_parallel_size * w


def qkv_elements(config: TransformerConfig, *, keep=("q", "k", "v"), expand_kv=True) -> int:
    """Elements per token of the storages attention keeps for q, k and v (those named in
    ``keep``) on one rank.

    q, k and v start as views of the QKV matmul's output (``(a + 2g)·d`` per token).
    Rotary embedding gives q and k storages of their own; grouped-query attention
    copies k and v to every query head (``expand_kv``: the context-parallel mechanisms
    take them unexpanded), and copies q out of the output when a rank holds several
    groups of several heads. Whatever stays a view keeps the whole output.
    """
    tp, d = config.tensor_model_parallel_size, config.kv_channels
    heads, groups = config.num_attention_heads // tp, config.num_query_groups // tp
    per_group, rope = heads // groups, config.position_embedding_type == "rope"
    own, views_output = 0, False
    if "q" not in keep:
        pass
    elif rope or (per_group > 1 and groups > 1):
        own += heads * d  # q: rotated, or gathered out of its groups
    else:
        views_output = True
    for name, rotated in (("k", rope), ("v", False)):
        if name not in keep:
            continue
        if per_group > 1 and expand_kv:
            own += heads * d  # repeated to every query head
        elif rotated:
            own += groups * d
        else:
            views_output = True
    return own + ((heads + 2 * groups) * d if views_output else 0)


def compute_width(config: TransformerConfig) -> int:
    """Bytes per element of the context-parallel attention's arithmetic: float32 for
    16-bit models (the softmax and its statistics), the model's own width otherwise."""
    dtype = torch.promote_types(config.params_dtype, torch.float32)
    return dtype.itemsize


def context_parallel_attention_bytes(
    config: TransformerConfig, seq_length: int, micro_batch_size: int
) -> int:
    """Bytes attention keeps for backward on one tensor- and context-parallel rank under
    context parallelism (its output apart), ``seq_length`` = ``n`` = ``s/cp`` tokens.

    Per ``config.cp_comm_type``, with ``a``/``g`` query/key-value heads of this
    tensor-parallel rank, ``w`` the model's bytes per element and ``c`` the compute
    width (:func:`compute_width`):

    - ``p2p`` (ring): this rank's q, k and v (k and v unexpanded) and the log-sum-exp
      ``c·b·a·n``; the ring's other keys are only in flight (working memory);
    - ``all_gather``: q alone of the local slice, the whole sequence's keys and values
      ``2·s·b·g·d·w``, the log-sum-exp ``c·b·a·n`` and the reorder's index;
    - ``a2a``: none of the local slice; q, k and v of the whole sequence for ``a/cp``
      heads (keys and values for the ``g·f/cp`` heads of :func:`~megapp.context_parallel.
      a2a.kv_repeats`), the attention's output and log-sum-exp for them, and the three
      reorders' indices.

    Neither keeps probabilities: both attend block by block
    (:func:`~megapp.context_parallel.blocks.attend_in_tiles`).
    With selective recompute only q, k and v are kept (attention is rerun).
    """
    n, b, cp = seq_length, micro_batch_size, config.context_parallel_size
    s = n * cp
    tp, d = config.tensor_model_parallel_size, config.kv_channels
    a, g = config.num_attention_heads // tp, config.num_query_groups // tp
    w, c = config.params_dtype.itemsize, compute_width(config)
    kind = config.cp_comm_type
    if config.recompute_granularity == "selective" or kind == "p2p":
        kept = n * b * qkv_elements(config, expand_kv=False) * w
        if config.recompute_granularity == "selective":
            return kept
        return kept + c * b * a * n  # the log-sum-exp
    index = 8 * 2 * cp  # a reorder's chunk index, kept by its backward
    if kind == "all_gather":
        q = n * b * qkv_elements(config, keep=("q",)) * w  # a view keeps the QKV output
        kv = 2 * s * b * g * d * w
        return q + kv + c * b * a * n + index  # and the log-sum-exp
    from megapp.context_parallel.a2a import kv_repeats

    heads, kv_heads = a // cp, g * kv_repeats(g, cp) // cp
    return s * b * (heads * (2 * d * w + c) + 2 * kv_heads * d * w) + 3 * index


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
    width = config.params_dtype.itemsize
    tokens = seq_length * micro_batch_size // (config.tensor_model_parallel_size if sp else 1)
    return tokens * config.hidden_size * width
