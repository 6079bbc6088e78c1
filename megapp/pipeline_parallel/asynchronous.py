"""PipeDream and PipeDream-2BW: pipelines that never flush, as schedules over iterations.

Both keep 1F1B's order (``w = p - r - 1`` warmup forwards on rank ``r``, then one
forward and one backward at a time) across the iterations of one run, with no flush
between them: the next iteration's forwards fill the pipeline while the last one's
backwards drain it. The price is that a microbatch's forward may run on weights that
are already some steps old; its backward must then use those same weights, which the
engine keeps (*weight stashing*, :mod:`megapp.pipeline_parallel.weight_stash`). Each
rank steps its optimizer (an ``U`` action) on its own, when its share of the gradient
is complete; no step waits for another stage.

- **PipeDream** steps after every microbatch's backward (a microbatch is its batch).
  Rank ``r``'s forward of microbatch ``g`` sees ``max(0, g - w_r)`` steps, so the
  stages of one microbatch use different versions and rank ``r`` holds up to
  ``p - r`` of them. With *vertical sync* every stage uses the version the first
  stage used, ``max(0, g - (p - 1))``, and so holds up to ``p``: a later stage keeps
  each version from its own step until the microbatches of the first stage's reach it.
- **PipeDream-2BW** sums the gradients of an iteration's ``m`` microbatches and steps
  once, after the iteration's last backward; every microbatch of iteration ``t`` runs
  on the weights of step ``t - 1`` on every stage, so
  ``W(t+1) = W(t) - lr·∇f(W(t-1))`` and no rank holds more than two versions. It
  needs ``m >= p - 1`` so that version exists when iteration ``t`` starts.

A run of several iterations still ends with a flush (the engine runs one schedule at a
time); the training loop runs as many iterations in one schedule as it can. 2BW's
delay spans runs: iteration 0 of a run uses the weights before the previous run's last
step (version -1), which the engine keeps between runs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from megapp.pipeline_parallel.schedules import (
    Action,
    MicrobatchCountError,
    Op,
    Schedule,
    check_sizes,
)


def _one_chunk(name: str, num_chunks: int) -> None:
    if num_chunks != 1:
        raise ValueError(
            f"{name} runs one model chunk per rank, got num_chunks={num_chunks}; "
            "it has no virtual pipeline stages"
        )


def _no_flush(
    num_stages: int, total: int, steps_after: set[int]
) -> tuple[tuple[tuple[Action, ...], ...], tuple[int, ...]]:
    """1F1B over ``total`` microbatches, with an update after the backward of every
    microbatch in ``steps_after`` (numbered in order on every rank)."""
    per_rank, warmups = [], []
    for rank in range(num_stages):
        warmup = min(num_stages - rank - 1, total)
        actions = [Action(Op.FORWARD, g) for g in range(warmup)]
        updates = 0
        for k in range(total):
            if warmup + k < total:
                actions.append(Action(Op.FORWARD, warmup + k))
            actions.append(Action(Op.BACKWARD, k))
            if k in steps_after:
                actions.append(Action(Op.UPDATE, updates))
                updates += 1
        per_rank.append(tuple(actions))
        warmups.append(warmup)
    return tuple(per_rank), tuple(warmups)


def pipedream(
    num_stages: int,
    num_microbatches: int,
    num_chunks: int = 1,
    *,
    iterations: int = 1,
    vertical_sync: bool = False,
) -> Schedule:
    """PipeDream with weight stashing over ``iterations`` of ``num_microbatches`` each:
    one optimizer step per microbatch, no flush until the run ends (see the module
    docstring); ``vertical_sync`` makes every stage use the first stage's version."""
    check_sizes(num_stages, num_microbatches, num_chunks)
    check_sizes(num_stages, iterations, 1)
    _one_chunk("pipedream", num_chunks)
    p, total = num_stages, num_microbatches * iterations
    actions, warmup = _no_flush(p, total, set(range(total)))
    first = warmup[0]
    versions = tuple(
        tuple(max(0, g - (first if vertical_sync else w)) for g in range(total)) for w in warmup
    )
    name = "pipedream-vsync" if vertical_sync else "pipedream"
    return Schedule(
        name,
        p,
        total,
        1,
        actions,
        warmup,
        update_interval=1,
        iterations=iterations,
        versions=versions,
    )


def pipedream_2bw(
    num_stages: int, num_microbatches: int, num_chunks: int = 1, *, iterations: int = 1
) -> Schedule:
    """PipeDream-2BW over ``iterations`` of ``num_microbatches`` each: one optimizer step
    per iteration, every stage running iteration ``t`` on the weights of step ``t - 1``,
    no flush until the run ends (see the module docstring)."""
    check_sizes(num_stages, num_microbatches, num_chunks)
    check_sizes(num_stages, iterations, 1)
    _one_chunk("pipedream-2bw", num_chunks)
    p, m = num_stages, num_microbatches
    if m < p - 1:
        raise MicrobatchCountError(
            f"pipedream-2bw needs at least p - 1 = {p - 1} microbatches per iteration, got "
            f"{m}: iteration t's first forward would need the weights of step t - 1 before "
            "the first stage has made them"
        )
    total = m * iterations
    actions, warmup = _no_flush(p, total, {t * m + m - 1 for t in range(iterations)})
    versions = tuple(tuple(g // m - 1 for g in range(total)) for _ in range(p))
    return Schedule(
        "pipedream-2bw",
        p,
        total,
        1,
        actions,
        warmup,
        update_interval=m,
        iterations=iterations,
        versions=versions,
    )


def in_flight_across_steps(actions: Sequence[Action]) -> set[tuple[int, int]]:
    """The (microbatch, chunk)s of one rank's ``actions`` whose backward runs after a step
    their forward did not see."""
    started, straddling = {}, set()
    for index, action in enumerate(actions):
        key = (action.microbatch, action.chunk)
        if action.op is Op.FORWARD:
            started[key] = index
        elif action.op is Op.BACKWARD and any(
            a.op is Op.UPDATE for a in actions[started[key] : index]
        ):
            straddling.add(key)
    return straddling


def stash_profile(schedule: Schedule, rank: int) -> tuple[int, int]:
    """``(versions, copies)``: the most weight versions ``rank`` holds at once, the current
    ones included, and the most frozen copies of weights it keeps beside the live ones.

    A version is held from the step that makes it (version -1 from the start) until the
    backward of the last microbatch that uses it. It needs a copy from the moment a
    microbatch that runs on it is in flight across a step: the optimizer changes the live
    weights in place, so such a microbatch runs on a copy even when its version is the
    current one. The live weights and a copy of the same version then both exist, so
    ``copies`` is ``versions`` where that happens (PipeDream's ranks before the last,
    2BW while one iteration's backwards overlap the next one's forwards) and
    ``versions - 1`` elsewhere. :class:`~megapp.pipeline_parallel.weight_stash.WeightStash`
    keeps exactly these."""
    actions = schedule.actions[rank]
    users = Counter(schedule.version(rank, a.microbatch) for a in actions if a.op is Op.FORWARD)
    straddling = in_flight_across_steps(actions)
    carries = any(v < 0 for v in users)
    keep = sum(a.op is Op.UPDATE for a in actions) - 1 if carries else None
    copies: set[int] = {-1} if carries else set()
    current, versions, peak_copies = 0, 1, len(copies)

    def drop(version: int) -> None:
        if version != keep and version != current and users[version] <= 0:
            copies.discard(version)

    for action in actions:
        version = schedule.version(rank, action.microbatch)
        if action.op is Op.FORWARD and version == current:
            if (action.microbatch, action.chunk) in straddling:
                copies.add(version)
        elif action.op is Op.BACKWARD:
            users[version] -= 1
            drop(version)
        elif action.op is Op.UPDATE:
            if users[current] > 0 or current == keep:
                copies.add(current)
            current += 1
            drop(current - 1)
        versions = max(versions, len(copies | {current}))
        peak_copies = max(peak_copies, len(copies))
    return versions, peak_copies


def held_versions(schedule: Schedule) -> list[int]:
    """The most weight versions each rank holds at once, the current ones included
    (:func:`stash_profile`): PipeDream ``p - r`` on rank ``r`` (``p`` with vertical sync),
    2BW 2."""
    return [stash_profile(schedule, rank)[0] for rank in range(schedule.num_stages)]
