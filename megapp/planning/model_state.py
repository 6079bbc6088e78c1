"""Parameters and model state (weights, gradients, optimizer states) per rank, counted.

A GPT chunk holds, per tensor-parallel rank: the word embedding's vocabulary shard and
the learned position embedding on the first virtual stage; its layers (norms whole,
QKV, projection and MLP weights split over the tensor-parallel ranks, row-parallel
biases whole); the final norm and the output layer's shard on the last stage (a copy
of the word embedding when the two are tied and live on different stages). The
vocabulary is padded as :func:`~megapp.tensor_parallel.utils.pad_vocab_size` pads it.

Model state follows megapp's buffers: weights in the parameters' dtype, an fp32
gradient per parameter, Adam's two fp32 moments and, for 16-bit weights, fp32 master
weights; ZeRO stage 1 shards the optimizer states over the data-parallel ranks, stage 2
also the gradients, stage 3 also the weights (``tools/benchmarks/zero_memory.py`` measures them
equal to the byte).

A mixture-of-experts layer holds, in place of the dense MLP, the router (``E·h``, whole),
the shared expert (split over tp) and ``E/ep`` experts split over etp; the experts' optimizer
states are sharded over the expert-data-parallel ranks (world / (etp·ep·pp)) instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megapp.models.gpt import GPTConfig
from megapp.pipeline_parallel.partition import split_layers


def _mlp_parameters(config: GPTConfig, width: int, split: int) -> int:
    """One MLP of inner ``width`` split over ``split`` ranks (row-parallel bias whole)."""
    h = config.hidden_size
    fc1_out = width * (2 if config.activation == "swiglu" else 1) // split
    fc1 = fc1_out * h + (fc1_out if config.add_bias_linear else 0)
    return fc1 + width // split * h + (h if config.add_bias_linear else 0)


def layer_parameters(config: GPTConfig, moe: bool | None = None) -> int:
    """Parameters of one transformer layer on one tensor-parallel rank. ``moe``: the layer
    is a mixture-of-experts layer (None: whether the model has experts), whose MLP is the
    router (``E·h``, whole on every rank), the shared expert (split over tp) and the rank's
    experts (:func:`expert_parameters`)."""
    tp, h = config.tensor_model_parallel_size, config.hidden_size
    d, heads, groups = config.kv_channels, config.num_attention_heads, config.num_query_groups
    norm = h * (2 if config.normalization == "LayerNorm" else 1)
    qkv_out = (heads + 2 * groups) * d // tp
    qkv = qkv_out * h + (qkv_out if config.add_bias_linear or config.add_qkv_bias else 0)
    proj = heads * d // tp * h + (h if config.add_bias_linear else 0)
    if moe is None:
        moe = config.num_moe_experts is not None
    if not moe:
        return 2 * norm + qkv + proj + _mlp_parameters(config, config.ffn_hidden_size, tp)
    shared = config.moe_shared_expert_intermediate_size
    mlp = config.num_moe_experts * h + expert_parameters(config)
    if shared:
        mlp += _mlp_parameters(config, shared, tp) + (h if config.moe_shared_expert_gate else 0)
    return 2 * norm + qkv + proj + mlp


def expert_parameters(config: GPTConfig) -> int:
    """Parameters of the experts one rank holds in one mixture-of-experts layer: ``E/ep``
    experts, each an MLP of ``moe_ffn_hidden_size`` split over etp (0 for a dense model)."""
    if config.num_moe_experts is None:
        return 0
    # the config's own fields (its checks filled in etp and the experts' width): a search
    # asks this for every chunk, where building its MoEConfig would cost more than the sum
    local = config.num_moe_experts // config.expert_model_parallel_size
    width = config.moe_ffn_hidden_size
    return local * _mlp_parameters(config, width, config.expert_tensor_parallel_size)


def moe_layer_count(config: GPTConfig, num_layers: int) -> int:
    """Mixture-of-experts layers among a chunk's ``num_layers`` layers: every
    ``moe_layer_freq``-th, counted from the chunk's first (exact for a frequency of 1)."""
    if config.num_moe_experts is None:
        return 0
    return -(-num_layers // config.moe_layer_freq)


def chunk_expert_parameters(config: GPTConfig, num_layers: int) -> int:
    """The experts' share of a chunk of ``num_layers`` layers on one rank (their gradients
    are reduced, and their optimizer states sharded, over the expert-data-parallel ranks)."""
    return moe_layer_count(config, num_layers) * expert_parameters(config)


def chunk_parameters(config: GPTConfig, stage: int, num_stages: int, num_layers: int) -> int:
    """Parameters of virtual stage ``stage`` of ``num_stages`` holding ``num_layers``
    layers, on one tensor-parallel rank."""
    return end_chunk_parameters(config, num_layers, stage == 0, stage == num_stages - 1)


def end_chunk_parameters(config: GPTConfig, num_layers: int, first: bool, last: bool) -> int:
    """Parameters of a chunk of ``num_layers`` layers on one tensor-parallel rank, with the
    embedding where it is the ``first`` stage, the output layer where the ``last``."""
    tp, h = config.tensor_model_parallel_size, config.hidden_size
    vocab = config.padded_vocab_size
    moe = moe_layer_count(config, num_layers)
    total = (num_layers - moe) * layer_parameters(config, False)
    total += moe * layer_parameters(config, True) if moe else 0
    if first:
        total += vocab // tp * h
        if config.position_embedding_type == "learned_absolute":
            total += config.max_position_embeddings * h
    if last:
        total += h * (2 if config.normalization == "LayerNorm" else 1)
        if not (config.share_embeddings_and_output_weights and first):
            total += vocab // tp * h  # its own output layer, or the tied embedding's copy
    return total


def rank_parameters(
    config: GPTConfig,
    stages: Sequence[int],
    num_stages: int,
    *,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> int:
    """Parameters one rank holds for its virtual ``stages`` (a schedule's
    ``placement[rank]``), layers split over ``num_stages`` as :func:`split_layers` does."""
    ranges = split_layers(
        config.num_layers,
        num_stages,
        first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers,
    )
    return sum(chunk_parameters(config, s, num_stages, len(ranges[s])) for s in stages)


@dataclass(frozen=True)
class ModelState:
    """Bytes of model state one rank holds between iterations."""

    weights: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer

    def __add__(self, other: ModelState) -> ModelState:
        return ModelState(
            self.weights + other.weights, self.grads + other.grads, self.optimizer + other.optimizer
        )


def optimizer_bytes_per_parameter(dtype: torch.dtype) -> int:
    """AdamW's fp32 moments, and an fp32 master copy of 16-bit weights."""
    return 8 + (4 if dtype != torch.float32 else 0)


def model_state(
    parameters: int, dtype: torch.dtype, dp: int = 1, zero_stage: int = 0
) -> ModelState:
    """Model state of ``parameters`` parameters in ``dtype`` under ZeRO ``zero_stage`` over
    ``dp`` data-parallel ranks."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    optimizer = optimizer_bytes_per_parameter(dtype)
    return ModelState(
        weights=dtype.itemsize * parameters / (dp if zero_stage >= 3 else 1),
        grads=4 * parameters / (dp if zero_stage >= 2 else 1),
        optimizer=optimizer * parameters / (dp if zero_stage >= 1 else 1),
    )
