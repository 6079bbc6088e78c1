"""Zero-bubble schedules: backwards split into ``I`` and ``W``, and the V placement.

Splitting a backward lets a rank send the input gradient upstream as soon as it
has it (``I``) and compute the weight gradients (``W``) later, where it would
otherwise wait (Qi et al., "Zero Bubble Pipeline Parallelism", 2023).

- :func:`zb_h1` is 1F1B (or interleaved 1F1B) with each rank's weight
  gradients held back by its distance from the last stage, the construction
  torch.distributed.pipelining's interleaved zero-bubble schedule uses.
- ZB-H2 comes from the paper's list-scheduling heuristic
  (:mod:`~megapp.pipeline_parallel.zero_bubble_greedy`).
- :func:`zb_v` (two chunks per rank in V placement) and :func:`dualpipev`
  (DeepSeek's DualPipe folded onto ``p`` ranks) are the published
  constructions, phase by phase.

A schedule's ``W`` keeps alive what the weight gradients need (the inputs of the
weight matmuls); :class:`~megapp.pipeline_parallel.simulate.CostModel`'s
``weight_grad_memory`` says how much that is.
"""

from __future__ import annotations

from collections import defaultdict, deque

from megapp.pipeline_parallel.schedules import (
    Action,
    MicrobatchCountError,
    Op,
    Schedule,
    check_sizes,
    interleaved_order,
    v_placement,
)

F, B, I, W = Op.FORWARD, Op.BACKWARD, Op.INPUT_GRAD, Op.WEIGHT_GRAD


def zb_h1(num_stages: int, num_microbatches: int, num_chunks: int = 1) -> Schedule:
    """ZB-H1: 1F1B (interleaved 1F1B with several chunks) with every backward split and
    each rank's weight gradients held back to fill its drain.

    Microbatches go through the chunks in groups of ``g`` as in interleaved 1F1B
    (:func:`~megapp.pipeline_parallel.schedules.interleaved_order`).
    Rank ``r`` runs ``(v - 1) g + p - 1 - r`` warmup forwards, then steady (F, I) pairs,
    each followed by the oldest pending ``W`` once ``r`` pairs have run, then the
    remaining input gradients, each with a ``W``, then the rest of the ``W``. It holds
    what 1F1B holds (``p`` microbatches on rank 0 with one chunk); at equal forward,
    input-gradient and weight-gradient times the bubble is about a third of 1F1B's.
    The order of torch.distributed.pipelining's interleaved zero-bubble schedule.
    """
    check_sizes(num_stages, num_microbatches, num_chunks)
    p, m, v = num_stages, num_microbatches, num_chunks
    if v == 1:
        g, order = m, [(mb, 0) for mb in range(m)]
    else:
        if m < p:
            raise MicrobatchCountError(
                f"zb-h1 with {v} chunks needs at least as many microbatches as pipeline "
                f"stages ({p}), got {m}"
            )
        g, order = interleaved_order("zb-h1", p, m, v)
    total = m * v
    per_rank = []
    for r in range(p):
        warmup = min((v - 1) * g + p - 1 - r, total)
        c = _Counter()

        for k in range(warmup):
            c.add(F, order[k][1])
        for k in range(warmup, total + warmup):
            if k < total:
                c.add(F, order[k][1])
            c.add(I, v - 1 - order[k - warmup][1])
            if k - warmup >= r:
                c.add_weight()
        while c.weights:
            c.add_weight()
        per_rank.append(tuple(c.actions))
    return Schedule("zb-h1", p, m, v, tuple(per_rank))


class _Counter:
    """Appends actions to one rank's list, numbering microbatches per (op, chunk)."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.count: dict[tuple[Op, int], int] = defaultdict(int)
        self.weights: deque[Action] = deque()  # W of each I, in order

    def add(self, op: Op, chunk: int) -> None:
        key = (I if op is B else op, chunk)
        action = Action(op, self.count[key], chunk)
        self.count[key] += 1
        self.actions.append(action)
        if op is I:
            self.weights.append(Action(W, action.microbatch, chunk))

    def add_weight(self) -> None:
        if self.weights:
            self.actions.append(self.weights.popleft())


def check_v_chunks(name: str, num_chunks: int) -> None:
    """A V places two model chunks on every rank."""
    if num_chunks != 2:
        raise ValueError(
            f"{name} places two model chunks on every rank in a V; got num_chunks={num_chunks}"
        )


def zb_v(num_stages: int, num_microbatches: int, num_chunks: int = 2) -> Schedule:
    """ZB-V: two chunks per rank in V placement, zero bubble at 1F1B's activation memory
    when forward, input-gradient and weight-gradient times are equal.

    Rank ``r``: ``2(p - r) - 1`` forwards of chunk 0; ``r`` pairs (F chunk 1, F chunk 0);
    ``p - r`` triples (F, I, W) of chunk 1; then steady (F, I, W) of chunk 0 and of
    chunk 1 in turn; then ``r`` pairs of input gradients with their ``W`` deferred, and
    ``p - r`` (I, W) of chunk 0; the deferred ``W`` last. Built for
    ``max(m, 2p - 1)`` microbatches, the ones beyond ``m`` left out.
    """
    check_sizes(num_stages, num_microbatches, num_chunks)
    check_v_chunks("zb-v", num_chunks)
    p, m = num_stages, num_microbatches
    n = max(m, 2 * p - 1)
    per_rank = []
    for r in range(p):
        c = _Counter()
        for _ in range(2 * (p - r) - 1):
            c.add(F, 0)
        for _ in range(r):
            c.add(F, 1)
            c.add(F, 0)
        for _ in range(p - r):
            for op in (F, I, W):
                c.add(op, 1)
        while c.count[(F, 1)] < c.count[(F, 0)] or c.count[(F, 0)] < n:
            if c.count[(F, 0)] < n:
                c.add(F, 0)
            c.add(I, 0)
            c.add(W, 0)
            for op in (F, I, W):
                c.add(op, 1)
        deferred = {0: c.count[(W, 0)], 1: c.count[(W, 1)]}
        for _ in range(r):
            c.add(I, 0)
            c.add(I, 1)
        for _ in range(p - r):
            c.add(I, 0)
            c.actions.append(Action(W, deferred[0], 0))
            deferred[0] += 1
        for chunk in (1, 0):
            while deferred[chunk] < c.count[(I, chunk)]:
                c.actions.append(Action(W, deferred[chunk], chunk))
                deferred[chunk] += 1
        per_rank.append(tuple(a for a in c.actions if a.microbatch < m))
    return Schedule("zb-v", p, m, 2, tuple(per_rank), placement=v_placement(p))


def dualpipev(num_stages: int, num_microbatches: int, num_chunks: int = 2) -> Schedule:
    """DualPipeV: DeepSeek's bidirectional DualPipe folded onto ``p`` ranks in a V.

    After a warmup of ``2(p - r - 1)`` forwards of chunk 0 and ``r + 1`` pairs, the
    steady state runs a forward of one chunk next to a whole backward of the other
    (the pairs DualPipe overlaps with expert-parallel communication; here they run
    one after the other); the last ``r + 1`` backwards on each rank split into ``I``
    and ``W`` to fill the drain. Needs ``m >= 2p``.
    """
    check_sizes(num_stages, num_microbatches, num_chunks)
    check_v_chunks("dualpipev", num_chunks)
    p, m = num_stages, num_microbatches
    if m < 2 * p:
        raise MicrobatchCountError(
            f"dualpipev needs at least 2p = {2 * p} microbatches (two per virtual stage's "
            f"worth of warmup), got {m}"
        )
    per_rank = []
    for r in range(p):
        c = _Counter()
        for _ in range(2 * (p - r - 1)):
            c.add(F, 0)
        for _ in range(r + 1):
            c.add(F, 0)
            c.add(F, 1)
        for _ in range(p - r - 1):
            c.add(I, 1)
            c.add_weight()
            c.add(F, 1)
        for _ in range(m - 2 * p + r + 1):
            for forward, backward in ((0, 1), (1, 0)):
                c.add(F, forward)
                c.add(B, backward)
        for _ in range(p - r - 1):
            c.add(B, 1)
            c.add(F, 1)
            c.add(B, 0)
        split = False
        for i in range(r + 1):
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            c.add(I if split else B, 1)
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            c.add(I if split else B, 0)
        for _ in range(p - r - 1):
            c.add_weight()
            c.add(I if split else B, 0)
        while c.weights:
            c.add_weight()
        per_rank.append(tuple(c.actions))
    return Schedule("dualpipev", p, m, 2, tuple(per_rank), placement=v_placement(p))
