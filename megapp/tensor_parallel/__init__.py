"""Tensor parallelism: parallel layers, region mappings, vocab-parallel loss, RNG and recompute."""

from megapp.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megapp.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    init_method_normal,
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
from megapp.tensor_parallel.random import (
    DATA_PARALLEL_RNG_TRACKER_NAME,
    MODEL_PARALLEL_RNG_TRACKER_NAME,
    RNGStatesTracker,
    checkpoint,
    get_rng_tracker,
    model_parallel_manual_seed,
)
from megapp.tensor_parallel.utils import pad_vocab_size, vocab_range

__all__ = [
    "DATA_PARALLEL_RNG_TRACKER_NAME",
    "MODEL_PARALLEL_RNG_TRACKER_NAME",
    "ColumnParallelLinear",
    "RNGStatesTracker",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "checkpoint",
    "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "get_rng_tracker",
    "init_method_normal",
    "model_parallel_manual_seed",
    "pad_vocab_size",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "vocab_parallel_cross_entropy",
    "vocab_range",
]
