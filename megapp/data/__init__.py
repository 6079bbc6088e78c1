"""Data pipeline: Megatron-compatible `.bin`/`.idx` datasets, GPT samples, splits, tokenizers.

Everything here needs only numpy, so that the preprocessing tool starts quickly. The training
loop's sampler, per-chunk iterators and `get_batch` (torch) are in
`megapp.training.data_iterators`.
"""

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
from megapp.data.split_rules import DATA_RULES, blend_sizes, split_sequence_ranges
from megapp.data.token_check import check_token_ids, token_id_range
from megapp.data.tokenizers import (
    ByteTokenizer,
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    build_tokenizer,
)

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
    "blend_sizes",
    "build_blending_indices",
    "build_default_corpus",
    "build_gpt_indices",
    "build_tokenizer",
    "build_train_valid_test_datasets",
    "check_token_ids",
    "optimal_dtype",
    "parse_data_path",
    "parse_split",
    "split_sequence_ranges",
    "token_id_range",
]
