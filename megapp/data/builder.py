"""Train/valid/test datasets from `--data-path` and `--split`, Megatron-Core's way.

`--data-path` is one path prefix, or alternating weights and prefixes
(`30 corpusA_text_document 70 corpusB_text_document`). `--split` weights the
train/valid/test shares of every prefix; how a share becomes a range of sequences and
how a blend sizes its members are `split_rules` (Megatron-Core's by default, legacy
Megatron-LM's on request). With several prefixes, every split is a blend of that split
of each prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from megapp.data.blended_dataset import BlendedDataset, default_blend_cache_dir
from megapp.data.gpt_dataset import GPTDataset
from megapp.data.indexed_dataset import IndexedDataset
from megapp.data.split_rules import (
    CORE,
    blend_shares,
    blend_sizes,
    check_rules,
    normalize,
    split_sequence_ranges,
)

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
    return normalize(parts)


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
    if any(not w > 0 for w in weights):
        raise ValueError(f"--data-path weights must be positive, got {words[0::2]}")
    return words[1::2], weights


def _describe_split(
    prefix: str, num_sequences: int, split: str, ranges: Sequence[tuple[int, int] | None]
) -> str:
    """`"the 5 sequences of PREFIX split '1,1,1' as train 2, valid 1, test 2"`."""
    counts = ", ".join(
        f"{name} {0 if r is None else r[1] - r[0]}"
        for name, r in zip(SPLIT_NAMES, ranges, strict=True)
    )
    noun = "sequence" if num_sequences == 1 else "sequences"
    return f"the {num_sequences} {noun} of {prefix} split {split!r} as {counts}"


def build_train_valid_test_datasets(
    data_path: str | Sequence[str],
    split: str,
    num_samples: Sequence[int | None],
    sequence_length: int,
    seed: int = 1234,
    cache: bool = True,
    cache_dir: str | None = None,
    rules: str = CORE,
    warn: Callable[[str], None] | None = None,
) -> tuple[Any, Any, Any]:
    """Datasets for train, valid and test; None for a split that gets no sequences.

    Args:
        data_path: see the module docstring.
        split: train/valid/test weights, e.g. "969,30,1".
        num_samples: samples wanted per split (train_iters · global_batch_size, ...);
            None for one epoch (a single prefix only).
        sequence_length: model sequence length.
        seed: shuffle seed.
        cache, cache_dir: index caching, see GPTDataset.
        rules: `core` (Megatron-Core) or `legacy` (legacy Megatron-LM), see split_rules.
        warn: called with one line for each valid or test split that is asked for samples
            but gets no sequences (evaluation on it is skipped); None stays silent.

    Raises:
        ValueError: for bad settings, and when samples are asked of a train split that
            gets no sequences (a dataset too small for `split`).
    """
    check_rules(rules)
    prefixes, weights = parse_data_path(data_path)
    fractions = parse_split(split)
    # Weights make a blend, even of one prefix (`--data-path 1 A`), as in Megatron-Core.
    blended = weights is not None
    if blended and any(n is None for n in num_samples):
        raise ValueError("a blend of datasets needs a sample count for every split")
    # Sized from the weights normalised once; the blend normalises these once more.
    shares = blend_shares(weights, rules) if blended else None
    sizes = [blend_sizes(weights, n, rules) if blended else None for n in num_samples]
    indexed = [IndexedDataset(prefix) for prefix in prefixes]
    ranges = [split_sequence_ranges(fractions, len(d), rules) for d in indexed]
    # Per split asked for samples: how the first prefix with no sequences for it splits.
    empty: list[str | None] = [None] * len(SPLIT_NAMES)
    for prefix, dataset, split_ranges in zip(prefixes, indexed, ranges, strict=True):
        for s, sequence_range in enumerate(split_ranges):
            if sequence_range is None and num_samples[s] and empty[s] is None:
                empty[s] = _describe_split(prefix, len(dataset), split, split_ranges)
    if empty[0] is not None:
        raise ValueError(
            f"the train split gets no sequences: {empty[0]}; "
            "give more data or a larger train share of the split"
        )
    if warn is not None:
        for s in (1, 2):
            if empty[s] is not None and all(r[s] is None for r in ranges):
                name = SPLIT_NAMES[s]
                warn(f"warning: no {name} data: {empty[s]}; evaluation on {name} data is skipped")
    per_prefix = []
    for i, (dataset, split_ranges) in enumerate(zip(indexed, ranges, strict=True)):
        splits = []
        for s, sequence_range in enumerate(split_ranges):
            if sequence_range is None:
                splits.append(None)
                continue
            wanted = sizes[s][0][i] if blended else num_samples[s]
            splits.append(
                GPTDataset(
                    dataset,
                    wanted,
                    sequence_length,
                    seed,
                    sequence_range,
                    SPLIT_NAMES[s],
                    cache=cache,
                    cache_dir=cache_dir,
                )
            )
        per_prefix.append(splits)
    if not blended:
        return tuple(per_prefix[0])
    blend_dir = cache_dir if cache_dir is not None else default_blend_cache_dir(prefixes)
    result = []
    for s in range(len(SPLIT_NAMES)):
        members = [splits[s] for splits in per_prefix]
        if all(m is None for m in members):
            result.append(None)
            continue
        if any(m is None for m in members):
            empty_prefixes = [p for p, m in zip(prefixes, members, strict=True) if m is None]
            raise ValueError(f"split {SPLIT_NAMES[s]!r} gets no sequences of {empty_prefixes}")
        result.append(BlendedDataset(members, shares, sizes[s][1], blend_dir if cache else None))
    return tuple(result)
