"""Split a stack of layers into contiguous pipeline stages.

Stages are virtual stages: with ``p`` ranks and ``v`` chunks per rank there
are ``p·v`` of them, and virtual stage ``s`` lives on rank ``s % p`` as chunk
``s // p`` (the looped placement; a schedule may place them otherwise). Every
split covers every layer exactly once; one that cannot raises ``ValueError``
saying what to change.

A model's split (:func:`stage_layer_ranges`) is Megatron's: even over the ``p·v``
virtual stages, or with the first and/or last pipeline rank's layer count given
(``num_layers_in_first_pipeline_stage``, ``num_layers_in_last_pipeline_stage``) and
the rest even over the other ranks; each rank's layers split evenly over its chunks. Or
the embedding and/or the loss count as one layer each
(``account_for_embedding_in_pipeline_split``, ``account_for_loss_in_pipeline_split``):
the counted layers split evenly over the virtual stages, and the first (last) virtual
stage holds one transformer layer fewer, none where it holds one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from itertools import accumulate, pairwise

import torch
from torch import nn

from megapp.pipeline_parallel.schedules import looped_placement

FIRST, LAST = "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"
EMBEDDING, LOSS = "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"


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


def check_layer_split(
    num_layers: int,
    pp: int,
    vpp: int | None = None,
    *,
    first: int | None = None,
    last: int | None = None,
    embedding: bool = False,
    loss: bool = False,
) -> None:
    """Megatron's rules for a model's split (:func:`rank_layer_counts`,
    :func:`counted_stage_sizes`): without a ``first`` or ``last`` pipeline rank's count,
    nor the ``embedding`` or the ``loss`` counted as a layer, ``num_layers`` divides by the
    ``pp × vpp`` virtual stages."""
    if embedding or loss:
        counted_stage_sizes(
            num_layers, pp, vpp, embedding=embedding, loss=loss, first=first, last=last
        )
        return
    if first is not None or last is not None:
        rank_layer_counts(num_layers, pp, vpp, first=first, last=last)
        return
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


def rank_layer_counts(
    num_layers: int,
    pp: int,
    vpp: int | None = None,
    *,
    first: int | None = None,
    last: int | None = None,
) -> list[int]:
    """The layers each pipeline rank holds over its ``vpp`` chunks (Megatron-Core's
    uneven split): ``first`` on rank 0 and ``last`` on rank ``pp - 1`` where given, the
    rest evenly over the other ranks; every rank's count divides by ``vpp``, so each of
    its chunks holds the same number, at least one. Raises ``ValueError`` naming the
    fields to change."""
    v = vpp or 1
    if first is None and last is None:
        check_layer_split(num_layers, pp, vpp)
        return [num_layers // pp] * pp
    given = {name: n for name, n in ((FIRST, first), (LAST, last)) if n is not None}
    for name, n in given.items():
        if n < 1:
            raise ValueError(f"{name} must be >= 1, got {n}")
        if n % v:
            raise ValueError(
                f"{name} ({n}) is not divisible by virtual_pipeline_model_parallel_size ({v}): "
                f"the rank's {v} chunks hold equal shares; use {nearest_multiples(n, v)}"
            )
    names = " and ".join(given)
    if pp < 2:
        raise ValueError(
            f"{names} {'need' if len(given) > 1 else 'needs'} pipeline_model_parallel_size "
            f">= 2, got {pp}; drop {'them' if len(given) > 1 else 'it'} or use more pipeline "
            "stages"
        )
    middle_ranks = pp - len(given)
    middle_layers = num_layers - sum(given.values())
    if middle_ranks == 0 and middle_layers != 0:
        raise ValueError(
            f"with {pp} pipeline stages, {names} ({' + '.join(map(str, given.values()))}) "
            f"must add up to num_layers ({num_layers})"
        )
    group = middle_ranks * v
    if middle_ranks and (middle_layers < group or middle_layers % group):
        chunks = f" ({v} chunks each)" if v > 1 else ""
        leave = "leave" if len(given) > 1 else "leaves"
        raise ValueError(
            f"{names} {leave} {middle_layers} of num_layers ({num_layers}) to the other "
            f"{middle_ranks} pipeline stages{chunks}, which must divide them evenly with at "
            "least one layer per chunk"
        )
    counts = [middle_layers // middle_ranks if middle_ranks else 0] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def stage_layer_ranges(
    num_layers: int,
    pp: int,
    vpp: int | None = None,
    *,
    first: int | None = None,
    last: int | None = None,
    placement: Sequence[Sequence[int]] | None = None,
    embedding: bool = False,
    loss: bool = False,
) -> list[range]:
    """The layers of every virtual stage, in stage order: the stage that runs as one of
    rank ``r``'s chunks under ``placement`` (``placement[rank][chunk]``, default looped)
    holds ``1/vpp`` of rank ``r``'s layers (:func:`rank_layer_counts`); with the
    ``embedding`` or the ``loss`` counted as a layer, :func:`counted_stage_sizes` (the
    first virtual stage, or the last, may hold none)."""
    v = vpp or 1
    if embedding or loss:
        sizes = counted_stage_sizes(
            num_layers, pp, vpp, embedding=embedding, loss=loss, first=first, last=last
        )
        bounds = [0, *accumulate(sizes)]
        return [range(a, b) for a, b in pairwise(bounds)]
    if first is None and last is None:
        check_layer_split(num_layers, pp, vpp)
        return split_layers(num_layers, pp * v)
    counts = rank_layer_counts(num_layers, pp, vpp, first=first, last=last)
    rank_of = {
        stage: rank
        for rank, row in enumerate(placement or looped_placement(pp, v))
        for stage in row
    }
    return split_layers(num_layers, pp * v, sizes=[counts[rank_of[s]] // v for s in range(pp * v)])


def counted_stage_sizes(
    num_layers: int,
    pp: int,
    vpp: int | None = None,
    *,
    embedding: bool = False,
    loss: bool = False,
    first: int | None = None,
    last: int | None = None,
) -> list[int]:
    """Layers of every virtual stage, in stage order, with the ``embedding`` and/or the
    ``loss`` counted as a layer of the split (Megatron-Core's
    ``--account-for-embedding-in-pipeline-split``, ``--account-for-loss-in-pipeline-split``):
    ``num_layers`` plus those split evenly over the ``pp`` ranks and each rank's over its
    ``vpp`` chunks; virtual stage 0 then holds one transformer layer fewer for the
    embedding and the last one fewer for the loss, which leaves a stage of one counted
    layer with none (an embedding-only or loss-only chunk). Raises ``ValueError`` naming
    what to change; the first/last ranks' counts (``first``, ``last``) cannot go with it."""
    given = [name for name, on in ((EMBEDDING, embedding), (LOSS, loss)) if on]
    if first is not None or last is not None:
        raise ValueError(
            f"{FIRST} and {LAST} cannot go with {' and '.join(given)}: give the ranks' "
            "counts or count the embedding and the loss as layers, not both"
        )
    v = vpp or 1
    counted = num_layers + embedding + loss
    what = f"num_layers ({num_layers}) + {' + '.join(g.split('_')[2] for g in given)}"
    if counted % pp:
        raise ValueError(
            f"{what} = {counted} is not divisible by pipeline_model_parallel_size ({pp}); use "
            f"{nearest_multiples(counted, pp)} counted layers or another pipeline size"
        )
    if (counted // pp) % v:
        raise ValueError(
            f"{what} = {counted} leaves {counted // pp} per pipeline rank, which is not "
            f"divisible by virtual_pipeline_model_parallel_size ({v})"
        )
    sizes = [counted // (pp * v)] * (pp * v)
    sizes[0] -= embedding
    sizes[-1] -= loss
    if min(sizes) < 0 or sum(sizes) != num_layers:
        raise ValueError(f"{what} is too few to split over {pp * v} virtual stages")
    return sizes


def virtual_stages(
    num_layers: int, pp: int, layers_per_virtual_stage: int, *, counted: int = 0
) -> int | None:
    """Model chunks per pipeline rank when each virtual stage holds
    ``layers_per_virtual_stage`` layers (Megatron's way of asking for the interleaved
    schedule), ``counted`` more layers counted in the split (the embedding, the loss:
    :func:`counted_stage_sizes`); None when that leaves one chunk per rank."""
    if pp < 2:
        raise ValueError(
            "num_layers_per_virtual_pipeline_stage needs pipeline_model_parallel_size >= 2; "
            "drop it or use more pipeline stages"
        )
    group = pp * layers_per_virtual_stage
    total = num_layers + counted
    if total % group:
        what = f"num_layers ({num_layers})" if not counted else f"num_layers + {counted} ({total})"
        raise ValueError(
            f"{what} is not divisible by pipeline_model_parallel_size × "
            f"num_layers_per_virtual_pipeline_stage ({pp} × {layers_per_virtual_stage} = "
            f"{group}); use {nearest_multiples(total, group)} layers or change the two sizes"
        )
    chunks = total // group
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
