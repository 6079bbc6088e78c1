"""Train/valid/test datasets from `--data-path` and `--split`, Megatron's way.

`--data-path` is one path prefix, or alternating weights and prefixes
(`30 corpusA_text_document 70 corpusB_text_document`). `--split` weights the
train/valid/test shares of every prefix's documents (`969,30,1`); each split is a
contiguous run of documents, so no document is in two splits. With several
prefixes, every split is a blend of that split of each prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megapp.data.blended_dataset import (
    BlendedDataset,
    blend_sample_counts,
    default_blend_cache_dir,
)
from megapp.data.gpt_dataset import GPTDataset
from megapp.data.indexed_dataset import IndexedDataset

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str) -> list[float]:
    """`"969,30,1"` -> train/valid/test fractions summing to 1 (missing parts are 0)."""
    try:
        parts = [float(p) for p in split.replace("/", ",").split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"split {split!r} must be up to 3 comma-separated numbers") from None
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ValueError(f"split {split!r} must be up to 3 non-negative numbers, not all 0")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [p / total for p in parts]


def split_document_ranges(fractions: Sequence[float], num_documents: int) -> list[tuple[int, int]]:
    """Document ranges `[start, stop)` per split: each boundary advances by
    `round(fraction · documents)`, then all boundaries shift so the last is exact."""
    bounds = [0]
    for fraction in fractions:
        bounds.append(bounds[-1] + round(fraction * float(num_documents)))
    overshoot = bounds[-1] - num_documents
    bounds[1:] = [b - overshoot for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(len(fractions))]


def parse_data_path(data_path: str | Sequence[str]) -> tuple[list[str], list[float] | None]:
    """Prefixes and weights from `--data-path` words; weights are None for one bare prefix."""
    words = [data_path] if isinstance(data_path, str) else list(data_path)
    if len(words) == 1:
        return words, None
    if len(words) % 2:
        raise ValueError(f"--data-path needs one prefix or weight/prefix pairs, got {words}")
    try:
        weights = [float(w) for w in words[0::2]]
    except ValueError:
        raise ValueError(f"--data-path weights must be numbers, got {words[0::2]}") from None
    return words[1::2], weights


def build_train_valid_test_datasets(
    data_path: str | Sequence[str],
    split: str,
    num_samples: Sequence[int | None],
    sequence_length: int,
    seed: int = 1234,
    cache: bool = True,
    cache_dir: str | None = None,
) -> tuple[Any, Any, Any]:
    """Datasets for train, valid and test; None for a split that gets no documents.

    Args:
        data_path: see the module docstring.
        split: train/valid/test weights, e.g. "969,30,1".
        num_samples: samples wanted per split (train_iters · global_batch_size, ...);
            None for one epoch (a single prefix only).
        sequence_length: model sequence length.
        seed: shuffle seed.
        cache, cache_dir: index caching, see GPTDataset.
    """
    prefixes, weights = parse_data_path(data_path)
    fractions = parse_split(split)
    if weights is not None and len(prefixes) > 1 and any(n is None for n in num_samples):
        raise ValueError("a blend of datasets needs a sample count for every split")
    per_prefix = []
    for i, prefix in enumerate(prefixes):
        indexed = IndexedDataset(prefix)
        ranges = split_document_ranges(fractions, indexed.num_documents)
        splits = []
        for name, (start, stop), target in zip(SPLIT_NAMES, ranges, num_samples, strict=True):
            if stop == start:
                splits.append(None)
                continue
            wanted = target
            if weights is not None and len(prefixes) > 1:
                wanted = blend_sample_counts(weights, target)[i]
            splits.append(
                GPTDataset(
                    indexed,
                    wanted,
                    sequence_length,
                    seed,
                    (start, stop),
                    name,
                    cache=cache,
                    cache_dir=cache_dir,
                )
            )
        per_prefix.append(splits)
    if len(prefixes) == 1:
        return tuple(per_prefix[0])
    blend_dir = cache_dir if cache_dir is not None else default_blend_cache_dir(prefixes)
    result = []
    for s, target in enumerate(num_samples):
        members = [splits[s] for splits in per_prefix]
        if all(m is None for m in members):
            result.append(None)
            continue
        if any(m is None for m in members):
            empty = [p for p, m in zip(prefixes, members, strict=True) if m is None]
            raise ValueError(f"split {SPLIT_NAMES[s]!r} gets no documents of {empty}")
        result.append(BlendedDataset(members, weights, target, blend_dir if cache else None))
    return tuple(result)
