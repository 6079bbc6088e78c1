"""The layouts a planner searches: every split of N devices into tensor, pipeline and data
parallel sizes with virtual stages, micro-batch sizes, recompute, ZeRO stages, sequence
parallelism and schedules that the arithmetic allows."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from megapp.models.gpt import GPTConfig
from megapp.pipeline_parallel.catalog import SCHEDULE_KINDS, SCHEDULES
from megapp.planning.layout import RECOMPUTE, Layout


@dataclass(frozen=True)
class Space:
    """Limits of the search: micro-batch sizes (powers of two) up to
    ``max_micro_batch_size``, up to ``max_chunks`` virtual stages per rank, ``schedules``."""

    max_micro_batch_size: int = 8
    max_chunks: int = 8
    schedules: tuple[str, ...] = tuple(SCHEDULES)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _splits(base: GPTConfig, gpus: int, gpus_per_node: int) -> list[tuple[int, int]]:
    """Every (tp, pp): tp divides the devices, a node (a tp group within one node) and the
    heads; pp divides what tp leaves and is at most the layers."""
    heads, groups, layers = base.num_attention_heads, base.num_query_groups, base.num_layers
    return [
        (tp, pp)
        for tp in _divisors(gpus)
        if not (gpus_per_node % tp or heads % tp or groups % tp)
        for pp in _divisors(gpus // tp)
        if pp <= layers
    ]


def _schedule_names(layers: int, pp: int, space: Space) -> list[tuple[int, list]]:
    """Each number of chunks per pipeline rank (whole chunks of layers) with the schedules
    that run it (the V-shaped ones need exactly two)."""
    if pp == 1:
        return [(1, [None])]
    most = min(space.max_chunks, layers // pp)
    chunks = [1] + [v for v in range(2, most + 1) if layers % (pp * v) == 0]
    return [
        (v, [n for n in space.schedules if not SCHEDULE_KINDS[n].v_shaped or v == 2])
        for v in chunks
    ]


def layouts(
    base: GPTConfig,
    gpus: int,
    gpus_per_node: int,
    global_batch_size: int,
    space: Space = Space(),
) -> Iterator[Layout]:
    """Every layout of ``gpus`` devices the arithmetic allows (sizes that divide, a whole
    number of microbatches, whole chunks of layers); the schedules' own rules are left to
    :func:`~megapp.planning.layout.pretrain_config`. :func:`why_empty` says which rule
    left none."""
    for tp, pp in _splits(base, gpus, gpus_per_node):
        dp = gpus // (tp * pp)
        if global_batch_size % dp:
            continue
        for vpp, names in _schedule_names(base.num_layers, pp, space):
            for mbs in (1 << i for i in range(space.max_micro_batch_size.bit_length())):
                if mbs > space.max_micro_batch_size or global_batch_size % (mbs * dp):
                    continue
                for recompute in RECOMPUTE:
                    for zero in range(4) if dp > 1 else [0]:
                        for sp in (False, True) if tp > 1 else [False]:
                            for name in names:
                                yield Layout(tp, pp, dp, vpp, mbs, name, sp, recompute, zero)


def why_empty(
    base: GPTConfig,
    gpus: int,
    gpus_per_node: int,
    global_batch_size: int,
    space: Space = Space(),
) -> str:
    """Which rule of :func:`layouts` left no layout (tp = pp = 1 and one sample per
    microbatch always pass theirs): the data-parallel sizes the global batch must divide,
    or the V-shaped schedules' two chunks per pipeline rank."""
    splits = _splits(base, gpus, gpus_per_node)
    sizes = sorted({gpus // (tp * pp) for tp, pp in splits})
    if all(global_batch_size % dp for dp in sizes):
        return (
            f"global batch {global_batch_size} is not divisible by any data-parallel size "
            f"that {gpus} GPUs leave ({', '.join(map(str, sizes))}: GPUs / (tp × pp), tp "
            f"dividing a node's {gpus_per_node} GPUs and the model's "
            f"{base.num_attention_heads} heads, pp up to its {base.num_layers} layers); use "
            f"a multiple of {sizes[0]}"
        )
    return (
        f"the schedules {', '.join(space.schedules)} run two chunks per pipeline rank, and "
        f"no pipeline size that global batch {global_batch_size} allows gives two (the "
        f"model's {base.num_layers} layers, at most {space.max_chunks} chunks per rank); add "
        "a schedule of one chunk per rank"
    )
