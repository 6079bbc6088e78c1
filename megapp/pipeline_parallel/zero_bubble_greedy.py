"""The zero-bubble list scheduler (Qi et al., "Zero Bubble Pipeline Parallelism", 2023) and
ZB-H2, the schedule it makes with every rank capped at ``2p - 1`` microbatches.

:func:`greedy` advances time event by event: a rank runs a ready ``I`` first, else a ready
forward while its held activations stay under its cap, and a deferred ``W`` where it fits
in a gap or frees memory a forward waits for. It decides actions in order of time, so its
first decisions (:func:`greedy_actions` with ``decisions``) leave every rank's list a
prefix of its whole one: :func:`zb_h2_opening`, what a planner reads a floor on memory from
before building the schedule.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence

from megapp.pipeline_parallel.schedules import (
    Action,
    Op,
    Schedule,
    check_sizes,
    looped_placement,
)
from megapp.pipeline_parallel.simulate import CostModel

F, B, I, W = Op.FORWARD, Op.BACKWARD, Op.INPUT_GRAD, Op.WEIGHT_GRAD


def greedy(
    name: str,
    num_stages: int,
    num_microbatches: int,
    num_chunks: int,
    placement: Sequence[Sequence[int]],
    memory_limit: Sequence[float],
    costs: CostModel | None = None,
    split_backward: bool = True,
) -> Schedule:
    """List-schedule every rank's actions against ``costs`` (the zero-bubble heuristic):
    :func:`greedy_actions`, all of them, as a :class:`Schedule`."""
    placement = tuple(tuple(row) for row in placement)
    args = (num_stages, num_microbatches, num_chunks, placement, memory_limit, costs)
    actions = greedy_actions(name, *args, split_backward=split_backward)
    return Schedule(name, num_stages, num_microbatches, num_chunks, actions, placement=placement)


def greedy_actions(
    name: str,
    num_stages: int,
    num_microbatches: int,
    num_chunks: int,
    placement: Sequence[Sequence[int]],
    memory_limit: Sequence[float],
    costs: CostModel | None = None,
    split_backward: bool = True,
    decisions: int | None = None,
) -> tuple[tuple[Action, ...], ...]:
    """Every rank's actions as the zero-bubble heuristic orders them against ``costs``;
    with ``decisions``, only the first that many it decides (over all ranks), which leaves
    each rank's list a prefix of its whole one.

    Time advances event by event; a rank free at time ``t`` picks, among what is ready
    then: an input gradient (or whole backward), oldest first; else a forward if its
    held activations (``costs.memory``) stay within ``memory_limit[rank]``, deepest
    stage first; else its oldest deferred ``W``. Messages arrive ``p2p_latency`` after
    the action that produced them, as on a transport whose sends finish in the
    background. ``split_backward=False`` makes every backward one ``B``.

    Raises ValueError when a limit is too small for any forward to run.
    """
    check_sizes(num_stages, num_microbatches, num_chunks)
    costs = costs or CostModel()
    p, m, v = num_stages, num_microbatches, num_chunks
    placement = tuple(tuple(row) for row in placement)
    last = p * v - 1
    where = {stage: r for r, row in enumerate(placement) for stage in row}
    # (0 forward or 1 backward, microbatch, stage) -> finish time; W feeds no one
    done: dict[tuple[int, int, int], float] = {}
    clock, held = [0.0] * p, [0.0] * p
    next_f = [[0] * v for _ in range(p)]
    next_b = [[0] * v for _ in range(p)]
    deferred: list[deque[Action]] = [deque() for _ in range(p)]
    actions: list[list[Action]] = [[] for _ in range(p)]
    backward = I if split_backward else B

    def latency(rank: int, peer_stage: int) -> float:
        """A message from another rank takes the latency; one within the rank none."""
        return 0.0 if where.get(peer_stage, rank) == rank else costs.p2p_latency

    # what a proposal reads, per [rank][chunk]: the latency of a message from the stage
    # before and after (none from its own rank)
    from_prev = [[latency(r, s - 1) for s in row] for r, row in enumerate(placement)]
    from_next = [[latency(r, s + 1) for s in row] for r, row in enumerate(placement)]
    # every action's time and change in held memory, per op, [rank][chunk] (the same for
    # every microbatch): what a proposal reads of a forward's activations and a W's time
    priced = {
        op: (
            [[costs.time(r, Action(op, 0, c)) for c in range(v)] for r in range(p)],
            [[costs.memory(r, Action(op, 0, c)) for c in range(v)] for r in range(p)],
        )
        for op in (F, backward, W)
    }
    forward_memory, weight_time = priced[F][1], priced[W][0]

    def ready_at(rank: int, op: Op, chunk: int) -> float | None:
        """When the next ``op`` of ``chunk`` on ``rank`` has its input, if known."""
        stage = placement[rank][chunk]
        if op is F:
            mb = next_f[rank][chunk]
            if mb >= m:
                return None
            if stage == 0:
                return 0.0
            t = done.get((0, mb, stage - 1))
            return None if t is None else t + from_prev[rank][chunk]
        mb = next_b[rank][chunk]
        if mb >= m:
            return None
        t = done.get((0, mb, stage))
        if t is None or stage == last:
            return t
        t = done.get((1, mb, stage + 1))
        return None if t is None else t + from_next[rank][chunk]

    # a proposal's priorities per [rank][chunk]: the first stage's input gradient feeds no
    # one, so forwards go first there; among forwards the deepest stage first
    urgency = [[2 if stage == 0 else 0 for stage in row] for row in placement]
    depth = [[-stage for stage in row] for row in placement]
    chunks = range(v)

    def proposal(rank: int) -> tuple[float, Op, int] | None:
        """What ``rank`` would start next and when, from what is known now."""
        work = []  # (start, priority, tiebreak, op, chunk)
        memory_blocked = backward_now = False
        soonest = math.inf
        now, ready_now, holding = clock[rank], ready[rank], held[rank]
        limit = memory_limit[rank] + 1e-9
        for chunk in chunks:
            t_forward, t_backward = ready_now[chunk]
            if t_backward is not None:
                start = t_backward if t_backward > now else now
                work.append((start, urgency[rank][chunk], next_b[rank][chunk], backward, chunk))
                soonest = min(soonest, start)
                backward_now = backward_now or start <= now
            if t_forward is not None:
                if holding + forward_memory[rank][chunk] <= limit:
                    start = t_forward if t_forward > now else now
                    work.append((start, 1, depth[rank][chunk], F, chunk))
                    soonest = min(soonest, start)
                else:
                    memory_blocked = True
        if deferred[rank]:
            chunk = deferred[rank][0].chunk
            # a W fills a gap it fits in (or nothing else is ready), or frees memory a
            # forward waits for
            if soonest >= now + weight_time[rank][chunk] or (memory_blocked and not backward_now):
                return now, W, chunk
        if not work:
            return None
        start, _, _, op, chunk = min(work)
        return start, op, chunk

    total = m * v * p * (3 if split_backward else 2)
    if decisions is not None:
        total = min(total, decisions)

    # A rank's proposal reads its own state and when its stages' neighbours finished: an
    # action changes only its own rank's and the ranks holding the next and previous stage.
    def readiness(rank: int, chunk: int) -> list[float | None]:
        return [ready_at(rank, F, chunk), ready_at(rank, backward, chunk)]

    # ready_at of every [rank][chunk]'s next forward and backward, refreshed as they change
    ready = [[readiness(r, c) for c in range(v)] for r in range(p)]
    chunk_of = {stage: c for row in placement for c, stage in enumerate(row)}
    proposals = [proposal(rank) for rank in range(p)]
    # the proposals by start, the lowest rank first among equal starts; an entry is stale
    # once its rank has proposed again
    queue = [(found[0], rank) for rank, found in enumerate(proposals) if found is not None]
    heapq.heapify(queue)
    for _ in range(total):
        while queue:  # drop the stale entries on top
            start, rank = queue[0]
            found = proposals[rank]
            if found is not None and found[0] == start:
                break
            heapq.heappop(queue)
        if not queue:
            raise ValueError(
                f"{name}: no rank can run anything under activation limits {list(memory_limit)}; "
                "a limit must allow at least one forward beyond what the pipeline needs"
            )
        rank = heapq.heappop(queue)[1]
        start, op, chunk = proposals[rank]
        stage = placement[rank][chunk]
        if op is W:
            action = deferred[rank].popleft()
        else:
            counter = next_f if op is F else next_b
            action = Action(op, counter[rank][chunk], chunk)
            counter[rank][chunk] += 1
            if op is I:
                deferred[rank].append(Action(W, action.microbatch, chunk))
        seconds, memory = priced[op]
        end = start + seconds[rank][chunk]
        if op is not W:  # its own next action of the chunk, and the stage it feeds
            done[(int(op is not F), action.microbatch, stage)] = end
            ready[rank][chunk] = readiness(rank, chunk)
            fed = stage + 1 if op is F else stage - 1
            if 0 <= fed <= last:
                peer, peer_chunk = where[fed], chunk_of[fed]
                ready[peer][peer_chunk][op is not F] = ready_at(peer, op, peer_chunk)
        clock[rank] = end
        held[rank] += memory[rank][chunk]
        actions[rank].append(action)
        neighbours = (where[s] for s in (stage - 1, stage + 1) if 0 <= s <= last)
        for changed in {rank, *neighbours}:
            found = proposals[changed] = proposal(changed)
            if found is not None:
                heapq.heappush(queue, (found[0], changed))
    return tuple(map(tuple, actions))


def zb_h2(num_stages: int, num_microbatches: int, num_chunks: int = 1) -> Schedule:
    """ZB-H2: every rank may hold ``2p - 1`` microbatches (``v`` times as many
    chunk-activations), enough that the bubble nearly vanishes at uniform costs."""
    return greedy("zb-h2", *_zb_h2_inputs(num_stages, num_microbatches, num_chunks))


def zb_h2_opening(
    num_stages: int, num_microbatches: int, num_chunks: int = 1
) -> tuple[tuple[Action, ...], ...]:
    """Every rank's first actions under :func:`zb_h2`, each a prefix of its whole list:
    the greedy's first ``p·v·(2p + 2)`` decisions, about the first ``2p + 2`` units of
    time (a unit is one microbatch's forward through a rank's chunks), by which rank 0
    holds the most microbatches between forward and input gradient it ever does (only
    deferred ``W``s pile up later). What a rank holds over them bounds from below what it
    holds over the whole schedule, at a fraction ``(2p + 2) / 3m`` of the cost."""
    p, v = num_stages, num_chunks
    decisions = p * v * (2 * p + 2)
    return greedy_actions("zb-h2", *_zb_h2_inputs(p, num_microbatches, v), decisions=decisions)


def _zb_h2_inputs(p: int, m: int, v: int) -> tuple:
    """:func:`greedy`'s sizes, placement, caps and costs for ZB-H2."""
    limits = [float(v * (2 * p - 1))] * p
    return p, m, v, looped_placement(p, v), limits, CostModel(forward=1.0 / v, backward=2.0 / v)
