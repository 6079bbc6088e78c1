"""``--pipeline-schedule auto``: time one iteration, then search for the schedule that fits.

The first iteration runs zb-h1 (its split backward times ``F``, ``I`` and ``W`` apart)
with the timeline recorded on every rank. Every rank gathers every rank's action times,
so all derive the same per-chunk costs and the search
(:func:`~megapp.pipeline_parallel.schedule_search.search_schedule`) picks the same
schedule for every later iteration, within the activation memory 1F1B (interleaved 1F1B
with virtual stages) would hold. The chunks keep their looped placement.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from megapp.pipeline_parallel.catalog import build_schedule
from megapp.pipeline_parallel.schedule_search import costs_from_events, search_schedule
from megapp.pipeline_parallel.schedules import Schedule
from megapp.pipeline_parallel.simulate import Event, simulate

PROBE = "zb-h1"
"""The schedule of the timed first iteration."""


def probe_schedule(num_stages: int, num_microbatches: int, num_chunks: int) -> Schedule:
    return build_schedule(PROBE, num_stages, num_microbatches, num_chunks)


def choose_schedule(
    probe: Schedule, events: Sequence[Event], seconds: float
) -> tuple[Schedule, str]:
    """The searched schedule for the costs ``events`` (this rank's recorded timeline of an
    iteration of ``probe`` that took ``seconds``), and a line saying what was found.
    Collective over the default group."""
    mine = [e for e in events if e.kind == "compute"]
    gathered: list = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
    every = [e for rank_events in gathered for e in rank_events]
    costs = costs_from_events(probe, every)
    result = search_schedule(
        probe.num_stages, probe.num_microbatches, costs, num_chunks=probe.num_chunks
    )
    label, makespan, peak = result.candidates[0]
    replayed = simulate(probe, costs).makespan
    line = (
        f"pipeline schedule auto: {label}, predicted {makespan * 1e3:.1f} ms of pipeline per "
        f"iteration holding at most {peak:g} microbatch-chunks of activations; the {PROBE} "
        f"iteration it was timed on took {seconds * 1e3:.1f} ms ({replayed * 1e3:.1f} ms "
        "predicted from its own action times)"
    )
    return result.schedule, line
