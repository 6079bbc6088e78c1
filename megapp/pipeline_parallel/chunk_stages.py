"""Which virtual stage a model chunk was built for, recorded on the chunk and checked
against the schedule that runs it.

A builder (:func:`~megapp.models.gpt.build_gpt_chunks`) marks each chunk with its
virtual stage and, where it knows it, the whole pipeline's placement
(``placement[rank][chunk]``). :func:`check_chunk_stages` runs before the engine sends
anything: a chunk built for another stage (a V-shaped schedule run on chunks built for
the looped placement, say) would otherwise fail with a shape error on one rank while its
peers wait for it. Since every rank's chunks record the same placement, every rank sees
the mistake, even one whose own chunks happen to sit where the schedule wants them, and
all of them raise.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from megapp.pipeline_parallel.schedules import Schedule

Placement = tuple[tuple[int, ...], ...]


def mark_chunk_stage(
    chunk: nn.Module, stage: int, placement: Sequence[Sequence[int]] | None
) -> None:
    """Record that ``chunk`` runs virtual ``stage`` of a pipeline laid out as
    ``placement`` (None: only the stage is known)."""
    chunk.pipeline_stage = stage
    chunk.pipeline_placement = None if placement is None else _as_tuples(placement)


def _as_tuples(placement: Sequence[Sequence[int]]) -> Placement:
    return tuple(tuple(row) for row in placement)


def chunk_stage(chunk: nn.Module) -> tuple[int | None, Placement | None]:
    """``(stage, placement)`` recorded on ``chunk`` or on the module it wraps (a
    data-parallel wrapper's ``module``); ``(None, None)`` for an unmarked chunk."""
    module: nn.Module | None = chunk
    while module is not None:
        if hasattr(module, "pipeline_stage"):
            return module.pipeline_stage, module.pipeline_placement
        inner = getattr(module, "module", None)
        module = inner if isinstance(inner, nn.Module) else None
    return None, None


def check_chunk_stages(schedule: Schedule, pp_rank: int, chunks: Sequence[nn.Module]) -> None:
    """Raise ``ValueError`` unless every marked chunk of ``pp_rank`` was built for the
    virtual stage ``schedule`` places there, and for ``schedule``'s placement."""
    for index, chunk in enumerate(chunks):
        stage, placement = chunk_stage(chunk)
        want = schedule.virtual_stage(pp_rank, index)
        if stage is not None and stage != want:
            raise ValueError(
                f"model chunk {index} of pipeline rank {pp_rank} was built for virtual stage "
                f"{stage}, but {schedule.name} runs virtual stage {want} there; build the "
                "chunks for the schedule (build_gpt_chunks(..., schedule=...))"
            )
        if placement is not None and placement != _as_tuples(schedule.placement):
            raise ValueError(
                f"the model chunks were built for the placement {placement} "
                f"(placement[rank][chunk] is a virtual stage), but {schedule.name} places "
                f"them as {schedule.placement}; build the chunks for the schedule "
                "(build_gpt_chunks(..., schedule=...))"
            )
