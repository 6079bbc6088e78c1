"""Several datasets mixed by weight, sample by sample, in a fixed greedy order.

Sample i of the blend comes from the dataset whose share so far lags its weight
the most: the one maximising `weight_d · max(i, 1) − taken_d` (ties go to the
lower index). This is Megatron's blending rule; at every prefix of the blend each
dataset's count is within about one sample of `weight · i`, so any training run,
however short, sees the intended mixture.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from megapp.data.index_cache import load_or_build

# Part of every cache key: bump it when the blending arithmetic changes.
BLEND_FORMAT_VERSION = 2


def normalize_weights(weights: Sequence[float]) -> np.ndarray:
    """Weights as float64 summing to 1; all must be non-negative with a positive sum."""
    array = np.asarray(weights, dtype=np.float64)
    if array.ndim != 1 or len(array) == 0 or np.any(array < 0) or array.sum() <= 0:
        raise ValueError(f"blend weights must be non-negative with a positive sum, got {weights}")
    return array / array.sum()


def build_blending_indices(shares: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Which dataset, and which of its samples, serves each of `size` blended samples.

    Args:
        shares: each dataset's share of the blend, used as given (BlendedDataset passes
            its normalised weights; normalising again would change the order).
        size: number of blended samples.

    Returns:
        dataset_index `[size] int16` and dataset_sample_index `[size] int64` (the
        running count of samples already taken from that dataset).
    """
    shares = [float(w) for w in shares]
    if not shares or any(not w >= 0 for w in shares):
        raise ValueError(f"blend shares must be non-negative, got {shares}")
    taken = [0] * len(shares)
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    for i in range(size):
        scale = float(max(i, 1))
        best, best_error = 0, shares[0] * scale - taken[0]
        for d in range(1, len(shares)):
            error = shares[d] * scale - taken[d]
            if error > best_error:
                best, best_error = d, error
        dataset_index[i] = best
        dataset_sample_index[i] = taken[best]
        taken[best] += 1
    return dataset_index, dataset_sample_index


class BlendedDataset:
    """`size` samples drawn from `datasets` in proportion to `weights`.

    Args:
        datasets: map-style datasets; dataset d must hold at least as many samples as
            the blend takes from it (about `weight_d · size`, see `split_rules.blend_sizes`).
        weights: relative weights, normalised here once (the builder hands over the
            `--data-path` weights already normalised once, as Megatron's builders do).
        size: number of blended samples.
        cache_dir: where to cache the blending indices (None: no cache). The key
            includes each dataset's `description` when it has one.
    """

    def __init__(
        self,
        datasets: Sequence[Any],
        weights: Sequence[float],
        size: int,
        cache_dir: str | None = None,
    ) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.size = int(size)
        self.description = {
            "class": type(self).__name__,
            "format": BLEND_FORMAT_VERSION,
            "weights": self.weights.tolist(),
            "size": self.size,
            "datasets": [getattr(d, "description", len(d)) for d in self.datasets],
        }
        arrays, self.built_anew = load_or_build(
            cache_dir,
            "blend",
            self.description,
            ("dataset_index", "dataset_sample_index"),
            lambda: dict(
                zip(
                    ("dataset_index", "dataset_sample_index"),
                    build_blending_indices(self.weights, self.size),
                    strict=True,
                )
            ),
        )
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        counts = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for d, (count, dataset) in enumerate(zip(counts, self.datasets, strict=True)):
            if count > len(dataset):
                raise ValueError(
                    f"the blend takes {count} samples from dataset {d}, which has {len(dataset)}"
                )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> Any:
        """Sample `idx` of the blend: a sample of one of the member datasets."""
        idx = int(idx)
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for {self.size} samples")
        dataset = self.datasets[int(self.dataset_index[idx])]
        return dataset[int(self.dataset_sample_index[idx])]


def default_blend_cache_dir(path_prefixes: Sequence[str]) -> str:
    """The directory of the first dataset, where its own indices are cached too."""
    return os.path.dirname(os.path.abspath(path_prefixes[0]))
