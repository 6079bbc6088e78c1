"""Data pipeline: Megatron-compatible `.bin`/`.idx` datasets, GPT samples, samplers, tokenizers.

Everything here needs only numpy, except `get_batch` and
`get_ltor_masks_and_position_ids` (torch), which load on first use so that the
preprocessing tool starts quickly.
"""

from typing import Any

from megapp.data.blended_dataset import BlendedDataset, build_blending_indices
from megapp.data.builder import (
    build_train_valid_test_datasets,
    parse_data_path,
    parse_split,
)
from megapp.data.corpus import build_default_corpus
from megapp.data.gpt_dataset import GPTDataset
from megapp.data.gpt_indices import build_gpt_indices
from megapp.data.indexed_dataset import (
    DTYPE_CODES,
    IndexedDataset,
    IndexedDatasetBuilder,
    optimal_dtype,
)
from megapp.data.samplers import MegatronPretrainingSampler, build_pretraining_data_loader
from megapp.data.split_rules import DATA_RULES, blend_sizes, split_sequence_ranges
from megapp.data.token_check import check_token_ids, token_id_range
from megapp.data.tokenizers import (
    ByteTokenizer,
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    build_tokenizer,
)

_TORCH_NAMES = ("get_batch", "get_ltor_masks_and_position_ids")


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        from megapp.data import batch

        return getattr(batch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DATA_RULES",
    "DTYPE_CODES",
    "BlendedDataset",
    "ByteTokenizer",
    "GPT2BPETokenizer",
    "GPTDataset",
    "HuggingFaceTokenizer",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "MegatronPretrainingSampler",
    "blend_sizes",
    "build_blending_indices",
    "build_default_corpus",
    "build_gpt_indices",
    "build_pretraining_data_loader",
    "build_tokenizer",
    "build_train_valid_test_datasets",
    "check_token_ids",
    "get_batch",
    "get_ltor_masks_and_position_ids",
    "optimal_dtype",
    "parse_data_path",
    "parse_split",
    "split_sequence_ranges",
    "token_id_range",
]
