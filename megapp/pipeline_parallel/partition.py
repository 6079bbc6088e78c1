"""Split a stack of layers into contiguous pipeline stages.

Stages are virtual stages: with ``p`` ranks and ``v`` chunks per rank there
are ``p·v`` of them, and virtual stage ``s`` lives on rank ``s % p`` as chunk
``s // p``. Every split covers every layer exactly once; one that cannot
raises ``ValueError`` saying what to change.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from itertools import accumulate, pairwise

import torch
from torch import nn


def split_layers(
    num_layers: int,
    num_stages: int,
    *,
    sizes: Sequence[int] | None = None,
    weights: Sequence[float] | None = None,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> list[range]:
    """The layer indices of every stage.

    Args:
        sizes: explicit layer counts per stage.
        weights: one cost per layer (parameters or time); stages are balanced
            to minimize the most expensive stage.
        first_stage_layers / last_stage_layers: fix the first/last stage's
            count (e.g. lighter because it also holds the embedding or the
            loss); the rest are split evenly.
    Without any of these, layers are split evenly; counts differ by at most one.
    """
    if num_layers < 1 or num_stages < 1:
        raise ValueError(
            f"need num_layers >= 1 and num_stages >= 1, got {num_layers}, {num_stages}"
        )
    if (
        sum(x is not None for x in (sizes, weights))
        + (first_stage_layers is not None or last_stage_layers is not None)
        > 1
    ):
        raise ValueError("give at most one of sizes, weights, or first/last stage layer counts")
    if sizes is not None:
        sizes = list(sizes)
    elif weights is not None:
        if len(weights) != num_layers:
            raise ValueError(f"got {len(weights)} layer weights for {num_layers} layers")
        sizes = _balanced_sizes(list(weights), num_stages)
    elif first_stage_layers is not None or last_stage_layers is not None:
        sizes = _uneven_ends(num_layers, num_stages, first_stage_layers, last_stage_layers)
    else:
        _check_enough(num_layers, num_stages)
        base, extra = divmod(num_layers, num_stages)
        sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
    if len(sizes) != num_stages or any(n < 1 for n in sizes) or sum(sizes) != num_layers:
        raise ValueError(
            f"stage sizes {sizes} must be {num_stages} positive counts summing to "
            f"{num_layers} layers (sum is {sum(sizes)})"
        )
    bounds = [0, *accumulate(sizes)]
    return [range(a, b) for a, b in pairwise(bounds)]


def nearest_multiples(value: int, step: int) -> str:
    """The multiples of ``step`` around ``value``, for a message's hint: ``"6 or 9"``."""
    lower, upper = value // step * step, (value // step + 1) * step
    return f"{upper}" if lower == 0 else f"{lower} or {upper}"


def check_layer_split(num_layers: int, pp: int, vpp: int | None = None) -> None:
    """Megatron's rule for an even split: ``num_layers`` divides by the ``pp × vpp``
    virtual stages (an uneven first or last stage is asked for explicitly)."""
    stages = pp * (vpp or 1)
    if num_layers % stages == 0:
        return
    if vpp is None:
        layout = f"pipeline_model_parallel_size ({pp})"
    else:
        layout = (
            f"pipeline_model_parallel_size × virtual_pipeline_model_parallel_size "
            f"({pp} × {vpp} = {stages})"
        )
    raise ValueError(
        f"num_layers ({num_layers}) is not divisible by {layout}; use "
        f"{nearest_multiples(num_layers, stages)} layers or another layout"
    )


def virtual_stages(num_layers: int, pp: int, layers_per_virtual_stage: int) -> int | None:
    """Model chunks per pipeline rank when each virtual stage holds
    ``layers_per_virtual_stage`` layers (Megatron's way of asking for the interleaved
    schedule); None when that leaves one chunk per rank."""
    if pp < 2:
        raise ValueError(
            "num_layers_per_virtual_pipeline_stage needs pipeline_model_parallel_size >= 2; "
            "drop it or use more pipeline stages"
        )
    group = pp * layers_per_virtual_stage
    if num_layers % group:
        raise ValueError(
            f"num_layers ({num_layers}) is not divisible by pipeline_model_parallel_size × "
            f"num_layers_per_virtual_pipeline_stage ({pp} × {layers_per_virtual_stage} = "
            f"{group}); use {nearest_multiples(num_layers, group)} layers or change the two sizes"
        )
    chunks = num_layers // group
    return chunks if chunks > 1 else None


def _check_enough(num_layers: int, num_stages: int) -> None:
    if num_layers < num_stages:
        raise ValueError(
            f"cannot split {num_layers} layers into {num_stages} stages: every stage needs at "
            "least one layer; use fewer pipeline stages or virtual chunks"
        )


def _uneven_ends(
    num_layers: int, num_stages: int, first: int | None, last: int | None
) -> list[int]:
    ends = [n for n in (first, last) if n is not None]
    if any(n < 1 for n in ends):
        raise ValueError(f"first/last stage layer counts must be >= 1, got {first}, {last}")
    if num_stages == 1:
        raise ValueError("first/last stage layer counts need at least 2 stages")
    middle_stages = num_stages - len(ends)
    middle_layers = num_layers - sum(ends)
    if middle_stages == 0:
        if middle_layers != 0:
            raise ValueError(
                f"first + last stage layers ({sum(ends)}) must equal num_layers ({num_layers}) "
                "with 2 stages"
            )
        return ends
    if middle_layers < middle_stages or middle_layers % middle_stages:
        raise ValueError(
            f"after the first/last stages, {middle_layers} layers remain for {middle_stages} "
            f"stages; they must split evenly with at least one layer each"
        )
    middle = [middle_layers // middle_stages] * middle_stages
    return ([first] if first is not None else []) + middle + ([last] if last is not None else [])


def _balanced_sizes(weights: list[float], num_stages: int) -> list[int]:
    """Contiguous split minimizing the heaviest stage (linear partition, dynamic programming)."""
    n = len(weights)
    _check_enough(n, num_stages)
    prefix = [0.0, *accumulate(weights)]
    inf = float("inf")
    # best[k][i]: least possible heaviest stage when the first i layers form k stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    sizes, i = [], n
    for k in range(num_stages, 0, -1):
        sizes.append(i - cut[k][i])
        i = cut[k][i]
    return sizes[::-1]


def parameter_counts(layers: Sequence[nn.Module]) -> list[float]:
    """Weights for :func:`split_layers`: each layer's number of parameters."""
    return [float(sum(p.numel() for p in layer.parameters())) for layer in layers]


def measured_times(
    layers: Sequence[nn.Module],
    example_input: torch.Tensor,
    repeats: int = 3,
    timer: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """Weights for :func:`split_layers`: each layer's forward+backward time on
    ``example_input`` (the best of ``repeats``), feeding each layer the previous one's output."""
    times, x = [], example_input
    for layer in layers:
        best = float("inf")
        for _ in range(repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            start = timer()
            out = layer(inp)
            out.float().sum().backward()
            best = min(best, timer() - start)
        layer.zero_grad(set_to_none=True)
        times.append(best)
        x = out.detach()
    return times


def rank_chunks(stage_ranges: Sequence[range], num_ranks: int, rank: int) -> list[range]:
    """The layer ranges of ``rank``'s model chunks: chunk ``c`` is virtual stage ``c·p + rank``."""
    if len(stage_ranges) % num_ranks:
        raise ValueError(
            f"{len(stage_ranges)} virtual stages do not divide over {num_ranks} pipeline ranks"
        )
    return list(stage_ranges[rank::num_ranks])
