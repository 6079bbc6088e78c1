"""What one transformer layer's backward has alive at its peak beyond what the layer
keeps: the working bytes :mod:`megapp.planning.memory` adds to a chunk's backward. Each is
the most of the layer's moments, read off the operators megapp's layers run with the
weights' gradients added into buffers that exist (as into a data-parallel gradient
buffer), and held to what a layer allocates by ``tests/test_live_memory.py``."""

from __future__ import annotations

import dataclasses

from megapp.models.gpt import GPTConfig
from megapp.planning.activations import (
    context_parallel_attention_bytes,
    moe_routed_rows,
    qkv_elements,
)
from megapp.planning.attention_working import attention_working_bytes

__all__ = [
    "dense_backward_bytes",
    "dense_input_grad_bytes",
    "layer_backward_bytes",
    "moe_backward_bytes",
]


def moe_backward_bytes(config: GPTConfig, seq_length: int, mbs: int) -> int:
    """Working bytes of a mixture-of-experts layer's backward above what it held, the most
    of four moments (``R`` routed rows of ``T`` tokens in pair order, ``M = etp·R`` rows on
    the experts, ``L`` local experts of width ``f`` on the rank, ``n·f`` of it out of their
    first matmul, ``c`` the wider of the weights' dtype and the router's float32):

    - the weighted sum's: the rows' gradient ``R·h`` in their dtype and its product with
      the rows ``R·h`` in ``c``, the gradients of the ``[T, k]`` weights, and for 16-bit
      weights the output's gradient widened, ``T·h`` in ``c``;
    - the second matmul's: the activation rebuilt and its gradient (``M·f`` each), and the
      local experts' weight gradient ``L·f·h`` (one grouped matmul for them all);
    - the first matmul's: its weight gradient ``L·h·n·f`` (its input gradient takes the
      place of the held rows');
    - the activation's: its gradient ``M·f`` and its input's ``M·n·f``, the rows' output
      ``R·h`` freed.

    Each equals what megapp's layer allocates, on one rank with ``R`` rows, to within the
    routing's ``[T, k]`` tensors (``tests/test_live_memory.py``)."""
    s, b, h, w = seq_length, mbs, config.hidden_size, config.params_dtype.itemsize
    moe = config.moe_config()
    etp = moe.expert_tensor_parallel_size
    rows = moe_routed_rows(config, s, b)
    tokens, on_experts = rows // moe.moe_router_topk, etp * rows
    f, fc1, local = moe.moe_ffn_hidden_size // etp, moe.fc1_width // etp, moe.num_local_experts
    wide = max(w, 4)
    weighted_sum = rows * h * (w + wide) + rows * 4 + (tokens * h * wide if w < wide else 0)
    second = (2 * on_experts * f + local * f * h) * w
    first = local * h * fc1 * w
    activation = (on_experts * (f + fc1) - rows * h) * w
    return max(weighted_sum, second, first, activation)


def dense_backward_bytes(config: GPTConfig, seq_length: int, mbs: int) -> int:
    """Working bytes of a dense layer's backward above what it held, the most of five
    moments (``t = s·b`` rows, ``f`` the MLP's width on the rank, ``n·f`` out of its first
    matmul; the weights' gradients added into buffers that exist, as into a data-parallel
    gradient buffer):

    - the second MLP matmul's: the gradient of the MLP's output ``t·h``, the activation
      rebuilt and its gradient (``t·f`` each) and the weight's gradient ``h·f``;
    - SwiGLU's: its gradient ``t·f`` and its input's ``2·t·f`` (GeLU's two ``t·f`` stay
      below the second matmul's moment);
    - the first matmul's: its weight gradient ``h·n·f`` and its input's ``t·h``, beside the
      norm's output rebuilt for it ``t·h``;
    - the attention projection's: its weight gradient, its input's and its output's
      ``t·h`` each, the MLP's kept output freed (the peak with a single key/value group,
      whose QKV weight is small);
    - the QKV matmul's: its weight gradient, beside its input's and the fused q, k, v
      gradient, once the MLP's kept output and attention's kept q, k, v are freed; the
      peak where the tokens are few against the width (not counted under context
      parallelism, whose attention keeps other tensors and has a moment of its own).

    Counted on one rank: each equals what a layer allocates to within 0.7%
    (``tests/test_live_memory.py``: GeLU and SwiGLU, grouped queries, RoPE, selective
    recompute, biases, bfloat16)."""
    t, h, w = seq_length * mbs, config.hidden_size, config.params_dtype.itemsize
    tp, d = config.tensor_model_parallel_size, config.kv_channels
    f = config.ffn_hidden_size // tp
    n = 2 if config.activation == "swiglu" else 1
    qkv_width = (config.num_attention_heads + 2 * config.num_query_groups) // tp * d
    second = t * h + 2 * t * f + h * f
    activation = 3 * t * f if n == 2 else 0
    first = h * n * f + 2 * t * h
    projection = h * config.num_attention_heads // tp * d + 2 * t * h - n * t * f
    qkv = 0
    if config.context_parallel_size == 1:
        kept = t * qkv_elements(config) + n * t * f  # freed by the QKV matmul's moment
        qkv = h * qkv_width + t * h + t * qkv_width - kept
    return max(second, activation, first, projection, qkv) * w


def dense_input_grad_bytes(config: GPTConfig, seq_length: int, mbs: int, incoming: bool) -> int:
    """Working bytes of a dense layer's input half of a split backward (``I``) above what
    it held, the most of four moments (``t = s·b`` rows, ``f`` the MLP's width on the rank,
    ``n·f`` out of its first matmul, ``a`` attention's width, ``q`` the elements per token
    of attention's q, k and v). ``I`` defers the weights' gradients, and the store that
    ``W`` will read keeps what a whole backward frees as it goes: the MLP's output gradient,
    the activation and the second norm's output rebuilt, the first matmul's output
    gradient (``2·h + f + n·f`` per row), while the first matmul's input ``n·f`` is freed:

    - the activation's: the MLP's output gradient ``t·h``, the activation rebuilt, its
      gradient and its input's (``t·f``, ``t·f``, ``n·t·f``);
    - the second norm's: those the store keeps, the norm's output rebuilt and its
      gradient through the first matmul, the norm's input gradient (``4·t·h + t·f``);
    - attention's: the attention block's input gradient beside the MLP's store
      (``3·t·h + t·f``), the projection's input gradient ``t·a`` and q, k and v's ``t·q``
      (with the scores materialized, the larger of those and the softmax's output and
      input gradients, ``2·s`` per token and head);
    - the first norm's: the MLP's store and the fused QKV gradient in place of q, k and v,
      the norm's output rebuilt, its gradient through the QKV matmul and the norm's input
      gradient (``6·t·h + t·f``).

    ``incoming``: the layer's output gradient is a tensor of this backward (the layer is
    not the chunk's last), alive through the MLP's moments. Counted on one rank, as
    :func:`dense_backward_bytes`."""
    t, h, w = seq_length * mbs, config.hidden_size, config.params_dtype.itemsize
    tp, d = config.tensor_model_parallel_size, config.kv_channels
    f = config.ffn_hidden_size // tp
    n = 2 if config.activation == "swiglu" else 1
    a = config.num_attention_heads // tp * d
    given = h if incoming else 0
    activation = given + h + 2 * f + n * f
    second_norm = given + 4 * h + f
    grads = qkv_elements(config)  # q, k and v's gradients, or the scores' and their input's
    if config.attention_backend == "fused_softmax" and config.context_parallel_size == 1:
        grads = max(grads, 2 * seq_length * config.num_attention_heads // tp)
    attention = 3 * h + f + a + grads
    first_norm = 6 * h + f
    return max(activation, second_norm, attention, first_norm) * t * w


def layer_backward_bytes(
    config: GPTConfig,
    seq_length: int,
    mbs: int,
    fused_attention: bool = False,
    experts: bool = False,
    incoming: bool | None = None,
) -> int:
    """Working bytes of one layer's backward above what it held: a dense layer's
    (:func:`dense_backward_bytes`, or for the input half of a split backward, where
    ``incoming`` says whether the layer's output gradient is made by this backward or
    received, :func:`dense_input_grad_bytes`; None: a whole backward) or a
    mixture-of-experts layer's (``experts``: :func:`moe_backward_bytes`, whole or split),
    or, where it is larger,
    context-parallel attention's backward
    (:func:`~megapp.planning.attention_working.attention_working_bytes`; with selective
    recompute it first rebuilds what attention keeps; ``fused_attention``: its blocks run
    in the fused kernel, as on a CPU)."""
    s, b = seq_length, mbs
    if experts:  # the routed experts' weight gradients are not deferred: I works as B
        mlp = moe_backward_bytes(config, s, b)
        if incoming:  # beside the layer's output gradient
            tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
            mlp += s * b // tp * config.hidden_size * config.params_dtype.itemsize
    elif incoming is not None:
        mlp = dense_input_grad_bytes(config, s, b, incoming)
    else:
        mlp = dense_backward_bytes(config, s, b)
    if config.context_parallel_size == 1:
        return mlp
    attention = attention_working_bytes(config, s, b, True, fused_attention)
    if config.recompute_granularity == "selective":  # the rerun forward's kept tensors
        rerun = dataclasses.replace(config, recompute_granularity=None)
        attention += context_parallel_attention_bytes(rerun, s, b)
        attention -= context_parallel_attention_bytes(config, s, b)
    return max(mlp, attention)
