"""The layouts a planner searches: every split of N devices into tensor, pipeline and data
parallel sizes with virtual stages, micro-batch sizes, recompute, ZeRO stages, sequence
parallelism and schedules that the arithmetic allows."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from megapp.models.gpt import GPTConfig
from megapp.pipeline_parallel.catalog import SCHEDULES, V_SHAPED
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


def layouts(
    base: GPTConfig,
    gpus: int,
    gpus_per_node: int,
    global_batch_size: int,
    space: Space = Space(),
) -> Iterator[Layout]:
    """Every layout of ``gpus`` devices the arithmetic allows (sizes that divide, a whole
    number of microbatches, whole chunks of layers); the schedules' own rules are left to
    :func:`~megapp.planning.layout.pretrain_config`."""
    heads, groups, layers = base.num_attention_heads, base.num_query_groups, base.num_layers
    for tp in _divisors(gpus):
        if gpus_per_node % tp or heads % tp or groups % tp:  # a tp group within one node
            continue
        for pp in _divisors(gpus // tp):
            dp = gpus // (tp * pp)
            if pp > layers or global_batch_size % dp:
                continue
            most = min(space.max_chunks, layers // pp)
            chunks = [1] + [v for v in range(2, most + 1) if layers % (pp * v) == 0]
            for vpp in chunks if pp > 1 else [1]:
                names = list(space.schedules) if pp > 1 else [None]
                names = [n for n in names if n not in V_SHAPED or vpp == 2]
                for mbs in (1 << i for i in range(space.max_micro_batch_size.bit_length())):
                    if mbs > space.max_micro_batch_size or global_batch_size % (mbs * dp):
                        continue
                    for recompute in RECOMPUTE:
                        for zero in range(4) if dp > 1 else [0]:
                            for sp in (False, True) if tp > 1 else [False]:
                                for name in names:
                                    yield Layout(tp, pp, dp, vpp, mbs, name, sp, recompute, zero)
