"""How `--split` and `--data-path` weights become per-dataset ranges and sample counts.

Two rule sets, chosen with `--data-rules`; both split a dataset over its *sequences*
(a document written with several sequences, e.g. sentences, can straddle two splits):

- `core` (default): Megatron-Core's `BlendedMegatronDatasetBuilder`.
  * Split i is sequences `[round(c[i]·N), round(c[i+1]·N))` where `c` are the cumulative
    sums of the normalised weights (`c[0] = 0`); a split whose weight is 0 is absent.
  * A blend of `n` samples asks dataset d for `ceil(ceil(n·w_d)·1.005)` samples and has
    `Σ_d ceil(n·w_d)` samples itself.
- `legacy`: legacy Megatron-LM's GPT path, to reproduce an older run.
  * Boundary i advances by `round(w_i·N)`, then every boundary shifts so the last
    equals the sequence count N.
  * A blend of `n` samples asks dataset d for `ceil(n·w_d·1.005)` samples and has the
    sum of those itself.

The blend weights `w_d` are the `--data-path` weights normalised once (numpy's sum for
`core`, a left-to-right sum for `legacy`); the blend normalises them once more (numpy)
before choosing its order. Normalising is not idempotent in floating point
(`0.6, 0.3, 0.1` sums to 0.9999999999999999), so the count of normalisations matters.
All arithmetic is float64 in Megatron's order of operations (Python's round-half-to-even
included), so boundaries, sizes and order agree to the last sample.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from megapp.data.blended_dataset import normalize_weights

CORE = "core"
LEGACY = "legacy"
DATA_RULES = (CORE, LEGACY)
# Extra samples asked of each member of a blend, so the greedy blending order (which can
# run ahead of a dataset's exact share by one sample) never exhausts it.
BLEND_SURPLUS = 0.005


def check_rules(rules: str) -> str:
    if rules not in DATA_RULES:
        raise ValueError(f"data rules {rules!r} unknown; choose one of {', '.join(DATA_RULES)}")
    return rules


def normalize(weights: Sequence[float]) -> list[float]:
    """Weights divided by their float64 sum (numpy's, as Megatron-Core does), as floats."""
    return normalize_weights(weights).tolist()


def blend_shares(weights: Sequence[float], rules: str = CORE) -> list[float]:
    """`--data-path` weights normalised once, as the rule's builder does before it sizes
    the blend and hands the weights to it.

    `legacy` sums left to right in Python; numpy's sum groups eight or more weights
    differently, so the two can differ in the last bit.
    """
    shares = normalize(weights)  # validates the weights
    if check_rules(rules) == CORE:
        return shares
    total = 0.0
    for weight in weights:
        total += float(weight)
    return [float(weight) / total for weight in weights]


def split_bookends(fractions: Sequence[float]) -> list[tuple[float, float] | None]:
    """`[(c[i], c[i+1])]` from the cumulative sums of `fractions`; None for a zero share."""
    cumulative = [0.0]
    for fraction in fractions:
        cumulative.append(cumulative[-1] + fraction)
    return [(low, high) if high > low else None for low, high in itertools.pairwise(cumulative)]


def core_sequence_ranges(
    fractions: Sequence[float], num_sequences: int
) -> list[tuple[int, int] | None]:
    """Megatron-Core's split: sequence ranges from rounded cumulative bookends."""
    n = float(num_sequences)
    return [
        None if ends is None else (round(ends[0] * n), round(ends[1] * n))
        for ends in split_bookends(fractions)
    ]


def legacy_sequence_ranges(fractions: Sequence[float], num_sequences: int) -> list[tuple[int, int]]:
    """Legacy Megatron-LM's split: sequence ranges, each advancing by `round(w·N)`, then
    shifted so the last boundary is exact."""
    bounds = [0]
    for fraction in fractions:
        bounds.append(bounds[-1] + round(fraction * float(num_sequences)))
    overshoot = bounds[-1] - num_sequences
    bounds[1:] = [b - overshoot for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(len(fractions))]


def split_sequence_ranges(
    fractions: Sequence[float], num_sequences: int, rules: str = CORE
) -> list[tuple[int, int] | None]:
    """Per split, the `[start, stop)` sequences it holds, or None when it holds none.

    Args:
        fractions: normalised train/valid/test weights.
        num_sequences: the dataset's sequence count.
        rules: `core` or `legacy` (see the module docstring).
    """
    if check_rules(rules) == CORE:
        ranges = core_sequence_ranges(fractions, num_sequences)
    else:
        ranges = legacy_sequence_ranges(fractions, num_sequences)
    return [None if r is None or r[0] >= r[1] else r for r in ranges]


def blend_sizes(weights: Sequence[float], size: int, rules: str = CORE) -> tuple[list[int], int]:
    """Samples to ask of each dataset of a blend of `size` samples, and the blend's length.

    `weights` are the `--data-path` weights, normalised here once (`blend_shares`). See
    the module docstring for the two rules.
    """
    shares = blend_shares(weights, rules)
    if rules == CORE:
        targets = [math.ceil(size * w) for w in shares]
        asked = [math.ceil(t * (1 + BLEND_SURPLUS)) for t in targets]
        return asked, sum(targets)
    asked = [math.ceil(size * w * (1 + BLEND_SURPLUS)) for w in shares]
    return asked, sum(asked)
